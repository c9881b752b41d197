"""Input checks shared by the ops' eager paths and fake impls.

Every failure is a ``ValueError`` whose message starts with the argument's name, so an
engine author reading a traceback knows which tensor to look at. Under fake tensors,
sizes may be symbolic: a check only fails when the sizes are *known* to disagree, and
it never adds a guard (that would specialise a dynamic ``T``).
"""

from __future__ import annotations

import os

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


def known_false(cond) -> bool:
    """True when ``cond`` (a bool or SymBool) is certainly false, without guarding."""
    if isinstance(cond, bool):
        return not cond
    return statically_known_true(torch.sym_not(cond))


def require(cond, message: str) -> None:
    if known_false(cond):
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype,
    ndim: int,
    device: torch.device,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")


def check_size(name: str, t: torch.Tensor, dim: int, size, what: str) -> None:
    require(t.shape[dim] == size, f"{name}: dimension {dim} must be {what} ({size}), got shape {tuple(t.shape)}")


def check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    """Rows are read with wide vector loads, so the last dimension must be dense."""
    require(
        t.shape[-1] <= 1 or t.stride(-1) == 1,
        f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(t.stride())}",
    )


# Index values (slots, positions) can only be checked by reading them, which on CUDA is
# a host sync. The ops check them in eager use and skip the check during CUDA-graph
# capture; serving engines whose scheduler guarantees them can turn it off with
# PREPFUSE_CHECK_INDEX_VALUES=0. (The kernels never access memory out of bounds either way.)
CHECK_INDEX_VALUES = os.environ.get("PREPFUSE_CHECK_INDEX_VALUES", "1") != "0"


def can_read_index_values(t: torch.Tensor) -> bool:
    """Whether an op may read the values of index tensor ``t`` now."""
    return CHECK_INDEX_VALUES and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_slot_and_position_values(
    slot_mapping: torch.Tensor, num_blocks: int, block_size: int, positions: torch.Tensor, max_pos: int
) -> None:
    """Slots below ``num_blocks * block_size`` and positions in ``[0, max_pos)``.

    Reads the values, so does nothing when they cannot be read now
    (``can_read_index_values``). Negative slots are valid: they mean "skip this row".
    """
    if not can_read_index_values(slot_mapping):
        return
    n_slots = num_blocks * block_size
    if slot_mapping.numel() and int(slot_mapping.max()) >= n_slots:
        raise ValueError(
            f"slot_mapping: slot {int(slot_mapping.max())} is beyond the cache's {n_slots} slots "
            f"({num_blocks} blocks of {block_size})"
        )
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_pos:
            raise ValueError(f"positions: values must lie in [0, {max_pos}) (rows of cos_sin_cache), got [{lo}, {hi}]")
