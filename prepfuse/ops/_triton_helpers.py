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
    def _last_writer(slot_ptr, t, slot, n_insert, SCAN: tl.constexpr):
        """Whether no inserted row after row ``t`` names ``slot``: the scan rule of
        ``_duplicate_slots`` (the last of a slot's writers stores it), one vector load of the
        whole slot_mapping (``SCAN >= n_insert`` lanes), issued beside the row's own loads."""
        i = tl.arange(0, SCAN)
        later = tl.load(slot_ptr + i, mask=(i > t) & (i < n_insert), other=-1)
        return tl.sum((later == slot).to(tl.int32), axis=0) == 0

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
    def _to_e4m3_bits(v, SOFT_ROUNDING: tl.constexpr):
        """fp32 in [-448, 448] or NaN -> e4m3fn code byte, round to nearest even.

        Under the interpreter (whose fp8 cast rounds half up and drops the carry into
        the exponent) the value is first rounded onto the e4m3 grid exactly with
        integer arithmetic on its significand; the cast of an on-grid value is exact.
        """
        if SOFT_ROUNDING:
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
            return tl.where(v != v, 0x7F, codes).to(tl.uint8)
        else:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @triton.jit
    def _clamp_e4m3(x):
        """clamp(x, -448, 448) with torch.clamp's NaN: NaN stays NaN (then e4m3's NaN code;
        the GPU's satfinite convert keeps it). ``tl.minimum``/``tl.maximum`` return the
        other operand for a NaN, which stored a NaN as -448."""
        low = tl.maximum(x, -448.0, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(low, 448.0, propagate_nan=tl.PropagateNan.ALL)

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
        every fp32 significand of ``s`` (2^30 pairs, ``bench/e4m3_quotient_exhaustive.py``;
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
    def _rope_pairs_split(y, cs_row, SOFT_ROUNDING: tl.constexpr):
        """GPT-J RoPE of the last dim (64 values, pairs (2p, 2p+1)) of fp32 ``y [..., 64]``:
        the rotated pairs as two fp32 tensors ``(e', o') [..., 32]``.

        ``e' = e*cos[p] - o*sin[p]``, ``o' = e*sin[p] + o*cos[p]``, each product rounded on
        its own as PyTorch eager does (see ``_mul_rn``); ``cs_row`` points at 32 cos then
        32 sin. The pairs are split in registers, so the loads stay contiguous (vector)
        accesses; a caller joins them back (``tl.join``) or, packing pairs, uses them as is.
        """
        cos = tl.load(cs_row + tl.arange(0, 32))
        sin = tl.load(cs_row + 32 + tl.arange(0, 32))
        e, o = tl.split(tl.reshape(y, y.shape[:-1] + [32, 2]))
        e_rot = _mul_rn(e, cos, SOFT_ROUNDING) - _mul_rn(o, sin, SOFT_ROUNDING)
        o_rot = _mul_rn(e, sin, SOFT_ROUNDING) + _mul_rn(o, cos, SOFT_ROUNDING)
        return e_rot, o_rot

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
        1 up to 4, 2 up to 6. Each range is mapped exactly onto integer spacing (2a,
        a - 2, (a - 4) / 2: exact in fp32) and rounded to the nearest even integer by the
        1.5 * 2^23 add-and-subtract, whose rounding is the hardware's RNE on GPU and in the
        interpreter alike. It replaced counting the 7 midpoints below |v| (equal results
        for every fp32 in [0, 6], checked exhaustively), which cost 25% more time in the
        instruction-bound mxfp4 op: T=16384 on the H200 177.6 us -> 132.3 us
        (``bench/results/dsv4_indexer_launch_sweep_mxfp4_nvidia-h200.json``). Bit 3 is v's
        sign bit, so a negative value that rounds to zero keeps its sign (-0.0 is code 8),
        as IEEE rounding does.
        """
        a = tl.abs(v)
        low = a < 2.0
        mid = a < 4.0
        y = tl.where(low, 2.0 * a, tl.where(mid, a - 2.0, (a - 4.0) * 0.5))
        rounded = ((y + 12582912.0) - 12582912.0).to(tl.int32)
        code = rounded + tl.where(low, 0, tl.where(mid, 4, 6))
        sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
        return code | (sign << 3)
