"""``prepfuse::gqa_separate_qknorm_rope_kv_insert``: the GQA op with q, k and v as three tensors.

Its math is the fused-qkv op's, tested in ``test_gqa_qknorm_rope_kv_insert.py`` against an
oracle and Hugging Face. Here each implementation of the separate op is held to the
fused op on the same values (q, k and v copied out of qkv into tensors of their own,
some with a token stride wider than a row): the reference and the interpreter bit for
bit, and on CUDA the compiled kernel against the fused op's compiled kernel, bit for bit
(one kernel: the same per-head arithmetic whatever the source pointers). Fresh random
data and poisoned outputs every run; the seed is in each message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import (
    GQA_QKNORM_ROPE_KV_INSERT,
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_separate_qknorm_rope_kv_insert_reference,
    gqa_separate_qknorm_rope_kv_insert_triton,
)
from tests.ops.bad_inputs import assert_rejected
from prepfuse.testing import GqaInputs, call_with_fake_tensors, compare_gqa, make_gqa_inputs

FP8 = torch.float8_e4m3fn
needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not triton_interpret_mode(), reason="CPU-interpreter parity; on CUDA, test_cuda_matches_the_fused_op covers the kernel"
)
ARG_NAMES = (
    "q", "k", "v", "q_norm_weight", "k_norm_weight", "q_out", "k_cache", "v_cache", "slot_mapping", "positions",
    "cos_sin_cache", "kv_scale", "is_neox", "eps",
)


def inputs_and_seed(num_tokens, *shape, **options) -> tuple[GqaInputs, int]:
    """Fresh inputs; a case's ``num_inserted`` is capped at the token count (T=1 has one row)."""
    generator = torch.Generator()
    seed = generator.seed()
    if "num_inserted" in options:
        options = dict(options, num_inserted=min(options["num_inserted"], num_tokens))
    return make_gqa_inputs(num_tokens, *shape, generator=generator, **options), seed


def run_fused(impl, inputs: GqaInputs) -> GqaInputs:
    out = inputs.fresh_outputs()
    impl(*out.args())
    return out


def run_separate(impl, inputs: GqaInputs, token_padding: int = 0) -> GqaInputs:
    out = inputs.fresh_outputs()
    impl(*out.separate_args(token_padding))
    return out


def assert_same(expected: GqaInputs, actual: GqaInputs, seed: int) -> None:
    comparison = compare_gqa(expected, actual)
    assert comparison.exact(), f"seed={seed}: {comparison}"


CASES = [
    pytest.param(dict(), 0, id="qwen3-bf16"),
    pytest.param(dict(norm=False, is_neox=False, rotary_dim=32, cache_dtype=FP8), 64, id="llama-gptj-partial-fp8-padded"),
    pytest.param(dict(cache_dtype=FP8, num_inserted=3), 8, id="qwen3-fp8-fewer-slots-padded"),
]


@pytest.mark.parametrize("options, token_padding", CASES)
def test_reference_equals_the_fused_op_reference(options, token_padding):
    inputs, seed = inputs_and_seed(5, 4, 2, 64, 16, "cpu", **options)
    expected = run_fused(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run_separate(gqa_separate_qknorm_rope_kv_insert_reference, inputs, token_padding)
    assert_same(expected, actual, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options, token_padding", CASES)
def test_triton_interpreter_equals_the_fused_op(options, token_padding, head_dim):
    # without the norm the kernel is bit-exact on any data; with it, the fused op's own
    # interpreter run is the reference (same summation order as this kernel)
    from prepfuse.ops import gqa_qknorm_rope_kv_insert_triton

    inputs, seed = inputs_and_seed(3, 3, 1, head_dim, 16, "cpu", **options)
    expected = run_fused(gqa_qknorm_rope_kv_insert_triton, inputs)
    actual = run_separate(gqa_separate_qknorm_rope_kv_insert_triton, inputs, token_padding)
    assert_same(expected, actual, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("options, token_padding", CASES)
def test_cuda_matches_the_fused_op(options, token_padding, num_tokens, head_dim):
    """Qwen3-8B-like heads (32 q, 8 kv), through the dispatcher: every byte equal to the
    fused op's on the same values (one kernel, so also the norm's summation order)."""
    inputs, seed = inputs_and_seed(num_tokens, 32, 8, head_dim, 16, "cuda", **options)
    expected = run_fused(GQA_QKNORM_ROPE_KV_INSERT, inputs)
    actual = run_separate(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, inputs, token_padding)
    torch.cuda.synchronize()
    assert_same(expected, actual, seed)


# --------------------------------------------------------------------------------------
# Input checks: ValueError naming the argument, in eager and in the fake impl
# --------------------------------------------------------------------------------------
def _with(name: str, make):
    def change(args: dict) -> None:
        args[name] = make(args)
    return change


BAD_INPUTS = [
    ("q-width", "q", _with("q", lambda a: a["q"][:, :-64])),
    ("k-width", "k", _with("k", lambda a: torch.cat((a["k"], a["k"]), dim=1))),
    ("v-dtype", "v", _with("v", lambda a: a["v"].float())),
    ("v-tokens", "v", _with("v", lambda a: a["v"][:-1])),
    ("k-rank", "k", _with("k", lambda a: a["k"].unflatten(1, (-1, 64)))),
    ("q-strided", "q", _with("q", lambda a: torch.stack((a["q"], a["q"]), dim=-1).flatten(-2)[:, ::2])),
    ("q_out-head-size", "q_out", _with("q_out", lambda a: a["q_out"][..., :32])),
    ("k_cache-rank", "k_cache", _with("k_cache", lambda a: a["k_cache"][0])),
    ("positions-tokens", "positions", _with("positions", lambda a: a["positions"][:-1])),
    ("k_norm_weight-missing", "k_norm_weight", _with("k_norm_weight", lambda a: None)),
]


def named_args() -> dict:
    inputs = make_gqa_inputs(5, 4, 2, 64, 16, "cpu")
    return dict(zip(ARG_NAMES, inputs.separate_args()))


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS])
def test_bad_input_raises_in_eager(name, change):
    args = named_args()
    change(args)
    assert_rejected(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, args, name, fake=False)


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS])
def test_bad_input_raises_in_fake_impl(name, change):
    args = named_args()
    change(args)
    assert_rejected(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, args, name, fake=True)


def test_good_input_passes_fake_impl():
    call_with_fake_tensors(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, named_args())


def test_negative_slots_are_skipped():
    inputs, seed = inputs_and_seed(6, 4, 2, 64, 16, "cpu", skip_fraction=0.0)
    inputs = dataclasses.replace(inputs, slot_mapping=inputs.slot_mapping.clone())
    inputs.slot_mapping[[1, 4]] = -1
    expected = run_fused(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run_separate(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, inputs)
    assert_same(expected, actual, seed)
