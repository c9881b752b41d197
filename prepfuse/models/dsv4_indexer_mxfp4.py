"""DeepSeek-V4 lightning-indexer preparation (MXFP4 format), unfused, as model authors write it.

The math is ``prepfuse::dsv4_indexer_rope_mxfp4_insert``'s (``prepfuse/ops/dsv4_indexer_common.py``)
in plain PyTorch: GPT-J RoPE on the last 64 of the 128 dims and a bf16 round trip (the
FP8 model's ``rope_tail``), then per block of 32 values a UE8M0 scale
``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``, e2m1 nibbles (round to nearest even, bit 3
the sign bit) packed two per byte, even element low. q keeps its block scales apart
(``q_scale [T, H, 4]``) and its weights get no q scale; k rows go to a 68-byte slot of the
paged indexer cache (64 packed bytes, then 4 scale bytes after the block's data).

e2m1 rounding has no torch dtype, so model code spells it out. Two spellings, both the
op's bytes exactly (a row of :class:`Mxfp4Spelling`):

======  ==================================================================================
axis    choices
======  ==================================================================================
e2m1    ``compare``: the code counts the midpoints of the grid {0, .5, 1, 1.5, 2, 3, 4, 6}
        below ``|v|``, a midpoint next to an odd code counted on equality (ties to even):
        ``(a > .25) + (a >= .75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5)``;
        ``round``: the grid step is .5 below 2, 1 below 4, 2 above, so
        ``where(a < 2, round(2a), where(a < 4, round(a) + 2, round(a / 2) + 4))``
        (``torch.round`` rounds half to even, and an even multiple of the step is an even code)
pack    ``blocks``: pairs of the ``[.., 4, 32]`` codes; ``flat``: pairs of the codes
        flattened to ``[.., 128]`` first (blocks are 32 values, so pairs never straddle one)
split, rope, write   as in ``models/dsv4_indexer.py`` (``slice``/``split``,
        ``strided``/``complex``, ``view``/``columns``)
======  ==================================================================================

The sign is ``torch.signbit(v)`` (bit 3), so ``-0.0`` and negatives rounding to zero are
nibble 8, as IEEE rounding and PTX ``cvt.rn.satfinite.e2m1x2.f32`` give.
:data:`MXFP4_LOOKALIKES` compute something else (ties away from zero, the sign from
``v < 0``, NeoX RoPE, no bf16 round trip, another amax floor); the pass must leave them
alone. A negative slot wraps as eager indexing wraps it, fused or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prepfuse.models.dsv4_indexer import rope_tail, write_slot_rows
from prepfuse.ops.dsv4_indexer_common import (
    E2M1_MAX,
    MXFP4_AMAX_FLOOR,
    MXFP4_BLOCK,
    MXFP4_BLOCKS,
    MXFP4_PACKED,
    MXFP4_SLOT_BYTES,
    ROPE_DIM,
)

_SPLITS = ("slice", "split")
_ROPES = ("strided", "complex", "neox")
_WRITES = ("view", "columns")
_E2M1 = ("compare", "round", "ties_away")
_PACKS = ("blocks", "flat")
_SIGNS = ("signbit", "lt")

# (midpoint, counted on equality): a tie goes to the even code on either side
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class Mxfp4Spelling:
    """One way of writing the MXFP4 indexer preparation (see the module docstring's table).

    ``rope_first`` and ``bf16_round`` are read by ``models.dsv4_indexer.rope_tail``.
    """

    name: str
    split: str = "slice"
    rope: str = "strided"
    write: str = "view"
    e2m1: str = "compare"
    pack: str = "blocks"
    sign: str = "signbit"  # look-alike "lt": v < 0 (misses -0.0)
    rope_first: bool = False  # look-alike: RoPE on dims 0..63 (DeepSeek-V3.2's indexer)
    bf16_round: bool = True  # look-alike: quantise the fp32 rotation directly
    amax_floor: float = MXFP4_AMAX_FLOOR  # look-alike: another floor

    def __post_init__(self) -> None:
        axes = (("split", _SPLITS), ("rope", _ROPES), ("write", _WRITES), ("e2m1", _E2M1), ("pack", _PACKS),
                ("sign", _SIGNS))
        for axis, allowed in axes:
            if getattr(self, axis) not in allowed:
                raise ValueError(f"{axis}: must be one of {allowed}, got {getattr(self, axis)!r}")


MXFP4_SPELLINGS: tuple[Mxfp4Spelling, ...] = (
    Mxfp4Spelling("compare-blocks-slice-strided-view"),
    Mxfp4Spelling("round-flat-split-complex-columns", "split", "complex", "columns", "round", "flat"),
    Mxfp4Spelling("compare-flat-slice-complex-columns", "slice", "complex", "columns", "compare", "flat"),
    Mxfp4Spelling("round-blocks-split-strided-view", "split", "strided", "view", "round", "blocks"),
)

MXFP4_LOOKALIKES: tuple[Mxfp4Spelling, ...] = (
    Mxfp4Spelling("ties_away", e2m1="ties_away"),
    Mxfp4Spelling("sign_lt", sign="lt"),
    Mxfp4Spelling("neox_rope", rope="neox"),
    Mxfp4Spelling("no_bf16_round", bf16_round=False),
    Mxfp4Spelling("amax_floor_1e-4", amax_floor=1e-4),
)


def e2m1_codes(v: torch.Tensor, spelling: Mxfp4Spelling) -> torch.Tensor:
    """fp32 ``v`` (|v| <= 6 after the block scale) -> e2m1 nibbles, uint8 0..15."""
    a = v.abs()
    if spelling.e2m1 == "round":
        # the grid step is 0.5 below 2, 1 below 4, 2 from 4 on: round to the step, half to even;
        # saturate at 6 (code 7)
        a = a.clamp(max=E2M1_MAX)
        code = torch.where(a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a / 2) + 4))
        code = code.to(torch.uint8)
    else:
        u8 = torch.uint8
        if spelling.e2m1 == "ties_away":  # look-alike: every tie rounds up
            code = sum((a >= m).to(u8) for m, _ in E2M1_MIDPOINTS)
        else:
            code = ((a > 0.25).to(u8) + (a >= 0.75).to(u8) + (a > 1.25).to(u8) + (a >= 1.75).to(u8)
                    + (a > 2.5).to(u8) + (a >= 3.5).to(u8) + (a > 5.0).to(u8))
    negative = torch.signbit(v) if spelling.sign == "signbit" else v < 0
    return code | (negative.to(torch.uint8) << 3)


def mxfp4_block_quant(y: torch.Tensor, spelling: Mxfp4Spelling) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``y [..., 128]`` -> (packed [..., 64] uint8, UE8M0 scale bytes [..., 4] uint8)."""
    blocks = y.unflatten(-1, (MXFP4_BLOCKS, MXFP4_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp_min(spelling.amax_floor)
    e = torch.ceil(torch.log2(amax / E2M1_MAX))
    codes = e2m1_codes(blocks * torch.exp2(-e).unsqueeze(-1), spelling)
    if spelling.pack == "flat":
        codes = codes.flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even element in the low nibble
    return packed.reshape(*y.shape[:-1], MXFP4_PACKED), (e + 127).to(torch.uint8)


def indexer_q_prep(
    q, weights, positions, cos_sin_cache, weights_scale, spelling,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, 128] bf16, weights [T, H] -> (packed q [T, H, 64] uint8, scale bytes [T, H, 4]
    uint8, weights [T, H] fp32), as vLLM's ``fused_indexer_q_rope_quant`` (MXFP4) returns them."""
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, : ROPE_DIM // 2].unsqueeze(1), cs[:, ROPE_DIM // 2 :].unsqueeze(1)
    packed, scale_bytes = mxfp4_block_quant(rope_tail(q.float(), cos, sin, spelling), spelling)
    # the block scales travel with q, so the weights carry no q scale
    return packed, scale_bytes, weights.float() * weights_scale


def indexer_k_insert(
    k, k_cache, slot_mapping, k_positions, cos_sin_cache, block_size, spelling,
) -> None:
    """Rotate, quantise and write the first ``len(slot_mapping)`` rows of k [Tk, 128] into the
    MXFP4 indexer cache [NB, S] uint8: per block, ``block_size`` rows of 64 packed bytes, then
    ``block_size`` rows of 4 scale bytes. Every slot must be valid (see the module docstring)."""
    n = slot_mapping.shape[0]
    cs = cos_sin_cache[k_positions[:n]]
    y = rope_tail(k[:n].float(), cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :], spelling)
    data, scales = mxfp4_block_quant(y, spelling)  # [n, 64], [n, 4]
    write_slot_rows(k_cache, data, scales, slot_mapping, block_size, spelling.write)


def indexer_mxfp4_cache(num_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """An empty MXFP4 indexer cache [NB, S] uint8, S = block_size * 68 rounded up to 64 bytes."""
    stride = -(-block_size * MXFP4_SLOT_BYTES // 64) * 64
    return torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)
