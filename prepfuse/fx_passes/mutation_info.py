"""Which outputs of an ``auto_functionalized`` node carry which mutated argument.

Functionalization wraps a mutating op ``op(..., Tensor(a!) x, ...)`` in a higher-order
op that returns ``(*returns or (None,), *new values)``:

- ``auto_functionalized`` (v1): the new values follow the mutated arguments in schema
  order, so output ``n_ret + k`` is the new value of the k-th mutated argument;
- ``auto_functionalized_v2``: the node takes ``_all_bases`` (the distinct base tensors of
  the mutated arguments) and each argument's ``_<name>_base_index``; output
  ``n_ret + i`` is the new value of base ``i``, which two arguments may share.

A pass that turns these nodes back into in-place calls needs that mapping for every op
it meets. It is read here from the schema's alias annotations (``alias_info.is_write``)
and the node's own kwargs, never from a hand-written per-op table: a table is what
missed a new fused op in production ("auto_functionalized was not removed").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse._compat import auto_functionalized_ops, functionalization_special_tags


@dataclass(frozen=True)
class MutatedArg:
    """One argument an op writes: its schema position, name and alias set ('a', 'b' ...)."""

    position: int
    name: str
    alias_set: str


def mutated_args(op: torch._ops.OpOverload) -> tuple[MutatedArg, ...]:
    """The arguments ``op`` writes, in schema order, from the alias annotations.

    Ops tagged ``out`` or ``inplace`` are functionalized differently (always v2, and
    for ``out`` ops without the bases after the returns); prepfuse's ops carry neither
    tag, and this module refuses them rather than give wrong indices.
    """
    tags = set(getattr(op, "tags", ()))
    if tags & functionalization_special_tags():
        raise NotImplementedError(f"{op}: ops tagged out/inplace are functionalized differently; not supported")
    found = []
    for position, arg in enumerate(op._schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            found.append(MutatedArg(position, arg.name, ",".join(sorted(info.before_set))))
    return tuple(found)


def num_leading_outputs(op: torch._ops.OpOverload) -> int:
    """How many outputs precede the new values: the op's returns, or one ``None``."""
    return max(len(op._schema.returns), 1)


def v1_output_indices(op: torch._ops.OpOverload) -> dict[str, int]:
    """For an ``auto_functionalized`` (v1) node of ``op``: mutated arg name -> output index."""
    lead = num_leading_outputs(op)
    return {arg.name: lead + k for k, arg in enumerate(mutated_args(op))}


def v2_output_indices(op: torch._ops.OpOverload, kwargs: dict) -> dict[str, int | None]:
    """For an ``auto_functionalized_v2`` node: mutated arg name -> output index of its base.

    ``kwargs`` are the node's kwargs; an argument passed as ``None`` (optional tensors)
    has no base and maps to ``None``.
    """
    lead = num_leading_outputs(op)
    result: dict[str, int | None] = {}
    for arg in mutated_args(op):
        base_index = kwargs.get(f"_{arg.name}_base_index")
        result[arg.name] = None if base_index is None else lead + base_index
    return result


def functionalized_op(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The wrapped op if ``node`` is an auto_functionalized (v1 or v2) call, else None."""
    if node.op != "call_function":
        return None
    v1, v2 = auto_functionalized_ops()
    if node.target is v1 or (v2 is not None and node.target is v2):
        return node.args[0]
    return None


def output_indices(node: torch.fx.Node) -> dict[str, int | None]:
    """Mutated arg name -> index of the node output holding its new value (or its base's)."""
    v1, _ = auto_functionalized_ops()
    op = functionalized_op(node)
    if op is None:
        raise ValueError(f"{node.format_node()} is not an auto_functionalized call")
    return v1_output_indices(op) if node.target is v1 else v2_output_indices(op, node.kwargs)


def mutated_inputs(node: torch.fx.Node) -> dict[str, torch.fx.Node | None]:
    """Mutated arg name -> the graph value the in-place op would write into.

    For v1 that is the argument itself; for v2 it is the argument's base in
    ``_all_bases`` (the argument may be a view regenerated from it).
    """
    v1, _ = auto_functionalized_ops()
    op = functionalized_op(node)
    if op is None:
        raise ValueError(f"{node.format_node()} is not an auto_functionalized call")
    if node.target is v1:
        return {arg.name: node.kwargs[arg.name] for arg in mutated_args(op)}
    bases = node.kwargs["_all_bases"]
    return {
        arg.name: None if node.kwargs.get(f"_{arg.name}_base_index") is None else bases[node.kwargs[f"_{arg.name}_base_index"]]
        for arg in mutated_args(op)
    }
