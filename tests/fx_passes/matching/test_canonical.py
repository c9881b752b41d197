"""``matching/canonical.py``: one form per concept, on real traced graphs (``make_fx``), each
rewrite checked to compute the same values as the graph before it."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from prepfuse.fx_passes.matching.canonical import canonicalize, merge_repeated_steps

aten = torch.ops.aten


def traced(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def functional(fn, *inputs):
    """The functional graph of ``fn`` (writes as ``index_put`` / ``scatter`` and a copy back,
    as AOT autograd hands Inductor's passes)."""
    return make_fx(torch.func.functionalize(fn, remove="mutations"), tracing_mode="fake")(*inputs)


def count(graph, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in graph.nodes)


def outputs(graph):
    return next(n for n in graph.nodes if n.op == "output").args[0]


def run_both(fn, *inputs):
    """``fn`` eagerly, and its canonicalized traced graph on the same inputs."""
    gm = functional(fn, *(torch.empty_like(t) for t in inputs))
    canonicalize(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return fn(*(t.clone() for t in inputs)), gm(*(t.clone() for t in inputs)), gm.graph


def test_vllm_cos_cast_per_tensor_becomes_one_node():
    # vLLM's _apply_rotary_emb_torch casts cos once for q and again for k
    def rope_inputs(cos):
        return cos.unsqueeze(-2).to(torch.bfloat16) * 2, cos.unsqueeze(-2).to(torch.bfloat16) * 3

    graph = traced(rope_inputs, torch.empty(7, 32)).graph
    q_cos, k_cos = (o.args[0] for o in outputs(graph))
    assert q_cos is not k_cos
    assert merge_repeated_steps(graph) == 2  # the unsqueeze and the cast
    q_cos, k_cos = (o.args[0] for o in outputs(graph))
    assert q_cos is k_cos and count(graph, aten.unsqueeze.default) == 1
    graph.lint()


def test_different_arguments_and_random_steps_are_kept():
    graph = traced(lambda x: (x[..., 0::2] * 1, x[..., 1::2] * 1), torch.empty(7, 64)).graph
    assert merge_repeated_steps(graph) == 0
    graph = traced(lambda x: (x + torch.rand_like(x), x + torch.rand_like(x)), torch.empty(7, 64)).graph
    merge_repeated_steps(graph)
    assert count(graph, aten.add.Tensor) == 2  # each reads its own random values


def test_nothing_is_merged_past_a_mutation():
    def write_between(x, y):
        before = x.view(-1) * 1
        x.copy_(y)
        return before, x.view(-1) * 1

    graph = traced(write_between, torch.empty(7, 64), torch.empty(7, 64)).graph
    assert merge_repeated_steps(graph) == 0 and count(graph, aten.view.default) == 2


def test_one_square():
    x = torch.randn(7, 64)
    want, got, graph = run_both(lambda x: (x.pow(2).mean(-1), x.square().sum(-1)), x)
    assert count(graph, aten.pow.Tensor_Scalar) == 0 and count(graph, aten.square.default) == 0
    assert all(torch.equal(a, b) for a, b in zip(want, got))  # the same product, the same bits


def test_index_copy_and_a_scatter_of_whole_rows_are_index_puts():
    rows, slots = torch.randn(5, 2, 8), torch.tensor([3, 0, 7, 1, 9])

    def writes(a, b, rows, slots):
        a.index_copy_(0, slots, rows)
        b.scatter_(0, slots[:, None, None].expand(5, 2, 8), rows)
        return a * 1, b * 1

    want, got, graph = run_both(writes, torch.zeros(10, 2, 8), torch.zeros(10, 2, 8), rows, slots)
    assert count(graph, aten.index_copy.default) == 0 and count(graph, aten.scatter.src) == 0
    assert count(graph, aten.index_put.default) == 2
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_scatter_of_partial_rows_is_left_alone():
    def partial(a, rows, index):
        return a.scatter(0, index, rows)  # each element its own row: no index_put form

    index = torch.randint(0, 10, (5, 2, 8))
    graph = functional(partial, torch.zeros(10, 2, 8), torch.randn(5, 2, 8), index).graph
    canonicalize(graph)
    assert count(graph, aten.scatter.src) == 1


def test_a_write_through_a_bitcast_view_is_a_write_of_the_cache():
    """TensorRT-LLM's and TGI's ``cache.view(torch.int16)[slots] = k.view(torch.int16)``."""
    def bitcast_write(cache, k, slots):
        cache.view(torch.int16)[slots] = k.view(torch.int16)
        return cache * 1

    cache, k, slots = torch.zeros(10, 2, 8, dtype=torch.bfloat16), torch.randn(3, 2, 8).bfloat16(), torch.tensor([4, 1, 8])
    want, got, graph = run_both(bitcast_write, cache, k, slots)
    puts = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.index_put.default]
    assert [p.meta["val"].dtype for p in puts] == [torch.bfloat16]  # into the bf16 cache itself
    assert torch.equal(want, got)


def test_a_reshaped_bitcast_write_is_a_write_of_the_cache():
    """TGI's fp8 store: ``cache.view(torch.uint8).view(-1, H, D)[slots] = k.view(torch.uint8)``."""
    def store(cache, k, slots):
        shape = cache.shape
        cache.view(torch.uint8).view(-1, shape[-2], shape[-1])[slots] = k.view(torch.uint8)
        return cache.float() * 1

    cache = torch.zeros(2, 4, 2, 8).to(torch.float8_e4m3fn)
    k, slots = torch.randn(3, 2, 8).to(torch.float8_e4m3fn), torch.tensor([5, 0, 7])
    want, got, graph = run_both(store, cache, k, slots)
    puts = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.index_put.default]
    assert [p.meta["val"].dtype for p in puts] == [torch.float8_e4m3fn]
    assert torch.equal(want, got)


def rotate_views_in_place(x, w, cos, sin):
    """TGI's in-place rotation: ``flash_apply_rotary`` on views of q and of k inside the
    projection, then q and k read back from it."""
    qkv = x @ w
    q = qkv[:, :16].view(-1, 2, 8)
    kv = qkv[:, 16:].view(-1, 2, 1, 8)
    for rotated in (q, torch.select(kv, 1, 0)):
        x1, x2 = rotated[..., :4], rotated[..., 4:]
        o1 = (x1.float() * cos - x2.float() * sin).to(rotated.dtype)
        o2 = (x1.float() * sin + x2.float() * cos).to(rotated.dtype)
        x1.copy_(o1)
        x2.copy_(o2)
    return q * 1, kv[:, 0] * 1, kv[:, 1] * 1


def test_reads_of_views_rotated_in_place_are_the_rotated_values():
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(8, 32).bfloat16()
    cos, sin = torch.rand(3, 1, 4), torch.rand(3, 1, 4)
    want, got, graph = run_both(rotate_views_in_place, x, w, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert count(graph, aten.slice_scatter.default) == count(graph, aten.select_scatter.default) == 0
    assert count(graph, aten.cat.default) == 2  # each rotated tensor is its two halves


def test_a_read_of_part_of_a_scatter_stays():
    """A read that takes some scattered and some earlier values has no simpler form."""
    def half_overwritten(x, y):
        x = x * 2
        x[:, :4] = y
        return x[:, 2:6] * 1

    x, y = torch.randn(3, 8), torch.randn(3, 4)
    want, got, graph = run_both(half_overwritten, x, y)
    assert torch.equal(want, got)
    assert count(graph, aten.slice_scatter.default) == 1


def test_an_unbind_item_is_a_select():
    def write(kv_cache, rows, slots):
        k_cache, v_cache = kv_cache.unbind(0)
        k_cache[slots] = rows
        v_cache[slots] = rows * 2

    inputs = (torch.randn(2, 8, 3, 4), torch.randn(5, 3, 4), torch.tensor([1, 6, 0, 3, 7]))
    want, got, graph = run_both(write, *inputs)
    assert count(graph, aten.unbind.int) == 0 and count(graph, aten.select.int) >= 2
    assert got is None and want is None


def _written_buffer(write, *inputs):
    """The buffer (first input) ``write`` leaves, eagerly and by its canonicalized graph."""
    eager, canonical = [t.clone() for t in inputs], [t.clone() for t in inputs]
    write(*eager)
    gm = functional(write, *(torch.empty_like(t) for t in inputs))
    counts = canonicalize(gm.graph)
    gm.graph.lint()
    gm.recompile()
    gm(*canonical)
    return eager[0], canonical[0], counts, gm.graph


def test_a_row_of_k_and_v_heads_is_two_writes_of_the_same_bytes():
    def write(pool, k, v, slots):  # k heads then v heads, one row per token
        pool[1][slots] = torch.cat((k, v), dim=1)

    inputs = (torch.randn(2, 16, 6, 4), torch.randn(5, 2, 4), torch.randn(5, 4, 4), torch.tensor([3, 9, 0, 15, 3]))
    want, got, counts, graph = _written_buffer(write, *inputs)
    assert counts["written pieces"] == 1 and count(graph, aten.cat.default) == 0
    assert count(graph, aten.index_put.default) == 2
    assert torch.equal(got, want)  # a repeated slot keeps the last token's row in both


def test_rows_whose_heads_were_overwritten_in_place_are_written_piece_by_piece():
    def write(pool, kv, k, slots):  # lightllm: kv rows, their k heads replaced, the whole row written
        kv = kv.clone()
        kv[:, :2] = k
        pool[slots] = kv

    inputs = (torch.randn(16, 6, 4), torch.randn(5, 6, 4), torch.randn(5, 2, 4), torch.tensor([3, 9, 0, 15, 7]))
    want, got, counts, graph = _written_buffer(write, *inputs)
    assert counts["written pieces"] == 1 and count(graph, aten.index_put.default) == 2
    assert torch.equal(got, want)


def test_a_cat_of_a_rows_values_stays_one_write():
    def write(cache, a, b, slots):  # RoPE's halves: the row's own values, not parts of the buffer
        cache[slots] = torch.cat((a, b), dim=-1)

    inputs = (torch.randn(16, 2, 8), torch.randn(5, 2, 4), torch.randn(5, 2, 4), torch.tensor([3, 9, 0, 15, 7]))
    want, got, counts, graph = _written_buffer(write, *inputs)
    assert counts["written pieces"] == 0 and count(graph, aten.index_put.default) == 1
    assert torch.equal(got, want)


def test_a_packed_slice_write_with_k_overwritten_in_place_is_a_write_per_part():
    def write(cache, kv, k):  # flash-attention: [B, S, 2, Hkv, D], k rows replaced, one slice written
        kv = kv.clone()
        kv[:, :, 0] = k
        cache[0:2, 3:8, ...] = kv

    inputs = (torch.randn(3, 16, 2, 2, 4), torch.randn(2, 5, 2, 2, 4), torch.randn(2, 5, 2, 4))
    want, got, counts, graph = _written_buffer(write, *inputs)
    assert counts["written pieces"] == 1 and count(graph, aten.select_scatter.default) == 2
    writes = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.slice_scatter.default
              and n.args[0].target is aten.select.int]
    assert [w.args[2:] for w in writes] == [(1, 3, 8)] * 2  # k into [:, :, 0], v into [:, :, 1], each by slice
    assert torch.equal(got, want)


def test_a_stack_of_k_and_v_is_a_write_per_index():
    def write(cache, k, v, slots):
        cache[slots] = torch.stack((k, v), dim=1)

    inputs = (torch.randn(16, 2, 3, 4), torch.randn(5, 3, 4), torch.randn(5, 3, 4), torch.tensor([3, 9, 0, 15, 3]))
    want, got, counts, graph = _written_buffer(write, *inputs)
    assert counts["written pieces"] == 1 and count(graph, aten.stack.default) == 0
    assert count(graph, aten.index_put.default) == 2
    assert torch.equal(got, want)
