"""transformers' own ``DeepseekV4Attention`` (``prepfuse.models.hf_dsv4``), its k written into
vLLM's fp8_ds_mla cache by the engine's attention function: both sides of both layers fuse
into ``prepfuse::dsv4_qnorm_rope_kv_insert``, in one call a layer, with no near miss.

Numerics against eager (two layers, T=7, CPU). The first layer's cache, decoded: every NoPE
value within one e4m3 step of eager's (a block whose amax sits at a power of two may take the
next UE8M0 scale, its codes then halved), the RoPE values within 2^-6 of their row's largest
(the op rotates the kv_norm output Inductor computes, whose rounding may differ from eager's by
a bf16 ULP). The second layer reads the first one's output, which carries the
op's q (one fp32 rounding where HF rounds the norm factor and the product to bf16): its rows
are within one e4m3 step (2^-3) of their row's largest value. The layers' output within 0.05.
Written instead into vLLM's bf16 or per-tensor e4m3 full-row cache, both sides fuse into
``prepfuse::dsv4_qnorm_rope_kv_full_row_insert``. DeepSeek-V4.1 as vLLM serves it (no per-head q
norm; its MXFP8 records, or the other caches) fuses both sides with the op's ``apply_q_norm=False``.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.hf_dsv4 import build_hf_dsv4_client
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import NOPE_DIM
from prepfuse.testing import fp8_ds_mla_values, max_row_rel_diff, mxfp8_values

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

PASS = "fuse_dsv4_prep"


def compiled_and_eager(seed: int, num_tokens: int = 7, dynamic: bool = False, **client):
    """The client (``build_hf_dsv4_client``'s ``client`` options) compiled and eager on copies of
    the same caches: (backend, (out, caches), (eager out, eager caches), (slots, block_size))."""
    module, (x, positions, slots, caches, block_size) = build_hf_dsv4_client(num_tokens=num_tokens, seed=seed,
                                                                             **client)
    backend = PrepfuseBackend()
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(x, positions, slots, got,
                                                                                      block_size)
        ref = module(x, positions, slots, want, block_size)
    return backend, (out, got), (ref, want), (slots, block_size)


@pytest.mark.parametrize("seed", [0, 1])
def test_both_sides_of_every_layer_fuse(seed):
    backend, (out, got), (ref, want), (slots, block_size) = compiled_and_eager(seed)
    (report,) = backend.reports
    assert report.matched_counts.get(PASS, 0) == 2, report.format(verbose=True)
    assert [m.pattern for m in report.matches() if m.pass_name == PASS] == ["dsv4_q+kv"] * 2
    assert not report.near_misses(PASS), report.format(verbose=True)

    rows, ref_rows = (fp8_ds_mla_values(c, slots, block_size) for c in (got[0], want[0]))
    nope, ref_nope = rows[:, :NOPE_DIM], ref_rows[:, :NOPE_DIM]
    step = torch.maximum(ref_nope.abs() * 2**-3, ref_nope.abs().amax(-1, keepdim=True) * 2**-9)
    assert ((nope - ref_nope).abs() <= step).all()  # one e4m3 step of the value (of a tiny one, of its row)
    assert max_row_rel_diff([rows[:, NOPE_DIM:]], [ref_rows[:, NOPE_DIM:]]) <= 2**-6
    second = [fp8_ds_mla_values(c, slots, block_size) for c in (got[1], want[1])]
    assert max_row_rel_diff([second[0]], [second[1]]) <= 2**-3
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("cache", ["bf16", "fp8", "fp8_q"])
def test_full_row_caches_fuse_both_sides(cache):
    """The same attention with its k rows written whole into vLLM's full-row cache
    ``[blocks, block_size, 512]``, bf16 or e4m3 over the layer's ``k_scale``: both sides of
    both layers fuse into ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert``, no near miss.
    Written rows within 2^-6 of their row's largest value (the op rotates in fp32 and rounds
    once; e4m3: plus one e4m3 step of the value), every other row as it was, the layers'
    output within 0.05. With q cast to e4m3 too (``fp8_q``), the op writes that e4m3 q."""
    backend, (out, got), (ref, want), (slots, block_size) = compiled_and_eager(1, cache=cache)
    (report,) = backend.reports
    assert [m.pattern for m in report.matches() if m.pass_name == PASS] == ["dsv4_q+kv_full_row"] * 2, \
        report.format(verbose=True)
    assert not report.near_misses(PASS), report.format(verbose=True)
    assert "prepfuse.dsv4_qnorm_rope_kv_full_row_insert.default" in report.ops_after
    for g, w in zip(got, want):
        rows, ref_rows = g.flatten(0, 1)[slots].float(), w.flatten(0, 1)[slots].float()
        step = ref_rows.abs() * 2**-3 if cache != "bf16" else 0.0
        assert ((rows - ref_rows).abs() <= ref_rows.abs().amax(-1, keepdim=True) * 2**-6 + step).all()
        untouched = torch.ones(g.shape[0] * g.shape[1], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(g.flatten(0, 1)[untouched].view(torch.uint8), w.flatten(0, 1)[untouched].view(torch.uint8))
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("cache, pattern", [("mxfp8", "dsv4_q+kv"), ("fp8_ds_mla", "dsv4_q+kv"),
                                            ("bf16", "dsv4_q+kv_full_row")])
def test_v41_without_a_q_head_norm_fuses_both_sides(cache, pattern):
    """``q_b_norm`` dropped, as DeepSeek-V4.1 norms q before ``q_b_proj``: both sides of both
    layers fuse, the probes choosing the op's ``apply_q_norm=False``, no near miss. MXFP8 records:
    every value within one e4m3 step of eager's plus 2^-6 of its row's largest (HF rotates with
    bf16 cos/sin), every byte outside the written records as it was; the output within 0.05."""
    backend, (out, got), (ref, want), (slots, block_size) = compiled_and_eager(2, cache=cache, q_head_norm=False)
    (report,) = backend.reports
    assert [m.pattern for m in report.matches() if m.pass_name == PASS] == [pattern] * 2, report.format(verbose=True)
    assert "no q norm" in report.format(verbose=True)
    assert not report.near_misses(PASS), report.format(verbose=True)
    if cache == "mxfp8":
        for g, w in zip(got, want):
            rows, ref_rows = mxfp8_values(g, slots, block_size), mxfp8_values(w, slots, block_size)
            bound = ref_rows.abs() * 2**-3 + ref_rows.abs().amax(-1, keepdim=True) * 2**-6
            assert ((rows - ref_rows).abs() <= bound).all()
            written = torch.zeros(g.shape, dtype=torch.bool)
            for s in slots.tolist():
                written[s // block_size, (s % block_size) * 528: (s % block_size + 1) * 528] = True
            assert torch.equal(g[~written], w[~written])
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)
