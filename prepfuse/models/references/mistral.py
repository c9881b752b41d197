"""mistralai/mistral-inference, transcribed for its packed tokens, gathered RoPE table and rolling-buffer cache."""

from __future__ import annotations

import torch

from prepfuse.models.references.common import _Model, attend, precompute_freqs_cis
from prepfuse.models.references.meta import _MetaLayer


# -- mistralai/mistral-inference src/mistral_inference/{rope,transformer_layers,cache}.py -------------------
def apply_rotary_emb_mistral(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class _MistralLayer(_MetaLayer):
    def forward(self, x, freqs_cis, step, caches, layer):
        seqlen_sum, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(seqlen_sum, self.n_heads, self.head_dim)
        xk = xk.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xv = xv.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb_mistral(xq, xk, freqs_cis=freqs_cis)
        cache_k, cache_v = caches[layer]  # cache.update(xk, xv)
        n_kv_heads, head_dim = cache_k.shape[-2:]
        flat_cache_k = cache_k.view(-1, n_kv_heads, head_dim)
        flat_cache_v = cache_v.view(-1, n_kv_heads, head_dim)
        flat_cache_k.index_copy_(0, step["cache_positions"], xk[step["to_cache_mask"]])
        flat_cache_v.index_copy_(0, step["cache_positions"], xv[step["to_cache_mask"]])
        return self.o_proj(attend(xq[None].transpose(1, 2), xk[None].transpose(1, 2), xv[None].transpose(1, 2)))


class Mistral(_Model):
    layer_cls = _MistralLayer

    def finish(self):  # theta: args.rope_theta or 1e6; the source's table has 128_000 rows
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.s.head_dim, self.s.max_pos, 1e6), persistent=False)

    def prologue(self, x, step):
        return self.freqs_cis[step["positions"]]  # freqs_cis is always the same for every layer
