"""Pass name -> pass class, so the backend's ``passes`` option can name them.

prepfuse's own passes are listed in ``BUILTIN_PASSES`` in the order they run by default:
pattern passes first, ``defunctionalize`` last (it removes the ``auto_functionalized``
nodes the pattern passes leave). Their modules are imported lazily, the first time the
registry is read; a built-in pass whose module does not exist (yet) is simply absent.
An error *inside* an existing pass module is not hidden.

Engines add their own passes with ``register_pass`` (a class decorator); they run after
the built-in pattern passes and before ``defunctionalize``, in registration order.

``placement`` is not in the registry: it needs the backend's ``splitting_ops``, so the
backend adds it itself (``placement_position``), after every pattern pass (it must see
their fused ops) and before ``defunctionalize`` (it reads the functional graph), and
only when splitting ops are given; otherwise the pass list is as if it did not exist.
"""

from __future__ import annotations

import importlib

from prepfuse.fx_passes.base import PrepfusePass

# name -> (module, class), in default running order
BUILTIN_PASSES: dict[str, tuple[str, str]] = {
    "fuse_dsv4_prep": ("prepfuse.fx_passes.fuse_dsv4_prep", "FuseDsv4PrepPass"),
    "fuse_dsv4_indexer_prep": ("prepfuse.fx_passes.fuse_dsv4_indexer_prep", "FuseDsv4IndexerPrepPass"),
    "fuse_dsv4_indexer_mxfp4_prep": ("prepfuse.fx_passes.fuse_dsv4_indexer_mxfp4_prep", "FuseDsv4IndexerMxfp4PrepPass"),
    "fuse_gqa_prep": ("prepfuse.fx_passes.fuse_gqa_prep", "FuseGqaPrepPass"),
    "defunctionalize": ("prepfuse.fx_passes.defunctionalize", "DefunctionalizePass"),
}
LAST_PASS = "defunctionalize"
PLACEMENT_PASS = "placement"  # added by the backend, never registered

_REGISTRY: dict[str, type[PrepfusePass]] = {}
_builtins_loaded = False


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
    if name in BUILTIN_PASSES:
        raise ValueError(f"{name!r} is a built-in pass")
    _REGISTRY.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    for name, (module_name, class_name) in BUILTIN_PASSES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # the module itself is missing: not part of this build
                continue
            raise
        register_pass(getattr(module, class_name))
    _builtins_loaded = True


def registered_passes() -> dict[str, type[PrepfusePass]]:
    """Every available pass, in default running order."""
    _load_builtins()
    builtin = [n for n in BUILTIN_PASSES if n in _REGISTRY and n != LAST_PASS]
    extra = [n for n in _REGISTRY if n not in BUILTIN_PASSES]
    order = builtin + extra + ([LAST_PASS] if LAST_PASS in _REGISTRY else [])
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
