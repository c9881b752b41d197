"""Dao-AILab/flash-attention, transcribed for its einops-tiled half tables, partial rotary and K/V cache."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, attend


# -- Dao-AILab/flash-attention flash_attn/{layers/rotary.py, modules/mha.py} ----------------------------
def _repeat_1_2d(t):
    """einops ``repeat(t, "... d -> ... 1 (2 d)")``, as einops lowers it: a new axis, the last
    one tiled twice (NeoX)."""
    return t[..., None, None, :].expand(*t.shape[:-1], 1, 2, t.shape[-1]).reshape(*t.shape[:-1], 1, 2 * t.shape[-1])


def _rotate_half_chunk(x):  # flash-attention rotate_half(interleaved=False)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_torch(x, cos, sin):  # interleaved=False
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    cos = _repeat_1_2d(cos)
    sin = _repeat_1_2d(sin)
    return torch.cat([x[..., :ro_dim] * cos + _rotate_half_chunk(x[..., :ro_dim]) * sin, x[..., ro_dim:]], dim=-1)


class _FlashAttnLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.num_heads, self.num_heads_kv = s.heads, s.kv_heads
        self.Wqkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)

    def forward(self, x, cos_sin, step, caches, layer):
        cos, sin = cos_sin
        seqlen_offset = step["seqlen_offset"]
        qkv = self.Wqkv(x)
        q = qkv[..., : self.num_heads * self.head_dim]
        kv = qkv[..., self.num_heads * self.head_dim :]
        q = q.reshape(*q.shape[:-1], -1, self.head_dim)  # rearrange "... (h d) -> ... h d"
        kv = kv.reshape(*kv.shape[:-1], 2, -1, self.head_dim)  # "... (two hkv d) -> ... two hkv d"
        # RotaryEmbedding.forward(q, kv, seqlen_offset): its kernels as the module's PyTorch
        # reference spells them, kv's keys rotated in place (apply_rotary_emb_kv_)
        seqlen = q.shape[1]
        cos, sin = cos[seqlen_offset : seqlen_offset + seqlen], sin[seqlen_offset : seqlen_offset + seqlen]
        q = apply_rotary_emb_torch(q, cos, sin)
        kv[:, :, 0] = apply_rotary_emb_torch(kv[:, :, 0], cos, sin)
        kv_cache = caches[layer]  # _update_kv_cache
        batch_start = 0  # inference_params.batch_size_offset
        batch_end = batch_start + kv.shape[0]
        sequence_start = seqlen_offset
        sequence_end = sequence_start + kv.shape[1]
        assert batch_end <= kv_cache.shape[0]
        assert sequence_end <= kv_cache.shape[1]
        kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv
        k, v = kv.unbind(2)
        return self.o_proj(attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))


class FlashAttn(_Model):
    layer_cls = _FlashAttnLayer
    rotary_dim = 32  # rotary_emb_dim < head_dim: the partial rotary of GPT-NeoX-style configs

    def finish(self):  # _update_cos_sin_cache: fp32 angles, the table in the activation dtype
        dtype = self.layers[0].Wqkv.weight.dtype
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        t = torch.arange(self.s.max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("_cos_cached", torch.cos(freqs).to(dtype), persistent=False)
        self.register_buffer("_sin_cached", torch.sin(freqs).to(dtype), persistent=False)

    def prologue(self, x, step):
        return self._cos_cached, self._sin_cached
