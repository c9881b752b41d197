"""``gqa_qknorm_rope_kv_insert`` for engines that find a layer's cache by key at run time.

vLLM writes k and v through ``vllm::unified_kv_cache_update(key, value, layer_name)``: the
cache and the step's slot mapping are not graph values but found from the layer name when
the op runs. The by-layer op is the GQA op with ``k_cache``, ``v_cache`` and
``slot_mapping`` replaced by that key and the engine's name::

    gqa_qknorm_rope_kv_insert_by_layer(Tensor qkv, Tensor? q_norm_weight, Tensor? k_norm_weight,
        Tensor(a!) q_out, str layer_name, str engine, Tensor? positions, ...) -> Tensor

(the rest as ``gqa_qknorm_rope_kv_insert``, same order and defaults). It asks
``engine_caches.resolve(engine, layer_name)`` for the caches and slots, calls the GQA op on
them (its checks, its kernel on CUDA) and returns an empty tensor of qkv's dtype: the engine
op's own return, which its attention op takes as the dependency that orders the write before
the read. Where the engine has no slots this step (``resolve`` gives None), q is written and
no cache row. The key's schema type is the engine's: ``str`` here; an engine whose key is an
opaque object (vLLM's ``LayerName``) defines the same op in its namespace with
``define_by_layer_op`` (``prepfuse/integrations/vllm.py``).

Why a key and not the cache: a graph compiled once runs for every step and, where the engine
hands each layer its key as a graph input, for every layer; a cache read at compile time
would be the wrong one on the next.
"""

from __future__ import annotations

import torch

from prepfuse.ops import engine_caches
from prepfuse.ops._library import NAMESPACE, DefinedOp, define_op
from prepfuse.ops.gqa_qknorm_rope_kv_insert import GQA_QKNORM_ROPE_KV_INSERT, SCHEMA as GQA_SCHEMA, check_inputs

CACHE_ARGS = "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, "
KEY_ARGS = "{key} layer_name, str engine, "
assert CACHE_ARGS in GQA_SCHEMA and GQA_SCHEMA.endswith(") -> ()")
# the GQA op's schema, the caches and slots replaced by the key; the engine op's dummy returned
SCHEMA_TEMPLATE = GQA_SCHEMA.replace("gqa_qknorm_rope_kv_insert(", "gqa_qknorm_rope_kv_insert_by_layer(", 1) \
    .replace(CACHE_ARGS, KEY_ARGS).replace(") -> ()", ") -> Tensor")
_GQA_ARGS = [a.name for a in GQA_QKNORM_ROPE_KV_INSERT._schema.arguments]


def _gqa_call(caches, args: dict) -> None:
    args = dict(args, k_cache=caches.k_cache, v_cache=caches.v_cache, slot_mapping=caches.slot_mapping)
    GQA_QKNORM_ROPE_KV_INSERT(*(args[name] for name in _GQA_ARGS))


def _no_rows(qkv, args: dict) -> engine_caches.EngineCaches:
    """A one-slot cache and no slot: the call writes q alone (``resolve`` gave None)."""
    d = args["q_out"].shape[-1]
    cache = qkv.new_zeros(1, 1, args["num_kv_heads"], d, dtype=torch.bfloat16 if args["kv_scale"] is None
                          else torch.float8_e4m3fn)
    return engine_caches.EngineCaches(cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=qkv.device))


def define_by_layer_op(key_type: str = "str", namespace: str = NAMESPACE) -> DefinedOp:
    """The by-layer op with ``layer_name`` of schema type ``key_type``, in ``namespace``."""
    schema = SCHEMA_TEMPLATE.format(key=key_type)
    parsed = torch._C.parse_schema(f"{namespace}::{schema}").arguments
    names = [a.name for a in parsed]
    defaults = {a.name: a.default_value for a in parsed if a.has_default_value()}

    def by_layer(*values):
        args = dict(zip(names, values))
        caches = engine_caches.resolve(args["engine"], args["layer_name"])
        _gqa_call(caches if caches is not None else _no_rows(args["qkv"], args), args)
        return args["qkv"].new_empty(0)

    def fake(*values, **kwargs):
        args = {**defaults, **dict(zip(names, values)), **kwargs}
        if not isinstance(args["engine"], str) or args["engine"] not in engine_caches.resolver_names():
            raise ValueError(f"engine: no cache resolver is registered for {args['engine']!r}")
        # the q side checked as the GQA op checks it; the caches are checked when resolved
        caches = _no_rows(args["qkv"], args)
        check_inputs(**{n: args[n] for n in _GQA_ARGS if n not in ("k_cache", "v_cache", "slot_mapping")},
                     k_cache=caches.k_cache, v_cache=caches.v_cache, slot_mapping=caches.slot_mapping)
        return args["qkv"].new_empty(0)

    return define_op(schema, reference=by_layer, fake=fake, namespace=namespace)


_OP = define_by_layer_op()
gqa_qknorm_rope_kv_insert_by_layer = _OP.packet
GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER = gqa_qknorm_rope_kv_insert_by_layer.default
