"""Logical axes through views: which elements of a base tensor a chain of view ops shows.

Model code moves the same values through many layouts: Hugging Face projects ``[B, S, H*D]``,
views it as ``[B, S, H, D]``, norms, transposes to ``[B, H, S, D]`` and ropes there, and its
attention function writes ``k.transpose(1, 2).reshape(B*S, H, D)`` into the cache; gpt-fast
works on ``[1, T, H, D]``; engines on ``[T, H, D]`` or flat ``[T, H*D]``. The recognisers must
see one logical tensor ``(tokens, heads, head dim)`` in all of them, and must never take a
layout that reorders elements for one that does not.

A ``Layout`` describes a node's dims as *factors* of a base tensor's dims: factor
``Axis(dim, size, stride)`` counts ``size`` steps of ``stride`` along base dim ``dim``. Base
``[T, 256]`` viewed as ``[T, 4, 64]`` is ``[(t,), (w·64 x4,), (w x64,)]``; a permute reorders
the node's dims, a reshape regroups the factors in row-major order (logical order: what a
reshape means, also of a permuted tensor, where it copies), an unsqueeze adds an empty dim.
``follow`` applies one view op; ``strip_views`` walks up a chain to the first node that is
not a view and returns it with the layout; ``apply_views`` carries a layout a caller already
knows (a rotated tensor has its input's layout) down a chain to a later node.

Sizes may be symbolic (a dynamic token count): factors are compared and divided only where
the result is statically known, so nothing here adds a guard; what cannot be decided is
no match (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["Axis", "Layout", "identity", "follow", "strip_views", "apply_views", "token_major_heads",
           "canonical_order", "VIEW_OPS"]

aten = torch.ops.aten
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
            aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
            aten.alias.default, aten.t.default)
# (not ``clone``: a copy is a tensor of its own, which is how code says "a separate projection")


@dataclass(frozen=True)
class Axis:
    """``size`` steps of ``stride`` along base dim ``dim``."""

    dim: int
    size: object  # int or SymInt
    stride: object  # int or SymInt


@dataclass(frozen=True)
class Layout:
    """A node's dims as factors of a base's dims (outer first). A slice is never followed:
    it is a base of its own (``sources.column_starts`` counts its start)."""

    dims: tuple[tuple[Axis, ...], ...]


def _known(cond) -> bool:
    return cond if isinstance(cond, bool) else statically_known_true(cond)


def _is_one(size) -> bool:
    return _known(size == 1)


def _shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def identity(node: torch.fx.Node) -> Layout:
    """The layout of ``node`` relative to itself."""
    return Layout(tuple((Axis(d, s, 1),) if not _is_one(s) else () for d, s in enumerate(_shape(node))))


def _divides(a, b) -> bool:
    """``a`` divides ``b``, where the graph knows it without a guard: both numbers, or a
    number dividing a symbolic multiple of it (``2 * s`` tokens of two sequences viewed as
    ``[2, s]``: a batch of a dynamic length)."""
    if isinstance(a, int) and isinstance(b, int):
        return a != 0 and b % a == 0
    return isinstance(a, int) and a != 0 and _known(b % a == 0)


def _regroup(factors: list[Axis], sizes: tuple) -> tuple[tuple[Axis, ...], ...] | None:
    """``factors`` (row-major; size-1 ones dropped) grouped into dims of ``sizes``, or None. A
    factor of size ``a*b`` meeting a dim of size ``a`` gives that dim its outer ``a`` steps
    (stride ``b*stride``) and leaves the inner ``b`` steps to the dims after it: what a
    row-major reshape does. A split needs a number dividing the factor where the graph knows
    it (``_divides``); otherwise a symbolic factor must match whole."""
    factors = [f for f in factors if not _is_one(f.size)]
    out, i = [], 0
    for size in sizes:
        if _is_one(size):
            out.append(())
            continue
        group, need = [], size
        while not _is_one(need):
            if i >= len(factors):
                return None
            f = factors[i]
            if _known(f.size == need):
                group.append(f)
                i, need = i + 1, 1
            elif _divides(need, f.size):
                inner = f.size // need
                group.append(Axis(f.dim, need, f.stride * inner))  # the outer steps
                factors[i] = Axis(f.dim, inner, f.stride)  # the inner steps, for what follows
                need = 1
            elif _divides(f.size, need):
                group.append(f)
                i, need = i + 1, need // f.size
            else:
                return None
        out.append(tuple(group))
    return tuple(out) if i == len(factors) else None


def follow(layout: Layout, view: torch.fx.Node) -> Layout | None:
    """The layout of ``view`` given the layout of its input (``view.args[0]``), or None when
    ``view`` is no view op this understands (or one it cannot decide without a guard)."""
    t, args = view.target, view.args
    dims = list(layout.dims)
    ndim = len(dims)
    if t is aten.alias.default:
        return layout
    if t is aten.permute.default:
        order = [d % ndim for d in args[1]]
        return Layout(tuple(dims[d] for d in order))
    if t is aten.t.default:
        return Layout(tuple(reversed(dims)))
    if t is aten.transpose.int:
        a, b = args[1] % ndim, args[2] % ndim
        dims[a], dims[b] = dims[b], dims[a]
        return Layout(tuple(dims))
    if t is aten.unsqueeze.default:
        d = args[1] % (ndim + 1)
        return Layout(tuple(dims[:d] + [()] + dims[d:]))
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        drop = set(range(ndim)) if t is aten.squeeze.default else (
            {args[1] % ndim} if t is aten.squeeze.dim else {d % ndim for d in args[1]})
        kept = tuple(f for i, f in enumerate(dims) if not (i in drop and f == ()))
        return Layout(kept)
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        grouped = _regroup([f for group in dims for f in group], _shape(view))
        return None if grouped is None else Layout(grouped)
    return None


def apply_views(layout: Layout, chain: list[torch.fx.Node]) -> Layout | None:
    """``layout`` carried through ``chain`` (view ops, first to last)."""
    for view in chain:
        layout = follow(layout, view)
        if layout is None:
            return None
    return layout


def strip_views(node: torch.fx.Node, stop=None) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(the first non-view node up from ``node``, or the first for which ``stop(node)`` holds;
    the view ops from it down to ``node``)."""
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEW_OPS \
            and not (stop is not None and stop(node)):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def token_major_heads(layout: Layout, num_tokens, head_dim: int, token_dim: int = 0, width_dim: int = 1
                      ) -> int | None:
    """The head count H when ``layout`` shows a ``[num_tokens, W]`` base as token-major
    heads ``[tokens..., H, head_dim]``: every dim but the last two made of token factors (base
    dim ``token_dim``, outer first, all of it), then H heads of ``head_dim`` columns of
    ``width_dim``; else None."""
    dims = [d for d in layout.dims if d != ()]
    if len(dims) < 2:
        return None
    *tokens, heads, dim = dims
    if len(dim) != 1 or dim[0] != Axis(width_dim, head_dim, 1):
        return None
    if len(heads) != 1 or heads[0].dim != width_dim or not _known(heads[0].stride == head_dim):
        return None
    token_factors = [f for group in tokens for f in group]
    if not token_factors:  # one token: its size-1 dims hold no factor
        return heads[0].size if _is_one(num_tokens) else None
    if any(f.dim != token_dim for f in token_factors):
        return None
    strides = [f.stride for f in token_factors]
    if not _known(strides[-1] == 1) or any(not _known(a == b * f.size)
                                           for a, b, f in zip(strides, strides[1:], token_factors[1:])):
        return None
    if not _known(token_factors[0].size * token_factors[0].stride == num_tokens):
        return None  # a part of the tokens only
    return heads[0].size


def heads_major_as_token_major(layout: Layout) -> Layout | None:
    """``layout`` of heads-major rows ``[..., H, T, D]`` (a per-sequence cache's ``[Hkv, S, D]``
    slice, or ``[B, Hkv, S, D]`` of B sequences) with its heads dim moved behind the tokens
    dim: the token-major ``[..., T, H, D]`` layout ``token_major_heads`` reads (size-1 dims,
    one token or one sequence, hold no factor), or None if ``layout`` has fewer than three dims."""
    dims = list(layout.dims)
    if len(dims) < 3:
        return None
    heads = dims.pop(-3)
    dims.insert(len(dims) - 1, heads)
    return Layout(tuple(dims))


def canonical_order(layout: Layout) -> list[int] | None:
    """The permutation ``p`` with ``node = canonical.permute(p)``, ``canonical`` the node's dims
    sorted into base order (base dim, then outer before inner): how to rebuild ``node``'s
    layout from a token-major tensor of the same values; None if a dim mixes base dims."""
    keys = []
    for group in layout.dims:
        if group and len({f.dim for f in group}) > 1:
            return None
        keys.append(group[0].dim if group else -1)
    # within a base dim, a larger stride is outer
    order = sorted(range(len(layout.dims)), key=lambda i: (keys[i], -_static_stride(layout.dims[i])))
    return [order.index(i) for i in range(len(order))]


def _static_stride(group: tuple[Axis, ...]) -> int:
    if not group:
        return 0
    s = group[0].stride
    return s if isinstance(s, int) else 1 << 62
