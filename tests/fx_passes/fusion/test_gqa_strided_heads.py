"""Heads a projection lays out strided apart: GPT-NeoX's per-head ``[q | k | v]``
(``view(T, H, 3 * D).chunk(3, -1)``) and Megatron's per-group ``[q heads | k | v]``
(``view(T, G, (Hq / G + 2) * D).split(..)``). No op call reads such heads in place; the pass
reads a contiguous copy of each part (the three-source op), every cache byte and q as eager
gives them. Where nothing fuses, the copies go again: the graph is the model's.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from tests.fx_passes.fusion.test_gqa_shared_buffers import BLOCK, BLOCKS, D, HKV, HQ, T, prepared

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

GROUP = HQ // HKV


def per_head(qkv):
    """GPT-NeoX: each head's q, k and v side by side (so one head count for all three)."""
    q, k, v = qkv.view(T, HKV, 3 * D).chunk(3, dim=-1)
    return q, k, v


def per_group(qkv):
    """Megatron: each kv group's q heads, then its k, then its v."""
    q, k, v = qkv.view(T, HKV, (GROUP + 2) * D).split([GROUP * D, D, D], dim=-1)
    return q.reshape(T, HQ, D), k, v


def write(layout, qkv, w, table, positions, slots, k_cache, v_cache):
    q, k, v = prepared(*layout(qkv), *w, table, positions)
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v
    return q


def unrotated(layout, qkv, w, table, positions, slots, k_cache, v_cache):
    """k written before its RoPE: math the op does not compute."""
    q, k, v = layout(qkv)
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v
    return prepared(q, k, v, *w, table, positions)[0]


LAYOUTS = {"gpt-neox-per-head": (per_head, HKV), "megatron-per-group": (per_group, HQ)}


def inputs(num_q_heads, seed=3):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (num_q_heads + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    weights = tuple((1 + 0.3 * torch.randn(D, generator=gen)).to(torch.bfloat16) for _ in range(2))
    table = 2 * torch.rand(64, D, generator=gen) - 1
    positions, slots = torch.arange(T) + 3, torch.tensor([5, 9, 17, 2, 30, 11])
    caches = [torch.randn(BLOCKS, BLOCK, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    return qkv, weights, table, positions, slots, caches


def compiled_beside_eager(fn, layout, num_q_heads, **options):
    qkv, weights, table, positions, slots, caches = inputs(num_q_heads)
    eager, compiled = [c.clone() for c in caches], [c.clone() for c in caches]
    want = fn(layout, qkv, weights, table, positions, slots, *eager)
    backend = PrepfuseBackend(options)
    got = torch.compile(fn, backend=backend, fullgraph=True)(layout, qkv, weights, table, positions, slots, *compiled)
    return backend.reports, (got, compiled), (want, eager)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_strided_heads_fuse_reading_a_copy(name):
    layout, num_q_heads = LAYOUTS[name]
    reports, (got, written), (want, eager) = compiled_beside_eager(write, layout, num_q_heads)
    assert reports.pattern_counts().get("gqa_qknorm_rope_kv+separate") == 1, reports.format(verbose=True)
    assert torch.equal(got, want)
    assert all(torch.equal(c, e) for c, e in zip(written, eager))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nothing_fused_leaves_no_copy(name):
    layout, num_q_heads = LAYOUTS[name]
    reports, (got, written), (want, eager) = compiled_beside_eager(unrotated, layout, num_q_heads,
                                                                   record_graphs=True)
    assert not reports.pattern_counts(), reports.format(verbose=True)
    torch._dynamo.reset()  # the same canonical graph, without the GQA pass
    unpassed, _, _ = compiled_beside_eager(unrotated, layout, num_q_heads, record_graphs=True,
                                           passes=("fuse_dsv4_prep", "defunctionalize"))
    assert [r.graph for r in reports] == [r.graph for r in unpassed]
    assert all(torch.equal(c, e) for c, e in zip(written, eager))
