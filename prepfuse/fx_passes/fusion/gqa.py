"""Find unfused GQA (Qwen3 / Llama) attention-input preparation and call the fused op instead.

A post-grad pass (Inductor's ``post_grad_custom_post_pass``: the functional graph, before
defunctionalization), built like ``fuse_dsv4_prep`` (whose docstring says why steps are
read back by recognisers rather than traced with ``register_replacement``). It rewrites
the split of the fused qkv projection, the optional weighted RMSNorm of q and k heads,
NeoX or GPT-J RoPE (full or partial), and the index-assignment writes of k and v into
paged caches (bf16, or fp8 e4m3 with a per-tensor device scale) into one
``auto_functionalized`` call of ``prepfuse::gqa_qknorm_rope_kv_insert``
(``GQA_QKNORM_ROPE_KV_INSERT``), v1 or v2 as ``enable_auto_functionalized_v2`` says.

Anchors: the cache writes, ``index_put`` of ``[n, Hkv, D]`` rows into a 4-d cache. Writes
with the same slots pair up as k (its rows are roped heads of qkv) and v (its rows are
plain heads of the same qkv, right after k's columns); the q side is the one prepared
``[T, Hq, D]`` tensor whose heads are qkv's first ``Hq*D`` columns, with the same norm eps,
RoPE style, rotary dim, positions and cos/sin table as k. A k/v write without its q (or
q without its writes) is declined, not fused. The caches may be separate tensors or
views of one buffer (``SharedBase``).

Separate projections (Hugging Face's ``q_proj``, ``k_proj``, ``v_proj``): when k's heads
are a whole ``[T, Hkv*D]`` tensor, v's rows must be the whole of another one and q the
whole of a third, and the call is ``prepfuse::gqa_separate_qknorm_rope_kv_insert``
(``GQA_SEPARATE_QKNORM_ROPE_KV_INSERT``). Layers share slots and tables, so where more
than one q or v would fit, the one projected from the same input as k (``mm``/``addmm``
of one activation) is taken; if that does not single one out, the candidate is declined.

Numerics: the norm and the fp32 RoPE spellings give the op's bits; Hugging Face's
all-bf16 RoPE (cos/sin cast to bf16, three roundings) is replaced by the op's fp32
rotation with one rounding, which differs on about 40% of rotated values by at most
about ``2^-7 * (|a| + |b|)`` -- more accurate, but not the same bits (the report's
pattern name says ``bf16_rope`` when this happens).

Negative slots: the eager write ``cache[slot // bs, slot % bs] = row`` sends slot -1 to
the last row of the last block (Python index wraparound); the fused op skips negative
slots. The model code this pass fuses must pass valid slots, or mean "skip" by -1.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from prepfuse._compat import auto_functionalized_ops
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.fusion import gqa_patterns
from prepfuse.fx_passes.fusion.gqa_patterns import (
    CacheWrite, Heads, NoMatch, SliceRows, is_cache_write, match_cache_write, match_heads, slot_nodes,
    unsupported_cache_write,
)
from prepfuse.fx_passes.matching import MATCHING_MODULES, recognizers
from prepfuse.fx_passes.matching.emitter import Emitter, as_layout, cos_sin_args
from prepfuse.fx_passes.matching.layouts import apply_views, heads_major_as_token_major, strip_views, token_major_heads
from prepfuse.fx_passes.matching.repeated_steps import merge_repeated_steps
from prepfuse.fx_passes.matching.recognizers import (
    BlockRows, aten, expect, is_op, same_size, scatter_back, shape, val, view_chain,
)
from prepfuse.fx_passes.matching.validation import Checked
from prepfuse.fx_passes.mutation_info import output_indices
from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT, GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, SCRATCH

PATTERN = "gqa"
# q_out comes from the scratch arena (reserved before KV-cache sizing: docs/design.md,
# lesson 2), reservations "gqa_qknorm_rope_kv_insert.q_out.<k>"; the node keeps this name
# in debug dumps.
Q_SCRATCH_NAME = "prepfuse_gqa_q_out_scratch"


class FuseGqaPrepPass(PrepfusePass):
    """Rewrites matched GQA preparation into ``GQA_QKNORM_ROPE_KV_INSERT`` calls
    (``GQA_SEPARATE_QKNORM_ROPE_KV_INSERT`` for separate projections, ``+separate``).

    ``matched_count`` is the number of op calls made (one per attention layer); the log
    names each ``gqa_qknorm_rope_kv`` or ``gqa_rope_kv`` (no norm), with ``+bf16_rope``
    when HF's bf16 rotation was replaced and ``+full_cos_sin`` when the op reads full-width
    cos/sin (``full_cos_sin=True``), and lists every declined candidate with its reason.
    """

    name = "fuse_gqa_prep"
    uuid_sources = (gqa_patterns, *MATCHING_MODULES)

    def settings(self) -> tuple:
        # the emitted call's schema: an op change must invalidate cached compiled graphs too
        return (str(GQA_QKNORM_ROPE_KV_INSERT._schema), str(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT._schema),
                str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        merge_repeated_steps(graph)  # one node per computation: vLLM's cos/sin cast per tensor, gpt-fast's pairs
        self._replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        self._order = {n: i for i, n in enumerate(graph.nodes)}
        heads = self._prepared_heads(graph)
        k_writes, v_writes = self._cache_writes(graph)
        matched, used = 0, set()
        k_rows = {strip_views(w.rows, stop=heads.__contains__)[0] for w in k_writes}
        for k_write in k_writes:
            try:
                k = self._written_heads(k_write, heads)
                v_write = _v_write_of(k, k_write, v_writes, used)
                q = self._separate_q_of(k, v_write, heads, k_rows) if _is_separate(k) else self._q_of(k, v_write, heads)
                shared = self._check_call(q, k, k_write, v_write)
                self._rewrite(graph, q, k, k_write, v_write, shared)
            except NoMatch as err:
                self.log.declined(self.name, PATTERN, k_write.put, str(err))
                continue
            used.add(v_write.put)
            matched += 1
        for v_write in v_writes:  # v writes no k write declined with (that decline names the reason)
            if not any(_same_slots(k.slots, v_write.slots) for k in k_writes):
                self.log.declined(self.name, PATTERN, v_write.put, "v: no write of roped k heads of the same qkv "
                                                                  "with the same slots goes with this write of v heads")
        return matched

    # ----------------------------------------------------------------------------------
    def _prepared_heads(self, graph) -> dict[torch.fx.Node, Heads]:
        """Every 3-d or 4-d node (``[T, H, D]``, ``[B, S, H, D]``, ``[B, H, S, D]`` ...) that
        reads back as roped qkv heads."""
        found, self._why = {}, {}
        for node in graph.nodes:
            v = val(node)
            if node.op != "call_function" or not isinstance(v, torch.Tensor) or v.dim() not in (3, 4):
                continue
            try:
                found[node] = match_heads(node)
            except NoMatch as err:
                self._why[node] = str(err)
        return found

    def _written_heads(self, write: CacheWrite, heads: dict[torch.fx.Node, Heads]) -> Heads:
        """The roped heads a cache write writes: its rows, or token-major ``[T, H, D]`` rows
        of them through views (Hugging Face's ``k.transpose(1, 2).reshape(B * S, H, D)``)."""
        # up to the first prepared node, not the top of the views: a GPT-J rotation ends in a
        # view itself (the flatten of its pairs; torch 2.11 shows it without a cast after it)
        base, chain = strip_views(write.rows, stop=heads.__contains__)
        k = heads.get(base)
        expect(k is not None, f"k: the rows written with {recognizers.describe(write.put)} are neither qkv heads (v) "
                              f"nor roped ones ({self._why.get(base, 'no RoPE found')})")
        layout = apply_views(k.layout, chain)
        if layout is not None and write.layout == "sequence":  # [Hkv, T, D] rows: heads, then tokens
            layout = heads_major_as_token_major(layout)
        expect(layout is not None and token_major_heads(layout, shape(k.source)[0], k.head_dim) == k.num_heads,
               f"k: the rows written with {recognizers.describe(write.put)} are roped heads "
               f"{recognizers.describe(base)} in another order than one row of heads per token")
        return k

    def _cache_writes(self, graph) -> tuple[list[CacheWrite], list[CacheWrite]]:
        """The paged-cache writes, split into candidates for k (any rows) and v (qkv heads as they are)."""
        k_writes, v_writes = [], []
        for node in graph.nodes:
            if is_cache_write(node):
                try:
                    write = match_cache_write(node)
                except NoMatch as err:
                    self.log.declined(self.name, PATTERN, node, str(err))
                    continue
                (v_writes if _plain_heads(write) is not None else k_writes).append(write)
            elif (why := unsupported_cache_write(node)) is not None:
                self.log.declined(self.name, PATTERN, node, why)
        return k_writes, v_writes

    def _q_of(self, k: Heads, v_write: CacheWrite, heads: dict[torch.fx.Node, Heads]) -> Heads:
        """The prepared q read from the same qkv as ``k``; checks v and the shared settings."""
        head_dim, num_kv = k.head_dim, k.num_heads
        num_q, rem = divmod(k.first_column, head_dim)
        expect(rem == 0 and num_q > 0, f"k: its heads start at column {k.first_column} of qkv, not after whole q heads")
        expect(shape(k.source)[1] == (num_q + 2 * num_kv) * head_dim,
               f"qkv: width {shape(k.source)[1]} is not (Hq + 2*Hkv) * D = ({num_q} + 2*{num_kv}) * {head_dim}")
        v = _plain_heads(v_write)
        expect(v == (k.source, (num_q + num_kv) * head_dim, num_kv, head_dim),
               f"v: rows written into {recognizers.describe(v_write.cache)} are not qkv's last {num_kv} heads")
        qs = [h for h in heads.values() if h.source is k.source and h.first_column == 0 and h.num_heads == num_q]
        expect(len(qs) == 1, f"q: {len(qs)} prepared q tensors of qkv's first {num_q} heads, expected one")
        return _same_settings(qs[0], k)

    def _separate_q_of(self, k: Heads, v_write: CacheWrite, heads: dict[torch.fx.Node, Heads],
                       k_rows: set[torch.fx.Node]) -> Heads:
        """The prepared q of a separate projection that goes with ``k`` (a whole projection):
        a whole ``[T, Hq*D]`` source other than k's and v's, not itself written as k, with
        k's settings; among several, the one projected from k's input."""
        v_source = _plain_heads(v_write)[0]
        qs = [h for h in heads.values() if _is_separate(h) and h.head_dim == k.head_dim and h.prepared not in k_rows
              and h.source is not k.source and h.source is not v_source and _settings_match(h, k)]
        qs = _closest_projections(qs, lambda h: h.source, k.source)
        expect(len(qs) == 1, f"q: {len(qs)} prepared q tensors of a separate projection fit k's "
                             f"{recognizers.describe(k.source)} (same settings, same projected input), expected one")
        return qs[0]

    def _check_call(self, q: Heads, k: Heads, k_write: CacheWrite, v_write: CacheWrite) -> SharedBase | None:
        """One call can serve all three: caches alike, every input before every reader of an
        output. Returns the buffer both caches are views of, if they are (else None)."""
        expect(val(k_write.cache).dtype == val(v_write.cache).dtype and k_write.kv_scale is v_write.kv_scale,
               "write: k and v caches differ in dtype or kv_scale")
        expect(k_write.saturate == v_write.saturate,
               f"write: fp8 values past 448 {'saturate' if k_write.saturate else 'become NaN'} in the k cache and "
               f"{'saturate' if v_write.saturate else 'become NaN'} in the v cache (one clamped, one a bare cast)")
        expect(tuple(shape(k_write.cache)) == tuple(shape(v_write.cache)), "write: k and v caches differ in shape")
        expect(k_write.layout == v_write.layout,
               f"write: the k cache is laid out {k_write.layout}, the v cache {v_write.layout}")
        shared = _shared_base(k_write, v_write) or _shared_base(v_write, k_write)
        caches = [shared.root] if shared else [k_write.cache, v_write.cache]
        inputs = [q.source, k.source, _plain_heads(v_write)[0], *caches, *slot_nodes(k_write.slots), *q.cos_sin.key()]
        inputs += [n for n in (q.norm_weight, k.norm_weight, k_write.kv_scale) if n is not None]
        readers = _readers(q, k_write, v_write, shared)
        # the graph's order now, the nodes earlier rewrites emitted included
        self._order = {n: i for i, n in enumerate(q.prepared.graph.nodes)}
        point = min(readers, key=self._order.__getitem__)
        late = [n for n in inputs if self._order[n] > self._order[point]]
        if late:
            # Inductor's post-grad reorder_for_locality moves a producer next to its first
            # user: transformers' PagedAttentionCache.update writes k, writes v, then reads k
            # back, so v's projection lands after the read. Inputs that need no output are
            # hoisted in front of the first reader (a legal reorder of pure nodes)
            expect(_hoist_before(point, late, self._order, set(readers)),
                   f"order: input {recognizers.describe(late[0])} of the call needs a reader of one of its outputs "
                   f"({recognizers.describe(point)} comes first)")
            self._order = {n: i for i, n in enumerate(point.graph.nodes)}
        return shared

    def _rewrite(self, graph, q: Heads, k: Heads, k_write: CacheWrite, v_write: CacheWrite,
                 shared: SharedBase | None) -> None:
        order = self._order
        emit = Emitter(graph, min(_readers(q, k_write, v_write, shared), key=order.__getitem__), source=q.prepared)
        if _is_separate(k):
            op = GQA_SEPARATE_QKNORM_ROPE_KV_INSERT
            sources = dict(q=q.source, k=k.source, v=_plain_heads(v_write)[0])
            counts = {}
        else:
            op = GQA_QKNORM_ROPE_KV_INSERT
            sources = dict(qkv=q.source)
            counts = dict(num_q_heads=q.num_heads, num_kv_heads=k.num_heads)
        args = dict(**sources, q_norm_weight=q.norm_weight, k_norm_weight=k.norm_weight,
                    q_out=q_out_buffer(emit, q), k_cache=k_write.cache, v_cache=v_write.cache,
                    slot_mapping=_slot_mapping(emit, k_write), **cos_sin_args(emit, q.cos_sin, q.source, q.rotary_dim),
                    kv_scale=k_write.kv_scale, **counts, is_neox=q.is_neox, eps=q.eps if q.eps is not None else 0.0,
                    **({} if k_write.saturate else {"fp8_saturate": False}))
        if k_write.rows_per_slot_at_run_time or v_write.rows_per_slot_at_run_time:
            # an index_put of T rows at T' slots: T' == T at run time, which the graph does not
            # show (two dynamic sizes); the op inserts the first T' rows, so say it: an assert
            # that runs with the call, not a guard (nothing recompiles)
            same = emit.node(operator.eq, emit.size(slot_nodes(k_write.slots)[0], 0), emit.size(k.source, 0))
            emit.node(aten._assert_scalar.default, same, "prepfuse: the cache write's rows and slots differ in number")
        # a cache an earlier rewrite wrote (two calls into one cache) is read from its replacement
        args = torch.fx.node.map_arg(args, lambda n: self._replaced.get(n, n))
        extra_roles = dict.fromkeys((q.cos_sin.cos, q.cos_sin.sin), "duplicated_halves") \
            if q.cos_sin.per_token and q.cos_sin.full and q.cos_sin.equal_halves else {}
        def op_view(name):  # the [NB, bs, Hkv, D] tensor the op writes for a cache argument
            v = val(args[name])
            if k_write.layout in ("heads_first", "sequence"):  # sequence: [B, Hkv, S, D], B blocks of S
                return v.permute(0, 2, 1, 3)
            return v.unsqueeze(1) if k_write.layout == "flat" else v  # a token pool: block size 1

        if shared is not None:
            root = self._replaced.get(shared.root, shared.root)
            q_out, new = _viewed_call(emit, op, args, {n: (root, op_view(n)) for n in ("k_cache", "v_cache")})
            written = ((shared.written, new[root]),)
            names, extra_roles[root] = ("k_cache and v_cache's buffer",), "cache"
        elif k_write.layout != "paged":
            q_out, new = _viewed_call(emit, op, args, {n: (args[n], op_view(n)) for n in ("k_cache", "v_cache")})
            written = ((k_write.put, new[args["k_cache"]]), (v_write.put, new[args["v_cache"]]))
            names = ("k_cache", "v_cache")
        else:
            outs = emit.functional_call(op, args)
            q_out = outs["q_out"]
            written = ((k_write.put, outs["k_cache"]), (v_write.put, outs["v_cache"]))
            names = ("k_cache", "v_cache")
        new_q = as_layout(emit, q_out, q.layout, q.prepared)
        note = ""
        if self.validate == "probe":
            codes = torch.float8_e4m3fn if val(args["k_cache"]).dtype == torch.uint8 else None  # vLLM's "fp8"
            # fp8 rows before their cast, for the bound of a row the cast saturated
            before = {w.put: ((w.rows, w.kv_scale),) for w in (k_write, v_write) if w.kv_scale is not None}
            if shared is not None and before:
                before = {shared.written: before[k_write.put] + before[v_write.put]}
            checked = [Checked("q_out", q.prepared, new_q)] + [
                Checked(n, old, new, codes, before.get(old, ())) for n, (old, new) in zip(names, written)]
            cache = op_view("k_cache")
            capacity = cache.shape[0] * cache.shape[1]
            if isinstance(k_write.slots, BlockRows):  # probed as one slot each: distinct (block, row) pairs
                extra_roles.update({k_write.slots.block: "slot_block", k_write.slots.row: "slot_row"})
            elif isinstance(k_write.slots, torch.fx.Node) and k_write.slots is not args["slot_mapping"]:
                # B sequences: distinct positions of one; each sequence's own [B, T]: distinct in each row
                own = len(shape(k_write.slots)) == 2
                extra_roles[k_write.slots], capacity = "sequence_slots" if own else "slots", cache.shape[1]
            note = emit.validate(args, checked, extra_roles, slot_capacity=capacity, block_size=cache.shape[1])
        q.prepared.replace_all_uses_with(new_q)
        for old, new in written:
            old.replace_all_uses_with(new)
            self._replaced[old] = new
        pattern = ("gqa_qknorm_rope_kv" if q.norm_weight is not None else "gqa_rope_kv") + (
            "+separate" if _is_separate(k) else "") + ("+bf16_rope" if q.bf16_rope else "") + (
            "+full_cos_sin" if q.cos_sin.full_operand else "")
        self.log.matched(self.name, pattern, q.prepared, note)


def _same_slots(a, b) -> bool:
    """Two writes address the same slots: one node, or the same (block, row) nodes of a page
    table, or the same slice of positions."""
    return a is b or (isinstance(a, (BlockRows, SliceRows)) and a == b)


def _slot_mapping(emit: Emitter, write: CacheWrite) -> torch.fx.Node:
    """The op's slot per row, computed in front of the call where the write does not hold it
    as one tensor: ``block * bs + row`` for a page table's indices (``BlockRows``); for the
    positions of a static cache of B sequences (``per_sequence``: by position, shared by the
    sequences or each sequence's own ``[B, T]``, or a slice ``start + t``, ``SliceRows``)
    ``b * S + position``, token ``(b, t)`` being row ``b * T + t`` (a position outside
    ``[0, S)`` kept outside every sequence's rows)."""
    cache = val(write.cache)
    if isinstance(write.slots, BlockRows):
        return emit.node(aten.add.Tensor, emit.node(aten.mul.Tensor, write.slots.block, cache.shape[1]),
                         write.slots.row)
    positions = write.slots
    if isinstance(positions, SliceRows):
        start, end = positions.start, positions.end
        count = end - start if isinstance(start, int) and isinstance(end, int) else emit.node(operator.sub, end, start)
        every = emit.iota(count, cache.device)
        positions = emit.node(aten.add.Tensor, every, start) if start != 0 else every
    own = len(shape(positions)) == 2  # [B, T]: each sequence's own positions, else [T] shared by all
    if not write.per_sequence or cache.shape[0] == 1:
        return emit.node(aten.reshape.default, positions, [-1]) if own else positions
    batch = cache.shape[0]
    length = cache.shape[2] if write.layout in ("sequence", "heads_first") else cache.shape[1]
    def by_sequence(per_token):  # [T] values as the [1, T] row every sequence reads; [B, T] as they are
        return per_token if own else emit.node(aten.unsqueeze.default, per_token, 0)

    starts = emit.node(aten.mul.Tensor, emit.iota(batch, cache.device), length)
    slots = emit.node(aten.add.Tensor, emit.node(aten.unsqueeze.default, starts, 1), by_sequence(positions))
    if isinstance(write.slots, torch.fx.Node):  # positions as given (a slice's are in [0, S) by its shape)
        # a position outside [0, S) must not land in a neighbouring sequence's rows: beyond S
        # it becomes a slot beyond the cache (the op's index check raises, unchecked it is
        # skipped), negative it stays negative (skipped), as for one sequence's cache
        negative = emit.node(aten.lt.Scalar, positions, 0)  # -1 where negative, B * S where beyond
        beyond = emit.node(aten.add.Tensor, emit.node(aten.mul.Tensor, negative, -1 - batch * length), batch * length)
        inside = emit.node(aten.bitwise_and.Tensor, emit.node(aten.ge.Scalar, positions, 0),
                           emit.node(aten.lt.Scalar, positions, length))
        slots = emit.node(aten.where.self, by_sequence(inside), slots, by_sequence(beyond))
    return emit.node(aten.reshape.default, slots, [-1])


def _is_separate(h: Heads) -> bool:
    """The heads are the whole of their source: a separate projection, not qkv columns."""
    return _is_whole(h.source, h.first_column, h.num_heads, h.head_dim)


def _is_whole(source, first_column: int, num_heads: int, head_dim: int) -> bool:
    """Heads ``[first_column, + num_heads * head_dim)`` cover all of ``source``."""
    return first_column == 0 and shape(source)[1] == num_heads * head_dim


def _settings_match(q: Heads, k: Heads) -> bool:
    try:
        _same_settings(q, k)
        return True
    except NoMatch:
        return False


def _same_settings(q: Heads, k: Heads) -> Heads:
    """``q`` if it has one row per token of k's source and k's RoPE, norm and table (the op
    takes them once for both), else NoMatch saying which differs."""
    expect(same_size(shape(q.source)[0], shape(k.source)[0]), "q: not one row per token of qkv")
    expect((q.is_neox, q.rotary_dim) == (k.is_neox, k.rotary_dim),
           f"rope: q is {'NeoX' if q.is_neox else 'GPT-J'} over {q.rotary_dim} dims, k "
           f"{'NeoX' if k.is_neox else 'GPT-J'} over {k.rotary_dim}; the op rotates both alike")
    expect(q.cos_sin.key() == k.cos_sin.key(), "rope: q and k read different positions or tables")
    expect((q.norm_weight is None) == (k.norm_weight is None), "norm: only one of q and k is normed")
    if q.norm_weight is not None:
        qd, kd = val(q.norm_weight).dtype, val(k.norm_weight).dtype
        expect(qd == kd, f"norm: q's weight is {qd}, k's {kd}; the op applies both alike (bf16 weights after "
                         "rounding, fp32 weights before it)")
    expect(q.eps == k.eps, f"norm: q eps {q.eps} and k eps {k.eps} differ; the op takes one eps")
    return q


def projection_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The activation a linear projection read (``mm(x, w)``, ``addmm(b, x, w)``, through
    views on both sides), or None when ``node`` is no projection. Inductor on CUDA may pad
    the rows of an mm for alignment (``slice(mm(constant_pad_nd(x, [0, 0, 0, p])), 0, 0, -p)``,
    decided by timing it: some compiles pad, some do not); each projection pads its own copy,
    so the padding is seen through to ``x``."""
    node, _ = view_chain(node)
    if is_op(node, aten.mm.default):
        return _unpadded(view_chain(node.args[0])[0])
    if is_op(node, aten.addmm.default):
        return _unpadded(view_chain(node.args[1])[0])
    return None


def _unpadded(node: torch.fx.Node) -> torch.fx.Node:
    """``x`` for ``constant_pad_nd(x, [0, 0, 0, p])`` (rows added at the end, as Inductor's
    mm padding does), through views; else ``node``."""
    if is_op(node, aten.constant_pad_nd.default) and list(node.args[1])[:3] == [0, 0, 0]:
        return view_chain(node.args[0])[0]
    return node


def _closest_projections(candidates: list, source_of, k_source: torch.fx.Node) -> list:
    """``candidates`` as they are when at most one; else those projected from the same
    activation as ``k_source`` (one layer's q_proj/k_proj/v_proj read one input)."""
    if len(candidates) <= 1:
        return candidates
    k_input = projection_input(k_source)
    if k_input is None:
        return candidates
    return [c for c in candidates if projection_input(source_of(c)) is k_input]


def q_out_buffer(emit: Emitter, q: Heads) -> torch.fx.Node:
    """The op's ``q_out [T, Hq, D]``: scratch-arena memory (reservation
    ``gqa_qknorm_rope_kv_insert.q_out.<k>``, reserved before KV sizing; see
    ``fx_passes/scratch_buffers.py``), never a per-call allocation."""
    tokens = emit.size(q.source, 0)
    return emit.scratch("gqa_qknorm_rope_kv_insert.q_out", [tokens, q.num_heads, q.head_dim], torch.bfloat16, q.source,
                        name=Q_SCRATCH_NAME)


def _v_write_of(k: Heads, k_write: CacheWrite, v_writes: list[CacheWrite], used: set) -> CacheWrite:
    """The one unused write, to the same slots, of ``k``'s qkv's heads as they are; or,
    where k is a separate projection, of the whole of another projection (among several,
    the one projected from k's input)."""
    found = [w for w in v_writes if w.put not in used and _same_slots(w.slots, k_write.slots) and w.cache is not k_write.cache]
    if _is_separate(k):
        # v: the whole of another projection, k's heads and head size
        found = [w for w, plain in ((w, _plain_heads(w)) for w in found)
                 if _is_whole(*plain) and plain[0] is not k.source and plain[2:] == (k.num_heads, k.head_dim)]
        found = _closest_projections(found, lambda w: _plain_heads(w)[0], k.source)
        expect(len(found) == 1, f"v: {len(found)} writes of a separate projection's heads to the same slots fit "
                                f"k's {recognizers.describe(k.source)}, expected one")
        return found[0]
    found = [w for w in found if _plain_heads(w)[0] is k.source]
    expect(len(found) == 1, f"v: {len(found)} writes of heads of the same qkv to the same slots, expected one")
    return found[0]


def _plain_heads(write: CacheWrite) -> tuple | None:
    """(qkv, first column, heads, head size) if ``write``'s rows are qkv heads as they are (v),
    else None; heads-major rows ``[Hkv, T, D]`` for a per-sequence cache."""
    try:
        return gqa_patterns.qkv_heads(write.rows, heads_major=write.layout == "sequence")
    except NoMatch:
        return None


def _hoist_before(point: torch.fx.Node, nodes, order: dict, readers: set) -> bool:
    """Move ``nodes``, and every node after ``point`` they need, to just before ``point``,
    keeping their order; nothing moves and False where one of them is ``point``, a reader
    of an output (``readers``), or a node with an effect (a mutation, an assert)."""
    late, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n in late or order[n] < order[point]:
            continue
        if n is point or n in readers or n.op != "call_function" or n.is_impure():
            return False
        late.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        point.prepend(n)
    return True


def _readers(q: Heads, k_write: CacheWrite, v_write: CacheWrite, shared: SharedBase | None) -> list[torch.fx.Node]:
    caches = list(shared.written.users) if shared else list(k_write.put.users) + list(v_write.put.users)
    return list(q.prepared.users) + caches


@dataclass
class SharedBase:
    """k and v caches are views of one buffer (``kv[:, 0]``, ``kv[:, 1]`` of a
    ``[NB, 2, bs, Hkv, D]`` cache; AOT autograd merges two aliasing inputs into such a
    base): ``root`` before both writes, ``written`` after both."""

    root: torch.fx.Node
    written: torch.fx.Node


def _shared_base(first: CacheWrite, second: CacheWrite) -> SharedBase | None:
    """The buffer both caches view, when ``second`` writes a view of what ``first``'s write produced."""
    root, chain = view_chain(first.cache)
    second_root, second_chain = view_chain(second.cache)
    if not chain or not second_chain:
        return None
    try:
        if scatter_back(first.put, chain) is not second_root:
            return None
        return SharedBase(root, scatter_back(second.put, second_chain))
    except NoMatch:
        return None


def _viewed_call(emit: Emitter, op, args: dict, views: dict) -> tuple[torch.fx.Node, dict]:
    """The call writing ``k_cache`` and ``v_cache`` as views of graph buffers: ``views`` maps
    each to ``(root, view)``, ``view`` the fake tensor the op writes (its sizes, strides and
    storage offset within ``root``'s storage). Both caches views of one buffer share a
    root (FlashInfer's ``[NB, 2, bs, Hkv, D]``); a heads-first cache ``[NB, Hkv, bs, D]`` is
    its own root, written through its ``[NB, bs, Hkv, D]`` permutation. For v2 each root is
    one base and each view is regenerated from it (``_<arg>_size/_stride/_storage_offset``),
    which the defunctionalize pass turns into in-place writes; for v1 the views are
    ``as_strided`` of their roots and their new values are scattered back. Returns
    ``(q_out, {root: its new value})``."""
    v1, v2 = auto_functionalized_ops()
    roots = list(dict.fromkeys(root for root, _ in views.values()))
    strided = {name: (list(view.shape), list(view.stride()), view.storage_offset()) for name, (_, view) in views.items()}
    if v2 is not None and torch._inductor.config.enable_auto_functionalized_v2:
        call = {k: v for k, v in args.items() if k not in ("q_out", *views)}
        call.update(_q_out_base_index=0, _all_bases=[args["q_out"], *roots])
        for name, (root, _) in views.items():
            size, stride, offset = strided[name]
            call.update({f"_{name}_base_index": 1 + roots.index(root), f"_{name}_size": size,
                         f"_{name}_stride": stride, f"_{name}_storage_offset": offset})
        af = emit.node(v2, op, **call)
        index = output_indices(af)
        new = {root: emit.node(operator.getitem, af, index[next(n for n, (r, _) in views.items() if r is root)])
               for root in roots}
        return emit.node(operator.getitem, af, index["q_out"]), new
    call = dict(args, **{name: emit.node(aten.as_strided.default, root, *strided[name])
                         for name, (root, _) in views.items()})
    af = emit.node(v1, op, **call)
    index = output_indices(af)
    new = {root: root for root in roots}
    for name, (root, _) in views.items():
        new[root] = emit.node(aten.as_strided_scatter.default, new[root], emit.node(operator.getitem, af, index[name]),
                              *strided[name])
    return emit.node(operator.getitem, af, index["q_out"]), new
