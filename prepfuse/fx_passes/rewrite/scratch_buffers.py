"""Output buffers taken from the scratch arena: the one call every pass makes.

A pass that rewrites into an out-variant op needs the output buffer somewhere. A graph
``aten.empty`` would be allocated on every call, after the engine sized its KV cache
from the memory left (docs/design.md, lesson 2); ``scratch_buffer`` gives an arena view
instead (a ``prepfuse::scratch`` node), whose memory the profiling run reserved.

Sharing within a graph. The fused calls of a whole-model graph (one per layer) should
share one buffer, as Inductor's pooling of ``aten.empty`` did, or a 61-layer graph would
reserve 61 padded qs. Two scratch nodes that return the same bytes would hide that
aliasing from Inductor, which could then schedule one call's write before the other's
reads. So a later call does not take a second view: its ``q_out`` *is* the value the
previous call wrote (``af[q_out]``), which the op overwrites whole; Inductor then sees
one buffer written twice and its scheduler orders the reads of the first contents
before the second write. But only reads it *schedules* there: a pointwise reader (a cast,
a scale) may be inlined into a later kernel, which then reads the buffer after the
second write (seen on torch 2.13: ``tests/fx_passes/rewrite/test_scratch_buffers.py``,
``cast_then_together``). So a call chains onto the previous contents only when every
path of readers from them (views, pointwise ops, anything Inductor may inline) ends,
before the new call, in a node that Inductor runs as an extern call or matmul and that
realizes its inputs there (the attention op; an einsum's bmm behind its permute and
clone: what reads a padded q), and the graph does not return them. Otherwise the call
gets a new name, ``<base>.<k>`` with the first free k. So ``<base>.0`` is the first chain of every
graph: graphs compiled separately (a piecewise engine's layers) share its bytes, and a
whole-model graph usually needs only it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from prepfuse._compat import inductor_reads_inputs_when_it_runs
from prepfuse.fx_passes.mutation_info import functionalized_op, mutated_inputs, output_indices
from prepfuse.ops import SCRATCH
from prepfuse.ops.scratch import ensure_inductor_lowering

__all__ = ["scratch_buffer", "emit_scratch", "scratch_name", "scratch_nodes", "scratch_to_pool_buffers",
           "returned_scratch"]

aten = torch.ops.aten
# ops that read only a tensor's metadata, never its bytes
_METADATA_ONLY = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default)


def scratch_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The ``prepfuse::scratch`` nodes of ``graph``, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is SCRATCH]


def scratch_name(graph: torch.fx.Graph, base: str) -> str:
    """``base.<k>``, with k the first index no scratch node of ``graph`` uses yet."""
    if not isinstance(base, str) or not base:
        raise ValueError(f"base: expected a non-empty string, got {base!r}")
    used = {n.args[0] for n in scratch_nodes(graph)}
    k = 0
    while f"{base}.{k}" in used:
        k += 1
    return f"{base}.{k}"


def scratch_buffer(graph: torch.fx.Graph, before: torch.fx.Node, base: str, sizes: list, dtype: torch.dtype,
                   device: torch.device, *, node_name: str | None = None) -> torch.fx.Node:
    """An arena-backed output buffer for an op call to be inserted before ``before``.

    For an argument the op writes (an alias annotation ``Tensor(a!)``) whole, without
    reading what was there: the result is either the latest contents of one of this
    graph's ``base`` buffers, when every read of them is done before ``before`` (see the
    module docstring), or a new ``emit_scratch`` node.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in scratch_nodes(graph):
        if node.args[0].rsplit(".", 1)[0] != base:
            continue
        latest = _latest_contents(node)
        if _fits(latest, sizes, dtype) and _read_only_before(latest, order[before], order):
            return latest
    return emit_scratch(graph, before, base, sizes, dtype, device, node_name=node_name)


def emit_scratch(graph: torch.fx.Graph, before: torch.fx.Node, base: str, sizes: list, dtype: torch.dtype,
                 device: torch.device, *, node_name: str | None = None) -> torch.fx.Node:
    """Insert ``prepfuse::scratch(base.<k>, sizes, dtype, device)`` before ``before``.

    ``sizes`` holds ints and, for dynamic sizes, nodes producing SymInts (``sym_size``).
    The node gets its fake value (later passes read ``meta['val']``) and, if given, the
    name ``node_name`` (kept for debug dumps and reports).
    """
    ensure_inductor_lowering()  # Inductor must never reuse the view's buffer
    name = scratch_name(graph, base)
    args = (name, list(sizes), dtype, torch.device(device))
    with graph.inserting_before(before):
        node = graph.call_function(SCRATCH, args)
    if node_name is not None:
        node._rename(node_name)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    if fake_mode is None:
        raise RuntimeError("emit_scratch: the graph's placeholders carry no fake values (not a post-grad graph?)")
    fake_args = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = SCRATCH(*fake_args)
    return node


def _latest_contents(value: torch.fx.Node) -> torch.fx.Node:
    """Follow ``value`` through the functionalized calls that write it (``af[arg]``)."""
    while True:
        written = None
        for user in value.users:
            if functionalized_op(user) is None:
                continue
            indices = output_indices(user)
            for name, target in mutated_inputs(user).items():
                if target is value and indices.get(name) is not None:
                    getitems = (g for g in user.users if g.target is operator.getitem and g.args[1] == indices[name])
                    written = next(getitems, None)
        if written is None:
            return value
        value = written


def _fits(value: torch.fx.Node, sizes: list, dtype: torch.dtype) -> bool:
    """Whether ``value`` is a contiguous ``sizes`` ``dtype`` tensor (sizes may be sym_size nodes)."""
    t = value.meta.get("val")
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or not t.is_contiguous() or t.dim() != len(sizes):
        return False
    wanted = [s.meta["val"] if isinstance(s, torch.fx.Node) else s for s in sizes]
    return all(statically_known_true(sym_eq(have, want)) for have, want in zip(t.shape, wanted))


def _read_only_before(value: torch.fx.Node, limit: int, order: dict) -> bool:
    """Whether every read of ``value`` happens before graph position ``limit``: each path
    of its users (views, pointwise ops ... whose reads Inductor may defer into a later
    kernel) reaches, before ``limit``, a node that reads its inputs when it runs; and no
    path reaches the graph's output."""
    stack, seen = [value], {value}
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or order[user] >= limit:
                return False
            if user.target in _METADATA_ONLY or user in seen:
                continue
            seen.add(user)
            if not _reads_when_it_runs(user):
                stack.append(user)
    return True


def _reads_when_it_runs(node: torch.fx.Node) -> bool:
    """An extern call that realizes its inputs (its output is a fresh buffer)."""
    if functionalized_op(node) is not None:  # a prepfuse call: an extern kernel
        return True
    return isinstance(node.target, torch._ops.OpOverload) and inductor_reads_inputs_when_it_runs(node.target)


def scratch_to_pool_buffers(graph: torch.fx.Graph) -> int:
    """Replace every ``prepfuse::scratch`` view by a graph buffer (``aten.empty``); return how many.

    For ``cudagraphs="piecewise"``: Inductor's cudagraph trees own the memory of every
    buffer a captured partition produces, in the tree's private pool, and refuse a
    partition output (the padded q handed to the eager attention op, or returned) that
    lives elsewhere: "storage data ptrs are not allocated in pool" (seen on an H200 with
    torch 2.11). Under the trees the pool plays the arena's part: allocated once at
    capture, the same addresses on every replay, no allocation per call. Sizes are the
    scratch node's own (ints or SymInt nodes).
    """
    replaced = 0
    for node in scratch_nodes(graph):
        _, sizes, dtype, device = node.args
        with graph.inserting_before(node):
            empty = graph.call_function(
                aten.empty.memory_format, (list(sizes),), {"dtype": dtype, "device": device, "pin_memory": False}
            )
        empty.meta.update(node.meta)
        node.replace_all_uses_with(empty)
        graph.erase_node(node)
        replaced += 1
    return replaced


def returned_scratch(graph: torch.fx.Graph) -> list[str]:
    """The scratch names whose bytes ``graph`` returns: a view of the buffer (or the buffer
    as a call wrote it) reaches the output. Such a returned tensor is overwritten by the next
    run of any graph that takes the same name, which a caller keeping it does not expect."""
    names = []
    for node in scratch_nodes(graph):
        stack, seen = [node], {node}
        while stack:
            current = stack.pop()
            if any(user.op == "output" for user in current.users):
                names.append(node.args[0])
                break
            following = [u for u in current.users if _aliases_input(u)] + [_latest_contents(current)]
            for user in following:
                if user not in seen:
                    seen.add(user)
                    stack.append(user)
    return names


def _aliases_input(node: torch.fx.Node) -> bool:
    """A view of its first input (its schema's return shares that input's alias set) or an
    in-place write that returns it (``Tensor(a!)``)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns or not target._schema.arguments:
        return False
    returned, first = target._schema.returns[0].alias_info, target._schema.arguments[0].alias_info
    return returned is not None and first is not None and bool(set(returned.before_set) & set(first.before_set))
