"""DeepSeek-V4 indexer preparation, MXFP4 format, as one fused, mutating out-variant op.

Schema (the contract; ``tests/golden/schemas.txt`` holds it verbatim)::

    prepfuse::dsv4_indexer_rope_mxfp4_insert(Tensor q, Tensor weights, Tensor k,
        Tensor(a!) q_out, Tensor(b!) q_scale, Tensor(c!) weights_out, Tensor(d!) k_cache,
        Tensor slot_mapping, Tensor positions, Tensor k_positions, Tensor cos_sin_cache,
        float weights_scale, int block_size) -> ()

Inputs as in ``dsv4_indexer_common`` (q [T, H, 128] bf16, weights [T, H], k [Tk, 128] bf16,
slot_mapping [Tk'], positions [T], k_positions [Tk], cos_sin_cache [P, 64]); outputs::

    q_out        [T, H, 64]  uint8  written: rotated q as e2m1 nibbles, two per byte
    q_scale      [T, H, 4]   uint8  written: one UE8M0 byte per block of 32 values
                                    (vLLM hands it to DeepGEMM viewed as int32 [T, H])
    weights_out  [T, H]      fp32   written: weights * weights_scale (no q scale: the
                                    block scales travel with q)
    k_cache      [NB, S]     uint8  written at inserted slots, S >= block_size * 68

Per query head and key row (x: 128 values): GPT-J RoPE on dims 64..127, round to bf16;
per block of 32: ``amax = max(max|x|, 6 * 2^-126)``, ``e = clamp(ceil(log2(amax/6)), -127, 127)``,
nibble ``e2m1(x * 2^-e)`` (round to nearest even, saturating at 6, bit 3 the sign), byte
``j`` of a block ``nibble(x[2j]) | nibble(x[2j+1]) << 4``, scale byte ``e + 127``. This is
vLLM's ``fused_indexer_q_rope_quant`` (MXFP4 path) and its compressor's MXFP4 insert.

Indexer cache, slot ``s`` in block ``b = s // block_size``, row ``i = s % block_size``: bytes
``[b*S + i*64, +64)`` the packed values, ``[b*S + block_size*64 + i*4, +4)`` the 4 scale
bytes: 68 bytes per slot (vLLM's DeepSeek-V4 MXFP4 indexer layout).
"""

from __future__ import annotations

import torch

from prepfuse.ops._checks import check_flag
from prepfuse.ops._library import define_op
from prepfuse.ops.dsv4_indexer_common import (
    MXFP4_BLOCKS,
    MXFP4_PACKED,
    MXFP4_SLOT_BYTES,
    check_common_inputs,
    check_index_values,
    check_q_output,
    launch_indexer_kernel,
    mxfp4_quant_reference,
    rope_tail_reference,
    wrapped_indices,
    write_cache_rows,
)

SCHEMA = (
    "dsv4_indexer_rope_mxfp4_insert(Tensor q, Tensor weights, Tensor k, Tensor(a!) q_out, "
    "Tensor(b!) q_scale, Tensor(c!) weights_out, Tensor(d!) k_cache, Tensor slot_mapping, "
    "Tensor positions, Tensor k_positions, Tensor cos_sin_cache, float weights_scale, int block_size, "
    "bool wrap_indices=False) -> ()"
)


def dsv4_indexer_rope_mxfp4_insert_triton(
    q, weights, k, q_out, q_scale, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, wrap_indices=False, *, launch_config: tuple[int, int] | None = None,
    dedupe: str | None = None, k_first: bool = False,
) -> None:
    """Launch the fused kernel once (q and k sides together). Inputs are not checked here;
    ``launch_config``, ``dedupe`` and ``k_first`` as ``launch_indexer_kernel`` takes them."""
    launch_indexer_kernel(
        q, weights, k, q_out, q_scale, weights_out, k_cache, slot_mapping, positions, k_positions,
        cos_sin_cache, weights_scale, block_size, mxfp4=True, launch_config=launch_config,
        dedupe=dedupe, k_first=k_first, wrap_indices=wrap_indices,
    )


def _reference(
    q, weights, k, q_out, q_scale, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, wrap_indices=False,
) -> None:
    """The op in plain PyTorch, unchecked: ``define_op`` runs the checks first."""
    slot_mapping, positions, k_positions = wrapped_indices(k_cache, slot_mapping, positions, k_positions,
                                                           cos_sin_cache, block_size, wrap_indices)
    packed, scale_bytes = mxfp4_quant_reference(rope_tail_reference(q, positions, cos_sin_cache))
    q_out.copy_(packed)
    q_scale.copy_(scale_bytes)
    weights_out.copy_(weights.float() * weights_scale)
    n_insert = slot_mapping.shape[0]
    k_packed, k_scale_bytes = mxfp4_quant_reference(
        rope_tail_reference(k[:n_insert], k_positions[:n_insert], cos_sin_cache)
    )
    write_cache_rows(k_cache, k_packed, k_scale_bytes, slot_mapping, block_size)


def check_inputs(
    q, weights, k, q_out, q_scale, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
    weights_scale, block_size, wrap_indices=False,
) -> None:
    """Dtypes, shapes, devices and strides; raises ValueError naming the argument."""
    check_flag("wrap_indices", wrap_indices)
    check_common_inputs(
        q, weights, k, weights_out, k_cache, slot_mapping, positions, k_positions, cos_sin_cache,
        weights_scale, block_size, slot_bytes=MXFP4_SLOT_BYTES,
    )
    check_q_output("q_out", q_out, q, torch.uint8, MXFP4_PACKED, "64 packed bytes per head")
    check_q_output("q_scale", q_scale, q, torch.uint8, MXFP4_BLOCKS, "4 UE8M0 bytes per head")


_OP = define_op(
    SCHEMA, check=check_inputs, index_check=check_index_values, reference=_reference, triton=dsv4_indexer_rope_mxfp4_insert_triton,
)
dsv4_indexer_rope_mxfp4_insert = _OP.packet
# the plain-PyTorch path as a function, checks included (tests and benchmarks call it)
dsv4_indexer_rope_mxfp4_insert_reference = _OP.reference
DSV4_INDEXER_ROPE_MXFP4_INSERT = dsv4_indexer_rope_mxfp4_insert.default
