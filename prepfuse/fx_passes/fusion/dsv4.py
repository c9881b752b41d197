"""Find unfused DeepSeek-V4 attention-input preparation and call the fused op instead.

A post-grad pass (Inductor's ``post_grad_custom_post_pass``: the functional graph, before
defunctionalization). It rewrites the q side (RMSNorm without weight, GPT-J RoPE on
dims 448..512, one rounding to bf16, head padding) and the kv side (RoPE, UE8M0 fp8
quantisation in blocks of 64, the write into the uint8 ``fp8_ds_mla`` cache) into one
``auto_functionalized`` call of ``prepfuse::dsv4_qnorm_rope_kv_insert``
(``DSV4_QNORM_ROPE_KV_INSERT``), v1 or v2 as ``enable_auto_functionalized_v2`` says.
The call stays functional so that the defunctionalize pass (or, without it, Inductor's
own reinplacing) makes it write ``q_out`` and the cache in place, with no copy.

Why a hand-written matcher and not ``register_replacement``. A traced pattern is one
graph; the same math reaches the post-grad graph in many (docs/design.md, lesson 6):
three RMSNorm spellings times two RoPE spellings times two paddings times two slicings
is 24 q patterns before a torch upgrade turns a ``view`` into a ``reshape``, and the
cache write is a chain of view / ``index_put`` / ``slice_scatter`` nodes whose shape
depends on how the cache was viewed. Traced patterns also refuse a match when an
intermediate has an extra user, and need care for every dynamic-shape case. Here each
step is read back by a small recogniser (``matching/recognizers.py``) that accepts the forms of
that one step, composed into two patterns (``dsv4_patterns.py``): a new spelling
is one branch in one function, an extra user of an intermediate simply keeps that node
(and what it needs) alive -- the pass only rewires the final outputs and lets dead-code
elimination remove what nobody reads -- and a mismatch names the step that failed,
which is what ``declined`` reports.

Anchors: the q side is found from an ``aten.cat`` of 448 NoPE and 64 RoPE columns of a
``[T, H, 512]`` tensor; the kv side from an ``index_put`` of 576-byte rows into a uint8
tensor. A q match and a kv match share one call when they read the same positions and
cos/sin table, have the same token count (the kv rows may be the first
``len(slot_mapping)`` of them), and every reader of either output comes after all the
call's inputs; otherwise, and for a side matched alone, the call gets an empty other
side: no q heads (``q``, ``q_out`` of shape ``[T, 0, 512]``) or no inserted rows
(``slot_mapping`` of length 0, a one-slot cache from the arena that is never written,
any bf16 ``[T, 512]`` as kv).

q_out: arena memory (``scratch_buffer``: a ``prepfuse::scratch`` node, reservation
``dsv4_qnorm_rope_kv_insert.q_out.<k>``, or the q_out an earlier call of the graph wrote
when nothing reads that any more), so no padded q is allocated per call after the KV
cache was sized; or, when the unfused code writes a caller's ``[T, HP, 512]`` buffer
whole, that buffer. See
``docs/cudagraphs.md`` for the arena's lifetimes.

Negative slots: the eager write ``cache[slot // bs, slot % bs] = row`` sends slot -1 to
the last row of the last block (Python index wraparound); the fused op skips negative
slots. The model code this pass fuses must pass valid slots, or mean "skip" by -1.
"""

from __future__ import annotations

import torch
import torch.fx

from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.fusion import dsv4_patterns
from prepfuse.fx_passes.fusion.dsv4_patterns import KvSide, NoMatch, QSide, head_padding, match_kv_side, match_q_side
from prepfuse.fx_passes.matching import MATCHING_MODULES
from prepfuse.fx_passes.matching.cache_writes import byte_row_writes, first_rows_of
from prepfuse.fx_passes.matching.emitter import Emitter
from prepfuse.fx_passes.matching.recognizers import aten, is_op, same_size, shape, val
from prepfuse.fx_passes.matching.validation import Checked
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT, SCRATCH
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import CACHE_ROW_BYTES, HEAD_DIM, NOPE_DIM, ROPE_DIM, SLOT_BYTES

# q_out comes from the scratch arena (reserved before KV-cache sizing, docs/design.md,
# lesson 2): reservations "dsv4_qnorm_rope_kv_insert.q_out.<k>"; the node keeps this
# name in debug dumps.
Q_SCRATCH_NAME = "prepfuse_q_out_scratch"
Q_SCRATCH_BASE = "dsv4_qnorm_rope_kv_insert.q_out"
# a q-only call's one-slot cache: the op writes no byte of it (no slots), but the schema
# says it may, so it is a buffer of its own; arena memory, so no allocation per call
UNUSED_CACHE_NAME = "prepfuse_unused_cache_scratch"
UNUSED_CACHE_BASE = "dsv4_qnorm_rope_kv_insert.unused_k_cache"


class FuseDsv4PrepPass(PrepfusePass):
    """Rewrites matched DeepSeek-V4 preparation into ``DSV4_QNORM_ROPE_KV_INSERT`` calls.

    ``matched_count`` is the number of op calls made; the log names each as ``dsv4_q+kv``,
    ``dsv4_q`` or ``dsv4_kv`` and lists every declined candidate with its reason.
    """

    name = "fuse_dsv4_prep"
    uuid_sources = (dsv4_patterns, *MATCHING_MODULES)

    def settings(self) -> tuple:
        # the emitted calls' schemas: an op change must invalidate cached compiled graphs too
        return (str(DSV4_QNORM_ROPE_KV_INSERT._schema), str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        self._replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        q_sides, kv_sides = self._find(graph)
        calls = self._pair(graph, q_sides, kv_sides)
        matched = 0
        for q, kv, shared_kv in calls:
            try:
                self._rewrite(graph, q, kv, shared_kv)
                matched += 1
            except NoMatch as err:  # the probes disagree: nothing was rewired
                self.log.declined(self.name, _pattern(q, kv), q.prepared if q else kv.anchor, str(err))
        return matched

    # ----------------------------------------------------------------------------------
    def _find(self, graph) -> tuple[list[QSide], list[KvSide]]:
        q_sides, kv_sides = [], []
        for node in graph.nodes:
            if is_op(node, aten.cat.default) and _is_q_anchor(node):
                try:
                    q_sides.append(match_q_side(node))
                except NoMatch as err:
                    self.log.declined(self.name, "dsv4_q", node, str(err))
        writes = byte_row_writes(graph)
        for put, write in writes.items():
            if shape(put.args[2])[-1:] != (CACHE_ROW_BYTES,):
                continue
            try:
                if isinstance(write, NoMatch):
                    raise write
                kv = match_kv_side(write, writes.values())
                if not kv.cache_out.users:
                    raise NoMatch("write: nothing reads the written cache")
                kv_sides.append(kv)
            except NoMatch as err:
                self.log.declined(self.name, "dsv4_kv", put, str(err))
        return q_sides, kv_sides

    def _pair(self, graph, q_sides, kv_sides) -> list[tuple]:
        """(q, kv, the kv tensor a shared call reads): one call per q match, sharing it with
        the first kv match that can (graph order); the kv matches left get calls of their own."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        calls, free = [], list(kv_sides)
        for q in q_sides:
            partner = full = None
            for kv in free:
                full = _shared_kv(q, kv, order)
                if full is not None:
                    partner = kv
                    free.remove(kv)
                    break
            calls.append((q, partner, full))
        return calls + [(None, kv, kv.kv) for kv in free]

    def _rewrite(self, graph, q: QSide | None, kv: KvSide | None, kv_in: torch.fx.Node | None) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        readers = (_q_readers(q) if q else []) + (list(kv.cache_out.users) if kv else [])
        emit = Emitter(graph, min(readers, key=order.__getitem__), source=q.prepared if q else kv.anchor)
        if q is not None:
            tokens, num_heads = emit.size(q.q, 0), shape(q.q)[1]
            pads = [p for p in (head_padding(u, q.prepared) for u in q.prepared.users) if p is not None]
            padded_heads = pads[0].padded_heads if pads else num_heads
            # a caller's buffer the unfused code writes whole is q_out itself (no scratch, no copy)
            buffer = pads[0].buffer if pads else None
            q_in, positions, table, eps = q.q, q.positions, q.cos_sin_cache, q.eps
        else:
            tokens = emit.size(kv.kv, 0)
            q_in = emit.empty([tokens, 0, HEAD_DIM], torch.bfloat16, kv.kv)
            padded_heads, positions, table, eps, buffer = 0, kv.positions, kv.cos_sin_cache, 0.0, None
        if q is None:  # no heads: a zero-byte q_out, nothing to reserve
            buffer = emit.empty([tokens, 0, HEAD_DIM], torch.bfloat16, q_in)
        elif buffer is None or val(buffer).stride(-1) != 1:
            buffer = emit.scratch(Q_SCRATCH_BASE, [tokens, padded_heads, HEAD_DIM], torch.bfloat16, q_in,
                                  name=Q_SCRATCH_NAME)
        q_out = buffer
        if kv is not None:
            k_cache, slots, block_size = kv.cache_in, kv.slots, kv.block_size
            kv_in = emit.as_bf16(kv_in)  # fp32 where Inductor dropped the code's .to(bf16) (torch 2.11)
        else:  # no rows inserted: the op reads no kv row and writes no cache byte
            kv_in = emit.node(aten.select.int, q.q, 1, 0)
            k_cache = emit.scratch(UNUSED_CACHE_BASE, [1, SLOT_BYTES], torch.uint8, q.q, name=UNUSED_CACHE_NAME)
            slots = emit.empty([0], torch.int64, q.q)
            block_size = 1
        args = dict(q=q_in, kv=kv_in, q_out=q_out, k_cache=k_cache, slot_mapping=slots, positions=positions,
                    cos_sin_cache=table, eps=eps, block_size=block_size)
        # an input that an earlier rewrite replaced (a cache written twice) is read from its replacement
        args = torch.fx.node.map_arg(args, lambda n: self._replaced.get(n, n))
        outs = emit.functional_call(DSV4_QNORM_ROPE_KV_INSERT, args)
        if q is not None:  # what readers of the unpadded q read: the first H heads of q_out
            new_q = outs["q_out"]
            q_view = new_q if padded_heads == num_heads else emit.node(aten.slice.Tensor, new_q, 1, 0, num_heads)
        note = ""
        if self.validate == "probe":
            checked = [Checked("q_out", q.prepared, q_view)] if q is not None else []
            checked += [Checked("q_out (padded)", pads[0].node, new_q)] if q is not None and pads else []
            checked += [Checked("k_cache", kv.cache_out, outs["k_cache"])] if kv is not None else []
            note = emit.validate(args, checked)

        if q is not None:
            others = []
            for user in list(q.prepared.users):
                padding = head_padding(user, q.prepared)
                if padding is not None and padding.padded_heads == padded_heads:
                    self._replace(padding.node, new_q)
                else:
                    others.append(user)
            for user in others:
                user.replace_input_with(q.prepared, q_view)
        if kv is not None:
            self._replace(kv.cache_out, outs["k_cache"])
        self.log.matched(self.name, _pattern(q, kv), q.prepared if q else kv.anchor, note)

    def _replace(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        old.replace_all_uses_with(new)
        self._replaced[old] = new


def _pattern(q: QSide | None, kv: KvSide | None) -> str:
    return "dsv4_q+kv" if q and kv else ("dsv4_q" if q else "dsv4_kv")


def _is_q_anchor(cat) -> bool:
    """A cat of [.., 448] and [.., 64] along the last dim of a 3-d tensor."""
    parts = cat.args[0]
    out = shape(cat)
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return (len(out) == 3 and dim in (-1, 2) and len(parts) == 2
            and [shape(p)[-1] for p in parts] == [NOPE_DIM, ROPE_DIM])


def _q_readers(q: QSide) -> list[torch.fx.Node]:
    """The nodes that read the prepared q, directly or through a head padding."""
    readers = []
    for user in q.prepared.users:
        padding = head_padding(user, q.prepared)
        readers += list(padding.node.users) if padding is not None else [user]
    return readers


def _shared_kv(q: QSide, kv: KvSide, order: dict) -> torch.fx.Node | None:
    """The ``[T, 512]`` kv a call shared by ``q`` and ``kv`` takes, or None if they cannot share one.

    The op inserts the first ``len(slot_mapping)`` rows of kv, with positions of q's tokens.
    """
    rows, tokens = shape(kv.slots)[0], shape(q.q)[0]
    if kv.cos_sin_cache is not q.cos_sin_cache or first_rows_of(kv.positions, rows) is not q.positions and kv.positions is not q.positions:
        return None
    full = next((k for k in (kv.kv, first_rows_of(kv.kv, rows)) if same_size(shape(k)[0], tokens)), None)
    if full is None:
        return None
    inputs = (q.q, full, kv.cache_in, kv.slots, q.positions, q.cos_sin_cache)
    readers = _q_readers(q) + list(kv.cache_out.users)
    if max(order[n] for n in inputs) >= min(order[n] for n in readers):
        return None  # some reader of one output comes before an input of the other side
    return full
