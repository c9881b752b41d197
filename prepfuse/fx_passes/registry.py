"""Which passes a compile runs: prepfuse's own by default, an engine's only where named.

prepfuse's own passes are ``BUILTIN_PASSES``, in the order they run by default
(``default_passes()``): the fusion passes first, ``defunctionalize`` last (it removes the
``auto_functionalized`` nodes the fusion passes leave).

An engine's pass runs only in the compiles whose ``passes`` option names it, never in
another: the option takes a ``PrepfusePass`` subclass or instance directly
(``default_passes(MyPass)`` puts it after prepfuse's fusion passes and before
``defunctionalize``), or the name of a class given to ``register_pass``. Registering only
makes the name known; it adds the pass to no compile.

``placement`` is not in the registry: it needs the backend's ``splitting_ops``, so the
backend adds it itself (``placement_position``), after every fusion pass (it must see
their fused ops) and before ``defunctionalize`` (it reads the functional graph), and
only when splitting ops are given; otherwise the pass list is as if it did not exist.
"""

from __future__ import annotations

from typing import Union

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

# what the ``passes`` option holds: a name, a pass class, or a pass instance
PassEntry = Union[str, type[PrepfusePass], PrepfusePass]

_REGISTRY: dict[str, type[PrepfusePass]] = {}


def register_pass(cls: type[PrepfusePass]) -> type[PrepfusePass]:
    """Make ``cls`` nameable as ``cls.name`` in the ``passes`` option (a class decorator).

    It runs only in compiles that name it, never by default; giving the class itself in
    ``passes`` needs no registration. Registering the same class twice is a no-op.
    """
    _check_pass_class(cls, "register_pass")
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


def default_passes(*extra: PassEntry) -> tuple[PassEntry, ...]:
    """prepfuse's own passes in running order, with ``extra`` (an engine's passes: classes,
    instances or registered names) after the fusion passes and before ``defunctionalize``:
    ``options={"passes": default_passes(MyPass)}``. Without ``extra``: what a compile runs
    when ``passes`` is not given."""
    builtin = tuple(p.name for p in BUILTIN_PASSES if p.name != LAST_PASS)
    return (*builtin, *extra, LAST_PASS)


def registered_passes() -> dict[str, type[PrepfusePass]]:
    """Every pass ``passes`` can name: the built-in fusion passes, the registered ones, then
    ``defunctionalize`` (the order they would run in if all were named)."""
    builtin = [p.name for p in BUILTIN_PASSES if p.name != LAST_PASS]
    extra = [n for n in _REGISTRY if n not in _BUILTIN_NAMES]
    order = builtin + extra + [LAST_PASS]
    return {name: _REGISTRY[name] for name in order}


def get_pass(name: str) -> type[PrepfusePass]:
    passes = registered_passes()
    if name == PLACEMENT_PASS:
        raise ValueError(f"{PLACEMENT_PASS!r} is not named in passes: the backend adds it when splitting_ops are given")
    if name not in passes:
        raise ValueError(f"unknown prepfuse pass {name!r}; available: {', '.join(passes) or '(none)'} (or give the "
                         f"PrepfusePass class or instance itself)")
    return passes[name]


def pass_name(entry: PassEntry) -> str:
    """The name a ``passes`` entry runs under; ValueError for anything that is not a pass."""
    if isinstance(entry, str):
        return get_pass(entry).name
    if isinstance(entry, PrepfusePass):
        _check_pass_class(type(entry), "passes")
        return entry.name
    if isinstance(entry, type) and issubclass(entry, PrepfusePass):
        _check_pass_class(entry, "passes")
        return entry.name
    raise ValueError(f"passes: expected pass names, PrepfusePass subclasses or PrepfusePass instances, got {entry!r}")


def placement_position(passes: list[str]) -> int:
    """Where the ``placement`` pass goes in ``passes`` (names): before ``defunctionalize``, else last."""
    return passes.index(LAST_PASS) if LAST_PASS in passes else len(passes)


def _check_pass_class(cls, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, PrepfusePass)):
        raise TypeError(f"{where} expects a PrepfusePass subclass, got {cls!r}")
    if cls.name == PLACEMENT_PASS:
        raise ValueError(f"{PLACEMENT_PASS!r} is the backend's own pass (set splitting_ops); choose another name")


for _builtin in BUILTIN_PASSES:
    register_pass(_builtin)
