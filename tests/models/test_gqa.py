"""``prepfuse.models.gqa``: every spelling computes the op's reference, eagerly on the CPU.

Compared with ``gqa_qknorm_rope_kv_insert_reference`` on fresh random inputs, all slots
valid, the same norm weights:

- spellings that rotate in fp32 (``hf_fp32``, ``halves``, ``gptj``): q and every cache
  byte identical (the HF norm's ``torch.rsqrt`` on the CPU is the correctly rounded
  ``1/sqrt`` the op computes);
- Hugging Face's all-bf16 RoPE (``hf_bf16``): v and pass-through dims identical, rotated
  values within ``bf16_rope_pair_bound`` (1.25 * 2^-7 * (|a| + |b|)) of the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.models.gqa import (
    GQA_LOOKALIKES,
    GQA_SPELLINGS,
    GqaAttentionBlock,
    GqaSpelling,
    gqa_prep,
    insert,
    kv_cache,
    make_norms,
    split_qkv,
)
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT
from prepfuse.ops.gqa_qknorm_rope_kv_insert import gqa_qknorm_rope_kv_insert_reference
from prepfuse.testing import CACHE_POISON, bf16_rope_pair_bound, make_gqa_inputs

HQ, HKV, BLOCK, EPS = 4, 2, 16, 1e-6
SPELLINGS = [pytest.param(s, id=s.name) for s in GQA_SPELLINGS]
SHAPES = [pytest.param((7, 64), id="T7-D64"), pytest.param((33, 128), id="T33-D128"), pytest.param((5, 256), id="T5-D256")]


def inputs_for(spelling: GqaSpelling, num_tokens: int, head_dim: int, **kwargs):
    """(op inputs with the spelling's norm weights and cache dtype, q_norm, k_norm)."""
    inputs = make_gqa_inputs(num_tokens, HQ, HKV, head_dim, BLOCK, "cpu", rotary_dim=spelling.rotary_dim,
                             is_neox=spelling.is_neox, norm=False, cache_dtype=spelling.cache_dtype, eps=EPS,
                             skip_fraction=0.0, **kwargs)
    q_norm, k_norm = make_norms(head_dim, EPS, spelling, torch.Generator().manual_seed(3))
    if q_norm is not None:
        inputs = dataclasses.replace(inputs, q_norm_weight=q_norm.op_weight(), k_norm_weight=k_norm.op_weight())
    return inputs, q_norm, k_norm


def model_qkv(qkv: torch.Tensor, spelling: GqaSpelling, head_dim: int):
    """What the spelling's model code takes: qkv, or (``separate``) its q, k and v columns
    as three tensors of their own, as three projections give them."""
    if spelling.split != "separate":
        return qkv
    return tuple(part.contiguous() for part in qkv.split((HQ * head_dim, HKV * head_dim, HKV * head_dim), dim=1))


def run_model(inputs, q_norm, k_norm, spelling):
    """The spelling's model code on fresh outputs; a heads-first spelling writes a
    ``[NB, Hkv, bs, D]`` view of the op's ``[NB, bs, Hkv, D]`` caches, and a token-pool or
    slot-view one a flat or contiguous copy, copied back, so all compare as is."""
    run = inputs.fresh_outputs()
    caches = (run.k_cache, run.v_cache)
    if spelling.cache_layout == "heads_slots":
        caches = tuple(c.permute(0, 2, 1, 3) for c in caches)
    if spelling.cache_layout == "flat":  # a token pool: the blocks' rows one after the other
        caches = tuple(c.flatten(0, 1) for c in caches)  # a copy (the op's caches interleave k and v)
    if spelling.cache_layout == "slot_view":  # viewed flat by the model: needs blocks and rows mergeable
        caches = tuple(c.contiguous() for c in caches)  # a copy, for the same reason
    if spelling.cache_layout.startswith("sequence"):  # one sequence's [1, Hkv, S, D]: slot = position
        caches = tuple(c.flatten(0, 1).transpose(0, 1).unsqueeze(0).contiguous() for c in caches)
    q = gqa_prep(model_qkv(run.qkv, spelling, run.head_dim), q_norm, k_norm, *caches,
                 run.slot_mapping, run.positions, run.cos_sin_cache, run.kv_scale, HQ, HKV, spelling)
    for cache, written in zip((run.k_cache, run.v_cache), caches):
        if spelling.cache_layout == "flat":
            cache.copy_(written.unflatten(0, cache.shape[:2]))
        elif spelling.cache_layout == "slot_view":
            cache.copy_(written)
        elif spelling.cache_layout.startswith("sequence"):
            cache.copy_(written[0].transpose(0, 1).unflatten(0, cache.shape[:2]))
    return q, run


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spelling_equals_reference(spelling, shape):
    num_tokens, head_dim = shape
    inputs, q_norm, k_norm = inputs_for(spelling, num_tokens, head_dim)
    q, run = run_model(inputs, q_norm, k_norm, spelling)
    ref = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*ref.args())
    assert torch.equal(run.v_cache.view(torch.uint8), ref.v_cache.view(torch.uint8))
    if spelling.rope != "hf_bf16":
        assert torch.equal(q, ref.q_out)
        assert torch.equal(run.k_cache.view(torch.uint8), ref.k_cache.view(torch.uint8))
        return
    rot = spelling.rotary_dim or head_dim
    q_in, k_in, _ = split_qkv(model_qkv(inputs.qkv, spelling, head_dim), HQ, HKV, head_dim, spelling)
    if q_norm is not None:
        q_in, k_in = q_norm(q_in), k_norm(k_in)
    assert ((q.float() - ref.q_out.float()).abs() <= bf16_rope_pair_bound(q_in, rot, True)).all()
    slots = inputs.slot_mapping
    k_rows = run.k_cache[slots // BLOCK, slots % BLOCK].float()
    ref_rows = ref.k_cache[slots // BLOCK, slots % BLOCK].float()
    assert ((k_rows - ref_rows).abs() <= bf16_rope_pair_bound(k_in, rot, True)).all()
    assert int((q != ref.q_out).sum()) > 0  # HF's bf16 rounding really differs (else the bound tests nothing)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_fewer_slots_than_tokens(spelling):
    inputs, q_norm, k_norm = inputs_for(spelling, 7, 64, num_inserted=4)
    _, run = run_model(inputs, q_norm, k_norm, spelling)
    ref = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*ref.args())
    assert torch.equal(run.v_cache.view(torch.uint8), ref.v_cache.view(torch.uint8))

    def untouched_rows(cache):  # [NB, BS]: slots still all poison
        return (cache.view(torch.uint8) == CACHE_POISON).flatten(2).all(-1)

    assert torch.equal(untouched_rows(run.k_cache), untouched_rows(ref.k_cache))  # the same 4 rows written
    assert int((~untouched_rows(run.k_cache)).sum()) == 4


def test_negative_slot_wraps_around_in_eager_code():
    """The documented difference: eager index assignment writes slot -1 into the last row of
    the last block (Python index wraparound); the fused op skips it."""
    spelling = GQA_SPELLINGS[1]
    inputs, q_norm, k_norm = inputs_for(spelling, 3, 64)
    inputs = dataclasses.replace(inputs, slot_mapping=torch.tensor([0, -1, 5]))
    _, eager = run_model(inputs, q_norm, k_norm, spelling)
    assert not bool((eager.k_cache[-1, -1].view(torch.uint8) == CACHE_POISON).all())

    fused = inputs.fresh_outputs()
    GQA_QKNORM_ROPE_KV_INSERT(*fused.args())
    assert bool((fused.k_cache[-1, -1].view(torch.uint8) == CACHE_POISON).all())


# fp16 runs the same math on another dtype, the row offset writes the same rows into another
# place, and x * (1 / scale) differs from x / scale only in rare fp8 roundings:
# look-alikes for the pass, but not testable here
@pytest.mark.parametrize("spelling", [pytest.param(s, id=s.name) for s in GQA_LOOKALIKES
                                      if s.name not in ("float16", "cache_row_offset_by_one", "fp8_mul_reciprocal")])
def test_lookalikes_compute_something_else(spelling):
    """Each look-alike really differs from the op on typical inputs (else it would be a
    spelling the pass should fuse): bits differ where the look-alike rotates in fp32, the
    bf16-RoPE bound is broken where it rotates in bf16. The op takes one eps (q's here)."""
    inputs, q_norm, k_norm = inputs_for(spelling, 64, 64)
    q, run = run_model(inputs, q_norm, k_norm, spelling)
    ref = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*ref.args())
    if spelling.rope == "hf_fp32":
        assert not (torch.equal(q, ref.q_out) and torch.equal(run.k_cache.view(torch.uint8), ref.k_cache.view(torch.uint8)))
    else:
        q_in = q_norm(split_qkv(inputs.qkv, HQ, HKV, 64, spelling)[0])
        assert ((q.float() - ref.q_out.float()).abs() > bf16_rope_pair_bound(q_in, 64, True)).any()


def test_heads_before_slots_writes_another_layout():
    spelling = next(s for s in GQA_SPELLINGS if s.cache_layout == "heads_slots")
    cache = kv_cache(2, BLOCK, HKV, 64, spelling)
    assert cache.shape == (2, HKV, BLOCK, 64)
    rows = torch.randn(3, HKV, 64).to(torch.bfloat16)
    insert(cache, rows, torch.tensor([0, 17, 31]), spelling)
    assert torch.equal(cache[1, :, 1], rows[1]) and torch.equal(cache[1, :, 15], rows[2])


def test_spelling_validates_its_axes():
    with pytest.raises(ValueError, match="rope: must be one of"):
        GqaSpelling("bad", rope="yarn")
    with pytest.raises(ValueError, match="cache_dtype"):
        GqaSpelling("bad", cache_dtype=torch.float32)
    with pytest.raises(ValueError, match="rotary_dim"):
        GqaSpelling("bad", rotary_dim=33)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_attention_block_runs_and_writes_every_layer(spelling):
    inputs, _, _ = inputs_for(spelling, 7, 64)
    block = GqaAttentionBlock(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=64, spelling=spelling)
    caches = [(kv_cache(inputs.k_cache.shape[0], BLOCK, HKV, 64, spelling),
               kv_cache(inputs.k_cache.shape[0], BLOCK, HKV, 64, spelling)) for _ in range(2)]
    x = torch.randn(7, 64).to(torch.bfloat16)
    out = block(x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, caches, inputs.kv_scale)
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    for k_cache, v_cache in caches:
        assert int((k_cache.view(torch.uint8) != 0).sum()) > 0 and int((v_cache.view(torch.uint8) != 0).sum()) > 0
