"""The pages' T=1 target line (``harness.decode_target_note``): each op's T=1 median against
one tiny kernel in a graph timed in the same run, plus 0.5 us, and no verdict where the run
did not time that kernel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402


def _row(model, us, impl="fused", t=1):
    return {"model": model, "impl": impl, "T": t, "us_median": us}


def test_rows_within_and_over_the_floor_plus_half_a_microsecond():
    rows = [_row("llama3-8b", 1.56), _row("qwen3-8b", 1.68), _row("qwen3-8b-fp8", 1.83),
            # not T=1 fused medians: never judged
            _row("qwen3-8b", 1.10, impl="compile"), _row("qwen3-8b", 29.2, t=4096), {"model": "x", "impl": "fused",
                                                                                    "T": 1, "error": "failed"}]
    data = {"tiny_graph": {"us_median": 1.15}, "rows": rows}
    note = harness.decode_target_note(data, "model", ["llama3-8b", "qwen3-8b", "qwen3-8b-fp8", "x"])
    assert note == ("- **T=1 target** (one tiny kernel in a graph, this run: 1.15 us, + 0.5: <= 1.65 us): "
                    "llama3-8b 1.56 us (yes); qwen3-8b 1.68 us (no, +0.03); qwen3-8b-fp8 1.83 us (no, +0.18)")


def test_a_run_without_the_floor_is_not_judged():
    note = harness.decode_target_note({"rows": [_row("qwen3-8b", 1.68)]}, "model", ["qwen3-8b"])
    assert "not judged" in note and "1.68" not in note


def test_the_gqa_page_carries_the_line():
    import bench_gqa_qknorm_rope_kv_insert as gqa

    data = json.loads((BENCH / "results" / "gqa_qknorm_rope_kv_insert_nvidia-h200.json").read_text())
    data.pop("tiny_graph", None)
    assert "not judged" in gqa.render_markdown(data, "x.json", "x.png")
    fused_t1 = next(r["us_median"] for r in data["rows"]
                    if (r["model"], r["impl"], r["T"]) == ("qwen3-8b", "fused", 1))
    page = gqa.render_markdown({**data, "tiny_graph": {"us_median": fused_t1 - 0.45}}, "x.json", "x.png")
    assert f"qwen3-8b {fused_t1:.2f} us (yes)" in page
