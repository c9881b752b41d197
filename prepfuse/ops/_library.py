"""The ``prepfuse`` operator namespace and the once-per-process registration of its ops.

Every op is defined from an exact schema string (with labelled alias annotations such
as ``Tensor(a!) q_out``) rather than inferred from a Python signature: the schema is the
contract that functionalization, the FX passes and the drift test all read, so it is
written out where a reviewer can see it.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from prepfuse._compat import has_triton

NAMESPACE = "prepfuse"
log = logging.getLogger("prepfuse.ops")

# One fragment for the whole package; ops add their own definitions to it.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op(
    schema: str,
    *,
    reference: Callable,
    fake: Callable,
    cuda: Callable | None = None,
) -> torch._ops.OpOverloadPacket:
    """Register ``prepfuse::<schema>`` once per process and return its packet.

    ``reference`` is the plain-PyTorch implementation for every device (registered as
    CompositeExplicitAutograd, so CPU, XPU, MPS ... all reach it); ``cuda`` (the Triton
    path) overrides it on CUDA, or, where triton cannot be imported, the reference does,
    with one WARNING per op. A second import of the defining module (e.g. through importlib.reload)
    finds the op already there and checks the schema is unchanged instead of failing
    with a duplicate registration.
    """
    name = schema.split("(", 1)[0]
    if _is_defined(name):
        existing = str(getattr(torch.ops, NAMESPACE).__getattr__(name).default._schema)
        expected = f"{NAMESPACE}::{schema}"
        if existing != expected:
            raise RuntimeError(
                f"{NAMESPACE}::{name} is already registered with schema {existing!r}; "
                f"this process asked for {expected!r}"
            )
        return getattr(getattr(torch.ops, NAMESPACE), name)
    _LIB.define(schema)
    _LIB.impl(name, reference, "CompositeExplicitAutograd")
    if cuda is not None:
        _LIB.impl(name, cuda if has_triton() else _reference_with_warning(name, reference), "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def _reference_with_warning(name: str, reference: Callable) -> Callable:
    """The reference as the CUDA impl, saying so once: nothing silent."""
    warned = False

    def fallback(*args):
        nonlocal warned
        if not warned:
            log.warning("%s::%s falls back to the PyTorch reference on CUDA: triton is not installed", NAMESPACE, name)
            warned = True
        return reference(*args)

    return fallback


def _is_defined(name: str) -> bool:
    return torch._C._dispatch_has_kernel(f"{NAMESPACE}::{name}") or bool(
        torch._C._jit_get_schemas_for_operator(f"{NAMESPACE}::{name}")
    )


def registered_ops() -> list[torch._ops.OpOverload]:
    """Every overload in the prepfuse namespace, sorted by name (for the drift test)."""
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith(f"{NAMESPACE}::"):
            packet = getattr(getattr(torch.ops, NAMESPACE), schema.name.split("::", 1)[1])
            ops.append(getattr(packet, schema.overload_name or "default"))
    return sorted(ops, key=lambda op: str(op._schema))
