"""Regions: what a family replaces, sliced back from what it writes to where it starts.

A region is every node between its outputs (the cache after a write, the prepared q that
attention reads) and its *leaves*: graph inputs, constants, and the results of steps no
fused op does (a matmul, attention, an op of another library). A projection's output is
a leaf, so a region never reaches into the model beyond its own layer's preparation.

Inside a region a family tells two kinds of value apart by what they depend on:

- the *source*: the projection columns the op reads, and everything computed from them;
- *operands*: values that do not depend on the source but are mixed into it (a norm
  weight, ``1 + w``, cos/sin however they are made, a scale, an eps): the fused call reads
  them where the graph computes them, so what made them (a rotary module's ``inv_freq``
  times positions, a table gathered by positions, a complex ``polar``) is left to Inductor.

``backward`` slices, ``leaves`` lists what a slice reads, ``operands`` finds the operands
of a source inside a region.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from prepfuse.fx_passes.matching.axes import ELEMENTWISE, _REDUCTIONS, _TAIL_STEPS
from prepfuse.fx_passes.matching.nodes import VIEW_OPS, WRITE_VIEWS, NoMatch, aten, graph_order, prims, val, where

__all__ = ["PREP_STEPS", "is_leaf", "backward", "leaves", "depends_on", "operands", "constants", "is_scale",
           "expect_no_runtime_floats"]

# steps a region may hold: elementwise math, per-head steps, views, gathers, writes, creation
PREP_STEPS = frozenset({
    *ELEMENTWISE, *_REDUCTIONS, *_TAIL_STEPS, *VIEW_OPS, *WRITE_VIEWS, operator.getitem, aten.index.Tensor,
    aten.index_put.default, aten.slice_scatter.default, aten.select_scatter.default,
    aten.as_strided_scatter.default, aten.copy.default, aten.expand.default, aten.embedding.default,
    prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.bucketize.Tensor, aten.sym_size.int,
})


def is_leaf(node: torch.fx.Node) -> bool:
    """Where a region stops: an input, a constant, a step no prep op does, or one output of
    such a step (an earlier fused call's, attention's)."""
    if node.op != "call_function" or node.target not in PREP_STEPS:
        return True
    return node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and is_leaf(node.args[0])


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    found = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def backward(outputs, cut=frozenset(), limit: int | None = None, keep=frozenset()) -> list[torch.fx.Node]:
    """The region's nodes: ``outputs`` and what they read, back to the leaves (and to the
    ``cut`` nodes, which count as leaves; ``keep`` nodes never do), in graph order.
    ``limit``: stop counting past it."""
    seen, stack = set(), [o for o in outputs if isinstance(o, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or node in cut or (is_leaf(node) and node not in keep):
            continue
        seen.add(node)
        if limit is not None and len(seen) > limit:
            break
        stack += _inputs(node)
    return _ordered(seen)


def leaves(nodes) -> list[torch.fx.Node]:
    """What ``nodes`` read that is not among them, in graph order."""
    members = set(nodes)
    return _ordered({i for n in nodes for i in _inputs(n) if i not in members})


def _ordered(nodes) -> list[torch.fx.Node]:
    nodes = list(nodes)
    if not nodes:
        return nodes
    order = graph_order(nodes[0].graph)
    return sorted(nodes, key=order.__getitem__)


def depends_on(node, sources, memo: dict) -> bool:
    """``node`` reads one of ``sources`` (a set), through prep steps."""
    if node in memo:
        return memo[node]
    stack = [node]
    while stack:  # iterative: regions can be thousands of nodes deep
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        if n in sources:
            memo[n] = True
            stack.pop()
            continue
        if is_leaf(n):
            memo[n] = False
            stack.pop()
            continue
        pending = [i for i in _inputs(n) if i not in memo]
        if pending:
            stack += pending
            continue
        memo[n] = any(memo[i] for i in _inputs(n))
        stack.pop()
    return memo[node]


def operands(region: list[torch.fx.Node], sources: set, memo: dict) -> list[torch.fx.Node]:
    """The nodes of ``region`` (or its leaves) that do not depend on ``sources`` and are read
    by a node that does: what a fused call must be given besides the source."""
    found = set()
    for node in region:
        if node in sources or not depends_on(node, sources, memo):
            continue
        for i in _inputs(node):
            if not depends_on(i, sources, memo):
                found.add(i)
    return _ordered(found)


def constants(region: list[torch.fx.Node], sources: set, memo: dict) -> list[float]:
    """The float constants the source's own steps use (an eps, a scale's bound), in order."""
    seen = []
    for node in region:
        if node in sources or not depends_on(node, sources, memo):
            continue
        for a in (*node.args, *node.kwargs.values()):
            if isinstance(a, float) and a not in seen:
                seen.append(a)
    return seen


def is_scale(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one float value a tensor holds: a per-tensor scale operand."""
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.numel() == 1 and v.dim() <= 1


def expect_no_runtime_floats(region: list[torch.fx.Node], scales=()) -> None:
    """Decline where ``region`` reads a one-value float graph input other than the call's
    ``scales`` (or what one is computed from, ``scale.reciprocal()`` of a 0-d input): a
    Python float (eps, an fp8 range, a RoPE scaling) that ``dynamic=True`` made an input
    (Dynamo's ``specialize_float`` off). The op would need it as a number, which only the
    run knows; a probe value for it says nothing about the run's."""
    allowed = {n for s in scales if s is not None for n in (s, *leaves(backward([s])))}
    for n in leaves(region):
        v = val(n)
        if n.op == "placeholder" and n not in allowed and isinstance(v, torch.Tensor) and v.dim() == 0 \
                and v.dtype.is_floating_point:
            reader, frontier = n, list(n.users)
            while frontier and not reader.meta.get("stack_trace"):  # the first reader with a source line
                reader = frontier.pop(0)
                frontier += list(reader.users)[:2]
            raise NoMatch(f"a value at {where(reader)} is a 0-d tensor the graph reads at run time (dynamic=True "
                          "makes a Python float a graph input unless torch._dynamo.config.specialize_float is set); "
                          "the op takes it as a number")
