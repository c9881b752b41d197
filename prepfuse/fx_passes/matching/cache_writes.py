"""Paged byte-cache writes, read back to their layout: what every family's cache side shares.

A quantised cache (DeepSeek-V4's ``fp8_ds_mla``, the indexer's FP8 and MXFP4 caches) is a
2-d uint8 tensor ``[num_blocks, stride]``: a block holds ``block_size`` data rows, then
``block_size`` rows of scale bytes. Model code writes a token's data row and its scale row
with two ``index_put``s into views of the cache (or into its byte columns directly);
functionalization turns each into an ``index_put`` of a view scattered back into the root.

- ``byte_row_write`` reads one such ``index_put`` back to a ``ByteRowWrite`` (the cache before
  and after, the first column, row pitch and width, block size and slots);
- ``byte_row_writes`` does so for every uint8 ``index_put`` of a graph (or keeps the NoMatch);
- ``scale_partner`` finds the write of a data row's scale bytes: into the same cache, right
  before or after it, to the same slots, ``width`` bytes a row after the block's data rows;
- ``first_rows_of`` sees through the ``rows[:n]`` slice of data-parallel padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching import recognizers
from prepfuse.fx_passes.matching.recognizers import (
    NoMatch, aten, describe, expect, is_op, paged_slots, prims, put_rows, row_layout, same_size, scatter_back, shape,
    split_operands, val, view_chain,
)

__all__ = ["ByteRowWrite", "byte_row_write", "byte_row_writes", "scale_partner", "first_rows_of"]


@dataclass(frozen=True)
class ByteRowWrite:
    """``cache[:, first + i * pitch : .. + width]`` of block ``s // block_size``, row
    ``i = s % block_size``, written for every slot ``s`` of ``slots``."""

    put: torch.fx.Node  # the index_put
    root: torch.fx.Node  # the 2-d cache before the write
    new_root: torch.fx.Node  # the 2-d cache after it
    first: int  # first column of the block's rows
    pitch: int  # bytes between rows
    width: int  # bytes a row
    block_size: int
    slots: torch.fx.Node  # int64 [n]

    def follows(self, other: ByteRowWrite) -> bool:
        """This write goes into what ``other`` wrote, or ``other`` into what this one did."""
        return self.root is other.new_root or self.new_root is other.root


def byte_row_write(put) -> ByteRowWrite:
    """The layout one ``index_put`` of byte rows into a uint8 cache writes.

    Two spellings: ``cache[:, a:b].view(NB, bs, W)[s // bs, s % bs] = rows`` (an index_put
    into a view, scattered back), and ``cache[(s // bs)[:, None], a + (s % bs)[:, None] * W +
    arange(W)] = rows`` (an index_put into the 2-d cache itself).
    """
    view, indices = put.args[:2]
    values = put_rows(put)
    expect(not (put.args[3] if len(put.args) > 3 else put.kwargs.get("accumulate", False)), "write: accumulates")
    expect(len(indices) == 2 and all(isinstance(i, torch.fx.Node) for i in indices), "write: expected two index tensors")
    rows = tuple(shape(values))
    if len(rows) == 1 and all(shape(i)[:1] == (1,) for i in indices):
        # one row whose unit dimension the graph dropped altogether (a reshape chain
        # folded away, so put_rows has nothing to look through): it broadcasts the same
        rows = (1, *rows)
    expect(len(rows) == 2, "write: values are not rows")
    if len(shape(view)) == 2:  # indices select whole rows' bytes of the 2-d cache
        first, pitch, width, block_size, slots = _column_indices(indices, rows[1])
        expect(val(view).stride(1) == 1, f"write: the cache has strides {tuple(val(view).stride())}")
        root, new_root = view, put
    else:
        root, chain = view_chain(view)
        first, pitch, width = row_layout(view, root)
        block_size = shape(view)[1]
        slots = paged_slots(indices, block_size)
        new_root = scatter_back(put, chain)
    expect(rows[1] == width and same_size(rows[0], shape(slots)[0]), "write: values are not one row per slot")
    return ByteRowWrite(put, root, new_root, first, pitch, width, block_size, slots)


def _column_indices(indices, width: int) -> tuple[int, int, int, int, torch.fx.Node]:
    """(first column, row pitch, width, block size, slots) of the index pair
    ``[(s // bs)[:, None], first + (s % bs)[:, None] * pitch + arange(width)]``."""
    blk, cols = indices
    expect(_is_column(blk), f"write: block index {describe(blk)} is not (slot // block_size)[:, None]")
    expect(is_op(cols, aten.add.Tensor), f"write: columns {describe(cols)} are not row offset + arange")
    iota, offset = split_operands(cols, lambda n: is_op(n, prims.iota.default, aten.arange.default, aten.arange.start))
    expect(iota is not None and shape(iota) == (width,), "write: columns are not row offset + arange(row width)")
    if is_op(iota, prims.iota.default):
        expect((iota.kwargs.get("start", 0), iota.kwargs.get("step", 1)) == (0, 1), "write: iota does not count 0, 1, 2 ..")
    elif is_op(iota, aten.arange.start):
        expect(iota.args[0] == 0, "write: arange does not start at 0")
    first = 0.0
    if recognizers.add_scalar(offset) is not None:
        offset, first = recognizers.add_scalar(offset)
    expect(is_op(offset, aten.mul.Tensor), f"write: {describe(offset)} is not row * pitch")
    row, pitch = split_operands(offset, _is_column)
    expect(row is not None and isinstance(pitch, int), f"write: {describe(offset)} is not (slot % block_size)[:, None] * pitch")
    remainder = row.args[0]
    expect(is_op(remainder, aten.remainder.Scalar, aten.remainder.Tensor) and isinstance(remainder.args[1], int),
           f"write: row {describe(remainder)} is not slot % block_size")
    block_size = remainder.args[1]
    expect(first == int(first), f"write: first column {first} is not an integer")
    return int(first), pitch, width, block_size, paged_slots([blk.args[0], remainder], block_size)


def _is_column(node) -> bool:
    """``x[:, None]`` of a 1-d ``x``."""
    return is_op(node, aten.unsqueeze.default) and len(shape(node)) == 2 and node.args[1] in (1, -1)


def byte_row_writes(graph: torch.fx.Graph) -> dict[torch.fx.Node, ByteRowWrite | NoMatch]:
    """Every ``index_put`` into a uint8 tensor, with its ``ByteRowWrite`` or its NoMatch."""
    writes = {}
    for node in graph.nodes:
        if is_op(node, aten.index_put.default) and val(node.args[0]).dtype == torch.uint8:
            try:
                writes[node] = byte_row_write(node)
            except NoMatch as err:
                writes[node] = err
    return writes


def scale_partner(data: ByteRowWrite, writes, width: int) -> tuple[ByteRowWrite, torch.fx.Node, torch.fx.Node]:
    """(the scale write, the cache before both writes, after both) for ``data``: the one
    write of ``width``-byte scale rows into the same cache right before or after it, to the
    same slots (another layer's write into the same cache may sit next to it too), laid out
    after the block's data rows. Raises NoMatch saying what is missing or different."""
    found = [w for w in writes if isinstance(w, ByteRowWrite) and w.put is not data.put and w.follows(data)
             and w.slots is data.slots and w.width == width]
    expect(len(found) == 1, f"write: {len(found)} writes of {width} scale bytes of the same slots next to it, expected one")
    scales = found[0]
    data_bytes = data.block_size * data.pitch
    expect((scales.first, scales.pitch, scales.block_size) == (data_bytes, width, data.block_size),
           f"write: scale rows of {scales.width} bytes {scales.pitch} apart from column {scales.first}, "
           f"expected {width}, {width}, {data_bytes}")
    if scales.root is data.new_root:
        return scales, data.root, scales.new_root
    return scales, scales.root, data.new_root


def first_rows_of(node, rows):
    """``x`` if ``node`` is ``x[:rows]`` (a leading slice), else ``node``."""
    if is_op(node, aten.slice.Tensor) and node.args[1] == 0 and (node.args[2] if len(node.args) > 2 else 0) == 0:
        if (node.args[4] if len(node.args) > 4 else 1) == 1 and same_size(shape(node)[0], rows):
            return node.args[0]
    return node
