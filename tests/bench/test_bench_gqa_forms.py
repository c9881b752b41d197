"""``bench_gqa_qknorm_rope_kv_insert.py``'s operand forms without a GPU: each row the benchmark
times beside the form it extends (int32 indices, wrapped negative indices, v's own scale, one
kv head, partial rotary, uint8 caches) makes inputs whose fused call passes the benchmark's own gate against
the reference (under the Triton interpreter), and the gate fails a call with the operand dropped."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.skipif(not (has_triton() and triton_interpret_mode()),
                                reason="needs triton under TRITON_INTERPRET=1")
FORMS = ("qwen3-8b-int32", "qwen3-8b-wrap", "qwen3-8b-fp8-v-scale", "qwen3-8b-fp8-uint8", "qwen3-8b-one-kv-head",
         "qwen3-8b-partial")


@pytest.fixture
def on_cpu(monkeypatch):
    import bench_gqa_qknorm_rope_kv_insert as bench
    import harness

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return bench


@pytest.mark.parametrize("name", FORMS)
def test_form_passes_the_gate(on_cpu, name):
    bench = on_cpu
    model = bench.MODELS[name]
    inputs = bench.make_inputs(3, model, skip_fraction=0.1)
    fused = bench.make_impls(["fused"])["fused"]
    correct, comparison = bench._gate(fused, inputs, model)
    assert correct, comparison
    form = bench.operand_form(model)
    if form == "int32":
        assert inputs.slot_mapping.dtype == inputs.positions.dtype == torch.int32
    if form == "wrap":
        assert inputs.wrap_indices and (inputs.slot_mapping < 0).any() and (inputs.positions < 0).any()
    if form == "v-scale":
        assert inputs.v_scale is not None and not torch.equal(inputs.v_scale, inputs.kv_scale)


def test_gate_fails_without_v_scale(on_cpu):
    """The reference scales v by v_scale, the call by kv_scale: the gate must notice."""
    bench = on_cpu
    model = bench.MODELS["qwen3-8b-fp8-v-scale"]
    inputs = bench.make_inputs(3, model, skip_fraction=0.0)
    fused = bench.make_impls(["fused"])["fused"]
    correct, _ = bench._gate(lambda inp: fused(dataclasses.replace(inp, v_scale=None)), inputs, model)
    assert not correct


def test_wrapped_indices_need_wrap_indices(on_cpu):
    """Without wrap_indices the op refuses the negative positions, naming them."""
    bench = on_cpu
    inputs = bench.make_inputs(3, bench.MODELS["qwen3-8b-wrap"], skip_fraction=0.0)
    fused = bench.make_impls(["fused"])["fused"]
    with pytest.raises(ValueError, match="positions"):
        fused(dataclasses.replace(inputs, wrap_indices=False))
