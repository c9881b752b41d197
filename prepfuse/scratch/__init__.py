"""Reserved scratch memory for fused ops' outputs: the arena, and which one is current.

``ScratchArena`` (``arena.py``) holds named reservations and hands out views;
``micro_batch`` gives a micro-batch (and every thread) storage of its own;
``current_arena`` / ``use_arena`` (``current.py``) say which arena the
``prepfuse::scratch`` op (``prepfuse/ops/scratch.py``) takes from. Passes emit that op
with ``prepfuse.fx_passes.rewrite.scratch_buffers.scratch_buffer``. The contract is in
``docs/cudagraphs.md``.
"""

from prepfuse.scratch.arena import Reservation, ScratchArena, current_lane, micro_batch
from prepfuse.scratch.current import current_arena, default_arena, use_arena

__all__ = ["Reservation", "ScratchArena", "current_arena", "current_lane", "default_arena", "micro_batch", "use_arena"]
