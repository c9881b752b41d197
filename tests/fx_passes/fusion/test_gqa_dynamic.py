"""``torch.compile(dynamic=True)`` on the package's GQA example blocks
(``prepfuse.models.gqa.EXAMPLE_MODELS``): one graph for every token count past 1, both layers
fused, no recompile (``fail_on_recompile``), and the caches eager's. (Dynamo specializes a
size of 1 into a graph of its own: ``test_single_token.py``.) ``specialize_float`` is set for
the normed blocks: without it Dynamo makes the norms' eps a 0-d graph input, which the op
cannot take as its constant, and those graphs decline by name
(``tests/corpus/test_transformers.py::test_dynamic_true_eps_input_is_declined_by_name``); the
Llama-style block has no eps and fuses either way."""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.gqa import EXAMPLE_MODELS, GqaAttentionBlock, kv_cache
from prepfuse.testing import make_gqa_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
HQ, HKV, D, DIM, BLOCK = 4, 2, 64, 64, 16


def _call(compiled, block, spelling, t):
    inputs = make_gqa_inputs(t, HQ, HKV, D, BLOCK, "cpu", cache_dtype=spelling.cache_dtype, skip_fraction=0.0,
                             spare_slots=64 - t)
    x = (torch.randn(t, DIM, generator=torch.Generator().manual_seed(t)) * 0.5).to(torch.bfloat16)
    caches = [tuple(kv_cache(inputs.k_cache.shape[0], BLOCK, HKV, D, spelling, "cpu") for _ in range(2))
              for _ in range(2)]
    ref = [tuple(c.clone() for c in pair) for pair in caches]
    args = (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
    with torch.no_grad():
        compiled(*args, caches, inputs.kv_scale)
        block(*args, ref, inputs.kv_scale)
    return caches, ref, inputs.slot_mapping


@pytest.mark.parametrize("title", list(EXAMPLE_MODELS))
@torch._dynamo.config.patch(specialize_float=True)
@torch._inductor.config.patch(fx_graph_cache=False)
def test_example_block_fuses_for_every_token_count(title):
    spelling = EXAMPLE_MODELS[title]
    block = GqaAttentionBlock(2, DIM, HQ, HKV, D, spelling=spelling)
    backend = PrepfuseBackend()
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    _call(compiled, block, spelling, 7)  # no size of 1 or 2 (kv heads: duck sizing would tie them)
    assert backend.reports and all(r.matched_counts.get("fuse_gqa_prep") == 2 for r in backend.reports), \
        backend.reports.format(verbose=True)
    graphs = len(backend.reports)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in (3, 5, 9, 17):
            caches, ref, slots = _call(compiled, block, spelling, t)
            for got, want in zip((c for p in caches for c in p), (c for p in ref for c in p)):
                rows, want_rows = got.flatten(0, 1)[slots].float(), want.flatten(0, 1)[slots].float()
                tol = 2**-3 if got.dtype == torch.float8_e4m3fn else 2**-5
                assert ((rows - want_rows).abs() <= tol * want_rows.abs().amax(-1, keepdim=True) + 2**-9).all(), t
    assert len(backend.reports) == graphs
