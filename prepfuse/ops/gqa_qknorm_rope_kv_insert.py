"""GQA (Qwen3 / Llama style) attention-input preparation as one fused, mutating out-variant op.

``prepfuse::gqa_qknorm_rope_kv_insert`` (``SCHEMA``, held verbatim by ``tests/golden/schemas.txt``;
every argument, layout and error: ``docs/ops.md#gqa_qknorm_rope_kv_insert``). ``T`` tokens, ``Hq``
and ``Hkv`` heads, head size ``D`` in {64, 128, 256}, rotary dim ``R``::

    qkv            [T, (Hq+2*Hkv)*D]  bf16   q heads, k heads, v heads; last dim dense
    q/k_norm_weight [D] or None       bf16 (Qwen3) or fp32 (Gemma-3's 1 + w); both or neither
    q_out          [T, Hq, D]         bf16   written: normed and roped q
    k/v_cache      [NB, BS, Hkv, D]   bf16, float8_e4m3fn or uint8 e4m3fn codes; written at slots
    slot_mapping   [T']               T' <= T; slot s is block s // BS, row s % BS; negative skips
    positions      [T] or None        row of the cos/sin tables (None: token t reads row t)
    cos_sin_cache  [P, R] fp32        R/2 cos then R/2 sin ([P, 2R] with full_cos_sin), or cos, sin
    kv_scale, v_scale                 fp32 device scalars, given iff the caches hold fp8 codes

Q and K, per token and head (x: the head's D values in fp32)::

    bf16 weight:   x = bf16(w * bf16(x * rstd)),  rstd = 1/sqrt(mean(x^2) + eps) correctly rounded
                   (k's rows: k_eps in place of eps where it is given)
    fp32 weight:   x = bf16((x * rstd) * w)
    RoPE on [0, R): NeoX pairs (i, i + R/2), GPT-J (2i, 2i + 1); dims [R, D) pass through
        a' = a*cos - b*sin,  b' = b*cos + a*sin     (each product rounded: no FMA; one bf16 rounding)
        full_cos_sin: dim j rotated by entry j, x*cos + rotate_half(x)*sin as written

V as is. Cache rows: bf16, or e4m3(clamp(fp32(bf16 value) / kv_scale, -448, 448)), round to nearest
even (a true division, vLLM's scaled_convert); fp8_saturate=False stores NaN with the value's sign
where |x| > 464, as c10's cast. No byte of other slots, skipped rows or rows t >= T' is written.

Why these roundings: the norm is Hugging Face's Qwen3RMSNorm step for step (bf16 before the weight
multiply; bit for bit on the CPU), and RoPE in fp32 with one rounding equals HF's formula on
``q.float()`` bit for bit, the more accurate of the two against HF's all-bf16 evaluation (at most
about 2^-7 * (|a| + |b|) apart; docs/decisions.md).

Traffic per token: reads (Hq + 2*Hkv)*D*2 bytes of qkv and a 4R-byte cos/sin row (re-read from L1/L2
by every q and k program, as are the 2*D*2 weight bytes); writes Hq*D*2 bytes of q_out and
2*Hkv*D*c bytes of cache (c = 2 for bf16, 1 for fp8) for inserted rows. Qwen3-8B (Hq 32, Hkv 8,
D 128), bf16 cache: 12288 B read and 12288 B written per token; bandwidth bound above a few hundred
tokens, latency bound below.
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
from prepfuse.ops._math import rope_gptj, rope_neox

HEAD_DIMS = (64, 128, 256)
FP8_MAX = 448.0
# how k and v reach the cache (the kernel's CACHE_FP8): bf16 as is; e4m3fn codes saturating
# at +-448 (vLLM's scaled_convert, torch 2.13's cast); or NaN where a value rounds past 448,
# |x| > 464 (c10's fp8e4m3fn_from_fp32_value: torch 2.11's CUDA cast, ``fp8_saturate=False``)
FP8_OFF, FP8_SATURATE, FP8_OVERFLOW_NAN = 0, 1, 2
FP8_OVERFLOW = 464.0  # the midpoint of 448 and 480 (the code past 448): ties go to 448
# caches of e4m3fn codes: as float8_e4m3fn, or as the uint8 bytes vLLM allocates for "fp8"
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
CACHE_DTYPES = (torch.bfloat16, *FP8_CACHE_DTYPES)
# bf16: applied to the bf16-rounded normed value (Qwen3); fp32: in fp32 before one rounding (Gemma-3)
NORM_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)

SCHEMA = (
    "gqa_qknorm_rope_kv_insert(Tensor qkv, Tensor? q_norm_weight, Tensor? k_norm_weight, "
    "Tensor(a!) q_out, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor? positions, "
    "Tensor? cos_sin_cache, Tensor? kv_scale, int num_q_heads, int num_kv_heads, bool is_neox, float eps, "
    "bool full_cos_sin=False, Tensor? cos=None, Tensor? sin=None, bool fp8_saturate=True, bool wrap_indices=False, "
    "Tensor? v_scale=None, float? k_eps=None) -> ()"
)
# the cos and sin operands' dtypes: read as fp32 (a bf16 value widens exactly)
COS_SIN_DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------
if has_triton():
    import triton
    import triton.language as tl

    from prepfuse.ops._triton_helpers import (
        _e4m3_quotient, _last_writer, _lock_row, _mul_rn, _slot_at, _slot_block_row, _table_position, _to_bf16,
        _to_e4m3_bits,
        _unlock_row,
    )

    @triton.jit
    def _norm_weight(w_ptr, dims, HAS_NORM: tl.constexpr):
        """The norm weight at ``dims [1, N]`` as fp32 (1.0 without the norm: never read)."""
        if HAS_NORM:
            return tl.load(w_ptr + dims).to(tl.float32)
        else:
            return 1.0

    @triton.jit
    def _weighted(x, rstd, w, HAS_NORM: tl.constexpr, W_FP32: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
        """HF Qwen3RMSNorm's last two steps on fp32 ``x [BLOCK_H, N]`` with the weight ``w
        [1, N]`` (``_norm_weight``) of those dims: round ``x * rstd`` to bf16, then times the
        bf16 weight (exact in fp32: two 8-bit significands), rounded again. With an fp32
        weight (Gemma-3's ``1 + w``): ``(x * rstd) * w`` in fp32, rounded once. Without the
        norm, ``x`` as is."""
        if HAS_NORM:
            if W_FP32:
                x = _to_bf16((x * rstd) * w, SOFT_ROUNDING).to(tl.float32)
            else:
                x = _to_bf16(_to_bf16(x * rstd, SOFT_ROUNDING).to(tl.float32) * w, SOFT_ROUNDING).to(tl.float32)
        return x

    @triton.jit
    def _kv_scale(scale_ptr, QUANT_FP8: tl.constexpr):
        """kv_scale (fp32; 1.0 unread without QUANT_FP8), for a program to load beside its rows:
        loaded where the codes are made, after the norm's correctly rounded sqrt and division
        (slow-path branches no load is hoisted across), it was a round trip of its own
        (docs/decisions.md, GQA kernel: loads before the slot, the norm and the lock)."""
        if QUANT_FP8 != 0:
            return tl.load(scale_ptr)
        else:
            return 1.0

    @triton.jit
    def _store_values(
        ptrs,  # destination elements (uint8 when QUANT_FP8, else bf16)
        values,  # bf16, or fp32 (rounded to bf16 here: the model's bf16 result)
        mask,
        scale,  # fp32 kv_scale, loaded (_kv_scale; unused unless QUANT_FP8)
        QUANT_FP8: tl.constexpr,  # FP8_OFF: bf16; else e4m3fn codes of bf16(values) / kv_scale (FP8_*)
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        STORE_EVICTION: tl.constexpr,  # the stores' L2 eviction policy (_row_eviction)
    ):
        """Store values as bf16, or as the fp8 cache codes of their bf16 rounding:
        saturating at +-448 (FP8_SATURATE), or NaN where the value rounds past 448
        (FP8_OVERFLOW_NAN: |x| > 464, the midpoint to the next binade's first step)."""
        if values.dtype == tl.float32:
            values = _to_bf16(values, SOFT_ROUNDING)
        if QUANT_FP8 != 0:
            # the codes of a true, correctly rounded division (vLLM's scaled_convert), not
            # of x * (1/scale): the product and one FMA correction (_e4m3_quotient)
            scaled = _e4m3_quotient(values.to(tl.float32), scale, SOFT_ROUNDING)
            codes = _to_e4m3_bits(scaled, SOFT_ROUNDING)  # saturating at +-448
            if QUANT_FP8 == 2:  # FP8_OVERFLOW_NAN: the NaN code with the value's sign
                sign = ((scaled.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
                codes = tl.where(tl.abs(scaled) > 464.0, sign | 0x7F, codes)
            tl.store(ptrs, codes, mask=mask, eviction_policy=STORE_EVICTION)
        else:
            tl.store(ptrs, values, mask=mask, eviction_policy=STORE_EVICTION)

    @triton.jit
    def _load_heads(
        src,  # [BLOCK_H] pointers to the first of each row's D bf16 values (a head of a token)
        head_mask,  # [BLOCK_H] which of them are real heads
        HEAD_DIM: tl.constexpr,
        ROT_DIM: tl.constexpr,
        ROT_PAD: tl.constexpr,
        IS_NEOX: tl.constexpr,
        LOAD_EVICTION: tl.constexpr,  # the loads' L2 eviction policy (_row_eviction)
    ):
        """The rows' values as ``_norm_rope_store_loaded`` works them, fp32 ``(x, a, b)``: ``x``
        the whole row ``[BLOCK_H, D]`` where the norm or the unrotated dims need it (else 0.0),
        ``a`` and ``b`` the pair operands: NeoX's two halves of the rotated dims ``[BLOCK_H,
        R/2]``, GPT-J's rotated dims ``[BLOCK_H, R]`` in ``a`` (split in registers later; ``b``
        0.0), or with a rotary dim that is no power of two each lane's value and its pair
        partner's ``[BLOCK_H, ROT_PAD]`` (lane j of NeoX pairs with j +- R/2, of GPT-J with
        j ^ 1). Loading apart from the arithmetic lets the locked kv program issue its rows'
        loads before it takes the lock."""
        HALF: tl.constexpr = ROT_DIM // 2
        head_mask = head_mask[:, None]
        src = src[:, None]
        x = 0.0
        b = 0.0
        if ROT_PAD != ROT_DIM or ROT_DIM < HEAD_DIM or not IS_NEOX:
            x = tl.load(src + tl.arange(0, HEAD_DIM)[None, :], mask=head_mask, other=0.0,
                        eviction_policy=LOAD_EVICTION).to(tl.float32)
        if ROT_PAD != ROT_DIM:
            j = tl.arange(0, ROT_PAD)
            if IS_NEOX:
                partner = tl.where(j < HALF, j + HALF, j - HALF)
            else:
                partner = j ^ 1
            a = tl.load(src + j[None, :], mask=head_mask, other=0.0, eviction_policy=LOAD_EVICTION).to(tl.float32)
            b = tl.load(src + partner[None, :], mask=head_mask, other=0.0, eviction_policy=LOAD_EVICTION).to(tl.float32)
        elif IS_NEOX:
            # the pairs (i, i + R/2) are the two halves of the rotated dims: two contiguous
            # loads (L1 hits after the row's load where there is one)
            i = tl.arange(0, HALF)[None, :]
            a = tl.load(src + i, mask=head_mask, other=0.0, eviction_policy=LOAD_EVICTION).to(tl.float32)
            b = tl.load(src + i + HALF, mask=head_mask, other=0.0, eviction_policy=LOAD_EVICTION).to(tl.float32)
        elif ROT_DIM == HEAD_DIM:
            a = x
        else:
            a = tl.load(src + tl.arange(0, ROT_DIM)[None, :], mask=head_mask, other=0.0,
                        eviction_policy=LOAD_EVICTION).to(tl.float32)
        return x, a, b

    @triton.jit
    def _norm_rope_store_loaded(
        x,  # fp32 rows of _load_heads: the whole row where needed, else 0.0
        a,  # fp32 pair operands of _load_heads
        b,  # fp32 pair partners of _load_heads (NeoX, or a rotary dim that is no power of two)
        dst,  # [BLOCK_H] pointers to each row's first destination element
        head_mask,  # [BLOCK_H] which rows are real heads
        store_ok,  # [BLOCK_H] which rows to store (a k row whose slot is skipped: loads, no store)
        w_ptr,  # [D] bf16 norm weight (unread without HAS_NORM)
        cos_row,  # [BLOCK_H] each row's token's row of the cos table (fp32 or bf16), or [1]: one token's
        sin_row,  # [BLOCK_H] the same rows of the sin table
        eps,  # RMSNorm epsilon
        scale,  # fp32 kv_scale, loaded beside the rows (_kv_scale; unused unless QUANT_FP8)
        HEAD_DIM: tl.constexpr,  # D
        ROT_DIM: tl.constexpr,  # R: dims [0, R) are rotated
        ROT_PAD: tl.constexpr,  # R rounded up to a power of two (register tiles need one)
        IS_NEOX: tl.constexpr,  # pairs (i, i + R/2) if true, else (2i, 2i + 1)
        HAS_NORM: tl.constexpr,  # apply the weighted RMSNorm first
        W_FP32: tl.constexpr,  # the norm weight is fp32, applied in fp32 before one rounding
        FULL_COS_SIN: tl.constexpr,  # the rows hold R entries (one per dim), else R/2 (one per pair)
        QUANT_FP8: tl.constexpr,  # FP8_*: store fp8 cache codes (k), or FP8_OFF: bf16 (q_out, a bf16 cache)
        BLOCK_H: tl.constexpr,  # rows of src and dst (heads of one or more tokens)
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        STORE_EVICTION: tl.constexpr,  # the stores' L2 eviction policy (_row_eviction)
    ):
        """Norm and rotate BLOCK_H loaded rows (heads) and store them: rotated dims [0, R),
        then (partial rotary) the normed dims [R, D) as they are.

        A NeoX pair's two values are loaded and stored where they lie (the rotated dims'
        two halves), not split off a loaded row with a permute: as fast, and simpler. Stores
        take ``store_ok`` so that a k program need not branch on its slot before loading."""
        HALF: tl.constexpr = ROT_DIM // 2
        d = tl.arange(0, HEAD_DIM)[None, :]
        head_mask = head_mask[:, None]
        # the store mask (a where, not an &: the CPU interpreter's & of a loaded scalar's
        # comparison gives no boolean mask)
        keep = tl.where(store_ok[:, None], head_mask, False)
        dst = dst[:, None]
        # rows of one token read one cos/sin row: one load's threads ask for the same addresses
        cos_row = cos_row[:, None]
        sin_row = sin_row[:, None]
        # Every load first: the norm weights and cos/sin do not depend on the rows' values,
        # and the norm's correctly rounded sqrt and division (branches to slow paths) kept
        # the compiler from issuing loads written after them any earlier (sm_90 SASS): a
        # second round trip to memory after the norm, in every program.
        if ROT_DIM < HEAD_DIM:
            w_rest = _norm_weight(w_ptr, d, HAS_NORM)
        if ROT_PAD != ROT_DIM:
            # a rotary dim that is no power of two (R = 44, 96 of D = 128): each lane j < R
            # holds its own value and its pair partner's (_load_heads), since pairs cannot be
            # split off a padded tile in registers; both use cos/sin column j % (R/2) (NeoX)
            # resp. j // 2 (GPT-J). Same products, same roundings as the paths below.
            j = tl.arange(0, ROT_PAD)
            if IS_NEOX:
                first = j < HALF
                partner = tl.where(first, j + HALF, j - HALF)
                column = tl.where(first, j, j - HALF)
            else:
                first = (j % 2) == 0
                partner = j ^ 1
                column = j // 2
            in_rot = j < ROT_DIM
            entry = j if FULL_COS_SIN else column  # lane j's own entry of R-wide cos/sin, else its pair's
            cos = tl.load(cos_row + entry[None, :], mask=in_rot[None, :], other=0.0).to(tl.float32)
            sin = tl.load(sin_row + entry[None, :], mask=in_rot[None, :], other=0.0).to(tl.float32)
            w_j = _norm_weight(w_ptr, j[None, :], HAS_NORM)
            w_p = _norm_weight(w_ptr, partner[None, :], HAS_NORM)
        else:
            i = tl.arange(0, HALF)
            if IS_NEOX:
                ia = i[None, :]
                ib = ia + HALF
            else:
                # GPT-J pairs (2i, 2i + 1) are neighbours: split off the row in registers
                # (a thread holds both of a pair, so no value changes lanes)
                ia = 2 * i[None, :]
                ib = ia + 1
            if FULL_COS_SIN:  # a and b each read their own dim's entry of the R-wide cos and sin
                cos_a = tl.load(cos_row + ia).to(tl.float32)
                sin_a = tl.load(sin_row + ia).to(tl.float32)
                cos_b = tl.load(cos_row + ib).to(tl.float32)
                sin_b = tl.load(sin_row + ib).to(tl.float32)
            else:
                cos_a = tl.load(cos_row + i[None, :]).to(tl.float32)
                sin_a = tl.load(sin_row + i[None, :]).to(tl.float32)
                cos_b = cos_a
                sin_b = sin_a
            w_a = _norm_weight(w_ptr, ia, HAS_NORM)
            w_b = _norm_weight(w_ptr, ib, HAS_NORM)
        rstd = 1.0
        if HAS_NORM:
            if ROT_PAD == ROT_DIM and ROT_DIM == HEAD_DIM and IS_NEOX:  # the halves are the whole row
                mean_sq = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) * (1.0 / HEAD_DIM)
            else:
                mean_sq = tl.sum(x * x, axis=1) * (1.0 / HEAD_DIM)  # D is a power of 2: exact scaling
            # correctly rounded 1/sqrt, as the reference computes it, not rsqrt.approx
            rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))[:, None]
        if ROT_DIM < HEAD_DIM:
            _store_values(dst + d, _weighted(x, rstd, w_rest, HAS_NORM, W_FP32, SOFT_ROUNDING),
                          keep & (d >= ROT_DIM), scale, QUANT_FP8, SOFT_ROUNDING, STORE_EVICTION)
        if ROT_PAD != ROT_DIM:
            xj = _weighted(a, rstd, w_j, HAS_NORM, W_FP32, SOFT_ROUNDING)
            xp = _weighted(b, rstd, w_p, HAS_NORM, W_FP32, SOFT_ROUNDING)
            # first of a pair: a*cos - b*sin; second: b*cos + a*sin (each product rounded)
            rot = tl.where(first[None, :], _mul_rn(xj, cos, SOFT_ROUNDING) - _mul_rn(xp, sin, SOFT_ROUNDING),
                           _mul_rn(xj, cos, SOFT_ROUNDING) + _mul_rn(xp, sin, SOFT_ROUNDING))
            _store_values(dst + j[None, :], rot, keep & in_rot[None, :], scale, QUANT_FP8, SOFT_ROUNDING,
                          STORE_EVICTION)
        else:
            if not IS_NEOX:
                a, b = tl.split(tl.reshape(a, [BLOCK_H, HALF, 2]))
            a = _weighted(a, rstd, w_a, HAS_NORM, W_FP32, SOFT_ROUNDING)
            b = _weighted(b, rstd, w_b, HAS_NORM, W_FP32, SOFT_ROUNDING)
            # a' = a*cos - b*sin, b' = b*cos + a*sin, each product rounded (never an FMA)
            a_rot = _mul_rn(a, cos_a, SOFT_ROUNDING) - _mul_rn(b, sin_a, SOFT_ROUNDING)
            b_rot = _mul_rn(b, cos_b, SOFT_ROUNDING) + _mul_rn(a, sin_b, SOFT_ROUNDING)
            if IS_NEOX:
                _store_values(dst + ia, a_rot, keep, scale, QUANT_FP8, SOFT_ROUNDING, STORE_EVICTION)
                _store_values(dst + ib, b_rot, keep, scale, QUANT_FP8, SOFT_ROUNDING, STORE_EVICTION)
            else:
                rot = tl.reshape(tl.join(a_rot, b_rot), [BLOCK_H, ROT_DIM])
                r = tl.arange(0, ROT_DIM)[None, :]
                _store_values(dst + r, rot, keep, scale, QUANT_FP8, SOFT_ROUNDING, STORE_EVICTION)

    @triton.jit
    def _norm_rope_store_heads(
        src, dst, head_mask, store_ok, w_ptr, cos_row, sin_row, eps, scale_ptr,
        HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
        HAS_NORM: tl.constexpr, W_FP32: tl.constexpr, FULL_COS_SIN: tl.constexpr, QUANT_FP8: tl.constexpr,
        BLOCK_H: tl.constexpr, SOFT_ROUNDING: tl.constexpr, LOAD_EVICTION: tl.constexpr, STORE_EVICTION: tl.constexpr,
    ):
        """Load BLOCK_H rows (``_load_heads``: src ``[BLOCK_H]`` row pointers, head_mask the
        real heads), norm, rotate and store them (``_norm_rope_store_loaded``): a q or k column."""
        x, a, b = _load_heads(src, head_mask, HEAD_DIM, ROT_DIM, ROT_PAD, IS_NEOX, LOAD_EVICTION)
        scale = _kv_scale(scale_ptr, QUANT_FP8)
        _norm_rope_store_loaded(
            x, a, b, dst, head_mask, store_ok, w_ptr, cos_row, sin_row, eps, scale, HEAD_DIM, ROT_DIM,
            ROT_PAD, IS_NEOX, HAS_NORM, W_FP32, FULL_COS_SIN, QUANT_FP8, BLOCK_H, SOFT_ROUNDING, STORE_EVICTION,
        )

    @triton.jit
    def _slot_destination(
        cache_ptr,  # k_cache or v_cache
        stride_b,  # elements between its blocks
        stride_r,  # elements between rows (slots) of a block
        slot,  # [ROWS] each row's token's slot, loaded (-1 past T')
        live,  # [ROWS] whether the row's token exists
        t,  # [ROWS] each row's token
        slot_ptr,  # [T'] int64 slot_mapping (the scan reads it whole)
        n_insert,  # T'
        n_slots,  # NB * BS
        block_size,  # BS
        DEDUPE: tl.constexpr,  # 0 off, 1 scan (_duplicate_slots; the locked path has its own code)
        SCAN: tl.constexpr,  # with DEDUPE 1: lanes of the slot_mapping scan (>= T')
        SLOTS_U32: tl.constexpr,  # NB * BS < 2^32: block and row in 32-bit arithmetic
        WRAP: tl.constexpr,  # slots count from the cache's end when negative (_slot_at)
    ):
        """``(dst, insert)``: each row's slot in the cache (head 0; slot 0 where it is
        skipped) and whether it is written. Called after the program's loads are issued,
        so that nothing that waits for the slot stands in front of them."""
        insert = live & (slot >= 0) & (slot < n_slots)
        if DEDUPE == 1:
            # TOKENS = 1 (the launcher's rule): the rows are one token's, which stores
            # them only if no later row names its slot; its k and v programs decide alike
            insert = tl.where(_last_writer(slot_ptr, t, slot, n_insert, n_slots, SCAN, WRAP), insert, False)
        blk, row = _slot_block_row(tl.where(insert, slot, 0), block_size, SLOTS_U32)
        return cache_ptr + blk * stride_b + row * stride_r, insert

    @triton.jit
    def _insert_kv_column(
        c,  # the kv column: k heads c * HEADS + hb for c < KV_COLS, else v heads (c - KV_COLS) * HEADS + hb
        hb,  # [ROWS] each row's head within the column
        k_src,  # [ROWS] pointers to each row's token's k heads (k_ptr + t * stride_kt)
        v_src,  # [ROWS] the same for v
        k_cache_ptr,  # k_cache
        v_cache_ptr,  # v_cache
        slot,  # [ROWS] each row's token's slot, loaded, not yet compared
        live,  # [ROWS] whether the row's token exists
        t,  # [ROWS] each row's token
        slot_ptr,  # [T'] slot_mapping (the scan's)
        n_insert,  # T'
        n_slots,  # NB * BS
        block_size,  # BS
        stride_kb,  # elements between blocks of k_cache
        stride_kr,  # elements between rows of a k_cache block
        stride_kh,  # elements between heads of k_cache
        stride_vb,  # elements between blocks of v_cache
        stride_vr,  # elements between rows of a v_cache block
        stride_vh,  # elements between heads of v_cache
        k_w_ptr,  # [D] k norm weight (unread without HAS_NORM)
        cos_row,  # [ROWS] each row's token's row of the cos table, or [1]: one token's
        sin_row,  # [ROWS] the same of the sin table
        Hkv,  # kv heads
        eps,  # RMSNorm epsilon
        scale_ptr,  # [1] fp32 kv_scale of the k rows (unread unless CACHE_FP8)
        v_scale_ptr,  # [1] fp32 scale of the v rows (kv_scale's own pointer where one scale serves both)
        HEAD_DIM: tl.constexpr,
        ROT_DIM: tl.constexpr,
        ROT_PAD: tl.constexpr,
        IS_NEOX: tl.constexpr,
        HAS_NORM: tl.constexpr,
        W_FP32: tl.constexpr,
        FULL_COS_SIN: tl.constexpr,
        CACHE_FP8: tl.constexpr,
        HEADS: tl.constexpr,  # kv heads per column (KV_BLOCK)
        ROWS: tl.constexpr,  # rows of the tile (tokens x heads)
        KV_COLS: tl.constexpr,  # k columns (as many v columns follow)
        DEDUPE: tl.constexpr,  # as _slot_destination's
        SCAN: tl.constexpr,
        SLOTS_U32: tl.constexpr,
        SOFT_ROUNDING: tl.constexpr,
        LOAD_EVICTION: tl.constexpr,  # the row loads' L2 eviction policy (_row_eviction)
        STORE_EVICTION: tl.constexpr,  # the stores' (_row_eviction)
        WRAP: tl.constexpr,  # as _slot_destination's
    ):
        """One k or v column of the cache insert: k rows normed, rotated and stored, v rows
        copied or quantised (the kernel's separate k and v programs, T' <= 1024).

        Each program issues its rows' loads first and only then works on the slot
        (``_slot_destination``): the slot's compares and int64 division (a branch, see
        ``_slot_block_row``) in front of them cost a k or v program a second round trip to
        memory (docs/decisions.md, GQA kernel: loads before the slot, the norm and the lock)."""
        if c < KV_COLS:
            heads = c * HEADS + hb
            real = heads < Hkv
            x, a, b = _load_heads(k_src + heads * HEAD_DIM, real, HEAD_DIM, ROT_DIM, ROT_PAD, IS_NEOX, LOAD_EVICTION)
            scale = _kv_scale(scale_ptr, CACHE_FP8)
            k_dst, insert = _slot_destination(k_cache_ptr, stride_kb, stride_kr, slot, live, t, slot_ptr, n_insert,
                                              n_slots, block_size, DEDUPE, SCAN, SLOTS_U32, WRAP)
            _norm_rope_store_loaded(
                x, a, b, k_dst + heads * stride_kh, real, insert, k_w_ptr, cos_row, sin_row, eps, scale, HEAD_DIM,
                ROT_DIM, ROT_PAD, IS_NEOX, HAS_NORM, W_FP32, FULL_COS_SIN, CACHE_FP8, ROWS, SOFT_ROUNDING,
                STORE_EVICTION,
            )
        else:
            heads = (c - KV_COLS) * HEADS + hb
            v_real = (heads < Hkv)[:, None]  # (triton merges a name both branches bind: not `real`)
            d = tl.arange(0, HEAD_DIM)[None, :]
            v = tl.load((v_src + heads * HEAD_DIM)[:, None] + d, mask=v_real, eviction_policy=LOAD_EVICTION)
            scale = _kv_scale(v_scale_ptr, CACHE_FP8)
            v_dst, insert = _slot_destination(v_cache_ptr, stride_vb, stride_vr, slot, live, t, slot_ptr, n_insert,
                                              n_slots, block_size, DEDUPE, SCAN, SLOTS_U32, WRAP)
            _store_values((v_dst + heads * stride_vh)[:, None] + d, v, tl.where(insert[:, None], v_real, False),
                          scale, CACHE_FP8, SOFT_ROUNDING, STORE_EVICTION)

    @triton.jit
    def _load_kv_heads(
        k_src,  # a token's k heads (k_ptr + t * stride_kt)
        v_src,  # its v heads
        heads,  # [KV_BLOCK] the kv heads of one step of the locked kv program
        Hkv,  # kv heads
        HEAD_DIM: tl.constexpr,
        ROT_DIM: tl.constexpr,
        ROT_PAD: tl.constexpr,
        IS_NEOX: tl.constexpr,
        LOAD_EVICTION: tl.constexpr,  # the loads' L2 eviction policy (_row_eviction)
    ):
        """One lock step's rows, loaded apart from their arithmetic: ``(real, v, x, a, b)``,
        which of ``heads`` exist, the v rows ``[KV_BLOCK, D]`` as they are stored, and the k
        rows as ``_load_heads`` gives them."""
        real = heads < Hkv
        v = tl.load((v_src + heads * HEAD_DIM)[:, None] + tl.arange(0, HEAD_DIM)[None, :], mask=real[:, None],
                    eviction_policy=LOAD_EVICTION)
        x, a, b = _load_heads(k_src + heads * HEAD_DIM, real, HEAD_DIM, ROT_DIM, ROT_PAD, IS_NEOX, LOAD_EVICTION)
        return real, v, x, a, b

    @triton.jit
    def _token_rows(
        tok,  # the program's token block: tokens tok * TOKENS + [0, TOKENS)
        n_tokens,  # T
        pos_ptr,  # [T] int64 (unread without HAS_POSITIONS)
        max_pos,  # P: rows of the cos and sin tables
        cos_ptr,  # the cos table
        sin_ptr,  # the sin table
        stride_cos,  # elements between rows of the cos table
        stride_sin,  # elements between rows of the sin table
        HEADS: tl.constexpr,  # heads per token of the tile
        TOKENS: tl.constexpr,  # tokens of the tile (a power of two)
        HAS_POSITIONS: tl.constexpr,  # token t reads row positions[t], else row t
        WRAP: tl.constexpr,  # a negative position counts from the table's end (_table_position)
    ):
        """The rows of a program's TOKENS x HEADS tile (row r: token r // HEADS, head r % HEADS):
        ``(t, hb, live, cos_row, sin_row)``, each row's token (clamped to T - 1), head within
        the column, whether the token exists, and its token's cos and sin table rows. With one
        token a program, t, the position and the table rows are scalars ([1]-shaped pointers,
        broadcast over the heads): one load each, not one per row. A [HEADS, R/2] tile of
        equal addresses (one pointer a row, as TOKENS > 1 needs) costs registers and was no
        faster (docs/decisions.md, GQA kernel: vector row loads and per-token cos/sin)."""
        r = tl.arange(0, TOKENS * HEADS)
        hb = r % HEADS
        if TOKENS == 1:
            t = tok  # < T: the grid has one set of columns per token
            live = hb >= 0
        else:
            t = tok * TOKENS + r // HEADS
            live = t < n_tokens
            t = tl.minimum(t, n_tokens - 1)
        if HAS_POSITIONS:
            pos = _table_position(pos_ptr + t, max_pos, WRAP)
        else:  # the token's index is its position (clamped into the tables as well)
            pos = tl.minimum(t, max_pos - 1)
        cos_row = cos_ptr + pos * stride_cos + tl.zeros([1], dtype=tl.int32)
        sin_row = sin_ptr + pos * stride_sin + tl.zeros([1], dtype=tl.int32)
        return t, hb, live, cos_row, sin_row

    @triton.jit
    def _gqa_qknorm_rope_kv_insert_kernel(
        q_ptr,  # [T, Hq * D] bf16: q heads (qkv's first columns, or a separate q)
        k_ptr,  # [T, Hkv * D] bf16: k heads
        v_ptr,  # [T, Hkv * D] bf16: v heads
        q_w_ptr,  # [D] bf16 q norm weight (unread without HAS_NORM)
        k_w_ptr,  # [D] bf16 k norm weight (unread without HAS_NORM)
        q_out_ptr,  # [T, Hq, D] bf16
        k_cache_ptr,  # [NB, BS, Hkv, D] bf16, or uint8 codes of an fp8 cache
        v_cache_ptr,  # [NB, BS, Hkv, D] as k_cache
        slot_ptr,  # [T'] int64
        pos_ptr,  # [T] int64 (unread without HAS_POSITIONS)
        cos_ptr,  # [P, R/2] fp32 or bf16 ([P, R] with FULL_COS_SIN): the cos table
        sin_ptr,  # the sin table, like cos
        scale_ptr,  # [1] fp32 kv_scale (unread unless CACHE_FP8)
        v_scale_ptr,  # [1] fp32 scale of the v rows (scale_ptr itself where one scale serves both)
        locks_ptr,  # [N_ROW_LOCKS] int32 row locks (_duplicate_slots; read with DEDUPE_LOCK)
        Hq,  # query heads
        Hkv,  # kv heads
        n_tokens,  # T
        n_insert,  # T': rows inserted into the caches
        n_slots,  # NB * BS: slots the caches hold
        max_pos,  # P: rows of the cos and sin tables
        stride_qt,  # elements between tokens of q
        stride_kt,  # elements between tokens of k
        stride_vt,  # elements between tokens of v
        stride_ot,  # elements between tokens of q_out
        stride_oh,  # elements between heads of q_out
        stride_kb,  # elements between blocks of k_cache
        stride_kr,  # elements between rows (slots) of a k_cache block
        stride_kh,  # elements between heads of k_cache
        stride_vb,  # elements between blocks of v_cache
        stride_vr,  # elements between rows (slots) of a v_cache block
        stride_vh,  # elements between heads of v_cache
        stride_cos,  # elements between rows of the cos table
        stride_sin,  # elements between rows of the sin table
        eps,  # RMSNorm epsilon of q (and of k unless k_eps is given)
        k_eps,  # RMSNorm epsilon of k
        block_size,  # BS: slots per cache block
        HEAD_DIM: tl.constexpr,  # D
        ROT_DIM: tl.constexpr,  # R
        ROT_PAD: tl.constexpr,  # R rounded up to a power of two
        IS_NEOX: tl.constexpr,  # rotate-half pairs, else GPT-J interleaved pairs
        HAS_NORM: tl.constexpr,  # weighted RMSNorm on q and k
        W_FP32: tl.constexpr,  # the norm weights are fp32 (applied in fp32, one rounding)
        FULL_COS_SIN: tl.constexpr,  # cos and sin rows hold R entries, else R/2
        HAS_POSITIONS: tl.constexpr,  # token t reads row positions[t], else row t
        CACHE_FP8: tl.constexpr,  # FP8_OFF: bf16 caches; else e4m3fn codes scaled by kv_scale (FP8_*)
        BLOCK_H: tl.constexpr,  # q heads per program and token
        TOKENS: tl.constexpr,  # tokens per program (a power of two)
        Q_COLS: tl.constexpr,  # programs per token on q: cdiv(Hq, BLOCK_H)
        KV_COLS: tl.constexpr,  # programs per token on k, and again on v: cdiv(Hkv, KV_BLOCK); with
        # DEDUPE 2 the steps of the one kv program (k and v of KV_BLOCK heads each)
        SOFT_ROUNDING: tl.constexpr,  # round in integer arithmetic (CPU interpreter)
        DEDUPE: tl.constexpr,  # a slot several rows name (_duplicate_slots): 0 off, 1 scan, 2 lock
        SCAN: tl.constexpr,  # with DEDUPE 1: lanes of the slot_mapping scan (>= T')
        KV_BLOCK: tl.constexpr,  # kv heads per token of a k or v tile (with DEDUPE 2: per step)
        STRIDE_UNIT: tl.constexpr,  # stride_qt, stride_kt and stride_vt are in units of this many elements
        SLOTS_U32: tl.constexpr,  # NB * BS < 2^32: a slot's block and row in 32-bit arithmetic
        LOAD_EVICTION: tl.constexpr,  # the row loads' L2 eviction policy (_row_eviction)
        STORE_EVICTION: tl.constexpr,  # the output stores' (_row_eviction)
        KV_FIRST: tl.constexpr,  # a token's kv columns take its first programs, its q columns the rest
        WRAP: tl.constexpr,  # slots and positions count from the end when negative, as PyTorch indexing does
    ):
        # A 1-D grid of cdiv(T, TOKENS) * (Q_COLS + 2 * KV_COLS) programs. Columns vary
        # fastest and follow qkv's order (q heads, k heads, v heads), so programs running
        # together read TOKENS tokens' qkv rows front to back (q, k and v are three base
        # pointers: column ranges of one fused qkv, or separate projections); each column
        # handles BLOCK_H q heads (KV_BLOCK k or v heads) of each of its TOKENS tokens, as
        # one tile of rows (_token_rows). q and k columns share the norm and rotation code
        # (_norm_rope_store_heads), v columns only copy or quantise. Rows of tokens past T
        # read token T - 1 and store nothing. (T is not capped at 65535 on a 1-D grid.)
        # With DEDUPE 2 a token has one kv column.
        pid = tl.program_id(0).to(tl.int64)
        if DEDUPE == 2:
            n_cols = Q_COLS + 1
        else:
            n_cols = Q_COLS + 2 * KV_COLS
        col = pid % n_cols
        tok = pid // n_cols
        if KV_FIRST:
            # the kv columns first: at T=1 the normed k programs are the launch's longest
            # (launch_gqa_kernel's kv_first), so they are dispatched before the q programs
            col = (col + Q_COLS) % n_cols
        # token strides arrive divided by STRIDE_UNIT, so that the row loads vectorise
        # where a token stride is a multiple of 16 bytes but not of 16 elements (a slice
        # of a wider buffer): triton only marks an int argument divisible by 16
        stride_qt *= STRIDE_UNIT
        stride_kt *= STRIDE_UNIT
        stride_vt *= STRIDE_UNIT

        if col < Q_COLS:
            t, hb, live, cos_row, sin_row = _token_rows(
                tok, n_tokens, pos_ptr, max_pos, cos_ptr, sin_ptr, stride_cos, stride_sin, BLOCK_H, TOKENS,
                HAS_POSITIONS, WRAP,
            )
            heads = col * BLOCK_H + hb
            _norm_rope_store_heads(
                q_ptr + t * stride_qt + heads * HEAD_DIM, q_out_ptr + t * stride_ot + heads * stride_oh, heads < Hq,
                live, q_w_ptr, cos_row, sin_row, eps, scale_ptr,
                HEAD_DIM, ROT_DIM, ROT_PAD, IS_NEOX, HAS_NORM, W_FP32, FULL_COS_SIN, False, TOKENS * BLOCK_H,
                SOFT_ROUNDING, LOAD_EVICTION, STORE_EVICTION,
            )
        elif DEDUPE == 2:
            # TOKENS = 1 and a single kv column (the launcher's rule with DEDUPE 2): this
            # program writes token t's whole slot, k and v of every kv head, KV_BLOCK heads
            # a step, under the slot's lock, so that a slot two tokens name holds one of
            # them (_duplicate_slots). The first step's v and k rows are loaded beside the
            # slot, before the branch on it and the lock (a skipped slot's rows are read for
            # nothing): their round trip to memory overlaps the slot's and the atomic's
            # rather than following them, and only the arithmetic and the stores are held
            # under the lock. (kv_ names: triton merges a name that both sides of the
            # branch on col bind, so the k and v tiles' rows cannot reuse the q tile's.)
            kv_t, kv_hb, kv_live, kv_cos, kv_sin = _token_rows(
                tok, n_tokens, pos_ptr, max_pos, cos_ptr, sin_ptr, stride_cos, stride_sin, 1, 1, HAS_POSITIONS, WRAP,
            )
            slot = _slot_at(slot_ptr, kv_t, n_insert, n_slots, WRAP)
            kh = tl.arange(0, KV_BLOCK)
            d = tl.arange(0, HEAD_DIM)[None, :]
            k_src = k_ptr + kv_t * stride_kt
            v_src = v_ptr + kv_t * stride_vt
            real, v, x, a, b = _load_kv_heads(k_src, v_src, kh, Hkv, HEAD_DIM, ROT_DIM, ROT_PAD, IS_NEOX,
                                              LOAD_EVICTION)
            kv_scale = _kv_scale(scale_ptr, CACHE_FP8)
            v_scale = _kv_scale(v_scale_ptr, CACHE_FP8)
            if (slot >= 0) & (slot < n_slots):
                # an int64 division here, after the loads (not _slot_block_row): with the 32-bit
                # one ptxas moved this branch in front of the row loads and the q programs'
                # second cos/sin loads after their first products, a slower kernel (sm_90 SASS;
                # docs/decisions.md, GQA kernel: loads before the slot, the norm and the lock)
                k_dst = k_cache_ptr + (slot // block_size) * stride_kb + (slot % block_size) * stride_kr
                v_dst = v_cache_ptr + (slot // block_size) * stride_vb + (slot % block_size) * stride_vr
                _lock_row(locks_ptr, slot)
                for c in tl.static_range(KV_COLS):
                    heads = c * KV_BLOCK + kh
                    if c > 0:
                        real, v, x, a, b = _load_kv_heads(k_src, v_src, heads, Hkv, HEAD_DIM, ROT_DIM, ROT_PAD,
                                                          IS_NEOX, LOAD_EVICTION)
                    _norm_rope_store_loaded(
                        x, a, b, k_dst + heads * stride_kh, real, kh >= 0, k_w_ptr, kv_cos, kv_sin, k_eps,
                        kv_scale, HEAD_DIM, ROT_DIM, ROT_PAD, IS_NEOX, HAS_NORM, W_FP32, FULL_COS_SIN, CACHE_FP8,
                        KV_BLOCK, SOFT_ROUNDING, STORE_EVICTION,
                    )
                    _store_values((v_dst + heads * stride_vh)[:, None] + d, v, real[:, None], v_scale, CACHE_FP8,
                                  SOFT_ROUNDING, STORE_EVICTION)
                _unlock_row(locks_ptr, slot)
        else:
            # The slot only addresses the stores: its load is issued beside the row's,
            # not before it (no branch on it), so a k or v program waits on one round
            # trip to memory, not two; a skipped slot's rows load and store nothing.
            kv_t, kv_hb, kv_live, kv_cos, kv_sin = _token_rows(
                tok, n_tokens, pos_ptr, max_pos, cos_ptr, sin_ptr, stride_cos, stride_sin, KV_BLOCK, TOKENS,
                HAS_POSITIONS, WRAP,
            )
            slot = _slot_at(slot_ptr, kv_t, n_insert, n_slots, WRAP)
            _insert_kv_column(
                col - Q_COLS, kv_hb, k_ptr + kv_t * stride_kt, v_ptr + kv_t * stride_vt, k_cache_ptr, v_cache_ptr,
                slot, kv_live, kv_t, slot_ptr, n_insert, n_slots, block_size, stride_kb, stride_kr, stride_kh,
                stride_vb, stride_vr, stride_vh, k_w_ptr, kv_cos, kv_sin, Hkv, k_eps, scale_ptr, v_scale_ptr, HEAD_DIM,
                ROT_DIM, ROT_PAD, IS_NEOX, HAS_NORM, W_FP32, FULL_COS_SIN, CACHE_FP8, KV_BLOCK, TOKENS * KV_BLOCK,
                KV_COLS, DEDUPE, SCAN, SLOTS_U32, SOFT_ROUNDING, LOAD_EVICTION, STORE_EVICTION, WRAP,
            )


def _launch_config(num_tokens: int, head_dim: int, max_heads: int, has_norm: bool = True,
                   locked: bool = True, full_cos_sin: bool = False, cache_fp8: bool = False) -> tuple[int, ...]:
    """(q heads per program and token, warps per program, tokens per program[, register cap]),
    from the H200 sweeps (``bench/bench_gqa_qknorm_rope_kv_insert.py --sweep-config``); k and v
    programs take the kv heads up to that many (``launch_gqa_kernel``).

    At T <= 4 one head on one warp: the most programs for a latency-bound launch. From T = 5
    about 2048 values a program: without the row locks (T' <= 1024) ``2048 // D`` heads on four
    warps; under them (one kv program per token, bandwidth bound) at most 16 heads, a warp per
    1024 values with the norm and per 512 without, and a 56-register cap where the compiler would
    take 61-72 on the normed launch (at D 128 unless cos/sin are full-width, at D 256 with an fp8
    cache: 18 two-warp programs an SM instead of 16). One token a program: tiles of several were
    no faster. The timings behind each choice: docs/decisions.md (GQA kernel: launch table; a
    56-register cap).
    """
    if num_tokens <= 4:
        return 1, 1, 1
    block_h = max(1, 2048 // head_dim)
    if locked:
        block_h = min(block_h, 16)
    block_h = min(block_h, max(1, triton.next_power_of_2(max_heads)))
    num_warps = max(1, block_h * head_dim // (1024 if has_norm else 512)) if locked else 4
    if locked and has_norm and not full_cos_sin and (head_dim == 128 or (head_dim == 256 and cache_fp8)):
        # 56 registers a thread, nothing spilled: 18 two-warp programs an SM instead of 14-16;
        # the full-width cos/sin forms would spill at 56 and Gemma-3-12B's bf16 cache gains
        # nothing, so they keep the compiler's count
        return block_h, num_warps, 1, 56
    return block_h, num_warps, 1


# L2 eviction policies of the row loads and the output stores, by name, for a benchmark's
# sweep (``launch_gqa_kernel``'s ``eviction``); the launch's own rule is ``_row_eviction``
EVICTIONS = {
    "none": ("", ""),
    "loads": ("evict_first", ""),
    "stores": ("", "evict_first"),
    "both": ("evict_first", "evict_first"),
}


def _row_eviction(has_norm: bool, locked: bool) -> tuple[str, str]:
    """The L2 eviction policies (row loads, output stores) of a launch: of the row loads
    (q, k, v) and the output stores (q_out, the caches) ``evict_first`` on the locked launch
    (more than 1024 rows) without the norm (``EVICTIONS["both"]``), the default otherwise
    (``"none"``). Each row is read once and each output written once, so marking them first
    to go keeps the lines read again (the cos/sin rows, norm weights, slot_mapping, row
    locks) in L2. The normed launch was slower with them at large T, and the scanned launch
    (up to 1024 rows, its working set in L2) at T=512 (docs/decisions.md, GQA kernel: L2
    eviction hints)."""
    return EVICTIONS["both" if locked and not has_norm else "none"]


def stride_unit(*strides: int) -> int:
    """The largest of 16, 8, 4, 2, 1 that divides every stride: the kernel takes the token
    strides in these units and multiplies them back by a constexpr. Triton marks an int
    argument only as divisible by 16 or not, so a bf16 token stride of 6168 (a view of a
    wider buffer, 16-byte aligned rows) left every row load a scalar 2-byte load: 32 load
    instructions a thread where 4 vector ones do."""
    return next(u for u in (16, 8, 4, 2, 1) if all(s % u == 0 for s in strides))


def split_qkv_columns(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int):
    """Views of qkv's q, k and v column ranges, [T, Hq*D], [T, Hkv*D], [T, Hkv*D]."""
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    return qkv.split((num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=1)


def cos_sin_tables(cos_sin_cache, cos, sin, full_cos_sin) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(cos table, sin table, R)`` of either operand form: views of ``cos_sin_cache``'s
    two column ranges, or ``cos`` and ``sin`` as given (the kernel and the reference read
    only this form, so the two forms cannot drift apart)."""
    if cos_sin_cache is not None:
        cos, sin = cos_sin_cache.chunk(2, dim=-1)
    width = cos.shape[1]
    return cos, sin, width if full_cos_sin else 2 * width


def launch_gqa_kernel(
    q, k, v, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin_cache,
    kv_scale, is_neox, eps, full_cos_sin=False, cos=None, sin=None, fp8_saturate=True, wrap_indices=False,
    v_scale=None, k_eps=None, *, launch_config: tuple[int, ...] | None = None, dedupe: str | None = None,
    eviction: str | None = None, kv_first: bool = False,
) -> None:
    """The one launch of both GQA ops: q ``[T, Hq*D]``, k and v ``[T, Hkv*D]`` (column
    ranges of one qkv or separate tensors); heads and head size come from ``q_out`` and
    ``k_cache``. ``launch_config``, for a benchmark sweep: ``(BLOCK_H, num_warps)``,
    ``(BLOCK_H, num_warps, TOKENS)`` or ``(BLOCK_H, num_warps, TOKENS, MAXNREG)`` in place of
    ``_launch_config``'s (TOKENS is 1 where a duplicated slot is scanned for or locked;
    MAXNREG caps the registers a thread, 0 leaves them to the compiler); ``dedupe`` ("off", "scan", "lock") overrides
    ``_duplicate_slots.dedupe_mode`` (the benchmark measures each, a GPU test what a write
    without either does); ``eviction`` (a name in ``EVICTIONS``) overrides ``_row_eviction``'s
    hints, for a sweep; ``kv_first`` orders each token's programs kv columns first, q
    columns after (the grid otherwise follows qkv's order), for measuring
    what holds a T=1 launch (docs/decisions.md, GQA kernel: the T=1 floor). Inputs are
    not checked here."""
    num_tokens, num_q_heads, head_dim = q_out.shape
    num_kv_heads = k_cache.shape[2]
    if num_tokens == 0:
        return
    cos, sin, rot_dim = cos_sin_tables(cos_sin_cache, cos, sin, full_cos_sin)
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    mode = _duplicate_slots.dedupe_mode(slot_mapping, dedupe)
    config = launch_config or _launch_config(num_tokens, head_dim, max(num_q_heads, num_kv_heads),
                                             q_norm_weight is not None, mode == _duplicate_slots.DEDUPE_LOCK,
                                             bool(full_cos_sin), fp8)
    config = tuple(config)
    # a pair: one token per program; no register cap unless a fourth element asks for one
    block_h, num_warps, tokens, maxnreg = config + (1, 0)[len(config) - 2:]
    # a scan or a lock reads one token a program
    if mode != _duplicate_slots.DEDUPE_OFF:
        tokens = 1
    locked = mode == _duplicate_slots.DEDUPE_LOCK
    # k and v tiles hold the kv heads, up to BLOCK_H of them, not a q tile's BLOCK_H rows
    # (Qwen3-8B's 8 kv heads in a 16-row tile were half masked rows); under the row locks
    # one program per token writes its slot (k and v, every kv head) in steps of about
    # 1024 values
    kv_block = min(triton.next_power_of_2(num_kv_heads), max(1, 1024 // head_dim) if locked else block_h)
    q_cols, kv_cols = triton.cdiv(num_q_heads, block_h), triton.cdiv(num_kv_heads, kv_block)
    has_norm = q_norm_weight is not None
    load_eviction, store_eviction = EVICTIONS[eviction] if eviction else _row_eviction(has_norm, locked)
    # unread placeholders for absent optional tensors (the constexprs keep them unread)
    q_w = q_norm_weight if has_norm else q
    k_w = k_norm_weight if has_norm else q
    scale = kv_scale if fp8 else cos
    scale_v = v_scale if fp8 and v_scale is not None else scale
    block_size = k_cache.shape[1]
    grid = (triton.cdiv(num_tokens, tokens) * (q_cols + (1 if locked else 2 * kv_cols)),)
    unit = stride_unit(q.stride(0), k.stride(0), v.stride(0))
    _gqa_qknorm_rope_kv_insert_kernel[grid](
        q, k, v, q_w, k_w, q_out,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping, slot_mapping if positions is None else positions, cos, sin, scale, scale_v,
        _duplicate_slots.row_locks(k_cache.device),
        num_q_heads, num_kv_heads, num_tokens, slot_mapping.shape[0], k_cache.shape[0] * block_size, cos.shape[0],
        q.stride(0) // unit, k.stride(0) // unit, v.stride(0) // unit, q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cos.stride(0), sin.stride(0), eps, eps if k_eps is None else k_eps, block_size,
        HEAD_DIM=head_dim,
        ROT_DIM=rot_dim,
        ROT_PAD=triton.next_power_of_2(rot_dim),
        IS_NEOX=bool(is_neox),
        HAS_NORM=has_norm,
        W_FP32=has_norm and q_norm_weight.dtype == torch.float32,
        FULL_COS_SIN=bool(full_cos_sin),
        HAS_POSITIONS=positions is not None,
        CACHE_FP8=(FP8_SATURATE if fp8_saturate else FP8_OVERFLOW_NAN) if fp8 else FP8_OFF,
        BLOCK_H=block_h,
        TOKENS=tokens,
        Q_COLS=q_cols,
        KV_COLS=kv_cols,
        SOFT_ROUNDING=triton_interpret_mode(),
        DEDUPE=mode,
        SCAN=_duplicate_slots.scan_block(slot_mapping),
        KV_BLOCK=kv_block,
        STRIDE_UNIT=unit,
        SLOTS_U32=k_cache.shape[0] * block_size < 1 << 32,  # then BS and every slot fit 32 bits
        LOAD_EVICTION=load_eviction,
        STORE_EVICTION=store_eviction,
        KV_FIRST=bool(kv_first),
        WRAP=bool(wrap_indices),
        num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )


# --------------------------------------------------------------------------------------
# Reference implementation: plain PyTorch, any device, Hugging Face's steps
# --------------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm over the last dim of bf16 ``x``: ``weight * bf16(x * rstd)``, bf16; with
    an fp32 weight (Gemma3RMSNorm's ``1 + w``), ``bf16((x * rstd) * weight)`` in fp32."""
    h = x.float()
    variance = h.square().mean(dim=-1, keepdim=True)
    # correctly rounded fp32 1/sqrt: the sqrt through fp64 (torch's vectorised CPU fp32
    # sqrt is 1 ulp off for some inputs), then an IEEE reciprocal
    rstd = (variance + eps).double().sqrt().float().reciprocal()
    if weight.dtype == torch.float32:
        return ((h * rstd) * weight).to(torch.bfloat16)
    return weight * (h * rstd).to(torch.bfloat16)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool, *,
                   full: bool = False) -> torch.Tensor:
    """RoPE on the first R dims of bf16 ``x [T, H, D]`` in fp32, one rounding to bf16.
    ``cos``, ``sin``: [T, R/2] fp32 (one per pair), or [T, R] with ``full`` (one per dim)."""
    h = x.float()
    rot_dim = cos.shape[-1] if full else 2 * cos.shape[-1]
    rot, rest = h[..., :rot_dim], h[..., rot_dim:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = (rope_neox if is_neox else rope_gptj)(rot, cos, sin)
    return torch.cat((rotated, rest), dim=-1).to(torch.bfloat16)


def quantize_cache_reference(x: torch.Tensor, kv_scale: torch.Tensor | None, saturate: bool = True) -> torch.Tensor:
    """bf16 rows as the cache stores them: bf16, or e4m3fn of ``clamp(x / scale, +-448)``
    (a uint8 cache takes these codes' bytes: ``insert_cache_reference`` writes bytes);
    without ``saturate``, the NaN code with the value's sign where ``|x / scale| > 464``
    (written as bits: torch's own cast saturates on some versions and devices, not others)."""
    if kv_scale is None:
        return x
    scaled = x.float() / kv_scale.float().reshape(())
    codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if saturate:
        return codes
    nan_codes = torch.where(scaled.signbit(), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(scaled.abs() > FP8_OVERFLOW, nan_codes, codes.view(torch.uint8)).view(torch.float8_e4m3fn)


def insert_cache_reference(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, *,
                           as_baseline: bool = False) -> None:
    """Write ``rows [T', Hkv, D]`` at ``slots`` of ``cache [NB, BS, Hkv, D]`` as the kernel
    does (``_indices.written_rows``: negative and out-of-cache slots skipped, a duplicated
    slot written by its last token; a host sync on CUDA, as befits the oracle), unless the
    caller says every slot is valid and distinct (the capturable baseline)."""
    block_size = cache.shape[1]
    if not as_baseline:
        keep = written_rows(slots, cache.shape[0] * block_size)
        slots, rows = slots[keep], rows[keep]
    # through uint8 views: index_put has no float8 kernel on every device
    cache.view(torch.uint8)[slots // block_size, slots % block_size] = rows.view(torch.uint8)


def sources_reference(
    q, k, v, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin_cache,
    kv_scale, is_neox, eps, full_cos_sin=False, cos=None, sin=None, fp8_saturate=True, wrap_indices=False,
    v_scale=None, k_eps=None, *, as_baseline: bool = False,
) -> None:
    """Both GQA ops in plain PyTorch, unchecked (``define_op`` runs the checks first), from
    q ``[T, Hq*D]``, k and v ``[T, Hkv*D]``: the separate op's reference as it stands, the
    fused op's on qkv's column ranges (``on_qkv_columns``).

    ``as_baseline`` promises distinct slots inside the caches and positions inside the
    table, so no row is filtered (a boolean mask would sync the host) and no position
    clamped: the capturable form the benchmarks' unfused baseline runs
    (``prepfuse.models.gqa_prep_unfused``)."""
    cos, sin, _ = cos_sin_tables(cos_sin_cache, cos, sin, full_cos_sin)
    if positions is None:  # token t reads row t
        positions = torch.arange(q.shape[0], device=q.device)
    if wrap_indices:  # counted from the end when negative, as PyTorch indexing does
        positions = wrapped(positions, cos.shape[0])
        slot_mapping = wrapped(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    if not as_baseline:  # the kernel's reading of positions outside the table (``_indices``)
        positions = clamped_positions(positions, cos.shape[0])
    head_dim = q_out.shape[2]
    q_vals, k_rows, v_rows = prepared_heads_reference(
        q.unflatten(1, (-1, head_dim)), k.unflatten(1, (-1, head_dim)), v.unflatten(1, (-1, head_dim)),
        q_norm_weight, k_norm_weight, cos[positions].float(), sin[positions].float(), kv_scale,
        slot_mapping.shape[0], is_neox, eps, full_cos_sin=full_cos_sin, fp8_saturate=fp8_saturate, v_scale=v_scale,
        k_eps=k_eps,
    )
    q_out.copy_(q_vals)
    insert_cache_reference(k_cache, k_rows, slot_mapping, as_baseline=as_baseline)
    insert_cache_reference(v_cache, v_rows, slot_mapping, as_baseline=as_baseline)


def on_qkv_columns(impl):
    """The fused-qkv op's form of a three-source implementation (``launch_gqa_kernel``,
    ``sources_reference``): the same call on qkv's q, k and v column ranges, so both ops
    run one kernel and one reference and cannot drift apart."""

    def on_qkv(qkv, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions,
               cos_sin_cache, kv_scale, num_q_heads, num_kv_heads, is_neox, eps, full_cos_sin=False, cos=None,
               sin=None, fp8_saturate=True, wrap_indices=False, v_scale=None, k_eps=None, **options):
        q, k, v = split_qkv_columns(qkv, num_q_heads, num_kv_heads)
        impl(q, k, v, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions,
             cos_sin_cache, kv_scale, is_neox, eps, full_cos_sin, cos, sin, fp8_saturate, wrap_indices, v_scale,
             k_eps, **options)

    on_qkv.__name__ = on_qkv.__qualname__ = f"{impl.__name__}_on_qkv_columns"
    on_qkv.__doc__ = f"``{impl.__name__}`` on qkv's column ranges (``on_qkv_columns``); inputs are not checked here."
    return on_qkv


# the fused op's kernel launch (``launch_config`` overrides (BLOCK_H, num_warps[, TOKENS]),
# for a benchmark sweep) and its plain-PyTorch math, both on qkv's column ranges
gqa_qknorm_rope_kv_insert_triton = on_qkv_columns(launch_gqa_kernel)
unchecked_reference = on_qkv_columns(sources_reference)


def prepared_heads_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_scale: torch.Tensor | None,
    n_insert: int,
    is_neox: bool,
    eps: float,
    *,
    full_cos_sin: bool = False,
    fp8_saturate: bool = True,
    v_scale: torch.Tensor | None = None,
    k_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_out values [T, Hq, D] bf16, k and v rows [T', Hkv, D] as the cache stores them)
    from heads ``q [T, Hq, D]``, ``k``, ``v [T, Hkv, D]`` and each token's fp32 ``cos`` and
    ``sin`` ``[T, R/2]`` (``[T, R]`` with ``full_cos_sin``): everything both ops compute
    before the writes."""
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps)
        k = rms_norm_reference(k, k_norm_weight, eps if k_eps is None else k_eps)
    q = rope_reference(q, cos, sin, is_neox, full=full_cos_sin)
    k = rope_reference(k[:n_insert], cos[:n_insert], sin[:n_insert], is_neox, full=full_cos_sin)
    return (q, quantize_cache_reference(k, kv_scale, fp8_saturate),
            quantize_cache_reference(v[:n_insert], v_scale if v_scale is not None else kv_scale, fp8_saturate))


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------
def check_inputs(
    qkv, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions,
    cos_sin_cache, kv_scale, num_q_heads, num_kv_heads, is_neox, eps, full_cos_sin=False, cos=None, sin=None,
    fp8_saturate=True, wrap_indices=False, v_scale=None, k_eps=None,
) -> None:
    """Dtypes, shapes, devices and strides; raises ValueError naming the argument.

    Runs in the eager paths and in the fake impl (where sizes may be symbolic).
    """
    device = qkv.device if isinstance(qkv, torch.Tensor) else None
    check_tensor("qkv", qkv, dtype=torch.bfloat16, ndim=2, device=device)
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: must be a positive int, got {value!r}")
    num_tokens, width = qkv.shape
    n_heads = num_q_heads + 2 * num_kv_heads
    require(
        width % n_heads == 0,
        f"qkv: width {width} is not a multiple of Hq + 2*Hkv = {num_q_heads} + 2*{num_kv_heads} = {n_heads} heads",
    )
    head_dim = width // n_heads
    require(
        (head_dim == 64) | (head_dim == 128) | (head_dim == 256),
        f"qkv: head size {head_dim} (width {width} / {n_heads} heads) is not one of {HEAD_DIMS}",
    )
    check_prep_args(q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin_cache,
                    kv_scale, is_neox, eps, full_cos_sin, cos, sin, fp8_saturate, wrap_indices, v_scale,
                    num_tokens=num_tokens,
                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, device=device,
                    source="qkv")
    check_unit_last_stride("qkv", qkv)
    check_k_eps(k_eps)


def check_prep_args(
    q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale,
    is_neox, eps, full_cos_sin, cos, sin, fp8_saturate, wrap_indices, v_scale, *, num_tokens, num_q_heads,
    num_kv_heads, head_dim, device, source: str,
) -> None:
    """Everything but the q/k/v source (both GQA ops): dtypes, shapes, devices and strides
    against the token count, heads and head size the source gave (``source`` names it)."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        missing = "q_norm_weight" if q_norm_weight is None else "k_norm_weight"
        raise ValueError(f"{missing}: is None while the other norm weight is given; pass both or neither")
    if q_norm_weight is not None:
        dtype = getattr(q_norm_weight, "dtype", None)
        if dtype not in NORM_WEIGHT_DTYPES:
            raise ValueError(f"q_norm_weight: expected dtype torch.bfloat16 or torch.float32, "
                             f"got {dtype if dtype is not None else type(q_norm_weight).__name__}")
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            check_tensor(name, w, dtype=q_norm_weight.dtype, ndim=1, device=device)
            check_size(name, w, 0, head_dim, "the head size D")
            check_unit_last_stride(name, w)
    check_tensor("q_out", q_out, dtype=torch.bfloat16, ndim=3, device=device)
    check_size("q_out", q_out, 0, num_tokens, f"T, {source}'s token count")
    check_size("q_out", q_out, 1, num_q_heads, "num_q_heads")
    check_size("q_out", q_out, 2, head_dim, "the head size D")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dtype not in CACHE_DTYPES:
        got = k_cache.dtype if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise ValueError(f"k_cache: expected dtype torch.bfloat16, torch.float8_e4m3fn or torch.uint8 (e4m3fn "
                         f"codes), got {got}")
    check_tensor("k_cache", k_cache, dtype=k_cache.dtype, ndim=4, device=device)
    check_size("k_cache", k_cache, 2, num_kv_heads, "num_kv_heads")
    check_size("k_cache", k_cache, 3, head_dim, "the head size D")
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, ndim=4, device=device)
    for dim in range(4):
        check_size("v_cache", v_cache, dim, k_cache.shape[dim], f"k_cache's size {dim}")
    check_index_tensor("slot_mapping", slot_mapping, device)
    require(
        slot_mapping.shape[0] <= num_tokens,
        f"slot_mapping: has {slot_mapping.shape[0]} rows, more than T={num_tokens} tokens",
    )
    for name, flag in (("full_cos_sin", full_cos_sin), ("fp8_saturate", fp8_saturate), ("wrap_indices", wrap_indices)):
        check_flag(name, flag)
    tables = check_cos_sin(cos_sin_cache, cos, sin, full_cos_sin, head_dim, device)
    if positions is None:
        require(tables[0].shape[0] >= num_tokens,
                f"positions: is None, so token t reads row t of the cos/sin tables, which have "
                f"{tables[0].shape[0]} rows for T={num_tokens} tokens")
    else:
        check_index_tensor("positions", positions, device)
        check_size("positions", positions, 0, num_tokens, f"T, {source}'s token count")
    if k_cache.dtype in FP8_CACHE_DTYPES:
        if kv_scale is None:
            raise ValueError(f"kv_scale: an fp8 cache ({k_cache.dtype}) needs a device fp32 scale tensor of shape "
                             "[1] or [], got None")
        for name, scale in (("kv_scale", kv_scale), ("v_scale", v_scale)):
            if scale is None:
                continue
            check_tensor(name, scale, dtype=torch.float32, ndim=scale.dim(), device=device)
            require((scale.dim() <= 1) & (scale.numel() == 1), f"{name}: must have shape [1] or [], got {tuple(scale.shape)}")
    else:
        for name, scale in (("kv_scale", kv_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name}: must be None for a bf16 cache (it only scales fp8 caches)")
    named = (
        ("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping),
        ("positions", positions), *tables[1],
    )
    for name, t in named:
        if t is not None:
            check_unit_last_stride(name, t)
    check_flag("is_neox", is_neox)
    check_fp32_scalar("eps", eps, at_least=0.0)


def check_k_eps(k_eps) -> None:
    """k's own RMSNorm epsilon, where the model's k norm has another than q's (None: q's ``eps``)."""
    if k_eps is not None:
        check_fp32_scalar("k_eps", k_eps, at_least=0.0)


def check_cos_sin(cos_sin_cache, cos, sin, full_cos_sin, head_dim, device) -> tuple:
    """The cos/sin operand: ``cos_sin_cache`` alone (fp32, vLLM's layout), or ``cos`` and
    ``sin`` alone (fp32 or bf16, both alike, one shape). Returns (a table with the rows, the
    ``(name, tensor)`` pairs given)."""
    if cos_sin_cache is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if t is not None:
                raise ValueError(f"{name}: must be None when cos_sin_cache is given (pass one table, or cos and sin)")
        check_tensor("cos_sin_cache", cos_sin_cache, dtype=torch.float32, ndim=2, device=device)
        width = cos_sin_cache.shape[1]
        if full_cos_sin:
            require(
                (width > 0) & (width % 4 == 0) & (width <= 2 * head_dim),
                f"cos_sin_cache: with full_cos_sin its width is twice the rotary dim (R cos, then R sin), so a "
                f"positive multiple of 4 and at most 2 * the head size {head_dim}, got shape {tuple(cos_sin_cache.shape)}",
            )
        else:
            require(
                (width > 0) & (width % 2 == 0) & (width <= head_dim),
                f"cos_sin_cache: its width is the rotary dim and must be even, positive and at most "
                f"the head size {head_dim}, got shape {tuple(cos_sin_cache.shape)}",
            )
        return cos_sin_cache, (("cos_sin_cache", cos_sin_cache),)
    if cos is None or sin is None:
        missing = "cos_sin_cache" if cos is None and sin is None else ("cos" if cos is None else "sin")
        raise ValueError(f"{missing}: is None; pass cos_sin_cache, or both cos and sin")
    dtype = getattr(cos, "dtype", None)
    if dtype not in COS_SIN_DTYPES:
        raise ValueError(f"cos: expected dtype torch.float32 or torch.bfloat16, "
                         f"got {dtype if dtype is not None else type(cos).__name__}")
    check_tensor("cos", cos, dtype=dtype, ndim=2, device=device)
    check_tensor("sin", sin, dtype=dtype, ndim=2, device=device)
    for dim in range(2):
        check_size("sin", sin, dim, cos.shape[dim], f"cos's size {dim}")
    width = cos.shape[1]
    if full_cos_sin:
        require(
            (width > 0) & (width % 2 == 0) & (width <= head_dim),
            f"cos: with full_cos_sin its width is the rotary dim (one entry per rotated dim), so even, "
            f"positive and at most the head size {head_dim}, got shape {tuple(cos.shape)}",
        )
    else:
        require(
            (width > 0) & (2 * width <= head_dim),
            f"cos: its width is half the rotary dim (one entry per pair), so positive and at most half "
            f"the head size {head_dim}, got shape {tuple(cos.shape)}",
        )
    return cos, (("cos", cos), ("sin", sin))


def check_index_values(k_cache, slot_mapping, positions, cos_sin_cache, cos, wrap_indices=False) -> None:
    """Slot and position values in range (eager use; skipped while capturing a graph)."""
    rows = (cos_sin_cache if cos_sin_cache is not None else cos).shape[0]
    check_slot_and_position_values(slot_mapping, k_cache.shape[0], k_cache.shape[1], positions, rows,
                                   wrap=wrap_indices)


# --------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------


_OP = define_op(
    SCHEMA, check=check_inputs, index_check=check_index_values, reference=unchecked_reference, triton=gqa_qknorm_rope_kv_insert_triton,
)
gqa_qknorm_rope_kv_insert = _OP.packet
# the plain-PyTorch path as a function, checks included (tests and benchmarks call it)
gqa_qknorm_rope_kv_insert_reference = _OP.reference
GQA_QKNORM_ROPE_KV_INSERT = gqa_qknorm_rope_kv_insert.default
