"""k and v caches that are parts of one buffer, however the code takes the parts.

Engines keep a layer's k and v in one tensor and take the parts in the model: vLLM's
``[2, blocks, block, Hkv, D]`` by ``unbind(0)`` or ``kv_cache[0]``, Megatron's
``[2, layers, blocks, block, Hkv, D]`` by ``memory_buffer[0, layer]``, lightllm's token pool
``[layers, slots, 2 * Hkv, D]`` written ``kv_buffer[layer][slots] = cat((k, v), 1)`` (k heads,
then v heads, one row), TensorRT-LLM's ``[requests, 2, S, Hkv, D]`` by ``[request, 0].unsqueeze(0)``, flash-attention's
``[B, S, 2, Hkv, D]`` written ``kv_cache[b0:b1, s0:s1, ...] = kv`` (k rotated in place, ``kv[:, :, 0] =
rope(kv[:, :, 0])``, or k and v stacked). Each fuses into one call writing both parts, every byte of the buffer
as eager leaves it (the math rotates in fp32, as the op does), and with k and v from one kv
projection without q the three-source op reads that projection's column ranges.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, HQ, HKV, D, BLOCKS, BLOCK, LAYERS, EPS = 6, 4, 2, 64, 4, 8, 2, 1e-6


def prepared(q, k, v, q_weight, k_weight, table, positions):
    """Qwen3's norm and NeoX RoPE in fp32 with one rounding: [T, H, D] q, k and v."""
    def norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

    def rope(x):
        cos, sin = table[positions].chunk(2, -1)
        cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return (x.float() * cos + torch.cat((-x2, x1), -1).float() * sin).to(x.dtype)

    return rope(norm(q, q_weight)), rope(norm(k, k_weight)), v


def split_qkv(qkv):
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    return q.view(T, HQ, D), k.view(T, HKV, D), v.view(T, HKV, D)


def vllm_unbind(qkv, w, table, positions, slots, kv_cache):
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    k_cache, v_cache = kv_cache.unbind(0)
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v
    return q


def vllm_index(qkv, w, table, positions, slots, kv_cache):
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    kv_cache[0][slots // BLOCK, slots % BLOCK] = k
    kv_cache[1][slots // BLOCK, slots % BLOCK] = v
    return q


def megatron_layer(qkv, w, table, positions, slots, memory_buffer):
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    memory_buffer[0, 1, slots // BLOCK, slots % BLOCK] = k
    memory_buffer[1, 1, slots // BLOCK, slots % BLOCK] = v
    return q


def pool_of_k_then_v(qkv, w, table, positions, slots, kv_buffer):
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    kv_buffer[1][slots] = torch.cat((k, v), dim=1)
    return q


def kv_projection_in_place(qkv, w, table, positions, slots, kv_buffer):
    """q from its own projection, k and v from one: k's heads rotated in place in the kv rows."""
    q, kv = qkv[:, : HQ * D].contiguous(), qkv[:, HQ * D :].contiguous().view(T, 2 * HKV, D)
    q, k, _ = prepared(q.view(T, HQ, D), kv[:, :HKV], kv[:, HKV:], *w, table, positions)
    kv[:, :HKV] = k
    kv_buffer[1][slots] = kv
    return q


def request_of_block_tensor(qkv, w, table, positions, slots, kv_cache):
    """TensorRT-LLM's vanilla backend: request 1's k and v of a ``[requests, 2, S, Hkv, D]``
    tensor, taken ``[1, 0].unsqueeze(0)`` and written through an int16 view by position."""
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    for part, rows in ((0, k), (1, v)):
        out = kv_cache[1, part].unsqueeze(0)
        out.view(torch.int16).index_copy_(1, slots, rows.unsqueeze(0).view(torch.int16))
    return q


def packed_in_place(qkv, w, table, positions, slots, kv_cache):
    """flash-attention's ``[B, S, 2, Hkv, D]`` cache: k rotated in place in the kv rows, the
    step's rows written by slice assignment at positions 3 .. 3 + T - 1."""
    q, kv = qkv[:, : HQ * D].contiguous(), qkv[:, HQ * D :].contiguous().view(1, T, 2, HKV, D)
    q, k, _ = prepared(q.view(T, HQ, D), kv[0, :, 0], kv[0, :, 1], *w, table, positions)
    kv[:, :, 0] = k[None]
    kv_cache[0:1, 3 : 3 + T, ...] = kv
    return q


def packed_cat(qkv, w, table, positions, slots, kv_cache):
    """Sequence 1 of a packed cache written ``cat((k[:, None], v[:, None]), 1)``: a stack of k and v."""
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    kv_cache[1, 3 : 3 + T] = torch.cat((k[:, None], v[:, None]), dim=1)
    return q


CASES = {  # the function, its buffer's shape, the pattern it fuses as
    "vllm-unbind": (vllm_unbind, (2, BLOCKS, BLOCK, HKV, D), "gqa_qknorm_rope_kv"),
    "vllm-index": (vllm_index, (2, BLOCKS, BLOCK, HKV, D), "gqa_qknorm_rope_kv"),
    "megatron-layer-of-buffer": (megatron_layer, (2, LAYERS, BLOCKS, BLOCK, HKV, D), "gqa_qknorm_rope_kv"),
    "pool-k-then-v-heads": (pool_of_k_then_v, (LAYERS, BLOCKS * BLOCK, 2 * HKV, D), "gqa_qknorm_rope_kv"),
    "request-of-block-tensor": (request_of_block_tensor, (2, 2, BLOCKS * BLOCK, HKV, D), "gqa_qknorm_rope_kv"),
    "kv-projection-in-place": (kv_projection_in_place, (LAYERS, BLOCKS * BLOCK, 2 * HKV, D),
                               "gqa_qknorm_rope_kv+separate"),
    "packed-k-rotated-in-place": (packed_in_place, (1, BLOCKS * BLOCK, 2, HKV, D), "gqa_qknorm_rope_kv+separate"),
    "packed-cat": (packed_cat, (2, BLOCKS * BLOCK, 2, HKV, D), "gqa_qknorm_rope_kv"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_k_and_v_parts_of_one_buffer_fuse_into_one_call(name):
    fn, buffer_shape, pattern = CASES[name]
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    weights = tuple((1 + 0.3 * torch.randn(D, generator=gen)).to(torch.bfloat16) for _ in range(2))
    table = 2 * torch.rand(64, D, generator=gen) - 1
    positions, slots = torch.arange(T) + 3, torch.tensor([5, 9, 17, 2, 30, 11])
    buffer = torch.randn(buffer_shape, generator=gen).to(torch.bfloat16)
    eager_buffer, compiled_buffer = buffer.clone(), buffer.clone()
    want = fn(qkv, weights, table, positions, slots, eager_buffer)
    backend = PrepfuseBackend({})
    got = torch.compile(fn, backend=backend, fullgraph=True)(qkv, weights, table, positions, slots, compiled_buffer)
    assert backend.reports.pattern_counts().get(pattern) == 1, backend.reports.format(verbose=True)
    assert torch.equal(got, want)
    assert torch.equal(compiled_buffer, eager_buffer)
