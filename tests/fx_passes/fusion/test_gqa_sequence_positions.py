"""``FuseGqaPrepPass`` on static caches of B sequences each written at its own positions
(an engine batching sequences of different lengths onto one static cache):
``cache[arange(B)[:, None], pos] = k`` into ``[B, S, Hkv, D]`` or
``cache[arange(B)[:, None], :, pos] = k`` into heads-first ``[B, Hkv, S, D]``, ``pos [B, T]``.

The pass writes them with the op at slots ``b * S + pos[b, t]`` (computed in front of the
call) and proves each rewrite on probes whose positions differ per sequence. The layer
gathers each token's cos/sin rows by its own position and rotates in fp32 (the op's math,
rounding for rounding), so the written caches are compared with eager bit for bit. Small
shapes (Hq=4, Hkv=2, D=64, S=32); Inductor's FX graph cache is off.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.gqa import rotate_half
from prepfuse.testing import assert_fused_write_close

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

HQ, HKV, D, S, HIDDEN, P = 4, 2, 64, 32, 128, 64
PASS = "fuse_gqa_prep"
FP8 = torch.float8_e4m3fn
KV_SCALE = 3.0 / 448.0


def layer(x, w, cos_table, sin_table, positions, k_cache, v_cache, kv_scale, heads_first: bool, sequence=None):
    """A projection, an fp32 rotation by each token's own table rows, and k and v written at
    each sequence's own positions by index assignment (into the cache's sequences
    ``sequence``, default ``arange(B)``)."""
    batch, tokens = positions.shape
    q, k, v = (x @ w).split([HQ * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(batch, tokens, HQ, D), k.view(batch, tokens, HKV, D), v.view(batch, tokens, HKV, D)
    c, s = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)
    q = (q.float() * c + rotate_half(q.float()) * s).to(torch.bfloat16)
    k = (k.float() * c + rotate_half(k.float()) * s).to(torch.bfloat16)
    if k_cache.dtype == FP8:
        k, v = ((t.float() / kv_scale).clamp(-448.0, 448.0).to(FP8) for t in (k, v))
    sequence = (torch.arange(batch, device=x.device) if sequence is None else sequence)[:, None]
    if heads_first:
        k_cache[sequence, :, positions] = k
        v_cache[sequence, :, positions] = v
    else:
        k_cache[sequence, positions] = k
        v_cache[sequence, positions] = v
    return q


def inputs(batch: int, tokens: int, cache_dtype, heads_first: bool, seed: int):
    """Inputs with distinct positions per sequence (each its own offset into its rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w = (torch.randn(HIDDEN, (HQ + 2 * HKV) * D, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    angles = torch.rand(P, D // 2, generator=g) * 6.0
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    positions = torch.stack([torch.randperm(S, generator=g)[:tokens] for _ in range(batch)])
    shape = (batch, HKV, S, D) if heads_first else (batch, S, HKV, D)
    caches = [torch.randn(shape, generator=g).to(cache_dtype) for _ in range(2)]  # rows it must not touch too
    return x, w, cos, sin, positions, caches, torch.tensor([KV_SCALE])


def compiled_and_eager(batch, tokens, cache_dtype, heads_first, seed, backend=None, device="cpu"):
    backend = backend or PrepfuseBackend()
    made = inputs(batch, tokens, cache_dtype, heads_first, seed)
    x, w, cos, sin, positions, caches, kv_scale = torch.utils._pytree.tree_map(lambda t: t.to(device), made)
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    with torch.no_grad():
        q = torch.compile(layer, backend=backend, fullgraph=True)(x, w, cos, sin, positions, *got, kv_scale, heads_first)
        q_ref = layer(x, w, cos, sin, positions, *want, kv_scale, heads_first)
    return backend, (q, got), (q_ref, want)


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads_first", "token_major"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch,tokens", [(3, 5), (1, 4), (4, 1)], ids=["B3-T5", "B1-T4", "B4-decode"])
def test_each_sequences_own_positions_fuse(batch, tokens, cache_dtype, heads_first):
    backend, (q, got), (q_ref, want) = compiled_and_eager(batch, tokens, cache_dtype, heads_first, seed=batch * 7 + tokens)
    report = backend.reports[0]
    assert report.matched_counts.get(PASS, 0) == 1, report.format(verbose=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_first", [True, False], ids=["heads_first", "token_major"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_each_sequences_own_positions_fuse_on_cuda(cache_dtype, heads_first):
    """The same on CUDA (the Triton kernel): every cache byte beside eager's within a
    rounding of the fp32 rotation, v bit for bit (``assert_fused_write_close``)."""
    backend, (q, (k, v)), (q_ref, (k_ref, v_ref)) = compiled_and_eager(3, 5, cache_dtype, heads_first, seed=21,
                                                                       device="cuda")
    assert backend.reports[0].matched_counts.get(PASS, 0) == 1, backend.reports.format(verbose=True)
    assert_fused_write_close(q, k, v, q_ref, k_ref, v_ref)


def test_a_slot_formula_that_forgets_the_sequence_is_declined_by_the_probes(monkeypatch):
    """The probes draw different positions for each sequence: a slot formula that drops the
    sequence's offset (``pos`` for ``b * S + pos``) writes the wrong rows and is declined."""
    from prepfuse.fx_passes.fusion import gqa

    original = gqa.emit_slots

    def forgetful(emit, view, *args):
        return emit.node(torch.ops.aten.remainder.Scalar, original(emit, view, *args), S)

    monkeypatch.setattr(gqa, "emit_slots", forgetful)
    backend, (_, got), (_, want) = compiled_and_eager(3, 5, torch.bfloat16, True, seed=3)
    whys = [r.why for r in backend.reports[0].near_misses(PASS)]
    assert backend.reports[0].matched_counts.get(PASS, 0) == 0 and whys, whys
    assert all("cache differs" in w for w in whys), whys
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # declined: the code as Inductor compiles it


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_position_outside_a_sequence_stays_outside_every_sequence(checked, monkeypatch):
    """A position at S (eager index assignment raises) is a slot beyond the cache for the
    op, not sequence b + 1's row 0: the op's index check rejects it by name, with nothing
    written; unchecked (a CUDA graph, ``PREPFUSE_CHECK_INDEX_VALUES=0``) it is skipped. A
    negative position counts from its own sequence's end, as eager's indexing does: every
    other token's row is written as eager writes it, no other row."""
    from prepfuse.ops import _checks

    x, w, cos, sin, positions, caches, kv_scale = inputs(2, 3, torch.bfloat16, False, seed=9)
    compiled = torch.compile(layer, backend=PrepfuseBackend(), fullgraph=True)
    with torch.no_grad():
        compiled(x, w, cos, sin, positions, *[c.clone() for c in caches], kv_scale, False)
        eager = [c.clone() for c in caches]
        layer(x, w, cos, sin, positions, *eager, kv_scale, False)
    bad = positions.clone()
    bad[0, 1], bad[1, 0] = S, -1
    got = [c.clone() for c in caches]
    monkeypatch.setattr(_checks, "CHECK_INDEX_VALUES", checked)
    if checked:
        with pytest.raises(ValueError, match="slot_mapping"), torch.no_grad():
            compiled(x, w, cos, sin, bad, *got, kv_scale, False)
        assert all(torch.equal(a, b) for a, b in zip(got, caches))  # nothing written
        return
    with torch.no_grad():
        compiled(x, w, cos, sin, bad, *got, kv_scale, False)
    valid = [(b, t) for b in range(2) for t in range(3) if (b, t) != (0, 1)]
    good = positions.clone()
    good[1, 0] = -1  # a position eager takes: sequence 1's last row
    for i, (cache, before) in enumerate(zip(got, caches)):
        want, rows = before.clone(), [c.clone() for c in caches]
        with torch.no_grad():
            layer(x, w, cos, sin, good, *rows, kv_scale, False)
        for b, t in valid:
            want[b, int(good[b, t])] = rows[i][b, int(good[b, t])]
        assert torch.equal(cache, want)


def test_every_token_count_without_a_recompile():
    """``mark_dynamic`` on the token count: warmed up at T=1 and T=3, then every T in 1..S
    under ``fail_on_recompile``; the write fuses in every graph."""
    backend = PrepfuseBackend()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)

    def call(t):
        x, w, cos, sin, positions, caches, kv_scale = inputs(2, t, torch.bfloat16, True, seed=t)
        if t > 1:
            torch._dynamo.mark_dynamic(x, 1)
            torch._dynamo.mark_dynamic(positions, 1)
        with torch.no_grad():
            compiled(x, w, cos, sin, positions, *caches, kv_scale, True)

    for t in (1, 3):
        call(t)
    assert all(r.matched_counts.get(PASS, 0) == 1 for r in backend.reports), backend.reports
    graphs = len(backend.reports)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in range(1, S + 1):
            call(t)
    assert len(backend.reports) == graphs


def test_sequences_picked_by_an_index_fuse():
    """``cache[seq_ids[:, None], pos] = k`` with ``seq_ids`` any index (rows of the sequences
    it picks, a negative one counted from the end): the op's slot is ``seq_ids[b] * S + pos``,
    and the caches equal eager's bit for bit."""
    def picked(x, w, cos_table, sin_table, positions, seq_ids, k_cache, v_cache):
        return layer(x, w, cos_table, sin_table, positions, k_cache, v_cache, None, False, sequence=seq_ids)

    backend = PrepfuseBackend()
    x, w, cos, sin, positions, caches, _ = inputs(2, 3, torch.bfloat16, False, seed=4)
    caches = [torch.cat((c, c + 1)) for c in caches]  # four sequences' rows, two written
    seq_ids = torch.tensor([3, -4])
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    with torch.no_grad():
        q = torch.compile(picked, backend=backend, fullgraph=True)(x, w, cos, sin, positions, seq_ids, *got)
        q_ref = picked(x, w, cos, sin, positions, seq_ids, *want)
    assert backend.reports[0].matched_counts.get(PASS, 0) == 1, backend.reports.format(verbose=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("probe", [0, 1])
def test_the_probes_write_each_sequences_position_once_off_the_cpu(probe):
    """Off the CPU a position written twice holds either row, so the probes must not draw one
    (they once drew blocks [0, 0, 1] for three sequences, and a CUDA compile then declined).
    A block per sequence and the positions of each: every (block, position) pair distinct, on
    the draw CUDA makes (no repeats) and on the CPU's edge probe (a position from the end)."""
    from prepfuse.fx_passes.rewrite.probes import _Limits, _values

    batch, tokens = 3, 5
    for repeats in (False, True):
        limits = _Limits(slots=4 * S, block_size=S, repeats=repeats)
        gen = torch.Generator().manual_seed(7)
        blocks = _values("sequence_blocks", [batch, 1], torch.int64, limits, probe, gen)
        rows = _values("sequence_rows", [batch, tokens], torch.int64, limits, probe, gen)
        pairs = {(int(b) % 4, int(r) % S) for b, row in zip(blocks[:, 0], rows) for r in row}
        assert len(pairs) == batch * tokens, (blocks.tolist(), rows.tolist())
