"""Find GQA (Qwen3 / Llama / Gemma ...) attention-input preparation by what it writes, and
call the fused op instead.

Anchors are the writes into KV caches (``writes.RowsWrite``: any index assignment,
``index_copy_``, scatter or slice assignment of ``[.., Hkv, D]`` rows into a graph input).
Each write's values are traced back to the projection columns they are made from
(``sources.trace``: logical axes, so any layout and view spelling); a write whose values
take per-token operands (cos/sin, however made) is a k write, one whose values are the
columns as they are (maybe quantised) a v write. k and v writes to the same slots pair
up; q is the prepared tensor made the same way from the q columns (of the same fused qkv,
or of a separate projection of the same input) that a later step reads.

Which math that is (RoPE style and operands, norm form, eps, kv scale, fp8 overflow) is
decided on probes (``search.first_agreeing``): candidate calls of
``prepfuse::gqa_qknorm_rope_kv_insert`` (or ``gqa_separate_qknorm_rope_kv_insert``) are
emitted one by one (``gqa_calls.py``), first checked against the k and v writes, then the
agreeing one against the q candidates; the call that computes the region replaces it.
A decline names the closest candidate and the first value where it differs.

Numerics: the op rounds once in fp32 where the model may round in bf16 (Hugging Face's
RoPE with bf16 cos/sin: ``2^-7 (|a| + |b|)`` at most per rotated pair); the probes' bound
admits that and nothing structural (``rewrite/compare.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isfinite

import torch
import torch.fx

from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.fusion import gqa_calls
from prepfuse.fx_passes.fusion.gqa_calls import Math, math_candidates
from prepfuse.fx_passes.matching import MATCHING_MODULES, engine_writes, head_copies
from prepfuse.fx_passes.matching.layouts import Layout
from prepfuse.fx_passes.matching.nodes import (
    NoMatch, aten, expect, graph_order, divides, is_op, prims, same_size, shape, slice_params, val, where,
)
from prepfuse.fx_passes.matching.regions import (backward, constants, eps_inputs, expect_no_runtime_floats,
                                                  is_scale, operands)
from prepfuse.fx_passes.matching.rope_operands import emit_rope, per_token_operands, rope_forms
from prepfuse.fx_passes.matching.sources import (
    Start, Traced, column_starts, copy_start, dim_roles, heads_of, is_copy, prepared, projection_input, token_dims_order,
    trace, unpadded_rows, weight_like,
)
from prepfuse.fx_passes.matching.writes import RowsWrite, before_cast, first_rows, rows_writes
from prepfuse.fx_passes.rewrite import REWRITE_MODULES
from prepfuse.fx_passes.rewrite.by_layer import settle
from prepfuse.fx_passes.rewrite.cache_views import CacheView, cache_view, emit_slots, probe_roles
from prepfuse.fx_passes.rewrite.compare import Checked
from prepfuse.fx_passes.rewrite.emitter import Emitter, as_layout, viewed_call
from prepfuse.fx_passes.rewrite.probes import Probes
from prepfuse.fx_passes.rewrite.search import Candidate, first_agreeing
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT, GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, SCRATCH
from prepfuse.ops.gqa_qknorm_rope_kv_insert import HEAD_DIMS

PATTERN = "gqa"
Q_SCRATCH_NAME = "prepfuse_gqa_q_out_scratch"
# the products a projection's rows come from (``_float_sources``)
_PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


@dataclass
class KvWrite:
    """One write of ``[.., Hkv, D]`` rows into a cache, traced to its source columns."""

    write: RowsWrite
    traced: Traced
    roles: list[str]  # of the written values' dims
    token_order: list[int]  # the values' token dims, outer first
    heads: int
    head_dim: int
    view: CacheView
    operands: list[torch.fx.Node]  # what its math reads besides the source
    region: list[torch.fx.Node]
    rotated: bool  # its math reads per-token operands: a k write

    @property
    def start(self):
        return self.traced.start

    @property
    def tokens(self):
        return self.start.tokens


@dataclass
class Q:
    start: object  # sources.Start
    prepared: torch.fx.Node  # what later steps read
    layout: Layout
    heads: int
    weight: torch.fx.Node | None
    tail: bool = False  # a view or scaling of it is what later steps read (``sources.prepared``)


class FuseGqaPrepPass(PrepfusePass):
    """Rewrites GQA preparation into ``GQA_QKNORM_ROPE_KV_INSERT`` calls (separate
    projections: ``GQA_SEPARATE_QKNORM_ROPE_KV_INSERT``); ``matched_count`` is the calls made."""

    name = "fuse_gqa_prep"
    uuid_sources = (gqa_calls, *MATCHING_MODULES, *REWRITE_MODULES)
    canonical_graph = True

    def settings(self) -> tuple:
        return (str(GQA_QKNORM_ROPE_KV_INSERT._schema), str(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT._schema),
                str(SCRATCH._schema), engine_writes.declarations())

    def compile_state(self) -> tuple:
        return engine_writes.layout_keys()

    def run(self, graph: torch.fx.Graph) -> int:
        lifted = engine_writes.lift(graph, lambda node, why: self.log.declined(self.name, PATTERN, node, why))
        try:
            copies = self.scan(lambda: self._head_copies(graph), PATTERN, graph, [])
            try:
                return self._run(graph)
            finally:
                head_copies.undo(copies)
        finally:
            for write in (w for one in lifted for w in one.writes):
                self.replaced.pop(write, None)  # the probe form goes with ``settle``
            settle(graph, lifted, self._engine_declined)

    def _engine_declined(self, one: engine_writes.Lifted) -> None:
        """An engine write no call fused: said against the engine's call, with the reason
        given at its lifted k or v write (which ``settle`` removes)."""
        anchors = {w.format_node() for w in one.writes}
        mine = [e for e in self.log.events if e.kind == "declined" and e.where in anchors]
        self.log.events = [e for e in self.log.events if e not in mine]
        why = mine[-1].why if mine else "no GQA preparation (q, rotated k, v of one projection) writes its rows"
        self.log.declined(self.name, PATTERN, one.node, f"engine write {one.engine.name} at {where(one.node)}: "
                                                        f"not fused ({why}); left to the engine")

    def _head_copies(self, graph) -> list:
        """Copies of heads laid out strided apart in a projection (GPT-NeoX's per-head q|k|v),
        for each head dim a cache write takes (``head_copies``)."""
        # a symbolic width is no head dim the op takes (and a SymInt is not hashable)
        dims = {shape(w.values)[-1] for w in rows_writes(graph).values()
                if not isinstance(w, NoMatch) and isinstance(shape(w.values)[-1], int)}
        sources = _float_sources(graph)
        return [c for d in sorted(dims) if d in HEAD_DIMS for c in head_copies.copy_strided_heads(graph, sources, d)]

    def _run(self, graph: torch.fx.Graph) -> int:
        writes = self.scan(lambda: self._kv_writes(graph), PATTERN, graph, [])
        ks, vs = [w for w in writes if w.rotated], [w for w in writes if not w.rotated]
        matched, used = 0, set()
        for k in ks:
            done = []

            def fuse(k=k):
                v = self._v_of(k, vs, used)
                self._fuse_any(graph, self._q_of(k, v, ks + vs), k, v)
                done.append(v)

            if self.attempt(fuse, PATTERN, k.write.write):
                used.add(id(done[0]))
                matched += 1
        for v in vs:
            if id(v) not in used and not any(_same_slots(k.write, v.write) for k in ks):
                self.log.declined(self.name, PATTERN, v.write.write,
                                  f"v: no k write (rotated heads of the same projection) goes to the same slots as "
                                  f"the write at {where(v.write.write)}")
        return matched

    # ----------------------------------------------------------------------------------
    def _kv_writes(self, graph) -> list[KvWrite]:
        found = []
        for node, w in rows_writes(graph).items():
            if isinstance(w, NoMatch):
                self.log.declined(self.name, PATTERN, node, str(w))
                continue
            target, width = val(w.target), shape(w.values)[-1:]
            if width not in [(d,) for d in HEAD_DIMS] \
                    or target.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.float16):
                continue  # no KV cache of heads: another family's, or none
            if target.dim() not in (3, 4):  # heads of a head dim the op takes, in a cache it cannot address
                self.log.declined(self.name, PATTERN, node, f"write: the rows written at {where(w.write)} go into a "
                                  f"{target.dim()}-d buffer; the op writes [blocks, block, heads, dim], "
                                  "[blocks, heads, block, dim] or [slots, heads, dim] caches")
                continue
            self.attempt(lambda w=w: found.append(self._kv_write(w)), PATTERN, node)
        return found

    def _kv_write(self, w: RowsWrite) -> KvWrite:
        head_dim = shape(w.values)[-1]
        values = first_rows(w)
        region = backward([values])
        traced = trace(values, head_dim, avoid={w.root}, region=region)
        expect(traced, f"write: the rows written at {where(w.write)} are not heads of {head_dim} values of a projection "
                       "(no per-token, per-head path back to one)")
        writable = [(t, roles, order, heads) for t in traced for roles in [dim_roles(t.layout, head_dim)]
                    for order, heads in [(token_dims_order(t.layout, roles, t.start.tokens),
                                          heads_of(t.layout, roles, head_dim))]
                    if order is not None and heads is not None]
        expect(writable,  # the first source, in trace's order, whose layout the op can write
               f"write: the rows written at {where(w.write)} list tokens or heads in an order the op cannot write")
        t, roles, order, heads = writable[0]
        view = cache_view(w, roles, heads[0], head_dim)
        memo: dict = {}
        ops = [n for n in operands(region, {t.start.node}, memo) if n is not w.root]
        rotated = bool(per_token_operands(ops, weight_like))
        return KvWrite(w, t, roles, order, heads[0], head_dim, view, ops, region, rotated)

    def _v_of(self, k: KvWrite, vs: list[KvWrite], used: set) -> KvWrite:
        found = [v for v in vs if id(v) not in used and _same_slots(k.write, v.write) and v.write.root is not k.write.root
                 and (v.heads, v.head_dim) == (k.heads, k.head_dim)]
        if _is_whole(k):
            found = [v for v in found if _is_whole(v) and v.start.source is not k.start.source]
            found = _closest(found, lambda v: v.start.source, k.start.source)
        else:
            found = [v for v in found if v.start.source is k.start.source
                     and v.start.first == k.start.first + k.heads * k.head_dim]
        expect(len(found) == 1, f"v: {len(found)} writes of the same projection's next {k.heads} heads go to the "
                                f"same slots as k's (at {where(k.write.write)}), expected one")
        return found[0]

    def _q_of(self, k: KvWrite, v: KvWrite, writes: list[KvWrite]) -> list[Q]:
        """The prepared q candidates, latest first."""
        d = k.head_dim
        written = {w.start.node for w in writes}
        if _separate(k):
            graph = k.start.node.graph
            # k from the model's copy: q from its own, if the projection's order is none
            copies = {n: s for n in graph.nodes if is_copy(n) for s in [copy_start(n, d, k.tokens)] if s is not None} \
                if is_copy(k.start.source) else {}
            sources = [n for n in _float_sources(graph) if divides(d, shape(n)[-1]) and same_size(_tokens(n), k.tokens)]
            sources = [n for n in [*sources, *copies] if n is not k.start.source and n is not v.start.source]
            sources = _closest(sources, lambda n: n, k.start.source)
            starts = [copies[n] if n in copies else column_starts(n)[0] for n in sources]
            starts = [s for s in starts if s.node not in written]
        else:
            expect(k.start.first % d == 0 and k.start.first > 0,
                   f"k: its heads start at column {k.start.first} of the projection, not after whole q heads")
            num_q = k.start.first // d
            width = shape(k.start.source)[-1]
            expect(width == (num_q + 2 * k.heads) * d,
                   f"qkv: width {width} is not (Hq + 2*Hkv) * D = ({num_q} + 2*{k.heads}) * {d}")
            starts = [s for s in column_starts(k.start.source) if s.first == 0 and s.width == num_q * d]
        found = []
        for start in starts:
            found += [Q(start, p.node, p.layout, p.heads, _weight(p.operands), p.tail)
                      for p in prepared(start, d, start.tokens, tails=True)]
        expect(found, "q: no prepared q (rotated heads of the q projection read by a later step) goes with k")
        return found

    # ----------------------------------------------------------------------------------
    def _fuse_any(self, graph, qs: list[Q], k: KvWrite, v: KvWrite) -> None:
        """The q later steps read first; where none agrees, what those are views or number
        scalings of (the model scales q after its RoPE: the scaling stays the model's)."""
        read, tails = [q for q in qs if not q.tail], [q for q in qs if q.tail]
        try:  # a factor on q's weight only where no scaling after the rotation can stay the model's
            self._fuse(graph, read or tails, k, v, q_factors=not tails)
        except NoMatch as first:
            differed = getattr(first, "mismatch", None)  # search's closest candidate, where one ran
            if not (read and tails) or differed is None or differed.output != "q_out":
                raise  # k or v differ (or no call could be made): another q changes nothing
            try:
                self._fuse(graph, tails, k, v)
            except NoMatch:
                raise first from None

    def _fuse(self, graph, qs: list[Q], k: KvWrite, v: KvWrite, q_factors: bool = False) -> None:
        shared = _shared_root(k, v)
        # before the first reader of anything the call may replace (any q candidate)
        readers = [u for o in ([q.prepared for q in qs] + ([shared[1]] if shared else [k.write.after, v.write.after]))
                   for u in o.users]
        order = graph_order(graph)
        expect(readers, "write: nothing reads the written cache or the prepared q")
        point = min(readers, key=order.__getitem__)
        scales = (_scale(k), _scale(v))
        k_eps = eps_inputs(k.region)  # the eps a norm reads when the graph runs: the call's too
        expect_no_runtime_floats(k.region, {k.start.node}, scales, k_eps)  # its kv scales and eps: the call's
        probes_out = [k.write.after, v.write.after] if not shared else [shared[1]]
        probes = Probes(probes_out + [q.prepared for q in qs], **probe_roles(k.view), mode=self.validate, memo=self.memo)
        ropes = rope_forms(per_token_operands(k.operands, weight_like), k.tokens, k.head_dim, probes.equal_parts,
                           lambda n: probes.equal_parts(n, pairs=True))
        expect(ropes, f"rope: no cos/sin the op can read among what the rows written at {where(k.write.write)} mix in")
        weight = _weight(k.operands)
        fp8 = val(k.write.target).dtype in (torch.float8_e4m3fn, torch.uint8)
        expect(not fp8 or scales[0] is not None, "fp8: no one-value scale of the k rows")
        k_constants = constants(k.region, {k.start.node}, {})
        maths = math_candidates(ropes, val(weight).dtype if weight is not None else None, _reduces(k),
                                k_eps or k_constants, fp8, _gptj_hint(k), _q_factors(qs[0], k_constants) if q_factors else ())
        make = lambda: Emitter(graph, point, source=qs[0].prepared, readers=readers)  # noqa: E731
        checked_kv = lambda emit, outs: _kv_checked(k, v, shared, outs)  # noqa: E731
        if len(qs) == 1:  # one q: its call with each math, in one search
            final = first_agreeing(probes, [Candidate(m.describe(), _call(self, m, qs[0], k, v, shared, scales,
                                                                          checked_kv, with_q=True), m.rounding_of())
                                            for m in maths], make)
            best = next(m for m in maths if m.describe() == final.candidate.name)
        else:  # the math on k and v first, then which q goes with it
            agreed = first_agreeing(probes, [Candidate(m.describe(), _call(self, m, qs[0], k, v, shared, scales,
                                                                           checked_kv, with_q=False), m.rounding_of())
                                             for m in maths], make)
            agreed.emitter.discard()
            best = next(m for m in maths if m.describe() == agreed.candidate.name)
            final = first_agreeing(probes, [Candidate(f"{best.describe()}; q {where(q.prepared)}",
                                                      _call(self, best, q, k, v, shared, scales, checked_kv,
                                                            with_q=True)) for q in qs], make)
        q, new_q, written = final.result
        self.replace(q.prepared, new_q)
        for old, new in written:
            self.replace(old, new)
        pattern = ("gqa_qknorm_rope_kv" if best.norm != "none" else "gqa_rope_kv") + (
            "+separate" if _separate(k) else "")
        self.log.matched(self.name, pattern, q.prepared, final.note(best.describe()))

def _call(pass_, math: Math, q: Q, k: KvWrite, v: KvWrite, shared, scales, checked_kv, with_q: bool):
    """The emit function of one candidate call."""
    def emit_it(emit: Emitter):
        device = val(k.start.node).device
        if _separate(k):
            op = GQA_SEPARATE_QKNORM_ROPE_KV_INSERT
            args = dict(q=_columns(emit, q.start), k=_columns(emit, k.start), v=_columns(emit, v.start))
            tokens = emit.size(args["k"], 0)
        else:
            op = GQA_QKNORM_ROPE_KV_INSERT
            args = dict(qkv=_as_2d(emit, k.start.source), num_q_heads=q.heads, num_kv_heads=k.heads)
            tokens = emit.size(args["qkv"], 0)
        args.update(_norm_weights(emit, math, q, k))
        args["q_out"] = emit.scratch("gqa_qknorm_rope_kv_insert.q_out", [tokens, q.heads, k.head_dim],
                                     torch.bfloat16, k.start.node, name=Q_SCRATCH_NAME)
        args["slot_mapping"] = emit_slots(emit, k.view, k.roles, k.token_order, device)
        args.update(emit_rope(emit, math.rope, tokens, device))
        args["kv_scale"] = None
        if math.scale != "none":  # k's scale; v's where it has its own (vLLM's k_scale and v_scale)
            k_scale, v_scale = (s if math.scale == "divide" or s is None else emit.node(aten.reciprocal.default, s)
                                for s in scales)
            args["kv_scale"] = k_scale
            if v_scale is not None and scales[1] is not scales[0]:
                args["v_scale"] = v_scale
        q_region = backward([q.prepared], cut={q.start.node})
        q_eps = next(iter(eps_inputs(q_region)), None) if math.norm != "none" else None
        # q's math must not read a float only the run knows other than its eps, as k's (in _fuse)
        expect_no_runtime_floats(q_region, {q.start.node}, (), [q_eps] if q_eps is not None else ())
        args.update(is_neox=math.is_neox, eps=math.eps if q_eps is None else q_eps, wrap_indices=True)
        if q_eps is not None and q_eps is not math.eps:  # q's norm reads its own eps input
            args["k_eps"] = math.eps
        if not math.saturate:
            args["fp8_saturate"] = False
        views = {}
        for name, w in (("k_cache", k), ("v_cache", v)):
            root = shared[0] if shared else w.write.root
            root = pass_.replaced.get(root, root)
            if w.view.direct and not shared:
                args[name] = root
            else:
                views[name] = (root, w.view.fake())
        if views:
            plain, new = viewed_call(emit, op, args, views)
            new_q = plain["q_out"]
            caches = {name: new[root] for name, (root, _) in views.items()}
            caches.update({name: None for name in ("k_cache", "v_cache") if name not in caches})
        else:
            outs = emit.functional_call(op, args)
            new_q, caches = outs["q_out"], {"k_cache": outs["k_cache"], "v_cache": outs["v_cache"]}
        if shared:
            written = [(shared[1], caches["v_cache"])]
        else:
            written = [(k.write.after, caches["k_cache"] if caches["k_cache"] is not None else args["k_cache"]),
                       (v.write.after, caches["v_cache"] if caches["v_cache"] is not None else args["v_cache"])]
        checked = checked_kv(emit, written)
        q_view = as_layout(emit, new_q, q.layout, q.prepared)
        if with_q:
            checked = [Checked("q_out", q.prepared, q_view)] + checked
        return checked, (q, q_view, written)
    return emit_it


def _kv_checked(k, v, shared, written) -> list[Checked]:
    codes = torch.float8_e4m3fn if val(k.write.target).dtype == torch.uint8 else None
    names = ("k_cache and v_cache",) if shared else ("k_cache", "v_cache")
    # an fp8 row the cast saturated is bounded by its values before the cast
    before = [(b, None) for b in (before_cast(k.write.values), before_cast(v.write.values)) if b is not None]
    return [Checked(name, old, new, codes, tuple(before)) for name, (old, new) in zip(names, written)]


def _norm_weights(emit, math: Math, q: Q, k: KvWrite) -> dict:
    if math.norm == "none":
        return {"q_norm_weight": None, "k_norm_weight": None}
    if math.norm == "unweighted":
        ones = emit.node(aten.full.default, [k.head_dim], 1.0, dtype=torch.float32, device=val(k.start.node).device,
                         pin_memory=False)
        weights = {"q_norm_weight": ones, "k_norm_weight": ones}
    else:
        weights = {}
        for name, w in (("q_norm_weight", q.weight), ("k_norm_weight", _weight(k.operands))):
            expect(w is not None, f"norm: {name.split('_')[0]} has no [D] weight")
            if math.norm == "fp32" and val(w).dtype != torch.float32:
                w = emit.node(prims.convert_element_type.default, w, torch.float32)
            if tuple(shape(w)) != (k.head_dim,):
                w = emit.node(aten.reshape.default, w, [k.head_dim])
            weights[name] = w
    if math.q_factor != 1.0:  # the factor rides on q's weight, in fp32 (a bf16 product would round it)
        w = weights["q_norm_weight"]
        if val(w).dtype != torch.float32:
            w = emit.node(prims.convert_element_type.default, w, torch.float32)
        weights["q_norm_weight"] = emit.node(aten.mul.Tensor, w, math.q_factor)
    return weights


def _q_factors(q: Q, k_constants: list[float]) -> tuple:
    """The numbers q's own steps use and k's do not (a factor between q's norm and its
    rotation, where q's weight can carry it)."""
    found = constants(backward([q.prepared], cut={q.start.node}), {q.start.node}, {})
    return tuple(c for c in found if c not in k_constants and c not in (0.0, 1.0, -1.0) and isfinite(c))


def _as_2d(emit, source):
    """The op's ``[T, W]`` view of a source with leading token dims (a whole ``Start``: its
    own token dims, the rest ``W``)."""
    width = source.width if isinstance(source, Start) else None
    source = source.source if isinstance(source, Start) else source
    if len(shape(source)) != 2:
        source = emit.node(aten.reshape.default, source, [-1, width or shape(source)[-1]])
    return source  # a strided last dim gets its contiguous copy with the call's other operands (Emitter.dense_rows)


def _tokens(node):
    n = 1
    for s in shape(node)[:-1]:
        n = n * s
    return n


def _weight(ops) -> torch.fx.Node | None:
    found = [n for n in ops if weight_like(n)]
    return found[0] if len(found) == 1 else None


def _scale(w: KvWrite) -> torch.fx.Node | None:
    found = [n for n in w.operands if is_scale(n)]
    return found[0] if len(found) == 1 else None


def _reduces(k: KvWrite) -> bool:
    return any(is_op(n, aten.mean.dim, aten.sum.dim_IntList) for n in k.region)


def _gptj_hint(k: KvWrite) -> bool:
    """Interleaved pairs read likelier than halves: the region steps by 2 or goes complex."""
    return any(is_op(n, aten.view_as_complex.default) or (is_op(n, aten.slice.Tensor) and slice_params(
        n.args[1:], n.kwargs)[3] == 2) or (is_op(n, aten.select.int) and shape(n.args[0])[-1:] == (2,)) for n in k.region)


def _separate(k) -> bool:
    """Whether k's projection holds no q heads before it: k a projection of its own, or the
    first columns of a kv projection (k then v, lightllm's ``kv_proj``). The three-source op
    reads q, k and v wherever they are (a whole projection starts at column 0 too)."""
    return k.start.first == 0


def _columns(emit, start: Start):
    """The op's ``[T, width]`` view of ``start``'s columns: its whole source as ``_as_2d``
    gives it, or that narrowed to the columns (a row stride the op takes as it is)."""
    if _is_whole(start):
        return _as_2d(emit, start)
    source = _as_2d(emit, start.source)
    return emit.node(aten.slice.Tensor, source, 1, start.first, start.first + start.width)


def _is_whole(w) -> bool:
    start = w.start if hasattr(w, "start") else w
    return start.first == 0 and (start.node is start.source or start.width == shape(start.source)[-1])


def _same_slots(a: RowsWrite, b: RowsWrite) -> bool:
    return len(a.indices) == len(b.indices) and a.dims == b.dims and all(
        x.node is y.node and (x.start, x.stop, x.step) == (y.start, y.stop, y.step)
        for x, y in zip(a.indices, b.indices))


def _float_sources(graph):
    """The graph's float inputs and projection products of two dims or more (a fake tensor's
    attributes are slow to read: the node's kind is tested first)."""
    inputs_and_products = [n for n in graph.nodes if n.op == "placeholder" or is_op(n, *_PRODUCTS)]
    return [unpadded_rows(n) for n in inputs_and_products
            if isinstance(val(n), torch.Tensor) and val(n).dtype.is_floating_point and val(n).dim() >= 2]


def _closest(candidates, source_of, k_source):
    if len(candidates) <= 1:
        return candidates
    k_input = projection_input(k_source)
    if k_input is None:
        return candidates
    return [c for c in candidates if projection_input(source_of(c)) is k_input]


def _shared_root(k: KvWrite, v: KvWrite):
    """(root, final value) where the k and v caches are views of one buffer written one
    after the other; else None."""
    if v.write.root is k.write.after:
        return k.write.root, v.write.after
    if k.write.root is v.write.after:
        return v.write.root, k.write.after
    return None

