"""The README's main command, ``python -m prepfuse.demo`` (``__main__.py``): one section per
family (``dsv4``, ``gqa``, ``dsv4_indexer``), each running its op beside the reference
(``op_impls.py``) or compiling its example models with ``backend="prepfuse"``
(``compiled.py``: the compile, the report, the timing), and one printed line per check
(``rows.py``)."""
