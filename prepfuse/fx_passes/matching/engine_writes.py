"""Cache writes an engine makes through an op of its own, as rows written at indices.

vLLM writes a layer's k and v with ``vllm::unified_kv_cache_update(key, value, layer_name)``:
the cache and the step's slots are found at run time from the layer name, and the graph
holds neither. An engine declares such an op (``EngineWrite``, ``register_engine_write``):
which arguments are the k and v rows ``[T, Hkv, D]``, which is the layer key, the cache's
dtype and block size as known at compile time (or why they are not), and how to find the
cache and slots by key at run time (``prepfuse.ops.engine_caches``).

``lift`` gives each declared call the form the GQA family reads: probe-only graph inputs
for the k cache, the v cache and the slots, and ``cache[s // bs, s % bs] = rows`` writes of
the call's k and v rows (``writes.rows_write`` reads them as any cache write); the engine
call itself stays. The family then finds the region by what it writes, probes it and emits
its call on those inputs as always. ``rewrite/by_layer.settle`` then puts every call that
agreed into its by-layer form (``EngineWrite.by_layer_op``: the same call with the layer key
in place of the caches and slots, returning the engine call's dummy), removes the engine
call, and removes every lifted node and input: a write nothing fused leaves the graph
exactly as it was, and the reason is reported against the engine call. An op nobody
declared is never touched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
from torch._guards import detect_fake_mode

from prepfuse.fx_passes.matching.nodes import aten, call_node, concrete, shape, val, where
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER
from prepfuse.ops.engine_caches import EngineCaches, register_resolver

__all__ = ["NEGATIVE_SLOTS", "CacheLayout", "EngineWrite", "Lifted", "register_engine_write", "unregister_engine_write",
           "engine_write_of", "is_declared", "declarations", "layout_keys", "lift"]

# the probe form's block size and token slots per block count: any would do, the call
# reads the real ones when it runs
PROBE_BLOCK_SIZE = 16
_CACHE_DTYPES = (torch.bfloat16,)
NEGATIVE_SLOTS = ("skip", "wrap")


@dataclass(frozen=True)
class CacheLayout:
    """The engine's cache as the compiled call will find it: ``[NB, BS, Hkv, D]`` k and v
    views of ``dtype`` (heads and head size are the rows')."""

    dtype: torch.dtype


@dataclass(frozen=True)
class EngineWrite:
    """An engine's cache-write op and how to reach what it writes.

    ``layout(node)`` runs at compile time on the call: a ``CacheLayout``, or a sentence
    saying why the cache cannot be written by prepfuse's op (the call is then left alone
    and the sentence reported). ``resolve(key)`` runs when the fused call runs: the
    layer's ``EngineCaches``, or None where the engine writes nothing this step.
    ``by_layer_op``: the fused op taking the key, whose ``layer_name`` has the key's schema
    type (``prepfuse.ops.define_by_layer_op``). ``negative_slots``: what the engine's write
    does with a negative slot, ``"skip"`` (no row written: vLLM's ``PAD_SLOT_ID`` of -1 in
    a padded batch, as its ``reshape_and_cache_flash`` and SGLang's and TensorRT-LLM's
    writes treat it; positive slots then given to one token each) or ``"wrap"`` (counted
    from the cache's end, and a slot several tokens name holds the last one's row, as
    PyTorch index assignment does); the fused call treats it the same way.
    ``layout_key()``: what ``layout``'s answers depend on besides the call (the engine's
    config: its attention backends, its cache dtype), read each time a compile is keyed, so
    that Inductor's FX graph cache never serves a graph compiled for another answer; None
    where ``layout`` reads the call alone."""

    op: torch._ops.OpOverload
    key: str
    value: str
    layer: str
    layout: Callable[[torch.fx.Node], CacheLayout | str]
    resolve: Callable[[object], EngineCaches | None]
    by_layer_op: torch._ops.OpOverload = GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER
    negative_slots: str = "skip"
    layout_key: Callable[[], object] | None = None

    def __post_init__(self) -> None:
        if self.negative_slots not in NEGATIVE_SLOTS:
            raise ValueError(f"negative_slots: {self.negative_slots!r} is not one of {', '.join(NEGATIVE_SLOTS)}")

    @property
    def name(self) -> str:
        """The op's qualified name, overload included: the engine argument of the fused call."""
        overload = self.op._overloadname
        return self.op._schema.name + ("" if overload == "default" else f".{overload}")

    def arg(self, node: torch.fx.Node, name: str):
        names = [a.name for a in self.op._schema.arguments]
        i = names.index(name)
        return node.args[i] if i < len(node.args) else node.kwargs[name]


_DECLARED: dict[torch._ops.OpOverload, EngineWrite] = {}


_MARKED_EFFECTFUL: set = set()  # declared ops this module marked as writes for FX's dead-code elimination


def register_engine_write(write: EngineWrite) -> None:
    """Declare ``write.op`` an engine cache write (a second declaration replaces the first).

    The op writes a cache the graph does not hold, so an op whose schema mutates nothing is
    marked side-effectful for FX's dead-code elimination (``torch.fx.node.has_side_effect``):
    a call whose return nothing reads stays in the graph, so the cache is written and the
    call fuses as any other (without it, torch.compile drops such a call and the cache is
    never written)."""
    names = [a.name for a in write.op._schema.arguments]
    for role in ("key", "value", "layer"):
        if getattr(write, role) not in names:
            raise ValueError(f"{role}: {getattr(write, role)!r} is not an argument of {write.op._schema}")
    _DECLARED[write.op] = write
    register_resolver(write.name, write.resolve)
    if not write.op._schema.is_mutable and write.op not in torch.fx.node._side_effectful_functions:
        torch.fx.node.has_side_effect(write.op)
        _MARKED_EFFECTFUL.add(write.op)


def unregister_engine_write(op: torch._ops.OpOverload) -> None:
    _DECLARED.pop(op, None)
    if op in _MARKED_EFFECTFUL:
        torch.fx.node._side_effectful_functions.discard(op)
        _MARKED_EFFECTFUL.discard(op)


def declarations() -> tuple:
    """What the declared engine writes are, for the uuid of the pass that lifts them: each
    op, the by-layer op's schema, and the source of its layout and resolver functions."""
    def source(fn) -> str:
        try:
            return inspect.getsource(fn)
        except (OSError, TypeError):  # a builtin or a lambda made at run time: its name
            return getattr(fn, "__qualname__", repr(fn))

    return tuple(sorted((w.name, str(w.by_layer_op._schema), w.negative_slots, source(w.layout), source(w.resolve))
                        for w in _DECLARED.values()))


def layout_keys() -> tuple:
    """Each declared write's ``layout_key()`` now, by engine name (the GQA pass's compile
    state: ``PrepfusePass.compile_state``)."""
    return tuple(sorted((w.name, repr(w.layout_key())) for w in _DECLARED.values() if w.layout_key is not None))


def is_declared(op) -> bool:
    """Whether ``op`` is a declared engine write (the GQA family reads its calls)."""
    return op in _DECLARED


def engine_write_of(node: torch.fx.Node) -> EngineWrite | None:
    return _DECLARED.get(node.target) if node.op == "call_function" else None


@dataclass
class Lifted:
    """One engine call and the probe form made for it."""

    engine: EngineWrite
    node: torch.fx.Node  # the engine's call
    inputs: tuple[torch.fx.Node, ...]  # the probe-only graph inputs: k cache, v cache, slots
    writes: tuple[torch.fx.Node, ...]  # the k and v index_puts


def lift(graph: torch.fx.Graph, unusable: Callable[[torch.fx.Node, str], None]) -> list[Lifted]:
    """The probe form of every declared engine call whose cache the op can write; each other
    declared call is reported through ``unusable(node, why)`` and left as it is."""
    found = []
    for node in list(graph.nodes):
        engine = engine_write_of(node)
        if engine is None:
            continue
        why = _unusable(engine, node)
        if isinstance(why, str):
            unusable(node, f"engine write {engine.name} at {where(node)}: {why}; left to the engine")
        else:
            found.append(_lift_one(graph, engine, node, why))
    return found


def _unusable(engine: EngineWrite, node: torch.fx.Node) -> CacheLayout | str:
    k, v = engine.arg(node, engine.key), engine.arg(node, engine.value)
    if not all(isinstance(x, torch.fx.Node) and isinstance(val(x), torch.Tensor) for x in (k, v)):
        return "its k or v rows are not tensors"
    if len(shape(k)) != 3 or tuple(shape(k)) != tuple(shape(v)):
        return f"k rows {list(shape(k))} and v rows {list(shape(v))} are not both [T, Hkv, D]"
    layout = engine.layout(node)
    if isinstance(layout, CacheLayout) and layout.dtype not in _CACHE_DTYPES:
        return f"its cache is {layout.dtype}; the by-layer op writes {', '.join(map(str, _CACHE_DTYPES))} caches"
    return layout


def _lift_one(graph, engine: EngineWrite, node: torch.fx.Node, layout: CacheLayout) -> Lifted:
    k, v = engine.arg(node, engine.key), engine.arg(node, engine.value)
    tokens, heads, head_dim = shape(k)
    bs = PROBE_BLOCK_SIZE
    blocks = -(-2 * concrete(tokens) // bs) + 1  # room for distinct slots, and a wrapped negative one
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    inputs = []
    with fake_mode:
        fakes = [torch.empty(blocks, bs, heads, head_dim, dtype=layout.dtype, device=val(k).device)] * 2 + \
                [torch.empty(concrete(tokens), dtype=torch.int64, device=val(k).device)]
    for part, fake in zip(("k_cache", "v_cache", "slots"), fakes):
        with graph.inserting_after(last):
            last = graph.placeholder(f"prepfuse_engine_{part}")
        last.meta["val"] = fake.clone() if part != "slots" else fake
        inputs.append(last)
    with graph.inserting_before(node):
        slots = inputs[2]
        block = call_node(graph, aten.div.Tensor_mode, (slots, bs), {"rounding_mode": "floor"})
        row = call_node(graph, aten.remainder.Scalar, (slots, bs))
        writes = tuple(call_node(graph, aten.index_put.default, (cache, [block, row], rows),
                                 meta={"stack_trace": node.meta.get("stack_trace")})
                       for cache, rows in zip(inputs[:2], (k, v)))
    return Lifted(engine, node, tuple(inputs), writes)
