"""``prepfuse.models.dsv4_indexer``: every spelling computes the fp8 indexer op's bytes.

Eagerly on the CPU, fresh random inputs, all slots valid: each spelling's q codes, folded
weights and cache bytes equal ``dsv4_indexer_rope_fp8_insert_reference``'s bit for bit
(no sums anywhere, so no tolerance); each look-alike differs somewhere, on inputs built to
show its difference. This is what lets the pass replace model code by the op.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.models.dsv4_indexer import (
    INDEXER_LOOKALIKES,
    INDEXER_SPELLINGS,
    indexer_fp8_cache,
    indexer_k_insert,
    indexer_q_prep,
)
from prepfuse.ops import dsv4_indexer_rope_fp8_insert_reference
from prepfuse.testing import compare_dsv4_indexer, make_dsv4_indexer_inputs


def model_outputs(inputs, spelling):
    """The op's outputs as the model code computes them, into fresh poisoned buffers."""
    out = inputs.fresh_outputs()
    q_fp8, w = indexer_q_prep(out.q, out.weights, out.positions, out.cos_sin_cache, out.weights_scale, spelling)
    out.q_out.copy_(q_fp8)
    out.weights_out.copy_(w)
    indexer_k_insert(out.k, out.k_cache, out.slot_mapping, out.k_positions, out.cos_sin_cache, out.block_size, spelling)
    return out


def reference_outputs(inputs):
    out = inputs.fresh_outputs()
    dsv4_indexer_rope_fp8_insert_reference(*out.args())
    return out


def inputs_for(num_tokens, num_heads, block_size, **options):
    inputs = make_dsv4_indexer_inputs("fp8", num_tokens, num_heads, block_size, "cpu", skip_fraction=0.0, **options)
    # the model's cache helper (block rows exactly block_size * 132 bytes, rounded to 64)
    return dataclasses.replace(inputs, k_cache=indexer_fp8_cache(inputs.k_cache.shape[0], block_size))


@pytest.mark.parametrize("spelling", [pytest.param(s, id=s.name) for s in INDEXER_SPELLINGS])
@pytest.mark.parametrize("shape", [(7, 3, 16, 5, 5), (33, 64, 64, 9, 6)], ids=["T7-H3-bs16", "T33-H64-bs64-Tk'6"])
def test_spelling_is_the_op(spelling, shape):
    num_tokens, num_heads, block_size, num_k, inserted = shape
    inputs = inputs_for(num_tokens, num_heads, block_size, num_k=num_k, num_inserted=inserted)
    diffs = compare_dsv4_indexer(reference_outputs(inputs), model_outputs(inputs, spelling))
    assert not any(diffs.values()), diffs


@pytest.mark.parametrize("spelling", [pytest.param(s, id=s.name) for s in INDEXER_LOOKALIKES])
def test_lookalike_differs(spelling):
    # 40 x 128 key values: the bf16 round trip changes some e4m3 code among them (~1 in 70)
    inputs = inputs_for(7, 3, 16, num_k=40)
    if spelling.amax_floor != 1e-4:  # differs only for rows whose amax is below the floor
        inputs.q[0, 0] = (torch.randn(128) * 1e-6).to(torch.bfloat16)
        inputs.k[0] = (torch.randn(128) * 1e-6).to(torch.bfloat16)
    diffs = compare_dsv4_indexer(reference_outputs(inputs), model_outputs(inputs, spelling))
    assert diffs["q_out"] > 0 and diffs["k_cache"] > 0, diffs
