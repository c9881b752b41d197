"""``prepfuse.models.dsv4``: every spelling computes the op's reference bytes.

Compared with the reference functions of ``prepfuse/ops/dsv4_qnorm_rope_kv_insert.py``
(``q_prep_reference``, ``kv_cache_rows_reference``, ``insert_rows_reference``), eagerly
on the CPU, on fresh random inputs with all slots valid:

- cache bytes: identical, every spelling, every shape;
- q: within one bf16 ULP on at most max(16, 10 per million) values. The reference takes
  a correctly rounded ``1 / sqrt`` (its sqrt goes through fp64); the spellings use
  ``torch.rsqrt`` or an fp32 ``sqrt``, which on the CPU are each about one fp32 value in
  8 one ULP off it. A (token, head) row scaled by such a hair flips a few of its bf16
  roundings: about one q value per million overall -- the DeepSeek-V4 bound (docs/design.md) (the floor
  of 16 covers one such row in a small test).
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.models.dsv4 import (
    DSV4_LOOKALIKES,
    DSV4_SPELLINGS,
    Dsv4AttentionBlock,
    Dsv4Spelling,
    dsv4_kv_insert,
    dsv4_q_prep,
    fp8_ds_mla_cache,
)
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    insert_rows_reference,
    kv_cache_rows_reference,
    q_prep_reference,
)
from prepfuse.testing import CACHE_POISON, compare_dsv4_q, make_dsv4_inputs

SPELLINGS = [pytest.param(s, id=s.name) for s in DSV4_SPELLINGS]
SHAPES = [pytest.param((7, 3, 8, 16), id="T7-H3-HP8-bs16"), pytest.param((257, 16, 64, 64), id="T257-H16-HP64-bs64")]


def reference_q(inputs) -> torch.Tensor:
    """The padded q the op writes, from the reference functions."""
    num_heads, padded = inputs.q.shape[1], inputs.q_out.shape[1]
    out = torch.zeros_like(inputs.q_out)
    out[:, :num_heads] = q_prep_reference(inputs.q, inputs.positions, inputs.cos_sin_cache, inputs.eps).to(torch.bfloat16)
    assert out.shape[1] == padded
    return out


def reference_cache(inputs) -> torch.Tensor:
    cache = inputs.k_cache.clone()
    n = inputs.slot_mapping.shape[0]
    data, scales = kv_cache_rows_reference(inputs.kv[:n], inputs.positions[:n], inputs.cos_sin_cache)
    insert_rows_reference(cache, data, scales, inputs.slot_mapping, inputs.block_size)
    return cache


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spelling_equals_reference(spelling, shape):
    num_tokens, num_heads, padded, block_size = shape
    inputs = make_dsv4_inputs(num_tokens, num_heads, padded, block_size, "cpu", skip_fraction=0.0)

    q = dsv4_q_prep(inputs.q, inputs.positions, inputs.cos_sin_cache, inputs.eps, padded, spelling)
    # torch.rsqrt vs the reference's correctly rounded 1/sqrt: the DeepSeek-V4 bound (docs/design.md),
    # including its allowance where RoPE cancels (prepfuse.testing.Dsv4Comparison)
    comparison = compare_dsv4_q(reference_q(inputs), q)
    assert comparison.within_spec(), comparison
    assert bool((q[:, num_heads:] == 0).all()) and not torch.signbit(q[:, num_heads:]).any()

    cache = inputs.k_cache.clone()
    dsv4_kv_insert(inputs.kv, cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache, block_size, spelling)
    assert torch.equal(cache, reference_cache(inputs))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_fewer_slots_than_tokens(spelling):
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu", skip_fraction=0.0, num_inserted=4)
    cache = inputs.k_cache.clone()
    dsv4_kv_insert(inputs.kv, cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache, 16, spelling)
    assert torch.equal(cache, reference_cache(inputs))


def test_negative_slot_wraps_around_in_eager_code():
    """The documented difference: eager code writes slot -1 into the last row of the last
    block (Python index wraparound); the fused op skips it."""
    inputs = make_dsv4_inputs(3, 1, 8, 16, "cpu", skip_fraction=0.0)
    inputs.slot_mapping = torch.tensor([0, -1, 5])
    last_row = (slice(-1, None), slice(15 * 576, 16 * 576))

    eager = inputs.k_cache.clone()
    dsv4_kv_insert(inputs.kv, eager, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache, 16, DSV4_SPELLINGS[0])
    assert not bool((eager[last_row] == CACHE_POISON).all())

    fused = inputs.fresh_outputs()
    DSV4_QNORM_ROPE_KV_INSERT(*fused.args())
    assert bool((fused.k_cache[last_row] == CACHE_POISON).all())
    assert torch.equal(fused.k_cache, reference_cache(inputs))  # the reference skips it too


# float16 runs the same math on other dtypes: a look-alike for the pass, not testable here
@pytest.mark.parametrize("spelling", [pytest.param(s, id=s.name) for s in DSV4_LOOKALIKES
                                      if s.name != "float16"])
def test_lookalikes_compute_something_else(spelling):
    """Each look-alike really differs from the op on typical inputs (else it would be a
    spelling the pass should fuse)."""
    inputs = make_dsv4_inputs(64, 4, 8, 16, "cpu", skip_fraction=0.0)
    inputs.k_cache.zero_()
    q = dsv4_q_prep(inputs.q, inputs.positions, inputs.cos_sin_cache, inputs.eps, 8, spelling)
    cache = fp8_ds_mla_cache(inputs.k_cache.shape[0], 16, row_bytes=spelling.cache_row_bytes)
    dsv4_kv_insert(inputs.kv, cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache, 16, spelling)
    q_same = torch.equal(q, reference_q(inputs))
    cache_same = cache.shape == inputs.k_cache.shape and torch.equal(cache, reference_cache(inputs))
    assert not (q_same and cache_same)


def test_spelling_validates_its_axes():
    with pytest.raises(ValueError, match="norm: must be one of"):
        Dsv4Spelling("bad", norm="layer_norm")
    with pytest.raises(ValueError, match="quant_block"):
        Dsv4Spelling("bad", quant_block=32)


def test_attention_block_runs_and_writes_every_layer():
    block = Dsv4AttentionBlock(num_layers=2, spelling=DSV4_SPELLINGS[1])
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu", skip_fraction=0.0)
    caches = [fp8_ds_mla_cache(5, 16) for _ in range(2)]
    x = torch.randn(7, 64).to(torch.bfloat16)
    out = block(x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, caches)
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    for cache in caches:
        assert int((cache != 0).sum()) > 0
