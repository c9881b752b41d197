"""``FuseDsv4IndexerMxfp4PrepPass``: unfused DeepSeek-V4 indexer preparation (MXFP4) becomes one op call.

Every compiled case asserts what a pass test asserts:

- numerics, compiled vs eager on fresh random inputs with planted hard values (every e2m1
  tie, -0.0, a tiny block; all slots valid: eager code cannot skip one): packed q, scale
  bytes, weights and cache bytes identical -- there are no sums in this math, so the
  fused op and the model code agree bit for bit; look-alikes, left unfused, are Inductor's
  code against eager;
- the exact ``matched_count`` and the pattern of each call;
- the golden normalized post-pass graph (``EXPECTTEST_ACCEPT=1`` regenerates them).

Shapes are small (T=7, H=3, Tk=5, block 16) and Inductor's FX graph cache is off.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.dsv4_indexer import FuseDsv4IndexerMxfp4PrepPass
from prepfuse.fx_passes.registry import registered_passes
from prepfuse.models import dsv4_indexer_mxfp4 as model
from prepfuse.models.dsv4_indexer_mxfp4 import MXFP4_LOOKALIKES, MXFP4_SPELLINGS, indexer_mxfp4_cache
from prepfuse.ops import DSV4_INDEXER_ROPE_MXFP4_INSERT
from prepfuse.testing import make_dsv4_indexer_inputs
from prepfuse.testing.golden import GoldenFiles
from tests.fx_passes.fusion import indexer_harness as harness
from tests.fx_passes.fusion.indexer_harness import BLOCK, H, SCALE, TK, T, Run, assert_same_as_eager
from tests.models.test_dsv4_indexer_mxfp4 import plant_hard_values

GOLDEN = GoldenFiles.beside(__file__)

PASS = FuseDsv4IndexerMxfp4PrepPass.name
SPELLINGS = {s.name: s for s in MXFP4_SPELLINGS}
LOOKALIKES = {s.name: s for s in MXFP4_LOOKALIKES}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def prep(spelling):
    return harness.prep(model, spelling)


def q_only(spelling, with_weights=True):
    fn = harness.q_only(model, spelling)
    return fn if with_weights else lambda *args: fn(*args)[:2]


def k_only(spelling):
    return harness.k_only(model, spelling)


def make_inputs(**kwargs):
    inputs = make_dsv4_indexer_inputs("mxfp4", T, H, BLOCK, "cpu", num_k=TK, skip_fraction=0.0, **kwargs)
    num_blocks = inputs.k_cache.shape[0]
    return plant_hard_values(dataclasses.replace(inputs, k_cache=indexer_mxfp4_cache(num_blocks, BLOCK)))


def run(fn, inputs=None, *, passes=(PASS,), v2=True) -> Run:
    return harness.run(fn, make_inputs() if inputs is None else inputs, PASS, passes=passes, v2=v2)


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_into_one_call(name):
    r = run(prep(SPELLINGS[name]))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_mxfp4_q+k"]
    assert r.events("declined") == []
    GOLDEN.check(r.report.graph, "spelling_fuses_into_one_call")


def test_functionalization_v1():
    r = run(prep(MXFP4_SPELLINGS[1]), v2=False)
    assert_same_as_eager(r)
    assert r.matched == 1
    GOLDEN.check(r.report.graph, "functionalization_v1")


def test_runs_in_place_after_defunctionalize():
    """With the default pass list, Inductor's code is the op call alone: no kernel, copy or clone."""
    inputs = make_inputs()
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    fn = prep(MXFP4_SPELLINGS[0])
    backend = PrepfuseBackend({"strict": True})
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    out, (code,) = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True),
                                    inputs.q, inputs.weights, inputs.k, cache, *rest)
    ref = fn(inputs.q, inputs.weights, inputs.k, ref_cache, *rest)
    assert_same_as_eager(Run(out, cache, ref, ref_cache, None))
    (report,) = backend.reports
    assert report.matched_counts[PASS] == 1 and report.matched_counts["defunctionalize"] == 1
    # one call of q and k together, not one side of them (the other left to Inductor)
    assert [r.pattern for r in report.rewrites if r.pass_name == PASS and r.kind == "matched"] == [
        "dsv4_indexer_mxfp4_q+k"], [(r.pattern, r.why) for r in report.rewrites if r.pass_name == PASS]
    assert sum(report.matched_counts.values()) == 2  # no other pass rewrote anything
    (FileCheck().check_count("torch.ops.prepfuse.dsv4_indexer_rope_mxfp4_insert.default(", 1, exactly=True)
     .check_not("copy_").check_not("clone").run(code))
    FileCheck().check_not("cpp_fused").run(code)


def test_q_side_alone():
    r = run(q_only(MXFP4_SPELLINGS[2]))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_mxfp4_q"]
    GOLDEN.check(r.report.graph, "q_side_alone")


def test_q_side_without_weights_gets_a_dummy():
    """Nothing computes ``weights * c``: the call reads an unused ``weights`` and its
    ``weights_out`` is never read."""
    r = run(q_only(MXFP4_SPELLINGS[3], with_weights=False))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_mxfp4_q"]
    GOLDEN.check(r.report.graph, "q_side_without_weights_gets_a_dummy")


def test_k_side_alone_with_fewer_slots_than_rows():
    """slot_mapping has Tk' < Tk rows: the op inserts ``k[:Tk']`` at ``k_positions[:Tk']``."""
    r = run(k_only(MXFP4_SPELLINGS[1]), make_inputs(num_inserted=3))
    assert_same_as_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_mxfp4_k"]
    GOLDEN.check(r.report.graph, "k_side_alone_with_fewer_slots_than_rows")


def test_two_layers_pair_their_own_weights():
    """Two layers in one graph: two calls, each taking the weights product of its layer
    (graph order), each layer's outputs exactly eager's."""
    a, b = MXFP4_SPELLINGS[0], MXFP4_SPELLINGS[1]

    def fn(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        first = prep(a)(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache)
        q2, w2, k2 = q.flip(0).contiguous(), weights * 2, k.flip(0).contiguous()
        second = model.indexer_q_prep(q2, w2, positions, cos_sin_cache, 0.5, b)
        model.indexer_k_insert(k2, k_cache, slot_mapping.flip(0), k_positions, cos_sin_cache, BLOCK, b)
        return (*first, *second)

    r = run(fn)
    assert_same_as_eager(r)
    assert r.matched == 2 and r.events("matched") == ["dsv4_indexer_mxfp4_q+k"] * 2
    calls = [n for n in r.report.graph.splitlines() if "auto_functionalized_v2(" in n]
    # the second layer's (weights * 2) * 0.5 is weights times 1.0: one product of constants
    assert [("weights_scale=0.01" in c, "weights_scale=1.0" in c) for c in calls] == [(True, False), (False, True)]


def test_dynamic_token_count():
    """``mark_dynamic`` T: one graph, the scratch outputs sized by ``sym_size``, weights
    paired by symbolic shape; each T's bytes exactly eager's."""
    def layer(q, weights, *rest):
        # weights and q come from one hidden state in a model; here they are two inputs,
        # which Dynamo would give two size symbols unless told they are equal
        torch._check(weights.shape[0] == q.shape[0])
        return prep(MXFP4_SPELLINGS[0])(q, weights, *rest)

    backend = PrepfuseBackend({"passes": (PASS,), "record_graphs": True})
    fn = torch.compile(layer, fullgraph=True, backend=backend)
    for num_tokens in (7, 12):
        inputs = make_dsv4_indexer_inputs("mxfp4", num_tokens, H, BLOCK, "cpu", num_k=TK, skip_fraction=0.0)
        inputs = plant_hard_values(dataclasses.replace(inputs, k_cache=indexer_mxfp4_cache(inputs.k_cache.shape[0], BLOCK)))
        for t in (inputs.q, inputs.weights, inputs.positions):
            torch._dynamo.mark_dynamic(t, 0)
        cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
        rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
        out = fn(inputs.q, inputs.weights, inputs.k, cache, *rest)
        ref = prep(MXFP4_SPELLINGS[0])(inputs.q, inputs.weights, inputs.k, ref_cache, *rest)
        assert_same_as_eager(Run(out, cache, ref, ref_cache, None))
    (report,) = backend.reports  # one graph for both token counts
    assert report.matched_counts[PASS] == 1
    assert "sym_size" in report.graph and "weights=arg" in report.graph


# where Inductor drops the bf16 round trip (CUDA), the real spellings' graph is this
# look-alike's, and the pass fuses it within the probes' bounds (``compare.Quantized``)

@pytest.mark.parametrize("name", [n for n in LOOKALIKES if n != "no_bf16_round"])
def test_lookalikes_are_left_alone(name, caplog):
    with caplog.at_level(logging.DEBUG, logger="prepfuse.passes"):
        r = run(prep(LOOKALIKES[name]))
    assert r.matched == 0
    declined = r.events("declined")
    assert [p for p, _ in declined] == ["dsv4_indexer_mxfp4_q", "dsv4_indexer_mxfp4_k"], declined
    why = {
        "ties_away": "where every spelling of the math gives the same bytes",  # a tie rule, in the unrotated blocks
        "sign_lt": "differs",
        "neox_rope": "differs",
        "amax_floor_1e-4": "differs",
    }[name]
    assert all(why in w for _, w in declined), declined
    assert sum(why in rec.getMessage() for rec in caplog.records) == 2  # logged at DEBUG, both sides
    assert DSV4_INDEXER_ROPE_MXFP4_INSERT.name() not in r.report.graph
    # Inductor's code for the unfused math against eager
    assert_nope_exact_rope_close(r.out, r.ref_out, r.cache, r.ref_cache)


def test_quantising_the_unrounded_rotation_fuses_within_one_code():
    """Quantising the fp32 rotation without ``.to(bf16).float()`` (every real spelling's graph
    on CUDA, where Inductor drops the round trip): the op rounds to bf16 first, which moves a
    rotated value by at most one step of its grid (and a block's scale by a power of two, with
    its codes, where the rounding moves the amax across one); the unrotated blocks are the same
    bytes either way. Within the probes' bounds, so the pass fuses it, and the fused op gives
    the rounded spelling's eager result exactly."""
    spelling = LOOKALIKES["no_bf16_round"]
    inputs = make_inputs()
    r = run(prep(spelling), inputs)
    assert r.matched == 1 and r.events("matched") == ["dsv4_indexer_mxfp4_q+k"], r.events("declined")
    harness.assert_same_as_rounded_eager(r, model, spelling, inputs)


def assert_nope_exact_rope_close(out, ref_out, cache, ref_cache, block_size: int = BLOCK) -> None:
    """The NoPE half (dims 0..63, the planted ties, -0.0 and tiny block among them) goes
    through the same comparisons on the same values: identical bytes. On the RoPE half a
    product contracted into an FMA (Inductor's code, eager CUDA's complex multiply) now and
    then lands on the next bf16, and bf16 values often sit on an e2m1 midpoint or set a
    block's amax: about 1 byte in 50 there differs (3% seen), 1 in 10 allowed (garbage
    would differ in most). Weights: identical."""
    (packed, scale_bytes, w), (ref_packed, ref_scale_bytes, ref_w) = out, ref_out
    for part in range(2):  # 0: NoPE, 1: RoPE
        pairs = [(packed[..., 32 * part: 32 * (part + 1)], ref_packed[..., 32 * part: 32 * (part + 1)]),
                 (scale_bytes[..., 2 * part: 2 * (part + 1)], ref_scale_bytes[..., 2 * part: 2 * (part + 1)]),
                 (cache_half(cache, part, block_size), cache_half(ref_cache, part, block_size))]
        for got, want in pairs:
            differ = int((got != want).sum())
            assert differ == 0 if part == 0 else differ <= max(2, got.numel() // 10), (part, differ)
    assert torch.equal(w.view(torch.int32), ref_w.view(torch.int32))


def cache_half(cache: torch.Tensor, part: int, block_size: int = BLOCK) -> torch.Tensor:
    """The bytes of every cache slot that hold NoPE (``part`` 0) or RoPE (1) dims: half of its
    64 packed bytes, half of its 4 scale bytes (unwritten slots are zeros in both runs)."""
    blocks = cache[:, : block_size * 68]
    data = blocks[:, : block_size * 64].unflatten(1, (block_size, 64))[..., 32 * part: 32 * (part + 1)]
    scales = blocks[:, block_size * 64:].unflatten(1, (block_size, 4))[..., 2 * part: 2 * (part + 1)]
    return torch.cat((data, scales), dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 1000])
@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_on_cuda(name, v2, num_tokens):
    """On CUDA the call is the Triton kernel, with the default pass list (in place). The
    strided RoPE spellings are eager's bytes exactly (separate products, as the kernel's
    ``mul.rn``); eager CUDA's complex multiply may contract a product and a sum into an
    FMA, so the complex ones are held to exact NoPE bytes and close RoPE bytes."""
    check_fused_on("cuda", SPELLINGS[name], v2, num_tokens)


def check_fused_on(device: str, spelling, v2: bool, num_tokens: int, num_heads: int = 64, block_size: int = 64) -> None:
    inputs = make_dsv4_indexer_inputs("mxfp4", num_tokens, num_heads, block_size, "cpu",
                                      num_k=max(1, num_tokens // 4), skip_fraction=0.0)
    inputs = plant_hard_values(dataclasses.replace(inputs, k_cache=indexer_mxfp4_cache(inputs.k_cache.shape[0], block_size)))
    inputs = dataclasses.replace(inputs, **{f: getattr(inputs, f).to(device) for f in
                                            ("q", "weights", "k", "k_cache", "slot_mapping", "positions", "k_positions",
                                             "cos_sin_cache")})
    backend = PrepfuseBackend({"strict": True, "auto_functionalized_v2": v2})
    fn = harness.prep(model, spelling, block_size)

    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    out = torch.compile(fn, backend=backend, fullgraph=True)(inputs.q, inputs.weights, inputs.k, cache, *rest)
    ref = fn(inputs.q, inputs.weights, inputs.k, ref_cache, *rest)
    (report,) = backend.reports
    assert report.matched_counts[PASS] == 1 and report.matched_counts["defunctionalize"] == 1
    # one call of q and k together, not one side of them (the other left to Inductor)
    assert [r.pattern for r in report.rewrites if r.pass_name == PASS and r.kind == "matched"] == [
        "dsv4_indexer_mxfp4_q+k"], [(r.pattern, r.why) for r in report.rewrites if r.pass_name == PASS]
    if spelling.rope == "strided" or device == "cpu":
        assert_same_as_eager(Run(out, cache, ref, ref_cache, None))
        return
    assert_nope_exact_rope_close([t.cpu() for t in out], [t.cpu() for t in ref], cache.cpu(), ref_cache.cpu(),
                                 block_size)


def test_registered_before_defunctionalize():
    names = list(registered_passes())
    assert names.index(PASS) < names.index("defunctionalize")
