"""DeepSeek-V4 attention-input preparation as one fused, mutating out-variant op.

``prepfuse::dsv4_qnorm_rope_kv_insert`` (``SCHEMA``, held verbatim by ``tests/golden/schemas.txt``;
every argument, layout and error: ``docs/ops.md#dsv4_qnorm_rope_kv_insert``). ``T`` tokens, ``H``
local query heads, ``HP >= H`` padded heads::

    q              [T, H, 512]   bf16   rows dense (stride 1 on the last dim)
    kv             [T, 512]      bf16   one latent head, already RMS-normed upstream
    q_out          [T, HP, 512]  bf16   written: heads < H as below, heads >= H zero
    k_cache        [NB, S]       uint8  written: fp8_ds_mla layout, S >= block_size*584 (with
                                        kv_mxfp8: DeepSeek-V4.1's MXFP8 records, S >= block_size*528)
    slot_mapping   [T']          T' <= T; row t goes to slot slot_mapping[t]; negative skips
    positions      [T]           row of cos_sin_cache for each token
    cos_sin_cache  [P, 64]       fp32   per position: 32 cos, then 32 sin

Q, per token and head, in fp32 with one rounding to bf16 at the store::

    y = x * 1/sqrt(mean(x^2) + eps)                    (RMSNorm over 512, no weight;
                                                        y = x with apply_q_norm=False)
    GPT-J RoPE on dims 448..511: pair p, e, o = y[448+2p], y[449+2p]
        -> e*cos[p] - o*sin[p], e*sin[p] + o*cos[p]

KV, per inserted row: RoPE on dims 448..511 as above (no norm), rounded to bf16; the 448 NoPE values
in 7 blocks of 64: amax = max(max|x|, 1e-4), e = ceil(log2(amax/448)), fp8 = e4m3(clamp(x * 2^-e,
-448, 448)) (round to nearest even), scale byte e + 127 (UE8M0); a block holding a NaN or an
infinity: scale byte 0xFF, codes 0x7F.

Cache layout ``fp8_ds_mla``: slot s is block b = s // block_size, row i = s % block_size; bytes
[b*S + i*576, +448) hold the fp8 NoPE values, [+448, +576) the 64 roped values as little-endian
bf16; bytes [b*S + block_size*576 + i*8, +8) the 7 scale bytes and one zero byte. No other byte is
written.

``kv_mxfp8`` (DeepSeek-V4.1's sliding-window record, vLLM's ``kv_mxfp8=True``): the whole row, RoPE
dims included, rotated and rounded to bf16 as above, then quantised in 16 blocks of 32 by the same
rule (e4m3 codes, UE8M0 scale bytes, the non-finite rule); slot s's 528 bytes at [b*S + i*528, +528):
the 512 codes, then the 16 scale bytes. No other byte is written.

Traffic per token: reads 1024*H + 1024 + 256 bytes (q, kv, cos/sin row), writes 1024*HP + 584
bytes (q_out, cache row and scales; 528 with kv_mxfp8): bandwidth bound from a few hundred tokens, latency bound below.
"""

from __future__ import annotations


import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops._checks import (
    check_flag, check_fp32_scalar, check_index_tensor, check_size, check_slot_and_position_values, check_tensor,
    check_unit_last_stride, require,
)
from prepfuse.ops import _duplicate_slots
from prepfuse.ops._indices import clamped_positions, wrapped, written_rows
from prepfuse.ops._library import define_op
from prepfuse.ops._math import e4m3_pow2_quant, rope_gptj, ue8m0_bytes

HEAD_DIM = 512
ROPE_DIM = 64
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448
QUANT_BLOCK = 64
N_QUANT_BLOCKS = NOPE_DIM // QUANT_BLOCK  # 7
CACHE_ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: fp8 NoPE + bf16 RoPE
SCALE_BYTES = 8  # 7 UE8M0 scales and one zero byte
SLOT_BYTES = CACHE_ROW_BYTES + SCALE_BYTES  # 584: the least a slot takes in a block
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
MXFP8_BLOCK = 32  # kv_mxfp8: values a UE8M0 scale covers
MXFP8_SCALES = HEAD_DIM // MXFP8_BLOCK  # 16
MXFP8_SLOT_BYTES = HEAD_DIM + MXFP8_SCALES  # 528: a slot's codes, then its scale bytes

SCHEMA = (
    "dsv4_qnorm_rope_kv_insert(Tensor q, Tensor kv, Tensor(a!) q_out, Tensor(b!) k_cache, "
    "Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache, float eps, int block_size, "
    "bool wrap_indices=False, bool apply_q_norm=True, bool kv_mxfp8=False) -> ()"
)


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------
if has_triton():
    import triton
    import triton.language as tl

    from prepfuse.ops._triton_helpers import (
        _amax, _finite, _last_writer, _load_cos_sin, _lock_row, _rotate_pairs, _slot_at, _table_position, _to_bf16,
        _to_e4m3_bits, _unlock_row,
    )

    @triton.jit
    def _rope_pairs(y, cos, sin, SOFT_ROUNDING: tl.constexpr):
        """GPT-J RoPE of the last dim (64 values) of fp32 ``y``, fp32 out in ``y``'s layout
        (``_rotate_pairs``, joined back in registers so the store stays contiguous)."""
        e_rot, o_rot = _rotate_pairs(y, cos, sin, SOFT_ROUNDING)
        return tl.reshape(tl.join(e_rot, o_rot), y.shape)

    @triton.jit
    def _cos_sin_at(pos_at, cos_sin_ptr, stride_cs, max_pos, WRAP: tl.constexpr):
        """The cos and sin of the position at ``pos_at`` (``_table_position``, ``_load_cos_sin``).

        Called after a program's row loads, behind a barrier (a few cycles): the position
        and then its cos/sin are two round trips to memory that the rows need not wait for.
        Loaded at the kernel's top, the position was waited on (for the clamp) before any
        row load was issued, and the cos/sin loads came after the norm's sqrt and division
        (sm_90 SASS): three round trips a program instead of two."""
        return _load_cos_sin(cos_sin_ptr + _table_position(pos_at, max_pos, WRAP) * stride_cs)

    @triton.jit
    def _stored(y, multiplier, FP8: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
        """fp32 values as a DeepSeek-V4 output holds them, rounded once: bf16, or (``FP8``) the
        e4m3fn codes of ``y * multiplier``, saturating at +-448 (a per-tensor scale)."""
        if FP8:
            return _to_e4m3_bits(y * multiplier, SOFT_ROUNDING)
        else:
            return _to_bf16(y, SOFT_ROUNDING)

    @triton.jit
    def _q_heads(
        q_ptr,  # [T, H, 512] bf16
        q_out_ptr,  # [T, HP, 512] bf16, or uint8 (e4m3fn codes) with Q_FP8
        pos_ptr,  # [T] int64 or int32
        cos_sin_ptr,  # [P, 64] fp32
        t,  # the token
        col,  # the program's column, >= 1: heads (col - 1) * BLOCK_H onwards
        H,  # real query heads
        HP,  # padded query heads (q_out.size(1))
        max_pos,  # P: rows of cos_sin_cache
        stride_qt,  # elements between tokens of q
        stride_qh,  # elements between heads of q
        stride_ot,  # elements between tokens of q_out
        stride_oh,  # elements between heads of q_out
        stride_cs,  # elements between positions of cos_sin_cache
        eps,  # RMSNorm epsilon
        q_scale_ptr,  # [1] fp32 multiplier before the e4m3 rounding (read only with Q_FP8)
        BLOCK_H: tl.constexpr,  # query heads per program
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        Q_FP8: tl.constexpr,  # q_out holds e4m3fn codes, not bf16
        WRAP: tl.constexpr,  # positions count from the end when negative (_table_position)
        Q_NORM: tl.constexpr,  # RMS-normed (apply_q_norm), else rotated as it is
    ):
        """One q column of the DeepSeek-V4 kernels: BLOCK_H heads of token t RMS-normed
        (``Q_NORM``), rotated and stored once (``_stored``); heads in [H, HP) stored as +0.0."""
        if (col - 1) * BLOCK_H >= H:
            # only padded heads (H = 16 of 64: three programs in four): +0.0 stored, with
            # none of the norm and RoPE work on zeros that the masked path below would do
            # (zeroing more heads a program was slower: docs/decisions.md).
            heads = (col - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
            d = tl.arange(0, 512)
            out_rows = q_out_ptr + t * stride_ot + heads[:, None] * stride_oh
            if Q_FP8:
                zeros = tl.zeros([BLOCK_H, 512], dtype=tl.uint8)
            else:
                zeros = tl.zeros([BLOCK_H, 512], dtype=tl.bfloat16)
            tl.store(out_rows + d[None, :], zeros, mask=(heads < HP)[:, None])
        else:
            heads = (col - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
            real = heads < H
            d = tl.arange(0, 512)
            q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
            out_rows = q_out_ptr + t * stride_ot + heads[:, None] * stride_oh
            x = tl.load(q_rows + d[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            # The 64 rotated dims read again on their own (the same lines: an L1 hit),
            # so that the rotation costs 64 dims of work per head, not masked work on 512.
            pe = tl.load(q_rows + 448 + tl.arange(0, 64)[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            q_scale_inv = 1.0
            if Q_FP8:
                q_scale_inv = tl.load(q_scale_ptr)
            tl.debug_barrier()  # see _cos_sin_at
            cos, sin = _cos_sin_at(pos_ptr + t, cos_sin_ptr, stride_cs, max_pos, WRAP)
            if Q_NORM:
                mean_sq = tl.sum(x * x, axis=1) * (1.0 / 512)
                # correctly rounded 1/sqrt, as torch computes it, not rsqrt.approx; padded
                # heads get 0 so that they store +0.0 (eps = 0 would make 1/sqrt(0) inf)
                rstd = tl.where(real, tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps)), 0.0)
            else:  # times one: exact
                rstd = tl.where(real, 1.0, 0.0)
            y = x * rstd[:, None]
            stored = (heads < HP)[:, None]
            # padded heads' values are +0.0: times 1, never times a negative or NaN scale
            mult = tl.where(real, q_scale_inv, 1.0)[:, None]
            nope = _stored(y, mult, Q_FP8, SOFT_ROUNDING)
            rot = _stored(_rope_pairs(pe * rstd[:, None], cos, sin, SOFT_ROUNDING), mult, Q_FP8, SOFT_ROUNDING)
            # padded heads: +0.0 exactly, chosen after the rounding (0 * cos with cos < 0 would
            # store -0.0, and triton 3.6's e4m3 conversion of a [2, 512] block on one warp gave
            # the zero rows of a program mixing real and padded heads other codes on an H100)
            tl.store(out_rows + d[None, :], tl.where(real[:, None], nope, tl.zeros_like(nope)),
                     mask=stored & (d < 448)[None, :])
            tl.store(out_rows + 448 + tl.arange(0, 64)[None, :], tl.where(real[:, None], rot, tl.zeros_like(rot)),
                     mask=stored)

    @triton.jit
    def _ue8m0_blocks(x, SOFT_ROUNDING: tl.constexpr):
        """e4m3 code bytes and UE8M0 scale bytes (int32) of fp32 blocks ``x [N, B]``, one
        power-of-two scale a row (``e4m3_pow2_quant``, ``ue8m0_bytes``); a block holding a NaN
        or an infinity has no scale: it is stored as NaN (scale byte 0xFF, every code 0x7F;
        docs/ops.md, non-finite inputs)."""
        amax = _amax(x, 1)
        finite = _finite(amax)
        amax = tl.maximum(amax, 1e-4)
        # e = ceil(log2(amax / 448)) read exactly off amax's bits: with amax = m * 2^E
        # (1 <= m < 2) and 448 = 1.75 * 2^8, e is E - 8, or E - 7 when m > 1.75. No division
        # or log2 whose rounding could flip the ceiling at the (common) exact powers of two.
        amax_bits = amax.to(tl.int32, bitcast=True)
        e = ((amax_bits >> 23) & 0xFF) - 127 - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        # 2^-e, exact; NaN for a block without a scale, whose codes are then all 0x7F (no
        # clamp: |x| * 2^-e <= 448 by the choice of e)
        inv_scale = tl.where(finite, ((127 - e) << 23).to(tl.float32, bitcast=True), float("nan"))
        codes = _to_e4m3_bits(x * inv_scale[:, None], SOFT_ROUNDING)
        return codes, tl.where(finite, tl.minimum(tl.maximum(e + 127, 0), 254), 255)

    @triton.jit
    def _dsv4_qnorm_rope_kv_insert_kernel(
        q_ptr,  # [T, H, 512] bf16
        kv_ptr,  # [T, 512] bf16
        q_out_ptr,  # [T, HP, 512] bf16
        cache_ptr,  # [NB, S] uint8
        slot_ptr,  # [T'] int64
        pos_ptr,  # [T] int64
        cos_sin_ptr,  # [P, 64] fp32
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
        stride_cache_block,  # bytes between cache blocks (S)
        stride_cs,  # elements between positions of cos_sin_cache
        eps,  # RMSNorm epsilon
        block_size,  # tokens per cache block
        BLOCK_H: tl.constexpr,  # query heads per program
        N_COLS: tl.constexpr,  # programs per token: 1 (kv) + cdiv(HP, BLOCK_H) (q)
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        ROPE_U16: tl.constexpr,  # cache base and stride even: store RoPE bytes as uint16
        DEDUPE: tl.constexpr,  # a slot several rows name (_duplicate_slots): 0 off, 1 scan, 2 lock
        SCAN: tl.constexpr,  # with DEDUPE 1: lanes of the slot_mapping scan (>= T')
        WRAP: tl.constexpr,  # slots and positions count from the end when negative (_slot_at)
        Q_NORM: tl.constexpr,  # apply_q_norm
        KV_MXFP8: tl.constexpr,  # the cache holds DeepSeek-V4.1's MXFP8 records, not fp8_ds_mla rows
    ):
        # A 1-D grid of T * N_COLS programs, N_COLS = 1 + cdiv(HP, BLOCK_H): column 0
        # inserts token t's kv row, the others each normalise, rotate and store BLOCK_H
        # heads of q_out. Columns vary fastest, so programs running together stream
        # through q and q_out in address order (and T is not capped at 65535).
        pid = tl.program_id(0).to(tl.int64)
        t = pid // N_COLS
        col = pid % N_COLS

        if col == 0:
            # the row's loads are issued beside the slot's, not after it: the branch waits
            # on one round trip to memory, not two (T = 1 is latency bound)
            kv_row = kv_ptr + t * stride_kvt
            # NoPE: blocks of QB values (fp8_ds_mla 7 of 64, MXFP8 14 of 32); a masked row or
            # two keeps the shape a power of 2
            QB: tl.constexpr = 32 if KV_MXFP8 else 64
            NB: tl.constexpr = 448 // QB
            r = tl.arange(0, 16 if KV_MXFP8 else 8)
            c = tl.arange(0, QB)
            in_nope = (r < NB)[:, None]
            x = tl.load(kv_row + r[:, None] * QB + c[None, :], mask=in_nope, other=0.0).to(tl.float32)
            pe = tl.load(kv_row + 448 + tl.arange(0, 64)).to(tl.float32)
            slot = _slot_at(slot_ptr, t, n_insert, n_slots, WRAP)
            tl.debug_barrier()  # see _cos_sin_at
            kv_cos, kv_sin = _cos_sin_at(pos_ptr + t, cos_sin_ptr, stride_cs, max_pos, WRAP)
            write = (slot >= 0) & (slot < n_slots)
            if DEDUPE == 1:  # the last row naming the slot writes it (_duplicate_slots)
                write = write & _last_writer(slot_ptr, t, slot, n_insert, n_slots, SCAN, WRAP)
            if write:
                blk = slot // block_size
                row = slot % block_size
                if KV_MXFP8:
                    data = cache_ptr + blk * stride_cache_block + row * 528
                    scales = data + 512
                else:
                    data = cache_ptr + blk * stride_cache_block + row * 576
                    scales = cache_ptr + blk * stride_cache_block + block_size * 576 + row * 8
                if DEDUPE == 2:  # the row's data and scale bytes come from one token (_duplicate_slots);
                    # taken before the math, so that the atomic's round trip overlaps the loads'
                    _lock_row(locks_ptr, slot)
                codes, scale_byte = _ue8m0_blocks(x, SOFT_ROUNDING)
                tl.store(data + r[:, None] * QB + c[None, :], codes, mask=in_nope)
                # RoPE on dims 448..511 (no norm), rounded to bf16
                rot = _to_bf16(_rope_pairs(pe, kv_cos, kv_sin, SOFT_ROUNDING), SOFT_ROUNDING)
                if KV_MXFP8:  # quantised too: the last two blocks of 32
                    rot_codes, rot_scale = _ue8m0_blocks(tl.reshape(rot.to(tl.float32), (2, 32)), SOFT_ROUNDING)
                    tl.store(data + 448 + tl.arange(0, 2)[:, None] * 32 + tl.arange(0, 32)[None, :], rot_codes)
                    tl.store(scales + r, scale_byte.to(tl.uint8), mask=r < NB)
                    tl.store(scales + NB + tl.arange(0, 2), rot_scale.to(tl.uint8))
                else:
                    tl.store(scales + r, tl.where(r < NB, scale_byte, 0).to(tl.uint8))
                    bits = rot.to(tl.uint16, bitcast=True)
                    if ROPE_U16:  # the row's bf16 bytes are 2-aligned: 64 two-byte (vector) stores
                        tl.store((data + 448).to(tl.pointer_type(tl.uint16)) + tl.arange(0, 64), bits)
                    else:  # an odd cache stride or base: little-endian byte by byte
                        b = tl.arange(0, 64)
                        tl.store(data + 448 + 2 * b, (bits & 0xFF).to(tl.uint8))
                        tl.store(data + 449 + 2 * b, (bits >> 8).to(tl.uint8))
                if DEDUPE == 2:
                    _unlock_row(locks_ptr, slot)
        else:
            _q_heads(q_ptr, q_out_ptr, pos_ptr, cos_sin_ptr, t, col, H, HP, max_pos, stride_qt, stride_qh, stride_ot,
                     stride_oh, stride_cs, eps, q_ptr, BLOCK_H=BLOCK_H, SOFT_ROUNDING=SOFT_ROUNDING, Q_FP8=False, WRAP=WRAP,
                     Q_NORM=Q_NORM)

def _launch_config(num_tokens: int, padded_heads: int) -> tuple[int, int]:
    """(heads per program, warps per program), from the H200 sweep (bench/README.md).

    Up to T=8 one head on one warp: at these T a program's latency is the time, and one warp
    reduces a head's 512 values (and the kv row's 64-value blocks) in registers, where two warps
    meet through shared memory and barriers. From T=9 to 128 two heads on one warp, for the same
    reason. Above, four heads on two warps: each thread then moves several 16-byte vectors, more
    bytes in flight. The timings: docs/decisions.md (DeepSeek-V4 kernel: heads and warps a program).
    """
    if num_tokens <= 8:
        return 1, 1
    block_h, num_warps = (2, 1) if num_tokens <= 128 else (4, 2)
    # a kv-only call (the pass emits one: q and q_out [T, 0, 512]) has no q heads: one head a
    # program keeps the grid's arithmetic defined (next_power_of_2(0) is 0)
    return min(block_h, max(1, triton.next_power_of_2(padded_heads))), num_warps


def dsv4_qnorm_rope_kv_insert_triton(
    q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size, wrap_indices=False,
    apply_q_norm=True, kv_mxfp8=False, *, launch_config: tuple[int, int] | None = None, dedupe: str | None = None,
) -> None:
    """Launch the fused kernel once (q and kv sides together). Inputs are not checked here.

    ``launch_config`` overrides ``(BLOCK_H, num_warps)``; the benchmark's sweep uses it
    to choose ``_launch_config``'s table. ``dedupe`` ("off", "scan", "lock") overrides
    ``_duplicate_slots.dedupe_mode`` (the benchmark measures each, a GPU test what a write
    without either does).
    """
    num_tokens, num_heads, _ = q.shape
    padded_heads = q_out.shape[1]
    if num_tokens == 0:
        return
    block_h, num_warps = launch_config or _launch_config(num_tokens, padded_heads)
    n_cols = 1 + triton.cdiv(padded_heads, block_h)
    grid = (num_tokens * n_cols,)
    _dsv4_qnorm_rope_kv_insert_kernel[grid](
        q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache,
        _duplicate_slots.row_locks(k_cache.device),
        num_heads, padded_heads, slot_mapping.shape[0],
        k_cache.shape[0] * block_size, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), kv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), cos_sin_cache.stride(0),
        eps, block_size,
        BLOCK_H=block_h,
        N_COLS=n_cols,
        SOFT_ROUNDING=triton_interpret_mode(),
        ROPE_U16=k_cache.data_ptr() % 2 == 0 and k_cache.stride(0) % 2 == 0,
        DEDUPE=_duplicate_slots.dedupe_mode(slot_mapping, dedupe),
        SCAN=_duplicate_slots.scan_block(slot_mapping),
        WRAP=bool(wrap_indices),
        Q_NORM=bool(apply_q_norm),
        KV_MXFP8=bool(kv_mxfp8),
        num_warps=num_warps,
    )


# --------------------------------------------------------------------------------------
# Reference implementation: plain PyTorch, any device, the spec's text step by step
# --------------------------------------------------------------------------------------
def q_prep_reference(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float,
                     apply_q_norm: bool = True) -> torch.Tensor:
    """Normalised (``apply_q_norm``) and rotated q in fp32, [T, H, 512] (the caller rounds once to bf16)."""
    y = q.float()
    if apply_q_norm:
        # The sqrt goes through fp64 and back: that is the correctly rounded fp32 sqrt
        # (torch's vectorised CPU fp32 sqrt is 1 ulp off for some inputs).
        mean_sq = y.square().mean(dim=-1, keepdim=True) + eps
        y = y * mean_sq.double().sqrt().float().reciprocal()
    cs = cos_sin_cache[positions].unsqueeze(1)  # [T, 1, 64]
    rope = rope_gptj(y[..., NOPE_DIM:], cs[..., : ROPE_DIM // 2], cs[..., ROPE_DIM // 2 :])
    return torch.cat((y[..., :NOPE_DIM], rope), dim=-1)


def ue8m0_fp8_quant_reference(x: torch.Tensor, *, non_finite_blocks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-64 UE8M0 e4m3 quantisation of ``x [..., 448]`` fp32.

    Returns (fp8 codes [..., 448] uint8, scale bytes [..., 7] uint8); ``non_finite_blocks``:
    the op's rule for a block holding a NaN or an infinity (``e4m3_pow2_quant``), else the
    models' math, which leaves such a block undefined.
    """
    blocks = x.unflatten(-1, (N_QUANT_BLOCKS, QUANT_BLOCK))
    codes, e = e4m3_pow2_quant(blocks, AMAX_FLOOR, non_finite_blocks=non_finite_blocks)
    return codes.flatten(-2), ue8m0_bytes(e, non_finite_blocks=non_finite_blocks)


def kv_cache_rows_reference(
    kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, non_finite_blocks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes one kv row becomes: (data [T, 576] uint8, scales [T, 8] uint8)."""
    x = kv.float()
    cs = cos_sin_cache[positions]
    rope = rope_gptj(x[:, NOPE_DIM:], cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :]).to(torch.bfloat16)
    codes, scale_bytes = ue8m0_fp8_quant_reference(x[:, :NOPE_DIM], non_finite_blocks=non_finite_blocks)
    data = torch.cat((codes, rope.contiguous().view(torch.uint8)), dim=-1)
    scales = torch.cat((scale_bytes, scale_bytes.new_zeros(scale_bytes.shape[0], 1)), dim=-1)
    return data, scales


def kv_mxfp8_records_reference(
    kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, non_finite_blocks: bool = True,
) -> torch.Tensor:
    """The 528 bytes one kv row becomes in DeepSeek-V4.1's MXFP8 record [T, 528] uint8: dims
    448..511 rotated and rounded to bf16, then the whole row in 16 blocks of 32 (e4m3 codes,
    then the UE8M0 scale bytes)."""
    x = kv.float()
    cs = cos_sin_cache[positions]
    rope = rope_gptj(x[:, NOPE_DIM:], cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :]).to(torch.bfloat16).float()
    blocks = torch.cat((x[:, :NOPE_DIM], rope), dim=-1).unflatten(-1, (MXFP8_SCALES, MXFP8_BLOCK))
    codes, e = e4m3_pow2_quant(blocks, AMAX_FLOOR, non_finite_blocks=non_finite_blocks)
    return torch.cat((codes.flatten(-2), ue8m0_bytes(e, non_finite_blocks=non_finite_blocks)), dim=-1)


def write_mxfp8_records(k_cache: torch.Tensor, records: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
    """Write records [T', 528] at ``slots``, which must all be valid."""
    blk, row = (slots // block_size).unsqueeze(1), (slots % block_size).unsqueeze(1)
    k_cache[blk, row * MXFP8_SLOT_BYTES + torch.arange(MXFP8_SLOT_BYTES, device=slots.device)] = records


def insert_rows_reference(
    k_cache: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int
) -> None:
    """Write rows into their slots of the fp8_ds_mla cache as the kernel does
    (``_indices.written_rows``: negative and out-of-cache slots skipped, a duplicated slot
    written whole by its last token).

    The skip is a boolean mask, i.e. a host sync on CUDA: this is the oracle, not a
    capturable path (``write_rows`` is the write alone, for valid, distinct slots).
    """
    keep = written_rows(slots, k_cache.shape[0] * block_size)
    write_rows(k_cache, data[keep], scales[keep], slots[keep], block_size)


def write_rows(k_cache: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
    """Write rows [T', 576] and scale bytes [T', 8] at ``slots``, which must all be valid."""
    blk, row = (slots // block_size).unsqueeze(1), (slots % block_size).unsqueeze(1)
    data_cols = row * CACHE_ROW_BYTES + torch.arange(CACHE_ROW_BYTES, device=slots.device)
    scale_cols = block_size * CACHE_ROW_BYTES + row * SCALE_BYTES + torch.arange(SCALE_BYTES, device=slots.device)
    k_cache[blk, data_cols] = data
    k_cache[blk, scale_cols] = scales


def unchecked_reference(
    q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size, wrap_indices=False,
    apply_q_norm=True, kv_mxfp8=False, *, as_baseline: bool = False,
) -> None:
    """The op in plain PyTorch, unchecked (``define_op`` runs the checks first).

    ``as_baseline``: the benchmarks' unfused baseline (``prepfuse.models.dsv4_prep_unfused``),
    capturable, as model code writes it: every index value is trusted valid (slots distinct
    and in the cache, positions in the table), so every row is written without filtering
    skipped (negative) slots, which needs a boolean mask, i.e. a host sync, and positions are
    read as they are; blocks are quantised without the non-finite rule (the models' math)."""
    if wrap_indices:  # counted from the end when negative, as PyTorch indexing does
        positions = wrapped(positions, cos_sin_cache.shape[0])
        slot_mapping = wrapped(slot_mapping, k_cache.shape[0] * block_size)
    if not as_baseline:  # the kernel's reading of positions outside the table (``_indices``)
        positions = clamped_positions(positions, cos_sin_cache.shape[0])
    num_heads = q.shape[1]
    q_out[:, :num_heads] = q_prep_reference(q, positions, cos_sin_cache, eps, apply_q_norm).to(torch.bfloat16)
    q_out[:, num_heads:] = 0
    n_insert = slot_mapping.shape[0]
    if kv_mxfp8:
        records = kv_mxfp8_records_reference(kv[:n_insert], positions[:n_insert], cos_sin_cache,
                                             non_finite_blocks=not as_baseline)
        keep = slice(None) if as_baseline else written_rows(slot_mapping, k_cache.shape[0] * block_size)
        write_mxfp8_records(k_cache, records[keep], slot_mapping[keep], block_size)
        return
    data, scales = kv_cache_rows_reference(kv[:n_insert], positions[:n_insert], cos_sin_cache,
                                           non_finite_blocks=not as_baseline)
    (write_rows if as_baseline else insert_rows_reference)(k_cache, data, scales, slot_mapping, block_size)


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------
def check_inputs(q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size,
                 wrap_indices=False, apply_q_norm=True, kv_mxfp8=False) -> None:
    """Dtypes, shapes, devices and strides; raises ValueError naming the argument.

    Runs in the eager paths and in the fake impl (where sizes may be symbolic).
    """
    device = check_shared_inputs(q, kv, q_out, slot_mapping, positions, cos_sin_cache, eps, block_size, wrap_indices,
                                 apply_q_norm=apply_q_norm)
    check_flag("kv_mxfp8", kv_mxfp8)
    check_tensor("k_cache", k_cache, dtype=torch.uint8, ndim=2, device=device)
    check_unit_last_stride("k_cache", k_cache)
    slot_bytes, what = (MXFP8_SLOT_BYTES, "512 codes + 16 scale bytes") if kv_mxfp8 else \
        (SLOT_BYTES, "576 data + 8 scale bytes")
    require(
        k_cache.stride(0) >= block_size * slot_bytes and k_cache.shape[1] >= block_size * slot_bytes,
        f"k_cache: a block of {block_size} slots needs {block_size * slot_bytes} bytes "
        f"({what} per slot), got shape {tuple(k_cache.shape)} strides {tuple(k_cache.stride())}",
    )


def check_shared_inputs(q, kv, q_out, slot_mapping, positions, cos_sin_cache, eps, block_size, wrap_indices, *,
                        apply_q_norm=True,
                        q_out_dtype: torch.dtype | tuple[torch.dtype, ...] = torch.bfloat16) -> torch.device:
    """Everything but the cache, as both DeepSeek-V4 ops check it (this one and the full-row
    cache's, whose ``q_out`` may hold e4m3 codes: ``q_out_dtype``). Returns q's device."""
    device = q.device if isinstance(q, torch.Tensor) else None  # check_tensor names a non-tensor q
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3, device=device)
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=2, device=device)
    check_tensor("q_out", q_out, dtype=q_out_dtype, ndim=3, device=device)
    check_index_tensor("slot_mapping", slot_mapping, device)
    check_index_tensor("positions", positions, device)
    check_tensor("cos_sin_cache", cos_sin_cache, dtype=torch.float32, ndim=2, device=device)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    check_size("q", q, 2, HEAD_DIM, "the head dim")
    check_size("kv", kv, 0, num_tokens, "T, q's token count")
    check_size("kv", kv, 1, HEAD_DIM, "the head dim")
    check_size("q_out", q_out, 0, num_tokens, "T, q's token count")
    check_size("q_out", q_out, 2, HEAD_DIM, "the head dim")
    require(
        q_out.shape[1] >= num_heads,
        f"q_out: needs at least as many (padded) heads as q, got q_out.size(1)={q_out.shape[1]} < H={num_heads}",
    )
    check_size("positions", positions, 0, num_tokens, "T, q's token count")
    require(
        slot_mapping.shape[0] <= num_tokens,
        f"slot_mapping: has {slot_mapping.shape[0]} rows, more than T={num_tokens} tokens",
    )
    check_size("cos_sin_cache", cos_sin_cache, 1, ROPE_DIM, "32 cos + 32 sin values")
    named = (
        ("q", q), ("kv", kv), ("q_out", q_out), ("cos_sin_cache", cos_sin_cache),
        ("slot_mapping", slot_mapping), ("positions", positions),
    )
    for name, t in named:
        check_unit_last_stride(name, t)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
    check_fp32_scalar("eps", eps, at_least=0.0)
    check_flag("wrap_indices", wrap_indices)
    check_flag("apply_q_norm", apply_q_norm)
    return device


def check_index_values(k_cache, slot_mapping, positions, cos_sin_cache, block_size, wrap_indices=False) -> None:
    """Slot and position values in range (eager use; skipped while capturing a graph)."""
    check_slot_and_position_values(slot_mapping, k_cache.shape[0], block_size, positions, cos_sin_cache.shape[0],
                                   wrap=wrap_indices)


# --------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------


_OP = define_op(
    SCHEMA, check=check_inputs, index_check=check_index_values, reference=unchecked_reference, triton=dsv4_qnorm_rope_kv_insert_triton,
)
dsv4_qnorm_rope_kv_insert = _OP.packet
# the plain-PyTorch path as a function, checks included (tests and benchmarks call it)
dsv4_qnorm_rope_kv_insert_reference = _OP.reference
DSV4_QNORM_ROPE_KV_INSERT = dsv4_qnorm_rope_kv_insert.default
