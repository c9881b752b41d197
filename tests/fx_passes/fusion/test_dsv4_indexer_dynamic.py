"""Dynamic token counts on the DeepSeek-V4 indexer's example (two layers of the demo's
preparation, fp8 cache): with the token dims marked dynamic (``mark_dynamic`` on q, the
weights, k, the slots and the positions), one graph serves every token count, both layers
fuse into the indexer op, no recompile (``fail_on_recompile``), and every cache byte is
eager's. Under ``dynamic=True`` Dynamo makes the q and k widths symbolic too (they are graph
inputs here, not a module's weights), and the rewrite declines: the op's head dims are
constants, and a pass adds no guard. The indexer as a model holds it
(``models.dsv4_indexer_block``, projections from the hidden state) fuses under
``dynamic=True`` in both formats."""

from __future__ import annotations

import contextlib

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.demo.dsv4_indexer import indexer_layers
from prepfuse.models.dsv4_indexer_block import Dsv4IndexerBlock, indexer_cache
from prepfuse.models.dsv4_indexer import indexer_fp8_cache
from prepfuse.testing import make_dsv4_indexer_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
HEADS, BLOCK, LAYERS = 4, 16, 2


def _run(compiled, step, tokens: int, dynamic_tokens: bool) -> int:
    """Cache bytes where the compiled step and eager differ, for ``tokens`` tokens."""
    layers = [make_dsv4_indexer_inputs("fp8", tokens, HEADS, BLOCK, "cpu", num_k=max(2, tokens // 2),
                                       skip_fraction=0.0) for _ in range(LAYERS)]
    inputs = layers[0]
    caches = [indexer_fp8_cache(inputs.k_cache.shape[0], BLOCK, "cpu") for _ in range(LAYERS)]
    eager = [c.clone() for c in caches]
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    per_layer = ([x.q for x in layers], [x.weights for x in layers], [x.k for x in layers])
    if dynamic_tokens:
        for t in (*per_layer[0], *per_layer[1], *per_layer[2], *rest[:3]):
            torch._dynamo.mark_dynamic(t, 0)
    compiled(*per_layer, caches, *rest)
    step(*per_layer, eager, *rest)
    return sum(int((c != e).sum()) for c, e in zip(caches, eager))


def _step():
    weights_scale = make_dsv4_indexer_inputs("fp8", 7, HEADS, BLOCK, "cpu", num_k=2, skip_fraction=0.0).weights_scale
    return indexer_layers(LAYERS, weights_scale, BLOCK)


@torch._inductor.config.patch(fx_graph_cache=False)
def test_marked_token_dims_fuse_for_every_token_count():
    step, backend = _step(), PrepfuseBackend()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    assert _run(compiled, step, 7, dynamic_tokens=True) == 0
    assert backend.reports.pattern_counts().get("dsv4_indexer_q+k") == LAYERS, backend.reports.format(verbose=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        for tokens in (5, 9, 17):
            assert _run(compiled, step, tokens, dynamic_tokens=True) == 0, tokens
    assert len(backend.reports) == 1


@torch._dynamo.config.patch(specialize_float=True)
@torch._inductor.config.patch(fx_graph_cache=False)
def test_dynamic_true_makes_the_head_dims_symbolic_and_declines_by_name():
    step, backend = _step(), PrepfuseBackend()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    _run(compiled, step, 7, dynamic_tokens=False)  # the unfused code: Inductor's, not byte-checked here
    assert not backend.reports.pattern_counts().get("dsv4_indexer_q+k")
    whys = [r.why for r in backend.reports.near_misses("fuse_dsv4_indexer_prep")]
    assert whys and all("[Tk, 128]" in w for w in whys), whys


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@torch._dynamo.config.patch(specialize_float=True)
@torch._inductor.config.patch(fx_graph_cache=False)
def test_dynamic_true_fuses_the_example_block(fmt):
    """The indexer as a model holds it (``models.dsv4_indexer_block``: q, k and the head weights
    projected from the hidden state, so their widths are the weights'): under ``dynamic=True``
    both layers fuse in one graph for T = 7, 9 and 13 under ``fail_on_recompile``, q, the
    weights and every cache byte eager's."""
    block, backend = Dsv4IndexerBlock(fmt, num_layers=LAYERS, num_heads=HEADS, block_size=BLOCK), \
        PrepfuseBackend({"strict": True, "output_buffers": "graph"})
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for tokens in (7, 9, 13):
        inputs = make_dsv4_indexer_inputs(fmt, tokens, HEADS, BLOCK, "cpu", num_k=tokens, skip_fraction=0.0)
        caches = [indexer_cache(fmt, inputs.k_cache.shape[0], BLOCK) for _ in range(LAYERS)]
        eager = [c.clone() for c in caches]
        x = (torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))).to(torch.bfloat16)
        rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
        with torch.compiler.set_stance("fail_on_recompile") if tokens != 7 else contextlib.nullcontext():
            got = compiled(x, caches, *rest)
        want = block(x, eager, *rest)
        assert_block_is_eager(got, want, caches, eager, context=(fmt, tokens))
    pattern = "dsv4_indexer_q+k" if fmt == "fp8" else "dsv4_indexer_mxfp4_q+k"
    assert backend.reports.pattern_counts().get(pattern) == LAYERS, backend.reports.format(verbose=True)
    assert len(backend.reports) == 1


def assert_block_is_eager(got, want, caches, eager, context=None) -> None:
    """Every layer's prepared outputs and cache byte for byte eager's (``Dsv4IndexerBlock``)."""
    for got_layer, want_layer in zip(got, want):
        for g, w in zip(got_layer, want_layer):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), context
    assert all(torch.equal(c, e) for c, e in zip(caches, eager)), context
