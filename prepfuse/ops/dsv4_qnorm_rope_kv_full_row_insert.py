"""DeepSeek-V4 attention-input preparation for a full-row cache, as one fused, mutating out-variant op.

``prepfuse::dsv4_qnorm_rope_kv_full_row_insert`` (``SCHEMA``, held verbatim by ``tests/golden/schemas.txt``;
every argument, layout and error: ``docs/ops.md#dsv4_qnorm_rope_kv_full_row_insert``). The sibling of
``dsv4_qnorm_rope_kv_insert`` for the sliding-window caches that hold a token's 512 values as one row
in the cache's own dtype (bf16, or e4m3 with one per-tensor scale) instead of fp8_ds_mla blocks.
``T`` tokens, ``H`` local query heads, ``HP >= H`` padded heads::

    q              [T, H, 512]            bf16     rows dense (stride 1 on the last dim)
    kv             [T, 512]               bf16     one latent head, already RMS-normed upstream
    q_out          [T, HP, 512]           bf16 or float8_e4m3fn; written: heads < H as below, heads >= H +0.0
    k_cache        [NB, block_size, 512]  bf16 or float8_e4m3fn; written: row s % block_size of block
                                          s // block_size for each inserted slot s (strides free but the last)
    slot_mapping   [T']                   T' <= T; row t goes to slot slot_mapping[t]; negative skips
    positions      [T]                    row of cos_sin_cache for each token
    cos_sin_cache  [P, 64]                fp32     per position: 32 cos, then 32 sin
    kv_scale       [1] or [] fp32         iff k_cache is fp8: the value a code of 1 stands for
    q_scale_inv    [1] or [] fp32         iff q_out is fp8: the multiplier before the e4m3 rounding

Q, per token and head, as ``dsv4_qnorm_rope_kv_insert`` computes it (fp32 RMSNorm over 512 without
weight unless ``apply_q_norm`` is False, GPT-J RoPE on dims 448..511), then one rounding: bf16, or
``e4m3(clamp(y * q_scale_inv, -448, 448))``. KV, per inserted row: RoPE on dims 448..511 in fp32
(no norm), then the whole row with one rounding: bf16 (dims 0..447 are kv's values unchanged),
or ``e4m3(clamp(x * r, -448, 448))`` with ``r = fp32(1 / kv_scale)``: a product with the rounded
reciprocal, not a division, and no bf16 rounding between RoPE and e4m3, as the production
kernel computes it (docs/ops.md). e4m3 rounds to nearest even; a NaN stays NaN (0x7F), an
infinity saturates.

Traffic per token: reads 1024*H + 1024 + 256 bytes (q, kv, cos/sin row), writes HP*512 and 512
elements of q_out's and k_cache's dtypes: bandwidth bound from a few hundred tokens.
"""

from __future__ import annotations

import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import _duplicate_slots
from prepfuse.ops._checks import check_scale_tensor, check_size, check_tensor, check_unit_last_stride
from prepfuse.ops._indices import clamped_positions, wrapped, written_rows
from prepfuse.ops._library import define_op
from prepfuse.ops._math import E4M3_MAX, rope_gptj
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    HEAD_DIM, NOPE_DIM, ROPE_DIM, _launch_config, check_index_values, check_shared_inputs, q_prep_reference,
)

FP8 = torch.float8_e4m3fn
ROW_DTYPES = (torch.bfloat16, FP8)  # what q_out and k_cache may hold, each on its own

SCHEMA = (
    "dsv4_qnorm_rope_kv_full_row_insert(Tensor q, Tensor kv, Tensor(a!) q_out, Tensor(b!) k_cache, "
    "Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache, Tensor? kv_scale, Tensor? q_scale_inv, "
    "float eps, int block_size, bool wrap_indices=False, bool apply_q_norm=True) -> ()"
)


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------
if has_triton():
    import triton
    import triton.language as tl

    from prepfuse.ops._triton_helpers import _last_writer, _lock_row, _slot_at, _unlock_row
    # the q column and the pieces of the kv row shared with the fp8_ds_mla kernel (triton finds
    # a called jit function in the calling function's module globals)
    from prepfuse.ops.dsv4_qnorm_rope_kv_insert import _cos_sin_at, _q_heads, _rope_pairs, _stored

    @triton.jit
    def _dsv4_qnorm_rope_kv_full_row_insert_kernel(
        q_ptr,  # [T, H, 512] bf16
        kv_ptr,  # [T, 512] bf16
        q_out_ptr,  # [T, HP, 512] bf16, or uint8 (e4m3fn codes) with Q_FP8
        cache_ptr,  # [NB, block_size, 512] bf16, or uint8 (e4m3fn codes) with KV_FP8
        slot_ptr,  # [T'] int64 or int32
        pos_ptr,  # [T] int64 or int32
        cos_sin_ptr,  # [P, 64] fp32
        kv_scale_ptr,  # [1] fp32 (read only with KV_FP8)
        q_scale_ptr,  # [1] fp32 q_scale_inv (read only with Q_FP8)
        locks_ptr,  # [N_ROW_LOCKS] int32 row locks (_duplicate_slots; read with DEDUPE_LOCK)
        H,  # real query heads
        HP,  # padded query heads (q_out.size(1))
        n_insert,  # T': rows of kv inserted into the cache
        n_slots,  # NB * block_size: slots the cache holds
        max_pos,  # P: rows of cos_sin_cache
        stride_qt,  # elements between tokens of q
        stride_qh,  # elements between heads of q
        stride_kvt,  # elements between tokens of kv
        stride_ot,  # elements between tokens of q_out
        stride_oh,  # elements between heads of q_out
        stride_cache_block,  # elements between cache blocks
        stride_cache_row,  # elements between rows (slots) of a block
        stride_cs,  # elements between positions of cos_sin_cache
        eps,  # RMSNorm epsilon
        block_size,  # tokens per cache block
        BLOCK_H: tl.constexpr,  # query heads per program
        N_COLS: tl.constexpr,  # programs per token: 1 (kv) + cdiv(HP, BLOCK_H) (q)
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        Q_FP8: tl.constexpr,  # q_out holds e4m3fn codes
        KV_FP8: tl.constexpr,  # k_cache holds e4m3fn codes
        DEDUPE: tl.constexpr,  # a slot several rows name (_duplicate_slots): 0 off, 1 scan, 2 lock
        SCAN: tl.constexpr,  # with DEDUPE 1: lanes of the slot_mapping scan (>= T')
        WRAP: tl.constexpr,  # slots and positions count from the end when negative (_slot_at)
        Q_NORM: tl.constexpr,  # apply_q_norm
    ):
        # The fp8_ds_mla kernel's grid (T * N_COLS programs, column 0 the kv row, the others
        # BLOCK_H heads of q each); only the kv row's format differs.
        pid = tl.program_id(0).to(tl.int64)
        t = pid // N_COLS
        col = pid % N_COLS

        if col == 0:
            # the row's loads, the slot's and the scale's are issued together: one round trip
            kv_row = kv_ptr + t * stride_kvt
            d = tl.arange(0, 512)
            x = tl.load(kv_row + d).to(tl.float32)
            # the 64 rotated dims read again on their own (an L1 hit), so that RoPE works on 64
            pe = tl.load(kv_row + 448 + tl.arange(0, 64)).to(tl.float32)
            slot = _slot_at(slot_ptr, t, n_insert, n_slots, WRAP)
            kv_scale = 1.0
            if KV_FP8:
                kv_scale = tl.load(kv_scale_ptr)
            tl.debug_barrier()  # see _cos_sin_at
            kv_cos, kv_sin = _cos_sin_at(pos_ptr + t, cos_sin_ptr, stride_cs, max_pos, WRAP)
            write = (slot >= 0) & (slot < n_slots)
            if DEDUPE == 1:  # the last row naming the slot writes it (_duplicate_slots)
                write = write & _last_writer(slot_ptr, t, slot, n_insert, n_slots, SCAN, WRAP)
            if write:
                dst = cache_ptr + (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_row
                if DEDUPE == 2:  # the row's 512 values come from one token (_duplicate_slots)
                    _lock_row(locks_ptr, slot)
                inv_scale = 1.0
                if KV_FP8:  # the production kernel's arithmetic: one fp32 reciprocal, then products
                    inv_scale = tl.div_rn(1.0, kv_scale)
                tl.store(dst + d, _stored(x, inv_scale, KV_FP8, SOFT_ROUNDING), mask=d < 448)
                rot = _rope_pairs(pe, kv_cos, kv_sin, SOFT_ROUNDING)
                tl.store(dst + 448 + tl.arange(0, 64), _stored(rot, inv_scale, KV_FP8, SOFT_ROUNDING))
                if DEDUPE == 2:
                    _unlock_row(locks_ptr, slot)
        else:
            _q_heads(q_ptr, q_out_ptr, pos_ptr, cos_sin_ptr, t, col, H, HP, max_pos, stride_qt, stride_qh, stride_ot,
                     stride_oh, stride_cs, eps, q_scale_ptr, BLOCK_H=BLOCK_H, SOFT_ROUNDING=SOFT_ROUNDING, Q_FP8=Q_FP8,
                     WRAP=WRAP, Q_NORM=Q_NORM)


def dsv4_qnorm_rope_kv_full_row_insert_triton(
    q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale_inv, eps, block_size,
    wrap_indices=False, apply_q_norm=True, *, launch_config: tuple[int, int] | None = None,
    dedupe: str | None = None,
) -> None:
    """Launch the fused kernel once (q and kv sides together). Inputs are not checked here.

    ``launch_config`` overrides ``(BLOCK_H, num_warps)`` (the fp8_ds_mla op's table by default);
    ``dedupe`` ("off", "scan", "lock") overrides ``_duplicate_slots.dedupe_mode``.
    """
    num_tokens, num_heads, _ = q.shape
    padded_heads = q_out.shape[1]
    if num_tokens == 0:
        return
    block_h, num_warps = launch_config or _launch_config(num_tokens, padded_heads)
    n_cols = 1 + triton.cdiv(padded_heads, block_h)
    q_fp8, kv_fp8 = q_out.dtype == FP8, k_cache.dtype == FP8
    _dsv4_qnorm_rope_kv_full_row_insert_kernel[(num_tokens * n_cols,)](
        q, kv, q_out.view(torch.uint8) if q_fp8 else q_out, k_cache.view(torch.uint8) if kv_fp8 else k_cache,
        slot_mapping, positions, cos_sin_cache,
        kv_scale if kv_fp8 else cos_sin_cache,  # an unread placeholder without a scale
        q_scale_inv if q_fp8 else cos_sin_cache,
        _duplicate_slots.row_locks(k_cache.device),
        num_heads, padded_heads, slot_mapping.shape[0], k_cache.shape[0] * block_size, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), kv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), cos_sin_cache.stride(0),
        eps, block_size,
        BLOCK_H=block_h,
        N_COLS=n_cols,
        SOFT_ROUNDING=triton_interpret_mode(),
        Q_FP8=q_fp8,
        KV_FP8=kv_fp8,
        DEDUPE=_duplicate_slots.dedupe_mode(slot_mapping, dedupe),
        SCAN=_duplicate_slots.scan_block(slot_mapping),
        WRAP=bool(wrap_indices),
        Q_NORM=bool(apply_q_norm),
        num_warps=num_warps,
    )


# --------------------------------------------------------------------------------------
# Reference implementation: plain PyTorch, any device
# --------------------------------------------------------------------------------------
def stored_reference(y: torch.Tensor, dtype: torch.dtype, multiplier: torch.Tensor | None) -> torch.Tensor:
    """fp32 values as an output of ``dtype`` holds them: bf16, or e4m3fn of ``y * multiplier``
    clamped to +-448 (round to nearest even; NaN stays NaN)."""
    if dtype == torch.bfloat16:
        return y.to(torch.bfloat16)
    return (y * multiplier.float().reshape(())).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def kv_rows_reference(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype,
                      kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The rows [T, 512] of ``dtype`` that kv becomes: dims 448..511 rotated in fp32, every
    value then rounded once (fp8: times the fp32 reciprocal of ``kv_scale``)."""
    x = kv.float()
    cs = cos_sin_cache[positions]
    rope = rope_gptj(x[:, NOPE_DIM:], cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :])
    inverse = None if kv_scale is None else torch.reciprocal(kv_scale.float())
    return stored_reference(torch.cat((x[:, :NOPE_DIM], rope), dim=-1), dtype, inverse)


def unchecked_reference(
    q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale_inv, eps, block_size,
    wrap_indices=False, apply_q_norm=True,
) -> None:
    """The op in plain PyTorch, unchecked (``define_op`` runs the checks first); index values
    are read as the kernel reads them (``_indices``)."""
    if wrap_indices:  # counted from the end when negative, as PyTorch indexing does
        positions = wrapped(positions, cos_sin_cache.shape[0])
        slot_mapping = wrapped(slot_mapping, k_cache.shape[0] * block_size)
    positions = clamped_positions(positions, cos_sin_cache.shape[0])
    num_heads = q.shape[1]
    q_rows = q_prep_reference(q, positions, cos_sin_cache, eps, apply_q_norm)
    q_out[:, :num_heads] = stored_reference(q_rows, q_out.dtype, q_scale_inv)
    q_out[:, num_heads:] = 0
    n_insert = slot_mapping.shape[0]
    rows = kv_rows_reference(kv[:n_insert], positions[:n_insert], cos_sin_cache, k_cache.dtype, kv_scale)
    keep = written_rows(slot_mapping, k_cache.shape[0] * block_size)  # a host sync: the oracle, not a capturable path
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = rows[keep]


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------
def check_inputs(q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale_inv, eps,
                 block_size, wrap_indices=False, apply_q_norm=True) -> None:
    """Dtypes, shapes, devices and strides; raises ValueError naming the argument (eager paths
    and the fake impl, where sizes may be symbolic)."""
    device = check_shared_inputs(q, kv, q_out, slot_mapping, positions, cos_sin_cache, eps, block_size, wrap_indices,
                                 apply_q_norm=apply_q_norm, q_out_dtype=ROW_DTYPES)
    check_tensor("k_cache", k_cache, dtype=ROW_DTYPES, ndim=3, device=device)
    check_size("k_cache", k_cache, 1, block_size, "block_size, the tokens a block holds")
    check_size("k_cache", k_cache, 2, HEAD_DIM, "the head dim")
    check_unit_last_stride("k_cache", k_cache)  # rows overlapping each other: _checks.check_written_apart
    check_scale_tensor("kv_scale", kv_scale, device, needed=k_cache.dtype == FP8, scaled="k_cache")
    check_scale_tensor("q_scale_inv", q_scale_inv, device, needed=q_out.dtype == FP8, scaled="q_out")


# --------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------
_OP = define_op(
    SCHEMA, check=check_inputs, index_check=check_index_values, reference=unchecked_reference,
    triton=dsv4_qnorm_rope_kv_full_row_insert_triton,
)
dsv4_qnorm_rope_kv_full_row_insert = _OP.packet
# the plain-PyTorch path as a function, checks included (tests and benchmarks call it)
dsv4_qnorm_rope_kv_full_row_insert_reference = _OP.reference
DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT = dsv4_qnorm_rope_kv_full_row_insert.default
