"""``emit_scratch`` and the DeepSeek-V4 pass's ``q_out`` taken from the scratch arena.

The pass's golden graphs in ``tests/fx_passes/fusion/test_dsv4.py`` show the ``prepfuse.scratch`` node;
here: the compiled code's q_out *is* the arena's reservation (no allocation); when a
later call of a graph reuses an earlier call's buffer and when it takes a new name
(with numerics that would show a clobbered q); growth over dynamic T before
``freeze()``, the error after it; numerics against eager (the DeepSeek-V4 bound (docs/design.md), as in
the pass tests).
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.dsv4 import Q_SCRATCH_BASE, UNUSED_CACHE_BASE
from prepfuse.fx_passes.rewrite.scratch_buffers import emit_scratch, scratch_name, scratch_nodes
from prepfuse.models import dsv4 as model
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.ops import SCRATCH
from prepfuse.scratch import ScratchArena, use_arena
from prepfuse.testing import compare_dsv4_q, make_dsv4_inputs
from prepfuse.testing.golden import GoldenFiles

GOLDEN = GoldenFiles.beside(__file__)

H, HP, BLOCK, EPS = 3, 8, 16, 1e-6
Q_OUT_0 = f"{Q_SCRATCH_BASE}.0"


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


@pytest.fixture
def arena():
    with use_arena(ScratchArena()) as arena:
        yield arena


def prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    torch._check(kv.shape[0] == q.shape[0])
    spelling = DSV4_SPELLINGS[0]
    q_padded = model.dsv4_q_prep(q, positions, cos_sin_cache, EPS, HP, spelling)
    model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, spelling)
    return q_padded


def _call(compiled, num_tokens: int, dynamic: bool = False):
    """(compiled q_out, eager q_out, compiled cache, eager cache) on fresh inputs."""
    inputs = make_dsv4_inputs(num_tokens, H, HP, BLOCK, "cpu", skip_fraction=0.0)
    if dynamic:
        for t in (inputs.q, inputs.kv, inputs.slot_mapping, inputs.positions):
            torch._dynamo.mark_dynamic(t, 0)
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out = compiled(inputs.q, inputs.kv, cache, *rest)
    ref = prep(inputs.q, inputs.kv, ref_cache, *rest)
    return out, ref, cache, ref_cache


def _assert_matches_eager(out, ref, cache, ref_cache):
    comparison = compare_dsv4_q(ref, out)
    assert comparison.within_spec(), comparison
    assert torch.equal(cache, ref_cache)


# --------------------------------------------------------------------------------------
# emit_scratch
# --------------------------------------------------------------------------------------
def test_scratch_name_takes_the_first_free_index():
    graph = torch.fx.Graph()
    assert scratch_name(graph, "op.q_out") == "op.q_out.0"
    for name in ("op.q_out.0", "op.q_out.2", "other.q_out.1"):
        graph.call_function(SCRATCH, (name, [1], torch.float32, torch.device("cpu")))
    assert scratch_name(graph, "op.q_out") == "op.q_out.1"
    assert scratch_name(graph, "other.q_out") == "other.q_out.0"
    with pytest.raises(ValueError, match="base: expected a non-empty string"):
        scratch_name(graph, "")


def test_emit_scratch_needs_a_post_grad_graph():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(x)
    with pytest.raises(RuntimeError, match="carry no fake values"):
        emit_scratch(graph, x.next, "op.q_out", [1], torch.float32, "cpu")


# --------------------------------------------------------------------------------------
# The pass's q_out
# --------------------------------------------------------------------------------------
def test_q_out_is_the_arena_reservation(arena):
    """The compiled code takes q_out from the arena, allocates no [T, HP, 512] buffer,
    and its result matches eager; the returned q is the reservation itself, so it is
    valid until the next call (which writes the same bytes)."""
    compiled = torch.compile(prep, backend=PrepfuseBackend({"strict": True}), fullgraph=True)
    inputs = make_dsv4_inputs(7, H, HP, BLOCK, "cpu", skip_fraction=0.0)
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out, (code,) = run_and_get_code(compiled, inputs.q, inputs.kv, cache, *rest)
    _assert_matches_eager(out, prep(inputs.q, inputs.kv, ref_cache, *rest), cache, ref_cache)
    FileCheck().check(f"torch.ops.prepfuse.scratch.default('{Q_OUT_0}', [7, 8, 512], torch.bfloat16").check(
        "torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(").run(code)
    FileCheck().check_not("empty_strided_cpu((7, 8, 512)").run(code)

    (reservation,) = arena.reservations()
    assert (reservation.name, reservation.nbytes) == (Q_OUT_0, 7 * 8 * 512 * 2)
    assert out.data_ptr() == reservation.storage.data_ptr()
    again, *_ = _call(compiled, 7)
    assert again.data_ptr() == out.data_ptr()


def prep_other_model(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """Another model's code (its own compiled graph) fusing the same op: its tokens' q in
    reverse order (other values, the same shapes)."""
    return prep(q.flip(0).contiguous(), kv, k_cache, slot_mapping, positions, cos_sin_cache)


@pytest.mark.parametrize("output_buffers", ["arena", "graph"])
def test_a_returned_q_out_lives_until_any_graph_fusing_the_op_runs(arena, output_buffers):
    """The documented rule (README, docs/passes.md, the backend docstring): with the arena,
    a returned q_out is valid until the next run of *any* compiled graph taking the same
    reservation (graphs share ``<op>.q_out.0`` by name), another compiled model's included;
    with ``output_buffers="graph"`` it is the caller's to keep."""
    backend = PrepfuseBackend({"strict": True, "output_buffers": output_buffers})
    first = torch.compile(prep, backend=backend, fullgraph=True)
    other = torch.compile(prep_other_model, backend=backend, fullgraph=True)
    out, *_ = _call(first, 7)
    kept = out.clone()
    others, *_ = _call(other, 7)
    if output_buffers == "arena":
        assert others.data_ptr() == out.data_ptr()  # one reservation: the other model wrote these bytes
        assert torch.equal(out.view(torch.int16), others.view(torch.int16))
        assert not torch.equal(out.view(torch.int16), kept.view(torch.int16))
    else:
        assert torch.equal(out.view(torch.int16), kept.view(torch.int16))


def test_output_buffers_graph_returns_fresh_tensors(arena):
    """output_buffers='graph': the fused op writes a graph buffer (no arena reservation),
    so a returned q survives the next call, as torch.compile's outputs usually do."""
    backend = PrepfuseBackend({"strict": True, "output_buffers": "graph"})
    compiled = torch.compile(prep, backend=backend, fullgraph=True)
    inputs = make_dsv4_inputs(7, H, HP, BLOCK, "cpu", skip_fraction=0.0)
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out, (code,) = run_and_get_code(compiled, inputs.q, inputs.kv, cache, *rest)
    _assert_matches_eager(out, prep(inputs.q, inputs.kv, ref_cache, *rest), cache, ref_cache)
    FileCheck().check_not("torch.ops.prepfuse.scratch").check("torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(").run(code)
    assert arena.reservations() == []
    kept = out.clone()
    again, *_ = _call(compiled, 7)
    assert again.data_ptr() != out.data_ptr() and torch.equal(out.view(torch.int16), kept.view(torch.int16))


def test_grows_over_dynamic_tokens_then_refuses_after_freeze(arena):
    compiled = torch.compile(prep, backend=PrepfuseBackend({"strict": True}), fullgraph=True)
    for num_tokens in (5, 12):  # the profiling run: the largest T sizes the reservation
        _assert_matches_eager(*_call(compiled, num_tokens, dynamic=True))
    (reservation,) = arena.reservations()
    assert reservation.nbytes == 12 * HP * 512 * 2
    address = reservation.storage.data_ptr()
    arena.freeze()
    for num_tokens in (1, 12, 9):
        out, *rest = _call(compiled, num_tokens, dynamic=True)
        _assert_matches_eager(out, *rest)
        assert out.data_ptr() == address
    with pytest.raises(RuntimeError, match=rf"'{Q_OUT_0}' on cpu needs 106496 bytes .* only 98304 were reserved"):
        _call(compiled, 13, dynamic=True)
    assert arena.reserved_bytes() == reservation.nbytes


def test_layers_of_one_graph_share_one_reservation(arena):
    """Two layers in one graph: layer 2's q_out is what layer 1's call wrote (read by
    layer 1's attention before layer 2 runs), so one reservation serves both, and
    Inductor sees one buffer written twice."""
    block = Dsv4AttentionBlock(num_layers=2, num_heads=H, padded_heads=HP, block_size=BLOCK)
    inputs = make_dsv4_inputs(7, H, HP, BLOCK, "cpu", skip_fraction=0.0)
    x = torch.randn(7, 64).to(torch.bfloat16)
    caches = [fp8_ds_mla_cache(5, BLOCK) for _ in range(2)]
    backend = PrepfuseBackend({"passes": ("fuse_dsv4_prep",), "record_graphs": True})
    out = torch.compile(block, backend=backend, fullgraph=True)(
        x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, caches)
    ref_caches = [fp8_ds_mla_cache(5, BLOCK) for _ in range(2)]
    ref = block(x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, ref_caches)
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)  # as test_attention_block_dynamic
    assert [r.name for r in arena.reservations()] == [Q_OUT_0]
    (report,) = backend.reports
    assert {k: v for k, v in report.matched_counts.items() if v} == {"fuse_dsv4_prep": 2}
    lines = [line.split(", q=")[0] + (", _all_bases=" + line.split("_all_bases=")[1] if "_all_bases" in line else "")
             for line in report.graph.splitlines() if "scratch" in line or "auto_functionalized" in line]
    GOLDEN.check("\n".join(lines), "layers_of_one_graph_share_one_reservation")


def two_q_preps(readers: str):
    """Two q-side preps in one graph and how their padded qs are read afterwards."""
    w = torch.eye(512, dtype=torch.bfloat16)  # an exact matmul

    def fn(qa, qb, positions, cos_sin_cache):
        pa = model.dsv4_q_prep(qa, positions, cos_sin_cache, EPS, HP, DSV4_SPELLINGS[0])
        pb = model.dsv4_q_prep(qb, positions, cos_sin_cache, EPS, HP, DSV4_SPELLINGS[0])
        if readers == "matmul_then_matmul":
            return torch.mm(pa.flatten(0, 1), w).float() * 2, torch.mm(pb.flatten(0, 1), w).float() * 2
        if readers == "one_after_the_other":
            return pa.float() * 2, pb.float() * 2
        if readers == "cast_then_together":
            return pa.float() * pb.float()
        if readers == "together":
            return torch.cat((pa, pb))
        return pa, pb  # both returned
    return fn


@pytest.mark.parametrize("readers, names", [
    # a is read by a matmul before b's call: b's call writes a's buffer
    ("matmul_then_matmul", [Q_OUT_0]),
    # a's readers come before b's call in the graph, but are pointwise: Inductor may
    # inline them into a kernel after b's call (it does for the cast): two buffers
    ("one_after_the_other", [Q_OUT_0, f"{Q_SCRATCH_BASE}.1"]),
    ("cast_then_together", [Q_OUT_0, f"{Q_SCRATCH_BASE}.1"]),
    # a and b are read by one node after both calls, or by the caller: two buffers
    ("together", [Q_OUT_0, f"{Q_SCRATCH_BASE}.1"]),
    ("returned", [Q_OUT_0, f"{Q_SCRATCH_BASE}.1"]),
])
def test_a_call_reuses_an_earlier_buffer_only_when_nothing_reads_it_later(arena, readers, names):
    fn = two_q_preps(readers)
    a = make_dsv4_inputs(7, H, HP, BLOCK, "cpu")
    qb = make_dsv4_inputs(7, H, HP, BLOCK, "cpu").q
    backend = PrepfuseBackend({"strict": True})
    out = torch.compile(fn, backend=backend, fullgraph=True)(a.q, qb, a.positions, a.cos_sin_cache)
    ref = fn(a.q, qb, a.positions, a.cos_sin_cache)
    (report,) = backend.reports
    # every registered pass reports; only these two rewrote anything
    assert {name: n for name, n in report.matched_counts.items() if n} == {"fuse_dsv4_prep": 2, "defunctionalize": 2}
    reserved = [r.name for r in arena.reservations()]
    assert [n for n in reserved if n.startswith(Q_SCRATCH_BASE)] == names
    # both q-only calls' one-slot caches: never written, never read, so one reservation
    assert [n for n in reserved if not n.startswith(Q_SCRATCH_BASE)] == [f"{UNUSED_CACHE_BASE}.0"]
    if readers == "cast_then_together":  # bf16 * bf16 is exact in fp32; each factor within 1 ULP
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
        return
    # x * 2 is exact; a clobbered q would differ whole
    for x, x_ref in zip(*((out, ref) if isinstance(out, tuple) else ((out,), (ref,)))):
        comparison = compare_dsv4_q((x_ref / 2).to(torch.bfloat16), (x / 2).to(torch.bfloat16))
        assert comparison.within_spec(), comparison


def test_scratch_nodes_lists_them_in_graph_order():
    graph = torch.fx.Graph()
    for name in ("b.0", "a.0", "b.1"):
        graph.call_function(SCRATCH, (name, [1], torch.float32, torch.device("cpu")))
    graph.call_function(torch.ops.aten.empty.memory_format, ([1],))
    assert [n.args[0] for n in scratch_nodes(graph)] == ["b.0", "a.0", "b.1"]
