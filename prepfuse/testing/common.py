"""What every family's checks share: poisoned outputs, fresh generators, random slots, a
cos/sin table, ULP and code distances, wrapped indices, and a call through the fake impl."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Q_POISON", "CACHE_POISON", "poisoned_like", "fresh_generator", "seeded_generator", "random_slots", "rope_cos_sin_cache", "bf16_ulp_diff", "e4m3_code_diff", "max_row_rel_diff", "with_wrapped_indices", "call_with_fake_tensors", "to_device"]

Q_POISON = -123.0
CACHE_POISON = 0xA5


def poisoned_like(t: torch.Tensor, *, value: float | None = None) -> torch.Tensor:
    """A new tensor with ``t``'s shape, strides, dtype and device, every element ``value``,
    or (default) every byte ``CACHE_POISON`` (any dtype, fp8 included)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    if value is None:
        out.view(torch.uint8).fill_(CACHE_POISON)
    else:
        out.fill_(value)
    return out


def fresh_generator(generator: torch.Generator | None) -> torch.Generator:
    """``generator``, or a new CPU one with a nondeterministic seed (the global RNG is left alone)."""
    if generator is None:
        generator = torch.Generator()
        generator.seed()
    return generator


def seeded_generator() -> tuple[torch.Generator, int]:
    """(a new CPU generator, its seed): a fresh nondeterministic seed that a failure message
    can carry, so the failing data can be drawn again."""
    generator = torch.Generator()
    return generator, generator.seed()


def random_slots(
    num_inserted: int, spare_slots: int, block_size: int, skip_fraction: float, gen: torch.Generator
) -> tuple[int, torch.Tensor]:
    """(num_blocks, slots): enough blocks for ``num_inserted + spare_slots`` slots, and
    ``num_inserted`` distinct random slots of them, about ``skip_fraction`` set to -1."""
    num_blocks = -(-(num_inserted + spare_slots) // block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_inserted]
    skip = torch.rand(num_inserted, generator=gen) < skip_fraction
    return num_blocks, torch.where(skip, torch.full_like(slots, -1), slots)


def rope_cos_sin_cache(max_pos: int, device, base: float = 10000.0, rotary_dim: int = 64) -> torch.Tensor:
    """A real RoPE table [max_pos, rotary_dim] fp32: rotary_dim/2 cos then as many sin per position."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.float32).to(device)


def bf16_ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 units in the last place (int32), for same-shape bf16 tensors."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    # sign-magnitude bit patterns onto a monotone integer line (+0 and -0 coincide)
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


def e4m3_code_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in e4m3 codes (int32), for uint8 tensors holding e4m3fn bytes."""
    ia, ib = a.to(torch.int32), b.to(torch.int32)
    ia = torch.where(ia >= 128, 128 - ia, ia)
    ib = torch.where(ib >= 128, 128 - ib, ib)
    return (ia - ib).abs()


def with_wrapped_indices(inputs, num_slots: int):
    """``inputs`` (a family's inputs with ``slot_mapping``, ``positions``, ``cos_sin_cache``
    and ``wrap_indices``) with every other slot and position counted from the end of the
    ``num_slots`` slots and of the table, and ``wrap_indices=True``: the same rows written,
    through the wrap. Slots must all be valid (under the wrap a negative slot is no skip)."""
    slots, positions = inputs.slot_mapping.clone(), inputs.positions.clone()
    if (slots < 0).any():
        raise ValueError("slot_mapping: a skipped (negative) slot has no wrapped form; make the inputs without skips")
    slots[::2] -= num_slots
    positions[::2] -= inputs.cos_sin_cache.shape[0]
    return dataclasses.replace(inputs, slot_mapping=slots, positions=positions, wrap_indices=True)


def max_row_rel_diff(got, want) -> float:
    """The largest relative difference of a row, over pairs of same-shape float tensors: per
    row (last dim), the largest ``|got - want|`` over the row's largest ``|want|`` (at least
    1e-3, so an all-zero row is compared absolutely). How the corpus compares written cache
    rows of two backends, or of a backend and eager."""
    return max(((g - w).abs().amax(-1) / w.abs().amax(-1).clamp_min(1e-3)).max().item() for g, w in zip(got, want))


def call_with_fake_tensors(op, args: dict) -> None:
    """Call ``op`` under a FakeTensorMode on fake copies of ``args`` (its fake impl runs),
    as torch.compile's tracing does: what the fake impl checks, it checks here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        op(*[mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in args.values()])


def to_device(inputs, device):
    """A family's inputs (a dataclass) with every tensor field moved to ``device``."""
    tensors = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return dataclasses.replace(inputs, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})
