"""Everything that differs between the torch and triton versions prepfuse supports.

prepfuse supports torch 2.11 through 2.15 (CI runs 2.13, 2.14 and 2.15 on the CPU, the
GPU machine 2.11 with triton 3.6). Any API that moved between those versions is gated here, once,
so the rest of the package reads as if there were one torch.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether triton can be imported at all (it is absent on macOS and Windows)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpret_mode() -> bool:
    """Whether triton kernels run on the CPU through its interpreter.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so this must be set
    before prepfuse is imported; the test suite's conftest does that on CPU machines.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def auto_functionalized_ops() -> tuple[object, object | None]:
    """The ``auto_functionalized`` and ``auto_functionalized_v2`` higher-order ops.

    v2 exists in every supported torch, but engines pinned to older torch still meet v1
    graphs, so callers treat v2 as optional.
    """
    from torch._higher_order_ops import auto_functionalize as af

    return af.auto_functionalized, getattr(af, "auto_functionalized_v2", None)


def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Make ``torch.compile(backend=name)`` find ``compiler_fn``; safe to call repeatedly.

    prepfuse also declares the backend as a ``torch_dynamo_backends`` entry point. When
    Dynamo has already read the entry points, it loads the backend from there (and
    registers it itself: registering it here too would be a duplicate name), so this only
    registers when no entry point is known, e.g. from a source tree that is not installed.
    """
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if registry._COMPILER_FNS.get(name) is compiler_fn:
        return
    if name in registry._COMPILER_FNS:  # a reloaded module: replace the stale function
        registry._COMPILER_FNS[name] = compiler_fn
        compiler_fn._tags = ()
        return
    if isinstance(registry._BACKENDS.get(name), EntryPoint):
        return
    registry.register_backend(compiler_fn=compiler_fn, name=name)


def current_compile_id() -> str | None:
    """Dynamo's id of the frame being compiled ("0/0"), or None outside a Dynamo compile."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - a missing id only costs a label
        return None
    return None if compile_id is None else str(compile_id)


def inductor_mode_options(mode: str | None) -> dict:
    """Inductor config patches of a ``torch.compile`` mode ("max-autotune" ...)."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_config_keys() -> frozenset[str]:
    """Every Inductor config name, dotted for nested ones ("triton.cudagraphs")."""
    import torch._inductor.config as inductor_config

    return frozenset(inductor_config.get_config_copy())


def functionalization_special_tags() -> frozenset:
    """Op tags that make functionalization use its special out/inplace handling.

    ``torch.Tag.out`` and ``torch.Tag.inplace`` are absent from torch 2.11's Tag enum;
    only the ones this torch has are returned.
    """
    return frozenset(tag for tag in (getattr(torch.Tag, "out", None), getattr(torch.Tag, "inplace", None)) if tag is not None)


# Inductor names forbidden inside CUDA graphs, for torch builds whose ``torch._inductor.utils``
# does not list them (the list there is the authority when it exists).
_FALLBACK_FORBIDDEN_CUDAGRAPH_OPS = frozenset({
    "aten._local_scalar_dense",
    "aten._assert_scalar",
    "run_and_save_rng_state",
    "run_with_rng_state",
})


@functools.lru_cache(maxsize=None)
def cudagraph_forbidden_ops() -> frozenset[str]:
    """Targets (as ``str(target)``) Inductor never lets into a CUDA graph (host syncs, RNG state)."""
    from torch._inductor import utils

    return frozenset(getattr(utils, "FORBIDDEN_CUDAGRAPH_OPS", _FALLBACK_FORBIDDEN_CUDAGRAPH_OPS))


def cudagraph_unsafe_tag():
    """``torch.Tag.cudagraph_unsafe`` (ops Inductor always partitions around), or None."""
    return getattr(torch.Tag, "cudagraph_unsafe", None)


def graph_partition_patches(splitting_ops: tuple[str, ...]) -> dict:
    """Inductor config for one compile that partitions the graph at ``splitting_ops`` and
    captures every other partition with cudagraph trees.

    ``custom_should_partition_ops`` (torch 2.10+) is a per-compile config key; torch 2.9's
    ``register_should_partition_rule`` is a process-wide registry, which a backend must not
    touch, so older torch is refused rather than patched globally.

    Inductor's two scheduler reorders that move nodes across a splitting op are turned
    off, so that its partitions follow the graph order prepfuse's placement pass chose and
    reports: the partition-reducing reorder (gated on a peak-memory estimate, it runs
    ready eager ops first and renumbers partitions) and the peak-memory reorder (seen on
    torch 2.13 moving a fused prep call, with its q_out allocation, from before the
    attention op to after it). The cost is the peak-memory reorder's saving, if any, for
    this compile.
    """
    keys = inductor_config_keys()
    if "custom_should_partition_ops" not in keys:
        raise RuntimeError(
            f"cudagraphs='piecewise' needs torch._inductor.config.custom_should_partition_ops "
            f"(torch 2.10+); torch {torch.__version__} does not have it"
        )
    patches = {
        "graph_partition": True,
        "custom_should_partition_ops": list(splitting_ops),
        "triton.cudagraphs": True,
        "triton.cudagraph_trees": True,
    }
    for key in ("triton.reorder_for_reducing_graph_partitions", "reorder_for_peak_memory"):
        if key in keys:
            patches[key] = False
    return patches


def static_input_indices() -> tuple[frozenset[int], int] | None:
    """(indices of the static inputs, number of inputs) of the graph AOTAutograd is compiling.

    Static inputs (parameters, buffers, tensors given to ``torch._dynamo.mark_static_address``)
    keep their address across calls; cudagraph trees let a captured graph write only those.
    Read from the tracing context's forward metadata; None outside a compile.
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    indices = getattr(metadata, "static_input_indices", None)
    if metadata is None or indices is None:
        return None
    return frozenset(indices), len(metadata.input_info)


def register_unpooled_fallback(op) -> None:
    """Lower ``op`` in Inductor as an extern call whose output buffer is never reused.

    Inductor reuses a dead buffer's memory for a later buffer of the same size (and lets
    a pointwise kernel write in place into a dead input). For an op whose output is a
    view of persistent memory shared with other calls (``prepfuse::scratch``), that
    would let Inductor's own buffers overwrite bytes another handout owns. The output is
    therefore added to ``V.graph.never_reuse_buffers`` (present, with the same meaning,
    in torch 2.11 through 2.14). Safe to call more than once.
    """
    from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
    from torch._inductor.virtualized import V

    if getattr(lowerings.get(op), "_prepfuse_unpooled", False):
        return  # already ours (a plain fallback Inductor made for an earlier graph is replaced)
    fallback = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def _lower(*args, **kwargs):
        out = fallback(*args, **kwargs)
        V.graph.never_reuse_buffers.add(out.get_name())
        return out

    lowerings[op]._prepfuse_unpooled = True


def inductor_reads_inputs_when_it_runs(target) -> bool:
    """Whether Inductor lowers calls of ``target`` so that they read their inputs when
    they run, from realized buffers: an extern or fallback kernel (no lowering, or a
    fallback handler: custom ops, unlowered aten ops) or a matmul (Inductor realizes its
    inputs for the extern call or template). Anything else may be inlined lazily into a
    later kernel, which then reads the inputs at *its* position in the schedule.
    """
    from torch._inductor.lowering import lowerings

    aten = torch.ops.aten
    if target in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default):
        return True
    lowering = lowerings.get(target)
    return lowering is None or getattr(lowering, "_is_fallback_handler", False)


# values past e4m3fn's largest (448), and the codes each known cast gives them
E4M3_OVERFLOW_PROBE = (448.0, 464.0, 465.0, 479.0, 480.0, float("inf"), -465.0, -1e4)
E4M3_OVERFLOW_CODES = {
    "saturate": (0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE),  # +-448, as clamp(-448, 448) first
    # c10's fp8e4m3fn_from_fp32_value: round to nearest even onto a grid whose step past 448
    # is the NaN code, so |x| > 464 (the tie goes to the even 448) is NaN with its sign
    "nan": (0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0xFF),
}


@functools.lru_cache(maxsize=None)
def e4m3_cast_overflow(device_type: str) -> str | None:
    """What torch's own cast to float8_e4m3fn on ``device_type`` makes of values past 448:
    ``"saturate"`` (+-448, as ``clamp(-448, 448)`` before the cast would), ``"nan"`` (the NaN
    code with the value's sign where ``|x| > 464``), or None for anything else or where the
    device cannot cast.

    It differs by version and device: torch 2.13's CPU cast saturates; torch 2.11's CUDA
    cast (c10's ``fp8e4m3fn_from_fp32_value``) gives NaN. A bare ``(k / s).to(e4m3)``
    (SGLang's and vLLM's ``forward_native`` spelling) is the op with ``fp8_saturate`` as this
    says. Decided by casting ``E4M3_OVERFLOW_PROBE`` once on the device, not by version."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad():
            probe = torch.tensor(E4M3_OVERFLOW_PROBE, device=device_type)
            codes = tuple(probe.to(torch.float8_e4m3fn).view(torch.uint8).tolist())
    except Exception as err:  # noqa: BLE001 - no device to cast on: nothing is assumed
        logging.getLogger("prepfuse").warning(
            "cannot cast on %s to see what e4m3 casts make of values past 448 (%s: %s)",
            device_type, type(err).__name__, err)
        return None
    found = next((name for name, known in E4M3_OVERFLOW_CODES.items() if codes == known), None)
    if found is None:
        logging.getLogger("prepfuse").warning(
            "torch %s's e4m3 cast on %s makes %s of %s: neither saturating nor c10's NaN past 464",
            torch.__version__, device_type, [hex(c) for c in codes], E4M3_OVERFLOW_PROBE)
    return found


def golden_rotary_graph_suffix() -> str | None:
    """The suffix of the corpus golden graph recorded for this torch, or None where none is.

    Hugging Face's rotary module, whose compute the graph keeps for Inductor, decomposes
    differently by version: torch 2.13 writes ``inv_freq @ positions`` as a broadcast
    ``mul`` and keeps ``cos * attention_scaling`` (a ``mul`` by 1.0): the plain golden;
    torch 2.14 drops that ``mul`` (``_torch2.14``); torch 2.11 keeps a ``bmm`` (not
    recorded). Only the golden print depends on it: the fused part is the same on every
    version."""
    return {(2, 13): "", (2, 14): "_torch2.14"}.get(TORCH_VERSION)


def post_grad_hook_takes_list() -> bool:
    """Whether Inductor's ``post_grad_custom_post_pass`` takes a list of passes (it reads it
    through ``custom_graph_pass.get_custom_graph_passes``, torch 2.13 on) or one pass only."""
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


def compiling_a_training_graph() -> bool:
    """Whether the graph being compiled belongs to a training step: AOTAutograd traced a
    backward for it (grad mode on and an input or parameter requiring grad), read from the
    compile's ``TracingContext`` (``fw_metadata.traced_tangents``, one per output a backward
    reads). Why: the forward then saves activations for a backward the fused ops do not have."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    return bool(getattr(meta, "traced_tangents", None))
