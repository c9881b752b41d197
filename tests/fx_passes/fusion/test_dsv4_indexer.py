"""``FuseDsv4IndexerPrepPass``: unfused DeepSeek-V4 indexer preparation (FP8) becomes one op call.

Every compiled case asserts what a pass test asserts:

- numerics, compiled vs eager on fresh random inputs (all slots valid: eager code cannot
  skip one): q codes, folded weights and cache bytes identical -- there are no sums in
  this math, so the fused op and the model code agree bit for bit; look-alikes, left
  unfused, are Inductor's code against eager, within one e4m3 code;
- the exact ``matched_count`` and the pattern of each call;
- the golden normalized post-pass graph (``EXPECTTEST_ACCEPT=1`` regenerates them).

Shapes are small (T=7, H=3, Tk=5, block 16) and Inductor's FX graph cache is off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.dsv4_indexer import FuseDsv4IndexerPrepPass
from prepfuse.fx_passes.registry import registered_passes
from prepfuse.models import dsv4_indexer as model
from prepfuse.models.dsv4_indexer import INDEXER_LOOKALIKES, INDEXER_SPELLINGS, indexer_fp8_cache
from prepfuse.testing import make_dsv4_indexer_inputs
from prepfuse.testing.golden import GoldenFiles
from tests.fx_passes.fusion import indexer_harness as harness
from tests.fx_passes.fusion.indexer_harness import BLOCK, H, SCALE, TK, T, Run, assert_same_as_eager

GOLDEN = GoldenFiles.beside(__file__)

PASS = FuseDsv4IndexerPrepPass.name
SPELLINGS = {s.name: s for s in INDEXER_SPELLINGS}
LOOKALIKES = {s.name: s for s in INDEXER_LOOKALIKES}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def prep(spelling):
    return harness.prep(model, spelling)


def q_only(spelling):
    return harness.q_only(model, spelling)


def k_only(spelling):
    return harness.k_only(model, spelling)


def make_inputs(**kwargs):
    """Seeded inputs: a test's values do not depend on what ran before it in the worker (a
    weight of one row was once one exponent step from eager's in a full run, see
    docs/decisions.md)."""
    kwargs.setdefault("generator", torch.Generator().manual_seed(0))
    inputs = make_dsv4_indexer_inputs("fp8", T, H, BLOCK, "cpu", num_k=TK, skip_fraction=0.0, **kwargs)
    num_blocks = inputs.k_cache.shape[0]
    return dataclasses.replace(inputs, k_cache=indexer_fp8_cache(num_blocks, BLOCK))


DEEPSEEK_HEADS, DEEPSEEK_BLOCK = 64, 64  # DeepSeek-V4's indexer heads and a vLLM cache block


def deepseek_inputs(num_tokens: int):
    """Seeded CPU inputs at DeepSeek-V4's sizes: 64 heads, block 64, a key row per 4 tokens."""
    inputs = make_dsv4_indexer_inputs("fp8", num_tokens, DEEPSEEK_HEADS, DEEPSEEK_BLOCK, "cpu",
                                      num_k=max(1, num_tokens // 4), skip_fraction=0.0,
                                      generator=torch.Generator().manual_seed(0))
    return dataclasses.replace(inputs, k_cache=indexer_fp8_cache(inputs.k_cache.shape[0], DEEPSEEK_BLOCK))


def run(fn, inputs=None, *, passes=(PASS,), v2=True) -> Run:
    return harness.run(fn, make_inputs() if inputs is None else inputs, PASS, passes=passes, v2=v2)


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_into_one_call(name):
    r = run(prep(SPELLINGS[name]))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q+k"]
    GOLDEN.check(r.report.graph, "spelling_fuses_into_one_call")


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_one_key_row_fuses(name):
    """One compressed key row under static shapes: torch's index_put decomposition squeezes
    the [1, 128] row to [128] (and the [1, 4] scale bytes to [4]); the k side still fuses."""
    inputs = dataclasses.replace(make_inputs(), k=make_inputs().k[:1], k_positions=make_inputs().k_positions[:1])
    inputs = dataclasses.replace(inputs, slot_mapping=inputs.slot_mapping[:1])
    r = run(prep(SPELLINGS[name]), inputs)
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q+k"], r.events("declined")


def test_functionalization_v1():
    r = run(prep(INDEXER_SPELLINGS[1]), v2=False)
    assert_same_as_eager(r)
    assert r.matched == 1
    GOLDEN.check(r.report.graph, "functionalization_v1")


def test_runs_in_place_after_defunctionalize():
    """With the default pass list, Inductor's code is the op call alone: no kernel, copy or clone."""
    inputs = make_inputs()
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    fn = prep(INDEXER_SPELLINGS[0])
    backend = PrepfuseBackend({"strict": True})
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    out, (code,) = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True),
                                    inputs.q, inputs.weights, inputs.k, cache, *rest)
    ref = fn(inputs.q, inputs.weights, inputs.k, ref_cache, *rest)
    assert_same_as_eager(Run(out, cache, ref, ref_cache, None))
    (report,) = backend.reports
    assert report.matched_counts[PASS] == 1 and report.matched_counts["defunctionalize"] == 1
    assert sum(report.matched_counts.values()) == 2  # no other pass rewrote anything
    (FileCheck().check_count("torch.ops.prepfuse.dsv4_indexer_rope_fp8_insert.default(", 1, exactly=True)
     .check_not("copy_").check_not("clone").run(code))
    FileCheck().check_not("cpp_fused").run(code)


def test_q_side_alone():
    r = run(q_only(INDEXER_SPELLINGS[2]))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q"]
    GOLDEN.check(r.report.graph, "q_side_alone")


def test_k_side_alone_with_fewer_slots_than_rows():
    """slot_mapping has Tk' < Tk rows: the op inserts ``k[:Tk']`` at ``k_positions[:Tk']``."""
    r = run(k_only(INDEXER_SPELLINGS[3]), make_inputs(num_inserted=3))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_k"]
    GOLDEN.check(r.report.graph, "k_side_alone_with_fewer_slots_than_rows")


@pytest.mark.parametrize("name", [n for n in LOOKALIKES if n != "no_bf16_round"])
def test_lookalikes_are_left_alone(name):
    """Other math: declined on both sides, naming the closest call and where it differs."""
    inputs = make_inputs()
    r = run(prep(LOOKALIKES[name]), inputs)
    assert r.matched == 0
    declined = r.events("declined")
    assert {p for p, _ in declined} == {"dsv4_indexer_q", "dsv4_indexer_k"}, declined
    assert all(w.startswith("closest: the FP8 indexer's ") and " differs at [" in w for _, w in declined), declined
    # left alone means what Inductor alone makes of it, byte for byte (Inductor's own
    # rounding of the unfused math differs from eager, by torch version: on 2.14 a whole
    # head's exponent moved, 128 codes 9 apart)
    torch._dynamo.reset()
    cache = inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    q, w = torch.compile(prep(LOOKALIKES[name]), backend="inductor", fullgraph=True)(
        inputs.q, inputs.weights, inputs.k, cache, *rest)
    assert torch.equal(r.out[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(r.out[1].view(torch.int32), w.view(torch.int32))
    assert torch.equal(r.cache, cache)


def test_quantising_the_unrounded_rotation_fuses_within_one_code():
    """Quantising the fp32 rotation without ``.to(bf16).float()``: the op rounds to bf16
    first, which moves a code by at most one step (and an exponent where the rounding
    carries past a power of two): within the probes' bounds, so the pass fuses it (on every
    torch: where Inductor drops narrowing round trips, the rounded spelling's graph is this
    one), and the fused op gives the rounded spelling's eager result exactly."""
    spelling = LOOKALIKES["no_bf16_round"]
    inputs = make_inputs()
    r = run(prep(spelling), inputs)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q+k"], r.events("declined")
    harness.assert_same_as_rounded_eager(r, model, spelling, inputs)


def test_the_unrounded_rotation_at_64_heads_moves_some_scales_and_fuses():
    """The same at DeepSeek-V4's sizes and T=1000 (64000 q rows, 250 key rows): there the
    probes meet rows whose amax the op's bf16 rounding carries across a power of two, so the
    row's codes and its weight (a key row's codes and its scale) are a power of two apart from
    the graph's. This is every spelling's graph under torch 2.11, whose Inductor drops the round
    trip: before the probes compared codes times their scale, q declined there (an H100 at T=8,
    the CPU at T=1000) and only k fused."""
    spelling = LOOKALIKES["no_bf16_round"]
    inputs = deepseek_inputs(1000)
    r = harness.run(harness.prep(model, spelling, DEEPSEEK_BLOCK), inputs, PASS)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q+k"], r.events("declined")
    harness.assert_same_as_rounded_eager(r, model, spelling, inputs, DEEPSEEK_BLOCK)


def test_an_fp32_k_is_rounded_by_the_call():
    """k = norm(..).to(bf16) read only by the prep's k.float(): where Inductor drops that
    round trip the k side reads the fp32 norm output; emulated by handing the prep fp32 k.
    The call reads k in bf16 (the cast goes in front of it), and the result is exactly
    eager's with k.to(bf16)."""
    inputs = make_inputs()
    k_fp32 = inputs.k.float() * 1.001  # not bf16-representable: the call's rounding shows
    r = run(prep(INDEXER_SPELLINGS[0]), dataclasses.replace(inputs, k=k_fp32))
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q+k"], r.events("declined")
    assert "convert_element_type" in r.report.graph  # the cast to bf16 in front of the call
    ref_cache = inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    ref_out = prep(INDEXER_SPELLINGS[0])(inputs.q, inputs.weights, k_fp32.to(torch.bfloat16), ref_cache, *rest)
    assert_same_as_eager(Run(r.out, r.cache, ref_out, ref_cache, None))


def test_weights_scaled_twice_fuse_one_product_and_keep_the_other():
    """Two readers scale the exponent into weights: the call folds it into one (the latest),
    the other keeps its own computation from the same exponent; both equal eager."""
    spelling = INDEXER_SPELLINGS[0]

    def fn(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        cs = cos_sin_cache[positions]
        y = model.rope_tail(q.float(), cs[:, :32].unsqueeze(1), cs[:, 32:].unsqueeze(1), spelling)
        q_fp8, e = model.fp8_row_quant(y, spelling)
        return q_fp8, weights.float() * torch.exp2(e) * SCALE, weights.float() * torch.exp2(e) * 2.0

    r = run(fn)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q"]
    for got, want in zip(r.out, r.ref_out):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_registered_before_defunctionalize():
    names = list(registered_passes())
    assert names.index(PASS) < names.index("defunctionalize")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 1000])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_on_cuda(name, num_tokens):
    """On CUDA the candidate calls the probes run are the Triton kernel, and the region's
    values are eager CUDA's: q and k still become one call, at DeepSeek-V4's 64 heads. The
    strided RoPE spellings are eager's bytes exactly; eager CUDA's complex multiply may
    contract a product and a sum into an FMA, so those are held to the one-code bound."""
    inputs = deepseek_inputs(num_tokens)
    inputs = dataclasses.replace(inputs, **{f: getattr(inputs, f).cuda() for f in (
        "q", "weights", "k", "k_cache", "slot_mapping", "positions", "k_positions", "cos_sin_cache")})
    spelling = SPELLINGS[name]
    r = harness.run(harness.prep(model, spelling, DEEPSEEK_BLOCK), inputs, PASS)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_q+k"], r.events("declined")
    if spelling.rope == "strided":
        assert_same_as_eager(r)
        return
    got, want = r.out[0].view(torch.uint8).int(), r.ref_out[0].view(torch.uint8).int()
    assert int(((got & 0x7F) - (want & 0x7F)).abs().max()) <= 1


def test_a_row_scale_one_power_of_two_apart_is_the_same_math():
    """A bf16 rounding the graph lost (torch 2.11's Inductor drops ``.to(bf16).float()``) may
    move one row's amax across a power of two: its codes halve and its weight doubles. Codes
    times their weight and each weight within a power of two agree then; a weight four times
    off (another amax floor, another scale) does not."""
    from prepfuse.fx_passes.fusion.dsv4_indexer import _fp8_codes_by_weight, _weights_by_row_scale
    from prepfuse.fx_passes.rewrite.compare import Checked, Mismatch, compare

    gen = torch.Generator().manual_seed(0)
    y = (torch.randn(2, 3, 128, generator=gen) * 150).clamp(-448, 448)  # the code clamps before its cast
    region_q, region_w = y.to(torch.float8_e4m3fn), torch.rand(2, 3, generator=gen) + 0.5
    moved_q, moved_w = region_q.clone(), region_w.clone()
    moved_q[1, 2] = (y[1, 2] / 2).to(torch.float8_e4m3fn)  # the call's scale one power of two up
    moved_w[1, 2] *= 2
    rq, cq, rw, cw = "region q", "call q", "region w", "call w"  # stand-ins for the graph's nodes

    def check(q, w):
        values, call_values = {rq: region_q, rw: region_w}, {cq: q, cw: w}
        compare(Checked("q_out", rq, cq, decode=_fp8_codes_by_weight, scales=(rw, cw)), q, region_q, 0, values,
                call_values)
        compare(Checked("weights_out", rw, cw, decode=_weights_by_row_scale), w, region_w, 0, values)

    check(moved_q, moved_w)
    far_q, far_w = region_q.clone(), region_w.clone()
    far_q[1, 2] = (y[1, 2] / 4).to(torch.float8_e4m3fn)  # two powers of two: the products agree,
    far_w[1, 2] *= 4  # the weight does not
    with pytest.raises(Mismatch, match="weights_out"):
        check(far_q, far_w)
    with pytest.raises(Mismatch, match="q_out"):  # the codes moved without their weight
        check(moved_q, region_w)
