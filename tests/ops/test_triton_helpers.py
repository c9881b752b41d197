"""The shared ``@triton.jit`` helpers, element by element against plain PyTorch.

``_to_e2m1_code`` rounds by an add-and-subtract of 1.5 * 2^23 rather than by counting
midpoints; its edge cases are the e2m1 midpoints and grid points, so every one of them
and the fp32 values a few ULPs either side are checked, with random values of both signs.
Runs under the CPU interpreter and compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops.dsv4_indexer_common import e2m1_codes_reference

pytestmark = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if has_triton():
    import triton
    import triton.language as tl

    from prepfuse.ops._triton_helpers import _to_e2m1_code

    @triton.jit
    def _e2m1_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, _to_e2m1_code(v).to(tl.uint8), mask=i < n)


def near(points: list[float], ulps: int) -> torch.Tensor:
    """Each point and the fp32 values up to ``ulps`` ULPs either side, both signs."""
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    offsets = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    values = (bits[:, None] + offsets[None, :]).flatten().view(torch.float32)
    values = values[(values >= 0) & (values <= 6.0)]
    return torch.cat((values, -values))


def test_e2m1_code_matches_the_reference_at_every_edge():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    smallest = [2.0**-149, 2.0**-126, 2.0**-24]  # subnormal, smallest normal, tiny
    gen = torch.Generator().manual_seed(0)
    random = (torch.rand(1 << 14, generator=gen) * 12 - 6).to(torch.float32)
    x = torch.cat((near(grid + midpoints, 3), torch.tensor(smallest), -torch.tensor(smallest), random))
    out = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    block = 1024
    _e2m1_kernel[(triton.cdiv(x.numel(), block),)](x.to(DEVICE), out, x.numel(), BLOCK=block)
    expected = e2m1_codes_reference(x)
    got = out.cpu()
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} values encoded differently (interpreter: {triton_interpret_mode()}), first: "
        + ", ".join(f"{x[i].item()!r}: {got[i].item()} != {expected[i].item()}" for i in bad[:5])
    )


if has_triton():
    from prepfuse.ops._triton_helpers import _e4m3_quotient, _to_e4m3_bits

    @triton.jit
    def _e4m3_quotient_kernel(x_ptr, s_ptr, q_ptr, code_ptr, n, SOFT_ROUNDING: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        q = _e4m3_quotient(x, tl.load(s_ptr + tl.program_id(1)), SOFT_ROUNDING)
        out = tl.program_id(1) * n + i
        tl.store(q_ptr + out, q, mask=i < n)
        tl.store(code_ptr + out, _to_e4m3_bits(q, SOFT_ROUNDING), mask=i < n)


def every_bf16() -> torch.Tensor:
    """Every bf16 bit pattern but NaNs' payload variety: all finite values, +-inf, one NaN."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = values[torch.isfinite(values)]
    return torch.cat((finite, torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=torch.bfloat16)))


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``RN(a * b + c)`` for fp32 tensors, exactly: the product is exact in float64 (48
    bits), the sum's rounding error is recovered (TwoSum) and folded in by rounding to odd
    at 53 bits, after which one rounding to fp32 (24 bits) is the correct one."""
    prod = a.double() * b.double()
    c = c.double()
    hi = prod + c
    back = hi - prod
    err = (prod - (hi - back)) + (c - back)
    odd = (hi.view(torch.int64) & 1) == 1
    toward = torch.nextafter(hi, torch.where(err > 0, torch.inf, -torch.inf).double())
    return torch.where((err == 0) | odd, hi, toward).float()


def one_step_quotient(x: torch.Tensor, s: float) -> torch.Tensor:
    """``_e4m3_quotient``'s GPU arithmetic with exactly emulated fp32 FMAs: r = RN(1/s),
    q0 = RN(x*r), q1 = RN(q0 + RN(x - s*q0) * r)."""
    s = torch.full_like(x, s)
    r = 1.0 / s
    q0 = x * r
    return fma32(fma32(-q0, s, x), r, q0)


# quotients where the correction decides: the one-step result is RN(x / s) exactly
WINDOW = (2.0**-20, 2.0**20)
SCALES = [3.0 / 448.0, 1.0, 0.5, 1.0 / 3.0, 0.0123, 1.9999999, 7.1e-5, 2.0**60, 2.0**-60]


def test_one_correction_step_divides_every_bf16_value_exactly():
    """The claim ``_e4m3_quotient`` rests on, in plain arithmetic, for every bf16 value and
    random scales (``bench/tools/e4m3_quotient_exhaustive.py`` checks every fp32 significand of s).
    Fails for the product alone: RN(x * RN(1/s)) is one ULP off for 27% of significand pairs."""
    x = every_bf16().float()
    x = x[torch.isfinite(x) & (x != 0)]
    gen = torch.Generator().manual_seed(0)
    scales = SCALES + (2.0 ** (torch.rand(64, generator=gen) * 80 - 40)).tolist()
    off_by_product = 0
    for s in scales:
        want = x / torch.tensor(s, dtype=torch.float32)
        window = (want.abs() >= WINDOW[0]) & (want.abs() < WINDOW[1])
        got = one_step_quotient(x, s)
        bad = window & (got.view(torch.int32) != want.view(torch.int32))
        assert not bad.any(), f"s={s!r}: {int(bad.sum())} quotients differ, first x={x[bad][:3].tolist()}"
        product = (x.double() * (1.0 / torch.tensor(s, dtype=torch.float32)).double()).float()
        off_by_product += int((window & (product != want)).sum())
    assert off_by_product > 0  # the correction step is what makes them exact


def test_e4m3_quotient_matches_division_on_every_bf16_value():
    """The kernel helper against torch's x / s: bit for bit inside the window, the same e4m3
    code everywhere (saturating at +-448, NaN kept), for every bf16 value and the scales
    above, including the two outside [2^-60, 2^60) that take the division per value."""
    x = every_bf16()
    scales = torch.tensor(SCALES + [2.0**61, 2.0**-61], dtype=torch.float32)
    n = x.numel()
    q = torch.empty(scales.numel(), n, dtype=torch.float32, device=DEVICE)
    codes = torch.empty(scales.numel(), n, dtype=torch.uint8, device=DEVICE)
    block = 4096
    _e4m3_quotient_kernel[(triton.cdiv(n, block), scales.numel())](
        x.to(DEVICE), scales.to(DEVICE), q, codes, n, SOFT_ROUNDING=triton_interpret_mode(), BLOCK=block,
    )
    want = x.float()[None, :] / scales[:, None]
    window = (want.abs() >= WINDOW[0]) & (want.abs() < WINDOW[1])
    got = q.cpu()
    bad = window & (got.view(torch.int32) != want.view(torch.int32))
    assert not bad.any(), f"{int(bad.sum())} quotients differ from x / s (interpreter: {triton_interpret_mode()})"
    want_codes = want.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = codes.cpu() != want_codes
    assert not bad.any(), f"{int(bad.sum())} e4m3 codes differ (interpreter: {triton_interpret_mode()})"


def bf16_values_up_to(limit: float) -> torch.Tensor:
    """Every finite bf16 value of magnitude <= ``limit`` (both zeros, the subnormals) as fp32."""
    x = every_bf16().float()
    return x[torch.isfinite(x) & (x.abs() <= limit)]


def test_min_of_three_rounded_lines_is_the_e2m1_code():
    """The arithmetic ``_e2m1_pair_bytes`` does in bf16x2 on the GPU, exactly (float64, then
    RNE to the integers, which is bf16's rounding on [128, 256)): for a = |x| * 2^-e the
    code is min(RNE(2a) + 192, RNE(a) + 194, RNE(a / 2) + 196) - 192, for every bf16
    magnitude x * 2^-e <= 6 that a finite bf16 block of scale 2^e can hold (e in
    [-126, 126]; the product taken inside the FMA, so never rounded)."""
    v = bf16_values_up_to(6.0).abs().unique().double()
    want = e2m1_codes_reference(v.float())
    for e in [-126, -125, -64, -8, -1, 0, 1, 2, 8, 64, 125, 126]:
        x = v * 2.0**e  # the block's bf16 values (exact: bf16 spans fp32's exponents)
        a = x * 2.0**-e
        lines = torch.stack((torch.round(a * 2.0) + 192, torch.round(a) + 194, torch.round(a * 0.5) + 196))
        got = lines.amin(dim=0) - 192
        bad = got.to(torch.uint8) != want
        assert not bad.any(), f"e={e}: {int(bad.sum())} codes differ, first a={a[bad][:3].tolist()}"


if has_triton():
    from prepfuse.ops._triton_helpers import _bf16x2_amax, _bf16x2_words, _e2m1_word_bytes

    @triton.jit
    def _e2m1_pair_kernel(x_ptr, e_ptr, out_ptr, n_pairs, SOFT_ROUNDING: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(e_ptr + tl.program_id(1))
        inv = ((127 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        x = tl.load(x_ptr + tl.program_id(1) * 2 * n_pairs + 2 * i[:, None] + tl.arange(0, 2)[None, :],
                    mask=(i < n_pairs)[:, None], other=0.0).to(tl.float32)
        even, odd = tl.split(x)
        words = _bf16x2_words(even, odd)
        keep = (i % 7) != 3  # some pairs of a block without a scale: byte 0
        byte = _e2m1_word_bytes(words, words & 0x7FFF7FFF, inv, keep, SOFT_ROUNDING)
        tl.store(out_ptr + tl.program_id(1) * n_pairs + i, byte.to(tl.uint8), mask=i < n_pairs)


@pytest.mark.parametrize("exponents", [[-126, -1, 0, 1, 126], list(range(-126, 127))], ids=["some", "every"])
def test_e2m1_word_bytes_match_the_reference(exponents):
    """The helper (bf16x2 on the GPU, value by value under the interpreter) against the
    reference, for every bf16 value a block of scale 2^e holds (|x| * 2^-e <= 6), both
    signs, at each scale exponent e; every exponent only on CUDA (the interpreter is slow)."""
    if len(exponents) > 5 and DEVICE == "cpu":
        pytest.skip("every exponent: on CUDA only")
    v = bf16_values_up_to(6.0)
    v = torch.cat((v, v[:1])) if v.numel() % 2 else v  # whole pairs
    e = torch.tensor(exponents, dtype=torch.int32)
    x = (v[None, :] * torch.exp2(e.float())[:, None]).to(torch.bfloat16)
    x = torch.where(x.isfinite(), x, 0.0)  # past bf16's range at the largest exponents
    if triton_interpret_mode():  # its bf16 -> fp32 widening loses subnormals (1.84e-40 -> 0)
        x = torch.where(x.float().abs() < 2.0**-126, 0.0, x)
    n_pairs = v.numel() // 2
    out = torch.empty(e.numel(), n_pairs, dtype=torch.uint8, device=DEVICE)
    block = 1024
    _e2m1_pair_kernel[(triton.cdiv(n_pairs, block), e.numel())](
        x.to(DEVICE), e.to(DEVICE), out, n_pairs, SOFT_ROUNDING=triton_interpret_mode(), BLOCK=block,
    )
    codes = e2m1_codes_reference(x.float() * torch.exp2(-e.float())[:, None])
    want = codes[:, 0::2] | (codes[:, 1::2] << 4)
    keep = (torch.arange(n_pairs) % 7) != 3
    want = torch.where(keep, want, 0)
    bad = out.cpu() != want
    assert not bad.any(), f"{int(bad.sum())} pair bytes differ (interpreter: {triton_interpret_mode()})"


if has_triton():
    from prepfuse.ops._triton_helpers import _round_bf16x2_words

    @triton.jit
    def _words_kernel(x_ptr, words_ptr, amax_ptr, SOFT_ROUNDING: tl.constexpr, ROWS: tl.constexpr, PAIRS: tl.constexpr):
        r = tl.arange(0, ROWS)[:, None]
        p = tl.arange(0, PAIRS)[None, :]
        even = tl.load(x_ptr + r * 2 * PAIRS + 2 * p)
        odd = tl.load(x_ptr + r * 2 * PAIRS + 2 * p + 1)
        words = _round_bf16x2_words(even, odd, SOFT_ROUNDING)
        tl.store(words_ptr + r * PAIRS + p, words)
        tl.store(amax_ptr + tl.arange(0, ROWS), _bf16x2_amax(words & 0x7FFF7FFF, 1, SOFT_ROUNDING))


def test_bf16x2_words_round_pack_and_amax_as_torch():
    """``_round_bf16x2_words``: each fp32 rounded as ``.to(bfloat16)`` (a NaN stays a NaN) and
    laid out as the pair lies in memory (even value in the low half); ``_bf16x2_amax``: ``abs().amax()`` of each
    row, NaN for a row holding one, infinity for one holding an infinity (and no NaN)."""
    rows, pairs = 64, 16
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 2 * pairs, generator=gen) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=gen).float())
    ties = (torch.randint(-2**15, 2**15, (rows, 2 * pairs), generator=gen, dtype=torch.int32) << 16) | 0x8000
    x = torch.where(torch.rand(rows, 2 * pairs, generator=gen) < 0.3, ties.view(torch.float32), x)  # exact ties
    x[3, 5], x[4, 0], x[4, 31], x[5, 7], x[5, 8] = float("nan"), float("inf"), -float("inf"), -float("inf"), float("nan")
    x[6] = -0.0
    words = torch.empty(rows, pairs, dtype=torch.int32, device=DEVICE)
    amax = torch.empty(rows, dtype=torch.float32, device=DEVICE)
    _words_kernel[(1,)](x.to(DEVICE), words, amax, SOFT_ROUNDING=triton_interpret_mode(), ROWS=rows, PAIRS=pairs)
    want = x.to(torch.bfloat16)
    got = words.cpu().view(torch.bfloat16).view(rows, 2 * pairs)
    bad = (got.view(torch.int16) != want.view(torch.int16)) & ~(got.isnan() & want.isnan())  # NaN payloads differ
    assert not bad.any(), f"{int(bad.sum())} differ, first x={x[bad][:3].tolist()}: {got[bad][:3].tolist()} != {want[bad][:3].tolist()}"
    want_amax = want.float().abs().amax(dim=1)
    got = amax.cpu()
    assert torch.equal(got.isnan(), want_amax.isnan()) and torch.equal(got[~got.isnan()], want_amax[~want_amax.isnan()])
