"""Serving engines' and reference projects' spellings of attention-input preparation
(``prepfuse.models.engine_clients``: vLLM's ``forward_native`` layers, SGLang's token pool,
gpt-fast, nano-vllm, FlashInfer's page table), written after reading theirs: what
``backend="prepfuse"`` fuses, against eager and against ``backend="inductor"``.

Per case: the exact number of fused calls and their pattern (or the near miss naming why
not), numerics, and for one case the golden post-pass graph and serving each T of
``RECOMPILE_TOKEN_COUNTS`` without a recompile. Numerics:
vLLM and SGLang rotate in bf16 (``cos.to(x.dtype)``); the fused op multiplies by the same
bf16 cos/sin in fp32 and rounds once, as Inductor's code for the unfused math does. So
against Inductor the written rows agree to a bf16 rounding (an fp8 row to one e4m3 step);
against eager by the rotation's bf16 roundings, ``2^-7 * (|a| + |b|)`` per rotated value,
bounded here per row as ``2^-6`` of its largest value (twice that for the second layer,
whose input carries the first layer's difference), and one e4m3 step more for fp8 rows
(``2^-3`` of the row's largest value covers both). Small shapes (T=7, 4 q heads, 2 kv
heads, D=64, two layers); the FX graph cache is off.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse._compat import e4m3_cast_overflow
from prepfuse.backend import PrepfuseBackend
from prepfuse.models.engine_clients import ENGINE_CASES, build_engine_client, engine_cache_rows
from prepfuse.testing import max_row_rel_diff
from prepfuse.testing.golden import GoldenFiles
from prepfuse.testing.passes import RECOMPILE_TOKEN_COUNTS

GOLDEN = GoldenFiles.beside(__file__)
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
CASES = {c.name: c for c in ENGINE_CASES}
PASS = "fuse_gqa_prep"
FP8 = torch.float8_e4m3fn
FP8_CODES = (FP8, torch.uint8)  # a uint8 cache holds e4m3fn codes (vLLM's "fp8" cache)


def run(case, backend, **build):
    """(output, every layer's written rows) of ``case`` compiled with ``backend`` (or eager
    for None), on the inputs ``build`` makes."""
    torch._dynamo.reset()
    model, (x, positions, slots, caches, kv_scale, block_size) = build_engine_client(case, **build)
    fn = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = fn(x, positions, slots, caches, kv_scale, block_size)
    return out, engine_cache_rows(case, caches, slots, block_size)


def saturated(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp8 rows with each NaN as the 448 of its sign: what a saturating cast stores where a
    non-saturating one (torch 2.11's eager CUDA cast, and the op with fp8_saturate=False)
    stores NaN. Inductor's own CUDA code for a bare cast saturates (torch 2.11: eager
    0x7F, Inductor 0x7E for 470), so rows are compared through this."""
    return [torch.where(r.isnan(), torch.copysign(torch.full_like(r, 448.0), r), r) for r in rows]


def assert_nans_agree(rows, ref_rows, seed) -> None:
    """The NaN codes two non-saturating casts store: the same, but for values a bf16 ULP
    apart at 464 (NaN on one side, 448 on the other: at most one in eight)."""
    for got, want in zip(rows, ref_rows):
        differ, agree = int((got.isnan() != want.isnan()).sum()), int((got.isnan() & want.isnan()).sum())
        assert 8 * differ <= agree or not differ, f"seed={seed}: {differ} NaN codes differ, {agree} agree"


@pytest.mark.parametrize("name", list(CASES))
def test_engine_spelling_fuses(name):
    case = CASES[name]
    backend = PrepfuseBackend()
    seed = int(torch.randint(0, 2**31, (1,)))
    out, rows = run(case, backend, seed=seed)
    report = backend.reports[0]
    expected_fused, expected_reason = case.expected_on("cpu")
    assert report.matched_counts.get(PASS, 0) == 2 * expected_fused, report.format(verbose=True)
    matched = [r.pattern for r in report.rewrites if r.pass_name == PASS and r.kind == "matched"]
    declined = [r.why for r in report.near_misses(PASS)]
    ref_out, ref_rows = run(case, None, seed=seed)
    if not expected_fused:  # declined by name; the code runs as Inductor compiles it
        assert declined and all(expected_reason in why for why in declined), declined
        # fp8 rows: Inductor rotates in fp32 where eager rounds in bf16, one e4m3 code apart
        bound = 2**-3 if case.cache_dtype in FP8_CODES else 2**-6
        assert max_row_rel_diff(rows, ref_rows) <= bound, f"seed={seed}"
        return
    assert matched == [case.pattern] * 2 and not declined, (matched, declined)
    fp8 = case.cache_dtype in FP8_CODES
    first, second = (2**-3, 2**-3) if fp8 else (2**-6, 2**-5)
    if fp8:
        assert_nans_agree(rows, ref_rows, seed)
        rows, ref_rows = saturated(rows), saturated(ref_rows)
    if case.bf16_rope or fp8:  # rows per layer: k, v of layer 0, then of layer 1
        assert max_row_rel_diff(rows[:2], ref_rows[:2]) <= first, f"seed={seed}"
        assert max_row_rel_diff(rows[2:], ref_rows[2:]) <= second, f"seed={seed}"
    else:  # an fp32 rotation the op computes step for step: the first layer's bits; the
        # second reads the first one's output, which Inductor computes in its own order
        assert all(torch.equal(a, b) for a, b in zip(rows[:2], ref_rows[:2])), f"seed={seed}"
        assert max_row_rel_diff(rows[2:], ref_rows[2:]) <= second, f"seed={seed}"
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0.05, atol=0.05, msg=f"seed={seed}")


# the fp8 cases with a bf16 rotation (each engine's own cast: clamped, bare, into uint8)
WIDE_FP8 = ["vllm-llama-fp8", "vllm-llama-fp8-uint8-cache", "sglang-llama-fp8-token-pool"]


@pytest.mark.parametrize("name", WIDE_FP8)
def test_fp8_cases_fuse_at_a_production_width(name):
    """Llama-3-8B's widths (hidden 4096, 32 q heads, 8 kv heads of 128), T=64: validation's
    edge probe runs the 4096-wide projection on rows of 32x-scaled values, the fp8 rows
    saturate, and bf16 RoPE against the op's fp32 one moves a small, cancelled value by
    ~2^-7 of magnitudes near 2300 (22 against 36 in a row of 448s). Bounded by the row's
    largest value after the cast (448) that was declined on every such case (the H200's
    clients run, 2026-12-02); the bound of a saturated row is now the magnitude before the
    cast (``Checked.before_cast``)."""
    case = CASES[name]
    if not case.expected_on("cpu")[0]:
        pytest.skip(f"{name} is declined by name on this torch's CPU cast")
    backend = PrepfuseBackend()
    run(case, backend, num_tokens=64, hidden=4096, heads=32, kv_heads=8, head_dim=128, num_layers=1,
        num_blocks=5, block_size=16, seed=64)
    report = backend.reports[0]
    assert report.matched_counts.get(PASS, 0) == 1, [r.why for r in report.near_misses(PASS)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.expected_fused])
def test_engine_spelling_matches_inductor(name, device):
    """The fused op against Inductor's own code for the unfused layers, same weights and
    inputs: both rotate bf16 values in fp32 and round once. On CUDA the fused op is the
    Triton kernel, and it must be fused there too. A bare fp8 cast stores NaN past 464 where
    torch's eager cast does (torch 2.11 on CUDA), and Inductor's own code saturates there:
    NaN is compared as 448 (``saturated``)."""
    case = CASES[name]
    prepfuse = PrepfuseBackend()
    (out, rows), (ind_out, ind_rows) = (run(case, b, seed=1234, device=device) for b in (prepfuse, "inductor"))
    report = prepfuse.reports[0]
    expected_fused, expected_reason = case.expected_on(device)
    assert report.matched_counts.get(PASS, 0) == 2 * expected_fused, report.format(verbose=True)
    if not expected_fused:
        declined = [r.why for r in report.near_misses(PASS)]
        assert declined and all(expected_reason in why for why in declined), declined
    fp8 = case.cache_dtype in FP8_CODES
    if fp8:
        rows, ind_rows = saturated(rows), saturated(ind_rows)
    assert max_row_rel_diff(rows[:2], ind_rows[:2]) <= (2**-3 if fp8 else 2**-7)
    assert max_row_rel_diff(rows[2:], ind_rows[2:]) <= (2**-3 if fp8 else 2**-6)
    torch.testing.assert_close(out.float(), ind_out.float(), rtol=0.02, atol=0.02)


BARE_CASTS = [n for n, c in CASES.items() if c.bare_fp8_cast]


@pytest.mark.parametrize("name", BARE_CASTS)
def test_bare_fp8_cast_takes_the_devices_overflow(monkeypatch, name):
    """SGLang's and vLLM's unclamped ``(k / s).to(fp8)`` store what torch's cast on the
    graph's device makes of values past 448: the op saturating where the cast saturates
    (torch 2.13 on the CPU), ``fp8_saturate=False`` (NaN past 464) where it gives NaN (torch
    2.11 on CUDA). Both are candidates; the probes' edge values overflow, so the one the
    device's cast agrees with is taken. Left only the other, the pass declines."""
    from prepfuse.fx_passes.fusion import gqa

    backend = PrepfuseBackend({"record_graphs": True})
    run(CASES[name], backend, seed=4321, num_layers=1)
    report = backend.reports[0]
    assert report.matched_counts.get(PASS, 0) == 1, report.format(verbose=True)  # one layer
    # the recorded graph's call: every argument positional, fp8_saturate the third from the end
    calls = [line for line in report.graph.splitlines() if "= prepfuse.gqa_qknorm_rope_kv_insert." in line]
    saturates = e4m3_cast_overflow("cpu") == "saturate"
    assert len(calls) == 1 and calls[0].split(", ")[-3] == str(saturates), calls

    real = gqa.math_candidates
    monkeypatch.setattr(gqa, "math_candidates",
                        lambda *a, **k: [m for m in real(*a, **k) if m.saturate != saturates])
    backend = PrepfuseBackend()
    run(CASES[name], backend, seed=4321, num_layers=1)
    report = backend.reports[0]
    assert report.matched_counts.get(PASS, 0) == 0, report.format(verbose=True)
    declined = [r.why for r in report.near_misses(PASS)]
    assert declined and all("k_cache differs" in w or "v_cache differs" in w for w in declined), declined


def test_vllm_golden_graph():
    backend = PrepfuseBackend({"record_graphs": True})
    run(CASES["vllm-qwen3"], backend, num_layers=1, seed=0)
    GOLDEN.check(backend.reports[0].graph, "vllm_qwen3")


@pytest.mark.parametrize("name", ["vllm-qwen3", "gpt-fast-llama", "gpt-fast-llama-batch2"])
def test_every_batch_size_without_a_recompile(name):
    """``mark_dynamic`` on the token count, warmed up at T=1 and T=7, then each T of
    ``RECOMPILE_TOKEN_COUNTS`` (1..17, each side of 32 .. 256, 300) under
    ``fail_on_recompile``: no pass adds a guard on the token count, and every graph fuses
    both layers."""
    case = CASES[name]
    model, _ = build_engine_client(case, num_tokens=300, seed=7, num_blocks=20)
    backend = PrepfuseBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    token_dim = 1 if case.engine == "gpt-fast" else 0

    def call(t):
        _, (x, positions, slots, caches, kv_scale, block_size) = build_engine_client(case, num_tokens=t, seed=t,
                                                                                     num_blocks=20)
        if t > 1:
            for tensor, dim in ((x, token_dim), (positions, 0), (slots, 0)):
                torch._dynamo.mark_dynamic(tensor, dim)
        with torch.no_grad():
            compiled(x, positions, slots, caches, kv_scale, block_size)

    for t in (1, 7):
        call(t)
    assert backend.reports and all(r.matched_counts.get(PASS, 0) == 2 for r in backend.reports), backend.reports
    compiled_graphs = len(backend.reports)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in RECOMPILE_TOKEN_COUNTS:
            call(t)
    assert len(backend.reports) == compiled_graphs


def test_shared_strided_cos_sin_are_read_by_position():
    """gpt-fast's batch: ``freqs_cis[input_pos]`` rows shared by both sequences, their cos
    and sin columns strided. The call reads the shared rows made dense (one row a position,
    not one a token of every sequence), token ``b * S + t`` at row ``t``: no per-token copy
    of the table is concatenated in front of it."""
    backend = PrepfuseBackend({"record_graphs": True})
    run(CASES["gpt-fast-llama-batch2"], backend, num_layers=1, seed=4)
    graph = backend.reports[0].graph  # the rewritten graph's text, one node a line
    call = "prepfuse.gqa_qknorm_rope_kv_insert.default("
    calls = [line.split(call, 1)[1].split(", ") for line in graph.splitlines() if call in line]
    # (qkv, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions, ..)
    assert len(calls) == 1 and calls[0][7].startswith("remainder"), calls
    assert graph.count("aten.cat.default") == 1, graph  # gpt-fast's own


def test_page_table_slots_are_probed(monkeypatch):
    """The page-table case's slot per token is computed by the pass (``block * bs + row``);
    the probes draw distinct (block, row) pairs, so a wrong formula (each slot moved one row
    on) is declined by the probes, and the code runs as Inductor compiles it."""
    from prepfuse.fx_passes.fusion import gqa

    original = gqa.emit_slots

    def moved(emit, view, *args):
        return emit.node(torch.ops.aten.add.Tensor, original(emit, view, *args), 1)

    monkeypatch.setattr(gqa, "emit_slots", moved)
    assert_declined_by_the_probes(CASES["flashinfer-qwen3-page-table"], seed=5)


def assert_declined_by_the_probes(case, seed: int) -> None:
    """Every candidate of ``case`` declined by the probes, and the code run as Inductor compiles it."""
    backend = PrepfuseBackend()
    _, rows = run(case, backend, seed=seed)
    declined = [r.why for r in backend.reports[0].near_misses(PASS)]
    assert backend.reports[0].matched_counts.get(PASS, 0) == 0
    assert declined and all("cache differs" in why for why in declined), declined
    _, ref_rows = run(case, None, seed=seed)
    assert max_row_rel_diff(rows, ref_rows) <= 2**-6


def test_sequence_slots_are_probed(monkeypatch):
    """The batched static cache's slot per token is computed by the pass (``b * S + pos``);
    the probes draw distinct positions and fill every sequence's rows, so a formula that
    forgets the sequence (every token into sequence 0's rows) is declined by the probes."""
    from prepfuse.fx_passes.fusion import gqa

    original = gqa.emit_slots

    def forgetful(emit, view, *args):  # the positions alone: sequence 0's slots
        return emit.node(torch.ops.aten.remainder.Scalar, original(emit, view, *args), view.sizes[1])

    monkeypatch.setattr(gqa, "emit_slots", forgetful)
    assert_declined_by_the_probes(CASES["gpt-fast-llama-batch2"], seed=6)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_batched_position_outside_the_cache_stays_outside_every_sequence(checked, monkeypatch):
    """The pass's slot ``b * S + pos`` must not turn a position beyond a sequence's ``S`` rows
    into a row of the next sequence (eager index assignment raises there): a position at
    ``S`` becomes a slot beyond the cache, which the op's index check rejects by name, and
    which unchecked (a CUDA graph, ``PREPFUSE_CHECK_INDEX_VALUES=0``) is skipped; a negative
    position counts from its own sequence's end, as eager's indexing does (not another
    sequence's row)."""
    from prepfuse.ops import _checks

    case = CASES["gpt-fast-llama-batch2"]
    model, (x, positions, _, caches, kv_scale, block_size) = build_engine_client(case, seed=8)
    compiled = torch.compile(model, backend=PrepfuseBackend(), fullgraph=True)
    with torch.no_grad():
        compiled(x, positions, positions, [tuple(c.clone() for c in p) for p in caches], kv_scale, block_size)
    length = caches[0][0].shape[2]
    bad = positions.clone()
    bad[-1], bad[0] = length, -1  # one position beyond the sequence, one negative
    written = [tuple(c.clone() for c in p) for p in caches]
    monkeypatch.setattr(_checks, "CHECK_INDEX_VALUES", checked)
    if checked:
        with pytest.raises(ValueError, match="slot_mapping"), torch.no_grad():
            compiled(x, bad, bad, written, kv_scale, block_size)
        assert all(torch.equal(a, b) for pa, pb in zip(written, caches) for a, b in zip(pa, pb))  # nothing written
        return
    with torch.no_grad():
        compiled(x, bad, bad, written, kv_scale, block_size)
    for pair, before in zip(written, caches):
        for cache, old in zip(pair, before):
            changed = (cache != old).any(dim=(1, 3))  # [B, S]: the positions written, per sequence
            want = torch.zeros_like(changed)
            want[:, 1:positions.shape[0] - 1] = True  # the valid positions 1 .. T-2 of both sequences
            want[:, length - 1] = True  # and -1: each sequence's last row
            assert changed.equal(want), changed.nonzero()
