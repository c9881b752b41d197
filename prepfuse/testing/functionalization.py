"""Functionalization checks for any mutating op: the metadata ``prepfuse.fx_passes.mutation_info``
derives from an op's schema against what torch really traces, auto_functionalized v1 and v2.

For each mutated argument the metadata names the ``auto_functionalized`` output that holds
its new value (v1) or its base's new value (v2), and the graph input it writes. Checked two
ways: in the graph aot_autograd traces (the named getitem feeds the graph output of that
input) and by value (running the graph, the named output equals what the eager op wrote).
An engine team points it at its own ops, with sample inputs::

    from prepfuse.testing.functionalization import check_functionalization

    @pytest.mark.parametrize("version", ["v1", "v2"])
    def test_my_op(version):
        check_functionalization(torch.ops.myns.my_op.default, sample_args(), version)
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx
from functorch.compile import aot_function, make_boxed_func

from prepfuse._compat import auto_functionalized_ops
from prepfuse.fx_passes.mutation_info import functionalized_op, mutated_args, mutated_inputs, num_leading_outputs, output_indices

__all__ = ["check_functionalization", "trace_functionalized"]

AF_V1, AF_V2 = auto_functionalized_ops()


# --------------------------------------------------------------------------------------
def clone_inputs(inputs: tuple) -> tuple:
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def trace_functionalized(fn: Callable, inputs: tuple, version: str) -> torch.fx.GraphModule:
    """aot_autograd's forward graph of ``fn`` with auto_functionalized ``version``."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    with torch._inductor.config.patch(enable_auto_functionalized_v2=version == "v2"):
        aot_function(fn, fw_compiler=capture)(*clone_inputs(inputs))
    (gm,) = graphs
    return gm


class Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.values[n] = super().run_node(n)
        return self.values[n]


def ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for inp in todo.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return seen


def root_placeholder(node: torch.fx.Node) -> torch.fx.Node:
    """The graph input a (chain of) view node(s) is taken from."""
    while node.op != "placeholder":
        node = node.args[0]
    return node


def getitem_of(node: torch.fx.Node, index: int) -> torch.fx.Node:
    found = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    assert len(found) == 1, f"expected one getitem [{index}] of {node.format_node()}, found {found}"
    return found[0]



def check_functionalization(fn: Callable, inputs: tuple, version: str) -> torch.fx.Node:
    """Trace ``fn`` (a mutating op, or a function calling one once) on ``inputs`` with
    auto_functionalized ``version`` ("v1" or "v2") and check the schema-derived metadata of
    its one ``auto_functionalized`` node against the graph and by value; returns the node.

    ``inputs`` must make the op write something (an input whose value changes eagerly)."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        op = fn
        fn = lambda *args: op(*args)  # noqa: E731
    eager = clone_inputs(inputs)
    fn(*eager)
    mutated_positions = [
        i for i, (before, after) in enumerate(zip(inputs, eager))
        if isinstance(before, torch.Tensor) and not torch.equal(before, after)
    ]
    assert mutated_positions, "the sample inputs must make the op write something"

    gm = trace_functionalized(fn, inputs, version)
    graph_inputs = clone_inputs(inputs)
    recorder = Recorder(gm)
    outputs = recorder.run(*graph_inputs)
    values = recorder.values
    for before, after in zip(inputs, graph_inputs):
        if isinstance(before, torch.Tensor):
            assert torch.equal(before, after), "the functional graph wrote into its inputs"

    # aot_autograd returns the new values of the mutated inputs first, in input order:
    # checked here, not assumed, since the structural checks below rely on it.
    for j, p in enumerate(mutated_positions):
        assert torch.equal(outputs[j], eager[p]), f"graph output {j} is not the new value of input {p}"

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output_nodes = list(gm.graph.output_node().args[0])
    af_nodes = [n for n in gm.graph.nodes if functionalized_op(n) is not None]
    assert len(af_nodes) == 1, gm.code
    (node,) = af_nodes
    assert node.target is (AF_V1 if version == "v1" else AF_V2), gm.code
    op = functionalized_op(node)
    indices, targets = output_indices(node), mutated_inputs(node)
    assert list(indices) == list(targets) == [a.name for a in mutated_args(op)]
    result = values[node]
    assert len(result) == num_leading_outputs(op) + (
        len(mutated_args(op)) if version == "v1" else len(node.kwargs["_all_bases"])
    )

    written = set()
    for arg in mutated_args(op):
        index, target = indices[arg.name], targets[arg.name]
        if target is None:  # an optional mutable argument passed None
            if version == "v1":
                assert node.kwargs[arg.name] is None and result[index] is None
            else:
                assert index is None and node.kwargs[f"_{arg.name}_base_index"] is None
            continue
        base = root_placeholder(target)
        if version == "v2":
            assert target.op == "placeholder", f"{arg.name}: v2 bases are graph values, not views"
        p = placeholders.index(base)
        assert p in mutated_positions, f"{arg.name}: names input {p}, which the op does not write"
        written.add(p)
        out_node = output_nodes[mutated_positions.index(p)]
        item = getitem_of(node, index)
        if target is base:
            assert item is out_node, f"{arg.name}: output [{index}] is not what input {p} becomes\n{gm.code}"
        else:  # v1, a view: its new value is scattered back into the base
            assert item in ancestors(out_node), f"{arg.name}: output [{index}] never reaches input {p}\n{gm.code}"
        # by value: the named output is the argument's (v1) or its base's (v2) new value
        before = values[target]
        expected = eager[p].as_strided(before.size(), before.stride(), before.storage_offset())
        assert torch.equal(result[index], expected), f"{arg.name}: output [{index}] holds another value"
    assert written == set(mutated_positions), "some written input is named by no argument"
    return node
