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

__all__ = ["CacheLayout", "EngineWrite", "Lifted", "register_engine_write", "unregister_engine_write",
           "engine_write_of", "declarations", "lift"]

# the probe form's block size and token slots per block count: any would do, the call
# reads the real ones when it runs
PROBE_BLOCK_SIZE = 16
_CACHE_DTYPES = (torch.bfloat16,)


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
    type (``prepfuse.ops.define_by_layer_op``)."""

    op: torch._ops.OpOverload
    key: str
    value: str
    layer: str
    layout: Callable[[torch.fx.Node], CacheLayout | str]
    resolve: Callable[[object], EngineCaches | None]
    by_layer_op: torch._ops.OpOverload = GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER

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


def register_engine_write(write: EngineWrite) -> None:
    """Declare ``write.op`` an engine cache write (a second declaration replaces the first)."""
    names = [a.name for a in write.op._schema.arguments]
    for role in ("key", "value", "layer"):
        if getattr(write, role) not in names:
            raise ValueError(f"{role}: {getattr(write, role)!r} is not an argument of {write.op._schema}")
    _DECLARED[write.op] = write
    register_resolver(write.name, write.resolve)


def unregister_engine_write(op: torch._ops.OpOverload) -> None:
    _DECLARED.pop(op, None)


def declarations() -> tuple:
    """What the declared engine writes are, for the uuid of the pass that lifts them: each
    op, the by-layer op's schema, and the source of its layout and resolver functions."""
    def source(fn) -> str:
        try:
            return inspect.getsource(fn)
        except (OSError, TypeError):  # a builtin or a lambda made at run time: its name
            return getattr(fn, "__qualname__", repr(fn))

    return tuple(sorted((w.name, str(w.by_layer_op._schema), source(w.layout), source(w.resolve))
                        for w in _DECLARED.values()))


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
