"""Plain-PyTorch math more than one op's reference uses: the two RoPE pairings, the
power-of-two-scaled e4m3 quantisation and UE8M0 scale bytes. One spelling each, so the
references of every family compute the same steps in the same order (and so the same
bits)."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F
UE8M0_NAN = 0xFF


def rope_gptj(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last dim of ``y`` by pairs (2p, 2p+1).

    ``cos``/``sin`` hold one value per pair (half ``y``'s width), or one per element (as
    wide as ``y``: ``y[2p]`` is rotated by entry 2p and ``y[2p+1]`` by entry 2p+1, which is
    ``y * cos + rotate_pairs(y) * sin`` written out)."""
    e, o = y[..., 0::2], y[..., 1::2]
    if cos.shape[-1] == y.shape[-1]:
        (cos_e, cos_o), (sin_e, sin_o) = (cos[..., 0::2], cos[..., 1::2]), (sin[..., 0::2], sin[..., 1::2])
    else:
        cos_e = cos_o = cos
        sin_e = sin_o = sin
    return torch.stack((e * cos_e - o * sin_e, e * sin_o + o * cos_o), dim=-1).flatten(-2)


def rope_neox(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) rotation of the last dim of ``y`` by pairs (i, i + n/2).

    ``cos``/``sin`` hold one value per pair (half ``y``'s width), or one per element (as
    wide as ``y``, Hugging Face's ``y * cos + rotate_half(y) * sin``: the first half is
    rotated by the first half of the table, the second by the second)."""
    a, b = y.chunk(2, dim=-1)
    if cos.shape[-1] == y.shape[-1]:
        (cos_a, cos_b), (sin_a, sin_b) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    else:
        cos_a = cos_b = cos
        sin_a = sin_b = sin
    return torch.cat((a * cos_a - b * sin_a, b * cos_b + a * sin_b), dim=-1)


def e4m3_pow2_quant(x: torch.Tensor, amax_floor: float, *, non_finite_blocks: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes of ``x`` as uint8, e) with one power-of-two scale ``2^e`` per row of the
    last dim: ``e = ceil(log2(max(amax(|x|), floor) / 448))``, codes ``e4m3(clamp(x * 2^-e,
    +-448))``, round to nearest even. The scale is a power of two, so ``x * 2^-e`` is exact.

    ``non_finite_blocks``: the ops' rule (``docs/ops.md``, non-finite inputs): a row holding
    a NaN or an infinity has no scale, ``e`` is NaN and every code 0x7F (e4m3fn's NaN).
    Without it, the math as model code writes it (the unfused baselines), which leaves such
    a row undefined."""
    amax = x.abs().amax(dim=-1)  # NaN when the row holds one
    e = torch.ceil(torch.log2(amax.clamp_min(amax_floor) / E4M3_MAX))
    if non_finite_blocks:
        finite = amax.isfinite()
        e = torch.where(finite, e, torch.nan)
    scaled = (x * torch.exp2(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    if non_finite_blocks:
        codes = torch.where(finite.unsqueeze(-1), codes, E4M3_NAN_CODE)
    return codes, e


def ue8m0_bytes(e: torch.Tensor, *, non_finite_blocks: bool = True) -> torch.Tensor:
    """Power-of-two exponents (float) as UE8M0 bytes ``e + 127``; ``non_finite_blocks``: NaN
    (a block without a scale) as 0xFF, UE8M0's NaN (else the models' ``clamp(0, 255)``)."""
    if not non_finite_blocks:
        return (e + 127).clamp(0, 255).to(torch.uint8)
    return torch.where(e.isnan(), UE8M0_NAN, (e + 127).clamp(0, 254)).to(torch.uint8)
