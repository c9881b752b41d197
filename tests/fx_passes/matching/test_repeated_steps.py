"""``matching/repeated_steps.py``: copies of one pure computation become one node, on real
traced graphs (``make_fx``); a step that is not pure, or one past a mutation, is kept."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from prepfuse.fx_passes.matching.recognizers import same_value
from prepfuse.fx_passes.matching.repeated_steps import merge_repeated_steps

aten = torch.ops.aten


def graph_of(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.empty(s) for s in shapes)).graph


def count(graph, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in graph.nodes)


def outputs(graph):
    return next(n for n in graph.nodes if n.op == "output").args[0]


def test_vllm_cos_cast_per_tensor_becomes_one_node():
    # vLLM's _apply_rotary_emb_torch casts cos once for q and again for k
    def rope_inputs(cos):
        return cos.unsqueeze(-2).to(torch.bfloat16) * 2, cos.unsqueeze(-2).to(torch.bfloat16) * 3

    graph = graph_of(rope_inputs, (7, 32))
    q_cos, k_cos = (o.args[0] for o in outputs(graph))
    assert q_cos is not k_cos and same_value(q_cos, k_cos)
    assert merge_repeated_steps(graph) == 2  # the unsqueeze and the cast
    q_cos, k_cos = (o.args[0] for o in outputs(graph))
    assert q_cos is k_cos
    assert count(graph, aten.unsqueeze.default) == 1
    graph.lint()


def test_different_arguments_are_kept():
    graph = graph_of(lambda x: (x[..., 0::2] * 1, x[..., 1::2] * 1), (7, 64))
    assert merge_repeated_steps(graph) == 0
    evens, odds = (o.args[0] for o in outputs(graph))
    assert not same_value(evens, odds)


def test_random_steps_are_kept():
    graph = graph_of(lambda x: (x + torch.rand_like(x), x + torch.rand_like(x)), (7, 64))
    merge_repeated_steps(graph)
    assert count(graph, aten.add.Tensor) == 2  # each reads its own random values


def test_nothing_is_merged_past_a_mutation():
    # a view read before and after the input is written holds two values
    def write_between(x, y):
        before = x.view(-1) * 1
        x.copy_(y)
        after = x.view(-1) * 1
        return before, after

    graph = graph_of(write_between, (7, 64), (7, 64))
    assert merge_repeated_steps(graph) == 0
    assert count(graph, aten.view.default) == 2
