"""DeepSeek-V4's prep writing vLLM's bf16 full-row cache, however the rows are written.

q normed and rotated (``models.dsv4.dsv4_q_prep``), kv rotated and written whole as bf16
rows into ``[blocks, block_size, 512]``: by (block, row), through the flat view by slot,
by ``index_copy_`` into the flat view, and the first ``len(slots)`` of more tokens (data
parallel padding). Each fuses both sides into one ``dsv4_qnorm_rope_kv_full_row_insert``
call; q equals eager within 2^-6 of each row's largest value, the written rows likewise,
every other cache row bit for bit. Per-tensor e4m3 rows (``rows / scale`` or ``rows * inv``,
saturated) fuse too, and so does q cast to e4m3 over its own scale beside them; rows cast without
a clamp fuse where torch's cast saturates, and are other math where it makes NaN. kv rotated by halves where q is rotated by pairs is other
math: q fuses alone, the kv write is declined naming the cache, and stays Inductor's.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse._compat import e4m3_cast_overflow
from prepfuse.backend import PrepfuseBackend
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4Spelling, cos_sin, dsv4_q_prep, rope, split_rope_dims
from prepfuse.testing import max_row_rel_diff

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, H, HP, BLOCKS, BLOCK, EPS = 6, 3, 4, 4, 8, 1e-6
SPELLING = DSV4_SPELLINGS[0]
NEOX = Dsv4Spelling("neox", rope="neox")


def rotated_rows(kv, positions, n):
    """kv's first ``n`` rows with their last 64 dims rotated, bf16."""
    nope, pe = split_rope_dims(kv[:n].float(), SPELLING)
    cos, sin = cos_sin(TABLE, positions[:n])
    return torch.cat((nope, rope(pe, cos, sin, SPELLING)), -1).to(kv.dtype)


def by_block_and_row(q, kv, positions, slots, cache):
    cache[slots // BLOCK, slots % BLOCK] = rotated_rows(kv, positions, slots.shape[0])
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def by_slot_of_the_flat_view(q, kv, positions, slots, cache):
    cache.view(-1, 512)[slots] = rotated_rows(kv, positions, slots.shape[0])
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def by_index_copy(q, kv, positions, slots, cache):
    cache.view(-1, 512).index_copy_(0, slots, rotated_rows(kv, positions, slots.shape[0]))
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def first_rows_of_padded_tokens(q, kv, positions, slots, cache):
    """Two more tokens than slots: the first ``len(slots)`` rows are written."""
    cache[slots[:-2] // BLOCK, slots[:-2] % BLOCK] = rotated_rows(kv, positions, slots.shape[0] - 2)
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def e4m3_rows_divided(q, kv, positions, slots, cache, scale):
    """vLLM's per-tensor fp8 full-row cache: the rotated rows over one scale, saturated."""
    rows = rotated_rows(kv, positions, slots.shape[0]).float() / scale
    cache[slots // BLOCK, slots % BLOCK] = rows.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def e4m3_rows_times_inverse(q, kv, positions, slots, cache, scale):
    """The same with the inverse scale given (``rows * inv``), through the flat view."""
    rows = rotated_rows(kv, positions, slots.shape[0]).float() * scale
    cache.view(-1, 512)[slots] = rows.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def e4m3_rows_not_saturated(q, kv, positions, slots, cache, scale):
    """No clamp: what a row past 448 becomes is the cast's (``_compat.e4m3_cast_overflow``)."""
    rows = rotated_rows(kv, positions, slots.shape[0]).float() / scale
    cache[slots // BLOCK, slots % BLOCK] = rows.to(torch.float8_e4m3fn)
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


def e4m3_q_and_rows(q_scaling):
    """e4m3 rows over one scale and q cast to e4m3 over its own (``q * q_scale_inv`` or
    ``q / q_scale``, saturated), as vLLM's fp8 full-cache path leaves both: the e4m3 q returned."""
    def fn(q, kv, positions, slots, cache, scale, q_scale):
        rows = rotated_rows(kv, positions, slots.shape[0]).float() / scale
        cache[slots // BLOCK, slots % BLOCK] = rows.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        prepared = dsv4_q_prep(q, positions, TABLE, EPS, H, SPELLING).float()
        prepared = prepared * q_scale if q_scaling == "multiply" else prepared / q_scale
        return prepared.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return fn


def neox_kv(q, kv, positions, slots, cache):
    """kv's rotation by halves (NeoX) where q's is GPT-J's: other math than the op's."""
    nope, pe = split_rope_dims(kv.float(), SPELLING)
    cos, sin = cos_sin(TABLE, positions)
    rows = torch.cat((nope, rope(pe, cos, sin, NEOX)), -1).to(kv.dtype)
    cache[slots // BLOCK, slots % BLOCK] = rows
    return dsv4_q_prep(q, positions, TABLE, EPS, HP, SPELLING)


TABLE = None  # the fp32 [P, 64] cos/sin table, set by inputs()


def inputs(seed=5):
    global TABLE
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(64, 32, generator=gen) * 6.28
    TABLE = torch.cat((angles.cos(), angles.sin()), -1)
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16)
    kv = torch.randn(T, 512, generator=gen).to(torch.bfloat16)
    positions = torch.arange(T) + 5
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:T]
    cache = torch.randn(BLOCKS, BLOCK, 512, generator=gen).to(torch.bfloat16)
    return q, kv, positions, slots, cache


def compiled_and_eager(fn, *scale):
    q, kv, positions, slots, cache = inputs()
    if scale:
        cache = cache.float().to(torch.float8_e4m3fn)
    got, want = cache.clone(), cache.clone()
    backend = PrepfuseBackend()
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, kv, positions, slots, got, *scale)
    ref = fn(q, kv, positions, slots, want, *scale)
    return backend.reports, (out, got), (ref, want), slots


@pytest.mark.parametrize("fn", [by_block_and_row, by_slot_of_the_flat_view, by_index_copy, first_rows_of_padded_tokens])
def test_both_sides_fuse_into_the_full_row_op(fn):
    reports, (out, got), (ref, want), slots = compiled_and_eager(fn)
    assert reports.pattern_counts().get("dsv4_q+kv_full_row") == 1, reports.format(verbose=True)
    assert max_row_rel_diff([out], [ref]) <= 2**-6
    written = torch.zeros(BLOCKS * BLOCK, dtype=torch.bool)
    written[slots[: (slots.shape[0] - 2 if fn is first_rows_of_padded_tokens else None)]] = True
    rows, ref_rows = got.flatten(0, 1), want.flatten(0, 1)
    assert max_row_rel_diff([rows[written]], [ref_rows[written]]) <= 2**-6
    assert torch.equal(rows[~written], ref_rows[~written])


@pytest.mark.parametrize("fn,scale", [(e4m3_rows_divided, 0.02), (e4m3_rows_times_inverse, 50.0)],
                         ids=["divided", "times_inverse"])
def test_e4m3_full_rows_fuse(fn, scale):
    """Per-tensor e4m3 rows: the op's product with the rounded reciprocal against the code's
    quotient, each written value within one e4m3 step of eager's, every other row bit for bit."""
    reports, (out, got), (ref, want), slots = compiled_and_eager(fn, torch.tensor([scale]))
    assert reports.pattern_counts().get("dsv4_q+kv_full_row") == 1, reports.format(verbose=True)
    assert max_row_rel_diff([out], [ref]) <= 2**-6
    rows, ref_rows = got.flatten(0, 1).float(), want.flatten(0, 1).float()
    written = torch.zeros(rows.shape[0], dtype=torch.bool)
    written[slots] = True
    assert ((rows[written] - ref_rows[written]).abs() <= ref_rows[written].abs() * 2**-3 + 2**-9).all()
    assert torch.equal(got.flatten(0, 1)[~written].view(torch.uint8), want.flatten(0, 1)[~written].view(torch.uint8))


@pytest.mark.parametrize("q_scaling,q_scale", [("multiply", 20.0), ("divide", 0.05)])
def test_e4m3_q_fuses_with_e4m3_rows(q_scaling, q_scale):
    """An e4m3 q beside e4m3 rows: one full-row call writes both (its ``q_scale_inv`` the
    code's factor, or the reciprocal of its divisor); q within one e4m3 step of eager's (the
    op rounds once, from fp32, where the code rounds to bf16 first), the rows likewise."""
    fn = e4m3_q_and_rows(q_scaling)
    reports, (out, got), (ref, want), slots = compiled_and_eager(fn, torch.tensor([0.02]), torch.tensor([q_scale]))
    assert reports.pattern_counts().get("dsv4_q+kv_full_row") == 1, reports.format(verbose=True)
    (report,) = reports
    assert ("e4m3 q * a scale" if q_scaling == "multiply" else "e4m3 q / q_scale") in report.matches()[0].why
    assert out.dtype == torch.float8_e4m3fn
    a, b = out.float(), ref.float()
    assert ((a - b).abs() <= b.abs() * 2**-3 + b.abs().amax(-1, keepdim=True) * 2**-6).all()
    rows, ref_rows = got.flatten(0, 1).float(), want.flatten(0, 1).float()
    assert ((rows[slots] - ref_rows[slots]).abs() <= ref_rows[slots].abs() * 2**-3 + 2**-9).all()


def test_e4m3_rows_cast_without_a_clamp_fuse_only_where_the_cast_saturates():
    """The op saturates; a bare cast is the same math where torch's cast saturates too (the
    CPU's), else NaN past 464, other math, declined by the edge probe's overflowing rows."""
    saturates = e4m3_cast_overflow("cpu") == "saturate"
    reports, _, _, _ = compiled_and_eager(e4m3_rows_not_saturated, torch.tensor([0.02]))
    assert ("dsv4_q+kv_full_row" in reports.pattern_counts()) == saturates, reports.format(verbose=True)
    if not saturates:
        assert any("k_cache differs" in m.why for m in reports.near_misses()), reports.format(verbose=True)


def test_rows_of_other_math_are_declined_and_stay_inductors():
    """q fuses alone; the kv write is declined naming the cache, its bytes Inductor's."""
    reports, (out, got), (ref, _), _ = compiled_and_eager(neox_kv)
    counts = reports.pattern_counts()
    assert counts.get("dsv4_q") == 1 and "dsv4_q+kv_full_row" not in counts, reports.format(verbose=True)
    assert any("k_cache differs" in m.why for m in reports.near_misses()), reports.format(verbose=True)
    assert max_row_rel_diff([out], [ref]) <= 2**-6
    torch._dynamo.reset()
    q, kv, positions, slots, cache = inputs()
    inductor = cache.clone()
    torch.compile(neox_kv, backend="inductor", fullgraph=True)(q, kv, positions, slots, inductor)
    assert torch.equal(got, inductor)
