"""Logical axes, carried forward through a region: which token and which head every value
of a node belongs to.

The fused ops read ``[T, W]`` projection columns as ``[T, H, D]`` heads and write per
token and head. Model code moves those values through views (``[B, S, H, D]``,
``.transpose(1, 2)``, a batch of one, ``.flatten(-2)``) and through per-head math (a norm's
mean over ``D``, RoPE's halves or pairs, a quantisation's blocks, bitcasts to bytes). So a
family starts at its source's columns and carries a ``Layout`` (``layouts.py``: each dim as
factors of the base ``[T, W]``'s dims) forward through every step that keeps each value in
its token and head:

- a view: exactly (``layouts.follow``);
- elementwise math, broadcasting what does not depend on the source (a weight, cos/sin, a
  scale, a factor per head): the layout of the operand that has the result's shape. An
  operand not made from the start that has values of its own for every head and every value
  inside it is another tensor's heads (k or v against q: the attention contraction Inductor
  writes as a product and a sum when a size is 1), and the step is not carried;
- a step that acts inside each head only (a reduction over the head's dims with
  ``keepdim``, slices and cats of the head's values, ``view_as_complex``, a bitcast): the
  leading (token and head) dims are kept and the head's own dims become *opaque* factors
  (base dim ``OPAQUE``: inside one head, in an order the step decided).

A step that moves values across tokens or heads (a reduction over heads, an ``expand`` of
heads for attention, a matmul) is not carried: its inputs are the region's frontier. Sizes
may be symbolic; nothing here adds a guard.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from prepfuse.fx_passes.matching.layouts import Axis, Layout, _known, _regroup, follow
from prepfuse.fx_passes.matching.nodes import CONVERTS, VIEW_OPS, aten, graph_order, same_size, shape, val

__all__ = ["OPAQUE", "base_layout", "base_columns", "carry", "lead_count", "token_major_heads", "ELEMENTWISE"]

OPAQUE = 2  # base dim id of factors inside one head in an order a step made opaque
ELEMENTWISE = frozenset({
    *CONVERTS, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default,
    aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.exp.default, aten.exp2.default,
    aten.log2.default, aten.log.default, aten.abs.default, aten.sign.default, aten.signbit.default,
    aten.ceil.default, aten.floor.default, aten.round.default, aten.trunc.default, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.clamp.Tensor, aten.clamp_min.Tensor, aten.clamp_max.Tensor,
    aten.where.self, aten.mul.Scalar,
    aten.add.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.div.Tensor_mode, aten.pow.Tensor_Scalar,
    aten.pow.Scalar, aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default, aten.fmod.Scalar,
    aten.remainder.Scalar, aten.remainder.Tensor, aten.lt.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.ge.Scalar,
    aten.lt.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ge.Tensor, aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar,
    aten.ne.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_and.Scalar,
    aten.bitwise_or.Scalar, aten.bitwise_left_shift.Tensor, aten.bitwise_right_shift.Tensor,
    aten.__lshift__.Scalar, aten.__rshift__.Scalar, aten.__or__.Tensor, aten.__and__.Tensor, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.sigmoid.default, aten.tanh.default, aten.square.default,
    aten.clone.default, aten.alias.default, aten.copysign.Tensor, aten.copysign.Scalar, aten.nan_to_num.default,
    aten.fill.Scalar, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.complex.default, aten.polar.default,
    aten.lift_fresh_copy.default, aten.rsub.Scalar, aten.bitwise_not.default, aten.cos.default, aten.sin.default,
    aten.tan.default, aten.atan.default, aten.atan2.default, aten.erf.default, aten.expm1.default, aten.log1p.default,
    aten.log10.default, aten.relu.default, aten.silu.default, aten.gelu.default, aten.softplus.default,
    aten.floor_divide.default, aten.isnan.default, aten.isinf.default,
})
_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
                         aten.var.correction, aten.prod.dim_int, aten.any.dims, aten.max.dim, aten.min.dim})
_TAIL_STEPS = frozenset({aten.slice.Tensor, aten.select.int, aten.cat.default, aten.stack.default,
                         aten.split.Tensor, aten.split_with_sizes.default, aten.view_as_complex.default,
                         aten.view_as_real.default, aten.view.dtype, aten.constant_pad_nd.default,
                         aten.unbind.int, aten.chunk.default, aten.repeat_interleave.self_int, aten.flip.default,
                         aten.roll.default, aten.unsqueeze.default, aten.expand.default, aten.gather.default,
                         aten.index_select.default, aten.real.default, aten.imag.default})


def _pretend_tail(sizes) -> tuple[tuple[Axis, ...], ...]:
    """Opaque factors for a head's own dims ``sizes`` (row-major strides among them)."""
    groups, stride = [], 1
    for size in reversed(list(sizes)):
        groups.append(() if _known(size == 1) else (Axis(OPAQUE, size, stride),))
        stride = stride * size
    return tuple(reversed(groups))


def _is_tail_group(group, head_dim) -> bool:
    return all(f.dim == OPAQUE or (f.dim == 1 and _known(f.stride * f.size <= head_dim)) for f in group)


def is_heads_group(group, head_dim) -> bool:
    """Whether a dim's factors are columns a whole number of heads apart: a dim of heads."""
    return all(f.dim == 1 and _known(f.stride % head_dim == 0) for f in group)


def lead_count(layout: Layout, head_dim) -> int | None:
    """How many leading dims hold tokens and heads (the rest lie inside one head); None
    when a head's own dim comes before a token or head dim."""
    last = -1
    for i, group in enumerate(layout.dims):
        if group and not _is_tail_group(group, head_dim):
            last = i
    if any(group and _is_tail_group(group, head_dim) for group in layout.dims[:last + 1]):
        return None
    return last + 1


def base_columns(node: torch.fx.Node, head_dim=None) -> tuple:
    """``(tokens, width)`` of the 2-d base ``[T, W]`` a source ``node`` shows: its leading
    dims are the tokens, its last the columns; a source whose last dim is ``head_dim``
    (``[T, H, D]``, heads passed as they are) has ``H * D`` columns."""
    sizes = shape(node)
    lead = sizes[:-2] if head_dim is not None and len(sizes) >= 3 and sizes[-1] == head_dim else sizes[:-1]
    tokens = 1
    for s in lead:
        tokens = tokens * s
    width = 1
    for s in sizes[len(lead):]:
        width = width * s
    return tokens, width


def base_layout(node: torch.fx.Node, head_dim=None) -> Layout | None:
    """``node`` as factors of its 2-d base ``[T, W]`` (``base_columns``); None where dynamic
    sizes keep that from being read without a guard."""
    sizes = shape(node)
    tokens, width = base_columns(node, head_dim)
    if len(sizes) == 2:
        return Layout(((Axis(0, sizes[0], 1),) if not _known(sizes[0] == 1) else (), (Axis(1, sizes[1], 1),)))
    grouped = _regroup([Axis(0, tokens, 1), Axis(1, width, 1)], sizes)
    return None if grouped is None else Layout(grouped)


def token_major_heads(layout: Layout, num_tokens, head_dim) -> int | None:
    """The head count H where ``layout`` is token-major heads: the token dims (base dim 0,
    outer first, all of it), then H heads of ``head_dim`` columns, then the head's own
    dims (their sizes multiplying to ``head_dim``); else None."""
    k = lead_count(layout, head_dim)
    if k is None:
        return None
    lead = [g for g in layout.dims[:k] if g]
    tail = [f for g in layout.dims[k:] for f in g]
    tail_size = 1
    for f in tail:
        tail_size = tail_size * f.size
    if not _known(tail_size == head_dim):
        return None
    if not lead:  # one token of one head: every leading dim has size 1
        return 1 if _known(num_tokens == 1) else None
    *tokens, heads = lead
    if heads and all(f.dim == 0 for f in heads):  # one head: no heads factor, the last lead dim is tokens
        tokens, heads = lead, ()
    heads_size = 1
    for f in heads:
        if f.dim != 1 or not _known(f.stride == head_dim):
            return None
        heads_size = heads_size * f.size
    factors = [f for g in tokens for f in g]
    if any(f.dim != 0 for f in factors):
        return None
    if not factors:
        return heads_size if _known(num_tokens == 1) else None
    strides = [f.stride for f in factors]
    if not _known(strides[-1] == 1) or any(not _known(a == b * f.size)
                                           for a, b, f in zip(strides, strides[1:], factors[1:])):
        return None
    if not _known(factors[0].size * factors[0].stride == num_tokens):
        return None
    return heads_size


def carry(start: torch.fx.Node, layout: Layout, head_dim, foreign) -> dict[torch.fx.Node, Layout]:
    """The layouts of every node the values of ``start`` (laid out ``layout``) reach through
    steps that keep each value in its token and head. ``foreign(node)`` says a node's values
    come from another source (it may not be mixed in)."""
    found = {start: layout}
    order = graph_order(start.graph)
    frontier = sorted(start.users, key=order.__getitem__)
    pending = set(frontier)
    own = made_from([start], order)
    while frontier:
        node = frontier.pop(0)
        pending.discard(node)
        out = _step(node, found, head_dim, foreign, own)
        if out is None:
            continue
        found[node] = out
        for user in node.users:
            if user not in found and user not in pending:
                pending.add(user)
                frontier.append(user)
        frontier.sort(key=order.__getitem__)
    return found


def _inputs(node) -> list[torch.fx.Node]:
    found = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


class _Pieces:
    """The pieces of a split (or a reduction's values and indices) along a head's own dims."""

    def __init__(self, layout: Layout, source: torch.fx.Node):
        self.layout, self.source = layout, source


def _dims_acted_on(node: torch.fx.Node) -> list[int] | None:
    """The input dims a reduction or a head-internal step works along (None: all of them)."""
    t, args, kwargs = node.target, node.args, node.kwargs
    ndim = len(shape(args[0])) if not isinstance(args[0], (list, tuple)) else len(shape(args[0][0]))
    if t in _REDUCTIONS:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None:
            return None
        return [d % ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if t in (aten.cat.default, aten.stack.default):
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return [dim % (ndim + (t is aten.stack.default))]
    if t in (aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
             aten.unbind.int, aten.chunk.default, aten.index_select.default, aten.gather.default,
             aten.repeat_interleave.self_int, aten.roll.default, aten.flip.default):
        if t is aten.split.Tensor or t is aten.split_with_sizes.default or t is aten.chunk.default:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        elif t is aten.roll.default:
            dim = args[2] if len(args) > 2 else kwargs.get("dims", [])
            return [d % ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])] or None
        elif t is aten.flip.default:
            return [d % ndim for d in args[1]]
        elif t is aten.repeat_interleave.self_int:
            dim = args[2] if len(args) > 2 else kwargs.get("dim")
            if dim is None:
                return None
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return [dim % ndim]
    if t is aten.constant_pad_nd.default:
        pads = list(args[1])
        return [ndim - 1 - i // 2 for i in range(len(pads)) if pads[i] != 0]
    if t is aten.expand.default:
        return [i + ndim - len(args[1]) for i, s in enumerate(args[1])
                if i + ndim - len(args[1]) >= 0 and s != -1 and not same_size(s, shape(args[0])[i + ndim - len(args[1])])]
    return []  # view_as_complex / view_as_real / view.dtype / real / imag: the last dims only


def _grows_a_unit_dim(node: torch.fx.Node, acted: list[int]) -> bool:
    """Whether ``node`` makes a dim of one of its input more than one (a pad, expand or
    repeat of it): the one head of ``[T, 1, D]`` padded to ``[T, HP, D]`` is then new heads,
    not values within the head, whatever the layout counts the dim of one as."""
    out, source = val(node), node.args[0]
    if not isinstance(out, torch.Tensor) or not isinstance(source, torch.fx.Node) or \
            len(shape(source)) != out.dim():
        return False
    return any(same_size(shape(source)[d], 1) and not same_size(out.shape[d], 1) for d in acted)


def made_from(starts, order: dict):
    """``made(node)``: whether ``node`` reads the values of any of ``starts`` (nodes), through
    any steps (a search back that stops at nodes before the earliest of them, remembering the
    nodes that do not). One search serves several starts: asking start by start walks the
    graph back once per start."""
    known = dict.fromkeys(starts, True)
    if not known:
        return lambda node: False
    floor = min(order[s] for s in known)

    def made(node: torch.fx.Node) -> bool:
        if node in known:
            return known[node]
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if known.get(n):
                known[node] = True
                return True
            if n in seen or n in known or order.get(n, -1) < floor:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        known.update(dict.fromkeys(seen, False))
        return False

    return made


def _step(node: torch.fx.Node, found: dict, head_dim, foreign, own) -> Layout | _Pieces | None:
    """The layout of ``node`` from its carried inputs, or None where it is not carried."""
    if node.op != "call_function":
        return None
    inputs = _inputs(node)
    carried = [i for i in inputs if i in found]
    if not carried or any(foreign(i) for i in inputs if i not in found):
        return None
    out = val(node)
    if node.target is operator.getitem:
        parent = found.get(node.args[0])
        if isinstance(parent, _Pieces) and isinstance(out, torch.Tensor):
            return _with_tail(parent.layout, parent.source, out.shape, head_dim)
        return None
    layouts = [found[i] for i in carried]
    if any(not isinstance(x, Layout) for x in layouts):
        return None
    first = layouts[0]
    if node.target in VIEW_OPS and isinstance(out, torch.Tensor):
        followed = follow(first, node)
        return followed if followed is not None else _with_tail(first, carried[0], out.shape, head_dim)
    if node.target in ELEMENTWISE and isinstance(out, torch.Tensor):
        same = [found[i] for i in carried if len(shape(i)) == out.dim() and
                all(same_size(a, b) for a, b in zip(shape(i), out.shape))]
        if not same or any(_per_head(i, same[0], out.dim(), head_dim) and not own(i) for i in inputs if i not in found):
            return None
        k = lead_count(same[0], head_dim)
        for x in layouts:  # every carried operand (a norm's smaller [.., 1] too) shares the lead dims
            if k is None or lead_count(x, head_dim) != k or x.dims[:k] != same[0].dims[:k]:
                return None
        if all(x == same[0] for x in same):
            return same[0]
        return Layout(same[0].dims[:k] + _pretend_tail(out.shape[k:]))  # the head's values mixed
    if node.target in _REDUCTIONS or node.target in _TAIL_STEPS:
        k = lead_count(first, head_dim)
        acted = _dims_acted_on(node)
        if k is None or acted is None or any(d < k for d in acted) or _grows_a_unit_dim(node, acted):
            return None
        if any(lead_count(x, head_dim) != k or x.dims[:k] != first.dims[:k] for x in layouts):
            return None
        if isinstance(out, torch.Tensor):
            return _with_tail(first, carried[0], out.shape, head_dim)
        if isinstance(out, (tuple, list)):
            return _Pieces(first, carried[0])
    return None


def _per_head(operand: torch.fx.Node, layout: Layout, ndim: int, head_dim) -> bool:
    """Whether ``operand``, broadcast against a result of ``ndim`` dims laid out ``layout``,
    holds more than one value along a dim of heads (columns ``head_dim`` apart) and along a
    dim inside the head: heads of its own."""
    sizes = shape(operand)
    k = lead_count(layout, head_dim)
    if not isinstance(val(operand), torch.Tensor) or len(sizes) > ndim or k is None:
        return False
    lead = ndim - len(sizes)

    def varies(i):
        return i >= lead and not _known(sizes[i - lead] == 1)

    heads = [i for i, group in enumerate(layout.dims[:k]) if group and is_heads_group(group, head_dim)]
    return any(map(varies, heads)) and any(map(varies, range(k, ndim)))


def _keeps_lead(layout: Layout, node, sizes, head_dim) -> bool:
    k = lead_count(layout, head_dim)
    return k is not None and len(sizes) >= k and all(same_size(a, b) for a, b in zip(shape(node)[:k], sizes[:k]))


def _with_tail(layout: Layout, node, sizes, head_dim) -> Layout | None:
    """``layout``'s token and head dims, then opaque head dims of ``sizes`` beyond them,
    where the step kept those leading dims as they were."""
    k = lead_count(layout, head_dim)
    if k is None or not _keeps_lead(layout, node, sizes, head_dim):
        return None
    return Layout(layout.dims[:k] + _pretend_tail(sizes[k:]))
