"""Each op's two implementations, by name, for what runs every op alike (the tests
``tests/ops/test_edge_shapes.py``, ``test_index_values.py``, ``test_non_finite.py``; the
row-lock benchmark and sanitize script): the checked plain-PyTorch reference and the
unchecked Triton launch (the CPU interpreter without a GPU, the kernel on CUDA)."""

from __future__ import annotations

from prepfuse.ops import (
    dsv4_indexer_rope_fp8_insert_reference,
    dsv4_indexer_rope_fp8_insert_triton,
    dsv4_indexer_rope_mxfp4_insert_reference,
    dsv4_indexer_rope_mxfp4_insert_triton,
    dsv4_qnorm_rope_kv_full_row_insert_reference,
    dsv4_qnorm_rope_kv_full_row_insert_triton,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)

__all__ = ["IMPLS", "implementations"]

# op: (reference, kernel launch)
IMPLS = {
    "dsv4": (dsv4_qnorm_rope_kv_insert_reference, dsv4_qnorm_rope_kv_insert_triton),
    "dsv4-full-row": (dsv4_qnorm_rope_kv_full_row_insert_reference, dsv4_qnorm_rope_kv_full_row_insert_triton),
    "gqa": (gqa_qknorm_rope_kv_insert_reference, gqa_qknorm_rope_kv_insert_triton),
    "indexer-fp8": (dsv4_indexer_rope_fp8_insert_reference, dsv4_indexer_rope_fp8_insert_triton),
    "indexer-mxfp4": (dsv4_indexer_rope_mxfp4_insert_reference, dsv4_indexer_rope_mxfp4_insert_triton),
}


def implementations(case: str) -> tuple:
    """(reference, kernel launch) of ``case``: an op's name in ``IMPLS``, or the op on an fp8 cache
    ("gqa-fp8", "dsv4-full-row-fp8": the same two implementations)."""
    return IMPLS[case.removesuffix("-fp8") if case in ("gqa-fp8", "dsv4-full-row-fp8") else case]
