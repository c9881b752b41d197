"""``prepfuse::dsv4_indexer_rope_fp8_insert`` / ``dsv4_indexer_rope_mxfp4_insert``: one call's
inputs per format, made fresh and poisoned, the bytes it writes, and the comparison."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prepfuse.testing.common import fresh_generator, poisoned_like, random_slots, rope_cos_sin_cache

__all__ = ["INDEXER_FORMATS", "Dsv4IndexerInputs", "make_dsv4_indexer_inputs", "indexer_written_bytes", "indexer_outputs", "compare_dsv4_indexer"]


INDEXER_FORMATS = ("fp8", "mxfp4")


@dataclass
class Dsv4IndexerInputs:
    """One call's arguments of the DeepSeek-V4 indexer op of format ``fmt``
    (``q_scale`` is None for fp8, whose schema has no such argument)."""

    fmt: str
    q: torch.Tensor
    weights: torch.Tensor
    k: torch.Tensor
    q_out: torch.Tensor
    q_scale: torch.Tensor | None
    weights_out: torch.Tensor
    k_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    k_positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    weights_scale: float
    block_size: int

    def args(self) -> tuple:
        outs = (self.q_out,) if self.fmt == "fp8" else (self.q_out, self.q_scale)
        return (
            self.q, self.weights, self.k, *outs, self.weights_out, self.k_cache, self.slot_mapping,
            self.positions, self.k_positions, self.cos_sin_cache, self.weights_scale, self.block_size,
        )

    @property
    def slot_bytes(self) -> int:
        return 132 if self.fmt == "fp8" else 68

    def fresh_outputs(self) -> "Dsv4IndexerInputs":
        """The same inputs with newly poisoned outputs (every byte CACHE_POISON)."""
        return replace(
            self,
            q_out=poisoned_like(self.q_out),
            q_scale=None if self.q_scale is None else poisoned_like(self.q_scale),
            weights_out=poisoned_like(self.weights_out),
            k_cache=poisoned_like(self.k_cache),
        )


def make_dsv4_indexer_inputs(
    fmt: str,
    num_tokens: int,
    num_heads: int,
    block_size: int,
    device,
    *,
    num_k: int | None = None,
    generator: torch.Generator | None = None,
    num_inserted: int | None = None,
    skip_fraction: float = 0.1,
    spare_slots: int = 64,
    max_pos: int = 8192,
    weights_dtype: torch.dtype = torch.bfloat16,
    weights_scale: float = 128**-0.5 * 64**-0.5,
) -> Dsv4IndexerInputs:
    """Fresh random inputs with poisoned outputs, for format ``fmt`` ("fp8" or "mxfp4").

    q and k have per-32-value-block magnitudes from about 1e-6 to 1e3 (so the per-head
    and per-block scales, e4m3 subnormals and every e2m1 code are exercised); k has
    ``num_k`` rows (default ``num_tokens``), the first ``num_inserted`` (default all) of
    which get distinct random slots, about ``skip_fraction`` of them -1. The cache rows
    are padded past ``block_size`` slots' bytes, as engines align blocks.
    """
    if fmt not in INDEXER_FORMATS:
        raise ValueError(f"fmt: must be one of {INDEXER_FORMATS}, got {fmt!r}")
    gen = fresh_generator(generator)
    num_k = num_tokens if num_k is None else num_k
    num_inserted = num_k if num_inserted is None else num_inserted

    def blocky(*rows):
        scale = torch.exp(torch.randn(*rows, 4, 1, generator=gen) * 3).clamp(1e-6, 1e3)
        return (torch.randn(*rows, 4, 32, generator=gen) * scale).flatten(-2).to(torch.bfloat16)

    q = blocky(num_tokens, num_heads)
    k = blocky(num_k)
    weights = torch.randn(num_tokens, num_heads, generator=gen).to(weights_dtype)
    num_blocks, slots = random_slots(num_inserted, spare_slots, block_size, skip_fraction, gen)
    slot_bytes = 132 if fmt == "fp8" else 68
    row_stride = block_size * slot_bytes + 64  # padded: bytes past the slots stay untouched
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    k_positions = torch.randint(0, max_pos, (num_k,), generator=gen)
    if fmt == "fp8":
        q_out = torch.empty(num_tokens, num_heads, 128, dtype=torch.float8_e4m3fn, device=device)
        q_scale = None
    else:
        q_out = torch.empty(num_tokens, num_heads, 64, dtype=torch.uint8, device=device)
        q_scale = torch.empty(num_tokens, num_heads, 4, dtype=torch.uint8, device=device)
    inputs = Dsv4IndexerInputs(
        fmt=fmt,
        q=q.to(device),
        weights=weights.to(device),
        k=k.to(device),
        q_out=q_out,
        q_scale=q_scale,
        weights_out=torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device),
        k_cache=torch.empty(num_blocks, row_stride, dtype=torch.uint8, device=device),
        slot_mapping=slots.to(device),
        positions=positions.to(device),
        k_positions=k_positions.to(device),
        cos_sin_cache=rope_cos_sin_cache(max_pos, device),
        weights_scale=weights_scale,
        block_size=block_size,
    )
    return inputs.fresh_outputs()


def indexer_written_bytes(inputs: Dsv4IndexerInputs) -> torch.Tensor:
    """True for the k_cache bytes the op must write: each inserted slot's data and 4 scale bytes."""
    mask = torch.zeros(inputs.k_cache.shape, dtype=torch.bool)
    bs, width = inputs.block_size, inputs.slot_bytes - 4
    for slot in inputs.slot_mapping.tolist():
        if slot >= 0:
            block, row = divmod(slot, bs)
            mask[block, row * width : (row + 1) * width] = True
            mask[block, bs * width + row * 4 : bs * width + (row + 1) * 4] = True
    return mask.to(inputs.k_cache.device)


def indexer_outputs(inputs: Dsv4IndexerInputs) -> dict[str, torch.Tensor]:
    """The written tensors as raw bytes, by name (for exact comparisons)."""
    outs = {"q_out": inputs.q_out.view(torch.uint8), "weights_out": inputs.weights_out, "k_cache": inputs.k_cache}
    if inputs.q_scale is not None:
        outs["q_scale"] = inputs.q_scale
    return outs


def compare_dsv4_indexer(a: Dsv4IndexerInputs, b: Dsv4IndexerInputs) -> dict[str, int]:
    """Elements that differ between two runs' outputs, by output name (weights by bits)."""
    diffs = {}
    for name, x in indexer_outputs(a).items():
        y = indexer_outputs(b)[name]
        if x.dtype == torch.float32:
            x, y = x.view(torch.int32), y.view(torch.int32)
        diffs[name] = int((x != y).sum())
    return diffs
