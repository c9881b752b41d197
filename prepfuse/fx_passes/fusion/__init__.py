"""One module per fusion family: the pass (``<family>.py``) and the patterns it reads back
(``<family>_patterns.py``), built from ``fx_passes/matching/``.

- ``dsv4``: DeepSeek-V4 MLA prep -> ``prepfuse::dsv4_qnorm_rope_kv_insert`` (``fuse_dsv4_prep``);
- ``gqa``: Qwen3 / Llama prep -> ``prepfuse::gqa_qknorm_rope_kv_insert`` and its
  separate-projections op (``fuse_gqa_prep``);
- ``dsv4_indexer``: the DeepSeek-V4 indexer, one pass body over a formats table, FP8
  (``fuse_dsv4_indexer_prep``) and MXFP4 (``fuse_dsv4_indexer_mxfp4_prep``; its quantisation
  steps in ``dsv4_indexer_mxfp4_patterns.py``).

A family borrows from ``matching/``, never from another family.
"""
