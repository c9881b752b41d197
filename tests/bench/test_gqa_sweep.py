"""``bench_gqa_qknorm_rope_kv_insert.py --sweep-config`` without a GPU: each swept configuration,
eviction hints included, is launched on its own inputs and gated against the reference (under
the Triton interpreter; the harness's CUDA-graph capture and timing replaced by plain calls),
and only the op's own choice with its own hints is marked as the heuristic row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.skipif(not (has_triton() and triton_interpret_mode()),
                                reason="needs triton under TRITON_INTERPRET=1")


def test_sweep_gates_every_eviction_hint(monkeypatch, tmp_path):
    import bench_gqa_qknorm_rope_kv_insert as bench
    import harness

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "spin_up_clocks", lambda: None)
    monkeypatch.setattr(harness, "device_info", lambda: {"device_slug": "cpu", "l2_bytes": 50 << 20})
    # each "graph" one call of the configuration on one input set; each "timing" runs them
    monkeypatch.setattr(harness, "capture_graphs", lambda fn, copies, warmup=2: [lambda c=c: fn(c) for c in copies])
    monkeypatch.setattr(harness, "time_graphs", lambda graphs, *a: [g() for g in graphs] and {"us_median": 1.0})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = argparse.Namespace(out_dir=str(tmp_path), name_suffix="_cpu", models=["qwen3-8b"],
                              tokens=[2], sweep_block_h=[1], sweep_warps=[1], sweep_tokens=[1], sweep_maxnreg=[0],
                              sweep_eviction=["rule", "none", "loads", "stores", "both"], target_ms=1)
    data = bench.run_sweep(args)
    rows = data["rows"]
    assert [(r["model"], r["eviction"]) for r in rows] == [
        (m, e) for m in args.models for e in args.sweep_eviction]
    assert all(r.get("correct") and "error" not in r for r in rows), rows
    # T=2 takes one head on one warp (_launch_config): the rule's row is the heuristic, only it
    assert [r["eviction"] for r in rows if r["heuristic"]] == ["rule"]
