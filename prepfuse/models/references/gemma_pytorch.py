"""google/gemma_pytorch's Gemma 3, transcribed for its 1 + w norms and complex RoPE on NeoX pairs."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, _norm_weight, attend, precompute_freqs_cis


# -- google/gemma_pytorch gemma/model.py (Gemma 3) -------------------------------------------------------
class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, add_unit_offset: bool = True):
        super().__init__()
        self.eps, self.add_unit_offset = eps, add_unit_offset
        self.weight = _norm_weight(dim, -0.5, 0.5)  # zeros in the source; 1 + w in 0.5..1.5

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        if self.add_unit_offset:
            output = output * (1 + self.weight.float())
        else:
            output = output * self.weight.float()
        return output.type_as(x)


def apply_rotary_emb_gemma(x, freqs_cis):
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out


class _GemmaLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.q_size, self.kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.qkv_proj = nn.Linear(s.hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.query_norm = GemmaRMSNorm(s.head_dim)
        self.key_norm = GemmaRMSNorm(s.head_dim)
        self.scaling = s.head_dim**-0.5  # query_pre_attn_scalar = head_dim (Gemma 3 1B)

    def forward(self, hidden_states, freqs_cis, step, caches, layer):
        batch_size, input_len, _ = hidden_states.shape
        freqs_cis = freqs_cis["local" if layer % 2 == 0 else "global"]  # sliding, global, ...
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.n_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.n_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.n_kv_heads, self.head_dim)
        xq = self.query_norm(xq)
        xk = self.key_norm(xk)
        xq = apply_rotary_emb_gemma(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb_gemma(xk, freqs_cis=freqs_cis)
        k_cache, v_cache = caches[layer]
        k_cache.index_copy_(1, step["input_positions"], xk)  # kv_write_indices = input_positions
        v_cache.index_copy_(1, step["input_positions"], xv)
        q = xq.transpose(1, 2)
        q.mul_(self.scaling)
        return self.o_proj(attend(q, xk.transpose(1, 2), xv.transpose(1, 2), scale=1.0))


class Gemma(_Model):
    layer_cls = _GemmaLayer

    def finish(self):  # _register_freqs_cis: Gemma 3's local (10k) and global (1M) tables
        self.register_buffer("local_freqs_cis", precompute_freqs_cis(self.s.head_dim, self.s.max_pos, 10_000),
                             persistent=False)
        self.register_buffer("global_freqs_cis", precompute_freqs_cis(self.s.head_dim, self.s.max_pos, 1_000_000),
                             persistent=False)

    def prologue(self, x, step):
        return {"local": self.local_freqs_cis.index_select(0, step["input_positions"]),
                "global": self.global_freqs_cis.index_select(0, step["input_positions"])}
