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
from prepfuse.fx_passes.matching.nodes import CONVERTS, VIEW_OPS, WRITE_VIEWS, NoMatch, aten, graph_order, prims, val, where

__all__ = ["PREP_STEPS", "is_leaf", "backward", "leaves", "depends_on", "operands", "constants", "is_scale",
           "is_runtime_float", "is_eps_input", "eps_inputs", "inductor_moves_floats", "expect_no_runtime_floats"]

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


def is_runtime_float(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a 0-d float graph input: a Python float (an eps, an fp8 range, a
    RoPE scaling) that ``dynamic=True`` made an input (Dynamo's ``specialize_float`` off),
    or a one-value tensor the model passes."""
    v = val(node)
    return node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype.is_floating_point


_MEANS = (aten.mean.dim, aten.mean.default, aten.sum.dim_IntList, aten.div.Tensor, aten.div.Scalar)


def is_eps_input(node: torch.fx.Node) -> bool:
    """Whether run-time float ``node`` is an RMSNorm's eps: added (through casts) to a mean
    of squares (a mean, or a sum divided), the step a reciprocal square root reads."""
    if not is_runtime_float(node):
        return False
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        if user.target in CONVERTS:
            frontier += list(user.users)
        elif user.target is aten.add.Tensor and len(user.args) == 2:
            other = user.args[1] if user.args[0] is not node and _through_casts(user.args[0]) is node \
                else user.args[0] if _through_casts(user.args[1]) is node else None
            other = _through_casts(other)
            if isinstance(other, torch.fx.Node) and other.target in _MEANS:
                return True
    return False


def _through_casts(node):
    while isinstance(node, torch.fx.Node) and node.target in CONVERTS:
        node = node.args[0]
    return node


def eps_inputs(region: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The run-time floats ``region`` reads as an RMSNorm's eps (``is_eps_input``), in graph
    order: a fused call takes each as its eps operand, read on the host when the op runs
    (the ops' ``tensor_floats`` overload). None where Inductor captures CUDA graphs
    (``inductor_moves_floats``)."""
    if inductor_moves_floats(region):
        return []
    return [n for n in leaves(region) if is_eps_input(n)]


def inductor_moves_floats(region: list[torch.fx.Node]) -> bool:
    """Whether Inductor's CUDA graphs (``mode="reduce-overhead"``) hold ``region``'s device:
    its graph partition then copies the 0-d CPU inputs to the device, and a call reading
    one on the host would sync inside the capture."""
    if not torch._inductor.config.triton.cudagraphs:
        return False
    return any(isinstance(val(n), torch.Tensor) and val(n).device.type == "cuda" for n in region)


def _read_as_a_number(node: torch.fx.Node, members: set, sources: set, memo: dict) -> bool:
    """Whether a step of the region computed from ``sources`` reads ``node`` as a number: a
    value of one element made from it by steps that are not (a cast, ``1 / x``), as
    ``amax * (1 / FP8_MAX)`` reads it. A tensor of many values made from it (``cos *
    attention_scaling``) is an operand the call reads where the graph computes it."""
    frontier, seen = [node], set()
    while frontier:
        made = frontier.pop()
        for user in made.users:
            if user not in members or user in seen:
                continue
            seen.add(user)
            if not depends_on(user, sources, memo):
                frontier.append(user)
            elif _one_value(made):
                return True
    return False


def _one_value(node: torch.fx.Node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) and s == 1 for s in v.shape)


def expect_no_runtime_floats(region: list[torch.fx.Node], sources: set, scales=(), numbers=()) -> None:
    """Decline where a step of ``region`` that the call replaces (one computed from
    ``sources``) reads a run-time float (``is_runtime_float``) other than the call's
    ``scales`` (or what one is computed from, ``scale.reciprocal()`` of a 0-d input) and
    ``numbers``, the inputs the call takes as its float operands (an eps, by ``eps_inputs``).
    Any other (an fp8 range, a factor on q) the op would need as a number it holds fixed,
    which only the run knows. A float that only operands read (a RoPE scaling of cos/sin)
    stays the graph's: the call reads the operand where the graph computes it."""
    allowed = {n for s in scales if s is not None for n in (s, *leaves(backward([s])))} | set(numbers)
    members, memo = set(region), {}
    for n in leaves(region):
        if n not in allowed and is_runtime_float(n) and _read_as_a_number(n, members, sources, memo):
            reader, frontier = n, list(n.users)
            while frontier and not reader.meta.get("stack_trace"):  # the first reader with a source line
                reader = frontier.pop(0)
                frontier += list(reader.users)[:2]
            why = "under Inductor's CUDA graphs it is copied to the device, where the op cannot read it " \
                "without a sync" if is_eps_input(n) and inductor_moves_floats(region) else "the op holds that number fixed"
            v = val(n)
            lifted = v.dtype == torch.float64 and v.device.type == "cpu"  # how Dynamo passes a Python float
            what = ("a 0-d tensor the graph reads at run time (dynamic=True makes a Python float a graph input "
                    "unless torch._dynamo.config.specialize_float is set)" if lifted else
                    f"a one-value {v.dtype} tensor the code passes, read when the graph runs")
            raise NoMatch(f"a value at {where(reader)} is {what}; {why}")
