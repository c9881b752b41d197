"""Meta's llama and llama-models references and llama2.c, transcribed for the complex RoPE most ports copy."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, _inv_freq, attend, precompute_freqs_cis


# -- meta-llama/llama llama/model.py; llama-models models/llama4/model.py; llama2.c model.py ---------------
def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb_complex(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_emb_real(xq, xk, freqs_cos, freqs_sin):  # llama2.c
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def llama4_rmsnorm(x, eps):  # weightless
    def _norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x)


class _MetaLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.wq = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.norm_eps = 1e-5  # llama4 args.norm_eps

    def forward(self, x, freqs, step, caches, layer):
        start_pos = step["start_pos"]
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.case.variant == "llama2c":
            xq, xk = apply_rotary_emb_real(xq, xk, *freqs)
        else:
            xq, xk = apply_rotary_emb_complex(xq, xk, freqs_cis=freqs)
        if self.case.variant == "llama4":  # use_qk_norm: after RoPE
            xq = llama4_rmsnorm(xq, self.norm_eps)
            xk = llama4_rmsnorm(xk, self.norm_eps)
        cache_k, cache_v = caches[layer]
        cache_k = cache_k.to(xq)  # self.cache_k = self.cache_k.to(xq)
        cache_v = cache_v.to(xq)
        cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = cache_k[:bsz, : start_pos + seqlen]
        values = cache_v[:bsz, : start_pos + seqlen]
        return self.o_proj(attend(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)))


class MetaLlama(_Model):
    layer_cls = _MetaLayer

    def finish(self):
        theta = 500000.0 if self.case.variant == "llama4" else 10000.0
        if self.case.variant == "llama2c":  # precompute_freqs_cis: fp32 cos and sin, [S, D/2] each
            freqs = torch.outer(torch.arange(self.s.max_pos), _inv_freq(self.s.head_dim, theta)).float()
            self.register_buffer("freqs_cos", torch.cos(freqs), persistent=False)
            self.register_buffer("freqs_sin", torch.sin(freqs), persistent=False)
        else:
            self.register_buffer("freqs_cis", precompute_freqs_cis(self.s.head_dim, self.s.max_pos, theta),
                                 persistent=False)

    def prologue(self, x, step):
        start_pos, seqlen = step["start_pos"], x.shape[1]
        if self.case.variant == "llama2c":  # llama2.c slices [:seqlen] (no cache); here at start_pos
            return self.freqs_cos[start_pos : start_pos + seqlen], self.freqs_sin[start_pos : start_pos + seqlen]
        return self.freqs_cis[start_pos : start_pos + seqlen]
