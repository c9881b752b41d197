"""The ``prepfuse`` operator namespace and the once-per-process registration of its ops.

Every op is defined from an exact schema string (with labelled alias annotations such
as ``Tensor(a!) q_out``) rather than inferred from a Python signature: the schema is the
contract that functionalization, the FX passes and the drift test all read, so it is
written out where a reviewer can see it.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch

from prepfuse._compat import has_triton
from prepfuse.ops._checks import check_written_apart

NAMESPACE = "prepfuse"
# the overload of an op with ``float`` arguments that takes each as a one-value CPU tensor
TENSOR_FLOATS = "tensor_floats"
_FLOAT_TYPES = ("float", "Optional[float]")
log = logging.getLogger("prepfuse.ops")

# One fragment per namespace (prepfuse's own, and an engine integration's); ops add their
# definitions to it.
_LIBS = {NAMESPACE: torch.library.Library(NAMESPACE, "FRAGMENT")}


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBS:
        _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBS[namespace]


@dataclass(frozen=True)
class DefinedOp:
    """An op registered by ``define_op``: its packet, and its checked implementations as
    plain functions (tests and benchmarks call the reference directly)."""

    packet: torch._ops.OpOverloadPacket
    reference: Callable  # checks, index checks, then the plain-PyTorch math (every device)
    fake: Callable  # checks only (shapes may be symbolic)

    @property
    def default(self) -> torch._ops.OpOverload:
        return self.packet.default


def define_op(
    schema: str,
    *,
    reference: Callable,
    check: Callable | None = None,
    index_check: Callable | None = None,
    triton: Callable | None = None,
    fake: Callable | None = None,
    namespace: str = NAMESPACE,
) -> DefinedOp:
    """Register ``<namespace>::<schema>`` (``prepfuse::`` unless an integration names its
    own) once per process; build every impl from the checks.

    ``check`` validates dtypes, shapes, devices and strides (ValueError naming the
    argument) and runs first in every impl, the fake one included; ``index_check`` reads
    slot and position values (eager only: never in the fake impl). Each is called with the
    schema arguments it names as parameters, by keyword, so no impl restates the op's
    argument list. ``reference`` (the plain-PyTorch math, every device, registered as
    CompositeExplicitAutograd) and ``triton`` (the CUDA path) take the schema's arguments
    positionally and need not check anything. Where triton cannot be imported, CUDA runs
    the reference, with one WARNING per op. A second import of the defining module (e.g.
    through importlib.reload) finds the op already there and checks the schema is unchanged
    instead of failing with a duplicate registration.

    ``fake`` replaces the checks-only fake impl, for an op that returns a tensor (its fake
    must make one: ``prepfuse::scratch``).
    """
    name = schema.split("(", 1)[0]
    qualname = f"{namespace}::{name}"
    parsed = torch._C.parse_schema(f"{namespace}::{schema}").arguments
    arg_names = [a.name for a in parsed]
    written = [a.name for a in parsed if a.alias_info is not None and a.alias_info.is_write]
    defaults = {a.name: a.default_value for a in parsed if a.has_default_value()}
    checked_reference = _checked(qualname, arg_names, check, index_check, reference, written, defaults)
    fake = fake or _checked(qualname, arg_names, check, None, None, written, defaults)
    packet = lambda: getattr(getattr(torch.ops, namespace), name)  # noqa: E731
    if _is_defined(qualname):
        existing = str(packet().default._schema)
        expected = f"{namespace}::{schema}"
        if existing != expected:
            raise RuntimeError(
                f"{qualname} is already registered with schema {existing!r}; "
                f"this process asked for {expected!r}"
            )
        return DefinedOp(packet(), checked_reference, fake)
    lib = _library(namespace)
    lib.define(schema)
    lib.impl(name, checked_reference, "CompositeExplicitAutograd")
    lib.impl(name, _not_differentiable(qualname, arg_names), "Autograd")
    if triton is not None:
        cuda = _checked(qualname, arg_names, check, index_check, triton, written, defaults) if has_triton() else \
            _reference_with_warning(qualname, checked_reference)
        lib.impl(name, cuda, "CUDA")
    torch.library.register_fake(qualname, fake, lib=lib)
    floats = [a.name for a in parsed if str(a.type) in _FLOAT_TYPES]
    if floats:
        _define_tensor_floats(lib, schema, qualname, floats, fake)
    return DefinedOp(packet(), checked_reference, fake)


def _define_tensor_floats(lib, schema: str, qualname: str, floats: list[str], fake: Callable) -> None:
    """``<op>.tensor_floats``: the op's schema with each ``float`` a ``Tensor`` (a one-value
    float tensor on the CPU, read on the host when the op runs), forwarding to the default
    overload. A Python float that ``torch.compile(dynamic=True)`` made a graph input (an eps,
    under Dynamo's default ``specialize_float=False``) is such a tensor: a fused call reads
    it at run time instead of taking the value it had when traced."""
    name, rest = schema.split("(", 1)
    if re.search(r"\bfloat\??\s+\w+=(?!None)", rest):
        raise TypeError(f"{qualname}: a float argument with a default other than None has no tensor form")
    rest = re.sub(r"\bfloat(\??)\s+(\w+)", r"Tensor\1 \2", rest)
    overload = f"{name}.{TENSOR_FLOATS}"
    lib.define(f"{overload}({rest}")
    arg_names = [a.name for a in torch._C.parse_schema(f"x::{overload}({rest}").arguments]
    namespace, op_name = qualname.split("::")

    def default_op():
        return getattr(getattr(torch.ops, namespace), op_name).default

    def on_host(args, kwargs, read: bool) -> dict:
        named = dict(zip(arg_names, args), **kwargs)
        for arg in floats:
            value = named.get(arg)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.dtype.is_floating_point \
                    or value.device.type != "cpu":
                got = (f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
                       if isinstance(value, torch.Tensor) else type(value).__name__)
                raise ValueError(f"{arg}: {qualname}.{TENSOR_FLOATS} takes it as a one-value float tensor on the "
                                 f"CPU, got {got}")
            # the fake impl cannot read a value: the checks see 0.0, the run checks the real one
            named[arg] = float(value) if read else 0.0
        return named

    lib.impl(overload, lambda *args, **kwargs: default_op()(**on_host(args, kwargs, read=True)),
             "CompositeExplicitAutograd")
    lib.impl(overload, _not_differentiable(qualname, arg_names, TENSOR_FLOATS), "Autograd")
    torch.library.register_fake(f"{qualname}.{TENSOR_FLOATS}",
                                lambda *args, **kwargs: fake(**on_host(args, kwargs, read=False)), lib=lib)


def float_args(op: torch._ops.OpOverload) -> list[str]:
    """The names of ``op``'s ``float`` and ``float?`` arguments, in schema order."""
    return [a.name for a in op._schema.arguments if str(a.type) in _FLOAT_TYPES]


def tensor_floats_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op``'s ``tensor_floats`` overload (its floats taken as one-value CPU tensors), or None
    where the op has no float argument."""
    packet = op.overloadpacket
    return getattr(packet, TENSOR_FLOATS) if TENSOR_FLOATS in packet.overloads() else None


def floats_as_tensors(op: torch._ops.OpOverload, args: tuple) -> tuple:
    """``args`` of ``op`` (positional) as its ``tensor_floats`` overload takes them: each float
    a 0-d float64 CPU tensor, as ``torch.compile(dynamic=True)`` makes a Python float a graph
    input. Why: tests and engine kits sample the overload from the default's inputs."""
    floats = set(float_args(op))
    names = [a.name for a in op._schema.arguments]
    return tuple(torch.tensor(a, dtype=torch.float64) if i < len(names) and names[i] in floats and a is not None
                 else a for i, a in enumerate(args))


def _checked(qualname: str, arg_names: list[str], check: Callable | None, index_check: Callable | None,
             impl: Callable | None, written: list[str] = (), defaults: dict | None = None) -> Callable:
    """``impl(*args)`` after ``check``, the aliasing check of the ``written`` arguments
    (``_checks.check_written_apart``) and ``index_check``, each given the arguments it names.
    Arguments the schema gives a default (an operand added later, such as the GQA ops'
    ``full_cos_sin``) may be left out by a caller; every impl still gets all of them."""
    defaults = dict(defaults or {})
    shape_checks = [(check, list(inspect.signature(check).parameters))] if check is not None else []
    value_checks = [(index_check, list(inspect.signature(index_check).parameters))] if index_check is not None else []
    for fn, wanted in shape_checks + value_checks:
        unknown = set(wanted) - set(arg_names)
        if unknown:
            raise TypeError(f"{qualname}: {fn.__name__} takes {sorted(unknown)}, which the schema does not have")
    written = list(written)

    def run(*args, **kwargs):
        named = dict(zip(arg_names, args), **kwargs)
        for key, value in defaults.items():
            named.setdefault(key, value)
        if len(args) > len(arg_names) or set(named) != set(arg_names):
            raise TypeError(f"{qualname}: expected the arguments ({', '.join(arg_names)}), "
                            f"got {len(args)} positional and {sorted(kwargs)}")
        for fn, wanted in shape_checks:
            fn(**{p: named[p] for p in wanted})
        if written:  # after the shape checks, before any index value is read
            check_written_apart(named, written)
        for fn, wanted in value_checks:
            fn(**{p: named[p] for p in wanted})
        return impl(*(named[n] for n in arg_names)) if impl is not None else None

    run.__name__ = f"{qualname.split('::')[1]}_{getattr(impl, '__name__', 'fake')}"
    return run


def _not_differentiable(qualname: str, arg_names: list[str], overload: str = "default") -> Callable:
    """The ops' autograd kernel, one for every device: an inference op writes its outputs in
    place and has no backward, so a call that autograd would have to record (grad mode on,
    an input that requires grad) is a RuntimeError naming that input; any other call goes on
    below autograd. Without it the CPU reference was recorded as differentiable and the
    CUDA kernel was not: one model, two behaviours."""
    packet = None

    def autograd(*args, **kwargs):
        nonlocal packet
        if torch.is_grad_enabled():
            named = dict(zip(arg_names, args), **kwargs)
            for arg, value in named.items():
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    raise RuntimeError(
                        f"{qualname}: {arg} requires grad; the op is not differentiable (it writes "
                        "its outputs in place for inference): call it under torch.no_grad() or "
                        "torch.inference_mode(), or pass detached tensors")
        if packet is None:
            namespace, name = qualname.split("::")
            packet = getattr(getattr(torch.ops, namespace), name)
            packet = getattr(packet, overload)
        with torch._C._AutoDispatchBelowAutograd():
            return packet(*args, **kwargs)

    return autograd


def _reference_with_warning(qualname: str, reference: Callable) -> Callable:
    """The reference as the CUDA impl, saying so once: nothing silent."""
    warned = False

    def fallback(*args):
        nonlocal warned
        if not warned:
            log.warning("%s falls back to the PyTorch reference on CUDA: triton is not installed", qualname)
            warned = True
        return reference(*args)

    return fallback


def _is_defined(qualname: str) -> bool:
    return torch._C._dispatch_has_kernel(qualname) or bool(torch._C._jit_get_schemas_for_operator(qualname))


def ops_in(namespace: str) -> list[torch._ops.OpOverload]:
    """Every overload registered in ``namespace``, sorted by schema (any namespace: the
    schema drift kit, ``prepfuse.testing.drift``, reads an engine's own)."""
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith(f"{namespace}::"):
            packet = getattr(getattr(torch.ops, namespace), schema.name.split("::", 1)[1])
            ops.append(getattr(packet, schema.overload_name or "default"))
    return sorted(ops, key=lambda op: str(op._schema))


def registered_ops() -> list[torch._ops.OpOverload]:
    """Every overload in the prepfuse namespace, sorted by schema (for the drift test)."""
    return ops_in(NAMESPACE)
