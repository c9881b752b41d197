"""Find DeepSeek-V4 indexer preparation by what it writes, and call the fused op of its format.

One pass body over a formats table (``FORMATS``): FP8 (``prepfuse::dsv4_indexer_rope_fp8_insert``,
pass ``fuse_dsv4_indexer_prep``) and MXFP4 (``prepfuse::dsv4_indexer_rope_mxfp4_insert``,
pass ``fuse_dsv4_indexer_mxfp4_prep``)::

    FP8:   y = bf16(rope_tail(q)); e = ceil(log2(max(amax(|y|), 1e-4) / 448)); q_fp8 = e4m3(y * 2^-e)
           w_out = weights.float() * 2^e * weights_scale          (the scale folded into the weights)
           cache slot: 128 code bytes, one fp32 scale (132 B)
    MXFP4: y = bf16(rope_tail(q)); per 32-block e = ceil(log2(max(amax, 6 * 2^-126) / 6)); e2m1
           nibbles packed two a byte; q_scale = (e + 127).to(uint8); w_out = weights.float() * c
           cache slot: 64 packed bytes, 4 UE8M0 bytes (68 B)

The k side is found from its cache writes (the format's data rows and the write of their 4
scale bytes at the same slots: ``writes.byte_rows``, ``writes.scale_partner``); the q side
from the format's quantised q: heads of 128 values of a projection carried per token and
head (``sources.prepared``) to the codes (and MXFP4's scale bytes) a later step reads. The
weights product is FP8's carried node of q's tokens and heads (the fold reads q's
exponent); MXFP4's has no data link to q, so a q call takes the first unclaimed ``[T, H]``
fp32 product of a ``[T, H]`` input and a constant. Which math that is (the sources, the
rotation's cos/sin, the weights scale) is decided on probes, as every family does.

A q side and a k side share one call when they read one cos/sin table (the op has one)
and a call of both agrees; otherwise each gets a call of its own, with an empty other side.
Two layers writing one cache: the second call reads the first call's written cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.matching import MATCHING_MODULES
from prepfuse.fx_passes.matching.axes import base_columns
from prepfuse.fx_passes.matching.nodes import (
    NoMatch, aten, expect, graph_order, is_op, prims, same_size, shape, val, where,
)
from prepfuse.fx_passes.matching.regions import backward, expect_no_runtime_floats, leaves, operands
from prepfuse.fx_passes.matching.rope_operands import RopeOperand, emit_table, per_token_operands, rope_forms
from prepfuse.fx_passes.matching.sources import dim_roles, prepared, projection_starts, row_sources, weight_like
from prepfuse.fx_passes.matching.writes import (
    ByteRows, byte_rows, first_rows, rows_writes, scale_partner, slot_of, slot_roles,
)
from prepfuse.fx_passes.rewrite import REWRITE_MODULES
from prepfuse.fx_passes.rewrite.compare import Checked, Exact, Quantized, e4m3_scaled, ue8m0
from prepfuse.fx_passes.rewrite.emitter import Emitter, as_layout
from prepfuse.fx_passes.rewrite.probes import Probes
from prepfuse.fx_passes.rewrite.search import Candidate, first_agreeing
from prepfuse.ops import DSV4_INDEXER_ROPE_FP8_INSERT, DSV4_INDEXER_ROPE_MXFP4_INSERT, SCRATCH
from prepfuse.ops.dsv4_indexer_common import HEAD_DIM, MXFP4_BLOCK, MXFP4_BLOCKS, MXFP4_PACKED, ROPE_DIM

__all__ = ["FORMATS", "IndexerFormat", "FuseDsv4IndexerPrepPass", "FuseDsv4IndexerMxfp4PrepPass"]

SCALE_BYTES = 4


@dataclass(frozen=True)
class IndexerFormat:
    """What differs between the indexer's cache formats; the pass body reads only this."""

    name: str  # "fp8" | "mxfp4"
    op: torch._ops.OpOverload
    pattern: str  # prefix of the report's pattern names
    data_bytes: int  # bytes of a k row's codes in the cache
    slot_bytes: int  # bytes of a slot: codes, then scale bytes
    # q's outputs: (name, values per head, dtype); weights_out is common
    q_outputs: tuple[tuple[str, int, torch.dtype], ...]
    weights_from_q: bool  # FP8 folds q's scale into the weights product: found from q
    node_prefix: str  # the scratch nodes' names in debug dumps and golden graphs

    @property
    def op_name(self) -> str:
        return self.op._schema.name.split("::", 1)[1]


FORMATS = {
    "fp8": IndexerFormat("fp8", DSV4_INDEXER_ROPE_FP8_INSERT, "dsv4_indexer", HEAD_DIM, HEAD_DIM + SCALE_BYTES,
                         (("q_out", HEAD_DIM, torch.float8_e4m3fn),), True, "prepfuse_indexer_"),
    "mxfp4": IndexerFormat("mxfp4", DSV4_INDEXER_ROPE_MXFP4_INSERT, "dsv4_indexer_mxfp4", MXFP4_PACKED,
                           MXFP4_PACKED + SCALE_BYTES, (("q_out", MXFP4_PACKED, torch.uint8),
                                                        ("q_scale", MXFP4_BLOCKS, torch.uint8)),
                           False, "prepfuse_indexer_mxfp4_"),
}


@dataclass
class KSide:
    data: ByteRows
    root: torch.fx.Node
    after: torch.fx.Node
    sources: list  # [Tk, 128] nodes the op could read as k, latest first
    operands: list

    @property
    def anchor(self):
        return self.data.write.write


@dataclass
class QSide:
    start: object  # sources.Start: heads of 128 of the q projection
    heads: int
    outputs: dict  # output name -> sources.Prepared (the node a later step reads)
    operands: list
    weights: tuple | None  # (the weights product node, the weights input, its constants)

    @property
    def anchor(self):
        return next(iter(self.outputs.values())).node


class _FuseDsv4IndexerPass(PrepfusePass):
    """Rewrites indexer preparation of ``fmt`` into calls of its op; the log names each
    ``<pattern>_q+k``, ``<pattern>_q`` or ``<pattern>_k``."""

    fmt: IndexerFormat
    uuid_sources = (*MATCHING_MODULES, *REWRITE_MODULES)
    canonical_graph = True

    def settings(self) -> tuple:
        return (str(self.fmt.op._schema), str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        ks = self.scan(lambda: self._k_sides(graph), "dsv4_indexer_k", graph, [])
        qs = self.scan(lambda: self._q_sides(graph, {s for k in ks for s in k.sources}), "dsv4_indexer_q", graph, [])
        claimed: set = set()
        matched, free = 0, list(ks)
        for q in qs:
            for k in free:
                try:  # one call of both sides where one agrees; else q alone
                    self._fuse(graph, q, k, claimed)
                except Exception:  # noqa: BLE001 - a decline or failure of both: each side alone says why, below
                    continue
                free.remove(k)
                matched += 1
                break
            else:
                matched += self.attempt(lambda q=q: self._fuse(graph, q, None, claimed), self._pattern(q, None),
                                        q.anchor)
        for k in free:
            matched += self.attempt(lambda k=k: self._fuse(graph, None, k, claimed), self._pattern(None, k), k.anchor)
        return matched

    def _pattern(self, q, k) -> str:
        return f"{self.fmt.pattern}_" + ("q+k" if q and k else ("q" if q else "k"))

    # ----------------------------------------------------------------------------------
    def _k_sides(self, graph) -> list[KSide]:
        byte = {}
        for node, w in rows_writes(graph).items():
            if isinstance(w, NoMatch) or val(w.root).dtype != torch.uint8 or val(w.root).dim() != 2:
                continue
            try:
                byte[node] = byte_rows(w)
            except NoMatch as err:
                if shape(w.values)[-1:] == (self.fmt.data_bytes,) and is_op(w.write, aten.index_put.default):
                    self.declined_at(self._pattern(None, 1), node, str(err))
        found = []
        for node, data in byte.items():
            if (data.first, data.pitch, data.width) != (0, self.fmt.data_bytes, self.fmt.data_bytes):
                if data.width == self.fmt.data_bytes:  # a row of this format's size, placed otherwise
                    self.declined_at(self._pattern(None, 1), node,
                                     f"write: rows of {data.width} bytes {data.pitch} apart from column {data.first}; "
                                     f"{self.fmt.name} rows are {data.width} bytes, {data.width} apart, from 0")
                continue
            self.attempt(lambda data=data: found.append(self._k_side(data, byte.values())), self._pattern(None, 1),
                         node)
        return found

    def _k_side(self, data: ByteRows, writes) -> KSide:
        scales, root, after = scale_partner(data, writes, SCALE_BYTES)
        sources, _, ops = row_sources([first_rows(data.write), scales.rows], HEAD_DIM, avoid={data.write.root})
        expect(sources, f"write: the rows written at {where(data.write.write)} are not made of one [Tk, 128] tensor")
        expect(data.write.after.users or scales.write.after.users, "write: nothing reads the written cache")
        return KSide(data, root, after, sources, ops)

    def _q_sides(self, graph, k_sources) -> list[QSide]:
        found = []
        _, width, dtype = next(o for o in self.fmt.q_outputs if o[0] == "q_out")
        if not any(isinstance(v := val(n), torch.Tensor) and v.dtype == dtype and v.shape[-1:] == (width,)
                   for n in graph.nodes):
            return found  # no tensor a prepared q could be: nothing to trace
        for start in projection_starts(graph, HEAD_DIM, (torch.bfloat16, torch.float32), avoid=k_sources):
            tokens = base_columns(start.source, HEAD_DIM)[0]
            outputs = {}
            for name, width, dtype in self.fmt.q_outputs:
                cands = [p for p in prepared(start, HEAD_DIM, tokens, dtypes=(dtype,)) if shape(p.node)[-1] == width]
                if cands:
                    outputs[name] = cands[0]
            if "q_out" not in outputs:
                continue
            heads = outputs["q_out"].heads
            ops = outputs["q_out"].operands
            found.append(QSide(start, heads, outputs, ops, self._weights_of(start, tokens, heads) if
                               self.fmt.weights_from_q else None))
        return found

    def _weights_of(self, start, tokens, heads):
        """FP8's weights product: a ``[T, H]`` fp32 node carried from q (its exponent) that
        multiplies a ``[T, H]`` input (``weights``) by constants."""
        for p in prepared_products(start, tokens, heads):
            return p
        return None

    # ----------------------------------------------------------------------------------
    def _fuse(self, graph, q: QSide | None, k: KSide | None, claimed: set) -> None:
        fmt = self.fmt
        weights = q.weights if q and q.weights else (_claim_product(graph, q, claimed) if q else None)
        outputs = ([p.node for p in q.outputs.values()] if q else []) + ([weights[0]] if weights else []) + \
            ([k.after] if k else [])
        readers = [u for o in outputs for u in o.users]
        expect(readers, "nothing reads what the preparation makes")
        sources = ({q.start.node} if q else set()) | (set(k.sources) if k else set()) | \
            ({weights[1]} if weights else set())
        expect_no_runtime_floats(backward(outputs, cut=sources), sources)  # the weights scale, the fp8 range: numbers
        order = graph_order(graph)
        point = min(readers, key=order.__getitem__)
        roles = {}
        if k is not None:
            roles.update(slot_roles(k.data))
        probes = Probes(outputs, roles, slots=(val(k.root).shape[0] * k.data.block_size) if k else None,
                        block_size=k.data.block_size if k else None, mode=self.validate, memo=self.memo)
        q_ropes = self._ropes(probes, q.operands) if q else [None]
        k_ropes = self._ropes(probes, k.operands) if k else [None]
        pairs = [(qr, kr) for qr in q_ropes for kr in k_ropes
                 if qr is None or kr is None or (qr.kind == kr.kind == "table" and qr.cos is kr.cos
                                                 and qr.columns == kr.columns)]
        expect(pairs, "rope: q and k read different cos/sin tables; the op reads one")
        scales = _scale_candidates(weights)
        cands = [Candidate(_describe(fmt, q, k, qr or kr, c), self._emitter_of(q, k, src, qr, kr, weights, c))
                 for src in (k.sources if k else [None]) for qr, kr in pairs for c in scales]
        agreed = first_agreeing(probes, cands, lambda: Emitter(graph, point, source=q.anchor if q else k.anchor,
                                                               readers=readers))
        if weights is not None:
            claimed.add(weights[0])
        for old, new in agreed.result:
            self.replace(old, new)
        self.log.matched(self.name, self._pattern(q, k), q.anchor if q else k.anchor,
                         agreed.note(agreed.candidate.name))

    def _ropes(self, probes, ops) -> list[RopeOperand]:
        forms = rope_forms(per_token_operands(ops, weight_like), None, ROPE_DIM, probes.equal_parts,
                           lambda n: probes.equal_parts(n, pairs=True))
        forms = [r for r in forms if r.rotary_dim == ROPE_DIM]
        expect(forms, "rope: no cos/sin for 64 rotated dims among what the rows mix in")
        return forms

    def _emitter_of(self, q, k, k_src, q_rope, k_rope, weights, scale):
        fmt = self.fmt

        def emit_it(emit: Emitter):
            like = q.start.source if q else k_src
            device = val(like).device
            written, checked = [], []
            if q is not None:
                tokens = _token_size(emit, q.start.source)
                q_in = _heads(emit, q.start.source, q.heads)
                heads = q.heads
            else:
                tokens, heads = 0, 1
                q_in = emit.empty([0, 1, HEAD_DIM], torch.bfloat16, like)
            if k is not None:
                k_in = _bf16(emit, k_src if len(shape(k_src)) == 2 else emit.node(aten.reshape.default, k_src,
                                                                                   [-1, HEAD_DIM]))
                slot = slot_of(k.data)
                slots = slot if slot is not None else emit.node(
                    aten.add.Tensor, emit.node(aten.mul.Tensor, k.data.block, k.data.block_size), k.data.row)
                k_cache, block_size = self.replaced.get(k.root, k.root), k.data.block_size
                k_tokens = _token_size(emit, k_src)
            else:
                k_in = emit.empty([0, HEAD_DIM], torch.bfloat16, like)
                slots = emit.empty([0], torch.int64, like)
                k_cache = emit.scratch(f"{fmt.op_name}.unused_k_cache", [1, fmt.slot_bytes], torch.uint8, like,
                                       name=f"{fmt.node_prefix}unused_k_cache_scratch")
                block_size, k_tokens = 1, 0
            q_in = _bf16(emit, q_in)
            # one table: the gathered one both sides read, or a side's own per-token one
            if q_rope is not None and k_rope is not None:
                positions, table = emit_table(emit, q_rope, tokens, device)
                k_positions = k_rope.positions
            elif q_rope is not None:
                positions, table = emit_table(emit, q_rope, tokens, device)
                k_positions = emit.empty([0], torch.int64, like)
            else:
                k_positions, table = emit_table(emit, k_rope, k_tokens, device)
                positions = emit.empty([0], torch.int64, like)
            if weights is not None:
                w_in = weights[1]
            else:
                w_in = emit.empty([tokens, heads], torch.float32, like)
            outs = {name: emit.scratch(f"{fmt.op_name}.{name}", [tokens, heads, cols], dtype, like,
                                       name=f"{fmt.node_prefix}{name}_scratch") for name, cols, dtype in fmt.q_outputs}
            outs["weights_out"] = emit.scratch(f"{fmt.op_name}.weights_out", [tokens, heads], torch.float32, like,
                                               name=f"{fmt.node_prefix}weights_out_scratch")
            args = dict(q=q_in, weights=w_in, k=k_in, **outs, k_cache=k_cache, slot_mapping=slots, positions=positions,
                        k_positions=k_positions, cos_sin_cache=table, weights_scale=scale, block_size=block_size,
                        wrap_indices=True)
            new = emit.functional_call(fmt.op, args)
            w_out = None
            if weights is not None:
                w_out = new["weights_out"]
                if tuple(shape(w_out)) != tuple(shape(weights[0])):
                    w_out = emit.node(aten.reshape.default, w_out, list(shape(weights[0])))
            # FP8 folds each q row's power-of-two scale into its weight: a bf16 rounding the
            # graph lost (torch 2.11's Inductor drops `.to(bf16).float()`) can move a row's amax
            # across a power of two, and its codes and its weight move by 2 each way: the codes
            # are compared as the logits kernel reads them, times their weight, and each weight
            # within a power of two of the code's.
            folded = fmt.weights_from_q and q is not None and w_out is not None
            if q is not None:
                outs = {name: as_layout(emit, new[name], p.layout, p.node) for name, p in q.outputs.items()}
                for name, p in q.outputs.items():
                    if folded and name == "q_out":
                        checked.append(Checked(name, p.node, outs[name], decode=_fp8_codes_by_weight,
                                               scales=(weights[0], w_out)))
                    elif val(outs[name]).dtype != torch.uint8:
                        checked.append(Checked(name, p.node, outs[name]))
                    elif name == "q_out":  # MXFP4 nibbles, read with their blocks' scale bytes
                        scales = (q.outputs["q_scale"].node, outs["q_scale"])
                        checked.append(Checked(name, p.node, outs[name], decode=_mxfp4_q, scales=scales))
                    else:
                        checked.append(Checked(name, p.node, outs[name], decode=_block_scales))
                    written.append((p.node, outs[name]))
            if weights is not None:
                if folded:
                    checked.append(Checked("weights_out", weights[0], w_out, decode=_weights_by_row_scale))
                else:
                    checked.append(Checked("weights_out", weights[0], w_out))
                written.append((weights[0], w_out))
            if k is not None:
                checked.append(Checked("k_cache", k.after, new["k_cache"], decode=_cache_decoder(fmt, block_size)))
                written.append((k.after, new["k_cache"]))
            return checked, written
        return emit_it


class FuseDsv4IndexerPrepPass(_FuseDsv4IndexerPass):
    """The FP8 indexer format: ``prepfuse::dsv4_indexer_rope_fp8_insert``."""

    name = "fuse_dsv4_indexer_prep"
    fmt = FORMATS["fp8"]


class FuseDsv4IndexerMxfp4PrepPass(_FuseDsv4IndexerPass):
    """The MXFP4 indexer format: ``prepfuse::dsv4_indexer_rope_mxfp4_insert``."""

    name = "fuse_dsv4_indexer_mxfp4_prep"
    fmt = FORMATS["mxfp4"]


# --------------------------------------------------------------------------------------
def prepared_products(start, tokens, heads) -> list[tuple]:
    """FP8's fold: ``[T, H]`` fp32 nodes carried from q's heads whose region reads a
    ``[T, H]`` float input besides q (the weights): ``(product, weights, constants)``."""
    from prepfuse.fx_passes.matching.axes import base_layout, carry
    from prepfuse.fx_passes.matching.layouts import Layout

    base = base_layout(start.node, HEAD_DIM)
    carried = carry(start.node, base, HEAD_DIM, lambda n: False) if base is not None else {}
    found = []
    for node, layout in carried.items():
        v = val(node)
        if not isinstance(layout, Layout) or not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            continue
        roles = dim_roles(layout, HEAD_DIM)
        if roles is None or "head" in roles or all(u in carried for u in node.users):
            continue
        w = _weights_input(backward([node]), {start.node}, tokens, heads)
        if w is not None:
            found.append((node, w[0], w[1]))
    order = graph_order(start.node.graph)
    return sorted(found, key=lambda p: -order[p[0]])


def _weights_input(region, sources, tokens, heads):
    ops = operands(region, sources, {}) if sources else leaves(region)
    cands = [n for n in ops if isinstance(val(n), torch.Tensor) and val(n).dtype.is_floating_point
             and len(shape(n)) == 2 and same_size(shape(n)[0], tokens) and same_size(shape(n)[1], heads)]
    if len(cands) != 1:
        return None
    weights = cands[0]
    # the op widens bf16 weights itself: read them as they are, not a widening copy
    if is_op(weights, prims.convert_element_type.default) and val(weights).dtype == torch.float32 \
            and val(weights.args[0]).dtype in (torch.bfloat16, torch.float32):
        weights = weights.args[0]
    consts = [a for n in region for a in n.args if isinstance(a, float)]
    return weights, consts


def _claim_product(graph, q: QSide, claimed: set):
    """MXFP4's weights product: the first unclaimed ``[T, H]`` fp32 node made from one
    ``[T, H]`` input and constants only."""
    tokens = base_columns(q.start.source, HEAD_DIM)[0]
    for node in graph.nodes:
        v = val(node)
        if node in claimed or not is_op(node, aten.mul.Tensor) or not isinstance(v, torch.Tensor) \
                or v.dtype != torch.float32 or len(shape(node)) != 2:
            continue
        if not (same_size(shape(node)[0], tokens) and same_size(shape(node)[1], q.heads)):
            continue
        region = backward([node])
        w = _weights_input(region, set(), tokens, q.heads)
        if w is not None and len(leaves(region)) == 1:
            return node, w[0], w[1]
    return None


def _scale_candidates(weights) -> list[float]:
    if weights is None:
        return [1.0]
    consts = [c for c in weights[2] if c not in (1.0,)]
    product = 1.0
    for c in consts:
        product *= c
    found = [product] + consts + [1.0]
    return list(dict.fromkeys(found))


def _heads(emit, source, heads):
    if len(shape(source)) == 3 and shape(source)[1] == heads:
        return source
    return emit.node(aten.reshape.default, source, [-1, heads, HEAD_DIM])


def _bf16(emit, node):
    """The op reads bf16: an fp32 value the code rounded (a round trip Inductor dropped) is cast."""
    if val(node).dtype == torch.bfloat16:
        return node
    return emit.node(prims.convert_element_type.default, node, torch.bfloat16)


def _token_size(emit, node):
    """The tokens of a ``[.., H, 128]`` or ``[.., 128]`` source as the call's size."""
    sizes = shape(node)
    lead = len(sizes) - 2 if len(sizes) >= 3 and sizes[-1] == HEAD_DIM else len(sizes) - 1
    return emit.count(node, range(lead))


# e2m1 magnitude codes 0..7: the value each stands for, and the grid's step up from it
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_STEPS = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0)


def _mxfp4_values(packed: torch.Tensor, scale_bytes: torch.Tensor) -> Quantized:
    """Packed e2m1 bytes ``[..., 16 n]`` (even element in the low nibble, bit 3 the sign) with
    their blocks' UE8M0 bytes ``[..., n]`` as values ``[..., n, 32]`` and their steps (a 0xFF
    block, non-finite, is NaN)."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    nibbles = nibbles.unflatten(-1, (scale_bytes.shape[-1], MXFP4_BLOCK))
    magnitude = nibbles & 7
    sign = 1.0 - 2.0 * (nibbles >> 3).float()
    scale = ue8m0(scale_bytes).unsqueeze(-1)
    values, steps = torch.tensor(_E2M1_VALUES), torch.tensor(_E2M1_STEPS)
    return Quantized(values[magnitude] * sign * scale, steps[magnitude] * scale)


def _mxfp4_q(packed: torch.Tensor, scale_bytes: torch.Tensor) -> dict:
    """MXFP4 codes: the blocks of unrotated dims (0..63, bytes 0..31) bit for bit (the bf16
    input scaled by a power of two: only the tie and sign rules can differ there), the rotated
    ones as the values they stand for (``compare.Quantized``)."""
    nope = (HEAD_DIM - ROPE_DIM) // 2
    nope_blocks = nope // (MXFP4_BLOCK // 2)
    return {"unrotated blocks": Exact(packed[..., :nope]),
            "rotated values": _mxfp4_values(packed[..., nope:], scale_bytes[..., nope_blocks:])}


def _fp8_scaled(codes: torch.Tensor, scale: torch.Tensor) -> Quantized:
    """e4m3 ``codes`` [..., 128] times their row's ``scale`` [...] (``compare.e4m3_scaled``)."""
    return e4m3_scaled(codes, scale.unsqueeze(-1))


def _rows(q: torch.Tensor, per_row: torch.Tensor):
    """``q`` as [rows, 128] and ``per_row`` as [rows], or None where they do not pair up."""
    if q.numel() % HEAD_DIM or per_row.numel() != q.numel() // HEAD_DIM:
        return None
    if q.dtype == torch.uint8:  # the codes' bytes
        q = q.view(torch.float8_e4m3fn)
    return q.reshape(-1, HEAD_DIM), per_row.reshape(-1)


def _fp8_codes_by_weight(q: torch.Tensor, weights: torch.Tensor):
    """FP8 q codes as the logits kernel reads them: each row times its weight (which holds
    the row's scale); the codes alone where the two do not pair up."""
    rows = _rows(q, weights)
    return {"codes times their weight": _fp8_scaled(*rows)} if rows else {"codes": q}


def _scales_within_a_step(scales: torch.Tensor, what: str) -> dict:
    """Per-row power-of-two scales (or weights holding one), each on its own (a trailing dim
    of one: no slack from a larger neighbour) and allowed one power of two either way and no
    further: half its magnitude, so that x2 and x1/2 pass and x4 does not (the codes,
    compared times their scale, pay for the move)."""
    one = scales.float().unsqueeze(-1)
    return {what: Quantized(one, one.abs() / 2)}


def _weights_by_row_scale(weights: torch.Tensor) -> dict:
    return _scales_within_a_step(weights, "weights, a power of two apart at most")


def _block_scales(scales: torch.Tensor) -> dict:
    """UE8M0 scale bytes of MXFP4 blocks: the unrotated blocks' bit for bit (their amax is
    the input's), the rotated ones' within one step."""
    nope = (HEAD_DIM - ROPE_DIM) // (HEAD_DIM // MXFP4_BLOCKS)
    return {"unrotated blocks": Exact(scales[..., :nope]), "rotated blocks": scales[..., nope:]}


def _cache_decoder(fmt: IndexerFormat, block_size: int):
    def decode(cache: torch.Tensor) -> dict:
        nb = cache.shape[0]
        data = cache[:, : block_size * fmt.data_bytes].reshape(nb, block_size, fmt.data_bytes)
        scales = cache[:, block_size * fmt.data_bytes: block_size * fmt.slot_bytes].reshape(nb, block_size, SCALE_BYTES)
        rest = cache[:, block_size * fmt.slot_bytes:].contiguous()
        if fmt.name == "fp8":  # a row's codes with its scale: a lost rounding moves both (q's note)
            codes, row_scales = data.contiguous().view(torch.float8_e4m3fn), scales.contiguous().view(torch.float32)
            return {"values": _fp8_scaled(codes, row_scales.squeeze(-1)),
                    **_scales_within_a_step(row_scales, "scales, a power of two apart at most"), "rest": rest}
        data, scales = data.contiguous(), scales.contiguous()
        return {**{f"codes ({k})": v for k, v in _mxfp4_q(data, scales).items()},
                **{f"scales ({k})": v for k, v in _block_scales(scales).items()}, "rest": rest}
    return decode


def _describe(fmt, q, k, rope, scale) -> str:
    sides = "q and k" if q and k else ("q" if q else "k")
    return f"the {fmt.name.upper()} indexer's {sides}, GPT-J RoPE on {rope.describe()}, weights scale {scale:g}"
