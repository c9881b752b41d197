"""Find unfused DeepSeek-V4 indexer preparation (FP8 format) and call the fused op instead.

A post-grad pass, like ``fuse_dsv4_prep``: it rewrites the indexer's q side (GPT-J RoPE
on the last 64 of 128 dims, bf16 round trip, one power-of-two e4m3 scale per token and
head, the scale folded into the head weights) and its k side (the same RoPE and
quantisation of the compressed keys, written with their fp32 scales into the paged fp8
indexer cache) into one ``auto_functionalized`` call of
``prepfuse::dsv4_indexer_rope_fp8_insert`` (``DSV4_INDEXER_ROPE_FP8_INSERT``). The
patterns (``dsv4_indexer_patterns.py``) reuse the MLA pass's recognisers for RoPE, the
cos/sin gather and the cache writes, so the same spellings are accepted.

Anchors: the q side is found from an e4m3 cast of ``[T, H, 128]`` rows whose exponent also
scales the head weights; the k side from an ``index_put`` of 128-byte rows into a uint8
tensor with its partner write of 4-byte scales. A q match and a k match share one call
when they read the same cos/sin table and every reader of either side's outputs comes
after all the call's inputs (q and k rows are independent: k rows are compressed tokens
with their own positions); a side matched alone gets a call with an empty other side
(no tokens, or no inserted rows and a dummy one-slot cache).

Not matched here (declined, with the reason in the report): the MXFP4 format (its own
pass, ``fuse_dsv4_indexer_mxfp4_prep``), a q side whose exponent does not scale
exactly one weights product, and look-alikes (NeoX RoPE, RoPE on the first 64 dims, no
bf16 round trip, another amax floor). Negative slots: as for ``fuse_dsv4_prep``, eager
code writes slot -1 through index wraparound, the fused op skips it.
"""

from __future__ import annotations

import torch
import torch.fx

from prepfuse.fx_passes import dsv4_indexer_patterns, dsv4_prep_patterns, emitter, recognizers, scratch_node
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.dsv4_indexer_patterns import KSide, NoMatch, QSide, find_writes, match_k_side, match_q_side
from prepfuse.fx_passes.emitter import Emitter
from prepfuse.fx_passes.recognizers import convert_source, shape
from prepfuse.ops import DSV4_INDEXER_ROPE_FP8_INSERT, SCRATCH
from prepfuse.ops.dsv4_indexer_common import FP8_SLOT_BYTES, HEAD_DIM


class FuseDsv4IndexerPrepPass(PrepfusePass):
    """Rewrites matched indexer preparation into ``DSV4_INDEXER_ROPE_FP8_INSERT`` calls.

    ``matched_count`` is the number of op calls made; the log names each
    ``dsv4_indexer_q+k``, ``dsv4_indexer_q`` or ``dsv4_indexer_k`` and lists every declined
    candidate with its reason.
    """

    name = "fuse_dsv4_indexer_prep"
    uuid_sources = (dsv4_indexer_patterns, dsv4_prep_patterns, emitter, recognizers, scratch_node)

    def settings(self) -> tuple:
        return (str(DSV4_INDEXER_ROPE_FP8_INSERT._schema), str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        q_sides, k_sides = self._find(graph)
        calls = self._pair(graph, q_sides, k_sides)
        for q, k in calls:
            self._rewrite(graph, q, k)
        return len(calls)

    def _find(self, graph) -> tuple[list[QSide], list[KSide]]:
        q_sides, k_sides = [], []
        for node in graph.nodes:
            if convert_source(node, torch.float8_e4m3fn) is not None and len(shape(node)) == 3 \
                    and shape(node)[-1] == HEAD_DIM:
                try:
                    q_sides.append(match_q_side(node))
                except NoMatch as err:
                    self.log.declined(self.name, "dsv4_indexer_q", node, str(err))
        writes = find_writes(graph)
        ok_writes = {p: w for p, w in writes.items() if not isinstance(w, NoMatch)}
        for put in writes:
            if shape(put.args[2])[-1:] != (HEAD_DIM,):
                continue
            try:
                if isinstance(writes[put], NoMatch):
                    raise writes[put]
                k = match_k_side(put, ok_writes)
                if not k.cache_out.users:
                    raise NoMatch("write: nothing reads the written cache")
                k_sides.append(k)
            except NoMatch as err:
                self.log.declined(self.name, "dsv4_indexer_k", put, str(err))
        return q_sides, k_sides

    def _pair(self, graph, q_sides, k_sides) -> list[tuple]:
        """One call per q match, sharing it with the first k match that can (graph order);
        the k matches left get calls of their own."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        calls, free = [], list(k_sides)
        for q in q_sides:
            partner = next((k for k in free if _can_share(q, k, order)), None)
            if partner is not None:
                free.remove(partner)
            calls.append((q, partner))
        return calls + [(None, k) for k in free]

    def _rewrite(self, graph, q: QSide | None, k: KSide | None) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        readers = _readers(q, k)
        emit = Emitter(graph, min(readers, key=order.__getitem__), source=q.codes if q else k.anchor)
        like = q.q if q else k.k
        if q is not None:
            tokens, heads = emit.size(q.q, 0), shape(q.q)[1]
            q_in, weights, positions, weights_scale = q.q, q.weights, q.positions, q.weights_scale
            q_in = emit.as_bf16(q_in)  # fp32 where Inductor dropped the code's rounding
        else:  # no tokens: the op reads no q and writes no q output
            tokens, heads = 0, 1
            q_in = emit.empty([0, 1, HEAD_DIM], torch.bfloat16, like)
            weights = emit.empty([0, 1], torch.float32, like)
            positions, weights_scale = emit.empty([0], torch.int64, like), 1.0
        if k is not None:
            k_in, k_positions, k_cache, slots, block_size = k.k, k.k_positions, k.cache_in, k.slots, k.block_size
            k_in = emit.as_bf16(k_in)
        else:  # no rows inserted: the op reads no k row and writes no cache byte
            k_in = emit.empty([0, HEAD_DIM], torch.bfloat16, like)
            k_positions, slots = emit.empty([0], torch.int64, like), emit.empty([0], torch.int64, like)
            k_cache, block_size = emit.empty([1, FP8_SLOT_BYTES], torch.uint8, like), 1
        args = dict(
            q=q_in, weights=weights, k=k_in,
            # outputs in scratch-arena memory (reserved before KV sizing), not allocated per call
            q_out=emit.scratch("dsv4_indexer_rope_fp8_insert.q_out", [tokens, heads, HEAD_DIM], torch.float8_e4m3fn,
                               like, name="prepfuse_indexer_q_out_scratch"),
            weights_out=emit.scratch("dsv4_indexer_rope_fp8_insert.weights_out", [tokens, heads], torch.float32,
                                     like, name="prepfuse_indexer_weights_out_scratch"),
            k_cache=k_cache, slot_mapping=slots, positions=positions, k_positions=k_positions,
            cos_sin_cache=q.cos_sin_cache if q else k.cos_sin_cache, weights_scale=weights_scale,
            block_size=block_size,
        )
        outs = emit.functional_call(DSV4_INDEXER_ROPE_FP8_INSERT, args)
        if q is not None:
            q.codes.replace_all_uses_with(outs["q_out"])
            q.weights_out.replace_all_uses_with(outs["weights_out"])
        if k is not None:
            k.cache_out.replace_all_uses_with(outs["k_cache"])
        pattern = "dsv4_indexer_q+k" if q and k else ("dsv4_indexer_q" if q else "dsv4_indexer_k")
        self.log.matched(self.name, pattern, q.codes if q else k.anchor)


def _readers(q: QSide | None, k: KSide | None) -> list[torch.fx.Node]:
    """The nodes that read a call's outputs: q codes, folded weights, the written cache."""
    readers = []
    if q is not None:
        readers += list(q.codes.users) + list(q.weights_out.users)
    if k is not None:
        readers += list(k.cache_out.users)
    return readers


def _can_share(q: QSide, k: KSide, order: dict) -> bool:
    """One call may do both sides: one cos/sin table, and every input before every reader."""
    if q.cos_sin_cache is not k.cos_sin_cache:
        return False
    inputs = (q.q, q.weights, q.positions, q.cos_sin_cache, k.k, k.k_positions, k.cache_in, k.slots)
    return max(order[n] for n in inputs) < min(order[n] for n in _readers(q, k))

