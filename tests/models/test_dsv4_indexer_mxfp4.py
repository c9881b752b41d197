"""``prepfuse.models.dsv4_indexer_mxfp4``: every spelling computes the MXFP4 indexer op's bytes.

Eagerly on the CPU, fresh random inputs plus planted hard values (every e2m1 tie, -0.0,
a block far below the fp8 floor), all slots valid: each spelling's packed q, scale bytes,
weights and cache bytes equal ``dsv4_indexer_rope_mxfp4_insert_reference``'s bit for bit
(no sums anywhere, so no tolerance); each look-alike differs somewhere on those inputs.
This is what lets the pass replace model code by the op.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.models.dsv4_indexer_mxfp4 import (
    MXFP4_LOOKALIKES,
    MXFP4_SPELLINGS,
    Mxfp4Spelling,
    e2m1_codes,
    indexer_k_insert,
    indexer_mxfp4_cache,
    indexer_q_prep,
)
from prepfuse.ops import dsv4_indexer_rope_mxfp4_insert_reference
from prepfuse.ops.dsv4_indexer_common import e2m1_codes_reference
from prepfuse.testing import compare_dsv4_indexer, make_dsv4_indexer_inputs

# every e2m1 value and midpoint (the ties), both signs, then -0.0: one block of 32, amax 6
# (so its scale is 2^0 and the values reach the rounding unscaled)
TIES_BLOCK = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.5, 3.0, 4.0, -0.25, -0.75, -1.25, -1.75,
              -2.5, -3.5, -5.0, -6.0, -0.5, 1.0, 2.0, -0.0, -0.0, 0.0, 0.1, -0.1, 5.5, -5.5, 0.0, -0.0]


def plant_hard_values(inputs):
    """Write the ties block and a block of ~1e-6 values (below an fp8-style 1e-4 floor) into
    the NoPE dims (not rotated) of q[0, 0], q[-1, -1] and k[0]; returns ``inputs``."""
    ties = torch.tensor(TIES_BLOCK, dtype=torch.bfloat16)
    tiny = (torch.randn(32) * 1e-6).to(torch.bfloat16)
    for row in (inputs.q[0, 0], inputs.q[-1, -1], inputs.k[0]):
        row[:32], row[32:64] = ties, tiny
    return inputs


def inputs_for(num_tokens, num_heads, block_size, **options):
    inputs = make_dsv4_indexer_inputs("mxfp4", num_tokens, num_heads, block_size, "cpu", skip_fraction=0.0, **options)
    # the model's cache helper (block rows exactly block_size * 68 bytes, rounded to 64)
    inputs = dataclasses.replace(inputs, k_cache=indexer_mxfp4_cache(inputs.k_cache.shape[0], block_size))
    return plant_hard_values(inputs)


def model_outputs(inputs, spelling):
    """The op's outputs as the model code computes them, into fresh poisoned buffers."""
    out = inputs.fresh_outputs()
    packed, scale_bytes, w = indexer_q_prep(out.q, out.weights, out.positions, out.cos_sin_cache, out.weights_scale, spelling)
    out.q_out.copy_(packed)
    out.q_scale.copy_(scale_bytes)
    out.weights_out.copy_(w)
    indexer_k_insert(out.k, out.k_cache, out.slot_mapping, out.k_positions, out.cos_sin_cache, out.block_size, spelling)
    return out


def reference_outputs(inputs):
    out = inputs.fresh_outputs()
    dsv4_indexer_rope_mxfp4_insert_reference(*out.args())
    return out


@pytest.mark.parametrize("spelling", [pytest.param(s, id=s.name) for s in MXFP4_SPELLINGS])
@pytest.mark.parametrize("shape", [(7, 3, 16, 5, 5), (33, 64, 64, 9, 6)], ids=["T7-H3-bs16", "T33-H64-bs64-Tk'6"])
def test_spelling_is_the_op(spelling, shape):
    num_tokens, num_heads, block_size, num_k, inserted = shape
    inputs = inputs_for(num_tokens, num_heads, block_size, num_k=num_k, num_inserted=inserted)
    diffs = compare_dsv4_indexer(reference_outputs(inputs), model_outputs(inputs, spelling))
    assert not any(diffs.values()), diffs


@pytest.mark.parametrize("e2m1", ["compare", "round"])
def test_e2m1_spelling_is_the_reference_on_every_input_it_can_see(e2m1):
    """Every finite fp32 value a scaled block can hold near the grid: all bf16 values in
    [-6, 6] (bf16 inputs times a power of two keep their bits) and each midpoint's fp32
    neighbours, nibble for nibble."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    v = bits.view(torch.bfloat16).float()
    v = v[v.isfinite() & (v.abs() <= 6)]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    v = torch.cat([v, near, -near, torch.tensor([0.0, -0.0])])
    expected = e2m1_codes_reference(v)
    got = e2m1_codes(v, Mxfp4Spelling("t", e2m1=e2m1))
    assert got.dtype == torch.uint8
    assert torch.equal(got, expected), v[got != expected][:8].tolist()


@pytest.mark.parametrize("spelling", [pytest.param(s, id=s.name) for s in MXFP4_LOOKALIKES])
def test_lookalike_differs(spelling):
    # 40 x 128 key values: the bf16 round trip changes some nibble among them; the planted
    # values show the ties, -0.0 and the amax floor
    inputs = inputs_for(7, 3, 16, num_k=40)
    diffs = compare_dsv4_indexer(reference_outputs(inputs), model_outputs(inputs, spelling))
    assert diffs["q_out"] > 0 and diffs["k_cache"] > 0, diffs


def test_bad_spelling_axis_raises():
    with pytest.raises(ValueError, match="e2m1: must be one of"):
        Mxfp4Spelling("bad", e2m1="bucketize")
