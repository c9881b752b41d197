"""ModelTC/lightllm's Qwen3, transcribed for its mm(out=) k/v buffer, in-place norms and RoPE, token pool."""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.references.common import _Layer, _Model, _norm_weight, attend


# -- ModelTC/lightllm lightllm/{models/qwen3,models/llama,common/basemodel}/... --------------------------
def rmsnorm_forward(x, weight, eps, out=None):
    """The Triton kernel's math: fp32 ``var = sum(x * x) / N``, ``rstd = 1 / sqrt(var + eps)``,
    ``(x * rstd) * w`` with w in fp32, stored in the output's dtype."""
    y = torch.empty_like(x) if out is None else out
    x_arg = x.view(-1, x.shape[-1])
    y_arg = y.view(-1, x.shape[-1])  # (the source asserts y_arg's data_ptr is y's: dynamo cannot trace that)
    xf = x_arg.to(torch.float32)
    var = (xf * xf).sum(-1, keepdim=True) / x_arg.shape[-1]
    rstd = 1 / torch.sqrt(var + eps)
    y_arg.copy_((xf * rstd * weight.to(torch.float32)).to(y.dtype))
    return y


def rotary_emb_fwd(q, k, cos, sin):
    """The Triton kernel's math, in place on q and k: NeoX halves, bf16 loads, ``q0 * cos - q1 *
    sin`` and ``q0 * sin + q1 * cos`` in the loads' dtype, stored back over q0 and q1."""
    cos, sin = cos.view(cos.shape[0], 1, -1), sin.view(sin.shape[0], 1, -1)
    for x in (q, k):
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half], x[..., half:]
        out0 = x0 * cos - x1 * sin
        out1 = x0 * sin + x1 * cos
        x0.copy_(out0)
        x1.copy_(out1)


class _LightllmLayer(_Layer):
    def __init__(self, case, s):
        super().__init__(case, s)
        self.tp_q_head_num_, self.tp_k_head_num_, self.tp_v_head_num_ = s.heads, s.kv_heads, s.kv_heads
        self.head_dim_, self.embed_dim_, self.eps_ = s.head_dim, s.hidden, 1e-6
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.kv_proj = nn.Linear(s.hidden, 2 * s.kv_heads * s.head_dim, bias=False)
        self.q_norm_weight_ = _norm_weight(s.head_dim)
        self.k_norm_weight_ = _norm_weight(s.head_dim)

    def _get_qkv(self, input, cache_kv, position_cos, position_sin):  # Qwen3 layer infer
        input = input.view(-1, self.embed_dim_)
        q = torch.mm(input, self.q_proj.weight.t())  # q_proj.mm(input)
        cache_kv = torch.mm(
            input, self.kv_proj.weight.t(),
            out=cache_kv.view(-1, (self.tp_k_head_num_ + self.tp_v_head_num_) * self.head_dim_),
        ).view(-1, (self.tp_k_head_num_ + self.tp_v_head_num_), self.head_dim_)
        rmsnorm_forward(q.view(-1, self.head_dim_), weight=self.q_norm_weight_, eps=self.eps_,
                        out=q.view(-1, self.head_dim_))
        cache_kv[:, : self.tp_k_head_num_, :] = rmsnorm_forward(
            cache_kv[:, : self.tp_k_head_num_, :].reshape(-1, cache_kv.shape[-1]),
            weight=self.k_norm_weight_,
            eps=self.eps_,
        ).view(-1, self.tp_k_head_num_, cache_kv.shape[-1])
        rotary_emb_fwd(q.view(-1, self.tp_q_head_num_, self.head_dim_), cache_kv[:, : self.tp_k_head_num_, :],
                       position_cos, position_sin)
        return q, cache_kv

    def forward(self, input_embdings, position_cos_sin, step, caches, layer):
        num_tokens = input_embdings.shape[0]
        cache_kv = torch.empty((num_tokens, self.tp_k_head_num_ + self.tp_v_head_num_, self.head_dim_),
                               dtype=input_embdings.dtype, device=input_embdings.device)  # _pre_cache_kv
        q, cache_kv = self._get_qkv(input_embdings, cache_kv, *position_cos_sin)
        kv_buffer = caches  # mem_manager.kv_buffer [layers, size + 1, 2 * H, D]
        kv_buffer[layer][step["mem_index"]] = cache_kv  # destindex_copy_kv: row i to mem_index[i]
        q = q.view(1, num_tokens, self.tp_q_head_num_, self.head_dim_).transpose(1, 2)
        k, v = cache_kv[None].transpose(1, 2).split([self.tp_k_head_num_, self.tp_v_head_num_], dim=1)
        return self.o_proj(attend(q, k, v))


class Lightllm(_Model):
    layer_cls = _LightllmLayer

    def finish(self):  # model._init_to_get_rotary: half-width tables in the model dtype
        dim = self.s.head_dim
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        t = torch.arange(self.s.max_pos, dtype=torch.float32) / 1.0
        freqs = torch.outer(t, inv_freq)
        dtype = self.layers[0].q_proj.weight.dtype
        self.register_buffer("_cos_cached", torch.cos(freqs).to(dtype), persistent=False)
        self.register_buffer("_sin_cached", torch.sin(freqs).to(dtype), persistent=False)

    def prologue(self, x, step):  # LlamaInferStateInfo.init_some_extra_state
        position_ids = step["position_ids"]
        position_cos = torch.index_select(self._cos_cached, 0, position_ids).view(position_ids.shape[0], -1)
        position_sin = torch.index_select(self._sin_cached, 0, position_ids).view(position_ids.shape[0], -1)
        return position_cos, position_sin
