"""DeepSeek-V4.1's preparation as vLLM serves it: q rotated without a per-head norm (the model
norms before its q up-projection), kv rotated and written as MXFP8 records (512 e4m3 codes over
16 UE8M0 scales of 32 values, then the 16 scale bytes; vLLM's ``kv_mxfp8``). Found by the same
pass as DeepSeek-V4's (``FuseDsv4PrepPass``): the records by what is written where, the missing
norm on probes, so one call of ``prepfuse::dsv4_qnorm_rope_kv_insert`` with ``apply_q_norm=False,
kv_mxfp8=True``.

Numerics compiled vs eager: q within one bf16 ULP (the op rotates in fp32 and rounds once, as
the code does), the cache's records byte for byte but a code step where a rotated value sits on
a rounding boundary, every byte outside the inserted records untouched. A look-alike whose scale
exponent is floored, not ceiled, is declined by the probes.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.fusion.dsv4 import FuseDsv4PrepPass
from prepfuse.models import dsv4 as model
from prepfuse.models.dsv4 import DSV4_SPELLINGS, mxfp8_cache, write_mxfp8_records
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import HEAD_DIM, NOPE_DIM
from prepfuse.testing import bf16_ulp_diff, e4m3_code_diff, make_dsv4_inputs, seeded_generator

T, H, HP, BLOCK = 7, 3, 8, 16
PASS = FuseDsv4PrepPass.name
SPELLING = DSV4_SPELLINGS[0]

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def v41_prep(whole: bool = True, floor_scale: bool = False):
    """q: GPT-J RoPE of the last 64 dims, head-padded; kv: the same RoPE rounded to bf16, then
    the row as MXFP8 records (``whole``: one 528-byte write, else codes and scale bytes apart);
    ``floor_scale``: the look-alike's ``floor(log2(amax / 448))``."""
    def fn(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
        torch._check(kv.shape[0] == q.shape[0])
        cos, sin = model.cos_sin(cos_sin_cache, positions)
        x = q.float()
        pe = model.rope(x[..., NOPE_DIM:], cos.unsqueeze(1), sin.unsqueeze(1), SPELLING)
        q_padded = model.pad_heads(torch.cat((x[..., :NOPE_DIM], pe), dim=-1).to(q.dtype), HP, SPELLING)
        rows = kv.float()
        rows = torch.cat((rows[:, :NOPE_DIM], model.rope(rows[:, NOPE_DIM:], cos, sin, SPELLING).to(kv.dtype).float()),
                         dim=-1)
        if floor_scale:
            _floored_records(rows, k_cache, slot_mapping)
        else:
            write_mxfp8_records(rows, k_cache, slot_mapping, BLOCK, whole=whole)
        return q_padded
    return fn


def _floored_records(rows, k_cache, slot_mapping):
    blocks = rows.unflatten(-1, (16, 32))
    e = torch.floor(torch.log2(blocks.abs().amax(dim=-1).clamp_min(1e-4) / 448.0))
    codes = (blocks * torch.exp2(-e).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    records = torch.cat((codes.flatten(-2), (e + 127).clamp(0, 255).to(torch.uint8)), dim=-1)
    view = k_cache[:, : BLOCK * 528].view(k_cache.shape[0], BLOCK, 528)
    view[slot_mapping // BLOCK, slot_mapping % BLOCK] = records


def inputs_and_copies():
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cpu", generator=generator, skip_fraction=0.0, kv_mxfp8=True)
    cache = mxfp8_cache(inputs.k_cache.shape[0], BLOCK)
    cache.fill_(0xA5)
    args = (inputs.q, inputs.kv, cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    return seed, args, (inputs.q, inputs.kv, cache.clone(), *args[3:])


def compiled_and_eager(fn, dynamic: bool = False, inductor: bool = False):
    """``dynamic``: the token dim of q, kv, the slots and the positions marked dynamic (a model's
    other sizes are its weights', static). ``inductor``: the reference compiled by plain
    Inductor instead of eager (what a declined graph must equal)."""
    seed, args, eager_args = inputs_and_copies()
    backend = PrepfuseBackend({"passes": (PASS,)})
    if dynamic:
        for t in (args[0], args[1], args[3], args[4]):
            torch._dynamo.mark_dynamic(t, 0)
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
        ref = (torch.compile(fn, backend="inductor", fullgraph=True) if inductor else fn)(*eager_args)
    (report,) = backend.reports
    return seed, report, (out, args[2]), (ref, eager_args[2])


@pytest.mark.parametrize("whole", [True, False], ids=["records", "codes-and-scales"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "mark_dynamic"])
def test_v41_prep_fuses_into_one_call(whole, dynamic):
    seed, report, (out, cache), (ref, ref_cache) = compiled_and_eager(v41_prep(whole), dynamic)
    assert [m.pattern for m in report.matches() if m.pass_name == PASS] == ["dsv4_q+kv"], report.format(verbose=True)
    assert "no q norm, MXFP8 records" in report.format(verbose=True)
    assert not report.near_misses(PASS), report.format(verbose=True)
    assert int(bf16_ulp_diff(out, ref).max()) <= 1, f"seed={seed}"
    codes = torch.zeros(cache.shape, dtype=torch.bool)
    codes[:, : BLOCK * 528] = (torch.arange(BLOCK * 528) % 528 < HEAD_DIM)
    assert int(torch.where(codes, e4m3_code_diff(cache, ref_cache), 0).max()) <= 1, f"seed={seed}"
    assert torch.equal(cache[~codes], ref_cache[~codes]), f"seed={seed}: scale bytes or bytes past the records differ"


def test_floored_scale_lookalike_declines():
    """The same bytes' layout with ``floor`` for ``ceil``: values past 448 would saturate; the
    probes tell, and the pass declines naming the kv write (no call)."""
    # declined: the reference is the code as plain Inductor compiles it (past 448 its rounding and
    # eager's may part: torch 2.15, 9 codes on one seed)
    seed, report, (out, cache), (ref, ref_cache) = compiled_and_eager(v41_prep(floor_scale=True), inductor=True)
    assert not any(m.pattern.endswith("kv") for m in report.matches() if m.pass_name == PASS), \
        report.format(verbose=True)
    assert torch.equal(cache, ref_cache) or int(e4m3_code_diff(cache, ref_cache).max()) <= 1, f"seed={seed}"
