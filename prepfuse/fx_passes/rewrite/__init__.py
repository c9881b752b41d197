"""What emits and validates a rewrite, for every fusion family: candidate calls run against
the region they would replace, on probes, and the one that agrees put into the graph.

- ``probes.py``, ``compare.py``: probe values, the region run once, candidates compared;
- ``search.py``: candidate calls tried on the probes, the first that agrees kept;
- ``emitter.py``: what every rewrite inserts (fake values, the functional call);
- ``scratch_buffers.py``: output buffers from the scratch arena;
- ``by_layer.py``: a fused engine write's call in the engine's by-layer form.
"""

from prepfuse.fx_passes.rewrite import by_layer, compare, emitter, probes, scratch_buffers, search

REWRITE_MODULES = (probes, compare, search, emitter, scratch_buffers, by_layer)

__all__ = ["REWRITE_MODULES"]
