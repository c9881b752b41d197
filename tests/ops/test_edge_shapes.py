"""Every input the checks accept runs on every implementation: the edge shapes of each op,
enumerated, through its checked reference and its Triton kernel (under the CPU interpreter
here; on CUDA the kernel itself), which must agree as the op's own tests require.

The edges: no tokens, one token, no rows inserted, no q heads (the kv-only or k-only call
the passes emit; a full-row cache's too), q heads without padding, one kv head, block size 1, every head size,
rotary dims that are no power of two (44, 96 of 128) and the smallest one (2).
"""

from __future__ import annotations

import pytest
import torch

from prepfuse._compat import has_triton
from prepfuse.testing import (
    compare_dsv4, compare_dsv4_full_row, compare_dsv4_indexer, compare_gqa, make_dsv4_full_row_inputs,
    make_dsv4_indexer_inputs, make_dsv4_inputs, seeded_gqa_inputs, with_cache_layout,
)
from prepfuse.testing.impls import IMPLS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
FP8 = torch.float8_e4m3fn

# (T, H, padded heads, block size, rows inserted)
DSV4_EDGES = {
    "no-tokens": (0, 3, 8, 16, 0),
    "one-token": (1, 3, 8, 16, 1),
    "nothing-inserted": (5, 3, 8, 16, 0),
    "kv-only": (5, 0, 0, 16, 5),
    "unpadded": (5, 4, 4, 16, 5),
    "block-1": (5, 3, 8, 1, 5),
}

# (T, H, padded heads, block size, rows inserted, format)
DSV4_FULL_ROW_EDGES = {
    "no-tokens": (0, 3, 3, 16, 0, "bf16"),
    "one-token": (1, 3, 8, 16, 1, "fp8"),
    "nothing-inserted": (5, 3, 3, 16, 0, "fp8"),
    "kv-only": (5, 0, 0, 16, 5, "fp8"),
    "kv-only-bf16": (5, 0, 0, 16, 5, "bf16"),
    "block-1": (5, 3, 3, 1, 5, "bf16"),
}

# (T, Hq, Hkv, D, block size, rotary dim, is_neox, cache dtype, rows inserted)
GQA_EDGES = {
    "no-tokens": (0, 4, 2, 64, 16, None, True, torch.bfloat16, 0),
    "one-token": (1, 4, 2, 128, 16, None, True, torch.bfloat16, 1),
    "nothing-inserted": (5, 4, 2, 64, 16, None, True, FP8, 0),
    "one-kv-head": (5, 3, 1, 64, 16, None, False, torch.bfloat16, 5),
    "head-256": (3, 2, 1, 256, 16, None, True, FP8, 3),
    "block-1": (5, 4, 2, 64, 1, None, True, torch.bfloat16, 5),
    "rotary-2": (5, 4, 2, 64, 16, 2, True, torch.bfloat16, 5),
    "rotary-44-neox": (5, 4, 2, 128, 16, 44, True, torch.bfloat16, 5),
    "rotary-44-gptj-fp8": (5, 4, 2, 128, 16, 44, False, FP8, 5),
    "rotary-96-neox-fp8": (5, 4, 2, 128, 16, 96, True, FP8, 5),
    "rotary-96-gptj": (5, 4, 2, 128, 16, 96, False, torch.bfloat16, 5),
}

# (T, H, block size, key rows, rows inserted)
INDEXER_EDGES = {
    "no-tokens": (0, 3, 16, 4, 4),
    "no-keys": (5, 3, 16, 0, 0),
    "empty": (0, 3, 16, 0, 0),
    "one-token": (1, 1, 16, 1, 1),
    "k-only": (5, 0, 16, 4, 4),
    "nothing-inserted": (5, 3, 16, 4, 0),
    "block-1": (5, 3, 1, 4, 4),
}


def both(reference, kernel, inputs):
    expected, actual = inputs.fresh_outputs(), inputs.fresh_outputs()
    reference(*expected.args())
    kernel(*actual.args())
    return expected, actual


@pytest.mark.parametrize("edge", list(DSV4_EDGES))
def test_dsv4(edge):
    tokens, heads, padded, block, inserted = DSV4_EDGES[edge]
    inputs = make_dsv4_inputs(tokens, heads, padded, block, DEVICE, num_inserted=inserted)
    expected, actual = both(*IMPLS["dsv4"], inputs)
    comparison = compare_dsv4(expected, actual)
    assert comparison.within_spec(), comparison


@pytest.mark.parametrize("edge", list(DSV4_FULL_ROW_EDGES))
def test_dsv4_full_row(edge):
    tokens, heads, padded, block, inserted, fmt = DSV4_FULL_ROW_EDGES[edge]
    inputs = make_dsv4_full_row_inputs(tokens, heads, padded, block, DEVICE, fmt=fmt, num_inserted=inserted)
    expected, actual = both(*IMPLS["dsv4-full-row"], inputs)
    comparison = compare_dsv4_full_row(expected, actual)
    assert comparison.within_spec(), comparison


@pytest.mark.parametrize("edge", list(GQA_EDGES))
def test_gqa(edge):
    tokens, hq, hkv, head_dim, block, rotary, neox, cache_dtype, inserted = GQA_EDGES[edge]
    inputs, seed = seeded_gqa_inputs(tokens, hq, hkv, head_dim, block, DEVICE, rotary_dim=rotary, is_neox=neox,
                                    cache_dtype=cache_dtype, num_inserted=inserted)
    expected, actual = both(*IMPLS["gqa"], inputs)
    comparison = compare_gqa(expected, actual)
    assert comparison.exact(), f"seed={seed}: {comparison}"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("edge", list(INDEXER_EDGES))
def test_indexer(edge, fmt):
    tokens, heads, block, keys, inserted = INDEXER_EDGES[edge]
    inputs = make_dsv4_indexer_inputs(fmt, tokens, heads, block, DEVICE, num_k=keys, num_inserted=inserted)
    expected, actual = both(*IMPLS[f"indexer-{fmt}"], inputs)
    diffs = compare_dsv4_indexer(expected, actual)
    assert not any(diffs.values()), diffs


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["heads-first", "token-pool"])
def test_gqa_cache_layouts(layout, cache_dtype):
    """Caches in the layouts the pass writes through views (``fuse_gqa_prep``): heads first,
    ``[NB, Hkv, bs, D]`` as its ``[NB, bs, Hkv, D]`` permutation, and a flat token pool
    ``[N, Hkv, D]`` as ``[N, 1, Hkv, D]`` (block size 1): the kernel follows the strides, as
    the reference does."""
    inputs, seed = seeded_gqa_inputs(5, 4, 2, 64, 16, DEVICE, cache_dtype=cache_dtype, rotary_dim=44)
    inputs = with_cache_layout(inputs, layout)
    assert not inputs.k_cache.is_contiguous() or inputs.k_cache.shape[1] == 1  # the layout is not the paged one
    expected, actual = both(*IMPLS["gqa"], inputs)
    assert actual.k_cache.stride() == inputs.k_cache.stride()
    comparison = compare_gqa(expected, actual)
    assert comparison.exact(), f"seed={seed}: {comparison}"
