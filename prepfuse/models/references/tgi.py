"""huggingface/text-generation-inference, transcribed for its K/V views rotated in place and fp8 slot cache."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import FP8, _Layer, _Model, _norm_weight, attend


# -- huggingface/text-generation-inference server/text_generation_server/{layers,models/custom_modeling} ----
def flash_apply_rotary(x1, x2, cos, sin, out1, out2):
    """flash-attention's ``rotary.apply_rotary(x1, x2, cos, sin, out1, out2, conj=False)``
    (``csrc/rotary/rotary_cuda.cu``): float math, stored in x's dtype; every element's x1 and x2
    read before its outputs are stored, so out may alias x."""
    o1 = (x1.float() * cos.float() - x2.float() * sin.float()).to(x1.dtype)
    o2 = (x1.float() * sin.float() + x2.float() * cos.float()).to(x1.dtype)
    out1.copy_(o1)
    out2.copy_(o2)


class Gemma3FastRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight_zero_centred = _norm_weight(dim, -0.5, 0.5)
        self.variance_epsilon = eps

    def finish(self):  # load(): weights.get_tensor(...) + 1 in fp32; self.dtype the model's
        self.dtype = self.weight_zero_centred.dtype
        self.register_buffer("weight", self.weight_zero_centred.detach().float() + 1, persistent=False)

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states += residual
        residual = hidden_states
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = hidden_states * self.weight
        return hidden_states.to(self.dtype), residual


class _TgiLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.num_heads, self.num_key_value_heads, self.head_size = s.heads, s.kv_heads, s.head_dim
        self.query_key_value = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        if case.variant == "gemma3":
            self.q_norm = Gemma3FastRMSNorm(s.head_dim)
            self.k_norm = Gemma3FastRMSNorm(s.head_dim)

    def finish(self):
        if self.case.variant == "gemma3":
            self.q_norm.finish()
            self.k_norm.finish()

    @staticmethod
    def rotary_emb(query, key, cos, sin):  # PositionRotaryEmbedding.forward, SYSTEM == "cuda"
        rotary_dim = cos.shape[-1]
        q1 = query[..., :rotary_dim]
        q2 = query[..., rotary_dim : 2 * rotary_dim]
        flash_apply_rotary(q1, q2, cos, sin, q1, q2)
        k1 = key[..., :rotary_dim]
        k2 = key[..., rotary_dim : 2 * rotary_dim]
        flash_apply_rotary(k1, k2, cos, sin, k1, k2)

    @staticmethod
    def store(key_cache, value_cache, key, value, slots, step):  # KVCache.store, flashinfer layout
        if key_cache.dtype == FP8 and step["kv_scale_cpu"] != 1.0:  # can_scale, SYSTEM == "cuda"
            key = fp8_quantize(key.float(), scale=step["kv_scale"], qdtype=key_cache.dtype)[0]
            value = fp8_quantize(value.float(), scale=step["kv_scale"], qdtype=value_cache.dtype)[0]
        key = key.to(key_cache.dtype)
        value = value.to(value_cache.dtype)
        if key_cache.dtype in {torch.float8_e4m3fn, torch.float8_e5m2}:
            # Torch index_put does not support float8_{e5m2,e4m3fn} yet, so put as raw data instead.
            key_cache = key_cache.view(torch.uint8)
            value_cache = value_cache.view(torch.uint8)
            key = key.view(torch.uint8)
            value = value.view(torch.uint8)
        shape = key_cache.shape
        key_cache.view(-1, shape[-2], shape[-1])[slots] = key
        value_cache.view(-1, shape[-2], shape[-1])[slots] = value

    def forward(self, hidden_states, cos_sin, step, caches, layer):
        cos, sin = cos_sin
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split([self.head_size * self.num_heads, 2 * self.head_size * self.num_key_value_heads], dim=1)
        if self.case.variant == "gemma3":  # FlashGemma3Attention
            kv = kv.view(-1, 2, self.num_key_value_heads * self.head_size)
            key = kv[:, 0]
            value = kv[:, 1]
            query = query.reshape(-1, self.head_size)
            key = key.reshape(-1, self.head_size)
            query, _ = self.q_norm(query.contiguous())
            key, _ = self.k_norm(key.contiguous())
            query = query.view(-1, self.num_heads, self.head_size)
            key = key.view(-1, self.num_key_value_heads, self.head_size)
            value = value.view(-1, self.num_key_value_heads, self.head_size)
            self.rotary_emb(query, key, cos, sin)
        else:  # FlashLlamaAttention
            query = query.view(-1, self.num_heads, self.head_size)
            kv = kv.view(-1, 2, self.num_key_value_heads, self.head_size)
            self.rotary_emb(query, torch.select(kv, dim=1, index=0), cos, sin)
            key, value = kv[:, 0], kv[:, 1]
        self.store(*caches[layer], key, value, step["slots"], step)
        q, k, v = (t[None].transpose(1, 2) for t in (query, key, value))
        return self.o_proj(attend(q, k, v))


def fp8_quantize(weight, scale, qdtype=FP8):  # layers/fp8.py, a scale given, scalar=True, not ROCm
    finfo = torch.finfo(qdtype)
    # Use reciprocal to avoid more expensive division.
    qweight = (weight * scale.reciprocal()).clamp(min=finfo.min, max=finfo.max)
    qweight = qweight.to(qdtype)
    return qweight, scale


class Tgi(_Model):
    layer_cls = _TgiLayer

    def finish(self):
        super().finish()
        # _update_cos_sin_cache, run once up front (the source rebuilds on a longer max_s)
        dim = self.s.head_dim
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        t = torch.arange(self.s.max_pos, dtype=inv_freq.dtype)
        freqs = torch.outer(t, inv_freq)
        dtype = self.layers[0].query_key_value.weight.dtype
        self.register_buffer("_cos_cached", torch.cos(freqs).to(dtype), persistent=False)
        self.register_buffer("_sin_cached", torch.sin(freqs).to(dtype), persistent=False)

    def prologue(self, x, step):  # get_cos_sin
        cos = torch.index_select(self._cos_cached, 0, step["position_ids"])
        sin = torch.index_select(self._sin_cached, 0, step["position_ids"])
        return cos.unsqueeze(1), sin.unsqueeze(1)
