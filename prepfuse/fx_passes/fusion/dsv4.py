"""Find DeepSeek-V4 attention-input preparation by what it writes, and call the fused op instead.

The kv side is found from its cache writes: 576-byte rows (448 e4m3 NoPE codes, 64 RoPE
values as bf16 bytes) and their 8 scale bytes, written at the same slots into the blocks
of a 2-d uint8 graph input (``writes.byte_rows``: through a view of the block rows or by
byte columns). The q side is the prepared q: heads of 512 values of a projection, carried
per token and head (``sources.prepared``) to a step that reads them (attention, or the
head padding FlashMLA wants: ``dsv4_padding``), their math reading per-token cos/sin.

Which values the op reads (the q projection's heads; the kv the rows are made of, which an
upstream norm may have produced), and how it reads cos/sin, is decided on probes
(``search.first_agreeing``): candidate calls of ``prepfuse::dsv4_qnorm_rope_kv_insert``
run against the region, the first that agrees kept. A q side and a kv side of the same
tokens share one call when a call of both agrees; otherwise each gets its own (a q-only
call inserts no rows into a one-slot arena cache; a kv-only call has no heads).

q_out: arena memory (``scratch_buffer``), or the caller's padded buffer the code writes
whole. The cache is compared decoded (fp8 codes as e4m3 values, RoPE values as bf16, scale
bytes as bytes): Hugging Face's q path rounds its norm factor and cos/sin to bf16, where
the op computes in fp32 and rounds once, so bytes of the same math can differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.fusion import dsv4_padding
from prepfuse.fx_passes.fusion.dsv4_padding import head_padding
from prepfuse.fx_passes.matching import MATCHING_MODULES
from prepfuse.fx_passes.matching.axes import base_columns
from prepfuse.fx_passes.matching.nodes import NoMatch, aten, expect, graph_order, prims, same_size, shape, val, where
from prepfuse.fx_passes.matching.regions import backward, constants, expect_no_runtime_floats
from prepfuse.fx_passes.matching.rope_operands import emit_table, per_token_operands, rope_forms
from prepfuse.fx_passes.matching.sources import prepared, projection_starts, row_sources, weight_like
from prepfuse.fx_passes.matching.writes import (
    ByteRows, byte_rows, first_rows, rows_writes, scale_partner, slot_of, slot_roles,
)
from prepfuse.fx_passes.rewrite import REWRITE_MODULES
from prepfuse.fx_passes.rewrite.compare import Checked
from prepfuse.fx_passes.rewrite.emitter import Emitter
from prepfuse.fx_passes.rewrite.probes import Probes
from prepfuse.fx_passes.rewrite.search import Candidate, first_agreeing
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT, SCRATCH
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import CACHE_ROW_BYTES, HEAD_DIM, NOPE_DIM, ROPE_DIM, SCALE_BYTES, SLOT_BYTES

Q_SCRATCH_NAME = "prepfuse_q_out_scratch"
Q_SCRATCH_BASE = "dsv4_qnorm_rope_kv_insert.q_out"
# a q-only call's one-slot cache: never written (no slots), arena memory so no allocation per call
UNUSED_CACHE_NAME = "prepfuse_unused_cache_scratch"
UNUSED_CACHE_BASE = "dsv4_qnorm_rope_kv_insert.unused_k_cache"


@dataclass
class KvSide:
    data: ByteRows
    scales: ByteRows
    root: torch.fx.Node  # the cache before both writes
    after: torch.fx.Node  # after both
    sources: list  # the [T, 512] nodes the op could read as kv, latest first
    region: list
    operands: list

    @property
    def anchor(self):
        return self.data.write.write


@dataclass
class QSide:
    start: object  # sources.Start: the q projection's columns
    candidates: list  # sources.Prepared, latest first
    heads: int


class FuseDsv4PrepPass(PrepfusePass):
    """Rewrites DeepSeek-V4 preparation into ``DSV4_QNORM_ROPE_KV_INSERT`` calls; the log
    names each ``dsv4_q+kv``, ``dsv4_q`` or ``dsv4_kv``."""

    name = "fuse_dsv4_prep"
    uuid_sources = (dsv4_padding, *MATCHING_MODULES, *REWRITE_MODULES)
    canonical_graph = True

    def settings(self) -> tuple:
        return (str(DSV4_QNORM_ROPE_KV_INSERT._schema), str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        kvs = self._kv_sides(graph)
        kv_starts = {s for kv in kvs for s in kv.sources}
        qs = self._q_sides(graph, kv_starts)
        matched = 0
        free = list(kvs)
        for q in qs:
            for kv in [kv for kv in free if any(same_size(_tokens(s), _tokens(q.start.node)) for s in kv.sources)]:
                try:  # one call for both sides where one agrees; else each side alone, below
                    self._fuse(graph, q, kv)
                except NoMatch:
                    continue
                free.remove(kv)
                matched += 1
                break
            else:
                matched += self.attempt(lambda: self._fuse(graph, q, None), "dsv4_q", q.candidates[0].node)
        for kv in free:
            matched += self.attempt(lambda kv=kv: self._fuse(graph, None, kv), "dsv4_kv", kv.anchor)
        return matched

    # ----------------------------------------------------------------------------------
    def _kv_sides(self, graph) -> list[KvSide]:
        byte = {}
        for node, w in rows_writes(graph).items():
            if isinstance(w, NoMatch) or val(w.root).dtype != torch.uint8 or val(w.root).dim() != 2:
                continue
            try:
                byte[node] = byte_rows(w)
            except NoMatch as err:
                if shape(w.values)[-1:] == (CACHE_ROW_BYTES,):
                    self.declined_at("dsv4_kv", node, str(err))
        found = []
        for node, data in byte.items():
            if (data.first, data.pitch, data.width) != (0, CACHE_ROW_BYTES, CACHE_ROW_BYTES):
                if CACHE_ROW_BYTES in (data.width, data.pitch):  # a row of this cache's size, placed otherwise
                    self.declined_at("dsv4_kv", node, f"write: rows of {data.width} bytes {data.pitch} apart from "
                                                      f"column {data.first}; fp8_ds_mla rows are {CACHE_ROW_BYTES} "
                                                      f"bytes, {CACHE_ROW_BYTES} apart, from 0")
                continue
            self.attempt(lambda data=data: found.append(self._kv_side(data, byte.values())), "dsv4_kv", node)
        return found

    def _kv_side(self, data: ByteRows, writes) -> KvSide:
        scales, root, after = scale_partner(data, writes, SCALE_BYTES)
        sources, region, ops = row_sources([first_rows(data.write), scales.rows], HEAD_DIM, avoid={data.write.root})
        expect(sources, f"write: the rows written at {where(data.write.write)} are not made of one [T, 512] tensor")
        return KvSide(data, scales, root, after, sources, region, ops)

    def _q_sides(self, graph, kv_starts) -> list[QSide]:
        found = []
        for start in projection_starts(graph, HEAD_DIM, (torch.bfloat16, torch.float16), avoid=kv_starts):
            cands = [p for p in prepared(start, HEAD_DIM, _tokens(start.source), dtypes=(torch.bfloat16, torch.float16))
                     if per_token_operands(p.operands, weight_like) and len(shape(p.node)) >= 3
                     and shape(p.node)[-1] == HEAD_DIM]
            if cands:
                found.append(QSide(start, cands, cands[0].heads))
        return found

    # ----------------------------------------------------------------------------------
    def _fuse(self, graph, q: QSide | None, kv: KvSide | None) -> None:
        expect(q is None or val(q.start.source).dtype == torch.bfloat16,
               f"q: the projection is {val(q.start.source).dtype if q else ''}; the op reads bfloat16")
        order = graph_order(graph)
        outputs = ([p.node for p in q.candidates] if q else []) + ([kv.after] if kv else [])
        outputs += [pd.node for p in (q.candidates if q else []) for pd in
                    (head_padding(u, p.node, HEAD_DIM) for u in p.node.users) if pd is not None]
        readers = [u for o in outputs for u in o.users]
        expect(readers, "nothing reads what the preparation makes")
        point = min(readers, key=order.__getitem__)
        roles, block_size = {}, 1
        if kv is not None:
            block_size = kv.data.block_size
            roles.update(slot_roles(kv.data))
        probes = Probes(outputs, roles, slots=_slots(kv), block_size=block_size, mode=self.validate, memo=self.memo)
        rope_ops = per_token_operands((q.candidates[0].operands if q else []) + (kv.operands if kv else []),
                                      weight_like)
        ropes = [r for r in rope_forms(rope_ops, None, ROPE_DIM, probes.equal_parts,
                                       lambda n: probes.equal_parts(n, pairs=True)) if r.rotary_dim == ROPE_DIM]
        expect(ropes, "rope: no cos/sin for 64 rotated dims among what the rows mix in")
        eps_values = [e for e in (constants(backward([q.candidates[0].node]), {q.start.node}, {}) if q else [])
                      if 0 < e < 0.1] or [0.0]
        kv_sources = kv.sources if kv else [None]
        q_nodes = q.candidates if q else [None]
        cands = [Candidate(f"{_describe(q, kv, r, e)}", self._emitter_of(q, p, kv, s, r, e))
                 for s in kv_sources for r in ropes for e in eps_values for p in q_nodes
                 if q is None or s is None or same_size(_tokens(s), _tokens(q.start.node))]
        expect(cands, "q and kv have different token counts")
        agreed = first_agreeing(probes, cands, lambda: Emitter(graph, point, source=(q.candidates[0].node if q
                                                                                        else kv.anchor), readers=readers))
        for old, new in agreed.result:
            self.replace(old, new)
        pattern = "dsv4_q+kv" if q and kv else ("dsv4_q" if q else "dsv4_kv")
        self.log.matched(self.name, pattern, q.candidates[0].node if q else kv.anchor,
                         agreed.note(agreed.candidate.name))

    def _emitter_of(self, q, p, kv, kv_src, rope, eps):
        def emit_it(emit: Emitter):
            # what the call computes must not read a float only the run knows (its fp8 range, eps)
            if q is not None:
                expect_no_runtime_floats(backward([p.node], cut={q.start.node}))
            if kv is not None:
                expect_no_runtime_floats(backward([first_rows(kv.data.write), kv.scales.rows], cut={kv_src}))
            device = val(q.start.source if q else kv.data.rows).device
            checked, written = [], []
            if q is not None:
                tokens = _token_size(emit, q.start.source)
                q_in = q.start.source if len(shape(q.start.source)) == 3 and shape(q.start.source)[1] == q.heads \
                    else emit.node(aten.reshape.default, q.start.source, [-1, q.heads, HEAD_DIM])
                pads = [pd for pd in (head_padding(u, p.node, HEAD_DIM) for u in p.node.users) if pd is not None]
                padded = pads[0].padded_heads if pads else q.heads
                buffer = pads[0].buffer if pads and pads[0].buffer is not None and \
                    val(pads[0].buffer).stride(-1) == 1 else None
                q_out = buffer if buffer is not None else emit.scratch(Q_SCRATCH_BASE, [tokens, padded, HEAD_DIM],
                                                                       torch.bfloat16, q_in, name=Q_SCRATCH_NAME)
            else:
                tokens = _token_size(emit, kv_src)
                q_in = emit.empty([tokens, 0, HEAD_DIM], torch.bfloat16, kv_src)
                q_out = emit.empty([tokens, 0, HEAD_DIM], torch.bfloat16, kv_src)
            if kv is not None:
                kv_in = kv_src if len(shape(kv_src)) == 2 else emit.node(aten.reshape.default, kv_src, [-1, HEAD_DIM])
                if val(kv_in).dtype != torch.bfloat16:  # fp32 the code rounded (a round trip Inductor dropped)
                    kv_in = emit.node(prims.convert_element_type.default, kv_in, torch.bfloat16)
                cache, slots = self.replaced.get(kv.root, kv.root), _emit_slots(emit, kv.data)
                block_size = kv.data.block_size
            else:
                kv_in = emit.node(aten.select.int, q_in, 1, 0)
                cache = emit.scratch(UNUSED_CACHE_BASE, [1, SLOT_BYTES], torch.uint8, q_in, name=UNUSED_CACHE_NAME)
                slots, block_size = emit.empty([0], torch.int64, q_in), 1
            positions, table = emit_table(emit, rope, tokens, device)
            args = dict(q=q_in, kv=kv_in, q_out=q_out, k_cache=cache, slot_mapping=slots, positions=positions,
                        cos_sin_cache=table, eps=eps, block_size=block_size, wrap_indices=True)
            outs = emit.functional_call(DSV4_QNORM_ROPE_KV_INSERT, args)
            if q is not None:
                new_q = outs["q_out"]
                q_view = new_q if padded == q.heads else emit.node(aten.slice.Tensor, new_q, 1, 0, q.heads)
                q_view = _as_prepared(emit, q_view, p)
                checked.append(Checked("q_out", p.node, q_view))
                written.append((p.node, q_view))
                for pd in pads:
                    if pd.padded_heads == padded:
                        checked.append(Checked("q_out (padded)", pd.node, new_q))
                        written.append((pd.node, new_q))
            if kv is not None:
                checked.append(Checked("k_cache", kv.after, outs["k_cache"], decode=_fp8_ds_mla(block_size)))
                written.append((kv.after, outs["k_cache"]))
            return checked, written
        return emit_it


def _as_prepared(emit, q_view, p):
    """The op's ``[T, H, 512]`` q laid out as the prepared node ``p`` is (``[B, H, S, 512]`` ..)."""
    from prepfuse.fx_passes.rewrite.emitter import as_layout

    return as_layout(emit, q_view, p.layout, p.node)


def _tokens(node):
    """The tokens of a source or a kv candidate (``axes.base_columns``)."""
    return base_columns(node, HEAD_DIM)[0]


def _token_size(emit, node):
    """``_tokens(node)`` as the call's size: a number, or a product of ``sym_size`` nodes."""
    sizes = shape(node)
    lead = len(sizes) - 2 if len(sizes) >= 3 and sizes[-1] == HEAD_DIM else len(sizes) - 1
    return emit.count(node, range(lead))


def _emit_slots(emit, rows: ByteRows):
    slot = slot_of(rows)
    if slot is not None:
        return slot
    return emit.node(aten.add.Tensor, emit.node(aten.mul.Tensor, rows.block, rows.block_size), rows.row)


def _slots(kv: KvSide | None):
    if kv is None:
        return None
    return val(kv.root).shape[0] * kv.data.block_size


def _fp8_ds_mla(block_size: int):
    """The decoder of an fp8_ds_mla cache ``[NB, S]`` for comparison: NoPE codes as e4m3
    values, RoPE values as bf16, scale bytes and the rest as bytes."""
    def decode(cache: torch.Tensor) -> dict:
        nb = cache.shape[0]
        data = cache[:, : block_size * CACHE_ROW_BYTES].reshape(nb, block_size, CACHE_ROW_BYTES)
        return {"NoPE codes": data[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn),
                "RoPE values": data[..., NOPE_DIM:].contiguous().view(torch.bfloat16),
                "scale bytes": cache[:, block_size * CACHE_ROW_BYTES:].contiguous()}
    return decode


def _describe(q, kv, rope, eps) -> str:
    sides = "q and kv" if q and kv else ("q" if q else "kv")
    text = f"DeepSeek-V4 {sides}, GPT-J RoPE on {rope.describe()}"
    return text + (f", RMSNorm eps {eps:g}" if q else "")
