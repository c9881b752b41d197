"""transformers' own ``DeepseekV4Attention``, run the way an engine runs it: its k written
into vLLM's fp8_ds_mla cache, or into its bf16 full-row cache.

The module is transformers' (``transformers.models.deepseek_v4``), unchanged: q through
``q_a_proj``, the weighted ``q_a_norm``, ``q_b_proj``, the per-head unweighted ``q_b_norm``
(its rsqrt factor rounded to bf16) and GPT-J RoPE on the last 64 of 512 dims with the
model's bf16 cos/sin (``repeat_interleave(2)``); kv through ``kv_proj``, the weighted
``kv_norm`` and the same RoPE. Its attention call goes to an engine function registered
through transformers' ``AttentionInterface`` (``DSV4_ENGINE_ATTENTION``): it writes the
step's k rows into the paged fp8_ds_mla cache as the engine does (UE8M0-scaled e4m3 NoPE
codes and the bf16 RoPE values, ``models.dsv4.write_fp8_ds_mla_rows``), then attends over
the step's tokens (one kv head for every q head; the sinks are the engine kernel's
business). ``DSV4_BF16_ENGINE_ATTENTION`` writes the rows whole into vLLM's bf16 full-row cache
``[blocks, block_size, 512]`` instead, ``DSV4_FP8_ENGINE_ATTENTION`` into its per-tensor e4m3 one
(``rows / k_scale``, saturated; the scale a buffer of the attention module, as engines keep it),
and ``DSV4_FP8_Q_ENGINE_ATTENTION`` there too with q cast to e4m3 first (``q * q_scale_inv``,
saturated, as vLLM's fp8 full-cache path hands its attention an e4m3 q).
``DSV4_MXFP8_ENGINE_ATTENTION`` writes DeepSeek-V4.1's MXFP8 records (``models.dsv4.write_mxfp8_records``:
512 e4m3 codes over 16 UE8M0 scales, then the scale bytes). DeepSeek-V4.1 norms q before its
up-projection, not per head: a client built with ``q_head_norm=False`` drops ``q_b_norm``. Layers
are sliding-window ones (no compressor: one cache row a token).

``transformers`` is a test dependency: this module imports it when a client is built.
"""

from __future__ import annotations

import torch
from torch import nn

from prepfuse.models.dsv4 import fp8_ds_mla_cache, mxfp8_cache, write_fp8_ds_mla_rows, write_mxfp8_records
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import NOPE_DIM

__all__ = ["DSV4_ENGINE_ATTENTION", "DSV4_BF16_ENGINE_ATTENTION", "DSV4_FP8_ENGINE_ATTENTION",
           "DSV4_FP8_Q_ENGINE_ATTENTION", "DSV4_MXFP8_ENGINE_ATTENTION", "HfDsv4Layers", "build_hf_dsv4_client",
           "register_dsv4_engine_attention"]

DSV4_ENGINE_ATTENTION = "prepfuse_fp8_ds_mla"
DSV4_BF16_ENGINE_ATTENTION = "prepfuse_dsv4_bf16_rows"
DSV4_FP8_ENGINE_ATTENTION = "prepfuse_dsv4_fp8_rows"
DSV4_FP8_Q_ENGINE_ATTENTION = "prepfuse_dsv4_fp8_rows_fp8_q"
DSV4_MXFP8_ENGINE_ATTENTION = "prepfuse_dsv4_mxfp8_records"


def _fp8_ds_mla_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The engine's attention: k's rows into the fp8_ds_mla cache at the step's slots, then
    causal SDPA over the step's tokens with the one kv head repeated for every q head."""
    rows = _rows(key)
    write_fp8_ds_mla_rows(rows[:, :NOPE_DIM].float(), rows[:, NOPE_DIM:], kwargs["k_cache"], kwargs["slot_mapping"],
                          kwargs["block_size"])
    return _attend(query, key, value, scaling)


def _bf16_rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The engine's attention over a bf16 full-row cache: k's rows written whole at the
    step's slots, then the same attention."""
    _write_full_rows(_rows(key), **kwargs)
    return _attend(query, key, value, scaling)


def _fp8_rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The same over a per-tensor e4m3 full-row cache: each row over the module's
    ``k_scale``, saturated at 448."""
    _write_full_rows(_e4m3(_rows(key).float() / module.k_scale), **kwargs)
    return _attend(query, key, value, scaling)


def _fp8_rows_fp8_q_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The e4m3 full-row cache with an e4m3 q: q times the module's ``q_scale_inv``,
    saturated, cast; the attention reads it back over the same scale."""
    q_fp8 = _e4m3(query.float() * module.q_scale_inv)
    _write_full_rows(_e4m3(_rows(key).float() / module.k_scale), **kwargs)
    return _attend((q_fp8.float() / module.q_scale_inv).to(query.dtype), key, value, scaling)


def _mxfp8_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The engine's attention over DeepSeek-V4.1's MXFP8 cache: k's rows as records at the
    step's slots, then the same attention."""
    write_mxfp8_records(_rows(key).float(), kwargs["k_cache"], kwargs["slot_mapping"], kwargs["block_size"])
    return _attend(query, key, value, scaling)


def _e4m3(x):
    """fp32 values saturated at 448 and cast to e4m3, as engines quantise per tensor."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _rows(key):
    """k's ``[B, 1, S, 512]`` head as ``[B * S, 512]`` rows, one a token."""
    batch, _, seq, head_dim = key.shape
    return key.transpose(1, 2).reshape(batch * seq, head_dim)


def _write_full_rows(rows, *, k_cache, slot_mapping, block_size, **_):
    """A full-row cache's rows at the step's slots: ``cache[slot // bs, slot % bs] = row``."""
    k_cache[slot_mapping // block_size, slot_mapping % block_size] = rows


def _attend(query, key, value, scaling):
    heads = query.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.expand(-1, heads, -1, -1), value.expand(-1, heads, -1, -1), is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_dsv4_engine_attention() -> None:
    """Register the engine attention functions with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DSV4_ENGINE_ATTENTION, _fp8_ds_mla_attention)
    AttentionInterface.register(DSV4_BF16_ENGINE_ATTENTION, _bf16_rows_attention)
    AttentionInterface.register(DSV4_FP8_ENGINE_ATTENTION, _fp8_rows_attention)
    AttentionInterface.register(DSV4_FP8_Q_ENGINE_ATTENTION, _fp8_rows_fp8_q_attention)
    AttentionInterface.register(DSV4_MXFP8_ENGINE_ATTENTION, _mxfp8_attention)


class HfDsv4Layers(nn.Module):
    """Layers of ``DeepseekV4Attention`` with the model's rotary module, each adding its
    output to the hidden state (a decoder's residual, without the MoE)."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

        self.rotary = DeepseekV4RotaryEmbedding(config)
        self.layers = nn.ModuleList(DeepseekV4Attention(config, layer_idx=i) for i in range(num_layers))

    def forward(self, x, position_ids, slot_mapping, caches, block_size: int):
        embeddings = {t: self.rotary(x, position_ids=position_ids, layer_type=t) for t in ("main", "compress")}
        for layer, cache in zip(self.layers, caches):
            out, _ = layer(x, position_embeddings=embeddings, position_ids=position_ids, attention_mask=None,
                           k_cache=cache, slot_mapping=slot_mapping, block_size=block_size)
            x = x + out
        return x


def build_hf_dsv4_client(*, num_tokens: int = 7, num_layers: int = 2, hidden: int = 256, heads: int = 4,
                         block_size: int = 16, num_blocks: int = 4, seed: int = 0, cache: str = "fp8_ds_mla",
                         q_head_norm: bool = True):
    """``(module, (x, position_ids, slot_mapping, caches, block_size))``: bf16 layers with
    random weights (norm weights around 1), one step of ``num_tokens`` tokens at positions
    ``3 ..`` and distinct random slots, fresh caches: fp8_ds_mla, or random full rows, bf16
    (``cache="bf16"``) or e4m3 (``cache="fp8"``, each layer's ``k_scale`` 0.02; ``"fp8_q"``: and q
    cast to e4m3 with each layer's ``q_scale_inv`` 20), or DeepSeek-V4.1's MXFP8 records
    (``cache="mxfp8"``); ``q_head_norm=False``: no per-head q norm (DeepSeek-V4.1)."""
    from transformers import DeepseekV4Config

    register_dsv4_engine_attention()
    config = DeepseekV4Config(hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
                              head_dim=512, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=128,
                              layer_types=["sliding_attention"] * num_layers)
    config._attn_implementation = {"fp8_ds_mla": DSV4_ENGINE_ATTENTION, "bf16": DSV4_BF16_ENGINE_ATTENTION,
                                   "fp8": DSV4_FP8_ENGINE_ATTENTION, "fp8_q": DSV4_FP8_Q_ENGINE_ATTENTION,
                                   "mxfp8": DSV4_MXFP8_ENGINE_ATTENTION}[cache]
    g = torch.Generator().manual_seed(seed)
    module = HfDsv4Layers(config, num_layers)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    module = module.to(torch.bfloat16).eval()
    if not q_head_norm:
        for layer in module.layers:
            layer.q_b_norm = nn.Identity()
    for layer in module.layers:  # an engine's per-layer kv and q scales, fp32 (after the bf16 cast)
        layer.register_buffer("k_scale", torch.tensor([0.02]))
        layer.register_buffer("q_scale_inv", torch.tensor([20.0]))
    x = torch.randn(1, num_tokens, hidden, generator=g).to(torch.bfloat16)
    position_ids = (torch.arange(num_tokens) + 3).unsqueeze(0)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if cache in ("bf16", "fp8", "fp8_q"):
        dtype = torch.bfloat16 if cache == "bf16" else torch.float8_e4m3fn
        caches = [torch.randn(num_blocks, block_size, 512, generator=g).to(dtype) for _ in range(num_layers)]
    elif cache == "mxfp8":
        caches = [mxfp8_cache(num_blocks, block_size) for _ in range(num_layers)]
    else:
        caches = [fp8_ds_mla_cache(num_blocks, block_size) for _ in range(num_layers)]
    return module, (x, position_ids, slots, caches, block_size)
