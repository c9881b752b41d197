"""``@triton.jit`` helpers shared by the ops' kernels: exact rounding and unfused products.

Each takes ``SOFT_ROUNDING`` (``prepfuse._compat.triton_interpret_mode()`` at launch): on a
GPU the hardware instruction already rounds as PyTorch does; triton's CPU interpreter does
not, so there the rounding is done on the bits. A kernel module imports these names into
its own namespace (triton resolves a called jit function through the caller's globals).
"""

from __future__ import annotations

from prepfuse._compat import has_triton

if has_triton():
    import triton
    import triton.language as tl

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
        """fp32 in [-448, 448] -> e4m3fn code byte, round to nearest even.

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
            v = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

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
