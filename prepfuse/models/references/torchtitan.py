"""pytorch/torchtitan's Qwen3, transcribed for its qkv grouped per kv head and fp32 cos|sin table (training)."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, _rotate_half_cat, attend


# -- pytorch/torchtitan models/common/{attention,rope,nn_modules}.py, models/qwen3 --------------------------
class _TorchtitanLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.heads_per_kv = s.heads // s.kv_heads
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(s.hidden, s.kv_heads * self.r_dim * s.head_dim, bias=False)  # FusedQKVLinear
        self.q_norm = nn.RMSNorm(s.head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(s.head_dim, eps=1e-6)
        self.q_norm.weight.data.uniform_(0.5, 1.5)
        self.k_norm.weight.data.uniform_(0.5, 1.5)

    @staticmethod
    def apply_rotary_emb(query, key, rope_cache):  # CosSinRoPE.apply_rotary_emb
        head_dim = query.shape[-1]
        cos = rope_cache[..., :head_dim]
        sin = rope_cache[..., head_dim:]
        query_f = query.float()
        key_f = key.float()
        xq_out = (query_f * cos) + (_rotate_half_cat(query_f) * sin)
        xk_out = (key_f * cos) + (_rotate_half_cat(key_f) * sin)
        return xq_out.type_as(query), xk_out.type_as(key)

    def forward(self, x, rope_cache, step, caches, layer):
        num_tokens = x.shape[0]
        qkv = self.wqkv(x)
        qkv = qkv.view(num_tokens, -1, self.r_dim, self.head_dim)
        hpk, hd = self.heads_per_kv, self.head_dim
        xq, xk, xv = torch.split(qkv, [hpk, 1, 1], dim=-2)
        xq_TNH = xq.reshape(num_tokens, -1, hd).contiguous()
        xk_TNH = xk.reshape(num_tokens, -1, hd).contiguous()
        xv_TNH = xv.reshape(num_tokens, -1, hd).contiguous()
        xq_TNH = self.q_norm(xq_TNH)
        xk_TNH = self.k_norm(xk_TNH)
        xq_TNH, xk_TNH = self.apply_rotary_emb(xq_TNH, xk_TNH, rope_cache)
        # not torchtitan's (it trains without a cache): vLLM's paged insert, whose kernels the
        # contiguous() above is for
        k_cache, v_cache = caches[layer]
        slots, bs = step["slots"], k_cache.shape[1]
        k_cache[slots // bs, slots % bs] = xk_TNH
        v_cache[slots // bs, slots % bs] = xv_TNH
        q, k, v = (t[None].transpose(1, 2) for t in (xq_TNH, xk_TNH, xv_TNH))
        return self.o_proj(attend(q, k, v))


class Torchtitan(_Model):
    layer_cls = _TorchtitanLayer

    def finish(self):  # CosSinRoPE._precompute_cache, Qwen3 theta 1e6
        dim = self.s.head_dim
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        t = torch.arange(self.s.max_pos, dtype=inv_freq.dtype)
        freqs = torch.outer(t, inv_freq).float()
        theta = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("rope_cache", torch.cat([theta.cos(), theta.sin()], dim=-1), persistent=False)

    def prologue(self, x, step):  # _reshape_for_broadcast
        cache_width = self.rope_cache.shape[-1]
        return self.rope_cache[step["positions"]].view(x.shape[0], 1, cache_width)
