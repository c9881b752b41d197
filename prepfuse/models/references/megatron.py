"""NVIDIA/Megatron-LM, transcribed for its sequence-first layout and static and dynamic-batching caches."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, attend


# -- NVIDIA/Megatron-LM megatron/core/{transformer/attention.py, models/common/embeddings/*,
#    inference/contexts/dynamic_context.py} ------------------------------------------------------------
def _rotate_half_megatron(x, rotary_interleaved: bool):
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)
    return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved: bool, mscale: float = 1.0):
    if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:
        freqs = freqs.squeeze(-2)
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    t = (t * cos_) + (_rotate_half_megatron(t, rotary_interleaved) * sin_)
    return torch.cat((t, t_pass), dim=-1)


class _MegatronLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.num_attention_heads_per_partition, self.num_query_groups_per_partition = s.heads, s.kv_heads
        self.hidden_size_per_attention_head = s.head_dim
        self.linear_qkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.dynamic = case.variant == "dynamic"
        if self.dynamic:  # qk_layernorm through WrappedTorchNorm: torch.nn.RMSNorm
            self.q_layernorm = nn.RMSNorm(s.head_dim, eps=1e-6)
            self.k_layernorm = nn.RMSNorm(s.head_dim, eps=1e-6)
            self.q_layernorm.weight.data.uniform_(0.5, 1.5)
            self.k_layernorm.weight.data.uniform_(0.5, 1.5)
        else:
            self.q_layernorm = self.k_layernorm = None

    def get_query_key_value_tensors(self, hidden_states):
        mixed_qkv = self.linear_qkv(hidden_states)
        num_query_heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        num_qkv_heads_per_group = num_query_heads_per_group + 2
        new_tensor_shape = mixed_qkv.size()[:-1] + (
            self.num_query_groups_per_partition,
            num_qkv_heads_per_group * self.hidden_size_per_attention_head,
        )
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)
        split_arg_list = [
            num_query_heads_per_group * self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
        ]
        query, key, value = torch.split(mixed_qkv, split_arg_list, dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value

    def forward(self, hidden_states, rotary_pos_emb, step, caches, layer):
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        q_pos_emb, k_pos_emb = rotary_pos_emb
        interleaved = self.dynamic
        if not self.dynamic:  # static batching: un-rotated keys cached, the prefix rotated after
            inference_key_memory, inference_value_memory = caches[layer]
            batch_start = step["batch_size_offset"]
            batch_end = batch_start + key.size(1)
            sequence_start = step["sequence_len_offset"]
            sequence_end = sequence_start + key.size(0)
            q_pos_emb = q_pos_emb[sequence_start:sequence_end, :, :, :]
            k_pos_emb = k_pos_emb[:sequence_end, :, :, :]
            inference_key_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = key
            inference_value_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = value
            key = inference_key_memory[:sequence_end, batch_start:batch_end, ...]
            value = inference_value_memory[:sequence_end, batch_start:batch_end, ...]
            query = apply_rotary_pos_emb_bshd(query, q_pos_emb, interleaved)
            key = apply_rotary_pos_emb_bshd(key, k_pos_emb, interleaved)
        else:  # dynamic batching, a prefill step (not decode-only)
            n = step["padded_active_token_count"]
            key_seq_idx = step["token_to_position_in_request"][:n]  # apply_rotary_emb_key
            key_emb = k_pos_emb[key_seq_idx]
            key[:n] = apply_rotary_pos_emb_bshd(key[:n], key_emb[:n], interleaved)
            memory_buffer = caches  # append_key_value_cache, the PyTorch path
            block_idx = step["token_to_block_idx"][:n]
            local_kv_seq_idx = step["token_to_local_position_within_kv_block"][:n]
            key = key.squeeze(1)
            value = value.squeeze(1)
            memory_buffer[0, layer, block_idx, local_kv_seq_idx] = key[:n]
            memory_buffer[1, layer, block_idx, local_kv_seq_idx] = value[:n]
            # apply_rotary_emb_query is not in the notes: here as the key's, by position in request
            query = apply_rotary_pos_emb_bshd(query, q_pos_emb[key_seq_idx], interleaved)
            key, value = key[:, None], value[:, None]
        # [sq, b, h, d] -> [b, h, sq, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return self.o_proj(attend(q, k, v)).transpose(0, 1)


class Megatron(_Model):
    layer_cls = _MegatronLayer
    max_seq_len = 64  # inference_max_sequence_length: the emb rows the forward computes

    def finish(self):  # RotaryEmbedding.__init__, rotary_percent 1.0
        dim = self.s.head_dim
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)),
                             persistent=False)

    def prologue(self, x, step):  # RotaryEmbedding.forward(max_seq_len, offset=0)
        seq = torch.arange(self.max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + 0
        freqs = torch.outer(seq, self.inv_freq)
        if self.case.variant == "static":  # rotary_interleaved=False
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        emb = emb[:, None, None, :]
        return emb, emb
