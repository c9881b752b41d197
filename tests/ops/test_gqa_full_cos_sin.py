"""The GQA ops' full-width cos/sin operand (``full_cos_sin=True``: a ``[P, 2R]`` table of
R cos, then R sin, one entry per rotated dim), as Hugging Face's rotary module gives cos/sin
and as a model passes them in from outside the compiled code.

Held against each other: the half table (the same values spread over the dims each
rotates must write the same bytes), Hugging Face's ``x * cos + rotate_half(x) * sin`` in
fp32 with every entry of the table different (so the two dims of a pair read different
values, and reading the wrong entry shows), and the kernel against the reference, bit for
bit (the interpreter on CPU, the compiled kernel on CUDA). Fresh seeds, poisoned outputs.
"""

from __future__ import annotations

import re

import pytest
import torch

from prepfuse.ops import (
    GQA_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)
from prepfuse.testing import (
    call_with_fake_tensors, compare_gqa, seeded_generator, seeded_gqa_inputs, with_full_cos_sin,
)
from tests.ops.gqa_parity import assert_kernel_matches_reference, run
from tests.ops.test_gqa_qknorm_rope_kv_insert import hf_rotate_half, needs_interpreter, needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
IMPLS = [
    pytest.param(gqa_qknorm_rope_kv_insert_reference, id="reference"),
    pytest.param(gqa_qknorm_rope_kv_insert_triton, id="triton", marks=needs_triton),
]
# (head size, rotary dim): the whole head, a power-of-two part, and 44 (the kernel's lane
# path for rotary dims that are no power of two)
ROTARY = [(64, 64), (128, 32), (128, 44)]



def inputs_on(device, head_dim, rotary_dim, is_neox, cache_dtype=torch.bfloat16, num_tokens=9):
    return seeded_gqa_inputs(num_tokens, 4, 2, head_dim, 16, device, rotary_dim=rotary_dim, is_neox=is_neox,
                             cache_dtype=cache_dtype, max_pos=64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", ROTARY)
def test_duplicated_full_table_writes_the_half_tables_bytes(impl, head_dim, rotary_dim, is_neox):
    """The half table's values spread over the dims each one rotates (NeoX ``cat((c, c))``,
    GPT-J ``repeat_interleave``): the same math, so the same bytes in q_out and both caches."""
    inputs, seed = inputs_on(DEVICE, head_dim, rotary_dim, is_neox)
    half, full = run(impl, inputs), run(impl, with_full_cos_sin(inputs))
    assert compare_gqa(half, full).exact(), f"seed={seed}: {compare_gqa(half, full)}"


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's partner of each dim: (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", ROTARY)
def test_reference_is_x_cos_plus_rotated_x_sin_with_every_entry_its_own(head_dim, rotary_dim, is_neox):
    """Unequal halves: each dim j of the rotated part is ``x[j] * cos[j] + rot(x)[j] * sin[j]``
    in fp32, rounded once (Hugging Face's ``apply_rotary_pos_emb`` on an fp32 table;
    rot = rotate_half for NeoX, the pair swap for GPT-J). Llama heads (no norm): the rows
    are qkv's own values."""
    inputs, seed = seeded_gqa_inputs(7, 4, 2, head_dim, 16, "cpu", rotary_dim=rotary_dim, is_neox=is_neox,
                                     norm=False, skip_fraction=0.0, max_pos=64)
    inputs = with_full_cos_sin(inputs, seeded_generator()[0])
    out = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    q = inputs.qkv.unflatten(1, (-1, head_dim))[:, : inputs.num_q_heads].float()
    cos, sin = inputs.cos_sin_cache[inputs.positions].unsqueeze(1).chunk(2, dim=-1)
    rot = q[..., :rotary_dim]
    partner = hf_rotate_half(rot) if is_neox else rotate_pairs(rot)
    want = torch.cat((rot * cos + partner * sin, q[..., rotary_dim:]), dim=-1).to(torch.bfloat16)
    assert torch.equal(out.q_out.view(torch.int16), want.view(torch.int16)), f"seed={seed}"
    half_read = run(gqa_qknorm_rope_kv_insert_reference, inputs_on("cpu", head_dim, rotary_dim, is_neox)[0])
    assert not torch.equal(out.q_out, half_read.q_out)


def kernel_against_reference(device, head_dim, rotary_dim, is_neox, cache_dtype, num_tokens) -> None:
    inputs, seed = inputs_on(device, head_dim, rotary_dim, is_neox, cache_dtype, num_tokens)
    inputs = with_full_cos_sin(inputs, seeded_generator()[0])
    kernel = gqa_qknorm_rope_kv_insert_triton if device == "cpu" else GQA_QKNORM_ROPE_KV_INSERT
    assert_kernel_matches_reference(kernel, inputs, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", ROTARY)
def test_interpreted_kernel_matches_the_reference(head_dim, rotary_dim, is_neox, cache_dtype):
    kernel_against_reference("cpu", head_dim, rotary_dim, is_neox, cache_dtype, num_tokens=9)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (128, 44), (256, 64)])
def test_cuda_kernel_matches_the_reference(head_dim, rotary_dim, is_neox, cache_dtype, num_tokens):
    kernel_against_reference("cuda", head_dim, rotary_dim, is_neox, cache_dtype, num_tokens)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("width,why", [(6, "multiple of 4"), (2 * 64 + 4, "at most 2 * the head size")])
def test_full_width_table_of_a_wrong_width_is_rejected_by_name(width, why, fake):
    inputs, _ = inputs_on("cpu", 64, 64, True)
    inputs = with_full_cos_sin(inputs)
    out = inputs.fresh_outputs()
    args = dict(zip(range(15), out.args()))
    args[8] = torch.zeros(inputs.cos_sin_cache.shape[0], width)
    before = out.k_cache.clone()
    with pytest.raises(ValueError, match=f"cos_sin_cache: with full_cos_sin.*{re.escape(why)}"):
        if fake:
            call_with_fake_tensors(GQA_QKNORM_ROPE_KV_INSERT, args)
        else:
            GQA_QKNORM_ROPE_KV_INSERT(*args.values())
    assert torch.equal(out.k_cache.view(torch.uint8), before.view(torch.uint8))


def test_the_operand_defaults_to_the_half_table():
    """Callers of the 14-argument form (engines, older prepfuse) keep the half table."""
    inputs, seed = inputs_on("cpu", 64, 64, True)
    out, old = inputs.fresh_outputs(), inputs.fresh_outputs()
    GQA_QKNORM_ROPE_KV_INSERT(*out.args())
    GQA_QKNORM_ROPE_KV_INSERT(*old.args()[:14])
    assert compare_gqa(out, old).exact(), f"seed={seed}"
