"""How every op's plain-PyTorch reference reads index values, the way the kernels do.

The index-value checks (``_checks.check_slot_and_position_values``) reject a position
outside the cos/sin table, a slot beyond the cache and a slot given to two tokens, before
anything is written. They read the values, so they are skipped while a CUDA graph is
captured and when an engine turns them off (``PREPFUSE_CHECK_INDEX_VALUES=0``). Then the
kernels still never read or write out of bounds, and the reference does what they do
instead of failing half-way (an IndexError after some rows were written) or wrapping a
position -1 to the table's last row:

- a position is clamped into ``[0, P)`` (with ``wrap_indices``, a negative one first
  counted from the table's end, and likewise a negative slot);
- a row whose slot is negative or not below the cache's slot count is skipped;
- a slot given to several tokens is written whole by the last of them (its data and
  scale bytes, its k and v): never a row mixed from two tokens. The kernels do the same
  (``_duplicate_slots``): the last writer up to ``SCAN_MAX`` inserted rows; beyond, each
  row is written under its slot's lock, so the row is one writer's whole row (on the GPU
  any one of them, under the CPU interpreter the last).
"""

from __future__ import annotations

import torch

__all__ = ["clamped_positions", "wrapped", "written_rows"]


def clamped_positions(positions: torch.Tensor, rows: int) -> torch.Tensor:
    """``positions`` clamped into ``[0, rows)``, as the kernels read them."""
    return positions.clamp(0, max(rows - 1, 0))


def wrapped(index: torch.Tensor, size: int) -> torch.Tensor:
    """``index`` (int64) with negative values counted from the end, as PyTorch indexing
    counts them (an op's ``wrap_indices``: a rewrite keeps the meaning of model code)."""
    index = index.long()
    return torch.where(index < 0, index + size, index)


def written_rows(slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The indices of the rows the op writes: slot in ``[0, n_slots)``, and no later row with
    the same slot. A host sync on CUDA (the oracle's way, not a capturable path)."""
    index = torch.arange(slots.numel(), device=slots.device)
    valid = (slots >= 0) & (slots < n_slots)
    slots, index = slots[valid], index[valid]
    if slots.numel() < 2:
        return index
    unique, inverse = torch.unique(slots, return_inverse=True)
    last = torch.full((unique.numel(),), -1, dtype=index.dtype, device=index.device)
    last.scatter_reduce_(0, inverse, index, reduce="amax")
    return index[last[inverse] == index]
