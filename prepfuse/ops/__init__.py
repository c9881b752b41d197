"""prepfuse's fused custom ops (``torch.ops.prepfuse.*``).

Importing this package registers every op once per process. Each op's module holds its
math, kernel, reference implementation, checks and registration; the overload
constants below are what passes and tests refer to. ``SCRATCH`` is no fused op: it is
the graph node through which passes take output buffers from the scratch arena.
"""

from prepfuse.ops._library import NAMESPACE, TENSOR_FLOATS, floats_as_tensors, registered_ops, tensor_floats_overload
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    DSV4_QNORM_ROPE_KV_INSERT,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
)
from prepfuse.ops.dsv4_qnorm_rope_kv_full_row_insert import (
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT,
    dsv4_qnorm_rope_kv_full_row_insert_reference,
    dsv4_qnorm_rope_kv_full_row_insert_triton,
)
from prepfuse.ops.dsv4_indexer_rope_fp8_insert import (
    DSV4_INDEXER_ROPE_FP8_INSERT,
    dsv4_indexer_rope_fp8_insert_reference,
    dsv4_indexer_rope_fp8_insert_triton,
)
from prepfuse.ops.dsv4_indexer_rope_mxfp4_insert import (
    DSV4_INDEXER_ROPE_MXFP4_INSERT,
    dsv4_indexer_rope_mxfp4_insert_reference,
    dsv4_indexer_rope_mxfp4_insert_triton,
)
from prepfuse.ops.gqa_qknorm_rope_kv_insert import (
    GQA_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)
from prepfuse.ops.gqa_qknorm_rope_kv_insert_by_layer import GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER, define_by_layer_op
from prepfuse.ops.gqa_separate_qknorm_rope_kv_insert import (
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT,
    gqa_separate_qknorm_rope_kv_insert_reference,
    gqa_separate_qknorm_rope_kv_insert_triton,
)
from prepfuse.ops.scratch import SCRATCH

__all__ = [
    "NAMESPACE",
    "registered_ops",
    "TENSOR_FLOATS",
    "tensor_floats_overload",
    "floats_as_tensors",
    "DSV4_QNORM_ROPE_KV_INSERT",
    "dsv4_qnorm_rope_kv_insert_reference",
    "dsv4_qnorm_rope_kv_insert_triton",
    "DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT",
    "dsv4_qnorm_rope_kv_full_row_insert_reference",
    "dsv4_qnorm_rope_kv_full_row_insert_triton",
    "DSV4_INDEXER_ROPE_FP8_INSERT",
    "dsv4_indexer_rope_fp8_insert_reference",
    "dsv4_indexer_rope_fp8_insert_triton",
    "DSV4_INDEXER_ROPE_MXFP4_INSERT",
    "dsv4_indexer_rope_mxfp4_insert_reference",
    "dsv4_indexer_rope_mxfp4_insert_triton",
    "GQA_QKNORM_ROPE_KV_INSERT",
    "gqa_qknorm_rope_kv_insert_reference",
    "gqa_qknorm_rope_kv_insert_triton",
    "GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER",
    "define_by_layer_op",
    "GQA_SEPARATE_QKNORM_ROPE_KV_INSERT",
    "gqa_separate_qknorm_rope_kv_insert_reference",
    "gqa_separate_qknorm_rope_kv_insert_triton",
    "SCRATCH",
]
