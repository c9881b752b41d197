"""One write per piece (``canonical.py``'s rule): a cache write whose values are pieces along
a dim between the tokens and a row's values is one write per piece into the matching part of
the buffer, so that each reads as an ordinary cache write (``writes.rows_write``).

The writes split are an ``index_put(dst, [i0, .., in-1], values)`` with ``n`` 1-d indices of
the leading dims (``pool[slots] = rows``), and a slice write ``slice_scatter(dst, values, s,
a, b)`` into a graph input's buffer (``cache[b0:b1, s0:s1, ...] = rows``); the values are
made of pieces along their dim ``d`` by a ``cat`` (lightllm's ``cat((k, v), 1)``), a ``stack``,
a ``slice_scatter`` (heads overwritten in place, ``kv[:, :Hk] = k``) or a ``select_scatter``
(one index of a stacked dim overwritten, flash-attention's ``kv[:, :, 0] = rope(kv[:, :, 0])``).
Each piece goes into the ``slice`` (or, for a piece lacking the dim, the ``select``) of ``dst``
along the matching dim, written as functionalization writes into a view: the view chain
taken again from the buffer's latest value, the part, the write, each view scattered back
(``nodes.scatter_back`` reads the same form). The same bytes land where they did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import (
    WRITE_VIEWS, NoMatch, aten, call_node, is_op, remove_dead, scatter_back, shape, slice_params, view_chain,
)

__all__ = ["one_write_per_piece"]

_SCATTER_OF = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default,
               aten.as_strided.default: aten.as_strided_scatter.default}
_WRITES = (aten.slice_scatter.default, aten.select_scatter.default, aten.as_strided_scatter.default,
           aten.index_put.default)


@dataclass(frozen=True)
class Piece:
    """Values written into one part of the destination along the split dim: ``at`` an index
    (values lacking the dim, written into a ``select``) or a ``(start, end)`` range (a
    ``slice``); ``of_base``: ``values`` is a scatter's base, whose same part is written."""

    values: torch.fx.Node
    at: int | tuple[int, int]
    of_base: bool = False


@dataclass(frozen=True)
class _Split:
    """A write the rule splits: its buffer's view chain, the root's value after it, the dim of
    ``dst`` the pieces lie along, and the pieces (their dim ``dim`` of the values)."""

    root: torch.fx.Node
    chain: list
    after: torch.fx.Node
    target_dim: int
    dim: int
    pieces: list[Piece]


def one_write_per_piece(graph: torch.fx.Graph) -> int:
    """Rewrite every write of pieces into one write per piece (the module's rule); returns how many."""
    done = 0
    for node in list(graph.nodes):
        if node._erased:  # a scatter back of a write already split
            continue
        split = _split_of(node)
        if split is not None:
            _write_pieces(graph, node, split)
            done += 1
    return done


def _split_of(node: torch.fx.Node) -> _Split | None:
    """The ``_Split`` of ``node`` where it is a write the rule splits, else None."""
    token_dim = _token_dim(node)
    if token_dim is None:
        return None
    dst, values = node.args[0], node.args[1] if is_op(node, aten.slice_scatter.default) else node.args[2]
    found = _pieces(values)
    if found is None:
        return None
    dim, pieces = found
    target_dim = dim + len(shape(dst)) - len(shape(values))
    if not token_dim < dim < len(shape(values)) - 1 or shape(values)[dim] != shape(dst)[target_dim]:
        return None  # the tokens, or the values of a row (RoPE's halves): one write, as the code has it
    root, chain = view_chain(dst)
    if any(step.target not in _SCATTER_OF for step in chain):
        return None
    try:
        after = scatter_back(node, chain)
    except NoMatch:
        return None
    return _Split(root, chain, after, target_dim, dim, pieces)


def _token_dim(node: torch.fx.Node) -> int | None:
    """The last dim of a write's values that addresses rows: 0 for an ``index_put`` of rows
    at 1-d indices of the leading dims, the slice's dim for a slice write into a graph
    input's buffer; None for any other node."""
    if is_op(node, aten.index_put.default):
        dst, indices, values = node.args[:3]
        if (len(node.args) > 3 and node.args[3]) or node.kwargs.get("accumulate"):
            return None
        if not all(isinstance(i, torch.fx.Node) and len(shape(i)) == 1 for i in indices):
            return None
        return 0 if len(shape(values)) == 1 + len(shape(dst)) - len(indices) else None
    if not is_op(node, aten.slice_scatter.default):
        return None
    dst, values = node.args[:2]
    if not isinstance(values, torch.fx.Node) or not _into_input(dst) or len(shape(values)) != len(shape(dst)):
        return None
    if is_op(values, *_WRITES) and _into_input(values.args[0]):
        return None  # the scatter back of a write into a part of the buffer: that write is the one
    return slice_params(node.args[2:], node.kwargs)[0] % len(shape(dst))


def _into_input(node) -> bool:
    """``node`` is a graph input, or a view of or a write into one (through views and writes)."""
    while is_op(node, *WRITE_VIEWS, *_WRITES):
        node = node.args[0]
    return isinstance(node, torch.fx.Node) and node.op == "placeholder"


def _write_pieces(graph: torch.fx.Graph, node: torch.fx.Node, split: _Split) -> None:
    """Each piece written into its part of the buffer, one after another, in place of ``node``."""
    root, td = split.root, split.target_dim
    with graph.inserting_before(split.after.next):
        for piece in split.pieces:
            views = [root]
            for step in split.chain:  # the view, taken from the buffer's latest value
                views.append(call_node(graph, step.target, (views[-1], *step.args[1:]), step.kwargs, node.meta))
            part = _part(graph, views[-1], td, piece.at, node.meta)
            values = _part(graph, piece.values, split.dim, piece.at, node.meta) if piece.of_base else piece.values
            new = _write(graph, node, part, values)
            new = _scatter(graph, views[-1], new, td, piece.at, node.meta)
            for step, base in zip(reversed(split.chain), reversed(views[:-1])):  # scattered back, view by view
                new = call_node(graph, _SCATTER_OF[step.target], (base, new, *step.args[1:]), step.kwargs, node.meta)
            root = new
    split.after.replace_all_uses_with(root)
    remove_dead([split.after])


def _write(graph, node: torch.fx.Node, part: torch.fx.Node, values: torch.fx.Node) -> torch.fx.Node:
    """``node``'s write (same indices, or same slice) of ``values`` into ``part``: the pieces'
    dim lies after the dims it addresses, so they keep their numbers."""
    if is_op(node, aten.index_put.default):
        return call_node(graph, aten.index_put.default, (part, list(node.args[1]), values), meta=node.meta)
    return call_node(graph, aten.slice_scatter.default, (part, values, *node.args[2:]), node.kwargs, node.meta)


def _part(graph, node: torch.fx.Node, dim: int, at, meta) -> torch.fx.Node:
    if isinstance(at, int):
        return call_node(graph, aten.select.int, (node, dim, at), meta=meta)
    return call_node(graph, aten.slice.Tensor, (node, dim, *at), meta=meta)


def _scatter(graph, base: torch.fx.Node, new: torch.fx.Node, dim: int, at, meta) -> torch.fx.Node:
    if isinstance(at, int):
        return call_node(graph, aten.select_scatter.default, (base, new, dim, at), meta=meta)
    return call_node(graph, aten.slice_scatter.default, (base, new, dim, *at), meta=meta)


def _pieces(values) -> tuple[int, list[Piece]] | None:
    """(dim, the pieces ``values`` is made of along it, in order) for a ``cat``, ``stack``,
    ``slice_scatter`` or ``select_scatter`` of sizes known as numbers; None for anything else."""
    if is_op(values, aten.cat.default, aten.stack.default):
        dim = values.args[1] if len(values.args) > 1 else values.kwargs.get("dim", 0)
        dim %= len(shape(values))
        if is_op(values, aten.stack.default):
            return dim, [Piece(x, i) for i, x in enumerate(values.args[0])]
        return _cat_pieces(values.args[0], dim)
    if not is_op(values, aten.slice_scatter.default, aten.select_scatter.default):
        return None
    base, src = values.args[:2]
    if is_op(values, aten.select_scatter.default):
        dim, index = values.args[2:4]
        size = shape(base)[dim]
        if not (isinstance(index, int) and isinstance(size, int)) or not -size <= index < size:
            return None
        start = at = index % size
        end = start + 1
    else:
        dim, start, end, step = slice_params(values.args[2:], values.kwargs)
        size = shape(base)[dim]
        start, end = 0 if start is None else start, size if end is None else end
        if step != 1 or not all(isinstance(x, int) and x >= 0 for x in (start, end, size)) or end > size:
            return None
        at = (start, end)
    dim %= len(shape(base))
    return dim, _base_part(base, 0, start) + [Piece(src, at)] + _base_part(base, end, size)


def _cat_pieces(xs, dim: int) -> tuple[int, list[Piece]] | None:
    """A ``cat``'s inputs as pieces: a piece of size 1 made by ``unsqueeze`` along ``dim`` (a
    stack spelled as a cat) is its input written into a ``select``."""
    pieces, start = [], 0
    for x in xs:
        size = shape(x)[dim] if len(shape(x)) > dim else None
        if not isinstance(size, int):
            return None
        if is_op(x, aten.unsqueeze.default) and x.args[1] % len(shape(x)) == dim:
            pieces.append(Piece(x.args[0], start))
        elif size:
            pieces.append(Piece(x, (start, start + size)))
        start += size
    return dim, pieces


def _base_part(base: torch.fx.Node, start: int, end: int) -> list[Piece]:
    """What a scatter left of ``base`` in ``[start, end)``: nothing, one index, or a range."""
    if end <= start:
        return []
    return [Piece(base, start if end == start + 1 else (start, end), of_base=True)]
