"""InternLM/lmdeploy, transcribed for its qkv views rotated in place and block-offset fill with fp8 scales."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import FP8, _Layer, _Model, attend


# -- InternLM/lmdeploy pytorch/{models/llama.py, nn/linear/utils.py, backends/default/*, kernels/cuda/fill_kv_cache.py}
def _rotate_half_empty_like(x):  # backends/default/apply_rotary_emb.py rotate_half
    half_size = x.shape[-1] // 2
    x1 = x[..., :half_size]
    x2 = x[..., half_size:]
    out = torch.empty_like(x)
    out[..., :half_size] = -x2
    out[..., half_size:] = x1
    return out


def _div_up(a, b):
    return (a + b - 1) // b


class _LmdeployLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.qkv_proj = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.all_out_features = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]

    def split_qkv(self, x):
        q, k, v = x.split(self.all_out_features, dim=-1)
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        k = k.unflatten(-1, (self.n_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim))
        return q, k, v

    @staticmethod
    def apply_rotary_pos_emb(query, key, cos, sin):  # DefaultApplyRotaryEmbImpl, inplace=True
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # _prepare_cos_sin
        q_embed = query
        k_embed = key
        q_sin = _rotate_half_empty_like(query) * sin
        q_embed.mul_(cos)
        q_embed.add_(q_sin)
        k_sin = _rotate_half_empty_like(key) * sin
        k_embed.mul_(cos)
        k_embed.add_(k_sin)
        return q_embed, k_embed

    @staticmethod
    def fill_kv_cache(k_states, v_states, k_caches, v_caches, step):
        """``fill_kv_cache``: the rows placed as the project's own ground truth places them
        (``tests/pytorch/kernel/test_fill_kv_cache.py``'s ``gt``); an fp8 cache's values quantised
        as its per-tensor fp8 kernel does, ``clamp(k.float() / k_scale, fp8_min, fp8_max)``."""
        if k_caches.dtype == FP8:
            finfo = torch.finfo(k_caches.dtype)
            k_states = torch.clamp(k_states.float() / step["k_scale"], finfo.min, finfo.max).to(k_caches.dtype)
            v_states = torch.clamp(v_states.float() / step["v_scale"], finfo.min, finfo.max).to(v_caches.dtype)
        seq_lens, history_lens, block_offsets = step["seq_lens"], step["history_lens"], step["block_offsets"]
        block_size = k_caches.shape[1]
        splited_k_states = k_states.split(seq_lens)
        splited_v_states = v_states.split(seq_lens)
        for bidx in range(len(seq_lens)):
            k_state = splited_k_states[bidx]
            v_state = splited_v_states[bidx]
            h_len = history_lens[bidx]
            b_offs = block_offsets[bidx]
            block_id = _div_up(h_len + 1, block_size) - 1
            fill_start = h_len % block_size
            fill_size = min(block_size - fill_start, k_state.size(0))
            while True:
                boff = b_offs[block_id : block_id + 1]  # b_offs[block_id]: a 0-d index would be read as an int
                tmp_ks = k_state[:fill_size]
                tmp_vs = v_state[:fill_size]
                fill_end = fill_start + fill_size
                k_caches[boff, fill_start:fill_end] = tmp_ks
                v_caches[boff, fill_start:fill_end] = tmp_vs
                k_state = k_state[fill_size:]
                v_state = v_state[fill_size:]
                block_id += 1
                fill_start = 0
                fill_size = min(block_size, k_state.size(0))
                if fill_size == 0:
                    break

    def forward(self, hidden_states, rotary_pos_emb, step, caches, layer):
        qkv_states = self.qkv_proj(hidden_states)
        qkv_states = qkv_states.flatten(0, -2)
        query_states, key_states, value_states = self.split_qkv(qkv_states)
        cos, sin = rotary_pos_emb
        query_states, key_states = self.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        k_caches, v_caches = caches[layer]
        self.fill_kv_cache(key_states, value_states, k_caches, v_caches, step)
        q, k, v = (t[None].transpose(1, 2) for t in (query_states, key_states, value_states))
        return self.o_proj(attend(q, k, v))


class Lmdeploy(_Model):
    layer_cls = _LmdeployLayer

    def finish(self):  # RotaryEmbeddingImpl.__init__
        dim = self.s.head_dim
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)),
                             persistent=False)

    def prologue(self, x, step):
        """``_rotary_embedding_fwd`` (which lmdeploy wraps in its own ``torch.compile``), then
        ``cos, sin = cos[0], sin[0]``: bf16 ``[T, D]``."""
        position_ids = step["position_ids"].float() / 1.0
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :]
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv_freq_expanded.float() * position_ids_expanded.float()).transpose(1, 2)
            emb = freqs.repeat(1, 1, 2)
            cos = emb.cos()
            sin = emb.sin()
        cos, sin = cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
        return cos[0], sin[0]
