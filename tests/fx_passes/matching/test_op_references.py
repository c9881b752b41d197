"""Engine ops read through a plain-PyTorch reference (``matching/op_references.py``).

A toy engine stands for vLLM's IR: its ``prepfuse_toy_ir::rms_norm(x, weight, epsilon)`` is
one opaque node, as ``vllm_ir::rms_norm`` reaches the post-grad graph. Declared with its
reference (for the op, or for its namespace by a finder), the q/k norms inside it fuse with
the RoPE and the cache writes; undeclared, nothing fuses and the op stays; declared where
nothing fuses, the graph keeps the op itself, none of the traced steps.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.matching.op_references import (
    register_reference, register_reference_finder, unregister_reference,
)
from prepfuse.models.gqa import GqaSpelling, cos_sin, gqa_prep, kv_cache, rope, split_qkv
from prepfuse.testing import make_gqa_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, HQ, HKV, D, BLOCK, EPS = 7, 4, 2, 64, 16, 1e-6
SPELLING = GqaSpelling("toy-ir", norm="hf", rope="halves")

_LIB = torch.library.Library("prepfuse_toy_ir", "DEF")  # lives as long as the test module
_LIB.define("rms_norm(Tensor x, Tensor? weight, float epsilon) -> Tensor")


def native_rms_norm(x, weight, epsilon):
    """The engine's own PyTorch form of its op: fp32 norm, rounded, times the weight."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return normed.to(x.dtype) * weight if weight is not None else normed.to(x.dtype)


def _kernel(x, weight, epsilon):
    """The op's kernel: the same values, computed in a way no pass reads (a stand-in for a
    compiled kernel)."""
    return native_rms_norm(x.clone(), weight, epsilon)


_LIB.impl("rms_norm", _kernel, "CompositeExplicitAutograd")
torch.library.register_fake("prepfuse_toy_ir::rms_norm", lambda x, weight, epsilon: torch.empty_like(x), lib=_LIB)
RMS_NORM = torch.ops.prepfuse_toy_ir.rms_norm.default


class EngineNorm(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        weight = 1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(seed))
        self.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return RMS_NORM(x, self.weight, EPS)


Q_NORM, K_NORM = EngineNorm(0), EngineNorm(1)


def prep(qkv, k_cache, v_cache, slots, positions, table):
    return gqa_prep(qkv, Q_NORM, K_NORM, k_cache, v_cache, slots, positions, table, None, HQ, HKV, SPELLING)


def norm_only(qkv, k_cache, v_cache, slots, positions, table):
    """The engine's norm and nothing a call could fuse: k normed, never written."""
    q, k, _ = split_qkv(qkv, HQ, HKV, D, SPELLING)
    return rope(Q_NORM(q), *cos_sin(table, positions), SPELLING), K_NORM(k)


@pytest.fixture
def declared(request):
    """The reference declared for the op, or through its namespace's finder."""
    if request.param == "op":
        register_reference(RMS_NORM, native_rms_norm)
    else:
        register_reference_finder("prepfuse_toy_ir", lambda op: native_rms_norm if op is RMS_NORM else None)
    yield
    unregister_reference(RMS_NORM)
    unregister_reference("prepfuse_toy_ir")


def run(fn, dynamic=False):
    """``fn`` compiled with prepfuse's backend beside eager on fresh caches: (compiled out,
    eager out, compiled caches, eager caches, the report)."""
    inputs = make_gqa_inputs(T, HQ, HKV, D, BLOCK, "cpu", skip_fraction=0.0)
    caches = [[kv_cache(inputs.k_cache.shape[0], BLOCK, HKV, D, SPELLING, "cpu") for _ in range(2)] for _ in range(2)]
    args = (inputs.qkv, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    if dynamic:  # a token count the graph does not fix, as an engine compiles for every batch size
        for t in args[:3]:
            torch._dynamo.mark_dynamic(t, 0)
    backend = PrepfuseBackend({"record_graphs": True})
    out = torch.compile(fn, backend=backend, fullgraph=True)(args[0], *caches[0], *args[1:])
    ref = fn(args[0], *caches[1], *args[1:])
    (report,) = backend.reports
    return out, ref, caches[0], caches[1], report


@pytest.mark.parametrize("declared", ["op", "namespace"], indirect=True)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-tokens"])
def test_an_engine_norm_read_through_its_reference_fuses(declared, dynamic):
    out, ref, got, want, report = run(prep, dynamic)
    assert report.matched_counts["fuse_gqa_prep"] == 1, report.format(verbose=True)
    assert str(RMS_NORM) not in report.graph and not report.opaque_ops  # both norms inside the fused call
    assert torch.equal(out, ref)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_an_engine_norm_without_a_reference_is_opaque_and_named():
    out, ref, got, want, report = run(prep)
    assert report.matched_counts["fuse_gqa_prep"] == 0
    assert report.graph.count(f"{RMS_NORM}(") == 2
    assert report.opaque_ops == {"prepfuse_toy_ir.rms_norm.default": 2}, report.opaque_ops
    assert "engine ops read as one opaque step: prepfuse_toy_ir.rms_norm.default x2" in report.format()


@pytest.mark.parametrize("declared", ["op"], indirect=True)
def test_where_nothing_fuses_the_engine_op_is_put_back(declared):
    """No cache write: the traced norms go, the engine's op comes back in each place, and
    the compiled values are its kernel's."""
    out, ref, _, _, report = run(norm_only)
    assert report.matched_counts["fuse_gqa_prep"] == 0
    assert report.graph.count(f"{RMS_NORM}(") == 2 and "rsqrt" not in report.graph, report.graph
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, atol=2**-6, rtol=2**-6)


def test_an_op_that_writes_an_argument_takes_no_reference():
    with pytest.raises(ValueError, match="writes an argument"):
        register_reference(torch.ops.aten.add_.Tensor, lambda x, y: x + y)
