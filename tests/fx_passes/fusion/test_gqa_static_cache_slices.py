"""``FuseGqaPrepPass`` on static caches written by slice assignment: consecutive positions of
every sequence overwritten, ``cache[:, :, start:start + T] = k`` into ``[B, Hkv, S, D]`` (heads
first) or ``cache[:, start:start + T] = k`` into ``[B, S, Hkv, D]`` (Meta's reference Llama
``cache_k[:, start_pos : start_pos + seqlen] = xk``), with a fixed or a dynamic ``start``.

The pass writes them with the op at slots ``b * S + start + t`` (computed in front of the
call) and proves each rewrite on probes. The layer below rotates in fp32 with an fp32 table
(the op's math, rounding for rounding), so the written caches are compared with eager bit for
bit; q within a bf16 rounding (Inductor's own code for q's readers). Small shapes (T=5, Hq=4,
Hkv=2, D=64, S=32); Inductor's FX graph cache is off.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion import gqa
from prepfuse.models.gqa import rotate_half
from prepfuse.testing import assert_fused_write_close, e4m3_code_diff

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, HQ, HKV, D, S, HIDDEN = 5, 4, 2, 64, 32, 128
PASS = "fuse_gqa_prep"
FP8 = torch.float8_e4m3fn
KV_SCALE = 3.0 / 448.0


def layer(x, w, cos, sin, k_cache, v_cache, kv_scale, start: int, heads_first: bool, round_k: bool = True):
    """A projection, an fp32 rotation by per-token cos/sin ``[B, T, D]``, and the step's k and
    v written into the static caches at ``start .. start + T - 1`` by slice assignment.
    ``round_k=False``: an fp8 cache's k quantised from the fp32 rotation, the graph torch
    2.11's Inductor makes of the rounded code (it drops the ``.to(bf16).float()``)."""
    batch = x.shape[0]
    q, k, v = (x @ w).split([HQ * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(batch, T, HQ, D), k.view(batch, T, HKV, D), v.view(batch, T, HKV, D)
    c, s = cos[:, :, None], sin[:, :, None]
    q = (q.float() * c + rotate_half(q.float()) * s).to(torch.bfloat16)
    k = k.float() * c + rotate_half(k.float()) * s
    k = k.to(torch.bfloat16) if round_k else k
    if heads_first:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if k_cache.dtype == FP8:
        k, v = ((t.float() / kv_scale).clamp(-448.0, 448.0).to(FP8) for t in (k, v))
    if heads_first:
        k_cache[:, :, start:start + T] = k
        v_cache[:, :, start:start + T] = v
    else:
        k_cache[:, start:start + T] = k
        v_cache[:, start:start + T] = v
    return q


def inputs(batch: int, cache_dtype, heads_first: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, HIDDEN, generator=g).to(torch.bfloat16)
    w = (torch.randn(HIDDEN, (HQ + 2 * HKV) * D, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    angles = torch.rand(batch, T, D // 2, generator=g) * 6.0
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    shape = (batch, HKV, S, D) if heads_first else (batch, S, HKV, D)
    caches = [torch.randn(shape, generator=g).to(cache_dtype) for _ in range(2)]  # rows it must not touch too
    return x, w, cos, sin, caches, torch.tensor([KV_SCALE])


def run(backend, batch, cache_dtype, heads_first, starts, seed=0, device="cpu", round_k=True):
    """Each start's (q, k cache, v cache), compiled with ``backend`` (None: eager)."""
    fn = layer if backend is None else torch.compile(layer, backend=backend, fullgraph=True)
    out = []
    for start in starts:
        made = inputs(batch, cache_dtype, heads_first, seed + start)
        x, w, cos, sin, (k_cache, v_cache), kv_scale = torch.utils._pytree.tree_map(lambda t: t.to(device), made)
        with torch.no_grad():
            q = fn(x, w, cos, sin, k_cache, v_cache, kv_scale, start, heads_first, round_k)
        out.append((q.clone(), k_cache, v_cache))  # a fused q_out lives until the next call
    return out


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads_first", "token_major"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 2])
def test_slice_writes_fuse(batch, cache_dtype, heads_first):
    """The first start compiles with it as a number, the second recompiles with it dynamic
    (Dynamo's automatic dynamic); after that every start is served without a recompile,
    each graph fuses its one call, and the caches hold eager's bytes."""
    backend = PrepfuseBackend()
    starts = (3, 9)
    got = run(backend, batch, cache_dtype, heads_first, starts)
    assert len(backend.reports) == 2 and all(r.matched_counts.get(PASS, 0) == 1 for r in backend.reports), \
        backend.reports.format()
    assert not backend.reports.near_misses(PASS), backend.reports.format()
    with torch.compiler.set_stance("fail_on_recompile"):
        got += run(backend, batch, cache_dtype, heads_first, (0, 14, S - T))
    want = run(None, batch, cache_dtype, heads_first, (*starts, 0, 14, S - T))
    for (q, k, v), (q_ref, k_ref, v_ref) in zip(got, want):
        assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_first", [True, False], ids=["heads_first", "token_major"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_slice_writes_fuse_on_cuda(cache_dtype, heads_first):
    """The same on CUDA (the Triton kernel): fused at a fixed and a dynamic start, every cache
    byte beside eager's within a rounding of the fp32 rotation, v bit for bit
    (``assert_fused_write_close``)."""
    backend = PrepfuseBackend()
    starts = (3, 9, 0, S - T)
    got = run(backend, 2, cache_dtype, heads_first, starts, device="cuda")
    assert len(backend.reports) == 2 and all(r.matched_counts.get(PASS, 0) == 1 for r in backend.reports), \
        backend.reports.format()
    want = run(None, 2, cache_dtype, heads_first, starts, device="cuda")
    for (q, k, v), (q_ref, k_ref, v_ref) in zip(got, want):
        assert_fused_write_close(q, k, v, q_ref, k_ref, v_ref)


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads_first", "token_major"])
def test_fp8_rows_of_the_unrounded_rotation_fuse(heads_first):
    """k quantised from the fp32 rotation with no bf16 rounding before the cast (what torch
    2.11's Inductor leaves of the rounded code), read through the heads-first transpose: the
    op's bf16 rounding before its cast moves a code by at most one e4m3 step, within the
    probes' bound; the call fuses, v's bytes are eager's and k's codes within one step."""
    backend = PrepfuseBackend()
    (_, k, v), = run(backend, 2, FP8, heads_first, (3,), round_k=False)
    assert backend.reports[0].matched_counts.get(PASS, 0) == 1, backend.reports.format(verbose=True)
    (_, k_ref, v_ref), = run(None, 2, FP8, heads_first, (3,), round_k=False)
    assert int(e4m3_code_diff(k.view(torch.uint8), k_ref.view(torch.uint8)).max()) <= 1
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))


def test_a_slot_formula_without_the_start_is_declined_by_the_probes(monkeypatch):
    """The slots ``start + t`` are the pass's own arithmetic: a formula that drops the start
    (every step written at positions 0..T-1) is declined by the probes, and the code runs as
    Inductor compiles it."""
    original = gqa.emit_slots

    def startless(emit, view, *args):  # the same number of positions, from 0
        return emit.node(torch.ops.aten.sub.Tensor, original(emit, view, *args), 3)

    monkeypatch.setattr(gqa, "emit_slots", startless)
    backend = PrepfuseBackend()
    got = run(backend, 2, torch.bfloat16, True, (3,))
    assert backend.reports[0].matched_counts.get(PASS, 0) == 0
    whys = [r.why for r in backend.reports.near_misses(PASS)]
    assert whys and all("cache differs" in why for why in whys), whys
    want = run(None, 2, torch.bfloat16, True, (3,))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got, want))


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads_first", "token_major"])
def test_an_open_ended_slice_fuses(heads_first):
    """``cache[:, :, S - T:] = k`` (no end: the graph's slice ends at INT64_MAX) writes the
    last T positions; the slots count the rows written, not up to the slice's end."""
    def open_ended(k, v, k_cache, v_cache):
        if heads_first:
            k_cache[:, :, S - T:], v_cache[:, :, S - T:] = k, v
        else:
            k_cache[:, S - T:], v_cache[:, S - T:] = k, v

    x, w, cos, sin, caches, _ = inputs(2, torch.bfloat16, heads_first, seed=11)

    def fn(x, w, cos, sin, k_cache, v_cache):
        q, k, v = (x @ w).split([HQ * D, HKV * D, HKV * D], -1)
        q, k, v = q.view(2, T, HQ, D), k.view(2, T, HKV, D), v.view(2, T, HKV, D)
        c, s = cos[:, :, None], sin[:, :, None]
        q = (q.float() * c + rotate_half(q.float()) * s).to(torch.bfloat16)
        k = (k.float() * c + rotate_half(k.float()) * s).to(torch.bfloat16)
        open_ended(*((k.transpose(1, 2), v.transpose(1, 2)) if heads_first else (k, v)), k_cache, v_cache)
        return q

    backend = PrepfuseBackend()
    got = [c.clone() for c in caches]
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(x, w, cos, sin, *got)
        fn(x, w, cos, sin, *caches)
    assert backend.reports[0].matched_counts.get(PASS, 0) == 1, backend.reports.format(verbose=True)
    assert all(torch.equal(a, b) for a, b in zip(got, caches))


def test_fp8_rows_transposed_after_the_cast_are_declined_by_name():
    """fp8 rows of no projection viewed after their cast (``k.to(fp8).transpose(1, 2)`` into
    a heads-first cache): declined, naming the write."""
    def transposed_after(k, cache, kv_scale):
        cache[:, :, 3:3 + T] = (k.float() / kv_scale).clamp(-448.0, 448.0).to(FP8).transpose(1, 2)
        return cache.float().sum()

    backend = PrepfuseBackend()
    k = torch.randn(2, T, HKV, D).to(torch.bfloat16)
    cache, scale = torch.zeros(2, HKV, S, D).to(FP8), torch.tensor([KV_SCALE])
    torch.compile(transposed_after, backend=backend, fullgraph=True)(k, cache, scale)
    whys = [r.why for r in backend.reports.near_misses(PASS)]
    assert len(whys) == 1 and whys[0].startswith("write: the rows written at") and "transposed_after" not in whys[0] \
        and "cache[:, :, 3:3 + T]" in whys[0], whys


def test_a_slice_written_into_a_local_tensor_is_no_candidate():
    """A 4-d slice overwritten in a tensor the graph makes itself (``buf[:, :, 3:8] = k`` into
    a ``zeros``) is no cache write: the report names no near miss for it, while the same
    write into a graph input is a candidate (declined here: nothing roped)."""
    def local(k, cache):
        buf = torch.zeros_like(cache)
        buf[:, :, 3:3 + T] = k
        return buf.float().sum()

    def into_input(k, cache):
        cache[:, :, 3:3 + T] = k
        return cache.float().sum()

    k, cache = torch.randn(2, HKV, T, D).to(torch.bfloat16), torch.zeros(2, HKV, S, D).to(torch.bfloat16)
    whys = {}
    for fn in (local, into_input):
        backend = PrepfuseBackend()
        torch.compile(fn, backend=backend, fullgraph=True)(k, cache.clone())
        whys[fn.__name__] = [r.why for r in backend.reports.near_misses(PASS)]
    assert whys["local"] == [] and len(whys["into_input"]) == 1, whys
