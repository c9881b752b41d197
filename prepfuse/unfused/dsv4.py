"""DeepSeek-V4 attention-input preparation as unfused plain PyTorch.

What ``prepfuse::dsv4_qnorm_rope_kv_insert`` replaces: the q path (RMSNorm, GPT-J RoPE on
dims 448..511, one rounding to bf16, zeroed padded heads) and the kv path (RoPE, UE8M0
block-64 fp8 quantisation, insertion into the ``fp8_ds_mla`` paged cache) as separate
PyTorch ops. The math is the op module's reference, step by step; only the insertion
differs: it has no boolean-mask filtering of skipped rows, so it never reads a tensor on
the host, can be captured in a CUDA graph and traced whole by ``torch.compile``.
"""

from __future__ import annotations

import torch

from prepfuse.ops.dsv4_qnorm_rope_kv_insert import kv_cache_rows_reference, q_prep_reference, write_rows


def dsv4_prep_unfused(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    block_size: int,
) -> None:
    """Same arguments and results as the op, for slot mappings whose slots are ALL valid.

    Every ``slot_mapping`` entry must lie in ``[0, k_cache.size(0) * block_size)``: a
    negative ("skip") slot is not filtered out (that would need a boolean mask, i.e. a
    host sync) and would index the cache from its end. Slots must also be distinct, as
    the op's callers guarantee. The benchmarks use all-valid slot mappings for every
    implementation. No input checks: a model's code would not carry them either.
    """
    # q: [T, H, 512] bf16 -> q_out: [T, HP, 512] bf16
    num_heads = q.shape[1]
    q_out[:, :num_heads] = q_prep_reference(q, positions, cos_sin_cache, eps).to(torch.bfloat16)
    q_out[:, num_heads:] = 0

    # kv: [T, 512] bf16 -> cache rows [T', 576] and scale bytes [T', 8], uint8
    n_insert = slot_mapping.shape[0]
    data, scales = kv_cache_rows_reference(kv[:n_insert], positions[:n_insert], cos_sin_cache)

    # k_cache: [NB, S] uint8; slot s -> block s // block_size, row s % block_size
    write_rows(k_cache, data, scales, slot_mapping, block_size)
