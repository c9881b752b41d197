"""The README's main command, ``python -m prepfuse.demo`` (``__main__.py``): one section per
family (``dsv4``, ``gqa``, ``dsv4_indexer``), each compiling its example models with
``backend="prepfuse"`` (``compiled.py``: the compile, the report, the timing)."""
