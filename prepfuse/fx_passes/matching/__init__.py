"""What every fusion family shares: finding a region by what it writes, and deciding on
probes which op call computes it.

- ``nodes.py``: what a node is (op, fake value, sizes compared without guards, source line);
- ``canonical.py``: one form per concept, the graph pass before any family;
- ``writes.py``: every cache write as rows written at indices (``RowsWrite``), byte rows;
- ``layouts.py``, ``axes.py``: logical axes through views and per-head steps;
- ``regions.py``: a region's nodes back to its leaves, its operands and constants;
- ``sources.py``: the projection columns written values come from;
- ``head_copies.py``: a copy of heads a projection lays out strided apart, which a call can read;
- ``rope_operands.py``: the cos/sin a call reads, however the model makes them;
- ``probes.py``, ``compare.py``: probe values, the region run once, candidates compared;
- ``search.py``: candidate calls tried on the probes, the first that agrees kept;
- ``emitter.py``: what every rewrite inserts (fake values, the functional call);
- ``scratch_buffers.py``: output buffers from the scratch arena.

A family (``fusion/<family>.py``) borrows from here, never from another family.
``MATCHING_MODULES`` lists these modules for the passes' uuids: editing one invalidates
Inductor's cache for every pass that uses it.
"""

from prepfuse.fx_passes.matching import (
    axes, canonical, compare, emitter, head_copies, layouts, nodes, probes, regions, rope_operands, scratch_buffers, search,
    sources, writes,
)

MATCHING_MODULES = (nodes, canonical, writes, layouts, axes, regions, sources, head_copies, rope_operands, probes, compare,
                    search, emitter, scratch_buffers)

__all__ = ["MATCHING_MODULES"]
