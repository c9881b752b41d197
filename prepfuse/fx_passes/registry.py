"""Pass name -> pass class, so the backend's ``passes`` option can name them.

prepfuse's own passes are ``BUILTIN_PASSES``, in the order they run by default: the
fusion passes first, ``defunctionalize`` last (it removes the ``auto_functionalized`` nodes
the fusion passes leave).

Engines add their own passes with ``register_pass`` (a class decorator); they run after
the built-in fusion passes and before ``defunctionalize``, in registration order.

``placement`` is not in the registry: it needs the backend's ``splitting_ops``, so the
backend adds it itself (``placement_position``), after every fusion pass (it must see
their fused ops) and before ``defunctionalize`` (it reads the functional graph), and
only when splitting ops are given; otherwise the pass list is as if it did not exist.
"""

from __future__ import annotations

from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.defunctionalize import DefunctionalizePass
from prepfuse.fx_passes.fusion.dsv4 import FuseDsv4PrepPass
from prepfuse.fx_passes.fusion.dsv4_indexer import FuseDsv4IndexerMxfp4PrepPass, FuseDsv4IndexerPrepPass
from prepfuse.fx_passes.fusion.gqa import FuseGqaPrepPass

# in default running order
BUILTIN_PASSES: tuple[type[PrepfusePass], ...] = (
    FuseDsv4PrepPass, FuseDsv4IndexerPrepPass, FuseDsv4IndexerMxfp4PrepPass, FuseGqaPrepPass, DefunctionalizePass,
)
LAST_PASS = DefunctionalizePass.name
PLACEMENT_PASS = "placement"  # added by the backend, never registered
_BUILTIN_NAMES = frozenset(p.name for p in BUILTIN_PASSES)

_REGISTRY: dict[str, type[PrepfusePass]] = {}


def register_pass(cls: type[PrepfusePass]) -> type[PrepfusePass]:
    """Register ``cls`` under ``cls.name``; registering the same class twice is a no-op."""
    if not (isinstance(cls, type) and issubclass(cls, PrepfusePass)):
        raise TypeError(f"register_pass expects a PrepfusePass subclass, got {cls!r}")
    if cls.name == PLACEMENT_PASS:
        raise ValueError(f"{PLACEMENT_PASS!r} is the backend's own pass (set splitting_ops); choose another name")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"a pass named {cls.name!r} is already registered ({existing.__module__}.{existing.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_pass(name: str) -> None:
    """Remove a pass added with ``register_pass`` (tests use this to clean up)."""
    if name in _BUILTIN_NAMES:
        raise ValueError(f"{name!r} is a built-in pass")
    _REGISTRY.pop(name, None)


def registered_passes() -> dict[str, type[PrepfusePass]]:
    """Every available pass, in default running order."""
    builtin = [p.name for p in BUILTIN_PASSES if p.name != LAST_PASS]
    extra = [n for n in _REGISTRY if n not in _BUILTIN_NAMES]
    order = builtin + extra + [LAST_PASS]
    return {name: _REGISTRY[name] for name in order}


def get_pass(name: str) -> type[PrepfusePass]:
    passes = registered_passes()
    if name == PLACEMENT_PASS:
        raise ValueError(f"{PLACEMENT_PASS!r} is not named in passes: the backend adds it when splitting_ops are given")
    if name not in passes:
        raise ValueError(f"unknown prepfuse pass {name!r}; available: {', '.join(passes) or '(none)'}")
    return passes[name]


def placement_position(passes: list[str]) -> int:
    """Where the ``placement`` pass goes in ``passes``: before ``defunctionalize``, else last."""
    return passes.index(LAST_PASS) if LAST_PASS in passes else len(passes)


for _builtin in BUILTIN_PASSES:
    register_pass(_builtin)
