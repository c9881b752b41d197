"""GQA (Qwen3 / Llama) attention-input preparation as unfused plain PyTorch.

What ``prepfuse::gqa_qknorm_rope_kv_insert`` replaces: split of the fused qkv, per-head
weighted RMSNorm of q and k (optional), RoPE, the q store, and the k/v insertion into
paged caches (bf16, or fp8-e4m3 with a per-tensor scale), as separate PyTorch ops. The
math is the op module's reference (``prepared_rows_reference``); only the insertion differs: no
boolean-mask filtering of skipped rows, so it never reads a tensor on the host, can be
captured in a CUDA graph and traced whole by ``torch.compile``.
"""

from __future__ import annotations

import torch

from prepfuse.ops.gqa_qknorm_rope_kv_insert import prepared_rows_reference


def gqa_prep_unfused(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    is_neox: bool,
    eps: float,
) -> None:
    """Same arguments and results as the op, for slot mappings whose slots are ALL valid
    and distinct (a negative slot would index the cache from its end). No input checks."""
    q, k_rows, v_rows = prepared_rows_reference(
        qkv, q_norm_weight, k_norm_weight, positions, cos_sin_cache, kv_scale, slot_mapping.shape[0],
        num_q_heads, num_kv_heads, is_neox, eps,
    )
    q_out.copy_(q)
    # caches: [NB, BS, Hkv, D]; slot s -> block s // BS, row s % BS (through uint8 views:
    # index_put has no float8 kernel)
    block_size = k_cache.shape[1]
    blk, row = slot_mapping // block_size, slot_mapping % block_size
    k_cache.view(torch.uint8)[blk, row] = k_rows.view(torch.uint8)
    v_cache.view(torch.uint8)[blk, row] = v_rows.view(torch.uint8)
