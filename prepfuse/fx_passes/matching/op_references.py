"""Engine ops the families read through a plain-PyTorch reference, put back where nothing fused.

An engine's own op (vLLM's ``vllm_ir::rms_norm``, lowered to its kernel only after the custom
passes) reaches the post-grad graph as one node: no family sees the norm inside it, and a
layer built from the engine's modules fuses nothing. An op with a reference is read as that
reference computes it:

- ``register_reference(op, fn)`` declares ``fn`` (plain PyTorch, the op's arguments in, its
  outputs out) for one op; ``register_reference_finder(namespace, find)`` declares ``find(op)
  -> fn | None`` for every op of a namespace (vLLM's IR ops: each op's native
  implementation, ``prepfuse.integrations.vllm``), so a new op of the engine needs nothing.
- ``inline(graph)`` replaces each call of such an op by its reference traced to aten under
  the graph's fake mode (Inductor's decompositions, symbolic sizes kept), the traced steps
  carrying the call's source line; the families then read it as any code.
- ``restore(graph, inlined)`` puts the call back for whatever still reads what its
  reference computed, and drops the traced steps nothing reads: where nothing fused, the
  graph is the engine's again, its op lowered as the engine lowers it.

A reference the tracer cannot run on the call's values leaves the call as it is, said once
per op in the log (``prepfuse.passes``); its families see an opaque step, as before.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import remove_dead

__all__ = ["register_reference", "register_reference_finder", "unregister_reference", "reference_of",
           "references", "Inlined", "inline", "restore"]

log = logging.getLogger("prepfuse.passes")

_REFERENCES: dict[torch._ops.OpOverload, Callable] = {}
_FINDERS: dict[str, Callable[[torch._ops.OpOverload], Callable | None]] = {}
_WARNED: set = set()


def register_reference(op: torch._ops.OpOverload, fn: Callable) -> None:
    """Read ``op`` as ``fn`` computes it (``fn(*args, **kwargs)`` with the op's arguments,
    returning what the op returns); a second registration replaces the first."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"op: expected an OpOverload (torch.ops.ns.name.overload), got {type(op).__name__}")
    if op._schema.is_mutable:
        raise ValueError(f"op: {op} writes an argument; a reference stands in for ops that return their results")
    _REFERENCES[op] = fn


def register_reference_finder(namespace: str, find: Callable[[torch._ops.OpOverload], Callable | None]) -> None:
    """Read every op of ``namespace`` that ``find(op)`` gives a reference for."""
    _FINDERS[namespace] = find


def unregister_reference(op_or_namespace) -> None:
    _REFERENCES.pop(op_or_namespace, None)
    _FINDERS.pop(op_or_namespace, None)


def references() -> tuple:
    """What the declarations are, for the uuid of the passes that read them: each op and
    namespace, by name and the reference's qualified name."""
    def named(fn) -> str:
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"

    return tuple(sorted([(str(op), named(fn)) for op, fn in _REFERENCES.items()]
                        + [(ns, named(find)) for ns, find in _FINDERS.items()]))


def reference_of(op) -> Callable | None:
    """``op``'s reference: registered for it, or found for its namespace; None for an op
    that writes an argument or has none."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if op in _REFERENCES:
        return _REFERENCES[op]
    find = _FINDERS.get(op.namespace)
    if find is None or op._schema.is_mutable:
        return None
    return find(op)


@dataclass
class Inlined:
    """One engine call read through its reference."""

    target: torch._ops.OpOverload  # the call, out of the graph until ``restore`` puts it back:
    args: tuple  # its op, arguments
    kwargs: dict
    meta: dict  # and meta (its value, source line)
    first: torch.fx.Node  # the first traced step: where the call goes back
    outputs: tuple  # the traced values standing for its outputs (one per output)
    tuple_output: bool  # whether the op returns several values (read through getitem)


def inline(graph: torch.fx.Graph) -> list[Inlined]:
    """Each call of an op with a reference replaced by the reference's steps."""
    done = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        fn = reference_of(node.target)
        if fn is None:
            continue
        traced = _traced(node, fn)
        if traced is not None:
            done.append(_splice(graph, node, traced))
    return done


def _traced(node: torch.fx.Node, fn: Callable) -> torch.fx.GraphModule | None:
    """``fn`` on ``node``'s argument values traced to aten: a graph of one placeholder per
    node argument (in ``node.all_input_nodes`` order), or None where it cannot be traced."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = node.all_input_nodes
    if not all(isinstance(i.meta.get("val"), (torch.Tensor, torch.SymInt, torch.SymFloat, int, float)) for i in inputs):
        return None

    def with_values(values):
        by_node = dict(zip(inputs, values))
        return torch.fx.node.map_arg((node.args, node.kwargs), lambda n: by_node[n])

    def run(*values):
        args, kwargs = with_values(values)
        return fn(*args, **kwargs)

    try:
        return make_fx(run, decomposition_table=select_decomp_table(), tracing_mode="symbolic")(
            *[i.meta["val"] for i in inputs])
    except Exception as err:  # noqa: BLE001 - a reference that cannot run here leaves the call opaque
        if node.target not in _WARNED:
            _WARNED.add(node.target)
            log.warning("prepfuse: the reference of %s could not be traced (%s: %s); the call stays opaque",
                        node.target, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None


def _splice(graph: torch.fx.Graph, node: torch.fx.Node, traced: torch.fx.GraphModule) -> Inlined:
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, node.all_input_nodes))
    trace = node.meta.get("stack_trace")
    with graph.inserting_before(node):
        out = graph.graph_copy(traced.graph, env)  # fills env with each traced node's copy
    new = [env[n] for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    for n in new:
        if trace:
            n.meta["stack_trace"] = trace
    several = isinstance(out, (tuple, list))
    outputs = tuple(out) if several else (out,)
    if several:
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs[0])
    first = new[0] if new else outputs[0]
    one = Inlined(node.target, node.args, dict(node.kwargs), dict(node.meta), first, outputs, several)
    if not node.users:
        graph.erase_node(node)
    return one


def restore(graph: torch.fx.Graph, inlined: list[Inlined]) -> int:
    """The engine call back wherever a value its reference computed is still read; the
    traced steps nothing reads removed. Returns how many calls went back."""
    back = 0
    for one in inlined:
        read = [o for o in one.outputs if _in(graph, o) and o.users]
        if read:
            _put_back(graph, one)
            back += 1
    remove_dead([o for one in inlined for o in one.outputs if _in(graph, o)])
    return back


def _in(graph: torch.fx.Graph, node) -> bool:
    """Whether ``node`` is a node still in ``graph`` (an erased node keeps its graph)."""
    return isinstance(node, torch.fx.Node) and node.graph is graph and not getattr(node, "_erased", False)


def _put_back(graph: torch.fx.Graph, one: Inlined) -> None:
    # where the call was (its arguments are computed before it, its readers after)
    anchor = one.first if _in(graph, one.first) else next(o for o in one.outputs if _in(graph, o))
    with graph.inserting_before(anchor):
        new = graph.call_function(one.target, one.args, one.kwargs)
    new.meta.update(one.meta)
    if one.tuple_output:
        for i, out in enumerate(one.outputs):
            if isinstance(out, torch.fx.Node) and out.users:
                with graph.inserting_after(new):
                    item = graph.call_function(operator.getitem, (new, i))
                item.meta.update(out.meta)
                out.replace_all_uses_with(item)
    else:
        one.outputs[0].replace_all_uses_with(new)
