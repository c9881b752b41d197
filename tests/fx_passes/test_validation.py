"""Translation validation (``validate="probe"``, the default): a rewrite is made only when the
fused call and the code it replaces agree on probes.

To show it catching what the structure alone would accept, each family's test plants a
recogniser bug (``blind_paged_slots``: the block-row index of a cache write is taken to be
``slot % block_size`` without checking whose slots it reads) and compiles model code that
bug misreads: each row written one row further into its block (``(slot + 1) % bs``, the
``cache_row_offset_by_one`` look-alikes). With validation the rewrite is declined, the
report says where the values differ, and the compiled code is Inductor's own, byte for byte
against ``backend="inductor"``; with ``validate="off"`` the blind match goes through and
the cache is wrong, which is what makes each test able to fail.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend, PrepfuseOptions
from prepfuse.fx_passes.fusion import gqa_patterns
from prepfuse.fx_passes.matching import cache_writes
from prepfuse.fx_passes.matching.recognizers import NoMatch
from prepfuse.fx_passes.matching.validation import NUM_PROBES
from prepfuse.models import dsv4_indexer as indexer_model
from prepfuse.models.dsv4_indexer import IndexerSpelling
from tests.fx_passes.fusion import indexer_harness
from tests.fx_passes.fusion import test_dsv4 as dsv4
from tests.fx_passes.fusion import test_dsv4_indexer as indexer
from tests.fx_passes.fusion import test_gqa as gqa

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def blind_paged_slots(indices, block_size: int):
    """The planted recogniser bug: ``slots`` of ``(slots // bs, <anything>)``."""
    blk, _ = indices
    return blk.args[0]


@pytest.fixture
def blind_recogniser(monkeypatch):
    monkeypatch.setattr(gqa_patterns, "paged_slots", blind_paged_slots)
    monkeypatch.setattr(cache_writes, "paged_slots", blind_paged_slots)


def gqa_case():
    case = gqa.make_case(gqa.LOOKALIKES["cache_row_offset_by_one"])
    return gqa.prep(case), lambda: case.args(case.k_cache.clone(), case.v_cache.clone())


def dsv4_case():
    inputs = dsv4.make_inputs()
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    return dsv4.prep(dsv4.LOOKALIKES["cache_row_offset_by_one"]), lambda: (
        inputs.q, inputs.kv, inputs.k_cache.clone(), *rest)


def indexer_case():
    inputs = indexer.make_inputs()
    spelling = IndexerSpelling("cache_row_offset_by_one", write="columns_next_row", scales="bytes")
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    return indexer_harness.prep(indexer_model, spelling), lambda: (
        inputs.q, inputs.weights, inputs.k, inputs.k_cache.clone(), *rest)


FAMILIES = {
    # family: (case, the pass, the declined pattern)
    "gqa": (gqa_case, "fuse_gqa_prep", "gqa"),
    "dsv4": (dsv4_case, "fuse_dsv4_prep", "dsv4_q+kv"),
    "dsv4_indexer": (indexer_case, "fuse_dsv4_indexer_prep", "dsv4_indexer_q+k"),
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
def test_a_look_alike_the_structure_accepts_is_declined_by_validation(family, blind_recogniser):
    make_case, pass_name, pattern = FAMILIES[family]
    fn, make_args = make_case()
    inductor = compiled(fn, make_args, "inductor")

    backend = PrepfuseBackend({"passes": (pass_name,), "record_graphs": True})
    probed = compiled(fn, make_args, backend)
    (report,) = backend.reports
    assert report.matched_counts[pass_name] == 0 and not report.ops_after
    declined = [(r.pattern, r.why) for r in report.near_misses() if r.why.startswith("validation:")]
    assert len(declined) == 1 and declined[0][0] == pattern, report.near_misses()
    why = declined[0][1]
    assert why.startswith("validation: k_cache differs at [") and ", region gives " in why, why
    assert same_bytes(probed, inductor)  # declined means Inductor's code for the model, byte for byte

    unchecked = PrepfuseBackend({"passes": (pass_name,), "validate": "off"})
    wrong = compiled(fn, make_args, unchecked)
    assert unchecked.reports[0].matched_counts[pass_name] == 1  # the blind recogniser's rewrite went in
    assert not same_bytes(wrong, inductor)  # and the cache it wrote is not the model's


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_true_spelling_validates(family):
    """Without the planted bug the same pass fuses its first spelling and says it validated."""
    _, pass_name, _ = FAMILIES[family]
    spelling_case = {
        "gqa": lambda: gqa.run(gqa.prep, gqa.make_case(gqa.GQA_SPELLINGS[0])),
        "dsv4": lambda: dsv4.run(dsv4.prep(dsv4.DSV4_SPELLINGS[0])),
        "dsv4_indexer": lambda: indexer.run(indexer.prep(indexer.INDEXER_SPELLINGS[0])),
    }[family]
    r = spelling_case()
    (match,) = r.report.matches()
    assert match.pass_name == pass_name and match.why == f"validated on {NUM_PROBES} probes"
    assert f"validated on {NUM_PROBES} probes" in r.report.format()


def test_validate_option():
    with pytest.raises(ValueError, match="validate: expected one of 'probe', 'off'"):
        PrepfuseOptions(validate="yes")
    probe, off = (PrepfuseBackend({"validate": v}).pass_manager() for v in ("probe", "off"))
    assert probe.uuid() != off.uuid()
    assert {p.validate for p in off.passes} == {"off"} and {p.validate for p in probe.passes} == {"probe"}


def _fp8(values) -> torch.Tensor:
    """fp8 values from floats, NaN as the NaN code of its sign (0x7F, 0xFF)."""
    t = torch.tensor(values)
    codes = t.nan_to_num(0.0).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_codes = torch.where(t.signbit(), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(t.isnan(), nan_codes, codes).view(torch.float8_e4m3fn)


NAN, NEG_NAN = float("nan"), -float("nan")


def test_nan_past_448_is_one_step_where_both_casts_give_nan():
    """Two non-saturating casts a bf16 ULP apart at 464 put one value on either side: NaN
    against 448 counts as the one e4m3 step it is; a saturating cast against a
    non-saturating one (448 where the other gives NaN at every overflow) is still a mismatch."""
    from prepfuse.fx_passes.matching.validation import _compare

    region = [NAN] * 8 + [NEG_NAN] * 8 + [1.0, 448.0]
    near_464 = [NAN] * 8 + [NEG_NAN] * 8 + [1.0, NAN]  # the last value a ULP past 464 here
    _compare("k_cache", _fp8(near_464).reshape(1, -1), _fp8(region).reshape(1, -1), probe=1)
    _compare("k_cache", _fp8(region).reshape(1, -1), _fp8(near_464).reshape(1, -1), probe=1)
    saturating = [448.0] * 8 + [-448.0] * 8 + [1.0, 448.0]
    for got, want in ((saturating, region), (region, saturating)):
        with pytest.raises(NoMatch, match="k_cache differs"):
            _compare("k_cache", _fp8(got).reshape(1, -1), _fp8(want).reshape(1, -1), probe=1)
    wrong_sign = [NAN] * 8 + [NEG_NAN] * 8 + [1.0, NEG_NAN]
    with pytest.raises(NoMatch, match="k_cache differs"):
        _compare("k_cache", _fp8(wrong_sign).reshape(1, -1), _fp8(region).reshape(1, -1), probe=1)


def test_a_byte_cache_of_e4m3_codes_is_compared_as_fp8_values():
    """A uint8 cache holding e4m3fn codes (vLLM's "fp8" cache) is compared as the values
    (``codes``): codes 0x13 and 0x15 are two steps apart as bytes, and well inside the
    bound of a row whose largest value is 448."""
    from prepfuse.fx_passes.matching.validation import _compare

    want = torch.tensor([[0x13, 0x7E]], dtype=torch.uint8)
    got = torch.tensor([[0x15, 0x7E]], dtype=torch.uint8)
    with pytest.raises(NoMatch, match="bound one code step"):
        _compare("k_cache", got, want, probe=0)
    _compare("k_cache", got, want, probe=0, codes=torch.float8_e4m3fn)


def test_an_fp8_rows_nan_counts_as_448_for_its_bound():
    """A row a non-saturating cast overflowed (NaN codes) still holds values past 448: the
    bound of its other values is 2^-6 of 448 plus one step, as in the saturated row."""
    from prepfuse.fx_passes.matching.validation import _compare

    want = _fp8([NAN] * 8 + [36.0]).reshape(1, -1)
    got = _fp8([NAN] * 8 + [22.0]).reshape(1, -1)  # 14 apart: inside 448 / 64 + 36 / 8 = 11.5? no
    with pytest.raises(NoMatch, match="k_cache differs"):
        _compare("k_cache", got, want, probe=1)
    _compare("k_cache", _fp8([NAN] * 8 + [28.0]).reshape(1, -1), want, probe=1)  # 8 apart: inside
    with pytest.raises(NoMatch, match="k_cache differs"):  # a row of small values keeps its small bound
        _compare("k_cache", _fp8([1.0] * 8 + [28.0]).reshape(1, -1), _fp8([1.0] * 8 + [36.0]).reshape(1, -1), probe=1)


def test_a_saturated_fp8_row_is_bounded_by_its_values_before_the_cast():
    """22 against 36 in a row of 448s (the H200's Llama-3-8B-wide fp8 cases): outside the
    bound of 448, inside that of the rows' largest |value| before the cast (2300: 36 + 4.5),
    which only a row the cast saturated takes; a row of small values keeps its own bound."""
    from prepfuse.fx_passes.matching.validation import _compare

    want = _fp8([448.0] * 8 + [36.0]).reshape(1, -1)
    got = _fp8([448.0] * 8 + [22.0]).reshape(1, -1)
    with pytest.raises(NoMatch, match="k_cache differs"):
        _compare("k_cache", got, want, probe=1)
    _compare("k_cache", got, want, probe=1, before_cast=2300.0)
    with pytest.raises(NoMatch, match="k_cache differs"):  # 26 apart: outside 1000 / 64 + 36 / 8 = 20.1
        _compare("k_cache", _fp8([448.0] * 8 + [10.0]).reshape(1, -1), want, probe=1, before_cast=1000.0)
    with pytest.raises(NoMatch, match="k_cache differs"):
        _compare("k_cache", _fp8([1.0] * 8 + [22.0]).reshape(1, -1), _fp8([1.0] * 8 + [36.0]).reshape(1, -1),
                 probe=1, before_cast=2300.0)
