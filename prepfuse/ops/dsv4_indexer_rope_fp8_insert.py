"""DeepSeek-V4 indexer preparation, FP8 format, as one fused, mutating out-variant op.

Schema (the contract; ``tests/golden/schemas.txt`` holds it verbatim)::

    prepfuse::dsv4_indexer_rope_fp8_insert(Tensor q, Tensor weights, Tensor k,
        Tensor(a!) q_out, Tensor(b!) weights_out, Tensor(c!) k_cache, Tensor slot_mapping,
        Tensor positions, Tensor k_positions, Tensor cos_sin_cache, float weights_scale,
        int block_size) -> ()

Inputs as in ``dsv4_indexer_common`` (q [T, H, 128] bf16, weights [T, H], k [Tk, 128] bf16,
slot_mapping [Tk'], positions [T], k_positions [Tk], cos_sin_cache [P, 64]); outputs::

    q_out        [T, H, 128]  float8_e4m3fn  written: rotated q, one power-of-two scale per
                                             token and head (not stored: folded below)
    weights_out  [T, H]       fp32           written: weights * q_scale * weights_scale
    k_cache      [NB, S]      uint8          written at inserted slots, S >= block_size * 132

Per query head (x: its 128 values): GPT-J RoPE on dims 64..127, round to bf16, then
``amax = max(max|x|, 1e-4)``, ``e = ceil(log2(amax / 448))``,
``q_out = e4m3(clamp(x * 2^-e, -448, 448))`` (round to nearest even) and
``weights_out = fp32(fp32(w) * 2^e) * weights_scale`` (the first product is exact).

This is vLLM's ``fused_indexer_q_rope_quant`` (FP8 path) contract: the q scale lives in
the weights, because DeepGEMM's ``fp8_fp4_mqa_logits`` applies a per-(token, head) factor
through them. vLLM multiplies by softmax_scale (head_dim^-0.5) and head_scale
(H^-0.5) one after the other; with ``weights_scale`` their product, the result is the
same bits whenever the head scale is a power of two (H = 64: 1/8).

Each key row: the same RoPE, rounding and scale rule over its 128 values, stored in the
FP8 indexer cache: bytes ``[b*S + i*128, +128)`` the codes of slot ``s`` (block
``b = s // block_size``, row ``i = s % block_size``), bytes ``[b*S + block_size*128 + i*4, +4)``
its scale ``2^e`` as a little-endian fp32 (vLLM's ``indexer_k_quant_and_cache`` layout,
read back by ``cp_gather_indexer_k_quant_cache``): 132 bytes per slot.
"""

from __future__ import annotations

import torch

from prepfuse.ops._checks import check_flag
from prepfuse.ops._library import define_op
from prepfuse.ops.dsv4_indexer_common import (
    FP8_SLOT_BYTES,
    HEAD_DIM,
    check_common_inputs,
    check_index_values,
    check_q_output,
    fp8_quant_reference,
    launch_indexer_kernel,
    rope_tail_reference,
    wrapped_indices,
    write_cache_rows,
)

SCHEMA = (
    "dsv4_indexer_rope_fp8_insert(Tensor q, Tensor weights, Tensor k, Tensor(a!) q_out, "
    "Tensor(b!) weights_out, Tensor(c!) k_cache, Tensor slot_mapping, Tensor positions, "
    "Tensor k_positions, Tensor cos_sin_cache, float weights_scale, int block_size, "
    "bool wrap_indices=False) -> ()"
)


def dsv4_indexer_rope_fp8_insert_triton(
    q, weights, k, q_out, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, wrap_indices=False, *, launch_config: tuple[int, int] | None = None,
    dedupe: str | None = None, k_first: bool = False,
) -> None:
    """Launch the fused kernel once (q and k sides together). Inputs are not checked here;
    ``launch_config``, ``dedupe`` and ``k_first`` as ``launch_indexer_kernel`` takes them."""
    launch_indexer_kernel(
        q, weights, k, q_out, None, weights_out, k_cache, slot_mapping, positions, k_positions,
        cos_sin_cache, weights_scale, block_size, mxfp4=False, launch_config=launch_config,
        dedupe=dedupe, k_first=k_first, wrap_indices=wrap_indices,
    )


def _reference(
    q, weights, k, q_out, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, wrap_indices=False,
) -> None:
    """The op in plain PyTorch, unchecked: ``define_op`` runs the checks first."""
    slot_mapping, positions, k_positions = wrapped_indices(k_cache, slot_mapping, positions, k_positions,
                                                           cos_sin_cache, block_size, wrap_indices)
    codes, q_scale = fp8_quant_reference(rope_tail_reference(q, positions, cos_sin_cache))
    q_out.view(torch.uint8).copy_(codes)
    weights_out.copy_(weights.float() * q_scale * weights_scale)
    n_insert = slot_mapping.shape[0]
    k_codes, k_scale = fp8_quant_reference(rope_tail_reference(k[:n_insert], k_positions[:n_insert], cos_sin_cache))
    scale_bytes = k_scale.unsqueeze(-1).contiguous().view(torch.uint8)  # fp32 little-endian
    write_cache_rows(k_cache, k_codes, scale_bytes, slot_mapping, block_size)


def check_inputs(
    q, weights, k, q_out, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, wrap_indices=False,
) -> None:
    """Dtypes, shapes, devices and strides; raises ValueError naming the argument."""
    check_flag("wrap_indices", wrap_indices)
    check_common_inputs(
        q, weights, k, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
        weights_scale, block_size, slot_bytes=FP8_SLOT_BYTES,
    )
    check_q_output("q_out", q_out, q, torch.float8_e4m3fn, HEAD_DIM, "the indexer head dim")


_OP = define_op(
    SCHEMA, check=check_inputs, index_check=check_index_values, reference=_reference, triton=dsv4_indexer_rope_fp8_insert_triton,
)
dsv4_indexer_rope_fp8_insert = _OP.packet
# the plain-PyTorch path as a function, checks included (tests and benchmarks call it)
dsv4_indexer_rope_fp8_insert_reference = _OP.reference
DSV4_INDEXER_ROPE_FP8_INSERT = dsv4_indexer_rope_fp8_insert.default
