"""Find unfused DeepSeek-V4 indexer preparation and call the fused op of its format instead.

One pass body over a formats table (``FORMATS``): FP8 (``prepfuse::dsv4_indexer_rope_fp8_insert``,
pass ``fuse_dsv4_indexer_prep``) and MXFP4 (``prepfuse::dsv4_indexer_rope_mxfp4_insert``,
pass ``fuse_dsv4_indexer_mxfp4_prep``). Both formats rewrite the indexer's q side (GPT-J RoPE
on the last 64 of 128 dims, bf16 round trip, then the format's quantisation) and its k side
(the same RoPE and quantisation of the compressed keys, written with their scale bytes into
the paged indexer cache) into one ``auto_functionalized`` call of the format's op, every
output (``q_out``, MXFP4's ``q_scale``, ``weights_out``) in scratch-arena memory.

    FP8:   y = rope_tail(q); e = ceil(log2(max(amax(|y|), 1e-4) / 448)); q_fp8 = e4m3(y * 2^-e)
           w_out = weights.float() * 2^e * weights_scale          (the scale folded into the weights)
           cache slot: 128 code bytes, one fp32 scale (132 B)
    MXFP4: y = rope_tail(q); per 32-block e = ceil(log2(max(amax, 6 * 2^-126) / 6)); e2m1 nibbles
           packed two a byte; q_scale = (e + 127).to(uint8)
           w_out = weights.float() * weights_scale                (no data link to q: claimed by shape)
           cache slot: 64 packed bytes, 4 UE8M0 bytes (68 B)

Anchors: the q side is found from the format's quantised q (an e4m3 cast of ``[T, H, 128]``
rows; the nibble packing ``lo | hi << 4``), the k side from an ``index_put`` of the format's
data rows into a uint8 tensor with its partner write of 4 scale bytes
(``matching/cache_writes.py``). A q match and a k match share one call when they read the
same cos/sin table and every reader of either side's outputs comes after all the call's
inputs (q and k rows are independent: k rows are compressed tokens with their own
positions); a side matched alone gets a call with an empty other side (no tokens, or no
inserted rows and an unwritten one-slot cache from the arena). Two layers writing one cache:
the second call reads the first call's written cache.

MXFP4's weights product has no data link to q (the block scales travel apart, unlike FP8's
fold), so each q call takes the first unclaimed ``weights.float() * c`` of q's ``[T, H]``
shape in graph order whose inputs come before the call's readers (whichever it takes, the
op computes that product's exact bits); a q call without one gets an unread dummy.

Declined, with the reason in the report: look-alikes (NeoX RoPE, RoPE on the first 64 dims,
no bf16 round trip, another amax floor; FP8 a q exponent that does not scale exactly one
weights product; MXFP4 e2m1 ties away from zero, the sign taken as ``v < 0``). Negative
slots: as for ``fuse_dsv4_prep``, eager code writes slot -1 through index wraparound, the
fused op skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.fusion import dsv4_indexer_mxfp4_patterns, dsv4_indexer_patterns
from prepfuse.fx_passes.fusion.dsv4_indexer_mxfp4_patterns import (
    is_pack, match_mxfp4_k_rows, match_mxfp4_q_side, packed_outputs, weights_products,
)
from prepfuse.fx_passes.fusion.dsv4_indexer_patterns import (
    KSide, NoMatch, is_fp8_q_anchor, match_fp8_k_rows, match_fp8_q_side, match_k_side,
)
from prepfuse.fx_passes.matching import MATCHING_MODULES
from prepfuse.fx_passes.matching.cache_writes import byte_row_writes
from prepfuse.fx_passes.matching.emitter import Emitter
from prepfuse.fx_passes.matching.recognizers import put_rows, same_size, shape
from prepfuse.fx_passes.matching.validation import Checked
from prepfuse.ops import DSV4_INDEXER_ROPE_FP8_INSERT, DSV4_INDEXER_ROPE_MXFP4_INSERT, SCRATCH
from prepfuse.ops.dsv4_indexer_common import FP8_SLOT_BYTES, HEAD_DIM, MXFP4_BLOCKS, MXFP4_PACKED, MXFP4_SLOT_BYTES

__all__ = ["FORMATS", "IndexerFormat", "FuseDsv4IndexerPrepPass", "FuseDsv4IndexerMxfp4PrepPass"]


@dataclass(frozen=True)
class IndexerFormat:
    """What differs between the indexer's cache formats; the pass body reads only this."""

    name: str  # "fp8" | "mxfp4"
    op: torch._ops.OpOverload
    pattern: str  # prefix of the report's pattern names
    data_bytes: int  # bytes of a k row's codes in the cache
    slot_bytes: int  # bytes of a slot: codes, then scale bytes
    q_anchors: Callable[[torch.fx.Node], list[torch.fx.Node]]  # where a q-side walk starts
    match_q: Callable  # anchor -> q side (``Fp8QSide`` | ``Mxfp4QSide``: anchor, q, outputs(), inputs())
    k_rows: Callable  # (data put, scale put) -> (k, k_positions, table)
    # q_out and q_scale outputs: (name, columns per head, dtype); weights_out is common
    q_outputs: tuple[tuple[str, int, torch.dtype], ...]
    weights_by_shape: bool  # the weights product is claimed by shape (MXFP4), not read off q (FP8)
    node_prefix: str  # the scratch nodes' names in debug dumps and golden graphs

    @property
    def op_name(self) -> str:
        return self.op._schema.name.split("::", 1)[1]


def _fp8_anchors(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [node] if is_fp8_q_anchor(node) else []


def _mxfp4_anchors(node: torch.fx.Node) -> list[torch.fx.Node]:
    # [n, 64] rows are k's: found from the cache writes
    return [p for p in packed_outputs(node) if len(shape(p)) == 3] if is_pack(node) else []


FORMATS = {
    "fp8": IndexerFormat(
        "fp8", DSV4_INDEXER_ROPE_FP8_INSERT, "dsv4_indexer", HEAD_DIM, FP8_SLOT_BYTES, _fp8_anchors,
        match_fp8_q_side, match_fp8_k_rows, (("q_out", HEAD_DIM, torch.float8_e4m3fn),), weights_by_shape=False,
        node_prefix="prepfuse_indexer_"),
    "mxfp4": IndexerFormat(
        "mxfp4", DSV4_INDEXER_ROPE_MXFP4_INSERT, "dsv4_indexer_mxfp4", MXFP4_PACKED, MXFP4_SLOT_BYTES, _mxfp4_anchors,
        match_mxfp4_q_side, match_mxfp4_k_rows,
        (("q_out", MXFP4_PACKED, torch.uint8), ("q_scale", MXFP4_BLOCKS, torch.uint8)), weights_by_shape=True,
        node_prefix="prepfuse_indexer_mxfp4_"),
}


@dataclass
class _Weights:
    """The weights product a call takes over: ``product = weights(.float()) * scale [* 2^e]``."""

    product: torch.fx.Node | None  # None: no product to take over, the op's output is unread
    weights: torch.fx.Node | None
    scale: float


class _FuseDsv4IndexerPass(PrepfusePass):
    """Rewrites matched indexer preparation of ``fmt`` into calls of its op.

    ``matched_count`` is the number of op calls made; the log names each ``<pattern>_q+k``,
    ``<pattern>_q`` or ``<pattern>_k`` (``dsv4_indexer_q+k``, ``dsv4_indexer_mxfp4_k`` ...)
    and lists every declined candidate with its reason.
    """

    fmt: IndexerFormat
    uuid_sources = (dsv4_indexer_patterns, dsv4_indexer_mxfp4_patterns, *MATCHING_MODULES)

    def settings(self) -> tuple:
        return (str(self.fmt.op._schema), str(SCRATCH._schema))

    def run(self, graph: torch.fx.Graph) -> int:
        q_sides, k_sides = self._find(graph)
        calls = _pair(graph, q_sides, k_sides)
        claimed, caches = set(), {}  # caches: a rewritten call's old cache value -> its new one
        matched = 0
        for q, k in calls:
            try:
                self._rewrite(graph, q, k, self._weights(graph, q, k, claimed), caches)
                matched += 1
            except NoMatch as err:  # the probes disagree: nothing was rewired
                self.log.declined(self.name, self._pattern(q, k), q.anchor if q else k.anchor, str(err))
        return matched

    def _pattern(self, q, k: KSide | None) -> str:
        return f"{self.fmt.pattern}_" + ("q+k" if q and k else ("q" if q else "k"))

    def _find(self, graph) -> tuple[list, list[KSide]]:
        fmt, q_sides, k_sides = self.fmt, [], []
        for node in graph.nodes:
            for anchor in fmt.q_anchors(node):
                try:
                    q_sides.append(fmt.match_q(anchor))
                except NoMatch as err:
                    self.log.declined(self.name, f"{fmt.pattern}_q", anchor, str(err))
        writes = byte_row_writes(graph)
        for put, write in writes.items():
            if shape(put_rows(put))[-1:] != (fmt.data_bytes,):
                continue
            try:
                if isinstance(write, NoMatch):
                    raise write
                k = match_k_side(write, writes.values(), fmt.data_bytes, fmt.k_rows)
                if not k.cache_out.users:
                    raise NoMatch("write: nothing reads the written cache")
                k_sides.append(k)
            except NoMatch as err:
                self.log.declined(self.name, f"{fmt.pattern}_k", put, str(err))
        return q_sides, k_sides

    def _weights(self, graph, q, k: KSide | None, claimed: set) -> _Weights | None:
        """The weights product the call takes over: FP8's fold, read off the q side; MXFP4's
        first unclaimed ``weights.float() * c`` of q's ``[T, H]`` that can join the call (its
        weights before, its readers after every other input and reader), claimed."""
        if q is None:
            return None
        if not self.fmt.weights_by_shape:  # the fold is one of q's outputs (``Fp8QSide.outputs``)
            return _Weights(None, q.weights, q.weights_scale)
        order = {n: i for i, n in enumerate(graph.nodes)}
        tokens, heads = shape(q.q)[:2]
        for product, weights, c in weights_products(graph):
            size = shape(product)
            if product in claimed or not (same_size(size[0], tokens) and same_size(size[1], heads)):
                continue
            inputs = [*_inputs(q, k), weights]
            if max(order[n] for n in inputs) < min(order[n] for n in _readers(q, k, product)):
                claimed.add(product)
                return _Weights(product, weights, c)
        return _Weights(None, None, 1.0)

    def _rewrite(self, graph, q, k: KSide | None, weights: _Weights | None, caches: dict) -> None:
        fmt = self.fmt
        order = {n: i for i, n in enumerate(graph.nodes)}
        readers = _readers(q, k, weights.product if weights else None)
        emit = Emitter(graph, min(readers, key=order.__getitem__), source=q.anchor if q else k.anchor)
        like = q.q if q else k.k
        if q is not None:
            tokens, heads = emit.size(q.q, 0), shape(q.q)[1]
            q_in, positions = emit.as_bf16(q.q), q.positions  # fp32 where Inductor dropped the code's rounding
        else:  # no tokens: the op reads no q and writes no q output
            tokens, heads = 0, 1
            q_in, positions = emit.empty([0, 1, HEAD_DIM], torch.bfloat16, like), emit.empty([0], torch.int64, like)
        if weights is not None and weights.weights is not None:
            w_in, weights_scale = weights.weights, weights.scale
        else:  # no weights product to take over: the op's weights_out is written and never read
            w_in, weights_scale = emit.empty([tokens, heads], torch.float32, like), 1.0
        if k is not None:
            k_in, k_positions, slots, block_size = emit.as_bf16(k.k), k.k_positions, k.slots, k.block_size
            # a cache an earlier call of this pass wrote (two layers, one cache): its new value
            k_cache = caches.get(k.cache_in, k.cache_in)
        else:  # no rows inserted: the op reads no k row and writes no cache byte
            k_in = emit.empty([0, HEAD_DIM], torch.bfloat16, like)
            k_positions, slots = emit.empty([0], torch.int64, like), emit.empty([0], torch.int64, like)
            # the schema says the op may write it, so a buffer of its own; arena memory, not
            # an allocation per call (the op writes no byte of it: no slots)
            k_cache, block_size = self._scratch(emit, "unused_k_cache", [1, fmt.slot_bytes], torch.uint8, like), 1

        outputs = {name: self._scratch(emit, name, [tokens, heads, cols], dtype, like) for name, cols, dtype in fmt.q_outputs}
        outputs["weights_out"] = self._scratch(emit, "weights_out", [tokens, heads], torch.float32, like)
        args = dict(
            q=q_in, weights=w_in, k=k_in, **outputs,
            k_cache=k_cache, slot_mapping=slots, positions=positions, k_positions=k_positions,
            cos_sin_cache=q.cos_sin_cache if q else k.cos_sin_cache, weights_scale=weights_scale,
            block_size=block_size,
        )
        outs = emit.functional_call(fmt.op, args)
        note = ""
        if self.validate == "probe":
            checked = [Checked(name, node, outs[name]) for name, node in q.outputs()] if q is not None else []
            if weights is not None and weights.product is not None:
                checked.append(Checked("weights_out", weights.product, outs["weights_out"]))
            if k is not None:
                checked.append(Checked("k_cache", k.cache_out, outs["k_cache"]))
            note = emit.validate(args, checked)
        if q is not None:
            for name, node in q.outputs():
                node.replace_all_uses_with(outs[name])
        if weights is not None and weights.product is not None:
            weights.product.replace_all_uses_with(outs["weights_out"])
        if k is not None:
            k.cache_out.replace_all_uses_with(outs["k_cache"])
            caches[k.cache_out] = outs["k_cache"]
        self.log.matched(self.name, self._pattern(q, k), q.anchor if q else k.anchor, note)

    def _scratch(self, emit: Emitter, output: str, sizes, dtype, like) -> torch.fx.Node:
        """An output buffer in scratch-arena memory (reserved before KV sizing), not
        allocated per call: reservation ``<op>.<output>.<k>``."""
        return emit.scratch(f"{self.fmt.op_name}.{output}", sizes, dtype, like,
                            name=f"{self.fmt.node_prefix}{output}_scratch")


class FuseDsv4IndexerPrepPass(_FuseDsv4IndexerPass):
    """The FP8 indexer format: ``prepfuse::dsv4_indexer_rope_fp8_insert``."""

    name = "fuse_dsv4_indexer_prep"
    fmt = FORMATS["fp8"]


class FuseDsv4IndexerMxfp4PrepPass(_FuseDsv4IndexerPass):
    """The MXFP4 indexer format: ``prepfuse::dsv4_indexer_rope_mxfp4_insert``."""

    name = "fuse_dsv4_indexer_mxfp4_prep"
    fmt = FORMATS["mxfp4"]


def _readers(q, k: KSide | None, weights_product: torch.fx.Node | None = None) -> list[torch.fx.Node]:
    """The nodes that read a call's outputs: q's outputs, the weights product, the cache."""
    readers = []
    if q is not None:
        readers += [u for _, node in q.outputs() for u in node.users]
    if weights_product is not None:
        readers += list(weights_product.users)
    if k is not None:
        readers += list(k.cache_out.users)
    return readers


def _inputs(q, k: KSide | None) -> list[torch.fx.Node]:
    inputs = q.inputs() if q is not None else []
    return inputs + ([k.k, k.k_positions, k.cos_sin_cache, k.cache_in, k.slots] if k is not None else [])


def _pair(graph, q_sides: list, k_sides: list[KSide]) -> list[tuple]:
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

