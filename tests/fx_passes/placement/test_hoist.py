"""Captured-region placement: ``PlacementPass``, the partition plan, and the check.

The splitting op is ``prepfuse_test::attention`` (``tests.placement_ops``), an opaque op
standing in for an engine's eager attention. Each compiled case asserts numerics
compiled vs eager (the attention output too: it tells whether a cache write moved ahead
of a read), the exact matched counts, the golden post-pass graph (node order is the
point here), and the partition the report gives each prepfuse op.

On the CPU Inductor's graph partition has nothing to capture; these tests check
prepfuse's own result (graph order, the plan, the check's errors). The GPU test at the
end checks that Inductor's partitions, in the generated code, agree with the plan.
Shapes are small (T=7, H=3, HP=8, block 16); Inductor's FX graph cache is off.
"""

from __future__ import annotations

import dataclasses
import operator
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend, PrepfuseOptions
from prepfuse.fx_passes.fusion.dsv4 import FuseDsv4PrepPass
from prepfuse.fx_passes.placement.partitions import PlacementPolicy, plan_partitions
from prepfuse.fx_passes.placement.hoist import PlacementPass, check_placement
from prepfuse.models import dsv4 as model
from prepfuse.models.dsv4 import DSV4_SPELLINGS
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT
from prepfuse.testing import compare_dsv4_q, compare_gqa, make_dsv4_inputs, make_gqa_inputs
from prepfuse.testing.golden import GoldenFiles
from tests.placement_ops import ATTENTION

GOLDEN = GoldenFiles.beside(__file__)

T, H, HP, BLOCK, EPS = 7, 3, 8, 16, 1e-6
SPELLING = DSV4_SPELLINGS[0]
SPLIT = "prepfuse_test::attention"
FUSED = "prepfuse.dsv4_qnorm_rope_kv_insert.default"
attention = torch.ops.prepfuse_test.attention


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


# --------------------------------------------------------------------------------------
# Model code: DeepSeek-V4 preparation written around an eager attention op
# --------------------------------------------------------------------------------------
def prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    q_padded = model.dsv4_q_prep(q, positions, cos_sin_cache, EPS, HP, SPELLING)
    model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, SPELLING)
    return q_padded


def prep_after_attention(x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """The prep is written after the attention call but reads nothing it produces."""
    a = attention(x * 2, x)
    q_padded = prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache)
    return a + 1, q_padded


def prep_of_attention_output(x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """The prep normalises what attention returns: it must stay after it."""
    q = attention(q, x * 2)
    return prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache)


def prep_into_cache_attention_reads(x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """Attention reads the cache the prep then writes: moving the write ahead would change
    what attention reads (no data edge says so in the graph, only the buffer)."""
    a = attention(x * 2, k_cache)
    q_padded = prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache)
    return a, q_padded


def prep_between_two_attentions(x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """The prep reads the first attention's output and is written after the second: it
    moves back exactly one splitting op, into the partition between them."""
    h = x * 2
    q = attention(q, h)
    a = attention(h, x)
    q_padded = prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache)
    return a - 1, q_padded


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    out: tuple
    ref_out: tuple
    cache: torch.Tensor
    ref_cache: torch.Tensor
    report: object  # GraphReport of the single compiled graph

    def matched(self, pass_name: str) -> int:
        return self.report.matched_counts.get(pass_name, 0)

    def events(self, kind: str) -> list:
        return [(r.pattern, r.why) if kind == "declined" else r.pattern
                for r in self.report.rewrites if r.pass_name == PlacementPass.name and r.kind == kind]


def run(fn, *, cudagraphs="piecewise", splitting_ops=(SPLIT,), v2=True, static_cache=True) -> Run:
    """``fn`` compiled by the prepfuse backend and eagerly, each on its own copy of the cache.

    The compiled call's cache is static (``mark_static_address``), as an engine's KV cache
    is: cudagraph trees only let a captured graph write static inputs."""
    inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cpu", skip_fraction=0.0)
    x = torch.randn(T, 16)
    backend = PrepfuseBackend({
        "record_graphs": True, "auto_functionalized_v2": v2,
        "splitting_ops": splitting_ops, "cudagraphs": cudagraphs,
    })
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    if static_cache:
        torch._dynamo.mark_static_address(cache)
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out = torch.compile(fn, backend=backend, fullgraph=True)(x, inputs.q, inputs.kv, cache, *rest)
    ref_out = fn(x, inputs.q, inputs.kv, ref_cache, *rest)
    (report,) = backend.reports
    return Run(_tuple(out), _tuple(ref_out), cache, ref_cache, report)


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def assert_close_to_eager(r: Run) -> None:
    """Cache bytes identical; the padded q within the DeepSeek-V4 bound (docs/design.md); attention's
    output (same fp32 math compiled and eager) identical."""
    assert torch.equal(r.cache, r.ref_cache), int((r.cache != r.ref_cache).sum())
    for got, want in zip(r.out, r.ref_out):
        if got.shape[-1] == 512 and got.dtype == torch.bfloat16:
            assert compare_dsv4_q(got, want).within_spec(), compare_dsv4_q(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------
# The pass moves independent prep ahead of the splitting op
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("v2", [pytest.param(False, id="v1"), pytest.param(True, id="v2")])
def test_prep_written_after_attention_moves_ahead_of_it(v2):
    r = run(prep_after_attention, v2=v2)
    assert_close_to_eager(r)
    assert r.matched(FuseDsv4PrepPass.name) == 1
    # the fused call lands ahead of attention: emitted there, or moved there by placement
    assert r.events("matched") in ([], ["ahead of prepfuse_test.attention.default"])
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 0}
    assert r.report.placement.layout() == "captured 0 | eager prepfuse_test.attention.default | captured 1"
    # every registered pattern pass, then placement, then defunctionalize
    assert "fuse_dsv4_prep" in r.report.passes and r.report.passes[-2:] == ("placement", "defunctionalize")
    GOLDEN.check(r.report.graph, "prep_written_after_attention_moves_ahead_of_it")


def test_report_gives_the_partition_of_each_prepfuse_op():
    r = run(prep_after_attention)
    text = r.report.format()
    assert "cudagraphs=piecewise, splitting ops: prepfuse_test::attention; partitions: captured 0 | eager " \
           "prepfuse_test.attention.default | captured 1" in text
    assert re.search(r"prepfuse\.dsv4_qnorm_rope_kv_insert\.default\s+dsv4_qnorm_rope_kv_insert_default\s+captured 0", text)


def gqa_call_after_attention(x, qkv, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping,
                             positions, cos_sin_cache):
    """Any prepfuse op is preparation, pattern pass or not: the GQA op called directly,
    on an input computed after attention (that computation moves with it). Attention's
    reader comes first: Inductor's own locality reorder moves a pure op like attention
    down to its first reader, which would otherwise put it after the prep already."""
    a = attention(x * 2, x) + 1
    GQA_QKNORM_ROPE_KV_INSERT(qkv * 2, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping,
                              positions, cos_sin_cache, None, 4, 2, True, EPS)
    return a


def test_any_prepfuse_op_moves_with_its_inputs():
    inputs = make_gqa_inputs(T, 4, 2, 64, BLOCK, "cpu", skip_fraction=0.0)
    x = torch.randn(T, 16)
    compiled_inputs, eager_inputs = inputs.fresh_outputs(), inputs.fresh_outputs()
    for t in (compiled_inputs.q_out, compiled_inputs.k_cache, compiled_inputs.v_cache):
        torch._dynamo.mark_static_address(t)
    backend = PrepfuseBackend({"record_graphs": True, "splitting_ops": [SPLIT], "cudagraphs": "piecewise"})
    out = torch.compile(gqa_call_after_attention, backend=backend, fullgraph=True)(x, *compiled_inputs.args()[:9])
    ref = gqa_call_after_attention(x, *eager_inputs.args()[:9])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert compare_gqa(compiled_inputs, eager_inputs).exact(), compare_gqa(compiled_inputs, eager_inputs)
    (report,) = backend.reports
    assert report.matched_counts[PlacementPass.name] == 1
    assert report.partition_of() == {"gqa_qknorm_rope_kv_insert_default": 0}
    GOLDEN.check(report.graph, "any_prepfuse_op_moves_with_its_inputs")


# --------------------------------------------------------------------------------------
# What must stay after the splitting op
# --------------------------------------------------------------------------------------
def test_prep_reading_attention_output_stays_after_it():
    r = run(prep_of_attention_output)
    assert_close_to_eager(r)
    assert r.matched(FuseDsv4PrepPass.name) == 1
    assert r.matched(PlacementPass.name) == 0
    assert r.events("declined") == [(
        "after prepfuse_test.attention.default", "it reads the output of splitting op attention",
    )]
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 1}
    GOLDEN.check(r.report.graph, "prep_reading_attention_output_stays_after_it")


@pytest.mark.parametrize("v2", [pytest.param(False, id="v1"), pytest.param(True, id="v2")])
def test_cache_write_stays_after_attention_reading_the_cache(v2):
    r = run(prep_into_cache_attention_reads, v2=v2)
    assert_close_to_eager(r)  # attention read the cache before the insert, as in eager
    assert r.matched(PlacementPass.name) == 0
    assert r.events("declined") == [(
        "after prepfuse_test.attention.default",
        "it writes a buffer read or written earlier by splitting op attention",
    )]
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 1}
    assert r.report.functionalized_left == []  # stayed in place: no cache copy
    GOLDEN.check(r.report.graph, "cache_write_stays_after_attention_reading_the_cache")


def test_prep_moves_back_to_the_partition_after_its_last_dependency():
    r = run(prep_between_two_attentions)
    assert_close_to_eager(r)
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 1}
    assert r.report.placement.layout() == (
        "captured 0 | eager prepfuse_test.attention.default | captured 1 | "
        "eager prepfuse_test.attention.default | captured 2"
    )
    GOLDEN.check(r.report.graph, "prep_moves_back_to_the_partition_after_its_last_dependency")


# --------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------
def test_fused_op_outside_every_captured_partition_fails():
    """Named as a splitting op, the fused op would run eagerly: the check names it and why."""
    with pytest.raises(Exception, match=(
        r"(?s)cudagraphs='piecewise'.*fused op dsv4_qnorm_rope_kv_insert_default "
        r"\(prepfuse\.dsv4_qnorm_rope_kv_insert\.default, dsv4\.py:\d+ .*\) lands outside every captured "
        r"partition: it is one of splitting_ops \(prepfuse_test::attention, prepfuse::dsv4_qnorm_rope_kv_insert\)"
    )):
        run(prep_after_attention, splitting_ops=(SPLIT, "prepfuse::dsv4_qnorm_rope_kv_insert"))


def test_fused_op_writing_a_non_static_input_fails():
    """cudagraph trees skip a partition that writes an input whose address may change:
    the cache insert would run uncaptured. The check says so, and how to fix it."""
    with pytest.raises(Exception, match=(
        r"(?s)dsv4_qnorm_rope_kv_insert_default \(prepfuse\.dsv4_qnorm_rope_kv_insert\.default, dsv4\.py:\d+ .*\) is in "
        r"captured partition 0 but a CUDA graph cannot hold it: writes graph input arg\d+_1 \(uint8\[\d+, \d+\]\) "
        r"in place, and it is not static: cudagraph trees skip a partition that mutates a non-static input "
        r"\(make it a module buffer or call torch\._dynamo\.mark_static_address on it\)"
    )):
        run(prep_after_attention, static_cache=False)


def test_full_mode_leaves_input_buffers_to_the_engine():
    r = run(prep_after_attention, cudagraphs="full", splitting_ops=(), static_cache=False)
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 0}


def test_inductor_keeps_the_placed_order():
    """Inductor's scheduler follows the order the pass chose: its code calls the fused op
    before the attention op (its reorders that could move it back are off in piecewise)."""
    r, (code, *_) = run_and_get_code(run, prep_after_attention)
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 0}
    FileCheck().check("torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(").check(
        "torch.ops.prepfuse_test.attention.default(").run(code)


def test_cudagraphs_none_checks_nothing():
    r = run(prep_after_attention, cudagraphs="none", splitting_ops=(SPLIT, "prepfuse::dsv4_qnorm_rope_kv_insert"))
    assert_close_to_eager(r)
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": None}
    assert "eager" in r.report.format()


def item_scaled_prep(x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    newest = positions.max().item()  # a host sync, in the middle of captured work
    return prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache), x + newest


@pytest.mark.parametrize("mode, region", [("piecewise", "captured partition 0"), ("full", "the captured forward")])
def test_item_in_a_captured_region_fails(mode, region):
    with torch._dynamo.config.patch(capture_scalar_outputs=True), pytest.raises(Exception, match=(
        rf"(?s)cudagraphs='{mode}'.*\(aten\._local_scalar_dense\.default, test_hoist\.py:\d+  newest = "
        rf"positions\.max\(\)\.item\(\).*\) is in {region} but a CUDA graph cannot hold it: host sync: \.item\(\)"
    )):
        run(item_scaled_prep, cudagraphs=mode, splitting_ops=() if mode == "full" else (SPLIT,))


def test_item_is_fine_without_cudagraphs():
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        r = run(item_scaled_prep, cudagraphs="none", splitting_ops=(SPLIT,))
    assert_close_to_eager(r)
    assert r.matched(PlacementPass.name) == 0  # no splitting op in this graph


def test_full_mode_is_one_captured_region():
    r = run(prep_after_attention, cudagraphs="full", splitting_ops=())
    assert_close_to_eager(r)
    assert "placement" not in r.report.passes  # nothing to move without splitting ops
    assert "fuse_dsv4_prep" in r.report.passes and r.report.passes[-1] == "defunctionalize"
    assert r.report.placement.layout() == "captured 0"
    assert r.report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": 0}


def _fake_graph(build) -> torch.fx.Graph:
    """A graph built by ``build(graph, fake_mode)``; every node carries its fake value."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        build(graph, mode)
    return graph


def _node(graph, op, target, args, val):
    """A node named after its op ("mul" for aten.mul.Tensor), as a traced graph would name it."""
    name = target if op == "placeholder" else target.__name__.split(".")[0]
    n = graph.create_node(op, target, args, name=name)
    n.meta["val"] = val
    return n


def test_cpu_scalar_read_in_a_cuda_graph_fails():
    """A CPU scalar tensor read by a CUDA kernel: its value is read on the host at launch,
    so a captured graph would replay a stale value. Built with fake CUDA tensors, so the
    rule is checked on a CPU-only machine."""
    def build(graph, mode):
        x = _node(graph, "placeholder", "x", (), torch.empty(4, device="cuda"))
        s = _node(graph, "placeholder", "s", (), torch.empty((), device="cpu"))
        y = _node(graph, "call_function", torch.ops.aten.mul.Tensor, (x, s), torch.empty(4, device="cuda"))
        z = _node(graph, "call_function", torch.ops.aten.add.Tensor, (y, 1), torch.empty(4, device="cuda"))
        graph.output((z,))

    plan = plan_partitions(_fake_graph(build), PlacementPolicy(cudagraphs="full"))
    assert plan.device == "cuda:0"
    assert check_placement(plan) == [
        "mul (aten.mul.Tensor) is in the captured forward but a CUDA graph cannot hold it: reads s, a cpu "
        "scalar tensor: its value is read on the host at launch and would be frozen into the graph",
    ]


def test_device_copy_and_cpu_op_in_a_cuda_graph_fail():
    def build(graph, mode):
        x = _node(graph, "placeholder", "x", (), torch.empty(4, device="cuda"))
        c = _node(graph, "call_function", torch.ops.aten._to_copy.default, (x,), torch.empty(4, device="cpu"))
        d = _node(graph, "call_function", torch.ops.aten.neg.default, (c,), torch.empty(4, device="cpu"))
        graph.output((d,))

    problems = check_placement(plan_partitions(_fake_graph(build), PlacementPolicy(cudagraphs="piecewise")))
    assert problems == [
        "_to_copy (aten._to_copy.default) is in captured partition 0 but a CUDA graph cannot hold it: "
        "device copy between cpu and cuda:0",
        "neg (aten.neg.default) is in captured partition 0 but a CUDA graph cannot hold it: runs on cpu, "
        "not on the captured device cuda:0",
    ]


def test_neutral_nodes_take_no_partition():
    """Views, getitem and size arithmetic between two splitting ops make no partition."""
    def build(graph, mode):
        x = _node(graph, "placeholder", "x", (), torch.empty(4, 2, device="cuda"))
        a = _node(graph, "call_function", ATTENTION, (x, x), torch.empty(4, 2, device="cuda"))
        v = _node(graph, "call_function", torch.ops.aten.view.default, (a, [8]), torch.empty(8, device="cuda"))
        n = _node(graph, "call_function", torch.ops.aten.sym_size.int, (v, 0), 8)
        m = _node(graph, "call_function", operator.mul, (n, 2), 16)
        b = _node(graph, "call_function", ATTENTION, (v, v), torch.empty(8, device="cuda"))
        graph.output((b, m))

    plan = plan_partitions(_fake_graph(build), PlacementPolicy((SPLIT,), "piecewise"))
    assert plan.layout() == "eager prepfuse_test.attention.default | eager prepfuse_test.attention.default"
    assert plan.num_captured == 0 and check_placement(plan) == []


# --------------------------------------------------------------------------------------
# Invisible unless asked for
# --------------------------------------------------------------------------------------
def test_no_splitting_ops_no_cudagraphs_is_invisible():
    default, explicit = PrepfuseBackend(), PrepfuseBackend({"splitting_ops": [], "cudagraphs": "none"})
    assert explicit.pass_manager().uuid() == default.pass_manager().uuid()
    assert explicit.pass_manager().pass_names == default.pass_manager().pass_names
    assert PlacementPass.name not in default.pass_manager().pass_names
    assert explicit.options.config_patches() == default.options.config_patches() == {}
    inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cpu", skip_fraction=0.0)
    torch.compile(prep, backend=explicit, fullgraph=True)(inputs.q, inputs.kv, inputs.k_cache.clone(),
                                                          inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    (report,) = explicit.reports
    assert report.placement is None and report.partition_of() == {}
    assert "cudagraphs" not in report.format(verbose=True)


def test_placement_pass_runs_after_every_pattern_pass_and_before_defunctionalize():
    names = PrepfuseBackend({"splitting_ops": [SPLIT]}).pass_manager().pass_names
    assert names[-2:] == ("placement", "defunctionalize")
    assert names[:-2] == tuple(PrepfuseOptions().passes[:-1])
    assert PrepfuseBackend({"splitting_ops": [SPLIT], "passes": ()}).pass_manager().pass_names == ("placement",)


def test_placement_is_not_a_registered_pass():
    from prepfuse.fx_passes.registry import register_pass

    with pytest.raises(ValueError, match=r"'placement' is not named in passes: the backend adds it"):
        PrepfuseOptions(passes=("placement",))

    class Impostor(PlacementPass):
        pass

    with pytest.raises(ValueError, match=r"'placement' is the backend's own pass"):
        register_pass(Impostor)


def test_piecewise_config_patches():
    patches = PrepfuseOptions(splitting_ops=[ATTENTION], cudagraphs="piecewise").config_patches()
    assert patches["graph_partition"] is True
    assert patches["custom_should_partition_ops"] == ["prepfuse_test::attention.default"]
    assert patches["triton.cudagraphs"] is True


# --------------------------------------------------------------------------------------
# On the GPU: Inductor's partitions agree with the plan, and capture replays correctly
# --------------------------------------------------------------------------------------
class PrepAfterAttention(torch.nn.Module):
    """q projection, an eager attention, then the next stage's preparation written after it
    (independent of attention: placed into partition 0)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.wq = torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)

    def forward(self, x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        a = attention(self.wq(x), x)
        q_padded = prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache)
        return a * 2, q_padded


class PrepOfAttentionOutput(PrepAfterAttention):
    """The preparation reads attention's output: it stays in partition 1."""

    def forward(self, x, q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        h = self.wq(x)
        q = attention(q, x)
        return h, prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("model_cls, partition", [(PrepAfterAttention, 0), (PrepOfAttentionOutput, 1)])
@torch.no_grad()  # inference, as engines run it
def test_piecewise_capture_on_gpu_matches_eager_and_the_plan(model_cls, partition):
    """Warm up, record, replay twice, each with fresh inputs: every output equals eager;
    the fused op is called inside the ``partition_<i>`` of Inductor's code that the report
    names (captured), the attention op between partitions; cudagraph trees skipped
    nothing and recorded both partitions."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    device = "cuda"
    module = model_cls().to(device)
    backend = PrepfuseBackend({"splitting_ops": [SPLIT], "cudagraphs": "piecewise", "strict": True})
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    counters.clear()
    # The engine's KV cache: one persistent, static buffer, refilled with poison every step.
    cache = make_dsv4_inputs(T, H, HP, BLOCK, device).k_cache.clone()
    torch._dynamo.mark_static_address(cache)

    code = None
    for step in range(4):
        inputs = make_dsv4_inputs(T, H, HP, BLOCK, device, skip_fraction=0.0)
        assert inputs.k_cache.shape == cache.shape
        cache.copy_(inputs.k_cache)
        ref_cache = inputs.k_cache.clone()
        x = torch.randn(T, 64, device=device, dtype=torch.bfloat16)
        args = (inputs.q, inputs.kv, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
        torch.compiler.cudagraph_mark_step_begin()
        if code is None:
            out, (code, *_) = run_and_get_code(compiled, x, args[0], args[1], cache, *args[2:])
        else:
            out = compiled(x, args[0], args[1], cache, *args[2:])
        out = tuple(t.clone() for t in out)  # cudagraph trees reuse output memory on replay
        ref = module(x, args[0], args[1], ref_cache, *args[2:])
        torch.testing.assert_close(out[0], ref[0])  # through the q projection: Inductor's mm vs eager's
        assert compare_dsv4_q(out[1], ref[1]).within_spec(), compare_dsv4_q(out[1], ref[1])
        assert torch.equal(cache, ref_cache), int((cache != ref_cache).sum())

    (report,) = backend.reports
    assert report.partition_of() == {"dsv4_qnorm_rope_kv_insert_default": partition}
    assert report.placement.layout() == "captured 0 | eager prepfuse_test.attention.default | captured 1"
    bodies = {}
    for name in ("partition_0", "partition_1"):
        assert f"def {name}(" in code, code
        bodies[name] = re.split(r"\n(?:def|class) ", code.split(f"def {name}(", 1)[1], maxsplit=1)[0]
    assert "def partition_2(" not in code
    for name, body in bodies.items():
        assert ("torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(" in body) == (name == f"partition_{partition}")
        assert "torch.ops.prepfuse_test.attention.default(" not in body
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    manager = get_manager(torch.device(device).index or 0, create_if_none_exists=False)
    recorded, stack = 0, list(manager.get_roots())
    while stack:
        node = stack.pop()
        recorded += 1
        stack.extend(child for children in node.children.values() for child in children)
    assert recorded >= 2  # partition_0 and partition_1 (a re-record would add nodes, not a bug here)


# --------------------------------------------------------------------------------------
# Where q_out lives: the arena, or under cudagraph trees their pool
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cudagraphs, buffer", [("piecewise", "aten.empty.memory_format"), ("none", "prepfuse.scratch.default")])
def test_q_out_is_a_pool_buffer_under_piecewise_capture(cudagraphs, buffer):
    """Cudagraph trees refuse a partition output outside their pool (an H200 run:
    "storage data ptrs are not allocated in pool"), so under cudagraphs='piecewise' the
    fused op's q_out is a graph buffer, which the trees own; otherwise the arena's view."""
    r = run(prep_after_attention, cudagraphs=cudagraphs)
    assert_close_to_eager(r)
    q_out_arg = [line for line in r.report.graph.splitlines() if line.startswith(("empty", "scratch"))]
    assert len(q_out_arg) == 1 and buffer in q_out_arg[0], r.report.graph
