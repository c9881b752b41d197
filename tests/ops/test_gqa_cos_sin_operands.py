"""The GQA ops' two-table cos/sin operand: ``cos`` and ``sin`` as two tensors (fp32 or
bf16, any row stride) in place of ``cos_sin_cache``, and ``positions=None`` (token t reads
row t), so that cos/sin a model computes per token, or a bf16 table, reach the op as they
lie instead of through a copy into one fp32 table.

Held against the table form, bit for bit (the same values as one fp32 table with
positions: a bf16 value widens exactly), on the reference and on the kernel (the
interpreter on CPU, the compiled kernel on CUDA), and every malformed operand rejected by
name with nothing written, in eager and in the fake impl. Fresh seeds, poisoned outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.ops import (
    GQA_QKNORM_ROPE_KV_INSERT,
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)
from prepfuse.testing import (
    call_with_fake_tensors, compare_gqa, seeded_generator, seeded_gqa_inputs, with_cos_sin_operands,
    with_full_cos_sin,
)
from tests.ops.gqa_parity import assert_kernel_matches_reference, run
from tests.ops.test_gqa_qknorm_rope_kv_insert import bits, needs_interpreter, needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
IMPLS = [
    pytest.param(gqa_qknorm_rope_kv_insert_reference, id="reference"),
    pytest.param(gqa_qknorm_rope_kv_insert_triton, id="triton", marks=needs_triton),
]
# (dtype, per token, row padding): fp32 views of a table, a bf16 table, per-token bf16
# values as a model computes them, and per-token fp32 rows of a wider buffer
FORMS = [
    pytest.param(torch.float32, False, 0, id="fp32-table"),
    pytest.param(torch.bfloat16, False, 0, id="bf16-table"),
    pytest.param(torch.bfloat16, True, 0, id="bf16-per-token"),
    pytest.param(torch.float32, True, 5, id="fp32-per-token-strided"),
]


def operand_inputs(device, head_dim=64, rotary_dim=None, is_neox=True, cache_dtype=torch.bfloat16, num_tokens=9, *,
                   dtype=torch.float32, per_token=False, row_padding=0, full=False):
    inputs, seed = seeded_gqa_inputs(num_tokens, 4, 2, head_dim, 16, device, rotary_dim=rotary_dim, is_neox=is_neox,
                                     cache_dtype=cache_dtype, max_pos=64)
    if full:
        inputs = with_full_cos_sin(inputs, seeded_generator()[0])
    operands, table = with_cos_sin_operands(inputs, dtype=dtype, per_token=per_token, row_padding=row_padding)
    return operands, table, seed


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("full", [False, True], ids=["half", "full"])
@pytest.mark.parametrize("dtype,per_token,row_padding", FORMS)
def test_two_tables_write_the_table_forms_bytes(impl, dtype, per_token, row_padding, full):
    """cos and sin as two tensors write what one fp32 table of the same values does."""
    operands, table, seed = operand_inputs(DEVICE, dtype=dtype, per_token=per_token, row_padding=row_padding, full=full)
    want, got = run(impl, table), run(impl, operands)
    assert compare_gqa(want, got).exact(), f"seed={seed}: {compare_gqa(want, got)}"


def test_positions_none_reads_the_row_of_each_token():
    """``positions=None`` is ``positions = arange(T)``, and a table longer than T is fine."""
    operands, _, seed = operand_inputs("cpu")
    with_positions = dataclasses.replace(operands, positions=torch.arange(9))
    rows = dataclasses.replace(operands, positions=None)
    want = run(gqa_qknorm_rope_kv_insert_reference, with_positions)
    got = run(gqa_qknorm_rope_kv_insert_reference, rows)
    assert compare_gqa(want, got).exact(), f"seed={seed}"
    # and the positions matter: the table's rows in another order write other q values
    reversed_rows = dataclasses.replace(operands, positions=torch.arange(9).flip(0))
    assert not torch.equal(bits(run(gqa_qknorm_rope_kv_insert_reference, reversed_rows).q_out), bits(got.q_out))


def test_separate_op_takes_the_operands_too():
    operands, table, seed = operand_inputs("cpu", dtype=torch.bfloat16, per_token=True)
    want = run(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, table, separate=True)
    got = run(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, operands, separate=True)
    assert compare_gqa(want, got).exact(), f"seed={seed}: {compare_gqa(want, got)}"


KERNEL_CASES = [  # (head size, rotary dim, NeoX, full, dtype, per token, row padding)
    (64, None, True, False, torch.bfloat16, True, 0),
    (128, 32, False, False, torch.float32, False, 3),
    (128, 44, True, False, torch.bfloat16, False, 0),
    (128, 44, False, True, torch.float32, True, 2),
    (64, None, False, True, torch.bfloat16, True, 0),
]


def kernel_against_reference(device, case, cache_dtype, num_tokens) -> None:
    head_dim, rotary_dim, is_neox, full, dtype, per_token, row_padding = case
    operands, _, seed = operand_inputs(device, head_dim, rotary_dim, is_neox, cache_dtype, num_tokens, dtype=dtype,
                                       per_token=per_token, row_padding=row_padding, full=full)
    kernel = gqa_qknorm_rope_kv_insert_triton if device == "cpu" else GQA_QKNORM_ROPE_KV_INSERT
    assert_kernel_matches_reference(kernel, operands, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_interpreted_kernel_matches_the_reference(case, cache_dtype):
    kernel_against_reference("cpu", case, cache_dtype, num_tokens=7)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_cuda_kernel_matches_the_reference(case, cache_dtype, num_tokens):
    kernel_against_reference("cuda", case, cache_dtype, num_tokens)


def _half(operands, **changes):
    return dataclasses.replace(operands, **changes)


BAD = [
    ("both forms", lambda o, t: _half(o, cos_sin_cache=t.cos_sin_cache), "cos: must be None when cos_sin_cache"),
    ("neither", lambda o, t: _half(o, cos=None, sin=None), "cos_sin_cache: is None; pass cos_sin_cache, or both"),
    ("no sin", lambda o, t: _half(o, sin=None), "sin: is None"),
    ("fp16", lambda o, t: _half(o, cos=o.cos.half(), sin=o.sin.half()), "cos: expected dtype torch.float32 or"),
    ("mixed dtypes", lambda o, t: _half(o, sin=o.sin.to(torch.bfloat16)), "sin: expected dtype torch.float32"),
    ("sin shorter", lambda o, t: _half(o, sin=o.sin[:-1]), "sin: dimension 0 must be cos's size 0"),
    ("too wide", lambda o, t: _half(o, cos=torch.zeros(64, 40), sin=torch.zeros(64, 40)), "cos: its width is half"),
    ("strided columns", lambda o, t: _half(o, cos=o.cos.t().contiguous().t()), "cos: the last dimension must be"),
    ("few rows", lambda o, t: _half(o, positions=None, cos=o.cos[:5], sin=o.sin[:5]), "positions: is None, so token t"),
    ("3-d", lambda o, t: _half(o, cos=o.cos[None], sin=o.sin[None]), "cos: expected 2 dimensions"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("make,named", [pytest.param(m, n, id=i) for i, m, n in BAD])
def test_malformed_operands_are_rejected_by_name_with_nothing_written(make, named, fake):
    operands, table, _ = operand_inputs("cpu")
    out = make(operands, table).fresh_outputs()
    before = out.k_cache.clone(), out.q_out.clone()
    with pytest.raises(ValueError, match=named):
        if fake:
            call_with_fake_tensors(GQA_QKNORM_ROPE_KV_INSERT, dict(enumerate(out.args())))
        else:
            GQA_QKNORM_ROPE_KV_INSERT(*out.args())
    assert torch.equal(bits(out.k_cache), bits(before[0])) and torch.equal(bits(out.q_out), bits(before[1]))


def test_a_position_beyond_the_tables_is_rejected_by_name():
    operands, _, _ = operand_inputs("cpu")
    bad = dataclasses.replace(operands, positions=torch.full((9,), 64)).fresh_outputs()
    with pytest.raises(ValueError, match=r"positions: values must lie in \[0, 64\)"):
        GQA_QKNORM_ROPE_KV_INSERT(*bad.args())

