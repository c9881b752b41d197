"""Where an engine keeps a layer's k/v cache and slot mapping, found at run time by its key.

Engines such as vLLM do not pass the cache to the compiled graph: their cache-write op takes
a layer key (vLLM's ``layer_name``) and finds the cache and the slots of the current step
itself. The by-layer ops (``gqa_qknorm_rope_kv_insert_by_layer``) do the same through the
resolver the engine registered here under its name, so one compiled graph serves every step
and every layer whose key it is handed. The compile-time half of an engine's declaration
(which op writes, its cache layout) is ``prepfuse.fx_passes.matching.engine_writes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["EngineCaches", "register_resolver", "resolve", "resolver_names"]


@dataclass(frozen=True)
class EngineCaches:
    """One layer's caches for this step: ``k_cache`` and ``v_cache`` ``[NB, BS, Hkv, D]``
    views (any strides, last dim dense) and ``slot_mapping`` ``[T']`` (slot ``s`` at block
    ``s // BS``, row ``s % BS``; negative skips), as the GQA op takes them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


# engine name (its cache-write op, "ns::op.overload") -> key -> caches, or None where the
# engine writes nothing this step (vLLM's profiling run has no slot mapping)
_RESOLVERS: dict[str, Callable[[object], EngineCaches | None]] = {}


def register_resolver(engine: str, resolver: Callable[[object], EngineCaches | None]) -> None:
    """Make ``engine``'s caches reachable by key; a second registration replaces the first."""
    _RESOLVERS[engine] = resolver


def resolver_names() -> tuple[str, ...]:
    return tuple(_RESOLVERS)


def resolve(engine: str, key) -> EngineCaches | None:
    """``engine``'s caches for ``key`` now; ValueError naming ``engine`` where none is registered."""
    if engine not in _RESOLVERS:
        raise ValueError(f"engine: no cache resolver is registered for {engine!r} (registered: "
                         f"{sorted(_RESOLVERS) or 'none'}); prepfuse.fx_passes.matching.engine_writes."
                         "register_engine_write declares one")
    return _RESOLVERS[engine](key)
