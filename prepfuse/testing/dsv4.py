"""``prepfuse::dsv4_qnorm_rope_kv_insert``: one call's inputs, made fresh and poisoned, and the
comparison the spec bounds (bf16 ULPs of q, fp8 codes of the cache)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    CACHE_ROW_BYTES, HEAD_DIM, MXFP8_SLOT_BYTES, NOPE_DIM, SCALE_BYTES, SLOT_BYTES,
)
from prepfuse.testing.common import (
    Q_POISON, bf16_ulp_diff, e4m3_code_diff, fresh_generator, poisoned_like, random_slots, rope_cos_sin_cache,
    seeded_generator,
)

__all__ = ["Dsv4Inputs", "make_dsv4_inputs", "exact_rms_q", "seeded_dsv4_inputs", "Dsv4Comparison", "fp8_data_byte_mask",
           "compare_dsv4_q", "compare_dsv4", "fp8_ds_mla_values", "mxfp8_values"]


@dataclass
class Dsv4Inputs:
    """One call's arguments of ``prepfuse::dsv4_qnorm_rope_kv_insert``."""

    q: torch.Tensor
    kv: torch.Tensor
    q_out: torch.Tensor
    k_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    eps: float
    block_size: int
    wrap_indices: bool = False  # a negative slot or position counts from the end
    apply_q_norm: bool = True  # False: q rotated as it is (DeepSeek-V4.1)
    kv_mxfp8: bool = False  # the cache holds DeepSeek-V4.1's MXFP8 records

    def args(self) -> tuple:
        return (
            self.q, self.kv, self.q_out, self.k_cache, self.slot_mapping, self.positions, self.cos_sin_cache,
            self.eps, self.block_size, self.wrap_indices, self.apply_q_norm, self.kv_mxfp8,
        )

    def fresh_outputs(self) -> "Dsv4Inputs":
        """The same inputs with newly poisoned q_out and k_cache (same shapes and strides)."""
        return replace(self, q_out=poisoned_like(self.q_out, value=Q_POISON), k_cache=poisoned_like(self.k_cache))


def make_dsv4_inputs(
    num_tokens: int,
    num_heads: int,
    padded_heads: int,
    block_size: int,
    device,
    *,
    generator: torch.Generator | None = None,
    num_inserted: int | None = None,
    skip_fraction: float = 0.1,
    spare_slots: int = 64,
    max_pos: int = 8192,
    eps: float = 1e-6,
    apply_q_norm: bool = True,
    kv_mxfp8: bool = False,
) -> Dsv4Inputs:
    """Fresh random inputs with poisoned outputs (``apply_q_norm`` and ``kv_mxfp8`` the op's).

    The first ``num_inserted`` rows (default all) get distinct random slots in a cache
    with ``spare_slots`` more slots than rows; about ``skip_fraction`` of them are -1.
    q has a wide per-row dynamic range and kv per-block ranges from 1e-6 to 1e3 so that
    the norm, the UE8M0 exponents and the fp8 subnormals are all exercised. The cache
    rows are padded past 584 bytes per slot, as engines pad to a multiple of 576 (MXFP8
    records past 528, to a multiple of 512).
    """
    gen = fresh_generator(generator)
    num_inserted = num_tokens if num_inserted is None else num_inserted

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = randn(num_tokens, num_heads, HEAD_DIM) * torch.exp(randn(num_tokens, num_heads, 1) * 2)
    kv_scale = torch.exp(randn(num_tokens, 8, 1) * 4).clamp(1e-6, 1e3)
    kv = (randn(num_tokens, 8, 64) * kv_scale).reshape(num_tokens, HEAD_DIM)

    num_blocks, slots = random_slots(num_inserted, spare_slots, block_size, skip_fraction, gen)
    slot_bytes, page = (MXFP8_SLOT_BYTES, 512) if kv_mxfp8 else (SLOT_BYTES, 576)
    row_stride = -(-block_size * slot_bytes // page) * page  # padded to a multiple of the page alignment
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)

    inputs = Dsv4Inputs(
        q=q.to(torch.bfloat16).to(device),
        kv=kv.to(torch.bfloat16).to(device),
        q_out=torch.empty(num_tokens, padded_heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
        k_cache=torch.empty(num_blocks, row_stride, dtype=torch.uint8, device=device),
        slot_mapping=slots.to(device),
        positions=positions.to(device),
        cos_sin_cache=rope_cos_sin_cache(max_pos, device),
        eps=eps,
        block_size=block_size,
        apply_q_norm=apply_q_norm,
        kv_mxfp8=kv_mxfp8,
    )
    return inputs.fresh_outputs()


# a * a + b * b -> (a, b) for 0 <= a <= b <= 64
_TWO_SQUARES: dict[int, tuple[int, int]] = {}
for _a in range(65):
    for _b in range(_a, 65):
        _TWO_SQUARES.setdefault(_a * _a + _b * _b, (_a, _b))


def exact_rms_q(num_tokens: int, num_heads: int, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Random q [T, H, 512] bf16 and an eps for which the RMS needs no rounding at all.

    q is integers in [-64, 64] times 2^k (one k per call, in [-20, 10]) and eps is
    e0^2 * 2^(2k-10), e0 in [1, 2048]: each head's sum of squares is exact in fp32 in any
    order (at most 512 * 64^2 = 2^21 units of 2^(2k)), and two entries of each head are
    chosen so that mean(x^2) + eps = (M * 2^(k-5))^2 exactly (M^2 < 2^24), which makes
    the sqrt exact too. All implementations then share every value up to
    y = x * (1/rms), and "bit for bit" is a deterministic claim.

    Why not any q: torch's fp32 sqrt on CPU is not correctly rounded (MKL VML: 1 ULP off
    for ~15% of inputs), and the kernel sums in another order; with a random RMS either
    one flips a rare bf16 rounding.
    """
    def draw(*shape):
        return torch.randint(-64, 65, shape, generator=generator)

    k = int(torch.randint(-20, 11, (1,), generator=generator))
    e0 = int(torch.randint(1, 2049, (1,), generator=generator))
    ints = draw(num_tokens, num_heads, 512)
    if num_tokens:
        ints[0, 0] = 0  # a head of zeros: y = 0 * (1/sqrt(eps))
    for head in ints.view(-1, 512):
        while True:
            # 2 * sum(x^2) + e0^2 = M^2 with x[0]^2 + x[1]^2 = need, M = e0 (mod 2)
            rest = int((head[2:] ** 2).sum())
            m = math.isqrt(2 * rest + e0 * e0 - 1) + 1
            m += (m - e0) % 2
            while (need := (m * m - e0 * e0) // 2 - rest) <= 2 * 64 * 64 and need not in _TWO_SQUARES:
                m += 2
            if need in _TWO_SQUARES:
                signs = torch.where(draw(2) >= 0, 1, -1)
                head[:2] = signs * torch.tensor(_TWO_SQUARES[need])
                break
            head[2:] = draw(510)  # no two squares fit: draw the rest of the head again
    q = ints.float() * 2.0**k
    return q.to(torch.bfloat16), e0 * e0 * 2.0 ** (2 * k - 10)


def seeded_dsv4_inputs(num_tokens, num_heads, padded_heads, block_size, device, *, exact_q: bool = True,
                       **options) -> tuple[Dsv4Inputs, int]:
    """(``make_dsv4_inputs`` from a fresh seed, the seed), with q and eps from ``exact_rms_q``
    unless ``exact_q`` is False (an RMS no summation order or sqrt can move)."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(num_tokens, num_heads, padded_heads, block_size, device, generator=generator, **options)
    if exact_q:
        q, eps = exact_rms_q(num_tokens, num_heads, generator)
        inputs = replace(inputs, q=q.to(device), eps=eps)
    return inputs, seed


@dataclass
class Dsv4Comparison:
    """How two runs of the op on the same inputs differ."""

    q_elements: int
    q_mismatches: int  # elements of q_out that differ at all
    q_max_ulp: int  # largest difference, bf16 ULPs
    q_nope_max_ulp: int  # largest difference among dims [0, 448), bf16 ULPs
    q_rope_over_1ulp: int  # RoPE-dim elements (448..511) more than 1 bf16 ULP apart
    cache_bytes: int
    cache_mismatches: int  # bytes of k_cache that differ at all
    cache_max_code_diff: int  # largest difference among fp8 data bytes, e4m3 codes
    cache_non_fp8_mismatches: int  # differing bytes outside fp8 data (bf16 rope, scales, untouched)

    def within_spec(self, per_million: float = 10.0) -> bool:
        """The DeepSeek-V4 bound (docs/design.md): at most 1 bf16 ULP on a few q values per million, one fp8 code
        on a few cache bytes per million, everything else identical. "A few" q values has
        a floor of 32, as they come in clusters: a head whose sum of squares rounds
        differently moves every value of the head near a rounding boundary (an H200 run
        saw 14 one-ULP values in 524288 at T=8, H=128; ~3 per million at large T).

        One allowance, in the RoPE dims only: e*cos - o*sin can cancel almost to zero,
        and there a one-ulp fp32 difference of 1/sqrt(mean(x^2)+eps) (summation order)
        is many bf16 ULPs of the tiny result. Such values may differ by more than one
        ULP, at most one per million q values (seen: 1 to 3 per 268M on an H200).
        """
        q_ok = (
            self.q_nope_max_ulp <= 1
            and self.q_rope_over_1ulp <= max(1, self.q_elements / 1e6)
            and self.q_mismatches <= max(32, self.q_elements * per_million / 1e6)
        )
        c_ok = (
            self.cache_max_code_diff <= 1
            and self.cache_non_fp8_mismatches <= max(1, self.cache_bytes * per_million / 1e6)
            and self.cache_mismatches <= max(1, self.cache_bytes * per_million / 1e6)
        )
        return q_ok and c_ok


def fp8_data_byte_mask(k_cache: torch.Tensor, block_size: int, kv_mxfp8: bool = False) -> torch.Tensor:
    """True for the cache bytes that hold fp8 codes: bytes [0, 448) of each fp8_ds_mla slot row,
    or [0, 512) of each MXFP8 record (``kv_mxfp8``)."""
    cols = torch.arange(k_cache.shape[1], device=k_cache.device)
    row, codes = (MXFP8_SLOT_BYTES, HEAD_DIM) if kv_mxfp8 else (CACHE_ROW_BYTES, NOPE_DIM)
    return ((cols < block_size * row) & (cols % row < codes)).expand_as(k_cache)


def compare_dsv4_q(a: torch.Tensor, b: torch.Tensor) -> Dsv4Comparison:
    """Compare two bf16 q tensors [..., 512] alone (the cache fields are zero), e.g. a
    compiled model's padded q against eager's, with the same ``within_spec`` bound."""
    ulp = bf16_ulp_diff(a, b)
    nope_ulp, rope_ulp = ulp[..., :NOPE_DIM], ulp[..., NOPE_DIM:]
    return Dsv4Comparison(
        q_elements=a.numel(),
        q_mismatches=int((ulp != 0).sum()),
        q_max_ulp=int(ulp.max()) if ulp.numel() else 0,
        q_nope_max_ulp=int(nope_ulp.max()) if nope_ulp.numel() else 0,
        q_rope_over_1ulp=int((rope_ulp > 1).sum()),
        cache_bytes=0,
        cache_mismatches=0,
        cache_max_code_diff=0,
        cache_non_fp8_mismatches=0,
    )


def compare_dsv4(a: Dsv4Inputs, b: Dsv4Inputs) -> Dsv4Comparison:
    """Compare the outputs of two runs (q_out and the whole cache, untouched bytes included)."""
    q = compare_dsv4_q(a.q_out, b.q_out)
    cache_diff = a.k_cache != b.k_cache
    fp8_mask = fp8_data_byte_mask(a.k_cache, a.block_size, a.kv_mxfp8)
    code_diff = torch.where(fp8_mask, e4m3_code_diff(a.k_cache, b.k_cache), 0)
    return replace(
        q,
        cache_bytes=a.k_cache.numel(),
        cache_mismatches=int(cache_diff.sum()),
        cache_max_code_diff=int(code_diff.max()) if code_diff.numel() else 0,
        cache_non_fp8_mismatches=int((cache_diff & ~fp8_mask).sum()),
    )


def fp8_ds_mla_values(k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """The fp32 ``[n, 512]`` values an fp8_ds_mla cache holds at ``slot_mapping``: each NoPE
    code times its block's UE8M0 scale ``2^(byte - 127)``, then the bf16 RoPE values. For
    comparing caches that two spellings wrote (``max_row_rel_diff``) where their bytes may
    differ by a code or a rounding."""
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    data = k_cache[:, : block_size * CACHE_ROW_BYTES].reshape(k_cache.shape[0], block_size, CACHE_ROW_BYTES)
    scales = k_cache[:, block_size * CACHE_ROW_BYTES: block_size * (CACHE_ROW_BYTES + SCALE_BYTES)]
    scales = scales.reshape(k_cache.shape[0], block_size, SCALE_BYTES)[blocks, rows, : NOPE_DIM // 64]
    row = data[blocks, rows]
    codes = row[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (NOPE_DIM // 64, 64))
    nope = (codes * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)
    return torch.cat((nope, row[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()), dim=-1)


def mxfp8_values(k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """The fp32 ``[n, 512]`` values a cache of DeepSeek-V4.1's MXFP8 records holds at
    ``slot_mapping``: each code times its block's UE8M0 scale ``2^(byte - 127)``."""
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    records = k_cache[:, : block_size * MXFP8_SLOT_BYTES].reshape(k_cache.shape[0], block_size, MXFP8_SLOT_BYTES)
    record = records[blocks, rows]
    codes = record[:, :HEAD_DIM].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, 32))
    return (codes * torch.exp2(record[:, HEAD_DIM:].float() - 127).unsqueeze(-1)).flatten(-2)
