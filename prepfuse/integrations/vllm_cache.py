"""vLLM 0.33's k/v cache write as a prepfuse engine write (``matching/engine_writes.py``).

vLLM's attention layer hands k and v to ``vllm::unified_kv_cache_update(key, value,
layer_name)``, which finds the layer and its cache (``attn_layer.kv_cache``) and the step's
slots (``forward_context.slot_mapping[layer_name]``) with ``get_attention_context`` and calls
the backend's ``do_kv_cache_update``. The declaration here gives the GQA family that op:

- k and v are ``key`` and ``value`` (``[T, Hkv, D]``), the key ``layer_name`` (vLLM's
  ``LayerName``, a graph input under torch >= 2.11, so one compiled graph serves every
  layer; a ``str`` with ``VLLM_USE_LAYERNAME=0``);
- the cache is FlashAttention's: one ``[num_blocks, Hkv, block_size, 2 * D]`` view per layer
  (any of vLLM's stride orders), k the first ``D`` values of a row and v the last,
  ``kv_cache.transpose(1, 2).split(D, -1)`` as ``FlashAttentionImpl.do_kv_cache_update``
  takes them: two ``[NB, BS, Hkv, D]`` views of one buffer with a dense last dim, which the
  GQA op writes as they are (k and v interleave per row without sharing a byte);
- the layout is known when compiling only where every attention layer of the model
  (``static_forward_context``) runs FlashAttention with a bf16 cache (``kv_cache_dtype
  "auto"``); any other backend (its own cache layout and write) or an fp8 cache (vLLM
  quantises inside its write with the layer's ``_k_scale``, which the by-layer call does not
  read) leaves the call to vLLM, said in the report.

A negative slot is skipped, as vLLM's ``reshape_and_cache_flash`` skips its ``PAD_SLOT_ID``
(-1) in a batch padded to a CUDA graph's size (``negative_slots="skip"``).

At run time the resolver reads the same forward context; a step without slots for the layer
(vLLM's profiling run) writes q alone, as vLLM writes no cache row then.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.utils.torch_utils import LayerName, LayerNameType, _resolve_layer_name

from prepfuse.fx_passes.matching.engine_writes import CacheLayout, EngineWrite, register_engine_write
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER, define_by_layer_op
from prepfuse.ops.engine_caches import EngineCaches

__all__ = ["UNIFIED_KV_CACHE_UPDATE", "BY_LAYER_OP", "vllm_engine_write"]

UNIFIED_KV_CACHE_UPDATE = torch.ops.vllm.unified_kv_cache_update.default
BACKEND = "FLASH_ATTN"
# the by-layer op whose layer_name is vLLM's key type: prepfuse's own for str, else the same op
# in this integration's namespace with vLLM's opaque LayerName
BY_LAYER_OP = GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER if LayerNameType is str else define_by_layer_op(
    f"{LayerName.__module__}.{LayerName.__qualname__}", namespace="prepfuse_vllm").default


def _attention_layers() -> dict | None:
    config = get_current_vllm_config_or_none()
    if config is None:
        return None
    return {name: layer for name, layer in config.compilation_config.static_forward_context.items()
            if hasattr(layer, "attn_backend") and hasattr(layer, "kv_cache_dtype")}


def _layout(node: torch.fx.Node) -> CacheLayout | str:
    """The cache every attention layer has, or why it is not one the by-layer op writes (the
    key is a graph input: the layer is known only when the graph runs)."""
    layers = _attention_layers()
    if not layers:
        return "no vLLM config with attention layers is current, so their cache layout is not known when compiling"
    for name, layer in layers.items():
        backend = layer.attn_backend.get_name()
        if backend != BACKEND:
            return (f"layer {name} runs the {backend} attention backend; prepfuse knows the cache layout of "
                    f"{BACKEND} ([num_blocks, Hkv, block_size, 2 * D], k then v in a row)")
        if layer.kv_cache_dtype != "auto" or layer.kv_cache_torch_dtype != torch.bfloat16:
            return (f"layer {name} keeps a {layer.kv_cache_dtype} ({layer.kv_cache_torch_dtype}) cache; the by-layer "
                    "op writes bf16 caches (vLLM quantises fp8 inside its write, with the layer's _k_scale)")
    return CacheLayout(torch.bfloat16)


def _layout_key() -> tuple | None:
    """What ``_layout`` reads of the current config: each attention layer's backend and cache
    dtype (None without a config), so a compile for another config is keyed apart."""
    layers = _attention_layers()
    if layers is None:
        return None
    return tuple((name, layer.attn_backend.get_name(), layer.kv_cache_dtype, str(layer.kv_cache_torch_dtype))
                 for name, layer in sorted(layers.items()))


def _resolve(layer_name) -> EngineCaches | None:
    """This step's cache views and slots of the layer, read as vLLM's own write reads them."""
    name = _resolve_layer_name(layer_name)
    _, layer, kv_cache, slots = get_attention_context(name)
    if slots is None:
        return None
    if layer.attn_backend.get_name() != BACKEND:
        raise ValueError(f"layer_name: {name} runs the {layer.attn_backend.get_name()} attention backend; the "
                         f"compiled call writes {BACKEND}'s cache layout")
    # (NB, Hkv, BS, 2 * D) -> k and v, each (NB, BS, Hkv, D): FlashAttentionImpl.do_kv_cache_update's views
    k_cache, v_cache = kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)
    return EngineCaches(k_cache, v_cache, slots)


def vllm_engine_write() -> EngineWrite:
    """The declaration of ``vllm::unified_kv_cache_update`` (registered on import)."""
    return EngineWrite(UNIFIED_KV_CACHE_UPDATE, key="key", value="value", layer="layer_name", layout=_layout,
                       resolve=_resolve, by_layer_op=BY_LAYER_OP, negative_slots="skip",
                       layout_key=_layout_key)


register_engine_write(vllm_engine_write())
