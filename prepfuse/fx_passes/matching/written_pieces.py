"""One write per piece (``canonical.py``'s rule): a write whose values are pieces along a
dim between the tokens and a row's values is one write per piece into the matching part of
the buffer, so that each reads as an ordinary cache write (``writes.rows_write``)."""

from __future__ import annotations

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import (
    NoMatch, aten, call_node, is_op, remove_dead, scatter_back, shape, slice_params, view_chain,
)

__all__ = ["one_write_per_piece"]

_SCATTER_OF = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default,
               aten.as_strided.default: aten.as_strided_scatter.default}


def one_write_per_piece(graph) -> int:
    """``index_put(dst, [i0, .., in-1], cat(pieces, d))`` with ``n`` 1-d indices of the
    leading dims and ``d`` a dim between the tokens and a row's values (heads): each piece
    written into its slice of ``dst`` along dim ``n + d - 1``, as functionalization writes into a view: the
    view chain from the buffer taken again from its latest value, ``slice``, ``index_put``,
    and each view scattered back (``nodes.scatter_back`` reads the same form)."""
    done = 0
    for node in list(graph.nodes):
        if not is_op(node, aten.index_put.default) or len(node.args) > 3 and node.args[3]:
            continue
        dst, indices, values = node.args[:3]
        pieces = _pieces(values)
        if pieces is None or any(i is None for i in indices) or any(len(shape(i)) != 1 for i in indices):
            continue
        rows, n = shape(values), len(indices)
        dim, parts = pieces
        sizes = [shape(piece)[dim] if isinstance(piece, torch.fx.Node) else piece[2] - piece[1] for piece in parts]
        if dim in (0, len(rows) - 1) or len(rows) != 1 + len(shape(dst)) - n or \
                not all(isinstance(x, int) for x in sizes):
            continue  # the tokens, or the values of a row (RoPE's halves): one write, as the code has it
        root, chain = view_chain(dst)
        if any(step.target not in _SCATTER_OF for step in chain):
            continue
        try:
            after = scatter_back(node, chain)
        except NoMatch:
            continue
        target_dim, start = n + dim - 1, 0
        with graph.inserting_before(after.next):
            for piece, size in zip(parts, sizes):
                if not isinstance(piece, torch.fx.Node):  # (base, start, end): what a scatter left of base
                    piece = call_node(graph, aten.slice.Tensor, (piece[0], dim, piece[1], piece[2]), meta=node.meta)
                views = [root]
                for step in chain:  # the view, taken from the buffer's latest value
                    views.append(call_node(graph, step.target, (views[-1], *step.args[1:]), step.kwargs, node.meta))
                part = call_node(graph, aten.slice.Tensor, (views[-1], target_dim, start, start + size), meta=node.meta)
                new = call_node(graph, aten.index_put.default, (part, list(indices), piece), meta=node.meta)
                new = call_node(graph, aten.slice_scatter.default, (views[-1], new, target_dim, start, start + size),
                            meta=node.meta)
                for step, base in zip(reversed(chain), reversed(views[:-1])):  # scattered back, view by view
                    new = call_node(graph, _SCATTER_OF[step.target], (base, new, *step.args[1:]), step.kwargs, node.meta)
                root, start = new, start + size
        after.replace_all_uses_with(root)
        remove_dead([after])
        done += 1
    return done


def _pieces(values: torch.fx.Node):
    """(dim, the pieces ``values`` is made of along it, in order) for a ``cat``, or for a
    ``slice_scatter(base, src, dim, a, b)`` (``src`` between what it left of ``base``, each
    such part as ``(base, start, end)``); None for anything else."""
    if is_op(values, aten.cat.default):
        dim = values.args[1] if len(values.args) > 1 else values.kwargs.get("dim", 0)
        return dim % len(shape(values)), list(values.args[0])
    if not is_op(values, aten.slice_scatter.default):
        return None
    base, src = values.args[:2]
    dim, start, end, step = slice_params(values.args[2:], values.kwargs)
    size = shape(base)[dim]
    start, end = 0 if start is None else start, size if end is None else end
    if step != 1 or not all(isinstance(x, int) and x >= 0 for x in (start, end, size)) or end > size:
        return None
    dim %= len(shape(base))
    parts = ([(base, 0, start)] if start else []) + [src] + ([(base, end, size)] if end < size else [])
    return dim, parts
