"""Where written values come from: the projection columns a fused op would read instead.

A fused op reads its source as ``[T, W]`` columns (heads at ``[first, first + H * D)``).
``trace`` walks a region back from what it writes to the nodes that could be that source
(the region's leaves first: a projection's output; then a node the per-head steps cannot
see through, such as a norm over all heads, which stays the model's own), starts the
logical axes (``axes.carry``) at each of their column ranges, and keeps the starts whose
axes reach the written values with every value in one token and one head. Which of them
computes the region is left to the probes; this only says which are possible, and with
what layout.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching.axes import base_columns, base_layout, carry, is_heads_group, lead_count
from prepfuse.fx_passes.matching.layouts import Axis, Layout, _known, _regroup
from prepfuse.fx_passes.matching.nodes import (
    CONVERTS, RESHAPES, aten, graph_order, is_op, same_size, shape, slice_params, val,
)
from prepfuse.fx_passes.matching.regions import PREP_STEPS, backward, is_leaf, leaves, operands

__all__ = ["Start", "Traced", "Prepared", "column_starts", "projection_starts", "trace", "dim_roles", "token_dims_order", "heads_of",
           "prepared", "projection_input", "weight_like", "first_tokens_of", "unpadded_rows", "is_copy", "copy_start",
           "replayed_views", "COLUMN_VIEWS", "TOKEN_DIMS"]


@dataclass(frozen=True)
class Start:
    """Columns ``[first, first + width)`` of ``source`` (``[..., W]``, leading dims tokens),
    seen as the node ``node`` (the source itself, or a slice of its last dim)."""

    source: torch.fx.Node
    node: torch.fx.Node
    first: int
    width: int
    token_dims: int | None = None  # leading dims of ``node`` that are the tokens (None: ``base_columns`` reads them)

    @property
    def tokens(self):
        """How many tokens ``node`` holds (without ``token_dims``: every dim but the last)."""
        n = 1
        for size in shape(self.node)[:-1 if self.token_dims is None else self.token_dims]:
            n = n * size
        return n

    def layout(self, head_dim) -> Layout | None:
        """``node`` as factors of the base ``[T, width]``."""
        if self.token_dims is None or len(shape(self.node)) == 2:
            return base_layout(self.node, head_dim if self.node is self.source else None)
        grouped = _regroup([Axis(0, self.tokens, 1), Axis(1, self.width, 1)], shape(self.node))
        return None if grouped is None else Layout(grouped)


@dataclass(frozen=True)
class Traced:
    start: Start
    layout: Layout  # of the traced node, over the start's [T, width]
    carried: dict  # every node the start's axes reach, with its layout


def column_starts(source: torch.fx.Node, head_dim=None, views: bool = False) -> list[Start]:
    """``source`` whole (``[T, W]``, or heads ``[T, H, head_dim]``: ``axes.base_columns``),
    and every slice of its columns (a slice, a split's piece) reached through views that
    keep its last dim whole; with ``views``, also every other view holding one column range
    per token (``_viewed_column_ranges``: dearer, so the last resort of ``trace``)."""
    sizes = shape(source)
    heads_given = head_dim is not None and len(sizes) == 3 and sizes[-1] == head_dim  # [T, H, D]: T tokens
    token_dims = source.meta.get(TOKEN_DIMS, 1 if heads_given else None)
    width = 1
    for size in sizes[token_dims:] if token_dims is not None else ():
        width = width * size
    found = [Start(source, source, 0, width if token_dims is not None else base_columns(source, head_dim)[1],
                   token_dims=token_dims)]
    width = shape(source)[-1]
    stack = [source]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_op(user, *RESHAPES) and user.args[0] is node and same_size(shape(user)[-1], width):
                stack.append(user)
            elif is_op(user, aten.slice.Tensor) and user.args[0] is node:
                dim, start, end, step = slice_params(user.args[1:], user.kwargs)
                if dim % len(shape(node)) == len(shape(node)) - 1 and step == 1 and isinstance(start, int):
                    start = start + width if start < 0 else start
                    found.append(Start(source, user, start, shape(user)[-1]))
            elif is_op(user, aten.split_with_sizes.default, aten.split.Tensor) and user.args[0] is node:
                dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
                if dim % len(shape(node)) != len(shape(node)) - 1:
                    continue
                sizes = list(user.args[1]) if user.target is aten.split_with_sizes.default else None
                if not all(isinstance(x, int) for x in (sizes if sizes is not None else [user.args[1]])):
                    continue  # a split of symbolic sizes: no column range known at compile time
                for piece in user.users:
                    index = piece.args[1]
                    first = sum(sizes[:index]) if sizes else index * user.args[1]
                    found.append(Start(source, piece, first, shape(piece)[-1]))
    found = [s for s in found if all(isinstance(x, int) for x in (s.first, s.width))]
    if not views:
        return found
    seen = {s.node for s in found}
    return found + [s for s in _viewed_column_ranges(source) if s.node not in seen]


TOKEN_DIMS = "prepfuse_token_dims"  # node meta: how many leading dims of a copy hold its tokens (``head_copies``)
COLUMN_VIEWS = (*RESHAPES, aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
                 aten.unsqueeze.default, aten.squeeze.dim, operator.getitem)
MAX_COLUMN_VIEWS = 64


def _viewed_column_ranges(source: torch.fx.Node) -> list[Start]:
    """Views of a 2-d ``source`` that keep its tokens, in order, as their leading dims (``[T,
    ..]``, a batch's ``[B, T, ..]``) and hold one range of its columns per token, however the
    views are spelled (``qkv.view(T, 2, H, D)[:, 0]``: columns ``[W_q, W_q + H * D)``), read off
    the offset and strides ``replayed_views`` gives them. Concrete sizes only (a symbolic one
    is left to ``column_starts``'s own cases)."""
    sizes = shape(source)
    if len(sizes) != 2 or not all(isinstance(x, int) for x in sizes):
        return []
    tokens, width = sizes
    found = []
    for node, out, _ in replayed_views(source):
        lead = _token_lead(out, tokens, width)
        row = out[(0,) * lead] if lead else None
        first = out.storage_offset()
        if row is not None and row.dim() and first + row.numel() <= width and row.is_contiguous():
            found.append(Start(source, node, first, row.numel(), token_dims=lead))
        if len(found) >= MAX_COLUMN_VIEWS:
            break
    return found


def _token_lead(out: torch.Tensor, tokens: int, width: int) -> int:
    """How many leading dims of ``out`` hold its ``tokens`` tokens, ``width`` apart in order
    (their size-1 dims aside); 0 where none do."""
    count = 1
    for lead in range(1, out.dim()):
        count *= out.shape[lead - 1]
        if count > tokens:
            return 0
        if count == tokens:
            step = width
            for d in reversed([d for d in range(lead) if out.shape[d] != 1]):
                if out.stride(d) != step:
                    return 0
                step *= out.shape[d]
            return lead
    return 0


def replayed_views(source: torch.fx.Node, views=COLUMN_VIEWS):
    """Every view of a 2-d ``source`` (concrete sizes) reached through ``views``, breadth first,
    as ``(node, its meta tensor over source's, descend)``: the views replayed on a meta tensor
    give each one's offset and strides, whatever the spelling. ``descend(False)`` before the
    next item skips the node's own views."""
    frontier = [(u, source, torch.empty(shape(source), device="meta")) for u in source.users]
    seen = 0
    while frontier and seen < 4 * MAX_COLUMN_VIEWS:
        node, parent_node, parent = frontier.pop(0)
        if not is_op(node, *views) or node.args[0] is not parent_node:
            continue
        try:
            target = aten.view.default if node.target in RESHAPES else node.target
            out = target(parent, *node.args[1:], **node.kwargs)
        except Exception:  # noqa: BLE001 - a view the meta tensor cannot replay (a symbolic size): not followed
            continue
        if isinstance(out, (list, tuple)):
            frontier += [(u, node, out) for u in node.users]
            continue
        if node.target is not operator.getitem and node.target not in RESHAPES and not out._is_view():
            continue
        seen += 1
        follow = [True]
        yield node, out, lambda flag: follow.__setitem__(0, flag)
        if follow[0]:
            frontier += [(u, node, out) for u in node.users]


def projection_starts(graph: torch.fx.Graph, head_dim: int, dtypes, avoid=frozenset()) -> list[Start]:
    """The first column start (``column_starts``) of every leaf of ``graph`` that could be a
    projection of heads of ``head_dim``: ``dtypes``, two dims or more, a static width that
    whole heads fill; none of ``avoid`` (another side's sources)."""
    found = []
    for node in graph.nodes:
        v = val(node)
        if not (isinstance(v, torch.Tensor) and v.dtype in dtypes and v.dim() >= 2 and is_leaf(node)
                and isinstance(v.shape[-1], int) and v.shape[-1] % head_dim == 0) or node in avoid:
            continue
        found += column_starts(unpadded_rows(node), head_dim)[:1]
    return found


def _source_candidates(region: list[torch.fx.Node], avoid: set) -> list[torch.fx.Node]:
    """Leaves of ``region`` that hold float columns, then the model's copies of values
    (``is_copy``), then region nodes made by a step the axes do not carry (from where the
    model's own computation must stand)."""
    def columns_like(n):
        v = val(n)
        return isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dim() >= 2 and n not in avoid
    first = [n for n in leaves(region) if columns_like(n)]
    copies = [n for n in region if columns_like(n) and is_copy(n)]  # the projection's values, copied
    return first + copies + [n for n in region if columns_like(n) and n.op == "call_function" and n.target in PREP_STEPS
                             and (is_op(n, aten.index.Tensor, aten.mean.dim, aten.sum.dim_IntList, aten.cat.default)
                                  or first_tokens_of(n) is not None)]


def copy_start(node: torch.fx.Node, head_dim: int, tokens) -> Start | None:
    """A copy (``is_copy``) whole, as the source of ``tokens`` tokens: its leading dims
    that hold that many, the rest whole heads of ``head_dim`` (a ``[T, Hkv, G, D]`` copy of
    q heads grouped per kv head is ``T`` tokens of ``Hkv * G`` heads)."""
    sizes = shape(node)
    count = 1
    for dims in range(1, len(sizes)):
        count = count * sizes[dims - 1]
        width = 1
        for size in sizes[dims:]:
            width = width * size
        if same_size(count, tokens) and isinstance(width, int) and width % head_dim == 0:
            return Start(node, node, 0, width, token_dims=dims)
    return None


def is_copy(node: torch.fx.Node) -> bool:
    """A copy the model makes of a projection's values, before any math (``.contiguous()``,
    a reshape that must copy): where the projection's own order is one no op call can read
    (heads strided apart, as a qkv grouped per kv head lays them out), the op may read the
    copy instead."""
    return is_op(node, aten.clone.default) and is_leaf(_under_views(node.args[0]))


def first_tokens_of(node) -> torch.fx.Node | None:
    """``x`` where ``node`` is ``x[:n]``, the first rows of tokens (data-parallel padding:
    an op reads all T rows and inserts the first ``len(slot_mapping)``), else None."""
    if is_op(node, aten.slice.Tensor):
        dim, start, _, step = slice_params(node.args[1:], node.kwargs)
        if dim == 0 and start in (0, None) and step == 1:
            return node.args[0]
    return None


def trace(values: torch.fx.Node, head_dim: int, avoid=frozenset(), region=None) -> list[Traced]:
    """The starts whose logical axes reach ``values`` with every value in one token and one
    head of ``head_dim``: the projection columns the values were made from (most likely
    first: a leaf before a computed node, a narrower column range before a wider one)."""
    region = region if region is not None else backward([values])
    sources = _source_candidates(region, set(avoid))
    found = _traced(values, head_dim, sources, views=False)
    if any(is_leaf(t.start.source) for t in found):
        return found
    # the views' replay (dearer) only where the plain column slices reach no leaf
    return _traced(values, head_dim, sources, views=True)


def _traced(values, head_dim, sources, views: bool) -> list[Traced]:
    found = []
    for source in sources:
        # whole heads only: a slice inside one head is the head's own math, not a source
        starts = sorted((s for s in column_starts(source, head_dim, views) if s.width % head_dim == 0),
                        key=lambda s: s.width)
        for start in starts:
            base = start.layout(head_dim)
            if base is None:
                continue
            carried = carry(start.node, base, head_dim, lambda n: False)
            layout = carried.get(values)
            if isinstance(layout, Layout) and dim_roles(layout, head_dim) is not None:
                found.append(Traced(start, layout, carried))
                break  # the narrowest range of this source that reaches them
    return found


def dim_roles(layout: Layout, head_dim: int) -> list[str] | None:
    """Per dim: ``tokens``, ``heads`` (columns ``head_dim`` apart), ``head`` (inside one head),
    or ``one`` (size 1); None when a dim mixes them or a head's own dim leads."""
    k = lead_count(layout, head_dim)
    if k is None:
        return None
    roles = []
    for i, group in enumerate(layout.dims):
        if not group:
            roles.append("one")
        elif i >= k:
            roles.append("head")
        elif all(f.dim == 0 for f in group):
            roles.append("tokens")
        elif is_heads_group(group, head_dim):
            roles.append("heads")
        else:
            return None
    return roles


def token_dims_order(layout: Layout, roles: list[str], num_tokens) -> list[int] | None:
    """The token dims outer to inner (by their factors' strides), where together they list
    every token once in order; else None."""
    dims = [i for i, r in enumerate(roles) if r == "tokens"]
    factors = sorted(((f, i) for i in dims for f in layout.dims[i]), key=lambda fi: -_stride(fi[0].stride))
    if not factors:
        return [] if _known(num_tokens == 1) else None
    expected = 1
    for f, _ in reversed(factors):
        if not _known(f.stride == expected):
            return None
        expected = expected * f.size
    if not _known(expected == num_tokens):
        return None
    order = []
    for _, i in factors:
        if i not in order:
            order.append(i)
    # each dim's factors must be contiguous in the order (a dim is one stretch of tokens)
    return order if len(order) == len(dims) else None


def heads_of(layout: Layout, roles: list[str], head_dim: int) -> tuple[int, int] | None:
    """(head count, first head's column offset in heads) of the heads dim; (1, 0) without one."""
    dims = [i for i, r in enumerate(roles) if r == "heads"]
    if not dims:
        return 1, 0
    if len(dims) != 1:
        return None
    group = layout.dims[dims[0]]  # factors of one heads dim, outer first: one run of heads if they abut
    if any(not _known(outer.stride == inner.size * inner.stride) for outer, inner in zip(group, group[1:])):
        return None
    count = 1
    for f in group:
        count = count * f.size
    return (count, 0) if _known(group[-1].stride == head_dim) else None


def _stride(s) -> int:
    return s if isinstance(s, int) else 1 << 62



def projection_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The activation a linear projection read (``mm(x, w)``, ``addmm(b, x, w)``, through
    views on both sides and a copy of the product), or None when ``node`` is no projection. Inductor on CUDA may pad
    the rows of an mm for alignment (``slice(mm(constant_pad_nd(x)))``); each projection
    pads its own copy, so the padding is seen through to ``x``."""
    node = _under_views(node.args[0] if is_copy(node) else node)
    if is_op(node, aten.mm.default):
        return _unpadded(_under_views(node.args[0]))
    if is_op(node, aten.addmm.default):
        return _unpadded(_under_views(node.args[1]))
    return None


def unpadded_rows(node: torch.fx.Node) -> torch.fx.Node:
    """The projection's own rows where Inductor padded them for alignment and slices them
    back (``slice(mm(constant_pad_nd(x)), 0, 0, T)``, nothing else reading the padded
    product): that slice; else ``node``. The padded product holds T + pad tokens, so its
    token count never matches the prep's."""
    operand = node.args[0] if is_op(node, aten.mm.default) else node.args[1] if is_op(node, aten.addmm.default) \
        else None
    if operand is None or not is_op(_under_views(operand), aten.constant_pad_nd.default) or len(node.users) != 1:
        return node
    (user,) = node.users
    return user if first_tokens_of(user) is node else node


def _under_views(node):
    while is_op(node, *RESHAPES, aten.slice.Tensor, aten.permute.default, aten.t.default, aten.transpose.int,
                aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.split.Tensor,
                aten.split_with_sizes.default, operator.getitem):
        node = node.args[0]
    return node


def _unpadded(node):
    if is_op(node, aten.constant_pad_nd.default) and list(node.args[1])[:3] == [0, 0, 0]:
        return _under_views(node.args[0])
    return node


def weight_like(n) -> bool:
    """A 1-d float operand: a norm weight (or ``1 + w``), one value per head dim."""
    v = val(n)
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.dtype.is_floating_point and v.numel() > 1


@dataclass(frozen=True)
class Prepared:
    """A node later steps read that holds ``start``'s heads, per token and head."""

    node: torch.fx.Node
    layout: Layout
    heads: int
    operands: list  # what its math reads besides the source (``regions.operands``)
    tail: bool = False  # only later steps of the q read it: a view, or a scaling by a number, of it is read


def prepared(start: Start, head_dim: int, tokens, dtypes=(torch.bfloat16, torch.float32),
             tails: bool = False) -> list[Prepared]:
    """Every node carried from ``start`` (heads of ``head_dim``) that a step outside the
    carried set reads (attention, a matmul, the graph's output), or that holds the heads as
    fp8 (what the code stores, though the reader dequantises it in the graph), whole heads
    per token in some layout, latest first: the candidates for "the prepared q". With ``tails``, after
    them and marked ``tail``, what those are views or number scalings of (``q =
    rope(q).transpose(1, 2)`` then ``q.mul_(scaling)``): the op's q, with the model's scaling
    left after it."""
    base = start.layout(head_dim)
    if base is None:
        return []
    carried = carry(start.node, base, head_dim, lambda n: False)

    def as_prepared(node, tail=False) -> Prepared | None:
        layout = carried.get(node)
        if not isinstance(layout, Layout) or not isinstance(val(node), torch.Tensor) or val(node).dtype not in dtypes:
            return None
        roles = dim_roles(layout, head_dim)
        heads = heads_of(layout, roles, head_dim) if roles else None
        if roles is None or heads is None or token_dims_order(layout, roles, tokens) is None:
            return None
        if "head" not in roles or heads[0] * head_dim != start.width:
            return None
        return Prepared(node, layout, heads[0], operands(backward([node]), {start.node}, {}), tail)

    order = graph_order(start.node.graph)
    outside = sorted((n for n in carried if not all(u in carried for u in n.users) or _fp8(n)), key=lambda n: -order[n])
    read = [p for p in map(as_prepared, outside) if p]
    if not tails:
        return read
    found, seen = [], {p.node for p in read}
    for node in outside:
        node = _tail_input(node, carried)
        while node is not None and node not in seen:
            seen.add(node)
            t = as_prepared(node, tail=True)
            if t is not None:
                found.append(t)
            node = _tail_input(node, carried)
    return read + found


def _fp8(node: torch.fx.Node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


_TAIL_VIEWS = (*RESHAPES, aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.clone.default)
_TAIL_SCALINGS = (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar)


def _tail_input(node: torch.fx.Node, carried) -> torch.fx.Node | None:
    """The carried input of ``node`` where ``node`` is a view of it, it times (or over) a
    number, or it widened exactly (bf16 to fp32: an attention's ``.float()``), and nothing
    else reads it; else None."""
    if is_op(node, *_TAIL_VIEWS):
        source = node.args[0]
    elif is_op(node, *CONVERTS) and isinstance(node.args[0], torch.fx.Node) and _widens(node.args[0], node):
        source = node.args[0]
    elif is_op(node, *_TAIL_SCALINGS):
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if len(tensors) != 1 or (is_op(node, aten.div.Tensor, aten.div.Scalar) and node.args[0] is not tensors[0]):
            return None
        source = tensors[0]
    else:
        return None
    if not isinstance(source, torch.fx.Node) or source not in carried or len(source.users) != 1:
        return None
    return source


def _widens(source: torch.fx.Node, node: torch.fx.Node) -> bool:
    a, b = val(source), val(node)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == torch.float32)


def row_sources(rows: list[torch.fx.Node], head_dim: int, avoid=frozenset()) -> tuple[list[torch.fx.Node], list, list]:
    """(the ``[T, head_dim]`` nodes written ``rows`` could be made from: a call's candidates
    for its one-head source, latest first; the region of the rows; the operands its math
    mixes in). A candidate is computed from the rows' source alone, before any per-token
    operand (cos/sin) is mixed in: a bf16 node, or fp32 where the graph holds no bf16 one
    (a round trip Inductor dropped: the call rounds it), never a widening of a bf16 one. The
    first rows ``x[:n]`` of a candidate bring ``x`` in too: an op inserting the first
    ``len(slot_mapping)`` rows reads it."""
    region = backward(rows)
    traced = trace(rows[0], head_dim, avoid=avoid, region=region)
    if not traced:
        return [], region, []
    leaf = traced[0].start.node
    ops = operands(region, {leaf}, {})
    found = []
    for node, layout in traced[0].carried.items():
        roles = dim_roles(layout, head_dim) if isinstance(layout, Layout) else None
        if roles is None or "heads" in roles or shape(node)[-1:] != (head_dim,) or node in found:
            continue
        dtype = val(node).dtype
        widened = dtype == torch.float32 and is_op(node, *CONVERTS) and val(node.args[0]).dtype == torch.bfloat16
        if dtype not in (torch.bfloat16, torch.float32) or widened:
            continue
        mixed = operands(backward([node]), {leaf}, {}) if node is not leaf else []
        if any(isinstance(val(m), torch.Tensor) and val(m).dim() >= 2 for m in mixed):
            continue  # per-token values mixed in already: past the rotation
        found.append(node)
    found += [x for x in map(first_tokens_of, found) if x is not None and x not in found]
    order = graph_order(rows[0].graph)
    found.sort(key=lambda n: (val(n).dtype != torch.bfloat16, -order[n]))
    return found, region, ops
