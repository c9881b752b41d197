"""Rows written at indices: every cache write of a post-grad graph, in one form.

Model code writes a cache by index assignment (``cache[s // bs, s % bs] = k``,
``pool[loc] = k``, ``cache[:, :, pos] = k``), ``index_copy_``, ``scatter_``, or slice
assignment (``cache[:, :, a:b] = k``), into the cache or into a view of it; after
canonicalization (``canonical.py``) these reach the graph as an ``index_put`` or a
``slice_scatter`` of a view of a graph input, scattered back into it. ``rows_write`` reads
any of them into a ``RowsWrite``: which buffer, which of its dims each row addresses and
by what (an int tensor per dim, or a slice's positions), the values, and how the values'
dims line up with the written dims. What the written values *are* (rotated heads,
quantised bytes) is no business of this module: a family decides that on probes.

Only writes into graph inputs count (a cache is the caller's buffer); a write into a
buffer the graph made (a local scratch) is no cache write.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import (
    RESHAPES, VIEW_OPS, WRITE_VIEWS, NoMatch, aten, expect, is_op, same_size, scatter_back, shape, slice_params, val,
    view_chain, where,
)

__all__ = ["Index", "RowsWrite", "rows_write", "rows_writes", "put_rows", "first_rows", "byte_rows", "ByteRows", "scale_partner",
           "slot_of", "before_cast"]


@dataclass(frozen=True)
class Index:
    """How one written dim is addressed: per row by an int tensor (``node``), or by the
    positions ``start, start + step, ..`` below ``stop`` of a slice (``node`` None)."""

    node: torch.fx.Node | None
    start: object = 0
    stop: object = None
    step: int = 1


@dataclass(frozen=True)
class RowsWrite:
    """``target[indices...] = values``, ``target`` the graph input ``root`` or a view of it."""

    write: torch.fx.Node  # the index_put / slice_scatter
    after: torch.fx.Node  # the root's new value: what later readers of the cache read
    root: torch.fx.Node  # the buffer before the write
    target: torch.fx.Node  # the tensor the write writes into: root, or a view of it
    dims: tuple[int, ...]  # the target dims addressed per row
    indices: tuple[Index, ...]  # one per addressed dim
    values: torch.fx.Node  # the values (a single index's rows seen through torch's reshape)
    # for each values dim: ("index", k), the k-th dim of the indices' broadcast shape; or
    # ("dim", d), target dim d taken whole; or ("broadcast", d) where values repeat along it
    value_dims: tuple[tuple[str, int], ...]

    def row_dims(self) -> tuple[int, ...]:
        """The target dims every row fills whole."""
        return tuple(d for kind, d in self.value_dims if kind == "dim")


def put_rows(put: torch.fx.Node) -> torch.fx.Node:
    """The values an ``index_put`` writes, one row per index: with a single index (one token)
    torch's decomposition reshapes the ``[1, ...]`` rows to ``[...]``, which broadcast over
    the index; look through that reshape where the values lack the index's dim."""
    values = put.args[2]
    indices = [i for i in put.args[1] if isinstance(i, torch.fx.Node)]
    count = shape(indices[0])[0] if indices and shape(indices[0]) else 1
    row_dims = max((len(shape(i)) for i in indices), default=0) + len(shape(put.args[0])) - len(indices)
    if same_size(count, 1) and len(shape(values)) == row_dims - 1 and is_op(
            values, *RESHAPES, aten.squeeze.dim, aten.squeeze.default):
        rows = values.args[0]
        if tuple(shape(rows)) == (1, *shape(values)):
            return rows
    return values


_WRITES_BACK = (aten.slice_scatter.default, aten.select_scatter.default, aten.as_strided_scatter.default,
                aten.index_put.default, *RESHAPES, aten.view.dtype, aten.squeeze.dim)


def _is_graph_buffer(root) -> bool:
    """``root`` is a graph input, or what earlier writes made of one (a second write into a
    buffer reads the first one's result: k and v caches of one ``[NB, 2, ..]`` buffer)."""
    while is_op(root, *_WRITES_BACK):
        root = root.args[0]
    return isinstance(root, torch.fx.Node) and root.op == "placeholder"


def rows_write(node: torch.fx.Node) -> RowsWrite:
    """The ``RowsWrite`` of one ``index_put`` or ``slice_scatter`` into a graph input, or NoMatch."""
    if is_op(node, aten.slice_scatter.default):
        return _slice_write(node)
    expect(is_op(node, aten.index_put.default), "write: not an index_put")
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    expect(not accumulate, f"write: {where(node)} adds its rows (index_put with accumulate=True), not stores them")
    target, indices = node.args[:2]
    root, chain = view_chain(target)
    expect(_is_graph_buffer(root), "write: into a buffer the compiled code made, not a cache")
    after = scatter_back(node, chain)
    values = put_rows(node)
    advanced = [d for d, ix in enumerate(indices) if ix is not None]
    expect(all(isinstance(indices[d], torch.fx.Node) for d in advanced), "write: an index is not a tensor")
    ndim = len(shape(target))
    rest = [d for d in range(ndim) if d not in advanced]
    n_index = max(len(shape(indices[d])) for d in advanced)
    adjacent = advanced == list(range(advanced[0], advanced[-1] + 1))
    if adjacent:  # the broadcast index dims stand where the indexed dims were
        layout = [("dim", d) for d in rest if d < advanced[0]] + [("index", k) for k in range(n_index)] + \
                 [("dim", d) for d in rest if d > advanced[-1]]
    else:  # split by a slice: torch puts them first
        layout = [("index", k) for k in range(n_index)] + [("dim", d) for d in rest]
    return RowsWrite(node, after, root, target, tuple(advanced), tuple(Index(indices[d]) for d in advanced), values,
                     _align(values, layout, target))


def _align(values: torch.fx.Node, layout: list, target: torch.fx.Node) -> tuple:
    """``layout`` for the values as given: broadcast from the right, a missing or size-1
    dim of a target dim the values repeat along marked ``("broadcast", d)``."""
    vs = shape(values)
    expect(len(vs) <= len(layout), f"write: the values of {where(values)} have more dims than the rows they fill")
    ts = shape(target)
    aligned = []
    for (kind, d), size in zip(layout[len(layout) - len(vs):], vs):
        if kind == "dim" and isinstance(size, int) and size == 1 and not same_size(ts[d], 1):
            kind = "broadcast"
        aligned.append((kind, d))
    return tuple(aligned)


def _slice_write(node: torch.fx.Node) -> RowsWrite:
    """``cache[.., a:b] = rows``: functionalized as ``slice_scatter(cache, copy(slice(cache), rows))``."""
    base, src = node.args[:2]
    dim, start, end, step = slice_params(node.args[2:], node.kwargs)
    root, chain = view_chain(base)
    expect(_is_graph_buffer(root), "write: into a buffer the compiled code made, not a cache")
    after = scatter_back(node, chain)
    values = src
    if is_op(src, aten.copy.default):  # x[..] = rows: the rows copied into the slice, then scattered back
        values = src.args[1]
    size = shape(base)[dim]
    dim = dim % len(shape(base))
    start = 0 if start is None else start
    expect(not (isinstance(start, int) and start < 0), f"write: the slice of {where(node)} counts from the end")
    if end is None or (isinstance(end, int) and isinstance(size, int) and end > size):
        end = size
    layout = [("index", 0) if d == dim else ("dim", d) for d in range(len(shape(base)))]
    return RowsWrite(node, after, root, base, (dim,), (Index(None, start, end, step),), values,
                     _align(values, layout, base))


def rows_writes(graph: torch.fx.Graph) -> dict[torch.fx.Node, RowsWrite | NoMatch]:
    """Every write into a graph input, with its ``RowsWrite`` or why it is none."""
    found = {}
    for node in graph.nodes:
        if is_op(node, aten.index_put.default, aten.slice_scatter.default):
            root = view_chain(node.args[0])[0]
            if not _is_graph_buffer(root):
                unfollowed = _unfollowed_view(root)
                if unfollowed is not None:  # said, so that such code never declines in silence
                    found[node] = NoMatch(f"write: {where(node)} writes into a view of the graph input "
                                          f"{unfollowed[0].name} taken by {unfollowed[1]}, which the cache-write "
                                          "reader does not follow")
                continue
            src = node.args[1]
            if is_op(node, aten.slice_scatter.default) and is_op(src, *_WRITES_BACK) \
                    and _is_graph_buffer(view_chain(src.args[0])[0]):
                continue  # the scatter back of a write into a slice of the buffer, read with that write
            try:
                found[node] = rows_write(node)
            except NoMatch as err:
                found[node] = err
        elif is_op(node, aten.select_scatter.default, aten.as_strided_scatter.default) \
                and _is_graph_buffer(view_chain(node.args[0])[0]) and not is_op(node.args[1], *_WRITES_BACK,
                                                                               aten.index_put.default):
            # values written straight into one index (or a strided window) of a buffer: no
            # rows at indices, but said, so that such code never declines in silence
            found[node] = NoMatch(f"write: {where(node)} writes its values into one "
                                  f"{'index' if is_op(node, aten.select_scatter.default) else 'strided window'} "
                                  f"of {view_chain(node.args[0])[0].name}, not rows at token indices")
    return found


def _unfollowed_view(node) -> tuple[torch.fx.Node, str] | None:
    """(the graph input, the first view op on the way) where ``node`` is a view of a graph
    input through views other than those ``view_chain`` follows (a permute, a transpose ...);
    None for anything else (a buffer the code made, a copy)."""
    first = None
    while is_op(node, *VIEW_OPS, *WRITE_VIEWS, aten.expand.default, aten.diagonal.default) or (
            isinstance(node, torch.fx.Node) and node.target is operator.getitem
            and is_op(node.args[0], aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default)):
        if node.target is operator.getitem:
            node = node.args[0]
        first = node
        node = node.args[0]
    if first is None or not _is_graph_buffer(node):
        return None
    return node, str(first.target).replace("aten.", "")


# --------------------------------------------------------------------------------------
# Byte caches: rows of bytes in the blocks of a 2-d uint8 buffer
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ByteRows:
    """A write of ``width``-byte rows into a 2-d uint8 cache ``[NB, stride]``: the row of slot
    ``s`` at column ``first + (s % block_size) * pitch`` of block ``s // block_size``."""

    write: RowsWrite
    first: int
    pitch: int
    width: int
    block_size: int
    block: torch.fx.Node  # the block index per row
    row: torch.fx.Node  # the row-in-block index per row
    rows: torch.fx.Node  # the values [n, width]


def byte_rows(write: RowsWrite) -> ByteRows:
    """A write's byte-row geometry, for either spelling: ``cache[:, a:b].view(NB, bs, W)[blk,
    row] = rows`` (read off the view's strides), or ``cache[blk[:, None], a + row[:, None] * W
    + arange(W)] = rows`` (read off the column index)."""
    root, target = write.root, write.target
    rv, tv = val(root), val(target)
    expect(rv.dtype == torch.uint8 and rv.dim() == 2 and rv.stride(1) == 1, "write: not a 2-d byte cache")
    expect(len(write.indices) == 2 and all(i.node is not None for i in write.indices),
           "write: a byte cache written by other than (block, row) indices")
    block, second = (i.node for i in write.indices)
    if tv.dim() == 3:  # a [NB, rows, width] view of the block rows
        expect(tv.stride(2) == 1 and tv.stride(0) == rv.stride(0) and write.dims == (0, 1),
               f"write: the view written has strides {tuple(tv.stride())}, not [blocks, rows, bytes] of a block row")
        first, pitch, width = tv.storage_offset() - rv.storage_offset(), tv.stride(1), tv.shape[2]
        rows = write.values
        if len(shape(rows)) == 1 and all(same_size(s, 1) for i in (block, second) for s in shape(i)):
            rows_shape = (1, *shape(rows))  # one row whose unit dim the graph dropped: it broadcasts the same
        else:
            rows_shape = shape(rows)
        expect(len(rows_shape) == 2 and rows_shape[1] == width, "write: the values are not one row per slot")
        return ByteRows(write, first, pitch, width, tv.shape[1], block, second, rows)
    expect(target is root and len(shape(block)) == 2 and len(shape(second)) == 2,
           "write: the byte columns are not (block[:, None], columns)")
    first, pitch, row, width = _column_index(second)
    rows = write.values
    expect(len(shape(rows)) == 2 and shape(rows)[1] == width, "write: the values are not one row per slot")
    expect(is_op(block, aten.unsqueeze.default), "write: the block index is not a column block[:, None]")
    block_size = row.args[1] if is_op(row, aten.remainder.Scalar, aten.remainder.Tensor) else None
    expect(isinstance(block_size, int), "write: the row of the byte columns is not slot % block_size")
    return ByteRows(write, first, pitch, width, block_size, block.args[0], row, rows)


def _column_index(cols: torch.fx.Node) -> tuple[int, int, torch.fx.Node, int]:
    """(first, pitch, row, width) of ``first + row[:, None] * pitch + arange(width)``."""
    expect(is_op(cols, aten.add.Tensor), "write: the byte columns are not row offset + arange")
    a, b = cols.args[:2]
    iota, offset = (a, b) if _is_iota(a) else (b, a)
    expect(_is_iota(iota), "write: the byte columns are not row offset + arange(width)")
    width = shape(iota)[0]
    first = 0
    if is_op(offset, aten.add.Tensor) and isinstance(offset.args[1], int):
        offset, first = offset.args[0], offset.args[1]
    expect(is_op(offset, aten.mul.Tensor) and isinstance(offset.args[1], int), "write: a row offset is not row * pitch")
    column, pitch = offset.args[:2]
    expect(is_op(column, aten.unsqueeze.default), "write: a row offset is not row[:, None] * pitch")
    return first, pitch, column.args[0], width


def _is_iota(node) -> bool:
    if is_op(node, torch.ops.prims.iota.default):
        return node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1 and len(shape(node)) == 1
    return is_op(node, aten.arange.default) or (is_op(node, aten.arange.start) and node.args[0] == 0)



def first_rows(write: RowsWrite) -> torch.fx.Node:
    """``x`` where the values written are ``x[:n]`` along a leading index dim (data-parallel
    padding: T tokens, T' <= T slots; a fused op inserts the first ``len(slot_mapping)``
    rows itself), else the values."""
    values = write.values
    if is_op(values, aten.slice.Tensor) and write.value_dims[:1] == (("index", 0),):
        dim, start, _, step = slice_params(values.args[1:], values.kwargs)
        if dim == 0 and start in (0, None) and step == 1:
            return values.args[0]
    return values


def scale_partner(data: ByteRows, writes, width: int, *, interleaved: bool = False
                  ) -> tuple[ByteRows, torch.fx.Node, torch.fx.Node]:
    """(the scale write, the cache before both writes, after both) for ``data``: the one
    write of ``width``-byte rows at the same (block, row) indices right before or after it
    in the same cache, laid out after the block's data rows (``block_size * pitch`` on,
    ``width`` apart: fp8_ds_mla and the indexer's caches keep their scale bytes so), or
    (``interleaved``) right after each data row, at its pitch (DeepSeek-V4.1's MXFP8 records)."""
    found = [w for w in writes if w.width == width and w.block is data.block and w.row is data.row
             and (w.write.root is data.write.after or data.write.root is w.write.after)]
    expect(len(found) == 1, f"write: {len(found)} writes of {width} scale bytes at the same slots go with the "
                            f"{data.width}-byte rows written at {where(data.write.write)}, expected one")
    scales = found[0]
    bs = data.block_size
    first, pitch = (data.first + data.width, data.pitch) if interleaved else (bs * data.pitch, width)
    expect((scales.first, scales.pitch, scales.block_size) == (first, pitch, bs),
           f"write: scale rows of {scales.width} bytes {scales.pitch} apart from byte {scales.first}, expected "
           f"{pitch} apart from byte {first}")
    if scales.write.root is data.write.after:
        return scales, data.write.root, scales.write.after
    return scales, scales.write.root, data.write.after


def slot_of(rows: ByteRows) -> torch.fx.Node | None:
    """``s`` where the rows are written at ``(s // bs, s % bs)``, else None."""
    blk, row = rows.block, rows.row
    if is_op(blk, aten.div.Tensor_mode) and blk.kwargs.get("rounding_mode") == "floor" and \
            is_op(row, aten.remainder.Scalar, aten.remainder.Tensor) and blk.args[0] is row.args[0] \
            and blk.args[1] == row.args[1] == rows.block_size:
        return blk.args[0]
    return None


def slot_roles(rows: ByteRows) -> dict[torch.fx.Node, str]:
    """The probes' roles of what addresses the rows: the slots (``slot_of``), else the block
    and the row in it, drawn together (``probes``: distinct pairs)."""
    slot = slot_of(rows)
    return {slot: "slots"} if slot is not None else {rows.block: "slot_block", rows.row: "slot_row"}


def before_cast(values: torch.fx.Node) -> torch.fx.Node | None:
    """The values an fp8 write held before their cast (and clamp), through views and
    bitcasts: what bounds a row the cast saturated (``compare.Checked.before_cast``)."""
    node = values
    while is_op(node, *RESHAPES, aten.view.dtype, aten.permute.default, aten.transpose.int,
                aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor):
        node = node.args[0]
    if not (is_op(node, torch.ops.prims.convert_element_type.default, aten._to_copy.default)
            and val(node).dtype == torch.float8_e4m3fn):
        return None
    node = node.args[0]
    while is_op(node, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        node = node.args[0]
    return node
