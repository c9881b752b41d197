"""One token (a decode step of one sequence) in every family's example block: every layer fuses,
compiled with static sizes and under ``dynamic=True`` (where Dynamo gives a size of 1 its own
graph), and the caches and prepared q are eager's within each family's bound.

At one token Inductor writes the example blocks' attention-like consumer (``einsum`` of q
against v, then ``.float()``) as a product and a sum, the widening moved before them: the
prepared q is the bf16 node before that widening, and the product with v is attention, not
a step of q's preparation (``matching/axes.py``).
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.models.dsv4_indexer_block import Dsv4IndexerBlock, indexer_cache
from prepfuse.models.gqa import EXAMPLE_MODELS, GqaAttentionBlock
from prepfuse.testing import make_dsv4_indexer_inputs, make_dsv4_inputs
from tests.fx_passes.fusion.test_dsv4 import _assert_layer_caches_close
from tests.fx_passes.fusion.test_dsv4_indexer_dynamic import assert_block_is_eager
from tests.fx_passes.fusion.test_gqa_dynamic import DIM, HKV, HQ, D
from tests.fx_passes.fusion.test_gqa_dynamic import _call as gqa_call

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
MODES = {"static": None, "dynamic=True": True}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("title", list(EXAMPLE_MODELS))
@torch._dynamo.config.patch(specialize_float=True)
def test_gqa_example_block(title, mode):
    spelling = EXAMPLE_MODELS[title]
    block = GqaAttentionBlock(2, DIM, HQ, HKV, D, spelling=spelling)
    backend = PrepfuseBackend({"strict": True})
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=MODES[mode])
    caches, ref, slots = gqa_call(compiled, block, spelling, 1)
    assert all(r.matched_counts.get("fuse_gqa_prep") == 2 for r in backend.reports), backend.reports.format(verbose=True)
    for got, want in zip((c for p in caches for c in p), (c for p in ref for c in p)):
        rows, want_rows = got.flatten(0, 1)[slots].float(), want.flatten(0, 1)[slots].float()
        tol = 2**-3 if got.dtype == torch.float8_e4m3fn else 2**-5
        assert ((rows - want_rows).abs() <= tol * want_rows.abs().amax(-1, keepdim=True) + 2**-9).all()


@pytest.mark.parametrize("mode", list(MODES))
@torch._dynamo.config.patch(specialize_float=True)
def test_dsv4_example_block(mode):
    block = Dsv4AttentionBlock(num_layers=2, num_heads=3, padded_heads=8, block_size=16, spelling=DSV4_SPELLINGS[4])
    inputs = make_dsv4_inputs(1, 3, 8, 16, "cpu", skip_fraction=0.0)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    args = (inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
    caches = [fp8_ds_mla_cache(5, 16) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    backend = PrepfuseBackend({"strict": True})
    out = torch.compile(block, backend=backend, fullgraph=True, dynamic=MODES[mode])(x, *args, caches)
    torch.testing.assert_close(out, block(x, *args, ref_caches), atol=0.1, rtol=0.05)
    assert backend.reports.pattern_counts().get("dsv4_q+kv") == 2, backend.reports.format(verbose=True)
    _assert_layer_caches_close(caches, ref_caches, inputs.slot_mapping)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@torch._dynamo.config.patch(specialize_float=True)
def test_indexer_example_block(fmt, mode):
    block = Dsv4IndexerBlock(fmt)
    inputs = make_dsv4_indexer_inputs(fmt, 1, 4, 16, "cpu", num_k=1, skip_fraction=0.0)
    caches = [indexer_cache(fmt, inputs.k_cache.shape[0], 16) for _ in range(2)]
    eager = [c.clone() for c in caches]
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    backend = PrepfuseBackend({"strict": True, "output_buffers": "graph"})
    got = torch.compile(block, backend=backend, fullgraph=True, dynamic=MODES[mode])(x, caches, *rest)
    want = block(x, eager, *rest)
    pattern = "dsv4_indexer_q+k" if fmt == "fp8" else "dsv4_indexer_mxfp4_q+k"
    assert backend.reports.pattern_counts().get(pattern) == 2, backend.reports.format(verbose=True)
    assert_block_is_eager(got, want, caches, eager)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_indexer_runtime_floats_are_declined_by_name(fmt):
    """``dynamic=True`` without ``specialize_float``: the block's weights scale and the fp8
    range reach the graph as 0-d inputs, which the op takes as numbers; both sides decline
    naming the line and the setting."""
    block = Dsv4IndexerBlock(fmt)
    inputs = make_dsv4_indexer_inputs(fmt, 5, 4, 16, "cpu", num_k=5, skip_fraction=0.0)
    caches = [indexer_cache(fmt, inputs.k_cache.shape[0], 16) for _ in range(2)]
    backend = PrepfuseBackend()
    torch.compile(block, backend=backend, fullgraph=True, dynamic=True)(
        torch.randn(5, 64).to(torch.bfloat16), caches, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    assert not backend.reports.pattern_counts()
    pass_name = "fuse_dsv4_indexer_prep" if fmt == "fp8" else "fuse_dsv4_indexer_mxfp4_prep"
    whys = [r.why for r in backend.reports.near_misses(pass_name)]
    assert whys and all("specialize_float" in w and "dsv4_indexer" in w for w in whys), whys
