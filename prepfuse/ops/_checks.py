"""Input checks shared by the ops' eager paths and fake impls.

Every failure is a ``ValueError`` whose message starts with the argument's name, so an
engine author reading a traceback knows which tensor to look at. Under fake tensors,
sizes may be symbolic: a check only fails when the sizes are *known* to disagree, and
it never adds a guard (that would specialise a dynamic ``T``).
"""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake
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
    dtype: torch.dtype | tuple[torch.dtype, ...],
    ndim: int,
    device: torch.device,
) -> None:
    """A tensor of ``dtype`` (or one of several), ``ndim`` dimensions, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
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


_FP32_MAX = torch.finfo(torch.float32).max


def check_flag(name: str, value) -> None:
    """A schema ``bool``: True or False, nothing that merely converts to one."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")


def check_fp32_scalar(name: str, value, *, at_least: float | None = None) -> None:
    """A finite float the kernels can hold in fp32 (the schema's ``float`` is a double:
    1e300 would reach the kernel as inf), and ``>= at_least`` where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= _FP32_MAX:
        raise ValueError(f"{name}: must be a finite float within float32's range, got {value!r}")
    if at_least is not None and not value >= at_least:
        raise ValueError(f"{name}: must be >= {at_least}, got {value!r}")


def check_scale_tensor(name: str, scale, device, *, needed: bool, scaled: str) -> None:
    """A per-tensor scale: an fp32 tensor of shape [1] or [] on ``device`` where ``needed``
    (``scaled``, the output it scales, holds fp8 codes), else None. A device tensor, not a
    float, so that a graph captured once serves every scale an engine calibrates later."""
    if not needed:
        if scale is not None:
            raise ValueError(f"{name}: must be None, {scaled} holds no fp8 codes for it to scale")
        return
    if scale is None:
        raise ValueError(f"{name}: {scaled} holds fp8 codes, so it needs an fp32 scale tensor of shape [1] or [], "
                         "got None")
    check_tensor(name, scale, dtype=torch.float32, ndim=scale.dim() if isinstance(scale, torch.Tensor) else 0,
                 device=device)
    require((scale.dim() <= 1) & (scale.numel() == 1), f"{name}: must have shape [1] or [], got {tuple(scale.shape)}")


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
    (fake tensors share a storage as real ones do), where sizes are concrete. Where tensors
    have memory, bytes are device addresses: two storages may map the same bytes (a DLPack
    round trip, ``torch.from_numpy`` of one array twice), so storage identity decides only
    between fake tensors."""
    placed = {n: _placed(t) for n, t in named.items() if isinstance(t, torch.Tensor) and t.numel()}
    placed = {n: p for n, p in placed.items() if p is not None}  # symbolic sizes: not checked
    for name in written:
        if name not in placed:
            continue
        memory, start, dims = placed[name]
        if _self_overlapping(dims):
            raise ValueError(f"{name}: its elements overlap each other (an expanded or self-overlapping view, "
                             f"strides {tuple(named[name].stride())}), so two writes would land on one element")
        for other, (other_memory, other_start, other_dims) in placed.items():
            if other == name or (other in written and written.index(other) < written.index(name)):
                continue
            if other_memory == memory and _overlap(start, dims, other_start, other_dims):
                raise ValueError(f"{name}: shares memory with {other}; an argument the op writes must not "
                                 f"overlap another argument (it would read what it wrote, or two writes collide)")


def _placed(t: torch.Tensor):
    """(its memory, first byte, [(byte stride, size)] largest stride first with the element's
    bytes as the last dim), or None where a size or stride is symbolic. The memory is the
    device where ``t`` has an address (the first byte is then one), else its storage object."""
    sizes, strides, offset = t.shape, t.stride(), t.storage_offset()
    if not all(isinstance(v, int) for v in (*sizes, *strides, offset)):
        return None
    size = t.element_size()
    dims = sorted(((st * size, sz) for st, sz in zip(strides, sizes) if sz > 1), reverse=True) + [(1, size)]
    address = _address(t)
    if address is None:  # fake or meta: views of one buffer share its storage object
        return (t.device, StorageWeakRef(t.untyped_storage())), offset * size, dims
    return t.device, address + offset * size, dims


def _span(dims) -> int:
    return sum(st * (sz - 1) for st, sz in dims)


def _self_overlapping(dims) -> bool:
    """Two indices reach one byte: a zero stride, or a stride within the span of the
    smaller dims (blocks laid over each other)."""
    return any(st == 0 or st <= _span(dims[i + 1:]) for i, (st, _) in enumerate(dims[:-1]))


def _overlap(start_a: int, dims_a, start_b: int, dims_b) -> bool:
    """Whether two placements in one memory share a byte. Disjoint byte ranges do not;
    views with the same byte layout at different offsets (k and v halves of one buffer)
    overlap iff the offset difference is a reachable index difference; anything else whose
    ranges intersect is taken as overlapping."""
    if start_a + _span(dims_a) < start_b or start_b + _span(dims_b) < start_a:
        return False
    if dims_a != dims_b or _self_overlapping(dims_a):
        return True
    return _reachable(start_b - start_a, dims_a)


def _address(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, or None where it has no memory (fake, meta)."""
    if t.device.type == "meta" or (type(t) is not torch.Tensor and is_fake(t)):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without real storage
        return None


def _reachable(delta: int, dims) -> bool:
    """Whether ``delta = sum(i_k * stride_k)`` with ``|i_k| < size_k`` (nested dims, largest first)."""
    if not dims:
        return delta == 0
    (stride, size), rest = dims[0], dims[1:]
    span = _span(rest)
    low, high = -(-(delta - span) // stride), (delta + span) // stride
    return any(_reachable(delta - i * stride, rest)
               for i in range(max(low, -(size - 1)), min(high, size - 1) + 1))
