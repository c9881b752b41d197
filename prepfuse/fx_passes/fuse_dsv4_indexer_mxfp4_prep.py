"""Find unfused DeepSeek-V4 indexer preparation (MXFP4 format) and call the fused op instead.

The MXFP4 sibling of ``fuse_dsv4_indexer_prep``: it rewrites the indexer's q side (GPT-J
RoPE on the last 64 of 128 dims, bf16 round trip, per block of 32 a UE8M0 scale and e2m1
nibbles packed two per byte, the scale bytes a ``[T, H, 4]`` output of their own), the
head weights' ``weights.float() * weights_scale`` and the k side (the same RoPE and
quantisation of the compressed keys, written with their scale bytes into the paged 68-byte
slots of the indexer cache) into one ``auto_functionalized`` call of
``prepfuse::dsv4_indexer_rope_mxfp4_insert`` (``DSV4_INDEXER_ROPE_MXFP4_INSERT``), its
outputs ``q_out``, ``q_scale`` and ``weights_out`` in scratch-arena memory.

Anchors: the q side is found from the nibble packing ``lo | hi << 4`` of ``[T, H, ..]``
codes, the k side from an ``index_put`` of 64-byte rows into a uint8 tensor with its
partner write of 4 scale bytes (``dsv4_indexer_mxfp4_patterns.py``). A q match and a k
match share one call when they read the same cos/sin table and every reader of either
side's outputs comes after all the call's inputs; a side matched alone gets a call with an
empty other side. The weights product has no data link to q (the block scales travel
apart, unlike FP8's fold), so each q call takes the first unclaimed ``weights.float() * c``
of q's ``[T, H]`` shape in graph order whose inputs come before the call's readers
(whichever it takes, the op computes that product's exact bits); a q call without one
gets an unread dummy ``weights``.

Declined, with the reason in the report: e2m1 ties away from zero, the sign taken as
``v < 0`` (drops -0.0's sign), another amax floor, and the FP8 pass's RoPE look-alikes
(NeoX, first 64 dims, no bf16 round trip). Negative slots: as for ``fuse_dsv4_prep``,
eager code writes slot -1 through index wraparound, the fused op skips it.
"""

from __future__ import annotations

import torch
import torch.fx

from prepfuse.fx_passes import (
    dsv4_indexer_mxfp4_patterns, dsv4_indexer_patterns, dsv4_prep_patterns, emitter, recognizers, scratch_node,
)
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.dsv4_indexer_mxfp4_patterns import (
    KSide, NoMatch, QSide, find_writes, is_pack, match_k_side, match_q_side, weights_products,
)
from prepfuse.fx_passes.emitter import Emitter
from prepfuse.fx_passes.recognizers import RESHAPES, is_op, put_rows, same_size, shape
from prepfuse.ops import DSV4_INDEXER_ROPE_MXFP4_INSERT, SCRATCH
from prepfuse.ops.dsv4_indexer_common import HEAD_DIM, MXFP4_BLOCKS, MXFP4_PACKED, MXFP4_SLOT_BYTES

OP_NAME = "dsv4_indexer_rope_mxfp4_insert"


class FuseDsv4IndexerMxfp4PrepPass(PrepfusePass):
    """Rewrites matched MXFP4 indexer preparation into ``DSV4_INDEXER_ROPE_MXFP4_INSERT`` calls.

    ``matched_count`` is the number of op calls made; the log names each
    ``dsv4_indexer_mxfp4_q+k``, ``dsv4_indexer_mxfp4_q`` or ``dsv4_indexer_mxfp4_k`` and
    lists every declined candidate with its reason.
    """

    name = "fuse_dsv4_indexer_mxfp4_prep"
    uuid_sources = (dsv4_indexer_mxfp4_patterns, dsv4_indexer_patterns, dsv4_prep_patterns, emitter, recognizers, scratch_node)

    def settings(self) -> tuple:
        return (str(DSV4_INDEXER_ROPE_MXFP4_INSERT._schema), str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        q_sides, k_sides = self._find(graph)
        calls = _pair(graph, q_sides, k_sides)
        claimed, caches = set(), {}  # caches: a rewritten call's old cache value -> its new one
        for q, k in calls:
            self._rewrite(graph, q, k, _weights_for(graph, q, k, claimed), caches)
        return len(calls)

    def _find(self, graph) -> tuple[list[QSide], list[KSide]]:
        q_sides, k_sides = [], []
        for node in graph.nodes:
            if not is_pack(node):
                continue
            for packed in _packed_outputs(node):
                if len(shape(packed)) != 3:  # [n, 64] rows are k's: found from the cache writes
                    continue
                try:
                    q_sides.append(match_q_side(packed))
                except NoMatch as err:
                    self.log.declined(self.name, "dsv4_indexer_mxfp4_q", packed, str(err))
        writes = find_writes(graph)
        ok_writes = {p: w for p, w in writes.items() if not isinstance(w, NoMatch)}
        for put in writes:
            if shape(put_rows(put))[-1:] != (MXFP4_PACKED,):
                continue
            try:
                if isinstance(writes[put], NoMatch):
                    raise writes[put]
                k = match_k_side(put, ok_writes)
                if not k.cache_out.users:
                    raise NoMatch("write: nothing reads the written cache")
                k_sides.append(k)
            except NoMatch as err:
                self.log.declined(self.name, "dsv4_indexer_mxfp4_k", put, str(err))
        return q_sides, k_sides

    def _rewrite(self, graph, q: QSide | None, k: KSide | None, weights: tuple | None, caches: dict) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        readers = _readers(q, k, weights)
        emit = Emitter(graph, min(readers, key=order.__getitem__), source=q.packed if q else k.anchor)
        like = q.q if q else k.k
        if q is not None:
            tokens, heads = emit.size(q.q, 0), shape(q.q)[1]
            q_in, positions = q.q, q.positions
            q_in = emit.as_bf16(q_in)  # fp32 where Inductor dropped the code's rounding
        else:  # no tokens: the op reads no q and writes no q output
            tokens, heads = 0, 1
            q_in, positions = emit.empty([0, 1, HEAD_DIM], torch.bfloat16, like), emit.empty([0], torch.int64, like)
        if weights is not None:
            product, w_in, weights_scale = weights
        else:  # no weights product to take over: the op's weights_out is written and never read
            product, w_in, weights_scale = None, emit.empty([tokens, heads], torch.float32, like), 1.0
        if k is not None:
            k_in, k_positions, slots, block_size = k.k, k.k_positions, k.slots, k.block_size
            k_in = emit.as_bf16(k_in)
            # a cache an earlier call of this pass wrote (two layers, one cache): its new value
            k_cache = caches.get(k.cache_in, k.cache_in)
        else:  # no rows inserted: the op reads no k row and writes no cache byte
            k_in = emit.empty([0, HEAD_DIM], torch.bfloat16, like)
            k_positions, slots = emit.empty([0], torch.int64, like), emit.empty([0], torch.int64, like)
            k_cache, block_size = emit.empty([1, MXFP4_SLOT_BYTES], torch.uint8, like), 1

        def scratch(out: str, sizes, dtype):
            # outputs in scratch-arena memory (reserved before KV sizing), not allocated per call
            return emit.scratch(f"{OP_NAME}.{out}", sizes, dtype, like, name=f"prepfuse_indexer_mxfp4_{out}_scratch")

        args = dict(
            q=q_in, weights=w_in, k=k_in,
            q_out=scratch("q_out", [tokens, heads, MXFP4_PACKED], torch.uint8),
            q_scale=scratch("q_scale", [tokens, heads, MXFP4_BLOCKS], torch.uint8),
            weights_out=scratch("weights_out", [tokens, heads], torch.float32),
            k_cache=k_cache, slot_mapping=slots, positions=positions, k_positions=k_positions,
            cos_sin_cache=q.cos_sin_cache if q else k.cos_sin_cache, weights_scale=weights_scale,
            block_size=block_size,
        )
        outs = emit.functional_call(DSV4_INDEXER_ROPE_MXFP4_INSERT, args)
        if q is not None:
            q.packed.replace_all_uses_with(outs["q_out"])
            for node in q.scale_bytes:
                node.replace_all_uses_with(outs["q_scale"])
        if product is not None:
            product.replace_all_uses_with(outs["weights_out"])
        if k is not None:
            k.cache_out.replace_all_uses_with(outs["k_cache"])
            caches[k.cache_out] = outs["k_cache"]
        pattern = "dsv4_indexer_mxfp4_" + ("q+k" if q and k else ("q" if q else "k"))
        self.log.matched(self.name, pattern, q.packed if q else k.anchor)


def _packed_outputs(pack: torch.fx.Node) -> list[torch.fx.Node]:
    """The packed bytes ``[.., 64]``: the pack itself (flat codes) or its reshapes (blocks)."""
    if shape(pack)[-1] == MXFP4_PACKED:
        return [pack]
    return [u for u in pack.users if is_op(u, *RESHAPES) and shape(u)[-1] == MXFP4_PACKED]


def _readers(q: QSide | None, k: KSide | None, weights: tuple | None = None) -> list[torch.fx.Node]:
    """The nodes that read a call's outputs: packed q, its scale bytes, the weights, the cache."""
    readers = []
    if q is not None:
        readers += list(q.packed.users) + [u for s in q.scale_bytes for u in s.users]
    if weights is not None:
        readers += list(weights[0].users)
    if k is not None:
        readers += list(k.cache_out.users)
    return readers


def _inputs(q: QSide | None, k: KSide | None) -> list[torch.fx.Node]:
    inputs = [q.q, q.positions, q.cos_sin_cache] if q is not None else []
    return inputs + ([k.k, k.k_positions, k.cos_sin_cache, k.cache_in, k.slots] if k is not None else [])


def _pair(graph, q_sides: list[QSide], k_sides: list[KSide]) -> list[tuple]:
    """One call per q match, sharing it with the first k match that can (graph order): one
    cos/sin table, every input before every reader; the k matches left get calls of their own."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    calls, free = [], list(k_sides)
    for q in q_sides:
        partner = next((k for k in free if q.cos_sin_cache is k.cos_sin_cache
                        and max(order[n] for n in _inputs(q, k)) < min(order[n] for n in _readers(q, k))), None)
        if partner is not None:
            free.remove(partner)
        calls.append((q, partner))
    return calls + [(None, k) for k in free]


def _weights_for(graph, q: QSide | None, k: KSide | None, claimed: set) -> tuple | None:
    """The first unclaimed ``weights.float() * c`` of q's ``[T, H]`` that can join the call
    (its weights before, its readers after every other input and reader), claimed."""
    if q is None:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    tokens, heads = shape(q.q)[:2]
    for product, weights, c in weights_products(graph):
        size = shape(product)
        if product in claimed or not (same_size(size[0], tokens) and same_size(size[1], heads)):
            continue
        inputs = [*_inputs(q, k), weights]
        if max(order[n] for n in inputs) < min(order[n] for n in _readers(q, k, (product,))):
            claimed.add(product)
            return product, weights, c
    return None
