"""The probes (``matching/probes.py``, ``compare.py``, ``search.py``): a family decides which
call computes a region by running candidates against it, and a rewrite is made only when one
agrees.

To show the probes catching what a family's structure alone would accept, each family's
test takes its cos/sin candidates and makes every one read cos where it should read sin
(``wrong_rope``; the candidates already hold both orders of the two operands, as the
structure cannot tell them apart): every call then differs from the code, the rewrite is
declined naming the closest candidate and the first value where it differs, and the
compiled code is Inductor's own, byte for byte against ``backend="inductor"``. With the
true candidates the same code fuses, which is what makes each test able to fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.backend import PrepfuseBackend, PrepfuseOptions
from prepfuse.fx_passes.matching import rope_operands
from prepfuse.fx_passes.rewrite.compare import Checked, compare
from prepfuse.fx_passes.rewrite.probes import NUM_PROBES, Mismatch
from prepfuse.fx_passes.fusion import dsv4, dsv4_indexer, gqa
from prepfuse.ops.dsv4_indexer_common import mxfp4_quant_reference
from tests.fx_passes.fusion import test_dsv4 as dsv4_tests
from tests.fx_passes.fusion import test_dsv4_indexer as indexer_tests
from tests.fx_passes.fusion import test_gqa as gqa_tests

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def wrong(forms):
    """Each cos/sin candidate with its sin operand replaced by its cos (a complex operand,
    which holds both, dropped)."""
    return [dataclasses.replace(f, sin=f.cos) if f.kind == "values"
            else dataclasses.replace(f, columns=(f.columns[0], f.columns[0], f.columns[2]))
            for f in forms if f.kind == "table" or f.sin is not None]


@pytest.fixture
def wrong_rope(monkeypatch):
    real = rope_operands.rope_forms
    for module in (gqa, dsv4, dsv4_indexer):
        monkeypatch.setattr(module, "rope_forms", lambda *a, **k: wrong(real(*a, **k)))


def gqa_case():
    case = gqa_tests.make_case(gqa_tests.SPELLINGS["qwen3-hf_fp32-slice-fp8"])
    return gqa_tests.prep(case), lambda: case.args(case.k_cache.clone(), case.v_cache.clone())


def dsv4_case():
    inputs = dsv4_tests.make_inputs()
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    return dsv4_tests.prep(dsv4_tests.DSV4_SPELLINGS[0]), lambda: (inputs.q, inputs.kv, inputs.k_cache.clone(), *rest)


def indexer_case():
    inputs = indexer_tests.make_inputs()
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    return indexer_tests.prep(indexer_tests.INDEXER_SPELLINGS[0]), lambda: (
        inputs.q, inputs.weights, inputs.k, inputs.k_cache.clone(), *rest)


FAMILIES = {
    # family: (case, the pass)
    "gqa": (gqa_case, "fuse_gqa_prep"),
    "dsv4": (dsv4_case, "fuse_dsv4_prep"),
    "dsv4_indexer": (indexer_case, "fuse_dsv4_indexer_prep"),
}


def tensors(out, args) -> list[torch.Tensor]:
    """Every output tensor, then every argument tensor (the caches the code wrote)."""
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [t for t in outs + list(args) if isinstance(t, torch.Tensor)]


def compiled(fn, make_args, backend):
    torch._dynamo.reset()
    args = make_args()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return tensors(out, args)


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_wrong_candidates_are_declined_by_the_probes(family, wrong_rope):
    make_case, pass_name = FAMILIES[family]
    fn, make_args = make_case()
    inductor = compiled(fn, make_args, "inductor")
    backend = PrepfuseBackend({"passes": (pass_name,), "record_graphs": True})
    probed = compiled(fn, make_args, backend)
    (report,) = backend.reports
    assert report.matched_counts[pass_name] == 0 and not report.ops_after
    reasons = [r.why for r in report.near_misses()]
    assert reasons and all(why.startswith("closest: ") and " differs at [" in why and ", the code gives " in why
                           for why in reasons), reasons
    assert same_bytes(probed, inductor)  # declined means Inductor's code for the model, byte for byte


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_true_candidates_validate(family):
    """With the true candidates the same code fuses and says which call it validated."""
    make_case, pass_name = FAMILIES[family]
    fn, make_args = make_case()
    backend = PrepfuseBackend({"passes": (pass_name,), "record_graphs": True})
    compiled(fn, make_args, backend)
    (report,) = backend.reports
    (match,) = report.matches()
    assert match.pass_name == pass_name and match.why.startswith(f"validated on {NUM_PROBES} probes: ")
    assert "RoPE on " in match.why


def test_validate_option():
    with pytest.raises(ValueError, match="validate: expected one of 'probe', 'quick'"):
        PrepfuseOptions(validate="off")
    probe, quick = (PrepfuseBackend({"validate": v}).pass_manager() for v in ("probe", "quick"))
    assert probe.uuid() != quick.uuid()
    assert {p.validate for p in quick.passes} == {"quick"} and {p.validate for p in probe.passes} == {"probe"}


def test_quick_runs_the_unit_scale_probe_alone():
    fn, make_args = gqa_case()
    backend = PrepfuseBackend({"passes": ("fuse_gqa_prep",), "validate": "quick"})
    compiled(fn, make_args, backend)
    (match,) = backend.reports[0].matches()
    assert match.why.startswith("validated on 1 probes: ")


# --------------------------------------------------------------------------------------
# The bounds (``compare.py``)
# --------------------------------------------------------------------------------------
def _fp8(values) -> torch.Tensor:
    """fp8 values from floats, NaN as the NaN code of its sign (0x7F, 0xFF)."""
    t = torch.tensor(values)
    codes = t.nan_to_num(0.0).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_codes = torch.where(t.signbit(), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(t.isnan(), nan_codes, codes).view(torch.float8_e4m3fn)


NAN, NEG_NAN = float("nan"), -float("nan")
K_CACHE = Checked("k_cache", None, None)


def check(got, want, probe=1, checked=K_CACHE, values=None):
    compare(checked, got, want, probe, values or {})


def test_nan_past_448_is_one_step_where_both_casts_give_nan():
    """Two non-saturating casts a bf16 ULP apart at 464 put one value on either side: NaN
    against 448 counts as the one e4m3 step it is; a saturating cast against a
    non-saturating one (448 where the other gives NaN at every overflow) is still a mismatch."""
    region = [NAN] * 8 + [NEG_NAN] * 8 + [1.0, 448.0]
    near_464 = [NAN] * 8 + [NEG_NAN] * 8 + [1.0, NAN]  # the last value a ULP past 464 here
    check(_fp8(near_464).reshape(1, -1), _fp8(region).reshape(1, -1))
    check(_fp8(region).reshape(1, -1), _fp8(near_464).reshape(1, -1))
    saturating = [448.0] * 8 + [-448.0] * 8 + [1.0, 448.0]
    for got, want in ((saturating, region), (region, saturating)):
        with pytest.raises(Mismatch, match="k_cache differs"):
            check(_fp8(got).reshape(1, -1), _fp8(want).reshape(1, -1))
    wrong_sign = [NAN] * 8 + [NEG_NAN] * 8 + [1.0, NEG_NAN]
    with pytest.raises(Mismatch, match="k_cache differs"):
        check(_fp8(wrong_sign).reshape(1, -1), _fp8(region).reshape(1, -1))


def test_a_byte_cache_of_e4m3_codes_is_compared_as_fp8_values():
    """A uint8 cache holding e4m3fn codes (vLLM's "fp8" cache) is compared as the values it
    decodes to: codes 0x13 and 0x15 are two steps apart as bytes, and well inside the bound
    of a row whose largest value is 448."""
    want = torch.tensor([[0x13, 0x7E]], dtype=torch.uint8)
    got = torch.tensor([[0x15, 0x7E]], dtype=torch.uint8)
    with pytest.raises(Mismatch, match="bound one code step"):
        check(got, want, probe=0)
    check(got, want, probe=0, checked=Checked("k_cache", None, None, decode=torch.float8_e4m3fn))


def test_a_buffer_of_several_encodings_is_compared_part_by_part():
    """A decoder returning named parts (a DeepSeek-V4 cache row: codes, bf16 values, scale
    bytes) holds each part to its own rule, and names the part that differs."""
    decode = lambda t: {"values": t[:, :4].contiguous().view(torch.bfloat16), "bytes": t[:, 4:]}  # noqa: E731
    want = torch.cat([torch.tensor([[1.0, 2.0]]).bfloat16().view(torch.uint8), torch.tensor([[7, 9]], dtype=torch.uint8)], 1)
    got = want.clone()
    got[0, 5] = 20
    with pytest.raises(Mismatch, match=r"k_cache \(bytes\) differs at \[0, 1\]"):
        check(got, want, checked=Checked("k_cache", None, None, decode=decode))
    check(want.clone(), want, checked=Checked("k_cache", None, None, decode=decode))


def test_an_fp8_rows_nan_counts_as_448_for_its_bound():
    """A row a non-saturating cast overflowed (NaN codes) still holds values past 448: the
    bound of its other values is 2^-6 of 448 plus one step, as in the saturated row."""
    want = _fp8([NAN] * 8 + [36.0]).reshape(1, -1)
    with pytest.raises(Mismatch, match="k_cache differs"):  # 14 apart: outside 448 / 64 + 36 / 8 = 11.5
        check(_fp8([NAN] * 8 + [22.0]).reshape(1, -1), want)
    check(_fp8([NAN] * 8 + [28.0]).reshape(1, -1), want)  # 8 apart: inside
    with pytest.raises(Mismatch, match="k_cache differs"):  # a row of small values keeps its small bound
        check(_fp8([1.0] * 8 + [28.0]).reshape(1, -1), _fp8([1.0] * 8 + [36.0]).reshape(1, -1))


def test_a_saturated_fp8_row_is_bounded_by_its_values_before_the_cast():
    """22 against 36 in a row of 448s (wide projections' fp8 edge probes): outside the bound
    of 448, inside that of the rows' largest |value| before the cast (2300: 36 + 4.5), which
    only a row the cast saturated takes; a row of small values keeps its own bound."""
    rows = torch.fx.Graph().placeholder("rows")
    before = Checked("k_cache", None, None, before_cast=((rows, None),))
    want = _fp8([448.0] * 8 + [36.0]).reshape(1, -1)
    got = _fp8([448.0] * 8 + [22.0]).reshape(1, -1)
    with pytest.raises(Mismatch, match="k_cache differs"):
        check(got, want)
    check(got, want, checked=before, values={rows: torch.tensor([2300.0])})
    with pytest.raises(Mismatch, match="k_cache differs"):  # 26 apart: outside 1000 / 64 + 36 / 8 = 20.1
        check(_fp8([448.0] * 8 + [10.0]).reshape(1, -1), want, checked=before, values={rows: torch.tensor([1000.0])})
    with pytest.raises(Mismatch, match="k_cache differs"):
        check(_fp8([1.0] * 8 + [22.0]).reshape(1, -1), _fp8([1.0] * 8 + [36.0]).reshape(1, -1), checked=before,
              values={rows: torch.tensor([2300.0])})


def _mxfp4_q_checked():
    return Checked("q_out", "region_q", "call_q", decode=dsv4_indexer._mxfp4_q, scales=("region_scales", "call_scales"))


def test_mxfp4_codes_are_compared_as_values_with_their_block_scales():
    """A rotated block whose amax sits a hair above 6 * 2^k before the code's bf16 rounding
    (which Inductor drops on CUDA) has scale 2^(k+1) in the graph and 2^k in the op: its codes
    differ by a factor of two (code 2 against 4: two steps as nibbles), its values by at most
    one step of the coarser grid. A value off by more (the wrong pairs rotated) is not."""
    torch.manual_seed(0)
    x = torch.randn(2, 128)
    x[:, 64] = 3.0 * (1 + 2.0**-12)  # block 2's amax: above 6 * 2^-1, and 3.0 once rounded to bf16
    x[:, 65] = 1.0  # code 2 at scale 2^0 in the graph, code 4 at scale 2^-1 in the op
    unrounded, rounded = mxfp4_quant_reference(x), mxfp4_quant_reference(x.bfloat16().float())
    assert not torch.equal(unrounded[1], rounded[1])  # block 2's scale byte moved
    assert int(((unrounded[0] & 0xF).int() - (rounded[0] & 0xF).int()).abs().max()) > 1  # beyond one nibble step
    region = {"region_scales": unrounded[1]}
    call = {"call_scales": rounded[1]}
    compare(_mxfp4_q_checked(), rounded[0], unrounded[0], 0, region, call)
    swapped = x.bfloat16().float()
    swapped[:, 64:] = swapped[:, 64:].roll(1, dims=-1)  # the wrong pairs
    wrong = mxfp4_quant_reference(swapped)
    with pytest.raises(Mismatch, match=r"q_out \(rotated values\) differs"):
        compare(_mxfp4_q_checked(), wrong[0], unrounded[0], 0, region, {"call_scales": wrong[1]})
    minus_zero = rounded[0].clone()
    row, col = (int(i) for i in ((minus_zero[:, 32:] & 0xF) == 0).nonzero()[0])  # a rotated +0 (low nibble)
    minus_zero[row, 32 + col] |= 0x8  # made -0
    with pytest.raises(Mismatch, match="a zero's sign exact"):  # a rounding never moves it: a sign rule
        compare(_mxfp4_q_checked(), minus_zero, rounded[0], 0, {"region_scales": rounded[1]}, call)
    bad_nope = rounded[0].clone()
    bad_nope[0, 0] ^= 0x1  # an unrotated block is the bf16 input scaled: bit for bit
    with pytest.raises(Mismatch, match=r"q_out \(unrotated blocks\) differs"):
        compare(_mxfp4_q_checked(), bad_nope, unrounded[0], 0, region, call)
