"""The GQA ops' fp32 norm weights: a weight applied in fp32 before one rounding to bf16,
``bf16((x * rstd) * w)``, as Gemma-3's ``Gemma3RMSNorm`` computes with ``w = 1 + weight``
(the bf16 weights keep Qwen3's ``bf16(w * bf16(x * rstd))``).

Held against transformers' own ``Gemma3RMSNorm`` (the reference, bit for bit), and the
kernel against the reference, bit for bit (the interpreter on CPU, the compiled kernel on
CUDA; exact-sum inputs, so the summation order of ``mean(x^2)`` cannot matter). Fresh
seeds, poisoned outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.ops import (
    GQA_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)
from prepfuse.testing import call_with_fake_tensors, seeded_gqa_inputs, with_fp32_norm_weights
from tests.ops.gqa_parity import assert_kernel_matches_reference, run
from tests.ops.test_gqa_qknorm_rope_kv_insert import bits, hf_apply_rope, needs_interpreter, needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def gemma_inputs(device, head_dim=64, rotary_dim=None, is_neox=True, cache_dtype=torch.bfloat16, num_tokens=9,
                 exact_sum=True):
    inputs, seed = seeded_gqa_inputs(num_tokens, 4, 2, head_dim, 16, device, rotary_dim=rotary_dim, is_neox=is_neox,
                                     cache_dtype=cache_dtype, exact_sum=exact_sum, skip_fraction=0.0)
    inputs, gemma = with_fp32_norm_weights(inputs)
    return inputs, gemma, seed


def test_reference_is_transformers_gemma3_rms_norm():
    """transformers' ``Gemma3RMSNorm`` (holding the bf16 weight w) on q and k heads, then
    Hugging Face's RoPE in fp32: the op with fp32 weights ``1 + w`` writes the same bits."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    inputs, gemma, seed = gemma_inputs("cpu", head_dim=128, exact_sum=False)
    out = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    hq, hkv = inputs.num_q_heads, inputs.num_kv_heads
    q, k, v = inputs.qkv.unflatten(1, (hq + 2 * hkv, 128)).split((hq, hkv, hkv), dim=1)
    norms = []
    for w in gemma:
        norm = Gemma3RMSNorm(128, eps=inputs.eps).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(w)
        norms.append(norm)
    with torch.no_grad():
        q, k = norms[0](q), norms[1](k)
    cos, sin = inputs.cos_sin_cache[inputs.positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)
    slots, block = inputs.slot_mapping, inputs.k_cache.shape[1]
    assert torch.equal(bits(out.q_out), bits(hf_apply_rope(q.float(), cos, sin).to(torch.bfloat16))), f"seed={seed}"
    k_hf = hf_apply_rope(k.float(), cos, sin).to(torch.bfloat16)
    assert torch.equal(bits(out.k_cache[slots // block, slots % block]), bits(k_hf)), f"seed={seed}"
    # and not the bf16-weight rounding: the two forms differ on these inputs
    bf16_form = dataclasses.replace(inputs, q_norm_weight=inputs.q_norm_weight.to(torch.bfloat16),
                                    k_norm_weight=inputs.k_norm_weight.to(torch.bfloat16))
    assert not torch.equal(out.q_out, run(gqa_qknorm_rope_kv_insert_reference, bf16_form).q_out)


def kernel_against_reference(device, kernel, head_dim, rotary_dim, is_neox, cache_dtype, num_tokens) -> None:
    inputs, _, seed = gemma_inputs(device, head_dim, rotary_dim, is_neox, cache_dtype, num_tokens)
    assert_kernel_matches_reference(kernel, inputs, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (128, 32), (128, 44)])
def test_interpreted_kernel_matches_the_reference(head_dim, rotary_dim, is_neox, cache_dtype):
    kernel_against_reference("cpu", gqa_qknorm_rope_kv_insert_triton, head_dim, rotary_dim, is_neox, cache_dtype, 5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, None), (128, 44), (256, 64)])
def test_cuda_kernel_matches_the_reference(head_dim, rotary_dim, is_neox, cache_dtype, num_tokens):
    kernel_against_reference("cuda", GQA_QKNORM_ROPE_KV_INSERT, head_dim, rotary_dim, is_neox, cache_dtype, num_tokens)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("q_dtype,k_dtype,named", [
    (torch.float16, torch.float16, "q_norm_weight: expected dtype torch.bfloat16 or torch.float32"),
    (torch.float32, torch.bfloat16, "k_norm_weight: expected dtype torch.float32"),
], ids=["fp16", "mixed"])
def test_norm_weights_of_another_dtype_are_rejected_by_name(q_dtype, k_dtype, named, fake):
    inputs, _, _ = gemma_inputs("cpu")
    out = dataclasses.replace(inputs, q_norm_weight=inputs.q_norm_weight.to(q_dtype),
                              k_norm_weight=inputs.k_norm_weight.to(k_dtype)).fresh_outputs()
    before = out.k_cache.clone()
    with pytest.raises(ValueError, match=named):
        if fake:
            call_with_fake_tensors(GQA_QKNORM_ROPE_KV_INSERT, dict(enumerate(out.args())))
        else:
            GQA_QKNORM_ROPE_KV_INSERT(*out.args())
    assert torch.equal(out.k_cache.view(torch.uint8), before.view(torch.uint8))
