"""Each op's two implementations, by name, for the tests that run every op alike
(``test_edge_shapes.py``, ``test_index_values.py``): the checked plain-PyTorch reference and
the unchecked Triton launch (the CPU interpreter here, the kernel on CUDA)."""

from __future__ import annotations

from prepfuse.ops import (
    dsv4_indexer_rope_fp8_insert_reference,
    dsv4_indexer_rope_fp8_insert_triton,
    dsv4_indexer_rope_mxfp4_insert_reference,
    dsv4_indexer_rope_mxfp4_insert_triton,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)

# op: (reference, kernel launch)
IMPLS = {
    "dsv4": (dsv4_qnorm_rope_kv_insert_reference, dsv4_qnorm_rope_kv_insert_triton),
    "gqa": (gqa_qknorm_rope_kv_insert_reference, gqa_qknorm_rope_kv_insert_triton),
    "indexer-fp8": (dsv4_indexer_rope_fp8_insert_reference, dsv4_indexer_rope_fp8_insert_triton),
    "indexer-mxfp4": (dsv4_indexer_rope_mxfp4_insert_reference, dsv4_indexer_rope_mxfp4_insert_triton),
}
