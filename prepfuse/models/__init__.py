"""Plain-PyTorch model code, written the way model authors write it.

These modules are what prepfuse's graph passes are tested against: the unfused
sequences a pass has to find, in the spellings seen in real model files.
"""

from prepfuse.models.dsv4 import (
    DSV4_LOOKALIKES,
    DSV4_SPELLINGS,
    Dsv4AttentionBlock,
    Dsv4Spelling,
    dsv4_kv_insert,
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
)

__all__ = [
    "DSV4_LOOKALIKES",
    "DSV4_SPELLINGS",
    "Dsv4AttentionBlock",
    "Dsv4Spelling",
    "dsv4_kv_insert",
    "dsv4_q_prep",
    "fp8_ds_mla_cache",
    "EXAMPLE_MODELS",
    "GQA_LOOKALIKES",
    "GQA_SPELLINGS",
    "GqaAttentionBlock",
    "GqaSpelling",
    "gqa_prep",
]
