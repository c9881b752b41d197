"""Find DeepSeek-V4 attention-input preparation by what it writes, and call the fused op instead.

The kv side is found from its cache writes: 576-byte rows (448 e4m3 NoPE codes, 64 RoPE
values as bf16 bytes) and their 8 scale bytes, written at the same slots into the blocks
of a 2-d uint8 graph input (``writes.byte_rows``: through a view of the block rows or by
byte columns), vLLM's fp8_ds_mla cache; 528-byte records (512 e4m3 codes, then 16 scale
bytes), written whole or as codes and scales at the same slots, DeepSeek-V4.1's MXFP8
record (vLLM's ``kv_mxfp8``); or whole rows of 512 values, bf16 or e4m3 over one
scale, written into a paged cache (``rewrite/cache_views``: ``[blocks, block_size, 512]`` or any
view of it), vLLM's full-row caches, which ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert``
writes. The q side is the prepared q: heads of 512 values of a projection, carried
per token and head (``sources.prepared``) to a step that reads them (attention, or the
head padding FlashMLA wants: ``dsv4_padding``), their math reading per-token cos/sin; bf16,
or e4m3 over one scale (vLLM's fp8 full-row path writes q so, ``q * q_scale_inv`` or
``q / q_scale``, the probes deciding which), which the full-row op writes beside a full-row
cache.

Which values the op reads (the q projection's heads; the kv the rows are made of, which an
upstream norm may have produced), how it reads cos/sin, and whether q is RMS-normed
(DeepSeek-V4.1 norms before the q projection, not per head) is decided on probes
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
from prepfuse.fx_passes.matching.axes import base_columns, made_from
from prepfuse.fx_passes.matching.nodes import (
    NoMatch, aten, concrete, expect, graph_order, prims, same_size, shape, val, where,
)
from prepfuse.fx_passes.matching.regions import backward, constants, eps_inputs, expect_no_runtime_floats, is_scale
from prepfuse.fx_passes.matching.rope_operands import emit_table, per_token_operands, rope_forms
from prepfuse.fx_passes.matching.sources import (
    prepared, projection_input, projection_starts, row_sources, weight_like,
)
from prepfuse.fx_passes.matching.writes import (
    ByteRows, RowsWrite, before_cast, byte_rows, first_rows, rows_writes, scale_partner, slot_of, slot_roles,
)
from prepfuse.fx_passes.rewrite import REWRITE_MODULES
from prepfuse.fx_passes.rewrite.cache_views import CacheView, cache_view, emit_slots, probe_roles
from prepfuse.fx_passes.rewrite.compare import Checked, Quantized, e4m3_scaled, ue8m0
from prepfuse.fx_passes.rewrite.emitter import Emitter, viewed_call
from prepfuse.fx_passes.rewrite.probes import Probes
from prepfuse.fx_passes.rewrite.search import Candidate, first_agreeing
from prepfuse.ops import DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, DSV4_QNORM_ROPE_KV_INSERT, SCRATCH
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    CACHE_ROW_BYTES, HEAD_DIM, MXFP8_SCALES, MXFP8_SLOT_BYTES, N_QUANT_BLOCKS, NOPE_DIM, ROPE_DIM, SCALE_BYTES,
    SLOT_BYTES,
)

FULL_ROW_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)  # a full-row cache's rows, as the op writes them
Q_SCRATCH_NAME = "prepfuse_q_out_scratch"
Q_SCRATCH_BASE = "dsv4_qnorm_rope_kv_insert.q_out"
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)  # a prepared q, as the code leaves it
# a q-only call's one-slot cache: never written (no slots), arena memory so no allocation per call
UNUSED_CACHE_NAME = "prepfuse_unused_cache_scratch"
UNUSED_CACHE_BASE = "dsv4_qnorm_rope_kv_insert.unused_k_cache"


@dataclass
class KvSide:
    root: torch.fx.Node  # the cache before its writes
    after: torch.fx.Node  # after them
    sources: list  # the [T, 512] nodes the op could read as kv, latest first
    region: list
    operands: list
    data: ByteRows | None = None  # fp8_ds_mla: the 576-byte rows; MXFP8: the records, or their codes
    scales: ByteRows | None = None  # and their scale bytes (none where MXFP8 records are written whole)
    mxfp8: bool = False  # the byte rows are DeepSeek-V4.1's MXFP8 records
    full_row: CacheView | None = None  # a full-row cache: the rows written whole
    scale: torch.fx.Node | None = None  # an e4m3 full-row cache: the one-value scale of its rows

    @property
    def anchor(self):
        return (self.data.write if self.data is not None else self.full_row.write).write

    @property
    def block_size(self):
        return self.data.block_size if self.data is not None else concrete(self.full_row.sizes[1])

    @property
    def rows(self) -> list:
        """What the code writes (the values the call's math must not read a run-time float into)."""
        if self.data is not None:
            return _byte_rows_written(self.data, self.scales)
        return [first_rows(self.full_row.write)]

    def scale_semantics(self) -> tuple:
        """How the rows may use the scale: ``rows / scale`` or ``rows * scale`` (an e4m3
        full-row cache); none otherwise."""
        return ("divide", "multiply") if self.scale is not None else (None,)

    def probe_limits(self) -> dict:
        """``Probes``'s roles and limits for the slots."""
        if self.full_row is not None:
            return probe_roles(self.full_row)
        return {"roles": slot_roles(self.data), "slots": val(self.root).shape[0] * self.data.block_size,
                "block_size": self.data.block_size}


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
        return (str(DSV4_QNORM_ROPE_KV_INSERT._schema), str(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT._schema),
                str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        kvs = self.scan(lambda: self._kv_sides(graph), "dsv4_kv", graph, [])
        kv_starts = {s for kv in kvs for s in kv.sources}
        qs = self.scan(lambda: self._q_sides(graph, kv_starts), "dsv4_q", graph, [])
        matched = 0
        free = list(kvs)
        for q in qs:
            for kv in [kv for kv in free if any(same_size(_tokens(s), _tokens(q.start.node)) for s in kv.sources)]:
                try:  # one call for both sides where one agrees; else each side alone, below
                    self._fuse(graph, q, kv)
                except Exception:  # noqa: BLE001 - a decline or failure of both: each side alone says why, below
                    continue
                free.remove(kv)
                matched += 1
                break
            else:
                matched += self.attempt(lambda: self._fuse(graph, q, None), "dsv4_q", q.candidates[0].node)
        for kv in free:
            matched += self.attempt(lambda kv=kv: self._fuse(graph, None, kv), _pattern(None, kv), kv.anchor)
        return matched

    # ----------------------------------------------------------------------------------
    def _kv_sides(self, graph) -> list[KvSide]:
        byte, found = {}, []
        for node, w in rows_writes(graph).items():
            if isinstance(w, NoMatch):
                continue
            if val(w.target).dtype in FULL_ROW_DTYPES and shape(w.values)[-1:] == (HEAD_DIM,):
                self.attempt(lambda w=w: found.append(self._full_row_side(w)), "dsv4_kv_full_row", node)
                continue
            if val(w.root).dtype != torch.uint8 or val(w.root).dim() != 2:
                continue
            try:
                byte[node] = byte_rows(w)
            except NoMatch as err:
                if shape(w.values)[-1:] == (CACHE_ROW_BYTES,):
                    self.declined_at("dsv4_kv", node, str(err))
        for node, data in byte.items():
            placed = (data.first, data.pitch, data.width)
            if placed in ((0, MXFP8_SLOT_BYTES, MXFP8_SLOT_BYTES), (0, MXFP8_SLOT_BYTES, HEAD_DIM)):
                self.attempt(lambda data=data: found.append(self._kv_side(data, byte.values(), mxfp8=True)), "dsv4_kv",
                             node)
                continue
            if placed == (HEAD_DIM, MXFP8_SLOT_BYTES, MXFP8_SCALES):
                continue  # an MXFP8 record's scale bytes: read with its codes (``_kv_side``)
            if placed != (0, CACHE_ROW_BYTES, CACHE_ROW_BYTES):
                if CACHE_ROW_BYTES in (data.width, data.pitch) or MXFP8_SLOT_BYTES in (data.width, data.pitch):
                    # a row of these caches' sizes, placed otherwise
                    self.declined_at("dsv4_kv", node, f"write: rows of {data.width} bytes {data.pitch} apart from "
                                                      f"column {data.first}; fp8_ds_mla rows are {CACHE_ROW_BYTES} "
                                                      f"bytes, {CACHE_ROW_BYTES} apart, from 0, MXFP8 records "
                                                      f"{MXFP8_SLOT_BYTES} bytes, as far apart, from 0")
                continue
            self.attempt(lambda data=data: found.append(self._kv_side(data, byte.values())), "dsv4_kv", node)
        return found

    def _kv_side(self, data: ByteRows, writes, mxfp8: bool = False) -> KvSide:
        """fp8_ds_mla rows and their scale bytes after the block's rows; or (``mxfp8``)
        DeepSeek-V4.1's records: 528 bytes a slot written whole, or its 512 codes and, at the
        same slots, its 16 scale bytes right after them."""
        if mxfp8 and data.width == MXFP8_SLOT_BYTES:
            scales, root, after = None, data.write.root, data.write.after
        else:
            scales, root, after = scale_partner(data, writes, MXFP8_SCALES if mxfp8 else SCALE_BYTES,
                                                interleaved=mxfp8)
        sources, region, ops = row_sources(_byte_rows_written(data, scales), HEAD_DIM, avoid={data.write.root})
        expect(sources, f"write: the {'records' if mxfp8 else 'rows'} written at {where(data.write.write)} are not "
                        "made of one [T, 512] tensor")
        return KvSide(root, after, sources, region, ops, data=data, scales=scales, mxfp8=mxfp8)

    def _full_row_side(self, w: RowsWrite) -> KvSide:
        """Whole rows of 512 values a token, bf16 or e4m3 with one scale, written into a
        paged cache (one head)."""
        roles = _row_roles(w)
        expect(roles.count("tokens") == 1, f"write: the rows written at {where(w.write)} address tokens along "
                                           f"{roles.count('tokens')} dims; one token dim expected")
        view = cache_view(w, roles, 1, HEAD_DIM)
        sources, region, ops = row_sources([first_rows(w)], HEAD_DIM, avoid={w.root})
        expect(sources, f"write: the rows written at {where(w.write)} are not made of one [T, 512] tensor")
        scale = _one_scale(ops, f"fp8: the e4m3 rows written at {where(w.write)}") \
            if val(w.target).dtype == torch.float8_e4m3fn else None
        return KvSide(w.root, w.after, sources, region, ops, full_row=view, scale=scale)

    def _q_sides(self, graph, kv_starts) -> list[QSide]:
        if not any(_heads_of_512(n) for n in graph.nodes):
            return []  # a q side is a node of [.., heads, 512]: no graph without one has any
        found = []
        for start in projection_starts(graph, HEAD_DIM, (torch.bfloat16, torch.float16), avoid=kv_starts):
            heads = [p for p in prepared(start, HEAD_DIM, _tokens(start.source), dtypes=(*Q_DTYPES, torch.float32),
                                         tails=True) if len(shape(p.node)) >= 3 and shape(p.node)[-1] == HEAD_DIM]
            cands = [p for p in heads if val(p.node).dtype in Q_DTYPES and per_token_operands(p.operands, weight_like)]
            if cands:
                found.append(QSide(start, cands, cands[0].heads))
            elif heads and heads[0].operands:  # heads of 512 prepared for a reader, but not as the op does: say why
                self.declined_at("dsv4_q", heads[0].node, _not_prepared(heads[0]))
        return _before_attention(found)

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
        limits = kv.probe_limits() if kv is not None else {"roles": {}, "slots": None, "block_size": 1}
        probes = Probes(outputs, **limits, mode=self.validate, memo=self.memo)
        rope_ops = per_token_operands((q.candidates[0].operands if q else []) + (kv.operands if kv else []),
                                      weight_like)
        ropes = [r for r in rope_forms(rope_ops, None, ROPE_DIM, probes.equal_parts,
                                       lambda n: probes.equal_parts(n, pairs=True)) if r.rotary_dim == ROPE_DIM]
        expect(ropes, "rope: no cos/sin for 64 rotated dims among what the rows mix in")
        kv_sources = kv.sources if kv else [None]
        q_nodes = q.candidates if q else [None]
        semantics = kv.scale_semantics() if kv else (None,)
        norms = _q_norms(q)
        cands = [Candidate(f"{_describe(q, kv, r, n, m, qm)}", self._emitter_of(q, p, kv, s, r, n, m, qm))
                 for m in semantics for s in kv_sources for r in ropes for n in norms for p in q_nodes
                 for qm in _q_scale_semantics(p)
                 if q is None or s is None or same_size(_tokens(s), _tokens(q.start.node))]
        expect(cands, "q and kv have different token counts")
        agreed = first_agreeing(probes, cands, lambda: Emitter(graph, point, source=(q.candidates[0].node if q
                                                                                        else kv.anchor), readers=readers))
        for old, new in agreed.result:
            self.replace(old, new)
        self.log.matched(self.name, _pattern(q, kv), q.candidates[0].node if q else kv.anchor,
                         agreed.note(agreed.candidate.name))

    def _emitter_of(self, q, p, kv, kv_src, rope, norm, scaling=None, q_scaling=None):
        apply_q_norm, eps = norm

        def emit_it(emit: Emitter):
            q_scale = _one_scale(p.operands, f"q: the e4m3 q at {where(p.node)}") if q_scaling is not None else None
            expect(q_scale is None or (kv is not None and kv.full_row is not None),
                   "q: an e4m3 q is written by the full-row op, beside a bf16 or e4m3 full-row cache; "
                   "this call writes none")
            # what the call computes must not read a float only the run knows (its fp8 range, eps)
            if q is not None:
                expect_no_runtime_floats(backward([p.node], cut={q.start.node}), {q.start.node}, [q_scale],
                                         [eps] if isinstance(eps, torch.fx.Node) else ())
            if kv is not None:
                expect_no_runtime_floats(backward(kv.rows, cut={kv_src}), {kv_src}, [kv.scale])
            device = val(q.start.source if q else kv.rows[0]).device
            checked, written = [], []
            if q is not None:
                tokens = _token_size(emit, q.start.source)
                q_in = q.start.source if len(shape(q.start.source)) == 3 and shape(q.start.source)[1] == q.heads \
                    else emit.node(aten.reshape.default, q.start.source, [-1, q.heads, HEAD_DIM])
                pads = [pd for pd in (head_padding(u, p.node, HEAD_DIM) for u in p.node.users) if pd is not None]
                padded = pads[0].padded_heads if pads else q.heads
                buffer = pads[0].buffer if pads and pads[0].buffer is not None and \
                    val(pads[0].buffer).stride(-1) == 1 else None
                q_dtype = torch.float8_e4m3fn if q_scale is not None else torch.bfloat16
                q_out = buffer if buffer is not None else emit.scratch(
                    Q_SCRATCH_BASE + (".e4m3" if q_scale is not None else ""), [tokens, padded, HEAD_DIM], q_dtype,
                    q_in, name=Q_SCRATCH_NAME)
            else:
                tokens = _token_size(emit, kv_src)
                q_in = emit.empty([tokens, 0, HEAD_DIM], torch.bfloat16, kv_src)
                q_out = emit.empty([tokens, 0, HEAD_DIM], torch.bfloat16, kv_src)
            if kv is not None:
                kv_in = kv_src if len(shape(kv_src)) == 2 else emit.node(aten.reshape.default, kv_src, [-1, HEAD_DIM])
                if val(kv_in).dtype != torch.bfloat16:  # fp32 the code rounded (a round trip Inductor dropped)
                    kv_in = emit.node(prims.convert_element_type.default, kv_in, torch.bfloat16)
                cache = self.replaced.get(kv.root, kv.root)
                slots = _emit_slots(emit, kv.data) if kv.data is not None else \
                    emit_slots(emit, kv.full_row, _row_roles(kv.full_row.write), [0], device)
                block_size = kv.block_size
            else:
                kv_in = emit.node(aten.select.int, q_in, 1, 0)
                cache = emit.scratch(UNUSED_CACHE_BASE, [1, SLOT_BYTES], torch.uint8, q_in, name=UNUSED_CACHE_NAME)
                slots, block_size = emit.empty([0], torch.int64, q_in), 1
            positions, table = emit_table(emit, rope, tokens, device)
            args = dict(q=q_in, kv=kv_in, q_out=q_out, k_cache=cache, slot_mapping=slots, positions=positions,
                        cos_sin_cache=table, eps=eps, block_size=block_size, wrap_indices=True)
            if not apply_q_norm:  # the schema's defaults left out: the call reads as the common case does
                args["apply_q_norm"] = False
            if kv is not None and kv.full_row is not None:
                kv_scale = kv.scale if scaling != "multiply" else emit.node(aten.reciprocal.default, kv.scale)
                q_scale_inv = None if q_scale is None else \
                    q_scale if q_scaling == "multiply" else emit.node(aten.reciprocal.default, q_scale)
                new_q, new_cache = _full_row_call(emit, args, kv.full_row, cache, kv_scale, q_scale_inv)
            else:
                outs = emit.functional_call(DSV4_QNORM_ROPE_KV_INSERT,
                                            dict(args, kv_mxfp8=True) if kv is not None and kv.mxfp8 else args)
                new_q, new_cache = outs["q_out"], outs["k_cache"]
            if q is not None:
                q_view = new_q if padded == q.heads else emit.node(aten.slice.Tensor, new_q, 1, 0, q.heads)
                q_view = _as_prepared(emit, q_view, p)
                q_before = before_cast(p.node) if q_scale is not None else None
                checked.append(Checked("q_out", p.node, q_view,
                                       before_cast=((q_before, None),) if q_before is not None else ()))
                written.append((p.node, q_view))
                for pd in pads:
                    if pd.padded_heads == padded:
                        checked.append(Checked("q_out (padded)", pd.node, new_q))
                        written.append((pd.node, new_q))
            if kv is not None:
                decode = None if kv.data is None else _mxfp8_records(block_size) if kv.mxfp8 else \
                    _fp8_ds_mla(block_size)
                before = before_cast(kv.full_row.write.values) if kv.scale is not None else None
                checked.append(Checked("k_cache", kv.after, new_cache, decode=decode,
                                       before_cast=((before, None),) if before is not None else ()))
                written.append((kv.after, new_cache))
            return checked, written
        return emit_it


def _before_attention(sides: list[QSide]) -> list[QSide]:
    """The q sides whose start is a projection or reads no other side's q: an attention output
    that the model rotates back before its output projection (DeepSeek-V4's inverse RoPE of
    ``o``) holds heads of 512 too, but it is what attention made of a q."""
    if len(sides) < 2:
        return sides
    order = graph_order(sides[0].start.node.graph)
    qs = {p.node for side in sides for p in side.candidates}
    return [side for side in sides if projection_input(side.start.node) is not None
            or not made_from(qs.difference(p.node for p in side.candidates), order)(side.start.node)]


def _not_prepared(p) -> str:
    """Why heads of 512 a later step reads are not a q the op prepares."""
    if val(p.node).dtype not in Q_DTYPES:
        return (f"q: the heads read at {where(p.node)} are {val(p.node).dtype}; the op writes q as bfloat16 "
                "(or e4m3 beside a full-row cache): round it before attention reads it")
    return f"q: the heads read at {where(p.node)} mix in no per-token cos/sin (no RoPE the op could apply)"


def _as_prepared(emit, q_view, p):
    """The op's ``[T, H, 512]`` q laid out as the prepared node ``p`` is (``[B, H, S, 512]`` ..)."""
    from prepfuse.fx_passes.rewrite.emitter import as_layout

    return as_layout(emit, q_view, p.layout, p.node)


def _heads_of_512(node: torch.fx.Node) -> bool:
    """Whether ``node`` could be a prepared q (``_q_sides``'s candidates): a tensor of three
    or more dims whose last is DeepSeek-V4's head dim."""
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() >= 3 and same_size(v.shape[-1], HEAD_DIM)


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


def _row_roles(w: RowsWrite) -> list[str]:
    """The roles of a full-row write's value dims: the 512 values (``head``), tokens (an
    indexed dim, or one of more than one position), or a dim of one."""
    last = len(shape(w.target)) - 1
    return ["head" if (kind, d) == ("dim", last) else
            "tokens" if kind == "index" or not same_size(shape(w.target)[d], 1) else "one" for kind, d in w.value_dims]


def _byte_rows_written(data: ByteRows, scales: ByteRows | None) -> list:
    """What a byte cache's side writes: its rows (or records, or codes), and their scale
    bytes where they are written apart."""
    return [first_rows(data.write)] + ([scales.rows] if scales is not None else [])


def _q_norms(q: QSide | None) -> list[tuple[bool, float | torch.fx.Node]]:
    """The q norms to try, as ``(apply_q_norm, eps)``: an RMSNorm with each eps-like constant
    q's math holds (or the run-time float it reads as its eps, ``regions.eps_inputs``), and
    none (DeepSeek-V4.1 norms before the q projection); without such a constant, none first,
    then a norm with eps 0."""
    if q is None:
        return [(True, 0.0)]  # the op's default: no q heads to norm
    region = backward([q.candidates[0].node], cut={q.start.node})
    eps_values = eps_inputs(region) or [e for e in constants(region, {q.start.node}, {}) if 0 < e < 0.1]
    if eps_values:
        return [(True, e) for e in eps_values] + [(False, 0.0)]
    return [(False, 0.0), (True, 0.0)]


def _q_scale_semantics(p) -> tuple:
    """How an e4m3 prepared q may use its scale (``q * s`` or ``q / s``); none for bf16 q."""
    return ("multiply", "divide") if p is not None and val(p.node).dtype == torch.float8_e4m3fn else (None,)


def _one_scale(operands, what: str) -> torch.fx.Node:
    """The one one-value scale among ``operands`` (an e4m3 side's: rows or q); ``what`` names
    the side for a decline."""
    scales = [n for n in operands if is_scale(n)]
    expect(len(scales) == 1, f"{what} read {len(scales)} one-value scales; the op takes one")
    return scales[0]


def _full_row_call(emit, args: dict, view: CacheView, cache, kv_scale, q_scale_inv=None) -> tuple:
    """The full-row op's call writing ``view``'s ``[blocks, block_size, 512]`` rows of the
    cache (the graph input itself, or a strided view of it); ``(q_out, the cache after)``."""
    args = dict(args, kv_scale=kv_scale, q_scale_inv=q_scale_inv)
    sizes, strides = [view.sizes[0], view.sizes[1], HEAD_DIM], [view.strides[0], view.strides[1], 1]
    root = val(view.write.root)
    if view.write.target is view.write.root and list(root.shape) == sizes and list(root.stride()) == strides:
        outs = emit.functional_call(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, args)
        return outs["q_out"], outs["k_cache"]
    args.pop("k_cache")
    plain, new = viewed_call(emit, DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, args,
                             {"k_cache": (cache, root.as_strided(sizes, strides, view.offset))})
    return plain["q_out"], new[cache]


def _pattern(q, kv) -> str:
    """The report's name of a call: which sides, and the full-row cache where it writes one."""
    sides = "dsv4_q+kv" if q and kv else ("dsv4_q" if q else "dsv4_kv")
    return sides + ("_full_row" if kv is not None and kv.full_row is not None else "")


def _blocks_by_scale(codes: torch.Tensor, scale_bytes: torch.Tensor) -> Quantized:
    """e4m3 codes ``[..., n * b]`` read with their n blocks' UE8M0 bytes ``[..., n]``: the values
    they stand for (``compare.e4m3_scaled``: where the graph lost the code's bf16 rounding of
    the row, a block's scale may sit one power of two off, its codes with it)."""
    blocks = codes.unflatten(-1, (scale_bytes.shape[-1], -1))
    return e4m3_scaled(blocks, ue8m0(scale_bytes).unsqueeze(-1))


def _fp8_ds_mla(block_size: int):
    """The decoder of an fp8_ds_mla cache ``[NB, S]`` for comparison: NoPE codes as the values
    they stand for with their blocks' scales, RoPE values as bf16, scale bytes (within one
    step) and the rest as bytes."""
    def decode(cache: torch.Tensor) -> dict:
        nb = cache.shape[0]
        data = cache[:, : block_size * CACHE_ROW_BYTES].reshape(nb, block_size, CACHE_ROW_BYTES)
        scales = cache[:, block_size * CACHE_ROW_BYTES: block_size * SLOT_BYTES].reshape(nb, block_size, -1)
        codes = data[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn)
        return {"NoPE values": _blocks_by_scale(codes, scales[..., :N_QUANT_BLOCKS].contiguous()),
                "RoPE values": data[..., NOPE_DIM:].contiguous().view(torch.bfloat16),
                "scale bytes": cache[:, block_size * CACHE_ROW_BYTES:].contiguous()}
    return decode


def _mxfp8_records(block_size: int):
    """The decoder of a cache of MXFP8 records ``[NB, S]`` for comparison: codes as the values
    they stand for with their blocks' scales, scale bytes (within one step) and the rest as
    bytes."""
    def decode(cache: torch.Tensor) -> dict:
        nb = cache.shape[0]
        records = cache[:, : block_size * MXFP8_SLOT_BYTES].reshape(nb, block_size, MXFP8_SLOT_BYTES)
        scales = records[..., HEAD_DIM:].contiguous()
        return {"values": _blocks_by_scale(records[..., :HEAD_DIM].contiguous().view(torch.float8_e4m3fn), scales),
                "scale bytes": scales,
                "bytes past the records": cache[:, block_size * MXFP8_SLOT_BYTES:].contiguous()}
    return decode


def _describe(q, kv, rope, norm, scaling=None, q_scaling=None) -> str:
    sides = "q and kv" if q and kv else ("q" if q else "kv")
    text = f"DeepSeek-V4 {sides}, GPT-J RoPE on {rope.describe()}"
    if q:
        text += (f", RMSNorm eps read when the graph runs ({where(norm[1])})" if isinstance(norm[1], torch.fx.Node)
                 else f", RMSNorm eps {norm[1]:g}") if norm[0] else ", no q norm"
    text += ", MXFP8 records" if kv is not None and kv.mxfp8 else ""
    text += {None: "", "divide": ", e4m3 q / q_scale", "multiply": ", e4m3 q * a scale"}[q_scaling]
    return text + {None: "", "divide": ", e4m3 rows / kv_scale", "multiply": ", e4m3 rows * a scale"}[scaling]
