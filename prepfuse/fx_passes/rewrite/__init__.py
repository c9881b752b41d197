"""What emits and validates a rewrite, for every fusion family: candidate calls run against
the region they would replace, on probes, and the one that agrees put into the graph.

- ``probes.py``, ``compare.py``: probe values, the region run once, candidates compared;
- ``search.py``: candidate calls tried on the probes, the first that agrees kept (or a
  rival rounding of it closer to the code's values);
- ``emitter.py``: what every rewrite inserts (fake values, the functional call);
- ``cache_views.py``: a rows write's paged cache as a call writes it, and each token's slot;
- ``scratch_buffers.py``: output buffers from the scratch arena;
- ``by_layer.py``: a fused engine write's call in the engine's by-layer form.
"""

from prepfuse.fx_passes.rewrite import by_layer, cache_views, compare, emitter, probes, scratch_buffers, search

REWRITE_MODULES = (probes, compare, search, emitter, scratch_buffers, cache_views, by_layer)

__all__ = ["REWRITE_MODULES"]
