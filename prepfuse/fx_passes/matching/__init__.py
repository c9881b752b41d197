"""What every fusion family shares to find a region: by what it writes, down to the
projection columns and the operands its math reads.

- ``nodes.py``: what a node is (op, fake value, sizes compared without guards, source line);
- ``canonical.py``: one form per concept, the graph pass before any family (its rule of one
  write per piece in ``written_pieces.py``);
- ``writes.py``: every cache write as rows written at indices (``RowsWrite``), byte rows;
- ``engine_writes.py``: an engine's declared cache-write op, lifted into that form for probing;
- ``layouts.py``, ``axes.py``: logical axes through views and per-head steps;
- ``regions.py``: a region's nodes back to its leaves, its operands and constants;
- ``sources.py``: the projection columns written values come from;
- ``head_copies.py``: a copy of heads a projection lays out strided apart, which a call can read;
- ``rope_operands.py``: the cos/sin a call reads, however the model makes them.

Which call computes a region, and how it goes into the graph, is ``fx_passes/rewrite``'s.
A family (``fusion/<family>.py``) borrows from both, never from another family.
``MATCHING_MODULES`` (and rewrite's ``REWRITE_MODULES``) list these modules for the passes'
uuids: editing one invalidates Inductor's cache for every pass that uses it.
"""

from prepfuse.fx_passes.matching import (
    axes, canonical, engine_writes, head_copies, layouts, nodes, op_references, regions, rope_operands, sources,
    writes, written_pieces,
)

MATCHING_MODULES = (nodes, canonical, writes, engine_writes, op_references, layouts, axes, regions, sources,
                    head_copies, rope_operands, written_pieces)

__all__ = ["MATCHING_MODULES"]
