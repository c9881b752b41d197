"""DeepSeek-V4 lightning-indexer preparation (FP8 format), unfused, as model authors write it.

The math is ``prepfuse::dsv4_indexer_rope_fp8_insert``'s (``prepfuse/ops/dsv4_indexer_common.py``)
in plain PyTorch: GPT-J RoPE on the last 64 of the 128 dims, a bf16 round trip, one
power-of-two e4m3 scale per row of 128 folded into the head weights (q) or stored beside
the codes (k, a 132-byte slot of the paged indexer cache). Spellings are rows of a table
(:class:`IndexerSpelling`):

======  ==================================================================================
axis    choices
======  ==================================================================================
split   ``slice``: ``x[..., :64]``, ``x[..., 64:]``; ``split``: ``x.split([64, 64], -1)``
rope    ``strided``: ``x[..., ::2]``, ``x[..., 1::2]``, ``torch.stack(.., -1).flatten(-2)``;
        ``complex``: ``view_as_complex`` times ``torch.complex(cos, sin)``
write   ``view``: ``cache[:, :bs*128].view(NB, bs, 128)[s // bs, s % bs] = codes``;
        ``columns``: ``cache[(s // bs)[:, None], (s % bs)[:, None] * 128 + arange(128)] = codes``
scales  ``unsqueeze``: ``exp2(e).unsqueeze(-1).view(uint8)``; ``bytes``: ``exp2(e).view(uint8).view(-1, 4)``
======  ==================================================================================

Torch 2.11's Inductor cannot compile the ``unsqueeze`` scales unfused (its view of the size-1
dim has stride 0, which ``view(dtype)`` rejects); later torch can. The look-alikes, which
must compile unfused, write ``bytes``.

:data:`INDEXER_LOOKALIKES` compute something else (NeoX RoPE, RoPE on the first 64 dims
as DeepSeek-V3.2's indexer, no bf16 round trip, another amax floor); the pass must leave
them alone. As in ``models/dsv4.py``, a negative slot wraps as eager indexing wraps it, fused
or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prepfuse.ops.dsv4_indexer_common import FP8_AMAX_FLOOR, FP8_MAX, HEAD_DIM, NOPE_DIM, ROPE_DIM

_SPLITS = ("slice", "split")
_ROPES = ("strided", "complex", "neox")
_WRITES = ("view", "columns", "columns_next_row")  # the last: a look-alike (tests/fx_passes/test_validation.py)
_SCALES = ("unsqueeze", "bytes")


@dataclass(frozen=True)
class IndexerSpelling:
    """One way of writing the indexer preparation (see the module docstring's table)."""

    name: str
    split: str = "slice"
    rope: str = "strided"
    write: str = "view"
    scales: str = "unsqueeze"
    rope_first: bool = False  # look-alike: RoPE on dims 0..63 (DeepSeek-V3.2's indexer)
    bf16_round: bool = True  # look-alike: quantise the fp32 rotation directly
    amax_floor: float = FP8_AMAX_FLOOR  # look-alike: another floor

    def __post_init__(self) -> None:
        for axis, allowed in (("split", _SPLITS), ("rope", _ROPES), ("write", _WRITES), ("scales", _SCALES)):
            if getattr(self, axis) not in allowed:
                raise ValueError(f"{axis}: must be one of {allowed}, got {getattr(self, axis)!r}")


INDEXER_SPELLINGS: tuple[IndexerSpelling, ...] = (
    IndexerSpelling("slice-strided-view"),
    IndexerSpelling("split-complex-columns", "split", "complex", "columns"),
    IndexerSpelling("slice-complex-view", "slice", "complex", "view"),
    IndexerSpelling("split-strided-columns", "split", "strided", "columns"),
    IndexerSpelling("slice-strided-view-bytes", scales="bytes"),
)

INDEXER_LOOKALIKES: tuple[IndexerSpelling, ...] = (
    IndexerSpelling("neox_rope", rope="neox", scales="bytes"),
    IndexerSpelling("rope_first_64", rope_first=True, scales="bytes"),
    IndexerSpelling("no_bf16_round", bf16_round=False, scales="bytes"),
    IndexerSpelling("amax_floor_1e-6", amax_floor=1e-6, scales="bytes"),
)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spelling: IndexerSpelling) -> torch.Tensor:
    """fp32 ``x [..., 128]`` with its last 64 dims rotated (GPT-J pairs), rounded to bf16 and back."""
    if spelling.split == "split":
        a, b = x.split([NOPE_DIM, ROPE_DIM], dim=-1)
    else:
        a, b = x[..., :NOPE_DIM], x[..., NOPE_DIM:]
    nope, pe = (b, a) if spelling.rope_first else (a, b)
    if spelling.rope == "strided":
        e, o = pe[..., ::2], pe[..., 1::2]
        pe = torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2)
    elif spelling.rope == "complex":
        pc = torch.view_as_complex(pe.unflatten(-1, (-1, 2)))
        pe = torch.view_as_real(pc * torch.complex(cos, sin)).flatten(-2)
    else:  # look-alike: NeoX rotate-half pairs (i, i + 32)
        h1, h2 = pe[..., : ROPE_DIM // 2], pe[..., ROPE_DIM // 2 :]
        pe = torch.cat((h1 * cos - h2 * sin, h2 * cos + h1 * sin), dim=-1)
    y = torch.cat((pe, nope) if spelling.rope_first else (nope, pe), dim=-1)
    return y.to(torch.bfloat16).float() if spelling.bf16_round else y


def fp8_row_quant(y: torch.Tensor, spelling: IndexerSpelling) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``y [..., 128]`` -> (e4m3 [..., 128], exponent e [...]), scale 2^e per row."""
    amax = y.abs().amax(dim=-1).clamp_min(spelling.amax_floor)
    e = torch.ceil(torch.log2(amax / FP8_MAX))
    codes = (y * torch.exp2(-e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, e


def indexer_q_prep(
    q, weights, positions, cos_sin_cache, weights_scale, spelling,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, 128] bf16, weights [T, H] -> (q fp8 [T, H, 128], weights [T, H] fp32 with the
    per-head q scale folded in), as vLLM's ``fused_indexer_q_rope_quant`` returns them."""
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, : ROPE_DIM // 2].unsqueeze(1), cs[:, ROPE_DIM // 2 :].unsqueeze(1)
    y = rope_tail(q.float(), cos, sin, spelling)
    q_fp8, e = fp8_row_quant(y, spelling)
    return q_fp8, weights.float() * torch.exp2(e) * weights_scale


def indexer_k_insert(
    k, k_cache, slot_mapping, k_positions, cos_sin_cache, block_size, spelling,
) -> None:
    """Rotate, quantise and write the first ``len(slot_mapping)`` rows of k [Tk, 128] into the
    fp8 indexer cache [NB, S] uint8: per block, ``block_size`` rows of 128 code bytes, then
    ``block_size`` fp32 scales. Every slot must be valid (see the module docstring)."""
    n = slot_mapping.shape[0]
    cs = cos_sin_cache[k_positions[:n]]
    y = rope_tail(k[:n].float(), cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :], spelling)
    codes, e = fp8_row_quant(y, spelling)
    data = codes.view(torch.uint8)  # [n, 128]
    if spelling.scales == "unsqueeze":
        scales = torch.exp2(e).unsqueeze(-1).view(torch.uint8)  # [n, 4]: fp32 little-endian
    else:
        scales = torch.exp2(e).view(torch.uint8).view(-1, 4)
    write_slot_rows(k_cache, data, scales, slot_mapping, block_size, spelling.write)


def write_slot_rows(k_cache: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor,
                    block_size: int, write: str) -> None:
    """Write data rows [n, W] and scale bytes [n, 4] at ``slot_mapping`` into an indexer cache
    [NB, S] uint8 (per block, ``block_size`` data rows, then ``block_size`` scale rows), the
    way a model spells it: ``"columns"`` scatters through computed byte columns, otherwise
    through [NB, block_size, W] views of each region. Both formats' model code writes this way."""
    width = data.shape[-1]
    blk, row = slot_mapping // block_size, slot_mapping % block_size
    if write == "columns_next_row":  # look-alike: each row one row further into its block
        row = (slot_mapping + 1) % block_size
    if write != "view":
        blk, row = blk.unsqueeze(1), row.unsqueeze(1)
        k_cache[blk, row * width + torch.arange(width, device=k_cache.device)] = data
        k_cache[blk, block_size * width + row * 4 + torch.arange(4, device=k_cache.device)] = scales
        return
    num_blocks = k_cache.shape[0]
    k_cache[:, : block_size * width].view(num_blocks, block_size, width)[blk, row] = data
    k_cache[:, block_size * width : block_size * (width + 4)].view(num_blocks, block_size, 4)[blk, row] = scales


def indexer_fp8_cache(num_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """An empty fp8 indexer cache [NB, S] uint8, S = block_size * 132 rounded up to 64 bytes."""
    stride = -(-block_size * (HEAD_DIM + 4) // 64) * 64
    return torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)
