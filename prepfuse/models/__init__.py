"""Plain-PyTorch model code, written the way model authors write it: the one home of the
unfused spellings.

One module per family (``dsv4``, ``gqa``, ``dsv4_indexer`` with its MXFP4 format in
``dsv4_indexer_mxfp4`` and its example module in ``dsv4_indexer_block``): the spelling table
and look-alikes the passes are tested against, the example modules the demo compiles, and
``<family>_prep_unfused``, the op's reference math unfused and capturable, which the
benchmarks time as their baseline.
"""

from prepfuse.models.dsv4 import (
    DSV4_LOOKALIKES,
    DSV4_SPELLINGS,
    Dsv4AttentionBlock,
    Dsv4Spelling,
    dsv4_kv_insert,
    dsv4_prep_unfused,
    dsv4_q_prep,
    fp8_ds_mla_cache,
)
from prepfuse.models.gqa import (
    EXAMPLE_MODELS,
    GQA_LOOKALIKES,
    GQA_SPELLINGS,
    GqaAttentionBlock,
    GqaSpelling,
    gqa_prep,
    gqa_prep_unfused,
)

__all__ = [
    "DSV4_LOOKALIKES",
    "DSV4_SPELLINGS",
    "Dsv4AttentionBlock",
    "Dsv4Spelling",
    "dsv4_kv_insert",
    "dsv4_prep_unfused",
    "dsv4_q_prep",
    "fp8_ds_mla_cache",
    "EXAMPLE_MODELS",
    "GQA_LOOKALIKES",
    "GQA_SPELLINGS",
    "GqaAttentionBlock",
    "GqaSpelling",
    "gqa_prep",
    "gqa_prep_unfused",
]
