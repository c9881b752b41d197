"""``@triton.jit`` helpers shared by the ops' kernels: exact rounding, unfused products, and
the clamp and amax that keep a NaN as PyTorch does (``docs/ops.md``, non-finite inputs).

Each takes ``SOFT_ROUNDING`` (``prepfuse._compat.triton_interpret_mode()`` at launch): on a
GPU the hardware instruction already rounds as PyTorch does; triton's CPU interpreter does
not, so there the rounding is done on the bits. A kernel module imports these names into
its own namespace (triton resolves a called jit function through the caller's globals).
"""

from __future__ import annotations

from prepfuse._compat import has_triton
from prepfuse.ops._duplicate_slots import N_ROW_LOCKS

if has_triton():
    import triton
    import triton.language as tl

    _ROW_LOCK_WORDS = tl.constexpr(N_ROW_LOCKS)

    @triton.jit
    def _last_writer(slot_ptr, t, slot, n_insert, n_slots, SCAN: tl.constexpr, WRAP: tl.constexpr):
        """Whether no inserted row after row ``t`` names ``slot``: the scan rule of
        ``_duplicate_slots`` (the last of a slot's writers stores it), one vector load of the
        whole slot_mapping (``SCAN >= n_insert`` lanes), issued beside the row's own loads.
        With ``WRAP`` the later slots are read as ``_slot_at`` reads them (a negative one
        counted from the end), so -1 and ``n_slots - 1`` are one slot."""
        i = tl.arange(0, SCAN)
        later = tl.load(slot_ptr + i, mask=(i > t) & (i < n_insert), other=-1)
        if WRAP:
            later = tl.where((i > t) & (i < n_insert) & (later < 0), later + n_slots, later)
        return tl.sum((later == slot).to(tl.int32), axis=0) == 0

    @triton.jit
    def _slot_at(slot_ptr, t, n_insert, n_slots, WRAP: tl.constexpr):
        """Row ``t``'s slot (int64; int32 slot mappings widen), or one that skips the row
        past ``n_insert``. Without ``WRAP`` a negative slot skips its row (engines' -1);
        with it a slot counts from the cache's end, as PyTorch indexing does (a rewrite of
        model code keeps its meaning: ``cache[s // bs, s % bs] = k`` with ``s = -1`` writes
        the last row)."""
        if WRAP:
            s = tl.load(slot_ptr + t, mask=t < n_insert, other=n_slots).to(tl.int64)
            return tl.where(s < 0, s + n_slots, s)
        else:
            return tl.load(slot_ptr + t, mask=t < n_insert, other=-1).to(tl.int64)

    @triton.jit
    def _lock_row(locks_ptr, slot):
        """Take slot ``slot``'s row lock (word ``slot % N_ROW_LOCKS`` of the table,
        ``_duplicate_slots``), spinning while another program holds it. One thread does the
        atomic; the barrier that hands its result to the others orders their stores after
        it, as Triton's layer-norm tutorial relies on."""
        lock = locks_ptr + slot % _ROW_LOCK_WORDS
        while tl.atomic_cas(lock, 0, 1, sem="acquire") != 0:
            pass

    @triton.jit
    def _unlock_row(locks_ptr, slot):
        """Release the lock once every thread of the program has stored its part of the row:
        the barrier puts all of them before the releasing atomic, whose release order puts
        them before the next holder's stores."""
        tl.debug_barrier()
        tl.atomic_xchg(locks_ptr + slot % _ROW_LOCK_WORDS, 0, sem="release")

    @triton.jit
    def _to_bf16(x, SOFT_ROUNDING: tl.constexpr):
        """fp32 -> bf16, round to nearest even.

        The GPU's convert instruction already rounds to nearest even; triton's CPU
        interpreter truncates, so under it the rounding is done on the bits.
        """
        if SOFT_ROUNDING:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def _bf16x2_words(even, odd):
        """fp32 tensors holding bf16 values -> their pairs as bf16x2 words (uint32: ``even``
        in the low half, ``odd`` in the high one, as the pair lies in memory)."""
        return (even.to(tl.uint32, bitcast=True) >> 16) | (odd.to(tl.uint32, bitcast=True) & 0xFFFF0000)

    @triton.jit
    def _bf16_bits_rn(x):
        """fp32 -> the bit pattern (uint32, low 16 bits) of its bf16 rounding, nearest even;
        a NaN gives bf16's NaN 0x7FC0."""
        bits = x.to(tl.uint32, bitcast=True)
        return tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint32)

    @triton.jit
    def _round_bf16x2_words(even, odd, SOFT_ROUNDING: tl.constexpr):
        """fp32 tensors rounded to bf16 (nearest even) and packed as ``_bf16x2_words``.

        On the GPU one ``cvt.rn.bf16x2.f32`` rounds and packs both (sm_90 issues the
        one-value ``cvt.rn.bf16.f32`` at a quarter rate, and triton converts pairs split
        from one row, RoPE's even and odd values, one by one)."""
        if SOFT_ROUNDING:  # on the bits: the interpreter's bf16 -> fp32 widening loses subnormals
            return _bf16_bits_rn(even) | (_bf16_bits_rn(odd) << 16)
        else:
            return tl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=tl.uint32, is_pure=True, pack=1
            )

    @triton.jit
    def _max_bf16x2_nan(a, b):
        """Per-half max of two bf16x2 words, a NaN winning (``_bf16x2_amax``'s GPU combine)."""
        return tl.inline_asm_elementwise("max.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1)

    @triton.jit
    def _max_halves(a, b):
        """Per-half unsigned max of two words (``_bf16x2_amax``'s interpreter combine)."""
        return tl.maximum(a & 0xFFFF, b & 0xFFFF) | (tl.maximum(a >> 16, b >> 16) << 16)

    @triton.jit
    def _bf16x2_amax(mags, axis: tl.constexpr, SOFT_ROUNDING: tl.constexpr):
        """max |x| over ``axis`` of bf16x2 magnitude words (``words & 0x7FFF7FFF``), as fp32;
        NaN when a value is NaN, as ``_amax``.

        Two halves at a time on the GPU (``max.NaN.bf16x2``, a NaN wins); the interpreter
        splits the halves and takes integer maxima, which agree: without the sign, bf16 bit
        patterns order as their magnitudes do, NaNs above the infinity above every finite
        value. The last step, the larger half, is that integer max too."""
        if SOFT_ROUNDING:
            both = tl.reduce(mags, axis, _max_halves)
        else:
            both = tl.reduce(mags, axis, _max_bf16x2_nan)
        return (tl.maximum(both & 0xFFFF, both >> 16) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _to_e4m3_bits(v, SOFT_ROUNDING: tl.constexpr):
        """fp32 -> e4m3fn code byte, round to nearest even, saturating: magnitudes past 448
        (infinities too) give +-448, a NaN gives 0x7F (the GPU's arithmetic makes every NaN
        positive), as ``torch.clamp(v, -448, 448).to(torch.float8_e4m3fn)``.

        On the GPU that is the convert instruction itself (``cvt.rn.satfinite.e4m3x2.f32``,
        triton's lowering on sm_89 and later), so callers need no clamp. Under the
        interpreter (whose fp8 cast rounds half up and drops the carry into the exponent)
        the clamped value is first rounded onto the e4m3 grid exactly with integer
        arithmetic on its significand; the cast of an on-grid value is exact.
        """
        if SOFT_ROUNDING:
            nan = v != v
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            bits = v.to(tl.uint32, bitcast=True)
            sign = bits & 0x80000000
            mag = bits & 0x7FFFFFFF
            exp = (mag >> 23).to(tl.int32) - 127
            signif = ((mag & 0x7FFFFF) | 0x800000).to(tl.int32)
            # keep 3 mantissa bits; below 2^-6 (e4m3 subnormals) the quantum is 2^-9
            shift = tl.minimum(20 + tl.maximum(-6 - exp, 0), 30)
            units = (signif + (1 << (shift - 1)) - 1 + ((signif >> shift) & 1)) >> shift
            quantum = ((tl.maximum(exp, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
            rounded = units.to(tl.float32) * quantum
            rounded = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            codes = rounded.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            # NaN: the interpreter's cast does not give e4m3's NaN code (the GPU's does)
            return tl.where(nan, 0x7F, codes).to(tl.uint8)
        else:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @triton.jit
    def _max_keep_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _amax(x, axis: tl.constexpr):
        """max |x| along ``axis``, NaN when any value is NaN, as ``torch.amax`` (``tl.max``
        skips NaNs). With ``_finite`` it tells a block that has no power-of-two scale."""
        return tl.reduce(tl.abs(x), axis, _max_keep_nan)

    @triton.jit
    def _finite(amax):
        """True where ``amax`` (of ``_amax``) is finite: False for NaN and for infinity."""
        return amax <= 3.4028234663852886e38

    @triton.jit
    def _mul_rn(a, b, SOFT_ROUNDING: tl.constexpr):
        """a * b rounded on its own, never contracted into an FMA with a later add.

        RoPE's e*cos - o*sin cancels badly when the two products are close; PyTorch
        eager rounds each product, an FMA would not, and the results then differ by
        thousands of ULPs of the (tiny) difference. PTX ``mul.rn`` is exempt from
        contraction. The interpreter (numpy) never contracts.
        """
        if SOFT_ROUNDING:
            return a * b
        else:
            return tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
            )

    @triton.jit
    def _e4m3_quotient(x, s, SOFT_ROUNDING: tl.constexpr):
        """``x / s`` for fp32 ``x`` holding bf16 values and one fp32 scalar ``s``, exact where
        it decides an e4m3 code: ``RN(x / s)`` for quotients of magnitude in [2^-20, 2^20),
        else ``RN(x * (1/s))``, which rounds to the same code (below 2^-20: zero of x/s's
        sign; from 2^20: past 464, saturated or NaN).

        One correction step after the product with the reciprocal, ``q0 = RN(x * r)``,
        ``q1 = RN(q0 + RN(x - s * q0) * r)`` (two FMAs), in place of a correctly rounded
        division per value (``div.rn``: a MUFU reciprocal, Newton steps and a slow-path
        check each). ``q1 == RN(x / s)`` was checked for every bf16 significand against
        every fp32 significand of ``s`` (2^30 pairs, ``bench/tools/e4m3_quotient_exhaustive.py``;
        ``tests/ops/test_triton_helpers.py`` checks it on every bf16 value, in emulated
        FMAs and on the device). The check holds while no
        step under- or overflows, hence the magnitude window and a division per value
        when |s| is outside [2^-60, 2^60]. The interpreter divides (numpy has no FMA)."""
        if SOFT_ROUNDING:
            return tl.div_rn(x, s)
        else:
            r = tl.div_rn(1.0, s)
            q0 = _mul_rn(x, r, SOFT_ROUNDING)
            q1 = tl.fma(tl.fma(-q0, s, x), r, q0)
            mag = tl.abs(q0)
            q = tl.where((mag >= 9.5367431640625e-07) & (mag < 1048576.0), q1, q0)
            if (tl.abs(s) < 8.673617379884035e-19) | (tl.abs(s) > 1.152921504606847e18):
                q = tl.div_rn(x, s)
            return q

    @triton.jit
    def _table_position(pos_at, max_pos, WRAP: tl.constexpr):
        """The position at ``pos_at`` (int64; int32 positions widen), clamped into a table of
        ``max_pos`` rows; with ``WRAP`` a negative one first counted from the table's end.
        Out-of-range positions are rejected on the host when it can read them; here they are
        clamped only so that no read leaves the table."""
        pos = tl.load(pos_at).to(tl.int64)
        if WRAP:
            pos = tl.where(pos < 0, pos + max_pos, pos)
        return tl.minimum(tl.maximum(pos, 0), max_pos - 1)

    @triton.jit
    def _slot_block_row(slot, block_size, SLOTS_U32: tl.constexpr):
        """``(slot // block_size, slot % block_size)`` of a slot in ``[0, n_slots)`` (a
        skipped one made 0 first), as int64. With ``SLOTS_U32`` (set by the launcher
        where the cache holds fewer than 2^32 slots: any real one) in 32-bit unsigned
        arithmetic, which ptxas inlines without a branch. An int64 division is a 32-bit
        fast path behind a branch on the operands' high words (sm_90 SASS), and no load
        written after it is issued before the slot has arrived: where the division precedes
        a program's row loads, that is a second round trip to memory."""
        if SLOTS_U32:
            s = slot.to(tl.uint32)
            bs = tl.cast(block_size, tl.uint32)
            blk = s // bs
            return blk.to(tl.int64), (s - blk * bs).to(tl.int64)
        else:
            return slot // block_size, slot % block_size

    @triton.jit
    def _load_cos_sin(cs_row):
        """A position's 32 cos and 32 sin values (fp32) at ``cs_row``. Apart from the rotation
        so that a kernel can issue the loads before arithmetic whose branches (a correctly
        rounded sqrt or division) the compiler does not hoist loads across."""
        return tl.load(cs_row + tl.arange(0, 32)), tl.load(cs_row + 32 + tl.arange(0, 32))

    @triton.jit
    def _rotate_pairs(y, cos, sin, SOFT_ROUNDING: tl.constexpr):
        """GPT-J RoPE of the last dim (64 values, pairs (2p, 2p+1)) of fp32 ``y [..., 64]``
        with ``cos, sin [32]`` (``_load_cos_sin``): the rotated pairs as two fp32 tensors
        ``(e', o') [..., 32]``.

        ``e' = e*cos[p] - o*sin[p]``, ``o' = e*sin[p] + o*cos[p]``, each product rounded on
        its own as PyTorch eager does (see ``_mul_rn``). The pairs are split in registers, so
        the loads stay contiguous (vector) accesses; a caller joins them back (``tl.join``)
        or, packing pairs, uses them as is.
        """
        e, o = tl.split(tl.reshape(y, y.shape[:-1] + [32, 2]))
        e_rot = _mul_rn(e, cos, SOFT_ROUNDING) - _mul_rn(o, sin, SOFT_ROUNDING)
        o_rot = _mul_rn(e, sin, SOFT_ROUNDING) + _mul_rn(o, cos, SOFT_ROUNDING)
        return e_rot, o_rot

    @triton.jit
    def _rope_pairs_split(y, cs_row, SOFT_ROUNDING: tl.constexpr):
        """``_rotate_pairs`` with the cos/sin of the row at ``cs_row`` (32 cos, then 32 sin)."""
        cos, sin = _load_cos_sin(cs_row)
        return _rotate_pairs(y, cos, sin, SOFT_ROUNDING)

    @triton.jit
    def _ceil_log2_ratio(amax, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr):
        """ceil(log2(amax / fmt_max)) for a normal, positive fp32 ``amax``, read off its bits.

        ``fmt_max = m0 * 2^MAX_EXP`` with significand ``m0``; ``MAX_MANT`` is ``m0``'s 23
        mantissa bits (448 = 1.75 * 2^8: 8, 0x600000; 6 = 1.5 * 2^2: 2, 0x400000). With
        amax = m * 2^E the answer is E - MAX_EXP, plus one when m > m0. No division or
        log2 whose rounding could flip the ceiling at exact powers of two.
        """
        bits = amax.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 127 - MAX_EXP + ((bits & 0x7FFFFF) > MAX_MANT).to(tl.int32)

    @triton.jit
    def _exp2_int(e):
        """2^e as fp32, exactly, for an int32 ``e`` in [-126, 127]."""
        return ((e + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _to_e2m1_code(v):
        """fp32 in [-6, 6] -> e2m1 nibble (0..15), round to nearest even, as PTX
        ``cvt.rn.satfinite.e2m1x2.f32`` (sm_100; sm_90 has none).

        The 8 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} are codes 0..7: spacing 0.5 below 2,
        1 up to 4, 2 up to 6. Each range is mapped exactly onto integer spacing with its code
        offset (2a, a + 2, a / 2 + 4: the product exact, one rounding) and added to
        M = 1.5 * 2^23, where fp32's quantum is 1: the add rounds to the nearest even integer
        (the hardware's RNE on GPU and in the interpreter alike; even integer = even e2m1
        mantissa, so ties go as IEEE's), and that integer, at most 7, is the low bits of the
        sum's bit pattern. No float-to-int conversion: sm_90 issues those at a quarter of
        the rate of the rest, in an op that is instruction-bound.

        Counting the 7 midpoints below |v| gives equal results for every fp32 in [0, 6]
        (``tests/ops/test_triton_helpers.py``) but took longer (docs/decisions.md). Bit 3 is v's sign
        bit, so a negative value that rounds to zero keeps its sign (-0.0 is code 8), as
        IEEE rounding does.
        """
        a = tl.abs(v)
        y = tl.where(a < 2.0, a * 2.0 + 12582912.0, tl.where(a < 4.0, a + 12582914.0, a * 0.5 + 12582916.0))
        sign = v.to(tl.uint32, bitcast=True) >> 28  # sign bit as bit 3
        return ((y.to(tl.uint32, bitcast=True) & 7) | (sign & 8)).to(tl.int32)

    @triton.jit
    def _e2m1_word_bytes(words, mags, inv, keep, SOFT_ROUNDING: tl.constexpr):
        """E2M1 nibble pairs of bf16x2 ``words`` (``_bf16x2_words``; ``mags`` the same with the
        signs cleared): ``code(even * inv) | code(odd * inv) << 4`` in the low byte of a
        uint32, for ``inv`` a power of two (broadcast) with every ``|x * inv| <= 6``: the
        MXFP4 quantisation of two values. Where ``keep`` (broadcast) is False the byte is 0
        (a block without a scale).

        On GPU both codes come from bf16x2 arithmetic on the word. E2M1's grid is 0.5 apart
        below 2, 1 apart up to 4 and 2 apart up to 6, so with ``a = |x * inv|`` the code is
        ``RNE(2a)``, ``RNE(a) + 2`` or ``RNE(a / 2) + 4`` (``_to_e2m1_code``): three lines
        whose minimum, for every a in [0, 6], is the one of a's range (the map is concave).
        Each line is one ``fma.rn.bf16x2`` into 192 + its offset, where bf16's quantum is 1,
        so the single rounding is the integer RNE (the product ``|x| * 2^k`` is exact inside
        the fused multiply-add, even for a subnormal multiplier) and the code is the sum's
        low 3 bits (192 = 0x4340). Per pair: three FMAs, two mins and the sign and nibble
        bit moves, against about nine fp32 instructions per value. The CPU interpreter (no
        inline PTX) encodes value by value with ``_to_e2m1_code``; the CPU tests check the
        bf16x2 formulation in exact arithmetic (``tests/ops/test_triton_helpers.py``)."""
        if SOFT_ROUNDING:
            even = (words << 16).to(tl.float32, bitcast=True)
            odd = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
            return tl.where(keep, _to_e2m1_code(even * inv) | (_to_e2m1_code(odd * inv) << 4), 0).to(tl.uint32)
        else:
            # the multipliers 2 inv, inv, inv / 2 as bf16x2 words (exact: powers of two;
            # inv / 2 may be the subnormal 2^-127, which fp32 holds and bf16 keeps), and
            # the masks that keep or clear the codes and the signs: per block, not per pair
            two = ((inv * 2.0).to(tl.uint32, bitcast=True) >> 16) * 0x10001
            one = (inv.to(tl.uint32, bitcast=True) >> 16) * 0x10001
            half = ((inv * 0.5).to(tl.uint32, bitcast=True) >> 16) * 0x10001
            code_bits = tl.where(keep, 0x00070007, 0).to(tl.uint32)
            sign_bits = tl.where(keep, 0x00080008, 0).to(tl.uint32)
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 l1, l2, l3, c;
                mov.b32 c, 0x43404340;
                fma.rn.bf16x2 l1, $2, $3, c;
                mov.b32 c, 0x43424342;
                fma.rn.bf16x2 l2, $2, $4, c;
                mov.b32 c, 0x43444344;
                fma.rn.bf16x2 l3, $2, $5, c;
                min.bf16x2 l1, l1, l2;
                min.bf16x2 l1, l1, l3;
                shr.b32 c, $1, 12;
                and.b32 c, c, $7;
                and.b32 l1, l1, $6;
                or.b32 l1, l1, c;
                shr.b32 c, l1, 12;
                or.b32 $0, l1, c;
                }""",
                "=r,r,r,r,r,r,r,r",
                [words, mags, two, one, half, code_bits, sign_bits],
                dtype=tl.uint32,
                is_pure=True,
                pack=1,
            )
