"""``FuseGqaPrepPass``: unfused Qwen3 / Llama preparation becomes one fused op call.

Every compiled case asserts the three things a pass test asserts:

- numerics, compiled vs eager on fresh random inputs (all slots valid: the eager code
  cannot skip a slot). Spellings that rotate in fp32 (``hf_fp32``, ``halves``, ``gptj``):
  q and every cache byte identical (the op is their math, rounding for rounding; the
  HF norm's ``torch.rsqrt`` is correctly rounded on the CPU). Hugging Face's all-bf16
  RoPE (``hf_bf16``): pass-through dims and v identical, each rotated q / k value within
  ``1.25 * 2^-7 * (|a| + |b|)`` of eager (``a``, ``b`` its pair's bf16 inputs: bf16 cos/sin
  and three bf16 roundings are four relative errors of at most 2^-9 each; the op's
  docstring measured 0.0081), and bit for bit what eager gives for the same model
  rotating in fp32 (``hf_fp32``): the op is HF's formula evaluated in fp32.
  Look-alikes, left unfused, are Inductor's code against eager within the dtype's
  default ``assert_close`` tolerance;
- the exact ``matched_count`` (fused calls made) and the pattern of each;
- the golden normalized post-pass graph (``EXPECTTEST_ACCEPT=1`` regenerates them).

Shapes are small (T=7, Hq=4, Hkv=2, D=64, block 16) and Inductor's FX graph cache is off.
Compiles go through ``backend="prepfuse"`` with ``passes=("fuse_gqa_prep",)`` so the
graph printed is this pass's output; the in-place tests add ``defunctionalize``.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.gqa import FuseGqaPrepPass
from prepfuse.models import gqa as model
from prepfuse.models.gqa import GQA_LOOKALIKES, GQA_SPELLINGS, GqaAttentionBlock, GqaSpelling
from prepfuse.testing import CACHE_POISON, bf16_rope_pair_bound, e4m3_code_diff, make_gqa_inputs
from prepfuse.testing.golden import GoldenFiles
from prepfuse.testing.passes import PassReportQueries, compile_beside_eager, internal_error_named

GOLDEN = GoldenFiles.beside(__file__)

T, HQ, HKV, D, BLOCK, EPS = 7, 4, 2, 64, 16, 1e-6
PASS = FuseGqaPrepPass.name
SPELLINGS = {s.name: s for s in GQA_SPELLINGS}
LOOKALIKES = {s.name: s for s in GQA_LOOKALIKES}
VERSIONS = [pytest.param(False, id="v1"), pytest.param(True, id="v2")]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


# --------------------------------------------------------------------------------------
# Inputs and the compiled functions
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """One spelling's inputs: qkv (``separate``: the tuple of q, k, v), the norm modules,
    empty caches in its layout."""

    spelling: GqaSpelling
    qkv: torch.Tensor | tuple
    q_norm: object
    k_norm: object
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_scale: torch.Tensor | None

    def args(self, k_cache=None, v_cache=None) -> tuple:
        return (self.qkv, self.k_cache if k_cache is None else k_cache, self.v_cache if v_cache is None else v_cache,
                self.slot_mapping, self.positions, self.cos_sin_cache, self.kv_scale)


def make_case(spelling: GqaSpelling, num_tokens: int = T, head_dim: int = D, device="cpu", **kwargs) -> Case:
    fp8 = spelling.cache_dtype == torch.float8_e4m3fn
    inputs = make_gqa_inputs(num_tokens, HQ, HKV, head_dim, BLOCK, device, rotary_dim=spelling.rotary_dim,
                             cache_dtype=spelling.cache_dtype if fp8 else torch.bfloat16, skip_fraction=0.0, **kwargs)
    q_norm, k_norm = model.make_norms(head_dim, EPS, spelling, torch.Generator().manual_seed(1))
    if q_norm is not None:
        q_norm, k_norm = q_norm.to(device), k_norm.to(device)
    cache = model.kv_cache(inputs.k_cache.shape[0], BLOCK, HKV, head_dim, spelling, device)
    cache.view(torch.uint8).fill_(CACHE_POISON)  # a byte that should stay untouched shows up
    qkv = inputs.qkv.to(spelling.dtype)
    if spelling.split == "separate":  # three projections' outputs, each a tensor of its own
        qkv = tuple(part.contiguous() for part in qkv.split((HQ * head_dim, HKV * head_dim, HKV * head_dim), dim=1))
    return Case(spelling, qkv, q_norm, k_norm, cache, cache.clone(), inputs.slot_mapping,
                inputs.positions, inputs.cos_sin_cache, inputs.kv_scale)


def prep(case: Case):
    def fn(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale):
        return model.gqa_prep(qkv, case.q_norm, case.k_norm, k_cache, v_cache, slot_mapping, positions,
                              cos_sin_cache, kv_scale, HQ, HKV, case.spelling)
    return fn


def kv_only(case: Case):
    """The cache writes alone: nothing reads the prepared q."""
    def fn(*args):
        prep(case)(*args)
    return fn


def with_extra_users(case: Case):
    """The prep, plus readers of two intermediates: the normed k before RoPE (the op does
    not produce it) and the roped q times 2."""
    def fn(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale):
        q = prep(case)(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale)
        _, k, _ = model.split_qkv(qkv, HQ, HKV, D, case.spelling)
        return q, case.k_norm(k), q * 2
    return fn


@dataclasses.dataclass
class Run(PassReportQueries):
    pass_name = PASS  # a class attribute, not a field

    case: Case
    out: object
    caches: tuple
    ref_out: object
    ref_caches: tuple
    report: object  # GraphReport of the (single) compiled graph


def run(fn_of, case: Case, *, passes=(PASS,), v2=True) -> Run:
    """``fn_of(case)`` compiled by the prepfuse backend and eagerly, each on its own caches."""
    caches = (case.k_cache.clone(), case.v_cache.clone())
    ref_caches = (case.k_cache.clone(), case.v_cache.clone())
    out, ref_out, report = compile_beside_eager(fn_of(case), case.args(*caches), case.args(*ref_caches),
                                                passes=passes, v2=v2)
    return Run(case, out, caches, ref_out, ref_caches, report)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def rope_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 q and k heads RoPE reads (normed for Qwen3), computed eagerly."""
    head_dim = case.k_cache.shape[-1]
    q, k, _ = model.split_qkv(case.qkv, HQ, HKV, head_dim, case.spelling)
    return (case.q_norm(q), case.k_norm(k)) if case.q_norm is not None else (q, k)


def pair_bound(h: torch.Tensor, spelling: GqaSpelling) -> torch.Tensor:
    """The bf16-RoPE bound (``prepfuse.testing.bf16_rope_pair_bound``) per value of ``h``'s rotation."""
    return bf16_rope_pair_bound(h, spelling.rotary_dim or h.shape[-1], spelling.is_neox)


def slot_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` as ``[NB, bs, Hkv, D]``: a heads-first ``[NB, Hkv, bs, D]`` cache (the
    ``heads_slots`` spellings; HKV != BLOCK here, so the shape tells) permuted, a flat token
    pool ``[NB * bs, Hkv, D]`` (``flat``) cut into blocks, one sequence's ``[1, Hkv, S, D]``
    transposed and cut (a copy: for reading)."""
    if cache.dim() == 3:
        return cache.unflatten(0, (-1, BLOCK))
    if cache.shape[0] == 1 and cache.shape[1] == HKV and cache.shape[2] > BLOCK:  # one sequence's [1, Hkv, S, D]
        return cache[0].transpose(0, 1).unflatten(0, (-1, BLOCK))
    return cache.permute(0, 2, 1, 3) if cache.shape[1] == HKV and cache.shape[2] == BLOCK else cache


def written_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots // bs, slots % bs]`` (slot-major), gathered as bytes (not every device indexes fp8)."""
    return slot_major(cache.view(torch.uint8))[slots // BLOCK, slots % BLOCK].view(cache.dtype)


def assert_close_to_eager(r: Run) -> None:
    """Fused against eager, as the module docstring says."""
    spelling, case = r.case.spelling, r.case
    q, ref_q = first(r.out), first(r.ref_out)
    (k, v), (ref_k, ref_v) = r.caches, r.ref_caches
    assert torch.equal(v.view(torch.uint8), ref_v.view(torch.uint8))
    if spelling.rope != "hf_bf16":
        assert torch.equal(q, ref_q), int((q != ref_q).sum())
        assert torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8)), int((k.view(torch.uint8) != ref_k.view(torch.uint8)).sum())
        return
    assert spelling.cache_dtype == torch.bfloat16  # the bound below is for bf16 values
    q_in, k_in = rope_inputs(case)
    slots = case.slot_mapping
    assert ((q.float() - ref_q.float()).abs() <= pair_bound(q_in, spelling)).all()
    k_rows, ref_rows = written_rows(k, slots), written_rows(ref_k, slots)
    assert ((k_rows.float() - ref_rows.float()).abs() <= pair_bound(k_in[: slots.shape[0]], spelling)).all()
    # untouched cache bytes stay as they were
    k, ref_k = slot_major(k), slot_major(ref_k)
    mask = torch.ones(k.shape[:2], dtype=torch.bool)
    mask[slots // BLOCK, slots % BLOCK] = False
    assert torch.equal(k[mask].view(torch.uint8), ref_k[mask].view(torch.uint8))
    # and bit for bit HF's formula evaluated in fp32
    twin = dataclasses.replace(case, spelling=dataclasses.replace(spelling, rope="hf_fp32"))
    twin_caches = (case.k_cache.clone(), case.v_cache.clone())
    assert torch.equal(q, prep(twin)(*twin.args(*twin_caches)))
    assert torch.equal(k.view(torch.uint8), slot_major(twin_caches[0]).view(torch.uint8))


def graph_ops(graph: str) -> list[str]:
    """The op of each line of a normalized graph print."""
    return [line.split(" = ", 1)[1].split("(", 1)[0] for line in graph.splitlines() if " = " in line]


FUSED_OPS = ["placeholders", "prepfuse.scratch.default", "auto_functionalized_v2", "getitem", "getitem", "getitem",
             "aten.copy_.default", "aten.copy_.default"]


# --------------------------------------------------------------------------------------
# Every spelling fuses into one call
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_into_one_call(name):
    spelling = SPELLINGS[name]
    r = run(prep, make_case(spelling))
    assert_close_to_eager(r)
    assert r.matched == 1
    pattern = ("gqa_qknorm_rope_kv" if spelling.has_norm else "gqa_rope_kv") + (
        "+separate" if spelling.split == "separate" else "")
    assert r.events("matched") == [pattern]
    # nothing but the call: no stray node of the unfused math is left, but the fp32 weights
    # the graph computes for an fp32-weight norm, taken as the op's operands (q's, then k's)
    weight_ops = {"gemma": ["prims.convert_element_type.default", "aten.add.Tensor"] * 2,
                  "weight_in_fp32": ["prims.convert_element_type.default"] * 2}.get(spelling.norm, [])
    assert [op for op in graph_ops(r.report.graph) if op != "placeholders"] == weight_ops + FUSED_OPS[1:]


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_one_token_fuses(name):
    """One token under static shapes: torch's index_put decomposition squeezes the [1, Hkv, D]
    rows of each cache write to [Hkv, D]; the writes are still anchors and the call fuses
    (before, no write was even a candidate and nothing was logged)."""
    spelling = SPELLINGS[name]
    r = run(prep, make_case(spelling, num_tokens=1))
    assert_close_to_eager(r)
    assert r.matched == 1, r.events("declined")


def test_qwen3_golden_graph():
    r = run(prep, make_case(SPELLINGS["qwen3-hf"]))
    assert r.matched == 1
    GOLDEN.check(r.report.graph, "qwen3")


def test_separate_projections_golden_graph():
    """q, k and v as three tensors (HF's q_proj, k_proj, v_proj): the separate op, reading
    each where it lies, no concatenation."""
    r = run(prep, make_case(SPELLINGS["llama-gptj-separate-fp8"]))
    assert_close_to_eager(r)
    assert r.matched == 1
    GOLDEN.check(r.report.graph, "separate_projections")


def two_layers_of_inputs(case: Case):
    """Two layers' separate q, k, v given as graph inputs (no projection to tell layers
    apart), writing the same caches at the same slots (the later layer's rows stay), with
    the same positions and table. (Caches of the second layer cloned from the inputs are
    no graph input: torch 2.15 keeps the clone, where earlier torches write the input.)"""
    def fn(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale):
        q2 = tuple(t * 2 for t in qkv)
        return (prep(case)(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale),
                prep(case)(q2, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale))
    return fn


def test_separate_layers_that_cannot_be_told_apart_are_declined():
    """Two layers whose q, k, v share every setting and come from no projection: which q
    goes with which k is not in the graph, so the pass declines rather than guess."""
    r = run(two_layers_of_inputs, make_case(SPELLINGS["qwen3-hf-separate"]))
    assert r.matched == 0
    whys = [why for _, why in r.events("declined")]
    assert any("go to the same slots as k's" in why and "expected one" in why for why in whys), whys


def mixed_sources(case: Case):
    """q from the columns of a fused qkv, k and v from projections of their own."""
    def fn(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale):
        separate = (qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HKV) * D].clone(), qkv[:, (HQ + HKV) * D :].clone())
        return prep(case)(separate, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale)
    return fn


def test_q_of_a_fused_qkv_with_separate_k_and_v_fuses():
    """q from one tensor's columns, k and v from tensors of their own: the separate op reads
    each where it lies (q as a strided view of the qkv's columns)."""
    case = make_case(SPELLINGS["qwen3-hf-separate"])
    case = dataclasses.replace(case, qkv=torch.cat(case.qkv, dim=1))
    r = run(mixed_sources, case)
    assert r.matched == 1, r.events("declined")
    q, ref_q = first(r.out).float(), first(r.ref_out).float()
    torch.testing.assert_close(q, ref_q, atol=0.05, rtol=0.05)
    for got, want in zip(r.caches, r.ref_caches):
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.05)


def test_llama_fp8_partial_golden_graph():
    r = run(prep, make_case(SPELLINGS["llama-halves-partial-fp8"]))
    assert_close_to_eager(r)
    GOLDEN.check(r.report.graph, "llama_fp8_partial")


def test_gptj_golden_graph():
    r = run(prep, make_case(SPELLINGS["qwen3-gptj-slice"]))
    assert_close_to_eager(r)
    GOLDEN.check(r.report.graph, "gptj")


@pytest.mark.parametrize("v2", VERSIONS)
def test_functionalization_versions(v2):
    r = run(prep, make_case(SPELLINGS["qwen3-hf_fp32-slice-fp8"]), v2=v2)
    assert_close_to_eager(r)
    assert r.matched == 1
    if v2:
        GOLDEN.check(r.report.graph, "functionalization_v2")
    else:
        GOLDEN.check(r.report.graph, "functionalization_v1")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_sizes(head_dim):
    spelling = dataclasses.replace(SPELLINGS["qwen3-hf_fp32-slice-fp8"], rotary_dim=head_dim // 2)
    r = run(prep, make_case(spelling, head_dim=head_dim))
    assert_close_to_eager(r)
    assert r.matched == 1 and r.events("matched") == ["gqa_qknorm_rope_kv"]


@pytest.mark.parametrize("v2", VERSIONS)
def test_runs_in_place_after_defunctionalize(v2):
    """With the default pass list the op writes q_out and the caller's caches directly:
    Inductor's code is the op call alone, no kernel, copy or clone around it."""
    case = make_case(SPELLINGS["llama-gptj-partial"])
    caches, ref_caches = (case.k_cache.clone(), case.v_cache.clone()), (case.k_cache.clone(), case.v_cache.clone())
    backend = PrepfuseBackend({"auto_functionalized_v2": v2, "strict": True})
    out, (code,) = run_and_get_code(torch.compile(prep(case), backend=backend, fullgraph=True), *case.args(*caches))
    ref = prep(case)(*case.args(*ref_caches))
    assert_close_to_eager(Run(case, out, caches, ref, ref_caches, None))
    (report,) = backend.reports
    assert {name: n for name, n in report.matched_counts.items() if n} == {PASS: 1, "defunctionalize": 1}
    (FileCheck().check_count("torch.ops.prepfuse.gqa_qknorm_rope_kv_insert.default(", 1, exactly=True)
     .check_not("copy_").check_not("clone").run(code))
    FileCheck().check_not("cpp_fused").run(code)


def halves(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v caches as the two halves of one ``[NB, 2, bs, Hkv, D]`` buffer (FlashInfer's
    layout): two aliasing inputs, which AOT autograd merges into one base of two views."""
    return buffer[:, 0], buffer[:, 1]


@pytest.mark.parametrize("v2", VERSIONS)
def test_caches_are_views_of_one_buffer(v2):
    """Both writes go into views of one buffer (``as_strided`` of the merged base, each
    scattered back): one call; v2 passes the buffer once, as the base of both cache views,
    so the default pass list writes it in place (no copy); v1 passes the two views and
    scatters their new values back (correct; defunctionalize leaves it functional)."""
    case = make_case(SPELLINGS["qwen3-hf_fp32-slice-fp8"])
    buffer = torch.stack((case.k_cache, case.v_cache), dim=1)
    for passes in ((PASS,), (PASS, "defunctionalize")):
        torch._dynamo.reset()
        compiled_buffer, eager_buffer = buffer.clone(), buffer.clone()
        backend = PrepfuseBackend({"passes": passes, "record_graphs": True, "auto_functionalized_v2": v2})
        out, (code,) = run_and_get_code(torch.compile(prep(case), backend=backend, fullgraph=True),
                                        *case.args(*halves(compiled_buffer)))
        ref = prep(case)(*case.args(*halves(eager_buffer)))
        assert torch.equal(out, ref) and torch.equal(compiled_buffer.view(torch.uint8), eager_buffer.view(torch.uint8))
        (report,) = backend.reports
        assert report.matched_counts[PASS] == 1
    # the report, code and golden graph below are of the last compile: both passes
    if v2:  # in place: the op call on two views of the buffer, nothing else
        assert report.matched_counts["defunctionalize"] == 1
        FileCheck().check_count("gqa_qknorm_rope_kv_insert.default(", 1, exactly=True).check_not("copy_").run(code)
        FileCheck().check_not("clone").check_not("cpp_fused").run(code)
        GOLDEN.check(report.graph, "caches_are_views_of_one_buffer_v2")
    else:
        assert report.functionalized_left  # v1 clones each written argument: two views of one buffer stay functional
        GOLDEN.check(report.graph, "caches_are_views_of_one_buffer_v1")


# --------------------------------------------------------------------------------------
# Extra users, fewer slots than tokens, dynamic T
# --------------------------------------------------------------------------------------
def test_extra_users_keep_their_values():
    r = run(with_extra_users, make_case(SPELLINGS["qwen3-hf_fp32-slice-fp8"]))
    assert_close_to_eager(r)
    assert r.matched == 1
    assert torch.equal(r.out[2], r.ref_out[2])  # reads q_out
    torch._dynamo.reset()
    unfused = run(with_extra_users, r.case, passes=())
    assert unfused.matched == 0 and torch.equal(r.out[1], unfused.out[1])  # the same nodes as without the pass
    GOLDEN.check(r.report.graph, "extra_users_keep_their_values")


def test_fewer_slots_than_tokens():
    """slot_mapping has T' < T rows: the rows written are ``k[:T']``, the op reads all of qkv."""
    r = run(prep, make_case(SPELLINGS["qwen3-gptj-slice"], num_inserted=4))
    assert_close_to_eager(r)
    assert r.matched == 1 and [op for op in graph_ops(r.report.graph) if op != "placeholders"] == FUSED_OPS[1:]


def test_dynamic_token_count():
    spelling = SPELLINGS["llama-halves-partial-fp8"]
    case = make_case(spelling)
    backend = PrepfuseBackend({"passes": (PASS,), "record_graphs": True})
    compiled = torch.compile(prep(case), backend=backend, fullgraph=True)
    for num_tokens in (7, 5, 12):
        case = dataclasses.replace(make_case(spelling, num_tokens=num_tokens), kv_scale=case.kv_scale)
        for t in (case.qkv, case.slot_mapping, case.positions):
            torch._dynamo.mark_dynamic(t, 0)
        caches, ref_caches = (case.k_cache.clone(), case.v_cache.clone()), (case.k_cache.clone(), case.v_cache.clone())
        out = compiled(*case.args(*caches))
        ref = prep(case)(*case.args(*ref_caches))
        assert_close_to_eager(Run(case, out, caches, ref, ref_caches, None))
    (report,) = backend.reports  # one graph for every T
    assert report.matched_counts == {PASS: 1}
    GOLDEN.check(report.graph, "dynamic_token_count")


@pytest.mark.parametrize("name, op", [("qwen3-hf", "gqa_qknorm_rope_kv_insert"),
                                      ("qwen3-hf-separate", "gqa_separate_qknorm_rope_kv_insert")])
def test_attention_block_dynamic(name, op):
    """Two Qwen3-style layers, T dynamic, the default pass list: one fused call per layer,
    in place. Layer 2 reads layer 1's output, which Inductor computes in its own order,
    so outputs and caches are compared with a tolerance. With separate projections both
    layers' q, k and v share slots and tables: each layer's three are told apart by the
    activation they project."""
    spelling = SPELLINGS[name]
    block = GqaAttentionBlock(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, spelling=spelling)
    case = make_case(spelling)
    x = torch.randn(T, 64).to(torch.bfloat16)
    for t in (x, case.slot_mapping, case.positions):
        torch._dynamo.mark_dynamic(t, 0)
    caches = [(case.k_cache.clone(), case.v_cache.clone()) for _ in range(2)]
    ref_caches = [tuple(c.clone() for c in pair) for pair in caches]
    backend = PrepfuseBackend({"strict": True})
    args = (case.positions, case.slot_mapping, case.cos_sin_cache)
    out, (code,) = run_and_get_code(torch.compile(block, backend=backend, fullgraph=True), x, *args, caches)
    ref = block(x, *args, ref_caches)
    (report,) = backend.reports
    assert {name: n for name, n in report.matched_counts.items() if n} == {PASS: 2, "defunctionalize": 2}
    FileCheck().check_count(f"torch.ops.prepfuse.{op}.default(", 2, exactly=True).run(code)
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)
    slots = case.slot_mapping
    for got, want in zip(caches, ref_caches):
        for c, rc in zip(got, want):
            torch.testing.assert_close(written_rows(c, slots).float(), written_rows(rc, slots).float(), atol=0.05, rtol=0.05)


# --------------------------------------------------------------------------------------
# Look-alikes and incomplete preparation stay unfused, with the reason logged
# --------------------------------------------------------------------------------------
LOOKALIKE_CASES = [
    # (look-alike, declined candidates, words of the reason)
    ("k_norm_eps_differs", 1, "q_out differs"),  # the op's one eps cannot be both
    ("rotate_half_unsigned", 1, "differs at"),
    ("float16", 2, "the cache is torch.float16"),
]


def test_bf16_weight_promoted_to_fp32_fuses(monkeypatch):
    """``(normed_fp32 * weight_bf16).to(bf16)``: type promotion multiplies in fp32 with no
    ``.float()`` node; the op's fp32-weight form (the weight converted once, outside the
    call) is that math, which the probes confirm."""
    def promoted(self, h):
        dtype, h = h.dtype, h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * self.weight).to(dtype)

    monkeypatch.setattr(model.RMSNorm, "forward", promoted)
    r = run(prep, make_case(SPELLINGS["qwen3-hf"]))
    assert r.matched == 1, r.events("declined")
    assert_close_to_eager(r)  # the spelling's bf16 RoPE bound, and bit for bit its fp32 twin


def test_fp8_rows_multiplied_by_the_reciprocal_scale_fuse():
    """``rows * (1 / kv_scale)`` against the op's ``rows / kv_scale``: the two roundings
    differ by at most one e4m3 step, within the probes' fp8 bound, so the call fuses; each
    dequantised value is within one step of eager's."""
    r = run(prep, make_case(LOOKALIKES["fp8_mul_reciprocal"]))
    assert r.matched == 1, r.events("declined")
    scale = r.case.kv_scale
    for c, rc in zip(r.caches, r.ref_caches):
        got, want = c.float() * scale, rc.float() * scale
        assert ((got - want).abs() <= torch.maximum(want.abs() * 2**-3, 2**-9 * scale)).all()


def test_row_offset_write_fuses_as_block_and_row():
    """``cache[s // bs, (s + 1) % bs] = rows`` was a look-alike while the pass read only
    ``cache[s // bs, s % bs]``. A write at ``[block, x % bs]`` is now fused with the op's slot
    computed as ``block * bs + row`` (``BlockRows``, page tables): the op then writes exactly
    the rows the code writes, which the probes confirm. (It stays in ``GQA_LOOKALIKES`` as the
    code a recogniser that ignores whose slots a row index reads would misread:
    ``tests/fx_passes/test_validation.py``.)"""
    r = run(prep, make_case(LOOKALIKES["cache_row_offset_by_one"]))
    assert r.matched == 1, r.report.format(verbose=True)
    (k, v), (ref_k, ref_v) = r.caches, r.ref_caches
    assert torch.equal(v, ref_v)  # v rows as they are, at the same places
    torch.testing.assert_close(k.float(), ref_k.float(), atol=0.05, rtol=0.05)  # HF's bf16 rotation


@pytest.mark.parametrize("name, declined, why", LOOKALIKE_CASES, ids=[c[0] for c in LOOKALIKE_CASES])
def test_lookalike_is_left_alone(name, declined, why, caplog):
    """Left unfused, with the reason logged at DEBUG. Inductor's code for the unfused math
    against eager: Inductor rotates bf16 in fp32 without the intermediate roundings, so
    within the pair bound plus one bf16 ULP of the value; fp8 codes within one code."""
    spelling = LOOKALIKES[name]
    with caplog.at_level(logging.DEBUG, logger="prepfuse.passes"):
        r = run(prep, make_case(spelling))
    assert r.matched == 0 and not r.report.ops_after  # no prepfuse op in the compiled graph
    events = r.events("declined")
    assert len(events) == declined and all(p == "gqa" and why in reason for p, reason in events), events
    assert not any(internal_error_named(reason) for _, reason in events), events
    assert any("declined" in rec.getMessage() and why in rec.getMessage() for rec in caplog.records)

    q_in, k_in = rope_inputs(r.case)
    q, ref_q = first(r.out).float(), first(r.ref_out).float()
    assert ((q - ref_q).abs() <= pair_bound(q_in, spelling) + ref_q.abs() * 2**-7).all()
    (k, v), (ref_k, ref_v) = r.caches, r.ref_caches
    bound = torch.zeros_like(k, dtype=torch.float32)  # the pair bound at each written value
    model.insert(bound, pair_bound(k_in, spelling), r.case.slot_mapping, spelling)
    if k.dtype == torch.float8_e4m3fn:  # dequantised, plus one e4m3 step of the value
        scale = r.case.kv_scale
        for c, rc, b in ((k, ref_k, bound), (v, ref_v, torch.zeros_like(bound))):
            got, want = c.float() * scale, rc.float() * scale
            step = torch.maximum(want.abs() * 2**-3, 2**-9 * scale)
            assert ((got - want).abs() <= b + want.abs() * 2**-7 + step).all()
        return
    assert torch.equal(v, ref_v)
    assert ((k.float() - ref_k.float()).abs() <= bound + ref_k.float().abs() * 2**-7).all()


def unrounded_k(case: Case):
    """``case``'s prep with the k rows quantised from the fp32 rotation, no ``.to(bf16).float()``
    between: the graph torch 2.11's Inductor makes of the rounded code (its ``pointless_convert``
    drops the round trip)."""
    spelling = case.spelling

    def fn(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale):
        q, k, v = model.split_qkv(qkv, HQ, HKV, D, spelling)
        q, k = case.q_norm(q), case.k_norm(k)
        cos, sin = model.cos_sin(cos_sin_cache, positions)
        cu, su = cos.unsqueeze(1), sin.unsqueeze(1)
        c, s = torch.cat((cu, cu), dim=-1), torch.cat((su, su), dim=-1)
        h = k.float()
        k32 = (h * c) + (model.rotate_half(h) * s)  # hf_fp32's rotation, not rounded
        model.insert(k_cache, (k32 / kv_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), slot_mapping, spelling)
        model.insert(v_cache, model.cache_rows(v, kv_scale, spelling), slot_mapping, spelling)
        return model.rope(q, cos, sin, spelling)
    return fn


def test_unrounded_fp8_rows_fuse_within_one_e4m3_step(caplog):
    """fp8 k rows quantised from the fp32 rotation, no bf16 rounding before the cast (what
    torch 2.11's Inductor leaves of the rounded code, and what code may write): the op rounds
    k to bf16 before its cast, which moves a code by at most one e4m3 step, within the
    probes' fp8 bound; the call fuses and each dequantised value is within one step."""
    case = make_case(SPELLINGS["qwen3-hf_fp32-slice-fp8"])
    with caplog.at_level(logging.DEBUG, logger="prepfuse.passes"):
        r = run(unrounded_k, case)
    assert r.matched == 1 and r.events("matched") == ["gqa_qknorm_rope_kv"], r.events("declined")
    assert torch.equal(first(r.out), first(r.ref_out))
    (k, v), (ref_k, ref_v) = r.caches, r.ref_caches
    assert torch.equal(v.view(torch.uint8), ref_v.view(torch.uint8))
    assert e4m3_code_diff(k.view(torch.uint8), ref_k.view(torch.uint8)).max() <= 1
    assert [op for op in graph_ops(r.report.graph) if op != "placeholders"] == FUSED_OPS[1:]


def test_fp32_heads_read_otherwise_keep_their_own_value():
    """q's fp32 rotation read by other math besides the cache rows is no second prepared q
    (two would decline the call), and keeps its own value."""
    case = make_case(SPELLINGS["qwen3-hf_fp32-slice-fp8"])
    inner = unrounded_k(case)

    def fn(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale):
        q = inner(qkv, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, kv_scale)
        heads, _, _ = model.split_qkv(qkv, HQ, HKV, D, case.spelling)
        cos, sin = model.cos_sin(cos_sin_cache, positions)
        cu, su = cos.unsqueeze(1), sin.unsqueeze(1)
        h = case.q_norm(heads).float()
        q32 = (h * torch.cat((cu, cu), dim=-1)) + (model.rotate_half(h) * torch.cat((su, su), dim=-1))
        return q, q32 * 2

    r = run(lambda _: fn, case)
    assert r.matched == 1 and r.events("matched") == ["gqa_qknorm_rope_kv"]
    assert torch.equal(r.out[0], prep(case)(*case.args(*r.ref_caches)))
    torch._dynamo.reset()
    unfused = run(lambda _: fn, case, passes=())
    assert r.out[1].dtype == torch.float32 and torch.equal(r.out[1], unfused.out[1])  # the same nodes as without the pass


def test_cache_writes_without_q_are_declined(caplog):
    """The op reads q, k and v of one qkv: writes whose q nobody reads are not fused."""
    with caplog.at_level(logging.DEBUG, logger="prepfuse.passes"):
        r = run(kv_only, make_case(SPELLINGS["qwen3-hf"]))
    assert r.matched == 0
    assert r.events("declined") == [("gqa", "q: no prepared q (rotated heads of the q projection read by a later step) "
                                             "goes with k")]


# --------------------------------------------------------------------------------------
# On CUDA: the Triton kernel in the compiled graph against eager CUDA PyTorch
# --------------------------------------------------------------------------------------
DEVICE_TOKENS = [
    pytest.param("cuda", 1, id="cuda-T1", marks=pytest.mark.gpu),
    pytest.param("cuda", 7, id="cuda-T7", marks=pytest.mark.gpu),
    pytest.param("cuda", 1000, id="cuda-T1000", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device, num_tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("v2", VERSIONS)
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses_on_cuda(name, v2, device, num_tokens):
    """Every spelling fuses to one call; on CUDA that call is the Triton kernel, against
    eager CUDA PyTorch. Eager CUDA ``rsqrt`` is approximate: one fp32 ULP off moves a normed
    bf16 value by at most one ULP, which RoPE carries into both values of its pair. So q
    and k are held to twice the pair bound plus one bf16 ULP of the value (every spelling),
    fp8 cache codes to one e4m3 code, v exactly."""
    spelling = SPELLINGS[name]
    seed = int(torch.randint(0, 2**31, ()))
    r = run(prep, make_case(spelling, num_tokens=num_tokens, device=device,
                            generator=torch.Generator().manual_seed(seed)), v2=v2)
    assert r.matched == 1
    q_in, k_in = rope_inputs(r.case)
    slots = r.case.slot_mapping

    def assert_within(got, want, rope_input):
        # 2^-6 |want|, not one ULP (2^-7): with the weighted norm a one-ULP flip of the
        # normed value becomes w * (n + ulp), rounded again: up to two ULPs of the result
        # (seen on an H200 in a pass-through dim of the partial-rotary spelling)
        bound = 2 * pair_bound(rope_input, spelling) + want.float().abs() * 2**-6
        assert ((got.float() - want.float()).abs() <= bound).all(), f"seed={seed}"

    assert_within(first(r.out), first(r.ref_out), q_in)
    (k, v), (ref_k, ref_v) = r.caches, r.ref_caches
    assert torch.equal(v.view(torch.uint8), ref_v.view(torch.uint8)), f"seed={seed}"
    k_rows, ref_rows = written_rows(k, slots), written_rows(ref_k, slots)
    if k.dtype == torch.float8_e4m3fn:
        # fp8 codes: one e4m3 step, plus what the rotation carries of eager's approximate
        # rsqrt. A one-ULP move of a normed pair (a, b) moves a*cos - b*sin by up to
        # ~2^-8 (|a| + |b|): where the rotation cancels, the result is small and that is
        # several e4m3 steps of it (an H200 once saw codes 2 apart at T=1000). So the bound
        # is in values: twice the pair bound over kv_scale, plus one step of the value.
        got, want = k_rows.float(), ref_rows.float()
        step = torch.maximum(want.abs() * 2**-3, torch.full_like(want, 2**-9))
        bound = 2 * pair_bound(k_in[: slots.shape[0]], spelling) / r.case.kv_scale.float() + step
        assert ((got - want).abs() <= bound).all(), (
            f"seed={seed}: codes {int(e4m3_code_diff(k_rows.view(torch.uint8), ref_rows.view(torch.uint8)).max())} apart")
    else:
        assert_within(k_rows, ref_rows, k_in[: slots.shape[0]])


# cache writes the pass does not fuse, declined by name: every other position of a static
# cache overwritten (consecutive ones fuse: test_gqa_static_cache_slices.py), and one set of
# rows written into every sequence of a batch's (one set per sequence fuses: the batched
# corpus cases)
def _sliced_write(k, cache, pos):
    cache[:, :, 3:3 + 2 * k.shape[2]:2] = k
    return cache.sum()


def _broadcast_write(k, cache, pos):
    cache[:, :, pos] = k[:1]  # the first sequence's rows into both
    return cache.sum()


def _added_to_pool(k, cache, pos):
    cache.view(-1, HKV, D).index_put_((pos,), k[0].transpose(0, 1), accumulate=True)
    return cache.sum()


def _one_head_into_pool(k, cache, pos):
    cache.view(-1, HKV, D)[pos, torch.zeros_like(pos)] = k[0, 0]  # head 0's [n, D] rows into [N, Hkv, D]
    return cache.sum()


@pytest.mark.parametrize("fn, words", [
    (_sliced_write, "are not heads of 64 values of a projection"),
    (_broadcast_write, "list tokens or heads in an order the op cannot write"),
    (_added_to_pool, "accumulate=True"),
    (_one_head_into_pool, "are not heads of 64 values of a projection"),
], ids=["slice", "broadcast", "accumulate", "one-head"])
def test_unfused_sequence_cache_writes_are_declined_by_name(fn, words):
    """The report says where the match stopped, for the cache forms other engines use
    (before, these writes gave no near miss at all; token-pool writes that were no
    candidate neither)."""
    backend = PrepfuseBackend({"passes": (PASS,)})
    k, cache, pos = torch.randn(2, HKV, 3, D).to(torch.bfloat16), torch.zeros(2, HKV, 16, D).to(torch.bfloat16), \
        torch.tensor([1, 4, 6])
    ref_cache = cache.clone()
    assert torch.equal(torch.compile(fn, backend=backend, fullgraph=True)(k, cache, pos), fn(k, ref_cache, pos))
    (report,) = backend.reports
    assert report.matched_counts[PASS] == 0
    whys = [r.why for r in report.near_misses()]
    assert len(whys) == 1 and whys[0].startswith("write: ") and words in whys[0], whys
