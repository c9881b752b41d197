"""``emitter.hoist_before``: the inputs of a fused call that come after the first reader of its
outputs (Inductor's post-grad ``reorder_for_locality`` moves a producer next to its first
user) are moved in front of that reader with everything they need, in their order, unless
one needs a reader or has an effect. The corpus case ``hf-qwen3-paged-attention-cache``
(transformers' ``PagedAttentionCache.update``: k written, v written, k read back) is the
graph that needs it (``tests/corpus/test_transformers.py``)."""

from __future__ import annotations

import operator

import torch
import torch.fx

from prepfuse.fx_passes.rewrite.emitter import hoist_before


def graph_of(fn):
    return torch.fx.symbolic_trace(fn).graph


def names(graph):
    return [n.name for n in graph.nodes]


def test_a_late_input_and_what_it_reads_move_in_front_of_the_reader():
    def fn(x, w):
        out = x * 2           # an output of the call
        reader = out + 1      # its first reader
        a = w - 3             # the late input needs a, which is late too
        late = a * w
        return reader, late

    graph = graph_of(fn)
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert hoist_before(nodes["add"], [nodes["mul_1"]], order, {nodes["add"]})
    assert names(graph) == ["x", "w", "mul", "sub", "mul_1", "add", "output"]
    graph.lint()


def test_an_input_that_needs_a_reader_moves_nothing():
    def fn(x, w):
        out = x * 2
        reader = out + 1
        late = reader * w     # needs the reader: no order of the graph puts it before the call
        return late

    graph = graph_of(fn)
    before = names(graph)
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert not hoist_before(nodes["add"], [nodes["mul_1"]], order, {nodes["add"]})
    assert names(graph) == before


def test_an_effectful_node_is_not_moved():
    def fn(x, w):
        out = x * 2
        reader = out + 1
        w.add_(1)             # a mutation the late input reads after
        late = operator.mul(w, 3)
        return reader, late

    graph = graph_of(fn)
    before = names(graph)
    nodes = {n.name: n for n in graph.nodes}
    late = next(n for n in graph.nodes if n.op == "call_function" and n.target is operator.mul and n.args[1] == 3)
    # the late input reads w after its in-place add: that add is effectful, so nothing moves
    late.args = (nodes["add_"], 3)
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert not hoist_before(nodes["add"], [late], order, {nodes["add"]})
    assert names(graph) == before
