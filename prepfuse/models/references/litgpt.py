"""Lightning-AI/litgpt, transcribed for its qk-norm after transpose(1, 2) (OLMo-2's over all heads)."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, _norm_weight, attend


# -- Lightning-AI/litgpt litgpt/model.py ----------------------------------------------------------------
class LitRMSNorm(nn.Module):
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = _norm_weight(size)
        self.eps, self.dim, self.add_unit_offset = eps, dim, add_unit_offset

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


def apply_rope(x, cos, sin):
    head_size_half = x.size(-1) // 2
    x1 = x[..., :head_size_half]
    x2 = x[..., head_size_half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    dims_diff = x.dim() - cos.dim()
    if dims_diff > 0:
        new_shape = cos.shape[0:1] + (1,) * dims_diff + cos.shape[1:]
        cos = cos.view(*new_shape)
        sin = sin.view(*new_shape)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class _LitLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.qkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        olmo2 = case.variant == "olmo2"
        self.norm_q = LitRMSNorm(s.heads * s.head_dim if olmo2 else s.head_dim)
        self.norm_k = LitRMSNorm(s.kv_heads * s.head_dim if olmo2 else s.head_dim)
        self.rope_n_elem = s.head_dim  # rotary_percentage 1.0 (Qwen3, OLMo-2)

    def forward(self, x, cos_sin, step, caches, layer):
        cos, sin = cos_sin
        B, T, C = x.size()
        n_head, n_query_groups, head_size, rope_n_elem = self.n_heads, self.n_kv_heads, self.head_dim, self.rope_n_elem
        qkv = self.qkv(x)
        query_size = n_head * head_size
        key_size = value_size = n_query_groups * head_size
        q, k, v = qkv.split((query_size, key_size, value_size), dim=-1)
        if self.case.variant == "olmo2":
            q = self.norm_q(q)
            k = self.norm_k(k)
        q = q.view(B, T, n_head, head_size)
        k = k.view(B, T, n_query_groups, head_size)
        v = v.view(B, T, n_query_groups, head_size)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if self.case.variant == "default":
            q = self.norm_q(q)
            k = self.norm_k(k)
        q_roped = apply_rope(q[..., :rope_n_elem], cos, sin)
        k_roped = apply_rope(k[..., :rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., rope_n_elem:]), dim=-1)
        k = torch.cat((k_roped, k[..., rope_n_elem:]), dim=-1)
        y = attend(q, k, v)  # litgpt attends over the cache's rows; here over the step's
        k_cache, v_cache = caches[layer]  # KVCache.forward, a global-attention layer
        if k_cache.dtype != k.dtype:
            k_cache = k_cache.to(k.dtype)
        if v_cache.dtype != v.dtype:
            v_cache = v_cache.to(v.dtype)
        bs = k.size(0)
        k_cache[:bs, ...].index_copy_(-2, step["input_pos"], k)  # batched_index_copy_, 1-d idx
        v_cache[:bs, ...].index_copy_(-2, step["input_pos"], v)
        return self.o_proj(y)


class LitGPT(_Model):
    layer_cls = _LitLayer

    def finish(self):  # build_rope_cache: fp32 [L, n_elem], repeat(1, 2); Qwen3 base 1e6, OLMo-2 5e5
        n_elem = self.s.head_dim
        base = 1e6 if self.case.variant == "default" else 500000.0
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
        seq_idx = torch.arange(self.s.max_pos).float() / 1
        idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
        self.register_buffer("cos", torch.cos(idx_theta) * 1.0, persistent=False)
        self.register_buffer("sin", torch.sin(idx_theta) * 1.0, persistent=False)

    def prologue(self, x, step):  # batched_index_select of a 1-d input_pos, then unsqueeze(0)
        cos = torch.index_select(self.cos, 0, step["input_pos"])
        sin = torch.index_select(self.sin, 0, step["input_pos"])
        return cos.unsqueeze(0), sin.unsqueeze(0)
