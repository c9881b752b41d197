"""One module per fusion family, built from ``fx_passes/matching/``: each finds its regions
by what they write, lists the calls of its op that could compute them, and keeps the one
the probes agree with.

- ``dsv4``: DeepSeek-V4 MLA prep -> ``prepfuse::dsv4_qnorm_rope_kv_insert`` (fp8_ds_mla cache)
  or ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert`` (bf16 full rows) (``fuse_dsv4_prep``; the
  head padding FlashMLA reads in ``dsv4_padding.py``);
- ``gqa``: Qwen3 / Llama / Gemma ... prep -> ``prepfuse::gqa_qknorm_rope_kv_insert`` and its
  separate-projections op (``fuse_gqa_prep``; its math candidates in ``gqa_calls.py``);
- ``dsv4_indexer``: the DeepSeek-V4 indexer, one pass body over a formats table, FP8
  (``fuse_dsv4_indexer_prep``) and MXFP4 (``fuse_dsv4_indexer_mxfp4_prep``).

A family borrows from ``matching/`` and ``rewrite/`` (``rewrite/cache_views.py``: the paged
cache a rows write writes, for every family whose cache holds rows of values), never from
another family.
"""
