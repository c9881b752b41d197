"""What the two DeepSeek-V4 indexer ops share: the math, one kernel, one launcher, the checks.

The ops (``dsv4_indexer_rope_fp8_insert``, ``dsv4_indexer_rope_mxfp4_insert``) prepare the
lightning indexer of DeepSeek-V4's compress-ratio-4 layers in one launch: the indexer queries are
rotated and quantised for the MQA-logits kernel (DeepGEMM ``fp8_fp4_mqa_logits``), their head
weights scaled, and the compressed indexer keys rotated, quantised and inserted into the paged
indexer cache. They differ only in the format; this module holds the rest, so they stay one
design. Arguments, layouts, errors and the sources of each choice: ``docs/ops.md#dsv4_indexer_rope_fp8_insert``.

Shapes (``T`` tokens, ``H`` indexer heads, 64 in DeepSeek-V4; ``Tk`` compressed key rows)::

    q              [T, H, 128]   bf16   indexer queries (wq_b output), last dim dense
    weights        [T, H]        bf16 or fp32   per-head logit weights (weights_proj)
    k              [Tk, 128]     bf16   compressed, RMS-normed indexer keys, last dim dense
    slot_mapping   [Tk']         int64  Tk' <= Tk; row r of k goes to slot slot_mapping[r]; negative skips
    positions      [T], k_positions [Tk]   RoPE positions (vLLM's compressor: (p // 4) * 4)
    cos_sin_cache  [P, 64]       fp32   per position: 32 cos, then 32 sin

Math, per query head and per key row (x: 128 values, fp32)::

    GPT-J RoPE on the LAST 64 dims: pair p in 0..31, e, o = x[64+2p], x[65+2p]
        -> e*cos[p] - o*sin[p], e*sin[p] + o*cos[p]; dims 0..63 pass through; all rounded to bf16
    fp8 (per row of 128): amax = max(max|x|, 1e-4); e = ceil(log2(amax / 448))
        code = e4m3(clamp(x * 2^-e, -448, 448)) (round to nearest even); scale = 2^e
    mxfp4 (per block of 32): amax = max(max|x|, 6 * 2^-126); e = clamp(ceil(log2(amax / 6)), -127, 127)
        nibble = e2m1(x * 2^-e) (nearest even, saturating at +-6, bit 3 the sign)
        byte j = nibble(x[2j]) | nibble(x[2j+1]) << 4; scale byte = e + 127 (UE8M0)
    a row (fp8) or block (mxfp4) holding a NaN or an infinity has no scale: fp8 scale NaN (so the
    head's weight is NaN) and codes 0x7F; mxfp4 scale byte 0xFF, nibbles 0

Cache, per block of ``block_size`` slots (vLLM's indexer layout): fp8 ``block_size * 128`` code
bytes, then ``block_size`` fp32 scales (132 bytes a slot); mxfp4 ``block_size * 64`` packed bytes,
then ``block_size * 4`` UE8M0 bytes (68 bytes a slot). No byte of other slots, skipped rows or
padding is written. Why vLLM's math (RoPE on the last dims, the bf16 round trip before the amax, no
Hadamard rotation): vLLM is the production reference these ops replace.
"""

from __future__ import annotations

import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops._math import e4m3_pow2_quant, rope_gptj, ue8m0_bytes
from prepfuse.ops._checks import (
    can_read_index_values,
    check_fp32_scalar,
    check_index_tensor,
    check_size,
    check_slot_and_position_values,
    check_tensor,
    check_unit_last_stride,
    require,
)
from prepfuse.ops import _duplicate_slots
from prepfuse.ops._indices import clamped_positions, wrapped, written_rows

HEAD_DIM = 128
ROPE_DIM = 64
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 64: the first 64 dims are not rotated
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_SLOT_BYTES = HEAD_DIM + 4  # 128 codes + one fp32 scale
MXFP4_BLOCK = 32
MXFP4_BLOCKS = HEAD_DIM // MXFP4_BLOCK  # 4
MXFP4_PACKED = HEAD_DIM // 2  # 64 bytes, two nibbles each
MXFP4_SLOT_BYTES = MXFP4_PACKED + MXFP4_BLOCKS  # 64 packed + 4 UE8M0 bytes
E2M1_MAX = 6.0
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126


# --------------------------------------------------------------------------------------
# Triton kernel (both formats; MXFP4 is a constexpr)
# --------------------------------------------------------------------------------------
if has_triton():
    import triton
    import triton.language as tl

    from prepfuse.ops._triton_helpers import (
        _amax,
        _bf16x2_amax,
        _bf16x2_words,
        _ceil_log2_ratio,
        _e2m1_word_bytes,
        _exp2_int,
        _finite,
        _last_writer,
        _lock_row,
        _max_keep_nan,
        _rope_pairs_split,
        _round_bf16x2_words,
        _slot_at,
        _table_position,
        _to_e4m3_bits,
        _unlock_row,
    )

    @triton.jit
    def _rotated_rope_words(rows, mask, cs_row, EVICT: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
        """The RoPE half (dims 64..127) of rows of 128 bf16 values at ``rows [R, 1]``,
        rotated (GPT-J), rounded to bf16 and packed as bf16x2 words ``[R, 32]``
        (``_bf16x2_words``): one contiguous load (L2 eviction policy ``EVICT``, see
        ``_load_rotated_words``), the pairs split in registers."""
        pe = tl.load(rows + 64 + tl.arange(0, 64)[None, :], mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        rot_even, rot_odd = _rope_pairs_split(pe, cs_row, SOFT_ROUNDING)
        return _round_bf16x2_words(rot_even, rot_odd, SOFT_ROUNDING)

    @triton.jit
    def _load_rotated_pairs(rows, mask, cs_row, SOFT_ROUNDING: tl.constexpr):
        """Rows of 128 bf16 values at ``rows [R, 1]`` as four fp32 ``[R, 32]`` tensors: the
        NoPE pairs (values 2p, 2p+1 of dims 0..63) and the rotated RoPE pairs (GPT-J on dims
        64..127, rounded to bf16). fp8's form: it scales values one by one and joins the
        pairs back before its contiguous store.
        """
        nope = tl.load(rows + tl.arange(0, 64)[None, :], mask=mask, other=0.0).to(tl.float32)
        nope_even, nope_odd = tl.split(tl.reshape(nope, nope.shape[:-1] + [32, 2]))
        rope = _rotated_rope_words(rows, mask, cs_row, "", SOFT_ROUNDING)
        rot_even = (rope << 16).to(tl.float32, bitcast=True)
        rot_odd = (rope & 0xFFFF0000).to(tl.float32, bitcast=True)
        return nope_even, nope_odd, rot_even, rot_odd

    @triton.jit
    def _load_rotated_words(rows, mask, cs_row, WORDS: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
        """The same rows as bf16x2 words ``[R, 32]`` (NoPE, rotated RoPE): mxfp4's form, which
        quantises pairs. With ``WORDS`` (rows 4-byte aligned, checked at launch) the NoPE
        half is loaded as words as it lies; else as bf16 values, widened and packed again.

        The rows are read once: loaded ``evict_first`` (as mxfp4's q bytes are stored), so
        that L2 gives them up before the lines still to be written back; the fp8 path was
        slower with the hint and has none (docs/decisions.md, Indexer kernel: evict_first on
        MXFP4)."""
        if WORDS:
            nope = tl.load(rows.to(tl.pointer_type(tl.uint32), bitcast=True) + tl.arange(0, 32)[None, :], mask=mask,
                           other=0, eviction_policy="evict_first")
        else:
            values = tl.load(rows + tl.arange(0, 64)[None, :], mask=mask, other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
            even, odd = tl.split(tl.reshape(values, values.shape[:-1] + [32, 2]))
            nope = _bf16x2_words(even, odd)
        return nope, _rotated_rope_words(rows, mask, cs_row, "evict_first", SOFT_ROUNDING)

    @triton.jit
    def _fp8_codes(even, odd, inv, SOFT_ROUNDING: tl.constexpr):
        """Pairs [R, 32] times ``inv [R, 1]`` -> their e4m3 code bytes [R, 64], in order.

        No clamp and no select per value: the row's scale bounds every product by 448, and a
        row without one has ``inv`` NaN, so its products are NaN, whose code is 0x7F."""
        code_even = _to_e4m3_bits(even * inv, SOFT_ROUNDING)
        code_odd = _to_e4m3_bits(odd * inv, SOFT_ROUNDING)
        return tl.reshape(tl.join(code_even, code_odd), even.shape[:-1] + [64])

    @triton.jit
    def _quant_fp8(nope_even, nope_odd, rot_even, rot_odd, SOFT_ROUNDING: tl.constexpr):
        """One scale per row of 128 -> (codes of dims 0..63 [R, 64], of 64..127 [R, 64], the
        fp32 scale 2^e's bits [R] uint32). A row holding a NaN or an infinity has no scale:
        NaN scale, NaN codes (docs/ops.md, non-finite inputs)."""
        amax = _max_keep_nan(
            _max_keep_nan(_amax(nope_even, 1), _amax(nope_odd, 1)),
            _max_keep_nan(_amax(rot_even, 1), _amax(rot_odd, 1)),
        )
        finite = _finite(amax)
        e = _ceil_log2_ratio(tl.maximum(amax, 1e-4), 8, 0x600000)  # 448 = 1.75 * 2^8
        inv = tl.where(finite, _exp2_int(-e), float("nan"))[:, None]
        scale_bits = tl.where(finite, (e + 127).to(tl.uint32) << 23, 0x7FC00000)
        nope = _fp8_codes(nope_even, nope_odd, inv, SOFT_ROUNDING)
        return nope, _fp8_codes(rot_even, rot_odd, inv, SOFT_ROUNDING), scale_bits

    @triton.jit
    def _quant_mxfp4_half(words, SOFT_ROUNDING: tl.constexpr):
        """64 values as bf16x2 words [R, 32] (``_bf16x2_words``) = two blocks of 32 -> (packed
        bytes [R, 32], UE8M0 scale bytes [R, 2]). A block holding a NaN or an infinity has
        no scale: byte 0xFF (UE8M0's NaN), nibbles 0 (docs/ops.md, non-finite inputs).
        The values stay packed two to a word throughout (amax and codes: bf16x2
        arithmetic, ``_bf16x2_amax`` and ``_e2m1_word_bytes``): this op is
        instruction-bound, and unpacking costs an instruction a value."""
        # shapes inline: a list bound to a name becomes a tuple of tensors on the GPU
        # compiler (not in the CPU interpreter), which tl.reshape rejects
        words = tl.reshape(words, words.shape[:-1] + [2, 16])
        mags = words & 0x7FFF7FFF
        amax = _bf16x2_amax(mags, 2, SOFT_ROUNDING)
        finite = _finite(amax)
        e = _ceil_log2_ratio(tl.maximum(amax, 6.0 * 2.0**-126), 2, 0x400000)  # 6 = 1.5 * 2^2
        e = tl.minimum(tl.maximum(e, -127), 127)  # never binds for finite bf16 input
        inv = _exp2_int(-e)[:, :, None]
        packed = _e2m1_word_bytes(words, mags, inv, finite[:, :, None], SOFT_ROUNDING)
        scale_bytes = tl.where(finite, e + 127, 255).to(tl.uint8)
        return tl.reshape(packed.to(tl.uint8), words.shape[:-2] + [32]), scale_bytes

    @triton.jit
    def _dsv4_indexer_rope_quant_insert_kernel(
        q_ptr,  # [T, H, 128] bf16
        w_ptr,  # [T, H] bf16 or fp32
        k_ptr,  # [Tk, 128] bf16
        q_out_ptr,  # [T, H, 128] e4m3 bytes (fp8) or [T, H, 64] packed bytes (mxfp4)
        q_scale_ptr,  # [T, H, 4] uint8 UE8M0 (mxfp4; unused for fp8)
        w_out_ptr,  # [T, H] fp32
        cache_ptr,  # [NB, S] uint8
        slot_ptr,  # [Tk'] int64
        pos_ptr,  # [T] int64
        k_pos_ptr,  # [Tk] int64
        cos_sin_ptr,  # [P, 64] fp32
        locks_ptr,  # [N_ROW_LOCKS] int32 row locks (_duplicate_slots; read with DEDUPE_LOCK)
        H,  # indexer heads
        n_q_programs,  # T * N_QCOLS: programs that prepare q; the rest insert k rows
        n_insert,  # Tk': rows of k inserted into the cache
        n_slots,  # NB * block_size: slots the cache holds
        max_pos,  # P: rows of cos_sin_cache
        stride_qt,  # elements between tokens of q
        stride_qh,  # elements between heads of q
        stride_wt,  # elements between tokens of weights
        stride_kt,  # elements between rows of k
        stride_ot,  # bytes between tokens of q_out
        stride_oh,  # bytes between heads of q_out
        stride_st,  # bytes between tokens of q_scale
        stride_sh,  # bytes between heads of q_scale
        stride_wot,  # elements between tokens of weights_out
        stride_cache_block,  # bytes between cache blocks (S)
        stride_cs,  # elements between positions of cos_sin_cache
        weights_scale,  # fp32 factor of weights_out (softmax scale * head scale)
        block_size,  # slots per cache block
        n_k,  # Tk: programs that insert k rows (read with K_FIRST)
        BLOCK_H: tl.constexpr,  # query heads per program
        N_QCOLS: tl.constexpr,  # programs per token on the q side: cdiv(H, BLOCK_H)
        MXFP4: tl.constexpr,  # the format: mxfp4, else fp8
        WORDS: tl.constexpr,  # q and k rows 4-byte aligned: mxfp4 loads NoPE halves as bf16x2 words
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        DEDUPE: tl.constexpr,  # a slot several rows name (_duplicate_slots): 0 off, 1 scan, 2 lock
        SCAN: tl.constexpr,  # with DEDUPE 1: lanes of the slot_mapping scan (>= Tk')
        K_FIRST: tl.constexpr,  # the k programs take the grid's first Tk programs, the q programs the rest
        WRAP: tl.constexpr,  # slots and positions count from the end when negative (_slot_at)
    ):
        # A 1-D grid: programs [0, T * N_QCOLS) rotate, quantise and store BLOCK_H heads of
        # one token's q (columns fastest, so q streams in address order); the Tk programs
        # after them each insert one k row. q and k rows are independent (k rows are
        # compressed tokens, fewer than T), so neither side waits for the other.
        # Every row is read as two contiguous halves and written as contiguous bytes: the
        # pairs RoPE and MXFP4 work on are split and joined in registers, not gathered.
        pid = tl.program_id(0).to(tl.int64)
        if K_FIRST:
            # the k programs first (launch_indexer_kernel's k_first): program p < Tk is k
            # row p, the others the q programs in their order (Tk an argument, not the grid's
            # size less the q programs: the decode floor's rows launch a cut grid)
            pid = tl.where(pid < n_k, pid + n_q_programs, pid - n_k)
        d32 = tl.arange(0, 32)[None, :]
        d64 = tl.arange(0, 64)[None, :]
        if pid < n_q_programs:
            t = pid // N_QCOLS
            heads = (pid % N_QCOLS) * BLOCK_H + tl.arange(0, BLOCK_H)
            in_h = heads < H
            # The position is loaded first; the compiler waits on it (for the clamp) and then
            # issues the rows with the cos/sin loads: two round trips to memory either way
            # (the rows first and the position behind a barrier, as the DSV4 kernel loads, was
            # slower here: docs/decisions.md).
            pos = _table_position(pos_ptr + t, max_pos, WRAP)
            rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
            cs_row = cos_sin_ptr + pos * stride_cs
            w = tl.load(w_ptr + t * stride_wt + heads, mask=in_h, other=0.0).to(tl.float32)
            out = q_out_ptr + t * stride_ot + heads[:, None] * stride_oh
            if MXFP4:
                nope_words, rope_words = _load_rotated_words(rows, in_h[:, None], cs_row, WORDS, SOFT_ROUNDING)
                nope_packed, nope_scales = _quant_mxfp4_half(nope_words, SOFT_ROUNDING)
                rope_packed, rope_scales = _quant_mxfp4_half(rope_words, SOFT_ROUNDING)
                # streamed out, evict_first as the rows came in (_load_rotated_words)
                tl.store(out + d32, nope_packed, mask=in_h[:, None], eviction_policy="evict_first")
                tl.store(out + 32 + d32, rope_packed, mask=in_h[:, None], eviction_policy="evict_first")
                b = tl.arange(0, 2)[None, :]
                scales = q_scale_ptr + t * stride_st + heads[:, None] * stride_sh + b
                tl.store(scales, nope_scales, mask=in_h[:, None])
                tl.store(scales + 2, rope_scales, mask=in_h[:, None])
                # the block scales travel with q: weights carry no q scale
                w_out = w * weights_scale
            else:
                ne, no, re, ro = _load_rotated_pairs(rows, in_h[:, None], cs_row, SOFT_ROUNDING)
                nope_codes, rope_codes, scale_bits = _quant_fp8(ne, no, re, ro, SOFT_ROUNDING)
                tl.store(out + d64, nope_codes, mask=in_h[:, None])
                tl.store(out + 64 + d64, rope_codes, mask=in_h[:, None])
                # the head's scale 2^e is folded into its weight (exact: a power of two)
                w_out = (w * scale_bits.to(tl.float32, bitcast=True)) * weights_scale
            tl.store(w_out_ptr + t * stride_wot + heads, w_out, mask=in_h)
        else:
            r = pid - n_q_programs
            # the row (and its position's cos/sin) is loaded beside the slot, not after
            # it: the branch waits on one round trip to memory, not two
            pos = _table_position(k_pos_ptr + r, max_pos, WRAP)
            # the row as one "head" ([1, ...] tensors), so the q side's helpers apply as they
            # are (k_ names: triton wants a name's type alike in both branches of the if)
            k_row = k_ptr + r * stride_kt + tl.zeros([1, 1], dtype=tl.int64)
            k_mask = tl.full([1, 1], 1, tl.int1)  # the whole row
            if MXFP4:
                k_nope_words, k_rope_words = _load_rotated_words(k_row, k_mask, cos_sin_ptr + pos * stride_cs, WORDS, SOFT_ROUNDING)
            else:
                k_ne, k_no, k_re, k_ro = _load_rotated_pairs(k_row, k_mask, cos_sin_ptr + pos * stride_cs, SOFT_ROUNDING)
            slot = _slot_at(slot_ptr, r, n_insert, n_slots, WRAP)
            write = (slot >= 0) & (slot < n_slots)
            if DEDUPE == 1:  # the last row naming the slot writes it (_duplicate_slots)
                write = write & _last_writer(slot_ptr, r, slot, n_insert, n_slots, SCAN, WRAP)
            if write:
                blk = slot // block_size
                row = slot % block_size
                block = cache_ptr + blk * stride_cache_block
                if DEDUPE == 2:  # the row's data and scale bytes come from one k row (_duplicate_slots);
                    # taken before the math, so that the atomic's round trip overlaps the loads'
                    _lock_row(locks_ptr, slot)
                if MXFP4:
                    nope_packed, nope_scales = _quant_mxfp4_half(k_nope_words, SOFT_ROUNDING)
                    rope_packed, rope_scales = _quant_mxfp4_half(k_rope_words, SOFT_ROUNDING)
                    data = block + row * 64
                    tl.store(data + d32, nope_packed)
                    tl.store(data + 32 + d32, rope_packed)
                    b = tl.arange(0, 2)[None, :]
                    scales = block + block_size * 64 + row * 4 + b
                    tl.store(scales, nope_scales)
                    tl.store(scales + 2, rope_scales)
                else:
                    nope_codes, rope_codes, scale_bits = _quant_fp8(k_ne, k_no, k_re, k_ro, SOFT_ROUNDING)
                    data = block + row * 128
                    tl.store(data + d64, nope_codes)
                    tl.store(data + 64 + d64, rope_codes)
                    # the fp32 scale 2^e as 4 little-endian bytes (byte stores: no alignment needed)
                    b = tl.arange(0, 4)[None, :]
                    bits = scale_bits[:, None]
                    tl.store(block + block_size * 128 + row * 4 + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8))
                if DEDUPE == 2:
                    _unlock_row(locks_ptr, slot)


def _launch_config(num_tokens: int, num_heads: int) -> tuple[int, int]:
    """(heads per program, warps per program), from the H200 sweep of the fp8 kernel
    (``bench/tools/sweep_dsv4_indexer_launch.py``; the mxfp4 sweep agrees within 4%).

    One warp throughout: a head is 256 bytes in and 128 out, so one warp already moves 16-byte
    vectors, and more warps only split a program's few rows thinner. Sixteen heads per program
    at large T, eight up to T=128, one at T <= 4, where latency rules. The timings:
    docs/decisions.md (Indexer kernel: contiguous halves, launch table, e2m1 by ranges).
    """
    if num_tokens <= 4:
        block_h = 1
    elif num_tokens <= 128:
        block_h = 8
    else:
        block_h = 16
    # no q heads (H = 0, a k-only call): one head a program keeps the grid's arithmetic
    # defined (next_power_of_2(0) is 0)
    return min(block_h, max(1, triton.next_power_of_2(num_heads))), 1


def _rows_hold_words(x: torch.Tensor) -> bool:
    """Whether every row of bf16 ``x`` (its last dim dense) starts on a 4-byte boundary, so
    that its values can be read two to a 32-bit word."""
    return x.data_ptr() % 4 == 0 and all(stride % 2 == 0 for stride in x.stride()[:-1])


def launch_indexer_kernel(
    q, weights, k, q_out, q_scale, weights_out, k_cache, slot_mapping, positions, k_positions,
    cos_sin_cache, weights_scale, block_size, *, mxfp4: bool, launch_config: tuple[int, ...] | None = None,
    dedupe: str | None = None, k_first: bool = False, wrap_indices: bool = False,
) -> None:
    """The one launch of both ops (q side and k side together). Inputs are not checked here.
    ``dedupe`` overrides ``_duplicate_slots.dedupe_mode`` (the benchmark and a GPU test use it);
    ``launch_config`` ``(heads per program, warps[, register cap])`` overrides
    ``_launch_config`` (the sweep's); ``k_first`` puts the k programs at the front of the
    grid (which otherwise holds every q program first), for measuring
    whether the one k program, last in a T=1 grid, holds the launch (docs/decisions.md).

    ``q_out`` and ``q_scale`` are passed as byte views; ``q_scale`` is ignored for fp8.
    Traffic per token: reads 256*H (q) + 2-4*H (weights) + 256 (cos/sin) bytes, writes
    128*H (fp8) or 68*H (mxfp4) + 4*H bytes; per k row reads 256 + 256, writes 132 or 68.
    """
    num_tokens, num_heads, _ = q.shape
    num_k = k.shape[0]
    if num_tokens == 0 and num_k == 0:
        return
    block_h, num_warps, maxnreg = (tuple(launch_config or _launch_config(num_tokens, num_heads)) + (0,))[:3]
    n_qcols = triton.cdiv(num_heads, block_h)
    n_q_programs = num_tokens * n_qcols
    q_bytes = q_out.view(torch.uint8)
    scale_bytes = q_scale if q_scale is not None else q_bytes  # a placeholder the fp8 branch never touches
    _dsv4_indexer_rope_quant_insert_kernel[(n_q_programs + num_k,)](
        q, weights, k, q_bytes, scale_bytes, weights_out, k_cache, slot_mapping, positions, k_positions,
        cos_sin_cache, _duplicate_slots.row_locks(k_cache.device),
        num_heads, n_q_programs, slot_mapping.shape[0], k_cache.shape[0] * block_size, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), weights.stride(0), k.stride(0),
        q_bytes.stride(0), q_bytes.stride(1), scale_bytes.stride(0), scale_bytes.stride(1),
        weights_out.stride(0), k_cache.stride(0), cos_sin_cache.stride(0),
        weights_scale, block_size, num_k,
        BLOCK_H=block_h,
        N_QCOLS=n_qcols,
        MXFP4=mxfp4,
        WORDS=mxfp4 and _rows_hold_words(q) and _rows_hold_words(k),
        SOFT_ROUNDING=triton_interpret_mode(),
        DEDUPE=_duplicate_slots.dedupe_mode(slot_mapping, dedupe),
        SCAN=_duplicate_slots.scan_block(slot_mapping),
        K_FIRST=bool(k_first),
        WRAP=bool(wrap_indices),
        num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )


# --------------------------------------------------------------------------------------
# Reference pieces: plain PyTorch, any device, the text above step by step
# --------------------------------------------------------------------------------------
def rope_tail_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``x [..., 128]`` (any float) with GPT-J RoPE on dims 64..127, rounded to bf16, as fp32.

    ``x`` is [T, H, 128] or [T, 128]; ``positions`` [T] picks the cos/sin rows.
    """
    x = x.float()
    cs = cos_sin_cache[clamped_positions(positions, cos_sin_cache.shape[0])]
    if x.dim() == 3:
        cs = cs.unsqueeze(1)
    cos, sin = cs[..., : ROPE_DIM // 2], cs[..., ROPE_DIM // 2 :]
    rope = rope_gptj(x[..., NOPE_DIM:], cos, sin)
    return torch.cat((x[..., :NOPE_DIM], rope), dim=-1).to(torch.bfloat16).float()


def fp8_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per row of ``x [..., 128]`` fp32: (e4m3 codes [..., 128] uint8,
    scales [...] fp32 = 2^ceil(log2(max(amax, 1e-4) / 448)))."""
    codes, e = e4m3_pow2_quant(x, FP8_AMAX_FLOOR)
    return codes, torch.exp2(e)


def e2m1_codes_reference(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> e2m1 nibbles (uint8 0..15), round to nearest even, saturating;
    bit 3 is the sign bit of ``v`` (so -0.0 and negatives rounding to zero give 8)."""
    a = v.abs()
    thresholds = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
    code = sum(((a >= m) if ties_up else (a > m)).to(torch.uint8) for m, ties_up in thresholds)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def mxfp4_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 of ``x [..., 128]`` fp32: (packed [..., 64] uint8, UE8M0 bytes [..., 4])."""
    blocks = x.unflatten(-1, (MXFP4_BLOCKS, MXFP4_BLOCK))
    amax = blocks.abs().amax(dim=-1)  # NaN when the block holds one
    e = torch.ceil(torch.log2(amax.clamp_min(MXFP4_AMAX_FLOOR) / E2M1_MAX)).clamp(-127, 127)
    finite = amax.isfinite()  # a block holding a NaN or an infinity has no scale
    e = torch.where(finite, e, torch.nan)
    codes = e2m1_codes_reference(blocks * torch.exp2(-e).unsqueeze(-1))
    codes = torch.where(finite.unsqueeze(-1), codes, 0)  # e2m1 has no NaN: the 0xFF scale says it
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even element in the low nibble
    return packed.flatten(-2), ue8m0_bytes(e)


def write_cache_rows(
    k_cache: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int
) -> None:
    """Write rows (data [Tk', D] and scale bytes [Tk', 4], uint8) into their slots of the
    indexer cache (each block: ``block_size * D`` data bytes, then ``block_size * 4`` scale
    bytes) as the kernel does (``_indices.written_rows``: negative and out-of-cache slots
    skipped, a duplicated slot written whole by its last token; a boolean mask: a host sync
    on CUDA, the oracle's way, not a capturable path)."""
    keep = written_rows(slots, k_cache.shape[0] * block_size)
    data, scales, slots = data[keep], scales[keep], slots[keep]
    width = data.shape[1]
    blk, row = (slots // block_size).unsqueeze(1), (slots % block_size).unsqueeze(1)
    k_cache[blk, row * width + torch.arange(width, device=slots.device)] = data
    k_cache[blk, block_size * width + row * 4 + torch.arange(4, device=slots.device)] = scales


# --------------------------------------------------------------------------------------
# Checks shared by both ops
# --------------------------------------------------------------------------------------
def check_common_inputs(
    q, weights, k, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, *, slot_bytes: int,
) -> None:
    """Dtypes, shapes, devices and strides of everything but the format's q outputs;
    raises ValueError naming the argument. Runs in eager and in the fake impls."""
    device = q.device if isinstance(q, torch.Tensor) else None  # check_tensor names a non-tensor q
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3, device=device)
    if not isinstance(weights, torch.Tensor) or weights.dtype not in (torch.bfloat16, torch.float32):
        got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights: expected dtype torch.bfloat16 or torch.float32, got {got}")
    check_tensor("weights", weights, dtype=weights.dtype, ndim=2, device=device)
    check_tensor("k", k, dtype=torch.bfloat16, ndim=2, device=device)
    check_tensor("weights_out", weights_out, dtype=torch.float32, ndim=2, device=device)
    check_tensor("k_cache", k_cache, dtype=torch.uint8, ndim=2, device=device)
    check_index_tensor("slot_mapping", slot_mapping, device)
    check_index_tensor("positions", positions, device)
    check_index_tensor("k_positions", k_positions, device)
    check_tensor("cos_sin_cache", cos_sin_cache, dtype=torch.float32, ndim=2, device=device)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    check_size("q", q, 2, HEAD_DIM, "the indexer head dim")
    check_size("weights", weights, 0, num_tokens, "T, q's token count")
    check_size("weights", weights, 1, num_heads, "H, q's head count")
    check_size("k", k, 1, HEAD_DIM, "the indexer head dim")
    check_size("weights_out", weights_out, 0, num_tokens, "T, q's token count")
    check_size("weights_out", weights_out, 1, num_heads, "H, q's head count")
    check_size("positions", positions, 0, num_tokens, "T, q's token count")
    check_size("k_positions", k_positions, 0, k.shape[0], "Tk, k's row count")
    require(
        slot_mapping.shape[0] <= k.shape[0],
        f"slot_mapping: has {slot_mapping.shape[0]} rows, more than k's {k.shape[0]} rows",
    )
    check_size("cos_sin_cache", cos_sin_cache, 1, ROPE_DIM, "32 cos + 32 sin values")
    named = (
        ("q", q), ("weights", weights), ("k", k), ("weights_out", weights_out), ("k_cache", k_cache),
        ("slot_mapping", slot_mapping), ("positions", positions), ("k_positions", k_positions),
        ("cos_sin_cache", cos_sin_cache),
    )
    for name, t in named:
        check_unit_last_stride(name, t)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
    require(
        k_cache.stride(0) >= block_size * slot_bytes and k_cache.shape[1] >= block_size * slot_bytes,
        f"k_cache: a block of {block_size} slots needs {block_size * slot_bytes} bytes "
        f"({slot_bytes} per slot), got shape {tuple(k_cache.shape)} strides {tuple(k_cache.stride())}",
    )
    check_fp32_scalar("weights_scale", weights_scale)


def check_q_output(name: str, t: torch.Tensor, q: torch.Tensor, dtype: torch.dtype, last: int, what: str) -> None:
    """A [T, H, last] output of q's tokens and heads, dense rows."""
    check_tensor(name, t, dtype=dtype, ndim=3, device=q.device)
    check_size(name, t, 0, q.shape[0], "T, q's token count")
    check_size(name, t, 1, q.shape[1], "H, q's head count")
    check_size(name, t, 2, last, what)
    check_unit_last_stride(name, t)


def check_index_values(k_cache, slot_mapping, positions, k_positions, cos_sin_cache, block_size,
                       wrap_indices=False) -> None:
    """Slot and position values in range (eager use; skipped while capturing a graph)."""
    check_slot_and_position_values(slot_mapping, k_cache.shape[0], block_size, positions, cos_sin_cache.shape[0],
                                   wrap=wrap_indices)
    if k_positions.numel() and can_read_index_values(k_positions):
        lo, hi, rows = int(k_positions.min()), int(k_positions.max()), cos_sin_cache.shape[0]
        low = -rows if wrap_indices else 0
        if lo < low or hi >= rows:
            raise ValueError(
                f"k_positions: values must lie in [{low}, {rows}) (rows of cos_sin_cache), got [{lo}, {hi}]"
            )


def wrapped_indices(k_cache, slot_mapping, positions, k_positions, cos_sin_cache, block_size, wrap_indices):
    """(slots, positions, k_positions) as the kernel reads them: with ``wrap_indices`` a
    negative value counted from the end, as PyTorch indexing does."""
    if not wrap_indices:
        return slot_mapping, positions, k_positions
    rows = cos_sin_cache.shape[0]
    return (wrapped(slot_mapping, k_cache.shape[0] * block_size), wrapped(positions, rows),
            wrapped(k_positions, rows))
