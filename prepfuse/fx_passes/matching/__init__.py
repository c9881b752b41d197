"""What every fusion family shares: reading preparation math back out of a post-grad graph,
and emitting the fused call.

- ``recognizers.py``: one small matcher per step (norm, RoPE, gathers, slices, view chains),
  each returning the step's inputs or raising ``NoMatch`` with what it found instead;
- ``layouts.py``: logical axes through views (``[B, S, H, D]``, transposes, a batch of one):
  which elements of a base a chain of view ops shows;
- ``cos_sin.py``: where a rotation's cos/sin come from, and the table the op reads instead;
- ``cache_writes.py``: paged byte-cache writes read back to their layout, and the write of a
  data row's scale bytes;
- ``repeated_steps.py``: one node per computation (repeated pure steps merged before matching);
- ``emitter.py``: what every rewrite inserts (fake values, the functional call);
- ``scratch_buffers.py``: output buffers from the scratch arena.

A family (``fusion/<family>.py``) borrows from here, never from another family.
``MATCHING_MODULES`` lists these modules for the passes' uuids: editing one invalidates
Inductor's cache for every pass that uses it.
"""

from prepfuse.fx_passes.matching import (
    cache_writes, cos_sin, emitter, layouts, recognizers, repeated_steps, scratch_buffers, validation,
)

MATCHING_MODULES = (recognizers, layouts, cos_sin, cache_writes, repeated_steps, emitter, scratch_buffers, validation)

__all__ = ["MATCHING_MODULES", "cache_writes", "cos_sin", "emitter", "layouts", "recognizers", "repeated_steps", "scratch_buffers", "validation"]
