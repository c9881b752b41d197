"""``matching/layouts.py``: which elements of a base a chain of view ops shows, read off real
traced graphs (``make_fx`` with fake tensors), including a view chain that reorders values
(which must not pass for token-major heads)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from prepfuse.fx_passes.matching.layouts import (
    Axis, apply_views, canonical_order, identity, strip_views, token_major_heads,
)

T, H, D = 7, 4, 64


def traced(fn):
    """(the projection node, the output node) of ``fn(x)`` on a ``[T, H*D]`` input."""
    gm = make_fx(fn, tracing_mode="fake")(torch.empty(T, H * D))
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    base, chain = strip_views(out)
    return base, chain, out


def layout_of(fn):
    base, chain, out = traced(fn)
    return apply_views(identity(base), chain)


def test_hf_transpose_is_heads_before_tokens():
    layout = layout_of(lambda x: x.view(1, T, H, D).transpose(1, 2))
    assert layout.dims == ((), (Axis(1, H, D),), (Axis(0, T, 1),), (Axis(1, D, 1),))
    assert token_major_heads(layout, T, D) is None  # heads before tokens: not rows of heads
    assert canonical_order(layout) == [0, 2, 1, 3]  # [1, T, H, D].permute(0, 2, 1, 3)


def test_transposed_back_and_flattened_is_token_major():
    layout = layout_of(lambda x: x.view(1, T, H, D).transpose(1, 2).transpose(1, 2).reshape(T, H, D))
    assert token_major_heads(layout, T, D) == H


def test_a_reshape_of_transposed_values_is_not_token_major():
    # the values of [H, T, D] read row-major as [T, H, D]: another tensor
    layout = layout_of(lambda x: x.view(T, H, D).transpose(0, 1).reshape(T, H, D))
    assert layout is None or token_major_heads(layout, T, D) is None


def test_a_batch_of_tokens_splits_the_token_dim():
    layout = layout_of(lambda x: x.view(7, 1, H, D))
    assert token_major_heads(layout, T, D) == H
    layout = layout_of(lambda x: x.view(T, H * D // 2, 2))  # pairs within a head: not heads of D
    assert token_major_heads(layout, T, D) is None


def test_one_token():
    gm = make_fx(lambda x: x.view(1, 1, H, D), tracing_mode="fake")(torch.empty(1, H * D))
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    base, chain = strip_views(out)
    assert token_major_heads(apply_views(identity(base), chain), 1, D) == H


def test_a_batch_of_dynamic_length_splits_a_symbolic_token_dim():
    """``2*s`` tokens regrouped as ``[2, s]`` (two sequences of a dynamic length, gpt-fast's
    batch under ``mark_dynamic``): known without a guard, the sequences the outer factor and
    back again; ``s`` tokens split by 3, which need not divide them, is no layout."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from prepfuse.fx_passes.matching.layouts import _regroup

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(7, source=ConstantSource("s")), hint=7)
    (outer,), (inner,) = _regroup([Axis(0, 2 * s, 1)], (2, s))
    assert outer == Axis(0, 2, s) and inner == Axis(0, s, 1)
    assert _regroup([outer, inner], (2 * s,)) == ((outer, inner),)  # merged back: the same two steps
    assert _regroup([Axis(0, s, 1)], (3, s)) is None
    assert not env.guards  # nothing decided at run time
