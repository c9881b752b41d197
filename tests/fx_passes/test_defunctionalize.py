"""``DefunctionalizePass``: auto_functionalized calls of prepfuse ops become in-place calls.

Every compiled case asserts the three things a pass test asserts (numerics against eager,
exact ``matched_count``, the golden post-pass graph) plus a ``FileCheck`` on Inductor's
generated code: no clone or copy of ``q_out`` / ``k_cache``, the op called on the
caller's buffers. Both functionalization versions are one parametrize axis.

The pass is also run directly on hand-built functional graphs, where it must decline
rewrites that would change a value (a read of the old contents after the call, an input
that aliases an output), and on an op of another namespace with a return value, to show
it is generic over mutating ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from prepfuse._compat import auto_functionalized_ops
from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.defunctionalize import DefunctionalizePass
from prepfuse.fx_passes.graph_print import normalized_graph
from prepfuse.fx_passes.registry import register_pass, unregister_pass
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
from prepfuse.testing import make_dsv4_inputs
from prepfuse.testing.golden import GoldenFiles

GOLDEN = GoldenFiles.beside(__file__)

AF_V1, AF_V2 = auto_functionalized_ops()
VERSIONS = [pytest.param(False, id="v1"), pytest.param(True, id="v2")]
T, H, HP, BLOCK = 7, 3, 8, 16


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class DirectCall(torch.nn.Module):
    """The op called straight on the caller's buffers."""

    def forward(self, q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache):
        DSV4_QNORM_ROPE_KV_INSERT(q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, 1e-6, BLOCK)


class EngineViews(torch.nn.Module):
    """As engines call it: q_out a slice of a persistent scratch, k_cache one layer's cache."""

    def forward(self, q, kv, scratch, caches, slot_mapping, positions, cos_sin_cache):
        DSV4_QNORM_ROPE_KV_INSERT(q, kv, scratch[:T], caches[1], slot_mapping, positions, cos_sin_cache, 1e-6, BLOCK)


class SharedScratch(torch.nn.Module):
    """Two layers writing the same q_out scratch, each into its own cache."""

    def forward(self, q, kv, q_out, cache0, cache1, slot_mapping, positions, cos_sin_cache):
        DSV4_QNORM_ROPE_KV_INSERT(q, kv, q_out, cache0, slot_mapping, positions, cos_sin_cache, 1e-6, BLOCK)
        DSV4_QNORM_ROPE_KV_INSERT(kv.view(q.shape[0], 1, -1), kv, q_out, cache1, slot_mapping, positions, cos_sin_cache, 1e-6, BLOCK)


def direct_args():
    inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cpu")
    return inputs.args()[:7]


def engine_args():
    q, kv, q_out, k_cache, slots, positions, cos_sin = direct_args()
    scratch = torch.full((2 * T, HP, 512), -7.0, dtype=torch.bfloat16)
    caches = torch.randint(0, 256, (3, *k_cache.shape), dtype=torch.uint8)
    return q, kv, scratch, caches, slots, positions, cos_sin


def cloned(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def assert_same_bytes(compiled_args, eager_args):
    for i, (c, e) in enumerate(zip(compiled_args, eager_args)):
        if isinstance(e, torch.Tensor):
            assert torch.equal(c.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)), f"argument {i}"


def compile_and_run(module, args, v2, **options):
    """Runs eager and compiled on copies of ``args``; returns (report, generated call())."""
    eager_args, compiled_args = cloned(args), cloned(args)
    module(*eager_args)
    backend = PrepfuseBackend({"passes": ("defunctionalize",), "auto_functionalized_v2": v2, "record_graphs": True, **options})
    _, codes = run_and_get_code(torch.compile(module, backend=backend, fullgraph=True), *compiled_args)
    assert_same_bytes(compiled_args, eager_args)
    (report,) = backend.reports
    (code,) = codes
    return report, code[code.index("def call(") :]


# --------------------------------------------------------------------------------------
# Compiled through the backend
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("v2", VERSIONS)
def test_direct_call_runs_in_place(v2):
    report, code = compile_and_run(DirectCall(), direct_args(), v2)

    assert report.matched_counts == {"defunctionalize": 1}
    assert report.pattern_counts() == {f"{DSV4_QNORM_ROPE_KV_INSERT}/{'v2' if v2 else 'v1'}": 1}
    assert report.near_misses() == [] and report.functionalized_left == []
    GOLDEN.check(report.graph, "direct_call_runs_in_place")
    # q_out (arg2_1) and k_cache (arg3_1) are written where they are: no temporary, no copy.
    FileCheck().check_not("clone").check_not("copy").check_not("empty_strided").check(
        "torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(arg0_1, arg1_1, arg2_1, arg3_1, "
    ).check_not("clone").check_not("copy").run(code)


@pytest.mark.parametrize("v2", VERSIONS)
def test_views_of_inputs_run_in_place(v2):
    report, code = compile_and_run(EngineViews(), engine_args(), v2)

    assert report.matched_counts == {"defunctionalize": 1}
    assert report.near_misses() == [] and report.functionalized_left == []
    if v2:  # v2 regenerates the views from _all_bases: a slice, and as_strided for the select
        GOLDEN.check(report.graph, "views_of_inputs_run_in_place_v2")
    else:  # v1 passed the views themselves; their slice_scatter/select_scatter write-back is gone
        GOLDEN.check(report.graph, "views_of_inputs_run_in_place_v1")
    # scratch (arg0_1) and caches (arg1_1) are written through views of themselves.
    FileCheck().check_not("clone").check_not("copy").check_not("empty_strided").check(
        "torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(arg2_1, arg3_1, reinterpret_tensor(arg0_1, (7, 8, 512)"
    ).check("reinterpret_tensor(arg1_1, (5, 9792), (9792, 1), 48960)").check_not("clone").check_not("copy").run(code)


def test_without_the_pass_inductor_clones_v1_views():
    """Why the pass exists: Inductor alone copies the whole scratch and cache around a v1
    call on views of graph inputs (torch 2.13 CPU)."""
    report, code = compile_and_run(EngineViews(), engine_args(), False, passes=())
    assert report.functionalized_left  # nothing removed it before Inductor's own passes
    if "clone" not in code:
        pytest.skip(f"torch {torch.__version__} re-inplaces v1 views by itself")
    FileCheck().check("clone").check("dsv4_qnorm_rope_kv_insert").run(code)


@pytest.mark.parametrize("v2", VERSIONS)
def test_shared_scratch_written_twice(v2):
    q, kv, q_out, k_cache, slots, positions, cos_sin = direct_args()
    args = (q, kv, q_out, k_cache, k_cache.clone(), slots, positions, cos_sin)
    report, code = compile_and_run(SharedScratch(), args, v2)

    assert report.matched_counts == {"defunctionalize": 2}
    assert report.functionalized_left == []
    calls = [line for line in report.graph.splitlines() if "prepfuse.dsv4_qnorm_rope_kv_insert" in line]
    assert [c.split("(")[1].split(", ")[2] for c in calls] == ["arg2", "arg2"]  # both write q_out itself
    FileCheck().check_not("clone").check_not("copy_").check_not("empty_strided").run(code)


# --------------------------------------------------------------------------------------
# On hand-built functional graphs
# --------------------------------------------------------------------------------------
def functional_call(v2, q, kv, q_out, k_cache, slots, positions, cos_sin):
    """What functionalization emits for one call; returns the new (q_out, k_cache)."""
    common = dict(q=q, kv=kv, slot_mapping=slots, positions=positions, cos_sin_cache=cos_sin, eps=1e-6, block_size=BLOCK)
    if v2:
        out = AF_V2(DSV4_QNORM_ROPE_KV_INSERT, **common, _q_out_base_index=0, _k_cache_base_index=1, _all_bases=[q_out, k_cache])
    else:
        out = AF_V1(DSV4_QNORM_ROPE_KV_INSERT, **common, q_out=q_out, k_cache=k_cache)
    return out[1], out[2]


def run_pass(fn, args, **kwargs):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    p = DefunctionalizePass(**kwargs)
    before = normalized_graph(gm)
    p(gm.graph)
    return p, before, normalized_graph(gm)


@pytest.mark.parametrize("v2", VERSIONS)
def test_declines_when_old_contents_are_read_after(v2):
    def fn(q, kv, q_out, k_cache, slots, positions, cos_sin):
        new_q, new_cache = functional_call(v2, q, kv, q_out, k_cache, slots, positions, cos_sin)
        return new_q, new_cache, q_out.sum()  # the old q_out, read after the call

    p, before, after = run_pass(fn, direct_args())
    assert p.matched_count == 0 and after == before
    (event,) = p.log.events
    assert event.kind == "declined" and event.why.startswith("sum_1 reads q_out_1 after the op")


def test_declines_when_an_input_aliases_an_output():
    def fn(q, kv, q_out, k_cache, slots, positions, cos_sin):
        return functional_call(False, q_out[:, :H], kv, q_out, k_cache, slots, positions, cos_sin)

    p, before, after = run_pass(fn, direct_args())
    assert p.matched_count == 0 and after == before
    assert "read-only input q aliases" in p.log.events[0].why


def test_other_namespaces_are_left_alone():
    def fn(q, kv, q_out, k_cache, slots, positions, cos_sin):
        return functional_call(True, q, kv, q_out, k_cache, slots, positions, cos_sin)

    p, before, after = run_pass(fn, direct_args(), namespaces=("someone_else",))
    assert p.matched_count == 0 and after == before and p.log.events == []


# --------------------------------------------------------------------------------------
# Generic over mutating ops: an op with a return value, outside the prepfuse namespace
# --------------------------------------------------------------------------------------
@torch.library.custom_op("prepfuse_test::scale_into", mutates_args=("out", "acc"))
def scale_into(x: torch.Tensor, out: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 2)
    acc.add_(x)
    return x.sum(0)


@scale_into.register_fake
def _(x, out, acc):
    return x.new_empty(x.shape[1:])


class WideDefunctionalize(DefunctionalizePass):
    name = "defunctionalize_wide"

    def __init__(self) -> None:
        super().__init__(namespaces=("prepfuse", "prepfuse_test"))


class ScaleInto(torch.nn.Module):
    def forward(self, x, out, acc):
        return torch.ops.prepfuse_test.scale_into(x, out, acc) + 1


@pytest.mark.parametrize("v2", VERSIONS)
def test_generic_op_with_a_return(v2):
    register_pass(WideDefunctionalize)
    try:
        x = torch.randn(4, 5)
        args = (x, torch.zeros(4, 5), torch.ones(4, 5))
        eager_args, compiled_args = cloned(args), cloned(args)
        expected = ScaleInto()(*eager_args)
        backend = PrepfuseBackend({"passes": ("defunctionalize_wide",), "auto_functionalized_v2": v2, "record_graphs": True})
        result = torch.compile(ScaleInto(), backend=backend, fullgraph=True)(*compiled_args)
    finally:
        unregister_pass(WideDefunctionalize.name)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert_same_bytes(compiled_args, eager_args)
    (report,) = backend.reports
    assert report.matched_counts == {"defunctionalize_wide": 1}
    GOLDEN.check(report.graph, "generic_op_with_a_return")
