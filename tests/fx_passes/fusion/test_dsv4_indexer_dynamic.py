"""Dynamic token counts on the DeepSeek-V4 indexer's example (two layers of the demo's
preparation, fp8 cache): with the token dims marked dynamic (``mark_dynamic`` on q, the
weights, k, the slots and the positions), one graph serves every token count, both layers
fuse into the indexer op, no recompile (``fail_on_recompile``), and every cache byte is
eager's. Under ``dynamic=True`` Dynamo makes the q and k widths symbolic too (they are graph
inputs here, not a module's weights), and the rewrite declines: the op's head dims are
constants, and a pass adds no guard."""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.demo.dsv4_indexer import indexer_layers
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
