"""Input checks shared by the ops' eager paths and fake impls.

Every failure is a ``ValueError`` whose message starts with the argument's name, so an
engine author reading a traceback knows which tensor to look at. Under fake tensors,
sizes may be symbolic: a check only fails when the sizes are *known* to disagree, and
it never adds a guard (that would specialise a dynamic ``T``).
"""

from __future__ import annotations

import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef
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


def check_index_tensor(name: str, t, device) -> None:
    """A 1-d int64 or int32 index tensor (slots, positions) on ``device``."""
    dtype = getattr(t, "dtype", None)
    if dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected dtype torch.int64 or torch.int32, "
                         f"got {dtype if dtype is not None else type(t).__name__}")
    check_tensor(name, t, dtype=dtype, ndim=1, device=device)


def check_slot_and_position_values(
    slot_mapping: torch.Tensor, num_blocks: int, block_size: int, positions: torch.Tensor | None, max_pos: int,
    *, wrap: bool = False,
) -> None:
    """Slots below ``num_blocks * block_size`` and each given to one token, positions in
    ``[0, max_pos)`` (None: rows by token, which the shape checks bound).

    Reads the values, so does nothing when they cannot be read now
    (``can_read_index_values``; what the ops do then: ``_indices``). Negative slots are
    valid, and may repeat: they mean "skip this row". With ``wrap`` (an op's
    ``wrap_indices``) a value counts from the end when negative, as PyTorch indexing does:
    slots and positions lie in ``[-n, n)``, and a slot several tokens name holds the last
    one's row, as eager index assignment leaves it.
    """
    if not can_read_index_values(slot_mapping):
        return
    n_slots = num_blocks * block_size
    if slot_mapping.numel() and int(slot_mapping.max()) >= n_slots:
        raise ValueError(
            f"slot_mapping: slot {int(slot_mapping.max())} is beyond the cache's {n_slots} slots "
            f"({num_blocks} blocks of {block_size})"
        )
    if wrap:
        if slot_mapping.numel() and int(slot_mapping.min()) < -n_slots:
            raise ValueError(f"slot_mapping: slot {int(slot_mapping.min())} counts from the end of a cache of "
                             f"only {n_slots} slots")
    else:
        check_distinct_slots(slot_mapping)
    if positions is not None and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        low = -max_pos if wrap else 0
        if lo < low or hi >= max_pos:
            raise ValueError(f"positions: values must lie in [{low}, {max_pos}) (rows of the cos/sin table), "
                             f"got [{lo}, {hi}]")


def check_distinct_slots(slot_mapping: torch.Tensor) -> None:
    """No slot (>= 0) given to two tokens: two writers of one slot would leave a row mixed
    from both (data bytes of one, scale bytes or v of the other)."""
    valid = slot_mapping[slot_mapping >= 0]
    if valid.numel() < 2:
        return
    ordered = torch.sort(valid).values
    repeated = ordered[1:] == ordered[:-1]
    if bool(repeated.any()):
        slot = int(ordered[1:][repeated][0])
        tokens = (slot_mapping == slot).nonzero().flatten()[:2].tolist()
        raise ValueError(
            f"slot_mapping: slot {slot} is given to tokens {tokens[0]} and {tokens[1]}; each token "
            f"written needs a slot of its own (a skipped token's slot is -1)"
        )


# --------------------------------------------------------------------------------------
# Aliasing: a written argument overlaps no other argument
# --------------------------------------------------------------------------------------
def check_written_apart(named: dict, written: list[str]) -> None:
    """Each written argument (``Tensor(a!)``) shares no byte with another argument and none
    of its own elements with each other (an expanded view); ValueError naming both.

    Precise for views of one buffer (``kv[:, 0]`` and ``kv[:, 1]`` of a FlashInfer cache
    interleave without overlapping and pass); runs in the eager paths and in the fake impl
    (fake tensors share a storage as real ones do), where sizes are concrete."""
    tensors = [(n, t) for n, t in named.items() if isinstance(t, torch.Tensor)]
    for name in written:
        a = named.get(name)
        if not isinstance(a, torch.Tensor) or a.numel() == 0 or _layout(a) is None:
            continue
        if _self_overlapping(a):
            raise ValueError(f"{name}: its elements overlap each other (an expanded or self-overlapping view, "
                             f"strides {tuple(a.stride())}), so two writes would land on one element")
        for other, b in tensors:
            if other == name or (other in written and written.index(other) < written.index(name)):
                continue
            if b.numel() and _layout(b) is not None and _overlap(a, b):
                raise ValueError(f"{name}: shares memory with {other}; an argument the op writes must not "
                                 f"overlap another argument (it would read what it wrote, or two writes collide)")


def _layout(t: torch.Tensor):
    """(byte offset, [(byte stride, size)] largest stride first, the element's bytes as the
    last dim) when every size and stride is a concrete int, else None (symbolic)."""
    sizes, strides, offset = t.shape, t.stride(), t.storage_offset()
    if not all(isinstance(v, int) for v in (*sizes, *strides, offset)):
        return None
    size = t.element_size()
    dims = sorted(((st * size, sz) for st, sz in zip(strides, sizes) if sz > 1), reverse=True)
    return offset * size, dims + [(1, size)]


def _span(dims) -> int:
    return sum(st * (sz - 1) for st, sz in dims)


def _self_overlapping(t: torch.Tensor) -> bool:
    """Two indices of ``t`` reach one byte: a zero stride, or a stride within the span of
    the smaller dims (blocks laid over each other)."""
    _, dims = _layout(t)
    return any(st == 0 or st <= _span(dims[i + 1:]) for i, (st, _) in enumerate(dims[:-1]))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte. Different storages or disjoint byte ranges do
    not; views with the same byte layout at different offsets (k and v halves of one
    buffer) overlap iff the offset difference is a reachable index difference; anything
    else whose ranges intersect is taken as overlapping."""
    if a.device != b.device or StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    (off_a, dims_a), (off_b, dims_b) = _layout(a), _layout(b)
    if off_a + _span(dims_a) < off_b or off_b + _span(dims_b) < off_a:
        return False
    if dims_a != dims_b or _self_overlapping(a):
        return True
    return _reachable(off_b - off_a, dims_a)


def _reachable(delta: int, dims) -> bool:
    """Whether ``delta = sum(i_k * stride_k)`` with ``|i_k| < size_k`` (nested dims, largest first)."""
    if not dims:
        return delta == 0
    (stride, size), rest = dims[0], dims[1:]
    span = _span(rest)
    low, high = -(-(delta - span) // stride), (delta + span) // stride
    return any(_reachable(delta - i * stride, rest)
               for i in range(max(low, -(size - 1)), min(high, size - 1) + 1))
