"""NVIDIA/TensorRT-LLM's PyTorch backend, transcribed for its 2-d q/k, RoPE via transpose, int-view cache."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import FP8, _Layer, _Model, _norm_weight, _rotate_half_cat, attend


# -- NVIDIA/TensorRT-LLM tensorrt_llm/_torch/{modules/*, attention_backend/vanilla.py} -----------------
class TrtRMSNorm(nn.Module):
    def __init__(self, *, hidden_size: int, eps: float):
        super().__init__()
        self.weight = _norm_weight(hidden_size)
        self.variance_epsilon = eps

    def forward(self, hidden_states):  # not IS_FLASHINFER_AVAILABLE, no residual
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight * hidden_states.to(input_dtype)
        return hidden_states


def apply_rotary_pos_emb_trt(q_or_k, cos, sin, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    q_or_k, q_or_k_pass = q_or_k[..., :rot_dim], q_or_k[..., rot_dim:]
    embed = (q_or_k * cos) + (_rotate_half_cat(q_or_k) * sin)
    return torch.cat((embed, q_or_k_pass), dim=-1)


class _TrtLayer(_Layer):
    _access_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self, case, s):
        super().__init__(case, s)
        self.q_size, self.kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.num_heads, self.num_kv_heads = s.heads, s.kv_heads
        self.qkv_proj = nn.Linear(s.hidden, self.q_size + 2 * self.kv_size, bias=False)
        if case.variant == "qwen3":
            self.q_norm = TrtRMSNorm(hidden_size=s.head_dim, eps=1e-6)
            self.k_norm = TrtRMSNorm(hidden_size=s.head_dim, eps=1e-6)
        self.attention_scaling = 1.0

    def apply_qk_norm(self, q, k):  # the aux stream's two norms, one after the other
        q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(-1, self.kv_size)
        return q, k

    def rotary_emb(self, inv_freq, position_ids, targets):  # RotaryEmbedding.forward, unfused
        q_or_k = targets[0]
        remove_input_padding = len(q_or_k.size()) == 2
        inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type=q_or_k.device.type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
            sin = emb.sin()
        cos = cos * self.attention_scaling
        sin = sin * self.attention_scaling
        cos = cos.to(dtype=q_or_k.dtype)
        sin = sin.to(dtype=q_or_k.dtype)
        bsz, seq_len = (1, q_or_k.size(0)) if remove_input_padding else q_or_k.size()[:2]

        def rope_target(target):
            target = target.view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
            target = apply_rotary_pos_emb_trt(target, cos, sin)
            target = target.transpose(1, 2).contiguous()
            return target.view(seq_len, -1) if remove_input_padding else target.view(bsz, seq_len, -1)

        return [rope_target(target) for target in targets]

    def _single_request_update_kv_cache(self, k, v, kv_cache_tensor, seq_len, cache_idx, cache_position):
        k_out = kv_cache_tensor[cache_idx, 0, :, :, :].unsqueeze(0)
        v_out = kv_cache_tensor[cache_idx, 1, :, :, :].unsqueeze(0)
        access_type = self._access_type[k.dtype.itemsize]
        k_out.view(dtype=access_type).index_copy_(1, cache_position, k.view(dtype=access_type))
        v_out.view(dtype=access_type).index_copy_(1, cache_position, v.view(dtype=access_type))
        return k_out[:, :seq_len, :, :], v_out[:, :seq_len, :, :]

    def forward(self, hidden_states, inv_freq, step, caches, layer):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # split_qkv
        if self.case.variant == "qwen3":  # QKNormRoPEAttention.apply_rope, fuse_qk_norm_rope=False
            q, k = self.apply_qk_norm(q, k)
        q, k = self.rotary_emb(inv_freq, step["position_ids"], [q, k])
        # VanillaAttention._single_request_forward, one request
        past_seen_token, cache_idx = step["past_seen_token"], step["cache_idx"]
        bsz = 1
        q_len = q.size(0)
        q = q.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        target_seq_len = past_seen_token
        kv_len = k.size(0)
        k = k.view(bsz, kv_len, self.num_kv_heads, self.head_dim)
        v = v.view(bsz, kv_len, self.num_kv_heads, self.head_dim)
        target_seq_len += kv_len
        kv_cache_tensor = caches[layer]
        if kv_cache_tensor.dtype == FP8:  # quant_mode.has_fp8_kv_cache()
            k = k.to(torch.float8_e4m3fn)
            v = v.to(torch.float8_e4m3fn)
        cache_position = torch.arange(past_seen_token, target_seq_len, device=q.device)
        key_states, value_states = self._single_request_update_kv_cache(
            k, v, kv_cache_tensor, target_seq_len, cache_idx, cache_position)
        key_states = key_states.transpose(1, 2).to(q.dtype)
        value_states = value_states.transpose(1, 2).to(q.dtype)
        return self.o_proj(attend(q, key_states, value_states))


class TensorRTLLM(_Model):
    layer_cls = _TrtLayer

    def finish(self):
        dim = self.s.head_dim
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)),
                             persistent=False)

    def prologue(self, x, step):
        return self.inv_freq
