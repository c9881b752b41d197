"""The compiled DeepSeek-V4 example model captured whole in one ``torch.cuda.CUDAGraph``.

The engine's "full" capture: warm up on a side stream (the first run compiles and is the
profiling run that sizes the arena), freeze the arena, capture, then replay with fresh
inputs copied into the static ones before every replay. Checked on every replay:

- no allocation: the caching allocator's counters are the same before and after
  ``replay()``; and q_out is the arena's reservation, not a buffer of the capture's pool;
- q_out and the whole k_cache are byte-identical to the op called eagerly on the same
  inputs (the same Triton kernel, not captured): capture and arena change no byte;
- against the un-compiled model (eager CUDA PyTorch: another rsqrt, another summation
  order) byte identity is impossible for q; the differences over all replays together
  must be within the DeepSeek-V4 bound (docs/design.md) (``Dsv4Comparison.within_spec``: one bf16 ULP on
  a few q values per million, one e4m3 code on a few cache bytes per million).

A second test captures the two-layer attention block, whose q_out is consumed inside
the graph (both layers write one reservation), against the same compiled code run
without capture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.dsv4 import Q_SCRATCH_BASE
from prepfuse.models import dsv4 as model
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
from prepfuse.scratch import ScratchArena, use_arena
from prepfuse.testing import Q_POISON, Dsv4Comparison, compare_dsv4, make_dsv4_inputs, poisoned_like

pytestmark = pytest.mark.gpu

T, H, HP, BLOCK, EPS = 37, 16, 64, 16, 1e-6
REPLAYS = 1000
ALLOCATOR_COUNTERS = ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.allocated")


class Dsv4Prep(nn.Module):
    """One layer's attention-input preparation as the example model writes it: returns
    the padded q (the fused op's q_out), writes the kv cache."""

    def forward(self, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        spelling = DSV4_SPELLINGS[0]
        q_padded = model.dsv4_q_prep(q, positions, cos_sin_cache, EPS, HP, spelling)
        model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, spelling)
        return q_padded


def _warm_up_freeze_capture(compiled, args, arena: ScratchArena):
    """The engine's sequence; returns (graph, static output, bytes the capture allocated)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiles; the first run is the profiling run that sizes the arena
            compiled(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    arena.freeze()
    graph = torch.cuda.CUDAGraph()
    allocated = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        out = compiled(*args)
    return graph, out, torch.cuda.memory_allocated() - allocated


def _replay_allocating_nothing(graph) -> None:
    before = torch.cuda.memory_stats()
    graph.replay()
    after = torch.cuda.memory_stats()
    assert {k: after[k] for k in ALLOCATOR_COUNTERS} == {k: before[k] for k in ALLOCATOR_COUNTERS}


def _total(comparisons: list[Dsv4Comparison]) -> Dsv4Comparison:
    """One comparison for all replays: counts summed, maxima kept."""
    fields = {f.name: [getattr(c, f.name) for c in comparisons] for f in dataclasses.fields(Dsv4Comparison)}
    return Dsv4Comparison(**{name: (max(v) if "max" in name else sum(v)) for name, v in fields.items()})


def test_full_capture_of_the_prep_replays_like_eager():
    gen = torch.Generator().manual_seed(2024)
    static = make_dsv4_inputs(T, H, HP, BLOCK, "cuda", generator=gen, skip_fraction=0.0)
    module = Dsv4Prep()
    compiled = torch.compile(module, backend=PrepfuseBackend({"strict": True}), fullgraph=True)
    args = (static.q, static.kv, static.k_cache, static.slot_mapping, static.positions, static.cos_sin_cache)
    with use_arena(ScratchArena()) as arena:
        graph, q_out, captured_bytes = _warm_up_freeze_capture(compiled, args, arena)
        (reservation,) = arena.reservations()
        assert reservation.name == f"{Q_SCRATCH_BASE}.0"
        assert q_out.data_ptr() == reservation.storage.data_ptr()
        assert captured_bytes < q_out.nbytes  # the capture's pool holds no q_out

        op_cache = static.k_cache.clone()  # the op called eagerly, replay after replay
        vs_model = []
        for i in range(REPLAYS):
            fresh = make_dsv4_inputs(T, H, HP, BLOCK, "cuda", generator=gen, skip_fraction=0.0)
            for name in ("q", "kv", "slot_mapping", "positions"):
                getattr(static, name).copy_(getattr(fresh, name))
            model_cache = static.k_cache.clone()
            _replay_allocating_nothing(graph)

            op_q = poisoned_like(q_out, value=Q_POISON)
            DSV4_QNORM_ROPE_KV_INSERT(fresh.q, fresh.kv, op_q, op_cache, fresh.slot_mapping, fresh.positions,
                                      fresh.cos_sin_cache, EPS, BLOCK)
            assert torch.equal(q_out, op_q), f"replay {i}: q_out differs from the eager op"
            assert torch.equal(static.k_cache, op_cache), f"replay {i}: k_cache differs from the eager op"

            model_q = module(fresh.q, fresh.kv, model_cache, fresh.slot_mapping, fresh.positions, fresh.cos_sin_cache)
            vs_model.append(compare_dsv4(dataclasses.replace(fresh, q_out=model_q, k_cache=model_cache),
                                         dataclasses.replace(fresh, q_out=q_out, k_cache=static.k_cache)))
    total = _total(vs_model)
    assert total.within_spec(), total


def test_full_capture_of_the_attention_block_replays_like_uncaptured():
    """Two layers, q_out consumed inside the graph (layer 2 writes the buffer layer 1's
    attention has read): one reservation, and every replay equals the same compiled
    code run without capture, byte for byte."""
    block = Dsv4AttentionBlock(num_layers=2, num_heads=H, padded_heads=HP, block_size=BLOCK).cuda()
    compiled = torch.compile(block, backend=PrepfuseBackend({"strict": True}), fullgraph=True)
    gen = torch.Generator().manual_seed(7)

    def fresh_inputs():
        inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cuda", generator=gen, skip_fraction=0.0)
        x = torch.randn(T, 64, generator=gen).to(torch.bfloat16).cuda()
        return x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache

    static = fresh_inputs()
    caches = [fp8_ds_mla_cache(8, BLOCK, device="cuda") for _ in range(2)]
    with use_arena(ScratchArena()) as arena:
        graph, out, _ = _warm_up_freeze_capture(compiled, (*static, caches), arena)
        assert [r.name for r in arena.reservations()] == [f"{Q_SCRATCH_BASE}.0"]
        ref_caches = [c.clone() for c in caches]
        for i in range(REPLAYS // 10):
            fresh = fresh_inputs()
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            _replay_allocating_nothing(graph)
            ref = compiled(*fresh, ref_caches)
            assert torch.equal(out, ref), f"replay {i}: output differs from the uncaptured run"
            for cache, ref_cache in zip(caches, ref_caches):
                assert torch.equal(cache, ref_cache), f"replay {i}: a cache differs from the uncaptured run"
