"""GQA preparation whose k/v write is an engine's own op (``matching/engine_writes.py``).

A toy engine stands for vLLM: its op ``prepfuse_toy_engine::write_kv(key, value, layer)``
finds the layer's caches and the step's slots in dicts by the layer's name and writes the
rows there, returning an empty tensor (vLLM's ``unified_kv_cache_update`` does the same
through its forward context). Declared, the write fuses into
``prepfuse::gqa_qknorm_rope_kv_insert_by_layer``, which finds the same caches at run time;
undeclared, or declared with a cache the op cannot write, the graph stays as it was and the
report names the engine op.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from torch._inductor.utils import fresh_inductor_cache

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.matching.engine_writes import (
    CacheLayout, EngineWrite, register_engine_write, unregister_engine_write,
)
from prepfuse.models.gqa import GqaSpelling, cos_sin, make_norms, rope, split_qkv
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER
from prepfuse.ops.engine_caches import EngineCaches
from prepfuse.testing.golden import GoldenFiles

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
GOLDEN = GoldenFiles.beside(__file__)

T, HQ, HKV, D, BLOCKS, BLOCK, EPS = 7, 4, 2, 64, 4, 16, 1e-6
SPELLING = GqaSpelling("toy-engine", rope="halves")  # vLLM's forward_native RoPE: the op's bits
Q_NORM, K_NORM = make_norms(D, EPS, SPELLING, torch.Generator().manual_seed(0))

# the engine's state: each layer's (k_cache, v_cache) and this step's slots (its forward context)
CACHES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
SLOTS: dict[str, torch.Tensor] = {}

_LIB = torch.library.Library("prepfuse_toy_engine", "DEF")  # lives as long as the test module


def _write_kv(key, value, layer, negative_slots: str):
    k_cache, v_cache = CACHES[layer]
    slots = SLOTS.get(layer)
    if slots is not None:  # the engine's own write: the first len(slots) rows
        n, bs = slots.shape[0], k_cache.shape[1]
        rows = torch.arange(n, device=slots.device) if negative_slots == "wrap" else (slots >= 0).nonzero().flatten()
        k_cache[slots[rows] // bs, slots[rows] % bs] = key[rows].to(k_cache.dtype)
        v_cache[slots[rows] // bs, slots[rows] % bs] = value[rows].to(v_cache.dtype)
    return key.new_empty(0)


# write_kv skips a negative slot, as vLLM's write does its padding slot -1; write_kv_indexed
# writes by index assignment, a negative slot counting from the cache's end
for _name, _negative in (("write_kv", "skip"), ("write_kv_indexed", "wrap")):
    _LIB.define(f"{_name}(Tensor key, Tensor value, str layer) -> Tensor")
    _LIB.impl(_name, lambda key, value, layer, negative=_negative: _write_kv(key, value, layer, negative),
              "CompositeExplicitAutograd")
    torch.library.register_fake(f"prepfuse_toy_engine::{_name}", lambda key, value, layer: key.new_empty(0), lib=_LIB)
WRITE_KV = torch.ops.prepfuse_toy_engine.write_kv.default
WRITE_KV_INDEXED = torch.ops.prepfuse_toy_engine.write_kv_indexed.default


def _resolve(layer) -> EngineCaches | None:
    if layer not in SLOTS:
        return None
    return EngineCaches(*CACHES[layer], SLOTS[layer])


def toy_engine(layout=lambda node: CacheLayout(torch.bfloat16), write=WRITE_KV) -> EngineWrite:
    return EngineWrite(write, key="key", value="value", layer="layer", layout=layout, resolve=_resolve,
                       negative_slots="wrap" if write is WRITE_KV_INDEXED else "skip")


@pytest.fixture
def declared(request):
    """The toy engine declared for one test (``layout`` from the test's parameter, if any)."""
    register_engine_write(toy_engine(*getattr(request, "param", ())))
    yield
    unregister_engine_write(WRITE_KV)


def attention_prep(qkv, table, positions, layer: str, write=WRITE_KV):
    """One attention's prep in plain PyTorch, its k and v handed to the engine: (q, the engine's dummy)."""
    q, k, v = split_qkv(qkv, HQ, HKV, D, SPELLING)
    q, k = Q_NORM(q), K_NORM(k)
    cos, sin = cos_sin(table, positions)
    q, k = rope(q, cos, sin, SPELLING), rope(k, cos, sin, SPELLING)
    return q, write(k, v, layer)


def two_layers(qkv0, qkv1, table, positions, write=WRITE_KV):
    q0, dep0 = attention_prep(qkv0, table, positions, "layers.0", write)
    q1, dep1 = attention_prep(qkv1, table, positions, "layers.1", write)
    return q0, q1, dep0, dep1


def unrotated(qkv, _, table, positions):
    """k and v handed over as projected: no k a GQA call writes (nothing rotates)."""
    q, k, v = split_qkv(qkv, HQ, HKV, D, SPELLING)
    q = rope(Q_NORM(q), *cos_sin(table, positions), SPELLING)
    return q, WRITE_KV(k, v, "layers.0")


def inputs(seed: int, slots_of: dict):
    """(two layers' qkv, table, positions) and each layer's ``[2, NB, BS, Hkv, D]`` cache."""
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    table = 2 * torch.rand(64, D, generator=gen) - 1
    positions = torch.randperm(60, generator=gen)[:T]
    caches = {layer: torch.randn(2, BLOCKS, BLOCK, HKV, D, generator=gen).to(torch.bfloat16) for layer in slots_of}
    return (*qkv, table, positions), caches


def engine_state(caches: dict, slots_of: dict) -> None:
    """The engine's state for one step: each layer's caches (``[2, ...]`` buffers unbound
    into k and v) and its slots (None: the engine writes nothing this step)."""
    CACHES.clear()
    SLOTS.clear()
    CACHES.update({layer: tuple(c.unbind(0)) for layer, c in caches.items()})
    SLOTS.update({layer: s for layer, s in slots_of.items() if s is not None})


def run_both(fn, slots_of: dict, passes=("fuse_gqa_prep", "defunctionalize"), fused: bool = True,
             device: str = "cpu"):
    """``fn`` compiled (prepfuse's backend, ``passes``) and, on the same inputs, eager
    (``fused``) or compiled by plain Inductor (not fused: the graph must be the one Inductor
    compiles anyway), each writing its own copy of the caches: (compiled out, reference
    out, report, compiled caches, reference caches)."""
    args, caches = inputs(3, slots_of)
    args = tuple(a.to(device) for a in args)
    slots_of = {layer: s if s is None else s.to(device) for layer, s in slots_of.items()}
    compiled_caches = {layer: c.to(device, copy=True) for layer, c in caches.items()}
    eager_caches = {layer: c.to(device, copy=True) for layer, c in caches.items()}
    backend = PrepfuseBackend({"passes": passes, "record_graphs": True})
    engine_state(compiled_caches, slots_of)
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    engine_state(eager_caches, slots_of)
    ref = fn(*args) if fused else torch.compile(fn, backend="inductor", fullgraph=True)(*args)
    (report,) = backend.reports
    return out, ref, report, compiled_caches, eager_caches


def assert_same(out, ref, compiled_caches, eager_caches) -> None:
    """q and every cache byte as the reference's: eager's where fused (the op's math is the
    spelling's: fp32 RoPE, one rounding), Inductor's own where not."""
    for got, want in zip(out, ref):
        assert torch.equal(got, want)
    for layer in eager_caches:  # every byte of each layer's buffer, rows not written included
        assert torch.equal(compiled_caches[layer], eager_caches[layer]), layer


SLOTS_7 = torch.tensor([5, 9, 17, 2, 30, 11, 40])


@pytest.mark.usefixtures("declared")
def test_a_declared_engine_write_fuses_into_the_by_layer_call():
    slots_of = {"layers.0": SLOTS_7, "layers.1": torch.tensor([3, 12, 63, 8, 20, 1, 33])}
    out, ref, report, got, want = run_both(two_layers, slots_of)
    assert_same(out, ref, got, want)
    assert report.matched_counts["fuse_gqa_prep"] == 2
    assert report.pattern_counts()["gqa_qknorm_rope_kv"] == 2
    assert report.near_misses("fuse_gqa_prep") == []
    # the engine op gone, each call keyed by its layer, no cache or slots in the graph
    GOLDEN.check(report.graph, "two_layers_by_layer")
    assert report.graph.count(f"{GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER}(") == 2
    assert f"{WRITE_KV}(" not in report.graph


@pytest.mark.usefixtures("declared")
@pytest.mark.parametrize("slots", [torch.tensor([5, 9, 17]), None], ids=["fewer-slots-than-tokens", "no-slots"])
def test_the_call_reads_the_steps_slots_when_it_runs(slots):
    """One compiled graph, the engine's slots of this step: T' < T rows inserted, or none
    (vLLM's profiling run has no slot mapping) with q still written."""
    out, ref, report, got, want = run_both(two_layers, {"layers.0": slots, "layers.1": slots})
    assert_same(out, ref, got, want)
    assert report.matched_counts["fuse_gqa_prep"] == 2


@pytest.mark.parametrize("write", [WRITE_KV, WRITE_KV_INDEXED], ids=["skips", "indexes"])
def test_a_padded_slot_is_read_as_the_engine_reads_it(write):
    """A batch padded to its CUDA graph's size with slot -1 (vLLM's ``PAD_SLOT_ID``): where
    the engine's write skips it, the fused calls leave every layer's last slot as it was;
    where the engine indexes, they write it as its index assignment does. Either way every
    cache byte is eager's."""
    slots = torch.tensor([5, 9, 17, 2, -1, -1, -1])
    register_engine_write(toy_engine(write=write))
    try:
        out, ref, report, got, want = run_both(lambda *args: two_layers(*args, write), {"layers.0": slots,
                                                                                        "layers.1": slots})
    finally:
        unregister_engine_write(write)
    assert report.matched_counts["fuse_gqa_prep"] == 2
    assert_same(out, ref, got, want)
    before = inputs(3, {"layers.0": slots, "layers.1": slots})[1]
    for layer, cache in got.items():  # k and v at the last block's last row
        untouched = torch.equal(cache[:, -1, -1], before[layer][:, -1, -1])
        assert untouched == (write is WRITE_KV), layer


@pytest.mark.gpu
@pytest.mark.parametrize("write", [WRITE_KV, WRITE_KV_INDEXED], ids=["skips", "indexes"])
def test_a_padded_slot_is_read_as_the_engine_reads_it_on_cuda(write):
    """The padded batch on CUDA, the by-layer call running the Triton kernel: the last slot
    as it was where the engine skips -1 and written where it indexes; every other byte of
    the caches eager's, the written rows within one bf16 rounding of it."""
    slots = torch.tensor([5, 9, 17, 2, -1, -1, -1])
    register_engine_write(toy_engine(write=write))
    try:
        out, ref, report, got, want = run_both(lambda *args: two_layers(*args, write), {"layers.0": slots,
                                                                                        "layers.1": slots},
                                               device="cuda")
    finally:
        unregister_engine_write(write)
    assert report.matched_counts["fuse_gqa_prep"] == 2
    before = inputs(3, {"layers.0": slots, "layers.1": slots})[1]
    for layer, cache in got.items():
        cache, eager = cache.cpu(), want[layer].cpu()
        torch.testing.assert_close(cache.float(), eager.float(), atol=2**-6, rtol=2**-7)
        untouched = torch.equal(cache[:, -1, -1], before[layer][:, -1, -1])
        assert untouched == (write is WRITE_KV), layer
    for got_q, want_q in zip(out[:2], ref[:2]):
        torch.testing.assert_close(got_q.float(), want_q.float(), atol=2**-6, rtol=2**-7)


def test_a_warm_cache_never_serves_a_call_compiled_for_another_layout():
    """The engine's layout read from its config, and its ``layout_key`` naming what it read:
    with Inductor's FX graph cache on, a compile for a bf16 cache fuses, and after the config
    moves to an fp16 cache the same code is keyed apart, compiled again and left to the
    engine, whose own write fills the fp16 cache (a served bf16 call would raise on it)."""
    config = {"dtype": torch.bfloat16}
    register_engine_write(dataclasses.replace(toy_engine(layout=lambda node: CacheLayout(config["dtype"])),
                                              layout_key=lambda: config["dtype"]))
    slots_of = {"layers.0": SLOTS_7, "layers.1": SLOTS_7}
    reports = []
    try:
        with torch._inductor.config.patch(fx_graph_cache=True), fresh_inductor_cache():
            for dtype in (torch.bfloat16, torch.float16):
                config["dtype"] = dtype
                torch._dynamo.reset()
                args, caches = inputs(3, slots_of)
                compiled_caches = {layer: c.to(dtype) for layer, c in caches.items()}
                eager_caches = {layer: c.to(dtype) for layer, c in caches.items()}
                backend = PrepfuseBackend({"passes": ("fuse_gqa_prep", "defunctionalize")})
                engine_state(compiled_caches, slots_of)
                out = torch.compile(two_layers, backend=backend, fullgraph=True)(*args)
                engine_state(eager_caches, slots_of)  # fused: eager's bytes; not: plain Inductor's
                reference = two_layers if dtype == torch.bfloat16 else torch.compile(two_layers, fullgraph=True)
                assert_same(out, reference(*args), compiled_caches, eager_caches)
                reports += backend.reports
    finally:
        unregister_engine_write(WRITE_KV)
    bf16, fp16 = reports
    assert bf16.matched_counts["fuse_gqa_prep"] == 2
    assert not fp16.cached and fp16.matched_counts["fuse_gqa_prep"] == 0
    assert all("its cache is torch.float16" in miss.why for miss in fp16.near_misses("fuse_gqa_prep"))


@pytest.mark.usefixtures("declared")
def test_an_engine_write_whose_return_nothing_reads_is_kept_and_fuses():
    """A layer handing k and v to the engine and returning only q: the engine call's dummy
    has no reader, yet the call stays (declared, it is a write), fuses, and the cache is
    written as eager writes it."""
    def q_only(qkv0, qkv1, table, positions):
        return two_layers(qkv0, qkv1, table, positions)[:2]

    out, ref, report, got, want = run_both(q_only, {"layers.0": SLOTS_7, "layers.1": SLOTS_7})
    assert report.matched_counts["fuse_gqa_prep"] == 2
    assert_same(out, ref, got, want)
    before = inputs(3, {"layers.0": SLOTS_7, "layers.1": SLOTS_7})[1]
    assert all(not torch.equal(got[layer], before[layer]) for layer in got)


def test_an_undeclared_engine_op_is_left_alone():
    out, ref, report, got, want = run_both(two_layers, {"layers.0": SLOTS_7, "layers.1": SLOTS_7}, fused=False)
    assert_same(out, ref, got, want)
    assert report.matched_counts["fuse_gqa_prep"] == 0 and report.near_misses("fuse_gqa_prep") == []
    assert report.graph.count(f"{WRITE_KV}(") == 2


def _unfused_graph() -> str:
    """The graph of ``unrotated`` where nothing is declared: what a decline must leave."""
    return run_both(unrotated, {"layers.0": SLOTS_7})[2].graph


@pytest.mark.parametrize("declared, why", [
    ((lambda node: "the cache's layout is not known when compiling",),
     "engine write prepfuse_toy_engine::write_kv at .*: the cache's layout is not known when compiling; left to "
     "the engine"),
    ((lambda node: CacheLayout(torch.float16),),
     r"engine write prepfuse_toy_engine::write_kv at .*: its cache is torch.float16; the by-layer op writes "
     r"torch.bfloat16 caches; left to the engine"),
], indirect=["declared"], ids=["unknown-layout", "fp16-cache"])
def test_an_engine_cache_the_op_cannot_write_is_named_and_left_alone(declared, why):
    unfused = _unfused_graph()
    out, ref, report, got, want = run_both(unrotated, {"layers.0": SLOTS_7}, fused=False)
    assert_same(out, ref, got, want)
    assert report.graph == unfused
    (miss,) = report.near_misses("fuse_gqa_prep")
    assert re.fullmatch(why, miss.why), miss.why


def test_an_engine_write_no_call_computes_is_named_and_left_alone():
    unfused = _unfused_graph()
    register_engine_write(toy_engine())
    try:
        out, ref, report, got, want = run_both(unrotated, {"layers.0": SLOTS_7}, fused=False)
    finally:
        unregister_engine_write(WRITE_KV)
    assert_same(out, ref, got, want)
    assert report.graph == unfused  # the probe form gone, the engine op as it was
    (miss,) = report.near_misses("fuse_gqa_prep")
    line = unrotated.__code__.co_firstlineno + inspect.getsource(unrotated).splitlines().index(
        '    return q, WRITE_KV(k, v, "layers.0")')
    at = re.escape(f'test_gqa_engine_writes.py:{line} `return q, WRITE_KV(k, v, "layers.0")`')
    assert re.fullmatch(f"engine write prepfuse_toy_engine::write_kv at {at}: not fused \\(v: no k write \\(rotated "
                        f"heads of the same projection\\) goes to the same slots as the write at {at}\\); left to the "
                        "engine", miss.why), miss.why
