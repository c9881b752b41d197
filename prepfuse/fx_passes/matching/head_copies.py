"""Heads a projection lays out strided apart, copied where an op call can read them.

GPT-NeoX's ``query_key_value`` holds each head's q, k and v side by side
(``view(.., H, 3 * D).chunk(3, -1)``), Megatron's each group's q heads, k and v
(``view(.., G, (Hq / G + 2) * D).split(..)``): a head is ``D`` contiguous columns, but its
neighbours lie more than ``D`` columns away, which no op call reads. ``copy_strided_heads``
gives each such view a contiguous copy in token order, the copy a model writing
``.contiguous()`` makes itself (``sources.is_copy``): the call then reads that. ``undo``
points the readers a rewrite left in the graph back at the view, so a graph nothing fused
in runs as it came.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import aten, call_node, shape
from prepfuse.fx_passes.matching.sources import COLUMN_VIEWS, TOKEN_DIMS, is_copy, replayed_views

__all__ = ["HeadCopy", "copy_strided_heads", "undo"]

_HEAD_VIEWS = (*COLUMN_VIEWS, aten.permute.default, aten.transpose.int, aten.t.default)


@dataclass
class HeadCopy:
    view: torch.fx.Node  # the strided view of the projection
    readers: list[torch.fx.Node]  # what read it, and now reads ``copy``
    made: list[torch.fx.Node]  # the nodes made, in order; the last is the copy in the view's dim order

    @property
    def copy(self) -> torch.fx.Node:
        return self.made[-1]


def copy_strided_heads(graph: torch.fx.Graph, sources, head_dim: int) -> list[HeadCopy]:
    """Copy every view of a ``[T, W]`` projection in ``sources`` that holds whole heads of
    ``head_dim`` per token at a stride other than ``head_dim`` (the first such view on each
    path: views of it are views of the copy)."""
    made = []
    for source in sources:
        sizes = shape(source)
        if len(sizes) != 2 or not all(isinstance(x, int) for x in sizes):
            continue  # a symbolic token count: left as it is
        for node, out, descend in replayed_views(source, _HEAD_VIEWS):
            order = _strided_heads_order(out, *sizes, head_dim)
            if order is None:
                continue
            descend(False)
            if node.users and not all(is_copy(u) for u in node.users):
                made.append(_copy(graph, node, *order))
    return made


def undo(copies: list[HeadCopy]) -> None:
    """The readers a rewrite did not replace read the view again; copies nothing reads go."""
    for hc in copies:
        for reader in hc.readers:
            if not getattr(reader, "_erased", False) and hc.copy in reader.all_input_nodes:
                reader.replace_input_with(hc.copy, hc.view)
        for node in reversed(hc.made):
            if not node.users:
                node.graph.erase_node(node)


def _strided_heads_order(out: torch.Tensor, tokens: int, width: int, head_dim: int) -> tuple | None:
    """(the dim order: size-1 dims, token dims outer to inner, then the head dims; how many of
    them lead up to the last token dim) in which ``out`` is tokens of whole heads, where those
    heads are not contiguous per token; else None."""
    if out.dim() < 3 or out.shape[-1] != head_dim or out.stride(-1) != 1:
        return None
    ones = [d for d in range(out.dim()) if out.shape[d] == 1]
    dims = sorted((d for d in range(out.dim()) if out.shape[d] != 1), key=lambda d: (-out.stride(d), d))
    if dims[-1] != out.dim() - 1:
        return None
    count, split = 1, 0
    while split < len(dims) and count < tokens:
        count *= out.shape[dims[split]]
        split += 1
    token_dims, head_dims = dims[:split], dims[split:]  # one token: no token dim but among the ones
    if count != tokens or (not token_dims and tokens != 1) or len(head_dims) < 2 \
            or (token_dims and out.stride(token_dims[-1]) != width):
        return None
    if any(out.stride(a) != out.stride(b) * out.shape[b] for a, b in zip(token_dims, token_dims[1:])):
        return None
    contiguous = all(out.stride(a) == out.stride(b) * out.shape[b] for a, b in zip(head_dims, head_dims[1:]))
    return None if contiguous else (ones + dims, len(ones) + len(token_dims))


def _copy(graph: torch.fx.Graph, view: torch.fx.Node, order: list[int], token_dims: int) -> HeadCopy:
    readers = list(view.users)
    identity = order == list(range(len(order)))
    made, node = [], view
    with graph.inserting_before(view.next):  # in order, right after the view
        if not identity:
            made.append(node := call_node(graph, aten.permute.default, [node, order]))
        made.append(node := call_node(graph, aten.clone.default, [node], {"memory_format": torch.contiguous_format}))
        node.meta[TOKEN_DIMS] = token_dims  # its tokens lead: [.., tokens, heads, D]
        if not identity:
            inverse = sorted(range(len(order)), key=order.__getitem__)
            made.append(node := call_node(graph, aten.permute.default, [node, inverse]))
    for reader in readers:
        reader.replace_input_with(view, node)
    return HeadCopy(view, readers, made)
