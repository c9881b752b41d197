"""``prepfuse::scratch``: a view of a named scratch-arena reservation, as a graph node.

Schema::

    scratch(str name, SymInt[] shape, ScalarType dtype, Device device) -> Tensor

returns ``current_arena().take(name, shape, dtype, device)``: a contiguous view of
memory reserved before the KV cache was sized (``prepfuse/scratch/arena.py``), with no
allocation once the arena is frozen. Passes emit it where they need an output buffer
(the fused ops' ``q_out``) instead of an ``aten.empty``.

What the compiler stack assumes about its output, and why that holds:

- *Functionalization / AOTAutograd* see a fresh tensor: the op has no tensor inputs, so
  its output cannot alias one, and the fake impl returns a new ``empty``. The pass emits
  it after functionalization anyway; the fused op then writes it through
  ``auto_functionalized`` like any buffer, and is made in place by ``defunctionalize``
  (or Inductor's reinplacing: the node has no other reader).
- *Inductor* would treat the output as a buffer it may reuse for a later, same-sized
  buffer (or write in place into) once the scratch is dead in the graph. Its bytes are
  shared with every other handout of the name, so ``ensure_inductor_lowering`` lowers it
  to an extern call whose buffer is never reused. ``emit_scratch`` calls it, i.e. when a
  pass first emits the op (Inductor is loaded by then; ``import prepfuse`` does not
  import Inductor's lowering machinery). Code that calls the op itself inside
  ``torch.compile`` calls ``ensure_inductor_lowering()`` first.
- *Graph outputs.* A graph may return the view (the padded q handed to an attention
  op outside the graph, as piecewise engines do). Like a cudagraph-trees output, it is
  valid until the next handout of the same name, i.e. until the compiled code runs
  again. Inside one graph a second call writes an earlier call's buffer only through
  the value that call wrote, so Inductor sees the aliasing, and only when nothing
  returns or later reads it (``prepfuse/fx_passes/rewrite/scratch_buffers.py``); otherwise it
  takes another name.
- *CUDA graphs.* The view is persistent storage, so a captured graph replays into the
  same bytes; the arena never frees storage a capture took (``arena.py``), and after
  ``freeze()`` every call gets the same address.
"""

from __future__ import annotations

import torch

from prepfuse._compat import register_unpooled_fallback
from prepfuse.ops._library import define_op
from prepfuse.scratch.arena import check_shape
from prepfuse.scratch.current import current_arena

SCHEMA = "scratch(str name, SymInt[] shape, ScalarType dtype, Device device) -> Tensor"


def scratch_reference(name: str, shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every device: the current arena's view (the arena checks the arguments)."""
    return current_arena().take(name, shape, dtype, device)


def _scratch_fake(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    check_shape(shape)
    return torch.empty(shape, dtype=dtype, device=device)


SCRATCH = define_op(SCHEMA, reference=scratch_reference, fake=_scratch_fake).default


def ensure_inductor_lowering() -> None:
    """Lower ``SCRATCH`` in Inductor as an extern call whose buffer is never reused (once)."""
    register_unpooled_fallback(SCRATCH)
