"""An engine write's fused call in its by-layer form (``matching/engine_writes.py``).

The GQA family fuses a lifted engine write as any cache write: its call writes the
probe-only cache inputs at the probe-only slots. ``settle`` turns that call into the
engine's ``by_layer_op`` (the key in place of the caches and slots, so the call finds them
when it runs) and lets the engine call's readers read its return; a lifted write nothing
fused is reported and its probe form removed, the engine call untouched.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch.fx

from prepfuse.fx_passes.matching.engine_writes import Lifted
from prepfuse.fx_passes.matching.nodes import val
from prepfuse.fx_passes.mutation_info import functionalized_op, output_indices
from prepfuse.fx_passes.rewrite.emitter import Emitter
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT

__all__ = ["settle"]


def settle(graph: torch.fx.Graph, lifted: list[Lifted], declined: Callable[[Lifted], None]) -> int:
    """Each fused call writing a lifted cache put in its by-layer form, the engine call
    replaced by it; every other lifted call reported through ``declined`` and its probe form
    removed. Returns how many engine calls went."""
    done = 0
    for one in lifted:
        calls = {u for i in one.inputs[:2] for u in i.users if _is_gqa_call(u)}
        if len(calls) == 1:
            _by_layer(graph, one, calls.pop())
            done += 1
        else:
            declined(one)
        for n in dict.fromkeys((*reversed(one.writes), *(u for w in one.writes for u in w.args[1]), *one.inputs)):
            if n.graph is graph and not n.users:
                graph.erase_node(n)
    return done


def _is_gqa_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a GQA op call, either overload (floats as numbers or tensors)."""
    op = functionalized_op(node)
    return op is not None and op.overloadpacket is GQA_QKNORM_ROPE_KV_INSERT.overloadpacket


def _by_layer(graph, one: Lifted, call: torch.fx.Node) -> None:
    """``call`` (the GQA op on the lifted caches and slots) as ``by_layer_op`` on the engine
    call's key, at ``call``'s place, reading negative slots as the engine does
    (``EngineWrite.negative_slots``); the engine call's readers read its return."""
    op = one.engine.by_layer_op
    args = _plain_args(call)
    args = {a.name: args[a.name] for a in op._schema.arguments if a.name in args}
    # the probe form's slots are index assignment's; the engine's own semantics goes in
    args.update(layer_name=one.engine.arg(one.node, one.engine.layer), engine=one.engine.name,
                wrap_indices=one.engine.negative_slots == "wrap")
    emit = Emitter(graph, call, source=call)
    outs = emit.functional_call(op, args)
    index = output_indices(call)
    for user in list(call.users):
        if user.target is operator.getitem and user.args[1] == index["q_out"]:
            user.replace_all_uses_with(outs["q_out"])
    with graph.inserting_after(outs["q_out"]):
        done = graph.call_function(operator.getitem, (outs["q_out"].args[0], 0))
    done.meta["val"] = val(one.node)
    one.node.replace_all_uses_with(done)
    for node in [*call.users, call, one.node]:
        if not node.users:
            graph.erase_node(node)


def _plain_args(call: torch.fx.Node) -> dict:
    """The op's arguments of an ``auto_functionalized`` call (v1, or v2 with each written
    argument its own base, as ``Emitter.functional_call`` makes them)."""
    kwargs = dict(call.kwargs)
    if "_all_bases" not in kwargs:
        return kwargs
    bases = kwargs.pop("_all_bases")
    plain = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    for k, v in kwargs.items():
        if k.endswith("_base_index") and v is not None:
            plain[k[1:-len("_base_index")]] = bases[v]
    return plain
