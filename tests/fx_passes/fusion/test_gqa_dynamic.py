"""``torch.compile(dynamic=True)`` on the package's GQA example blocks
(``prepfuse.models.gqa.EXAMPLE_MODELS``): one graph for every token count past 1, both layers
fused, no recompile (``fail_on_recompile``), and the caches eager's. (Dynamo specializes a
size of 1 into a graph of its own: ``test_single_token.py``.) Under torch's defaults
(``specialize_float`` off) Dynamo makes each norm's eps a 0-d graph input: the fused calls
read it when they run (the op's ``tensor_floats`` overload, q's and k's eps apart)."""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.matching import regions
from prepfuse.models.gqa import EXAMPLE_MODELS, GqaAttentionBlock, kv_cache
from prepfuse.testing import make_gqa_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
HQ, HKV, D, DIM, BLOCK = 4, 2, 64, 64, 16


def _call(compiled, block, spelling, t, device="cpu"):
    inputs = make_gqa_inputs(t, HQ, HKV, D, BLOCK, device, cache_dtype=spelling.cache_dtype, skip_fraction=0.0,
                             spare_slots=64 - t)
    x = (torch.randn(t, DIM, generator=torch.Generator().manual_seed(t)) * 0.5).to(torch.bfloat16).to(device)
    caches = [tuple(kv_cache(inputs.k_cache.shape[0], BLOCK, HKV, D, spelling, device) for _ in range(2))
              for _ in range(2)]
    ref = [tuple(c.clone() for c in pair) for pair in caches]
    args = (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
    with torch.no_grad():
        compiled(*args, caches, inputs.kv_scale)
        block(*args, ref, inputs.kv_scale)
    return caches, ref, inputs.slot_mapping


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("title", list(EXAMPLE_MODELS))
@torch._inductor.config.patch(fx_graph_cache=False)
def test_example_block_fuses_for_every_token_count(title, device):
    """Under torch's defaults: the norms' eps are graph inputs the fused calls read. Torch
    2.15 makes the fp8 range of ``clamp(-FP8_MAX, FP8_MAX)`` a graph input as well, a number
    the op holds fixed: there the fp8 block declines naming it, and fuses with
    ``specialize_float`` set."""
    spelling = EXAMPLE_MODELS[title]
    block = GqaAttentionBlock(2, DIM, HQ, HKV, D, spelling=spelling).to(device)
    backend = PrepfuseBackend()
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    _call(compiled, block, spelling, 7, device)  # no size of 1 or 2 (kv heads: duck sizing would tie them)
    specialize = torch._dynamo.config.patch(specialize_float=False)
    if spelling.cache_dtype == torch.float8_e4m3fn and not backend.reports.matches("fuse_gqa_prep"):
        whys = [r.why for r in backend.reports.near_misses("fuse_gqa_prep")]
        assert whys and all("FP8_MAX" in w and "specialize_float" in w for w in whys), whys
        torch._dynamo.reset()
        specialize = torch._dynamo.config.patch(specialize_float=True)
        backend = PrepfuseBackend()
        compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
        with specialize:
            _call(compiled, block, spelling, 7, device)
    assert backend.reports and all(r.matched_counts.get("fuse_gqa_prep") == 2 for r in backend.reports), \
        backend.reports.format(verbose=True)
    graphs = len(backend.reports)
    with torch.compiler.set_stance("fail_on_recompile"), specialize:
        for t in (3, 5, 9, 17, 64):
            caches, ref, slots = _call(compiled, block, spelling, t, device)
            for got, want in zip((c for p in caches for c in p), (c for p in ref for c in p)):
                rows, want_rows = got.flatten(0, 1)[slots].float(), want.flatten(0, 1)[slots].float()
                tol = 2**-3 if got.dtype == torch.float8_e4m3fn else 2**-5
                assert ((rows - want_rows).abs() <= tol * want_rows.abs().amax(-1, keepdim=True) + 2**-9).all(), t
    assert len(backend.reports) == graphs


@pytest.mark.gpu
@torch._inductor.config.patch({"fx_graph_cache": False, "triton.cudagraphs": True})
def test_under_inductor_cuda_graphs_a_run_time_eps_is_read_or_named():
    """Inductor's CUDA graphs on (``triton.cudagraphs``), dynamic=True defaults: the block runs
    equal to eager, and a layer that does not fuse declines naming CUDA graphs and
    ``specialize_float`` (Inductor copies 0-d CPU inputs to the device for a captured
    partition, where the op cannot read them). On an H100 (torch 2.11) both layers fused:
    the block writes its caches, inputs of the graph, so cudagraph trees skip the graph
    ("mutated inputs") and the eps inputs stay on the host."""
    spelling = EXAMPLE_MODELS["Qwen3-style (q/k RMSNorm, NeoX RoPE, bf16 cache)"]
    block = GqaAttentionBlock(2, DIM, HQ, HKV, D, spelling=spelling).to("cuda")
    backend = PrepfuseBackend()
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for t in (7, 9):
        caches, ref, slots = _call(compiled, block, spelling, t, "cuda")
        for got, want in zip((c for p in caches for c in p), (c for p in ref for c in p)):
            torch.testing.assert_close(got.flatten(0, 1)[slots].float(), want.flatten(0, 1)[slots].float(),
                                       atol=2**-6, rtol=2**-5)
    whys = [r.why for r in backend.reports.near_misses("fuse_gqa_prep")]
    assert all("CUDA graphs" in w and "specialize_float" in w for w in whys), backend.reports.format(verbose=True)
    assert len(backend.reports.matches("fuse_gqa_prep")) + len(whys) == 2 * len(backend.reports)


@torch._inductor.config.patch(fx_graph_cache=False)
def test_where_the_eps_input_moves_to_the_device_both_norms_decline_naming_it(monkeypatch):
    """Where Inductor would copy the 0-d eps inputs to the device (its CUDA graphs: the
    predicate ``regions.inductor_moves_floats``, made true here on the CPU), neither norm's
    eps is the call's operand: q's as k's, the decline names the setting, not a false
    "q_out differs"."""
    monkeypatch.setattr(regions, "inductor_moves_floats", lambda region: True)
    spelling = EXAMPLE_MODELS["Qwen3-style (q/k RMSNorm, NeoX RoPE, bf16 cache)"]
    block = GqaAttentionBlock(2, DIM, HQ, HKV, D, spelling=spelling)
    backend = PrepfuseBackend()
    _call(torch.compile(block, backend=backend, fullgraph=True, dynamic=True), block, spelling, 7)
    whys = [r.why for r in backend.reports.near_misses("fuse_gqa_prep")]
    assert len(whys) == 2 and all("CUDA graphs" in w and "specialize_float" in w for w in whys), \
        backend.reports.format(verbose=True)
