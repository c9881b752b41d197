"""Plain-PyTorch math more than one op's reference uses: the two RoPE pairings and the
power-of-two-scaled e4m3 quantisation. One spelling each, so the references of every
family compute the same steps in the same order (and so the same bits)."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def rope_gptj(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last dim of ``y`` by pairs (2p, 2p+1)."""
    e, o = y[..., 0::2], y[..., 1::2]
    return torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2)


def rope_neox(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) rotation of the last dim of ``y`` by pairs (i, i + n/2)."""
    a, b = y.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def e4m3_pow2_quant(x: torch.Tensor, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes of ``x`` as uint8, e) with one power-of-two scale ``2^e`` per row of the
    last dim: ``e = ceil(log2(max(amax(|x|), floor) / 448))``, codes ``e4m3(clamp(x * 2^-e,
    +-448))``, round to nearest even. The scale is a power of two, so ``x * 2^-e`` is exact."""
    amax = x.abs().amax(dim=-1).clamp_min(amax_floor)
    e = torch.ceil(torch.log2(amax / E4M3_MAX))
    scaled = (x * torch.exp2(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), e
