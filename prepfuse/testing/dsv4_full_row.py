"""``prepfuse::dsv4_qnorm_rope_kv_full_row_insert``: one call's inputs, made fresh and poisoned, and
how two runs differ (bf16 ULPs or e4m3 codes of q_out and of the cache rows)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prepfuse.ops.dsv4_qnorm_rope_kv_insert import HEAD_DIM
from prepfuse.testing.common import (
    CACHE_POISON, Q_POISON, bf16_ulp_diff, e4m3_code_diff, fresh_generator, poisoned_like, seeded_generator,
)
from prepfuse.testing.dsv4 import compare_dsv4_q, exact_rms_q, make_dsv4_inputs

__all__ = ["FULL_ROW_FORMATS", "Dsv4FullRowInputs", "make_dsv4_full_row_inputs", "seeded_dsv4_full_row_inputs",
           "Dsv4FullRowComparison", "compare_dsv4_full_row"]

FP8 = torch.float8_e4m3fn
# (q_out dtype, k_cache dtype) by name: vLLM's two formats, and the two mixed ones the op accepts
FULL_ROW_FORMATS = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp8": (FP8, FP8),
    "bf16-q-fp8-cache": (torch.bfloat16, FP8),
    "fp8-q-bf16-cache": (FP8, torch.bfloat16),
}


@dataclass
class Dsv4FullRowInputs:
    """One call's arguments of ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert``."""

    q: torch.Tensor
    kv: torch.Tensor
    q_out: torch.Tensor
    k_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_scale: torch.Tensor | None
    q_scale_inv: torch.Tensor | None
    eps: float
    block_size: int
    wrap_indices: bool = False
    apply_q_norm: bool = True  # False: q rotated as it is (DeepSeek-V4.1)

    def args(self) -> tuple:
        return (
            self.q, self.kv, self.q_out, self.k_cache, self.slot_mapping, self.positions, self.cos_sin_cache,
            self.kv_scale, self.q_scale_inv, self.eps, self.block_size, self.wrap_indices, self.apply_q_norm,
        )

    def fresh_outputs(self) -> "Dsv4FullRowInputs":
        """The same inputs with newly poisoned q_out (-123.0, or 0xA5 bytes when fp8) and k_cache."""
        q_poison = Q_POISON if self.q_out.dtype == torch.bfloat16 else None
        return replace(self, q_out=poisoned_like(self.q_out, value=q_poison), k_cache=_poisoned_storage(self.k_cache))


def _poisoned_storage(t: torch.Tensor) -> torch.Tensor:
    """``poisoned_like(t)`` with every byte of its storage poisoned, the bytes between blocks of a
    strided cache view too (a write there shows up)."""
    out = poisoned_like(t)
    torch.empty(0, dtype=torch.uint8, device=t.device).set_(out.untyped_storage()).fill_(CACHE_POISON)
    return out


def make_dsv4_full_row_inputs(
    num_tokens: int, num_heads: int, padded_heads: int, block_size: int, device, *, fmt: str = "bf16",
    generator: torch.Generator | None = None, block_padding: int = 0, **options,
) -> Dsv4FullRowInputs:
    """Fresh random inputs with poisoned outputs, in format ``fmt`` (``FULL_ROW_FORMATS``).

    q, kv, slots and positions as ``make_dsv4_inputs`` draws them (``options`` go to it). Scales
    are no powers of two (kv_scale in [0.3, 3), q_scale_inv in [2, 20)), so that the reciprocal's
    rounding matters and large values saturate. ``block_padding``: elements between blocks past
    ``block_size * 512`` (a cache view whose blocks are not adjacent).
    """
    gen = fresh_generator(generator)
    base = make_dsv4_inputs(num_tokens, num_heads, padded_heads, block_size, device, generator=gen, **options)
    q_dtype, cache_dtype = FULL_ROW_FORMATS[fmt]
    num_blocks = base.k_cache.shape[0]
    backing = torch.empty(num_blocks, block_size * HEAD_DIM + block_padding, dtype=cache_dtype, device=device)
    k_cache = backing[:, : block_size * HEAD_DIM].unflatten(1, (block_size, HEAD_DIM))

    def scale(low: float, high: float) -> torch.Tensor:
        return (low + (high - low) * torch.rand(1, generator=gen)).to(device)

    inputs = Dsv4FullRowInputs(
        q=base.q, kv=base.kv,
        q_out=torch.empty(num_tokens, padded_heads, HEAD_DIM, dtype=q_dtype, device=device),
        k_cache=k_cache, slot_mapping=base.slot_mapping, positions=base.positions,
        cos_sin_cache=base.cos_sin_cache,
        kv_scale=scale(0.3, 3.0) if cache_dtype == FP8 else None,
        q_scale_inv=scale(2.0, 20.0) if q_dtype == FP8 else None,
        eps=base.eps, block_size=block_size, apply_q_norm=base.apply_q_norm,
    )
    return inputs.fresh_outputs()


def seeded_dsv4_full_row_inputs(num_tokens, num_heads, padded_heads, block_size, device, *, exact_q: bool = True,
                                **options) -> tuple[Dsv4FullRowInputs, int]:
    """(``make_dsv4_full_row_inputs`` from a fresh seed, the seed), with q and eps from
    ``exact_rms_q`` unless ``exact_q`` is False (an RMS no summation order or sqrt can move)."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_full_row_inputs(num_tokens, num_heads, padded_heads, block_size, device, generator=generator,
                                       **options)
    if exact_q:
        q, eps = exact_rms_q(num_tokens, num_heads, generator)
        inputs = replace(inputs, q=q.to(device), eps=eps)
    return inputs, seed


def _largest(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else 0


def _unit_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: bf16 ULPs apart, or e4m3 codes apart."""
    if a.dtype == torch.bfloat16:
        return bf16_ulp_diff(a, b)
    return e4m3_code_diff(a.view(torch.uint8), b.view(torch.uint8))


@dataclass
class Dsv4FullRowComparison:
    """How two runs of the op on the same inputs differ, in units of each output's format."""

    q_elements: int
    q_mismatches: int
    q_max_diff: int  # bf16 ULPs, or e4m3 codes
    q_within_spec: bool  # the DeepSeek-V4 bound on q (Dsv4Comparison.within_spec; fp8: one code)
    cache_mismatches: int  # bytes of k_cache that differ (the rows hold no sums: none may)
    cache_max_diff: int

    def exact(self) -> bool:
        return self.q_mismatches == 0 and self.cache_mismatches == 0

    def within_spec(self) -> bool:
        return self.q_within_spec and self.cache_mismatches == 0


def compare_dsv4_full_row(a: Dsv4FullRowInputs, b: Dsv4FullRowInputs) -> Dsv4FullRowComparison:
    """Compare the outputs of two runs (q_out, and the whole cache, untouched bytes included)."""
    q_diff = _unit_diff(a.q_out, b.q_out)
    q_mismatches = int((q_diff != 0).sum())
    if a.q_out.dtype == torch.bfloat16:
        q_ok = compare_dsv4_q(a.q_out, b.q_out).within_spec()
    else:  # a one-ulp fp32 RMS moves a value by at most one code, on a few per million
        q_ok = _largest(q_diff) <= 1 and q_mismatches <= max(32, q_diff.numel() * 10 / 1e6)
    cache_bytes = a.k_cache.view(torch.uint8) != b.k_cache.view(torch.uint8)
    cache_diff = _unit_diff(a.k_cache, b.k_cache)
    return Dsv4FullRowComparison(
        q_elements=q_diff.numel(), q_mismatches=q_mismatches, q_max_diff=_largest(q_diff),
        q_within_spec=q_ok, cache_mismatches=int(cache_bytes.sum()), cache_max_diff=_largest(cache_diff),
    )
