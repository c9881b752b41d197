"""Which arena ``prepfuse::scratch`` hands views out of.

The op runs inside compiled code, which has no argument to pass an arena through, so
the arena is the process's *current* one: a default arena, or the one an engine (or a
test) installs with ``use_arena``. An engine normally keeps the default and calls
``current_arena().freeze()`` after its profiling run.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from prepfuse.scratch.arena import ScratchArena

_DEFAULT = ScratchArena()
_installed: list[ScratchArena] = []
_lock = threading.Lock()


def current_arena() -> ScratchArena:
    """The arena ``prepfuse::scratch`` uses now: the innermost ``use_arena``, else the default."""
    return _installed[-1] if _installed else _DEFAULT


def default_arena() -> ScratchArena:
    """The process-wide arena used when no ``use_arena`` is active."""
    return _DEFAULT


@contextlib.contextmanager
def use_arena(arena: ScratchArena) -> Iterator[ScratchArena]:
    """Make ``arena`` the current arena (for every thread) inside the ``with`` block.

    Process-wide rather than thread-local: compiled code may run on another thread than
    the one that set up the arena, and it must find the same bytes.
    """
    if not isinstance(arena, ScratchArena):
        raise ValueError(f"arena: expected a ScratchArena, got {type(arena).__name__}")
    with _lock:
        _installed.append(arena)
    try:
        yield arena
    finally:
        with _lock:  # the innermost entry of this arena: use_arena(A), use_arena(B), use_arena(A) nest
            del _installed[len(_installed) - 1 - _installed[::-1].index(arena)]
