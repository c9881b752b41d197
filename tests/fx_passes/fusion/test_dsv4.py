"""``FuseDsv4PrepPass``: unfused DeepSeek-V4 preparation becomes one fused op call.

Every compiled case asserts the three things a pass test asserts:

- numerics, compiled vs eager on fresh random inputs (all slots valid: the eager code
  cannot skip a slot): cache bytes identical; q identical except at most one bf16 ULP on
  at most max(16, 10 per million) values: the model's ``torch.rsqrt`` on the CPU is not
  correctly rounded (1 fp32 value in 8 is one ULP off ``1 / sqrt``), the op computes
  ``1 / sqrt``; such a (token, head) row scale flips a few bf16 roundings of that row,
  about one value per million overall (the DeepSeek-V4 bound (docs/design.md); the floor of 16 covers one
  such row in these small tests). Look-alikes, left unfused, are Inductor's
  code against eager: q within the dtype's default ``assert_close`` tolerance, cache bytes
  within one e4m3 code;
- the exact ``matched_count`` (fused calls made) and the pattern of each;
- the golden normalized post-pass graph (``EXPECTTEST_ACCEPT=1`` regenerates them).

Shapes are small (T=7, H=3, HP=8, block 16) and Inductor's FX graph cache is off.
Compiles go through ``backend="prepfuse"`` with ``passes=("fuse_dsv4_prep",)`` so the
graph printed is this pass's output; the in-place tests add ``defunctionalize`` and
check Inductor's generated code.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.dsv4 import FuseDsv4PrepPass
from prepfuse.models import dsv4 as model
from prepfuse.models.dsv4 import DSV4_LOOKALIKES, DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.testing import compare_dsv4, compare_dsv4_q, make_dsv4_inputs, max_row_rel_diff
from prepfuse.models import dsv4_prep_unfused
from prepfuse.testing.golden import GoldenFiles
from prepfuse.testing.passes import PassReportQueries, compile_beside_eager, internal_error_named

GOLDEN = GoldenFiles.beside(__file__)

T, H, HP, BLOCK, EPS = 7, 3, 8, 16, 1e-6
PASS = FuseDsv4PrepPass.name
SPELLINGS = {s.name: s for s in DSV4_SPELLINGS}
LOOKALIKES = {s.name: s for s in DSV4_LOOKALIKES}
VERSIONS = [pytest.param(False, id="v1"), pytest.param(True, id="v2")]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


# --------------------------------------------------------------------------------------
# The compiled functions: model code, one spelling each
# --------------------------------------------------------------------------------------
def prep(spelling):
    def fn(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        torch._check(kv.shape[0] == q.shape[0])  # one token count, as when both come from one x
        q_padded = model.dsv4_q_prep(q, positions, cos_sin_cache, EPS, HP, spelling)
        model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, spelling)
        return q_padded
    return fn


def q_only(spelling):
    def fn(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        return model.dsv4_q_prep(q, positions, cos_sin_cache, EPS, HP, spelling)
    return fn


def kv_only(spelling):
    def fn(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, spelling)
    return fn


def with_extra_users(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """The prep, plus readers of two intermediates: the fp32 normalised q before RoPE (the
    op does not produce it) and the unpadded bf16 q (the first H heads of q_out)."""
    spelling = DSV4_SPELLINGS[0]
    y = model.rms_norm(q.float(), EPS, spelling)
    nope, pe = model.split_rope_dims(y, spelling)
    cos, sin = model.cos_sin(cos_sin_cache, positions)
    prepared = torch.cat((nope, model.rope(pe, cos.unsqueeze(1), sin.unsqueeze(1), spelling)), dim=-1).to(q.dtype)
    model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, spelling)
    return model.pad_heads(prepared, HP, spelling), y, prepared[:, 0] * 2


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run(PassReportQueries):
    pass_name = PASS  # a class attribute, not a field

    inputs: object  # the Dsv4Inputs both runs read
    out: object
    cache: torch.Tensor
    ref_out: object
    ref_cache: torch.Tensor
    report: object  # GraphReport of the (single) compiled graph


def make_inputs(dtype=torch.bfloat16, **kwargs):
    inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cpu", skip_fraction=0.0, **kwargs)
    return dataclasses.replace(inputs, q=inputs.q.to(dtype), kv=inputs.kv.to(dtype))


def run(fn, inputs=None, *, passes=(PASS,), v2=True) -> Run:
    """``fn`` compiled by the prepfuse backend and eagerly, each on its own copy of the cache."""
    inputs = make_inputs() if inputs is None else inputs
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out, ref_out, report = compile_beside_eager(fn, (inputs.q, inputs.kv, cache, *rest),
                                                (inputs.q, inputs.kv, ref_cache, *rest), passes=passes, v2=v2)
    return Run(inputs, out, cache, ref_out, ref_cache, report)


def nonzero(counts: dict) -> dict:
    """The passes that rewrote something (other registered passes report 0)."""
    return {name: n for name, n in counts.items() if n}


def first(out):
    return out[0] if isinstance(out, tuple) else out


def assert_q_close(q: torch.Tensor, ref: torch.Tensor) -> None:
    """the DeepSeek-V4 bound (docs/design.md) (``Dsv4Comparison.within_spec``): at most one bf16 ULP on a
    few values per million, beyond one ULP only where RoPE cancels (at most one per million).

    ``torch.rsqrt`` one fp32 ULP off ``1 / sqrt`` scales a whole (token, head) row by a
    hair, which flips the bf16 rounding of a few of its values: differences come a few
    at a time, in about one row in 7000, about one value per million overall."""
    comparison = compare_dsv4_q(ref, q)
    assert comparison.within_spec(), comparison


def assert_close_to_eager(r: Run) -> None:
    """Fused against eager: q as ``assert_q_close``, every cache byte identical."""
    if r.out is not None:
        assert_q_close(first(r.out), first(r.ref_out))
    assert torch.equal(r.cache, r.ref_cache), int((r.cache != r.ref_cache).sum())


def assert_unfused_close_to_eager(r: Run) -> None:
    """Inductor's code for unfused math against eager: q within 2^-7 of its row's largest value
    (Inductor sums and contracts in another order: where RoPE cancels, a value can move by more
    than the dtype's default tolerance, as torch 2.14 showed for the no_rsqrt look-alike: 0.0625
    on a value of 1.5 in a row of much larger ones); cache bytes within one e4m3 code."""
    if r.out is not None:
        got, want = first(r.out), first(r.ref_out)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert max_row_rel_diff([got.float()], [want.float()]) <= 2**-7
    cmp = compare_dsv4(dataclasses.replace(r.inputs, q_out=r.inputs.q_out[:, :0], k_cache=r.cache),
                       dataclasses.replace(r.inputs, q_out=r.inputs.q_out[:, :0], k_cache=r.ref_cache))
    assert cmp.cache_max_code_diff <= 1 and cmp.cache_non_fp8_mismatches == 0, cmp


# --------------------------------------------------------------------------------------
# Every spelling fuses into one call
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_into_one_call(name):
    r = run(prep(SPELLINGS[name]))
    assert_close_to_eager(r)
    assert r.matched == 1
    assert r.events("matched") == ["dsv4_q+kv"]
    if SPELLINGS[name].norm == "rms_norm":  # F.rms_norm's eps arrives rounded to fp32
        GOLDEN.check(r.report.graph, "spelling_fuses_eps_rounded_to_fp32")
    else:
        GOLDEN.check(r.report.graph, "spelling_fuses_into_one_call")


@pytest.mark.parametrize("v2", VERSIONS)
def test_functionalization_versions(v2):
    r = run(prep(DSV4_SPELLINGS[1]), v2=v2)
    assert_close_to_eager(r)
    assert r.matched == 1
    if v2:
        GOLDEN.check(r.report.graph, "functionalization_v2")
    else:
        GOLDEN.check(r.report.graph, "functionalization_v1")


@pytest.mark.parametrize("v2", VERSIONS)
def test_runs_in_place_after_defunctionalize(v2):
    """With the default pass list the op writes q_out and the caller's cache directly:
    Inductor's code is the op call alone, no kernel, copy or clone around it."""
    inputs = make_inputs()
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    fn = prep(DSV4_SPELLINGS[0])
    backend = PrepfuseBackend({"auto_functionalized_v2": v2, "strict": True})
    args = (inputs.q, inputs.kv, cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out, (code,) = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True), *args)
    ref = fn(inputs.q, inputs.kv, ref_cache, *args[3:])
    assert_close_to_eager(Run(inputs, out, cache, ref, ref_cache, None))
    (report,) = backend.reports
    assert nonzero(report.matched_counts) == {PASS: 1, "defunctionalize": 1}
    (FileCheck().check_count("torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(", 1, exactly=True)
     .check_not("copy_").check_not("clone").run(code))
    FileCheck().check_not("cpp_fused").run(code)


# --------------------------------------------------------------------------------------
# Partial matches, extra users, fewer slots than tokens
# --------------------------------------------------------------------------------------
def test_q_side_alone():
    r = run(q_only(DSV4_SPELLINGS[1]))
    assert_close_to_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_q"]
    GOLDEN.check(r.report.graph, "q_side_alone")


def test_kv_side_alone():
    r = run(kv_only(DSV4_SPELLINGS[2]))
    assert_close_to_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_kv"]
    GOLDEN.check(r.report.graph, "kv_side_alone")


def test_extra_users_keep_their_values():
    r = run(with_extra_users)
    assert_close_to_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_q+kv"]
    # the unpadded q's reader now reads the first H heads of q_out: the same bound as q_out
    assert_q_close(r.out[2], r.ref_out[2])
    # the normalised q is still computed, by the same nodes as without the pass: same bits
    torch._dynamo.reset()
    unfused = run(with_extra_users, r.inputs, passes=())
    assert unfused.matched == 0 and torch.equal(r.out[1], unfused.out[1])
    GOLDEN.check(r.report.graph, "extra_users_keep_their_values")


def test_fewer_slots_than_tokens():
    """slot_mapping has T' < T rows: the kv rows are ``kv[:T']``, the op reads all of kv."""
    r = run(prep(DSV4_SPELLINGS[0]), make_inputs(num_inserted=4))
    assert_close_to_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_q+kv"]
    GOLDEN.check(r.report.graph, "fewer_slots_than_tokens")


@pytest.mark.parametrize("v2", VERSIONS)
def test_unfused_baseline_writes_the_callers_buffers(v2):
    """``prepfuse.models.dsv4_prep_unfused`` (the benchmarks' baseline: the reference's
    math, ``q_out[:, :H] = ..; q_out[:, H:] = 0`` into the caller's q_out, the cache written
    by byte columns) compiles to the op writing the caller's q_out and cache, nothing else."""
    inputs = make_inputs()
    compiled, eager = inputs.fresh_outputs(), inputs.fresh_outputs()
    backend = PrepfuseBackend({"auto_functionalized_v2": v2, "strict": True, "record_graphs": True})
    _, (code,) = run_and_get_code(torch.compile(dsv4_prep_unfused, backend=backend, fullgraph=True), *compiled.args())
    dsv4_prep_unfused(*eager.args())
    # the baseline computes 1 / sqrt as the op does: identical bytes
    assert torch.equal(compiled.q_out, eager.q_out) and torch.equal(compiled.k_cache, eager.k_cache)
    (report,) = backend.reports
    assert nonzero(report.matched_counts) == {PASS: 1, "defunctionalize": 1}
    GOLDEN.check(report.graph, "unfused_baseline_writes_the_callers_buffers")
    FileCheck().check_count("dsv4_qnorm_rope_kv_insert.default(", 1, exactly=True).check_not("copy_").run(code)
    FileCheck().check_not("cpp_fused").check_not("empty_strided_cpu(").run(code)  # no kernel, no buffer


# --------------------------------------------------------------------------------------
# Look-alikes stay unfused, with the reason logged
# --------------------------------------------------------------------------------------
LOOKALIKE_CASES = [
    # (look-alike, which code runs, pattern declined, words of each reason)
    ("eps_after_sqrt", q_only, ["dsv4_q"], ["q_out differs"]),
    ("no_rsqrt", q_only, ["dsv4_q"], ["q_out differs"]),
    ("neox_rope", prep, ["dsv4_q", "dsv4_kv"], ["q_out differs", "k_cache"]),
    ("quant_block_128", kv_only, ["dsv4_kv"], ["k_cache (NoPE"]),
    ("cache_row_640", kv_only, ["dsv4_kv"], ["640 apart"]),  # its slice's scatter back is no write of its own
    ("cache_row_640_columns", kv_only, ["dsv4_kv"], ["640 apart"]),
    ("float16", prep, ["dsv4_q", "dsv4_kv"], ["float16", "differs"]),
]


@pytest.mark.parametrize("name, code, declined, why", LOOKALIKE_CASES, ids=[c[0] for c in LOOKALIKE_CASES])
def test_lookalike_is_left_alone(name, code, declined, why, caplog):
    spelling = LOOKALIKES[name]
    inputs = make_inputs(dtype=spelling.dtype)
    if spelling.cache_row_bytes != model.CACHE_ROW_BYTES:
        cache = fp8_ds_mla_cache(inputs.k_cache.shape[0], BLOCK, row_bytes=spelling.cache_row_bytes).fill_(0xA5)
        inputs = dataclasses.replace(inputs, k_cache=cache)
    with caplog.at_level(logging.DEBUG, logger="prepfuse.passes"):
        r = run(code(spelling), inputs)
    assert r.matched == 0 and not r.report.ops_after  # no prepfuse op in the compiled graph
    assert [p for p, _ in r.events("declined")] == declined, r.events("declined")
    assert all(w in reason for w, (_, reason) in zip(why, r.events("declined"))), r.events("declined")
    assert not any(internal_error_named(reason) for _, reason in r.events("declined")), r.events("declined")
    assert any("declined" in rec.getMessage() and why[0] in rec.getMessage() for rec in caplog.records)
    assert_unfused_close_to_eager(r)


def test_rows_offset_by_one_fuse_as_block_and_row():
    """``cache[s // bs, (s + 1) % bs]``: each row one further into its block. The op's slot
    is ``block * bs + row`` of the code's own indices, so it writes the code's rows; the
    cache bytes equal eager's."""
    r = run(kv_only(LOOKALIKES["cache_row_offset_by_one"]))
    assert r.matched == 1, r.events("declined")
    assert torch.equal(r.cache, r.ref_cache), int((r.cache != r.ref_cache).sum())


# --------------------------------------------------------------------------------------
# Dynamic T, a whole attention block
# --------------------------------------------------------------------------------------
HEAD_DIM_KV = 512  # kv's width, one latent head
KV_NORM_WEIGHT = (1 + 0.1 * torch.randn(HEAD_DIM_KV, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)


def with_kv_norm(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    """The prep of a kv normed upstream in fp32 (``F.rms_norm`` with a weight) and rounded
    to bf16, read by nothing else: torch 2.11's Inductor drops that ``.to(bf16)`` before the
    prep's ``kv.float()``, so its graph reads the fp32 norm output."""
    normed = torch.nn.functional.rms_norm(kv.float(), (HEAD_DIM_KV,), KV_NORM_WEIGHT.float(), EPS)
    return prep(DSV4_SPELLINGS[0])(q, normed.to(kv.dtype), k_cache, slot_mapping, positions, cos_sin_cache)


def test_kv_normed_upstream_fuses_on_every_torch():
    """kv = norm(..).to(bf16) read only by the prep: one q+kv call on every torch, the cache
    exactly eager's (where Inductor drops the rounding, ``kv_columns`` reads the fp32 norm
    output and the call rounds it first; on torch 2.11 without that, the kv side declined
    and Inductor's unfused code wrote other cache bytes than eager)."""
    r = run(with_kv_norm)
    assert_close_to_eager(r)
    assert r.matched == 1 and r.events("matched") == ["dsv4_q+kv"]


def test_dynamic_token_count():
    fn = prep(DSV4_SPELLINGS[3])
    backend = PrepfuseBackend({"passes": (PASS,), "record_graphs": True})
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for num_tokens in (7, 5, 12):
        inputs = make_dsv4_inputs(num_tokens, H, HP, BLOCK, "cpu", skip_fraction=0.0)
        for t in (inputs.q, inputs.kv, inputs.slot_mapping, inputs.positions):
            torch._dynamo.mark_dynamic(t, 0)
        cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
        args = (inputs.q, inputs.kv, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
        out = compiled(*args[:2], cache, *args[2:])
        ref = fn(*args[:2], ref_cache, *args[2:])
        assert_close_to_eager(Run(inputs, out, cache, ref, ref_cache, None))
    (report,) = backend.reports  # one graph for every T
    assert report.matched_counts == {PASS: 1}
    GOLDEN.check(report.graph, "dynamic_token_count")


def _dequantized_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The [n, 512] values the fp8_ds_mla cache holds at ``slots`` (fp32)."""
    blk, row = slots // BLOCK, slots % BLOCK
    data = cache[:, : BLOCK * 576].view(-1, BLOCK, 576)[blk, row]
    scales = cache[:, BLOCK * 576 : BLOCK * 584].reshape(-1, BLOCK, 8)[blk, row, :7]
    nope = data[:, :448].view(torch.float8_e4m3fn).float().view(-1, 7, 64)
    nope = nope * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return torch.cat((nope.flatten(1), data[:, 448:].contiguous().view(torch.bfloat16).float()), dim=-1)


def test_attention_block_dynamic():
    """Two layers, T dynamic, the default pass list: one fused call per layer, in place.

    Layer 2 reads layer 1's output, which Inductor computes in its own order, so its kv
    (and cache bytes) may differ from eager by what the compiled projection and softmax
    differ; the caches are compared dequantised: layer 1's exactly, layer 2's at one e4m3 step of
    each value plus 2^-7 of its row's largest (an element-wise 12.5 % failed on a small value of
    layer 2 that moved by 0.02 with the row's bf16 noise)."""
    block = Dsv4AttentionBlock(num_layers=2, num_heads=H, padded_heads=HP, block_size=BLOCK, spelling=DSV4_SPELLINGS[4])
    inputs = make_inputs()
    x = torch.randn(T, 64).to(torch.bfloat16)
    for t in (x, inputs.slot_mapping, inputs.positions):
        torch._dynamo.mark_dynamic(t, 0)
    caches = [fp8_ds_mla_cache(5, BLOCK) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    backend = PrepfuseBackend({"strict": True})
    args = (inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
    out, (code,) = run_and_get_code(torch.compile(block, backend=backend, fullgraph=True), x, *args, caches)
    ref = block(x, *args, ref_caches)
    (report,) = backend.reports
    assert nonzero(report.matched_counts) == {PASS: 2, "defunctionalize": 2}
    assert [r.pattern for r in report.rewrites if r.pass_name == PASS and r.kind == "matched"] == ["dsv4_q+kv"] * 2
    FileCheck().check_count("torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(", 2, exactly=True).run(code)
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)
    _assert_layer_caches_close(caches, ref_caches, inputs.slot_mapping)


def _assert_layer_caches_close(caches, ref_caches, slots):
    """Layer 1's rows dequantised exactly as eager's, layer 2's within what its inputs moved."""
    for cache, ref_cache in zip(caches, ref_caches):
        got, want = _dequantized_rows(cache, slots), _dequantized_rows(ref_cache, slots)
        if cache is caches[0]:  # layer 1 reads what eager reads
            assert torch.equal(got, want)
            continue
        # one e4m3 step at the value (the 8 codes of each binade: 12.5 % at its bottom), plus what layer 2's
        # inputs moved: bf16 noise of its row, 2^-7 of the row's largest value
        step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), want.abs()).clamp_min(2.0**-30))) - 3)
        bound = step + 2.0**-7 * want.abs().amax(dim=-1, keepdim=True)
        assert ((got - want).abs() <= bound).all()


def test_attention_block_dynamic_true():
    """``torch.compile(dynamic=True)``: every size symbolic, and Python floats graph inputs
    unless ``specialize_float`` is set. The model's fp8 range (``amax / FP8_MAX``) is then a
    value only the run knows, and the kv side is declined naming that line (q fuses); with
    ``specialize_float`` both sides fuse, and a second token count runs without a recompile."""
    block = Dsv4AttentionBlock(num_layers=2, num_heads=H, padded_heads=HP, block_size=BLOCK, spelling=DSV4_SPELLINGS[4])
    inputs = make_inputs()
    x = torch.randn(T, 64).to(torch.bfloat16)
    args = (inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
    backend = PrepfuseBackend()
    torch.compile(block, backend=backend, dynamic=True)(x, *args, [fp8_ds_mla_cache(5, BLOCK) for _ in range(2)])
    patterns = [r.pattern for r in backend.reports.matches(PASS)]
    assert patterns == ["dsv4_q"] * 2, backend.reports.format(verbose=True)
    whys = [r.why for r in backend.reports.near_misses(PASS)]
    assert len(whys) == 2 and all("amax / FP8_MAX" in w and "specialize_float" in w for w in whys), whys

    torch._dynamo.reset()
    backend = PrepfuseBackend({"strict": True})
    with torch._dynamo.config.patch(specialize_float=True):
        compiled = torch.compile(block, backend=backend, dynamic=True)
        for tokens in (T, T - 2):
            caches = [fp8_ds_mla_cache(5, BLOCK) for _ in range(2)]
            ref_caches = [c.clone() for c in caches]
            sized = (inputs.positions[:tokens].clone(), inputs.slot_mapping[:tokens].clone(), inputs.cos_sin_cache)
            with torch._dynamo.config.patch(error_on_recompile=tokens != T):
                out = compiled(x[:tokens].clone(), *sized, caches)
            torch.testing.assert_close(out, block(x[:tokens], *sized, ref_caches), atol=0.1, rtol=0.05)
            _assert_layer_caches_close(caches, ref_caches, sized[1])
    patterns = [r.pattern for r in backend.reports.matches(PASS)]
    assert patterns == ["dsv4_q+kv"] * 2, backend.reports.format(verbose=True)


# --------------------------------------------------------------------------------------
# On CUDA: the Triton kernel in the compiled graph against eager CUDA PyTorch
# --------------------------------------------------------------------------------------
DEVICE_TOKENS = [
    pytest.param("cpu", 7, id="cpu-T7"),
    # one token under static shapes: index_put's decomposition squeezes the rows to [W]
    pytest.param("cpu", 1, id="cpu-T1"),
    pytest.param("cuda", 1, id="cuda-T1", marks=pytest.mark.gpu),
    pytest.param("cuda", 7, id="cuda-T7", marks=pytest.mark.gpu),
    pytest.param("cuda", 1000, id="cuda-T1000", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device, num_tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("v2", VERSIONS)
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_on_each_device(name, v2, device, num_tokens):
    """Every spelling fuses to one call; on CUDA that call is the Triton kernel, held to
    the DeepSeek-V4 bound (docs/design.md) against eager CUDA PyTorch (whose rsqrt is approximate)."""
    inputs = make_dsv4_inputs(num_tokens, H, HP, BLOCK, device, skip_fraction=0.0)
    r = run(prep(SPELLINGS[name]), inputs, v2=v2)
    assert r.matched == 1
    assert r.events("matched") == ["dsv4_q+kv"]
    fused = dataclasses.replace(inputs, q_out=r.out, k_cache=r.cache)
    eager = dataclasses.replace(inputs, q_out=r.ref_out, k_cache=r.ref_cache)
    cmp = compare_dsv4(eager, fused)
    assert cmp.within_spec(), cmp


def test_a_block_scale_one_power_of_two_apart_is_the_same_math():
    """Where the graph lost the code's bf16 rounding of kv (torch 2.11's Inductor drops
    ``.to(bf16).float()``: a kv normed upstream, T=512 on the CPU), a NoPE block's amax may
    sit across a power of two from the op's: its scale byte is one higher and its codes half.
    The cache compares its codes as the values they stand for, so that agrees; a scale two
    steps off does not (another amax floor, floor for ceil)."""
    from prepfuse.fx_passes.fusion.dsv4 import _fp8_ds_mla, _mxfp8_records
    from prepfuse.fx_passes.rewrite.compare import Checked, Mismatch, compare

    bs, gen = 4, torch.Generator().manual_seed(0)
    x = (torch.randn(bs, 448, generator=gen) * 100).clamp(-448, 448)
    region = fp8_ds_mla_cache(1, bs)
    row = region[0, : bs * 576].view(bs, 576)
    row[:, :448] = x.to(torch.float8_e4m3fn).view(torch.uint8)
    scales = region[0, bs * 576: bs * 584].view(bs, 8)
    scales[:, :7] = 120

    def moved(by: int) -> torch.Tensor:
        cache = region.clone()
        cache[0, 2 * 576 + 64: 2 * 576 + 128] = (x[2, 64:128] / 2**by).to(torch.float8_e4m3fn).view(torch.uint8)
        cache[0, bs * 576 + 2 * 8 + 1] += by  # slot 2's second block
        return cache

    check = Checked("k_cache", "region", "call", decode=_fp8_ds_mla(bs))
    compare(check, moved(1), region, 0, {})
    with pytest.raises(Mismatch, match="scale bytes"):
        compare(check, moved(2), region, 0, {})
    # MXFP8 records read the same way: 16 blocks of 32, their scale bytes after the codes
    records = torch.zeros(1, bs * 528, dtype=torch.uint8)
    y = (torch.randn(bs, 512, generator=gen) * 100).clamp(-448, 448)
    records.view(bs, 528)[:, :512] = y.to(torch.float8_e4m3fn).view(torch.uint8)
    records.view(bs, 528)[:, 512:] = 120
    shifted = records.clone()
    shifted.view(bs, 528)[1, 32:64] = (y[1, 32:64] / 2).to(torch.float8_e4m3fn).view(torch.uint8)
    shifted.view(bs, 528)[1, 513] += 1
    compare(Checked("k_cache", "region", "call", decode=_mxfp8_records(bs)), shifted, records, 0, {})
