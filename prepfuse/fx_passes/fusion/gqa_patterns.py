"""The GQA (Qwen3 / Llama) preparation patterns, read back out of a post-grad graph.

``match_heads`` reads one prepared head tensor (q, or k before its cache write) back to
its source: columns of the fused qkv it came from, or the whole of a separate q or k
projection; ``match_cache_write`` reads one paged-cache ``index_put`` back to its rows
and slots. Both return what the fused op needs or raise :class:`NoMatch` naming the step
that differs; ``gqa.py`` combines one q, one k write and one v write (of one
qkv, or of three projections of one input) into one call. Built from the step
recognisers of ``matching/recognizers.py``.

One torch difference shows here: torch 2.11's Inductor removes the bf16 round trip of
``(k.to(bf16).float() / kv_scale)`` before an fp8 cache write (``_compat.
inductor_drops_narrowing_round_trips``), so its graph quantises the fp32 rotation unrounded.
Where it does, fp32 heads read only by such quantisations count as the bf16 heads the code
rounded (``rounding_dropped``): the fused op rounds them to bf16 as the code says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse._compat import e4m3_cast_overflow, inductor_drops_narrowing_round_trips
from prepfuse.fx_passes.matching.cache_writes import first_rows_of
from prepfuse.fx_passes.matching.cos_sin import CosSin, cos_sin_operand
from prepfuse.fx_passes.matching.layouts import (
    heads_major_as_token_major,
    VIEW_OPS, Axis, Layout, apply_views, canonical_order, identity, strip_views, token_major_heads,
)
from prepfuse.fx_passes.matching.recognizers import (
    CONVERTS, RESHAPES, BlockRows, NoMatch, aten, bf16_columns, prims, block_rows, clamp_bounds, columns, convert_source, describe,
    expect, is_op, last_dim_slice, paged_slots, put_rows, rope_gptj, rope_neox, same_size, scatter_back, shape, val,
    slice_params, view_chain, weighted_rms_norm,
)
from prepfuse.fx_passes.matching.validation import read_as_rounded
from prepfuse.ops.gqa_qknorm_rope_kv_insert import CACHE_DTYPES, FP8_MAX, HEAD_DIMS

__all__ = ["NoMatch", "Heads", "CacheWrite", "SliceRows", "match_heads", "match_cache_write", "slot_count", "slot_nodes", "is_cache_write", "rounding_dropped",
           "unsupported_cache_write"]


@dataclass
class Heads:
    """``prepared = rope(norm(heads))`` bf16, ``heads`` a view of ``source[:, first:first + H*D]``
    as ``[T, H, D]`` in any layout (``[B, S, H, D]``, ``[B, H, S, D]`` ...: ``layout``)."""

    prepared: torch.fx.Node
    source: torch.fx.Node  # bf16 [T, W]: the fused qkv, or a separate projection (first 0, W = H*D)
    first_column: int
    num_heads: int
    head_dim: int
    norm_weight: torch.fx.Node | None  # bf16 [D], None without norm
    eps: float | None
    is_neox: bool
    rotary_dim: int
    cos_sin: CosSin  # a gathered [P, R] table, or the values the graph computes per token
    bf16_rope: bool  # the source rotates in bf16 (HF): fusing changes its numerics
    layout: Layout  # prepared's dims as factors of the heads' columns of source (token-major: [T, H, D])


@dataclass(frozen=True)
class SliceRows:
    """The positions ``start .. end - 1`` of every sequence of a static cache, overwritten by a
    slice assignment (``cache[:, :, start:end] = k``, ``cache[:, start:end] = k``): token
    ``(b, t)`` goes to position ``start + t``. ``start`` and ``end`` are numbers or the graph's
    nodes of them (a dynamic position)."""

    start: object
    end: object

    def nodes(self) -> tuple[torch.fx.Node, ...]:
        return tuple(n for n in (self.start, self.end) if isinstance(n, torch.fx.Node))


@dataclass
class CacheWrite:
    """``cache[slots // bs, slots % bs] = rows`` (rows maybe fp8 of ``x / kv_scale``)."""

    put: torch.fx.Node  # the index_put, or its view back to a paged cache: its users read the written cache
    cache: torch.fx.Node  # the cache before the write, [NB, bs, Hkv, D]
    slots: torch.fx.Node | BlockRows | SliceRows  # int64 [n]; a page table's (block, row) indices; a slice
    rows: torch.fx.Node  # bf16 [n, Hkv, D] or [T, Hkv, D] (first n inserted), before quantisation
    #   (fp32 where Inductor removed their bf16 round trip: ``rounding_dropped``)
    kv_scale: torch.fx.Node | None
    # fp8: values past 448 saturate (a clamp, or a bare cast where torch's saturates); False:
    # NaN past 464, a bare cast where torch's gives NaN (the op's ``fp8_saturate``)
    saturate: bool = True
    # rows and slots have sizes the graph cannot tell equal (two dynamic dims: an engine's
    # T and T'); index_put needs them equal, and the call asserts so at run time
    rows_per_slot_at_run_time: bool = False
    # the cache's layout: "paged" [NB, bs, Hkv, D]; "heads_first" [NB, Hkv, bs, D]
    # (``cache[s // bs, :, s % bs] = rows``); "sequence" [B, Hkv, S, D] of B sequences written
    # at the same positions (``cache[:, :, pos] = k``, rows [B, Hkv, T, D]; slots: the positions);
    # "flat" [N, Hkv, D], a token pool (``cache[loc] = rows``, SGLang's ``k_buffer``). The op
    # writes the last three through a [NB, bs, Hkv, D] view of them (a permutation, B blocks
    # of S slots; block size 1), its strides saying the layout
    layout: str = "paged"
    # the slots are positions within each of the cache's B sequences (a static cache written
    # by position or by a slice): the op's slot is b * S + position; else they are the op's
    per_sequence: bool = False


# --------------------------------------------------------------------------------------
# Heads: qkv columns -> (weighted RMSNorm) -> RoPE (full or partial) -> bf16
# --------------------------------------------------------------------------------------
def heads_view(node) -> tuple[torch.fx.Node, int, int, int, Layout]:
    """(source, first column, heads, head size, layout) for a view of ``H*D`` columns of a 2-d
    ``source [T, W]`` as heads: ``qkv[:, a:b].view(T, H, D)`` (or a split), ``x.view(T, H, D)``
    of a whole projection (a separate q, k or v), and any further views of those that keep
    each head's ``D`` values together (``[B, S, H, D]``, ``.transpose(1, 2)``, a batch of
    one ...). ``layout`` is ``node``'s dims over the heads' columns (``layouts.py``)."""
    head_dim = shape(node)[-1]
    base, chain = strip_views(node)
    first, src, start = 0, base, None
    found = last_dim_slice(base)
    if found is not None and len(shape(found[0])) == 2:  # columns of a 2-d qkv (slice or split)
        src, first, end, step = found
        expect(step == 1, f"heads: {describe(base)} takes every {step}th column of {describe(src)}")
    elif found is not None:  # columns of a qkv with batch dims ([B, S, W], gpt-fast) over a 2-d [T, W]
        src, first, end, step = found
        root, lead_chain = strip_views(src)
        lead = apply_views(identity(root), lead_chain) if len(shape(root)) == 2 else None
        if lead is not None and lead.dims[-1] == (Axis(1, shape(root)[1], 1),) and step == 1:
            # the views keep the last dim whole: the slice's columns are columns of the 2-d root
            start = Layout(lead.dims[:-1] + ((Axis(1, shape(base)[-1], 1),),))
            src = root
    expect(isinstance(src, torch.fx.Node) and len(shape(src)) == 2 and chain,
           f"heads: {describe(node)} is not a view of columns of a 2-d qkv or projection (it is {describe(base)})")
    num_tokens, width = shape(src)[0], shape(base)[-1]
    layout = apply_views(start or identity(base), chain)
    expect(layout is not None, f"heads: {describe(node)} is a view of {describe(base)} that moves values across heads")
    found = token_major_heads(layout, num_tokens, head_dim)
    expect(found is not None or _heads_in_any_order(layout, num_tokens, head_dim),
           f"heads: {describe(node)} does not hold whole heads of {head_dim} columns of {describe(src)}")
    num_heads = width // head_dim
    expect(width == num_heads * head_dim, f"heads: columns [{first}, {first + width}) are not "
                                          f"whole heads of {head_dim}")
    expect(val(src).dtype == torch.bfloat16, f"heads: qkv is {val(src).dtype}, the op reads bfloat16")
    return src, first, num_heads, head_dim, layout


def _heads_in_any_order(layout: Layout, num_tokens, head_dim: int) -> bool:
    """``layout`` holds token-major heads ``[T, H, D]`` with its dims permuted, the head dim
    still last (``[B, H, S, D]``): sorted back into base order, it is token-major."""
    order = canonical_order(layout)
    if order is None or order[-1] != len(order) - 1:
        return False
    by_position = sorted(range(len(order)), key=order.__getitem__)
    return token_major_heads(Layout(tuple(layout.dims[i] for i in by_position)),
                             num_tokens, head_dim) is not None


def qkv_heads(node, heads_major: bool = False) -> tuple[torch.fx.Node, int, int, int]:
    """(source, first column, heads, head size) of ``heads_view`` for rows read as they are
    (v): token-major ``[T, H, D]`` only, the order the cache rows are in; ``heads_major``:
    ``[H, T, D]``, the order a per-sequence cache ``[1, Hkv, S, D]`` takes them in."""
    src, first, num_heads, head_dim, layout = heads_view(node)
    if heads_major:
        layout = heads_major_as_token_major(layout) or layout
    expect(token_major_heads(layout, shape(src)[0], head_dim) is not None,
           f"heads: {describe(node)} holds its heads transposed, not one row of heads per token")
    return src, first, num_heads, head_dim


def _rotation(body) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, bool, bool, bool]:
    """(x, cos, sin, is_neox, cos/sin cast to bf16, cos/sin full width) of one RoPE formula's result."""
    if is_op(body, aten.view.default, aten.reshape.default, aten._unsafe_view.default):  # GPT-J: (even, odd) pairs
        x, cos, sin = rope_gptj(body)
        return x, cos, sin, False, False, False
    x, cos, sin, cast, full = rope_neox(body)
    expect(cast in (None, torch.bfloat16), f"rope: cos/sin are cast to {cast}")
    return x, cos, sin, True, cast is not None, full


def match_heads(prepared: torch.fx.Node) -> Heads:
    """Pattern (Hugging Face ``Qwen3Attention``, engine layout ``[T, H, D]``)::

        h = qkv.split([Hq*D, Hkv*D, Hkv*D], -1)[i].view(T, H, D)     # or qkv[:, a:b]
        h = norm_weight * rms_norm(h.float(), eps).to(bf16)           # Qwen3 only
        c, s = cos_sin_cache[positions].chunk(2, -1)                 # [T, R/2] fp32 each
        out = rope(h[..., :R], c, s)    # NeoX or GPT-J; in fp32 then .to(bf16), or HF all-bf16
        prepared = cat((out, h[..., R:]), -1)                          # partial only (R < D)
        (a full rotation read only by an fp8 quantisation may be the fp32 ``out`` before its
         ``.to(bf16)``, where Inductor dropped the round trip: ``rounding_dropped``)
      ->  (with the k side and the v write, gqa.py)
        af = auto_functionalized(gqa_qknorm_rope_kv_insert, qkv, norm_weight(s), q_out=empty(T, Hq, D), ..)
        (or gqa_separate_qknorm_rope_kv_insert(q, k, v, ..) where the heads are whole projections)
        (every reader of the prepared q reads af[q_out])
    """
    pv = val(prepared)
    dropped = rounding_dropped(prepared)
    expect(pv.dtype == torch.bfloat16 or dropped, f"heads: the prepared tensor is {pv.dtype}, the op writes bfloat16")
    # sizes are compared only where static: a test of a symbolic T would add a guard
    head_dim = pv.shape[-1]
    expect(pv.dim() in (3, 4) and isinstance(head_dim, int) and head_dim in HEAD_DIMS,
           f"heads: shape {tuple(pv.shape)}, the op's head size is one of {HEAD_DIMS}")
    rot, rest = prepared, None
    if is_op(prepared, aten.cat.default) and len(prepared.args[0]) == 2 and last_dim_slice(prepared.args[0][1]) is not None:
        rot, rest = prepared.args[0]  # partial rotary: cat((rope(h[..., :R]), h[..., R:]), -1)
    rot_dim = shape(rot)[-1]
    # the fp32 rotation before its rounding to bf16 (``prepared`` itself when Inductor dropped that)
    inner = prepared if dropped else convert_source(rot, torch.bfloat16)
    fp32 = inner is not None and val(inner).dtype == torch.float32
    x, cos, sin, is_neox, cast, full = _rotation(inner if fp32 else rot)
    if full:  # full-width values multiplied in: rounded as the model rounds them
        cast = val(cos).dtype == torch.bfloat16 and val(x).dtype == torch.bfloat16
    expect(fp32 or cast or val(x).dtype == torch.bfloat16, "rope: mixed dtypes")
    if rest is not None:
        h = bf16_columns(x, 0, rot_dim, "rope input") if fp32 else columns(x, 0, rot_dim, "rope input")
        expect(columns(rest, rot_dim, head_dim, "pass-through dims") is h, "rope: rotated and pass-through dims of different tensors")
    else:
        h = convert_source(x, torch.float32) if fp32 else x
        expect(h is not None, f"rope: fp32 rotation of {describe(x)}, not of the bf16 heads cast to fp32")
    weight = eps = None
    normed, after_norm = strip_views(h)  # Hugging Face: the norm on [B, S, H, D], then .transpose(1, 2)
    if is_op(normed, aten.mul.Tensor, *CONVERTS):  # normed heads (Qwen3)
        heads, weight, eps = weighted_rms_norm(normed)
        wv = val(weight)
        expect(wv.dtype in (torch.bfloat16, torch.float32) and wv.shape == (head_dim,) and wv.stride(0) == 1,
               f"norm: weight is {wv.dtype} {tuple(wv.shape)}, the op reads a dense bfloat16 or float32 [{head_dim}]")
        qkv, first, num_heads, hd, layout = heads_view(heads)
        layout = apply_views(layout, after_norm)
        expect(layout is not None, f"heads: the normed heads are moved by a view that mixes their values ({describe(h)})")
    else:
        qkv, first, num_heads, hd, layout = heads_view(h)
    expect(hd == head_dim, f"heads: head size {hd} != {head_dim}")
    num_tokens = shape(qkv)[0]
    token_major = token_major_heads(layout, num_tokens, head_dim) is not None
    cos_sin = cos_sin_operand(cos, sin, layout, shape(prepared), num_tokens, rot_dim, full=full,
                              table_rank=3 if token_major and pv.dim() == 3 else None)
    if cos_sin.table is not None:
        expect(shape(cos_sin.table)[1] == rot_dim,
               f"rope: the cos/sin table has {shape(cos_sin.table)[1]} columns, the rotary dim is {rot_dim}")
    return Heads(prepared, qkv, first, num_heads, head_dim, weight, eps, is_neox, rot_dim, cos_sin,
                 bf16_rope=bool(cast) or not fp32, layout=layout)


def rounding_dropped(node) -> bool:
    """Whether ``node`` is fp32 rows whose ``.to(bf16).float()`` before an fp8 cache write
    Inductor removed (``inductor_drops_narrowing_round_trips``; torch 2.11): every reader
    is ``(node / kv_scale).clamp(..).to(e4m3)``, directly or through views. The graph then cannot tell this from code
    that quantised the fp32 rows unrounded; the pass reads it as the rounded rows (what the
    supported spellings write, and the op computes). Readers other than the quantisation
    (a q read by attention) keep an fp32 tensor from passing for bf16 heads.
    """
    if val(node).dtype != torch.float32 or not node.users or not inductor_drops_narrowing_round_trips():
        return False
    if not _only_quantised(node):
        return False
    read_as_rounded(node)  # validation rounds the region here too
    return True


def _only_quantised(node) -> bool:
    """Every reader of ``node`` is its quantisation to e4m3, directly or through views (the
    transpose of heads into a heads-first cache)."""
    return bool(node.users) and all(
        _only_quantised(user) if is_op(user, *VIEW_OPS) and user.args[0] is node else _quantised_to_e4m3(user, node)
        for user in node.users)


def _quantised_to_e4m3(div: torch.fx.Node, rows: torch.fx.Node) -> bool:
    """``div`` is ``rows / scale``, read only through clamps by casts to float8_e4m3fn."""
    if not (is_op(div, aten.div.Tensor) and div.args[0] is rows):
        return False
    node = div
    while len(node.users) == 1 and is_op(next(iter(node.users)), aten.clamp_min.default, aten.clamp_max.default,
                                         aten.clamp.default):
        node = next(iter(node.users))
    return bool(node.users) and all(convert_source(u, torch.float8_e4m3fn) is node for u in node.users)


# --------------------------------------------------------------------------------------
# Cache writes: index_put(cache, [slots // bs, slots % bs], rows)
# --------------------------------------------------------------------------------------
def is_cache_write(node) -> bool:
    """A candidate: a non-accumulating ``index_put`` of ``[n, H, D]`` rows into a 4-d tensor
    (``[B, Hkv, T, D]`` rows of B sequences), or a slice of a 4-d tensor's dim 1 or 2
    overwritten (``slice_scatter``: a static cache written at consecutive positions)."""
    if is_op(node, aten.slice_scatter.default):  # of a graph input: a local [B, H, S, D] scratch is no cache
        dim, _, _, step = slice_params(node.args[2:], node.kwargs)
        return _is_graph_cache(node.args[0]) and dim in (1, 2) and step == 1
    if not is_op(node, aten.index_put.default):
        return False
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    rows, cache = shape(put_rows(node)), shape(node.args[0])
    # [B, Hkv, T, D] rows of B sequences into their [B, Hkv, S, D] cache
    sequences = len(rows) == 4 and len(cache) == 4 and same_size(rows[0], cache[0])
    return not accumulate and len(cache) in (3, 4) and (len(rows) == 3 or sequences)


def _is_graph_cache(cache, ranks: tuple[int, ...] = (4,)) -> bool:
    """``cache`` looks like a KV cache: a bf16/fp8/uint8/fp16 graph input or a view of one, of
    one of ``ranks`` dims (fp16 so that the cache's dtype is the reason given, not silence)."""
    root = view_chain(cache)[0] if isinstance(cache, torch.fx.Node) else None
    return (isinstance(root, torch.fx.Node) and root.op == "placeholder" and len(shape(cache)) in ranks
            and val(cache).dtype in (*CACHE_DTYPES, torch.float16))


def unsupported_cache_write(node) -> str | None:
    """Why ``node``, a write into what looks like a KV cache (a 4-d bf16/fp8 graph input or a
    view of one), is not a candidate, or None when it is no such write: the forms other
    engines use that the pass does not match yet, so the report says where it stopped."""
    if not is_op(node, aten.index_copy.default, aten.index_put.default, aten.slice_scatter.default):
        return None
    cache = node.args[0]
    # index assignment also writes token pools, [N, Hkv, D]
    if not _is_graph_cache(cache, (3, 4) if is_op(node, aten.index_put.default) else (4,)):
        return None
    sizes = tuple(shape(cache))
    if is_op(node, aten.index_copy.default):
        return (f"write: index_copy into a {list(sizes)} cache along dim {node.args[1]} (Hugging Face's StaticCache "
                "`index_copy_(2, cache_position, k)`); the pass matches paged-cache index assignment, not this yet")
    if is_op(node, aten.slice_scatter.default) and not is_cache_write(node):
        dim, start, end, step = slice_params(node.args[2:], node.kwargs)
        return (f"write: a slice [{describe(start)}:{describe(end)}:{step}] of dim {dim} of a {list(sizes)} cache "
                "overwritten (slice_scatter); the pass matches slices of consecutive positions of a static cache, "
                "`cache[:, :, start:end] = k` of [B, Hkv, S, D] or `cache[:, start:end] = k` of [B, S, Hkv, D]")
    if is_cache_write(node):
        return None
    rows = put_rows(node)
    where = f"written at {[describe(i) for i in node.args[1]]} of a {list(sizes)} cache"
    if len(node.args) > 3 and node.args[3] or node.kwargs.get("accumulate", False):
        return f"write: rows {list(shape(rows))} {where} are added (index_put with accumulate=True), not stored"
    if len(shape(rows)) == 4 and len(sizes) == 4:  # not one row per sequence: broadcast across the batch
        return (f"write: rows {list(shape(rows))} {where} of {sizes[0]} sequences: the same rows for every "
                "sequence (broadcast), not one set of rows per sequence")
    return (f"write: rows {list(shape(rows))} {where}: not one [n, Hkv, D] row per index (the pass matches "
            "[NB, bs, Hkv, D] paged caches and [N, Hkv, D] token pools written that way)")


def _fp8_rows(values) -> tuple[torch.fx.Node, torch.fx.Node, bool]:
    """(bf16 rows, kv_scale, saturate) for ``(rows.float() / kv_scale).clamp(-448, 448).to(e4m3)``
    (the fp32 rows where Inductor dropped their bf16 round trip: ``rounding_dropped``), or
    the bare ``(k / k_scale).to(fp8)`` of SGLang and vLLM's ``forward_native``, whose values
    past 448 are what torch's cast on the graph's device makes of them
    (``_compat.e4m3_cast_overflow``: torch 2.13's CPU cast saturates, the op's default;
    torch 2.11's CUDA cast gives NaN past 464, the op's ``fp8_saturate=False``); the probes
    check it on the graph's own torch (validation). ``rows / kv_scale`` with bf16 rows
    divides in fp32 (type promotion), as ``rows.float() / kv_scale`` does."""
    clamped = convert_source(values, torch.float8_e4m3fn)
    expect(clamped is not None, f"fp8: rows {describe(values)} are not a cast to float8_e4m3fn")
    scaled, lo, hi = clamp_bounds(clamped)
    expect((lo, hi) in ((-FP8_MAX, FP8_MAX), (None, None)),
           f"fp8: clamp to [{lo}, {hi}], expected [-448, 448] (or none: torch's cast then decides)")
    device = val(values).device.type
    overflow = "saturate" if lo is not None else e4m3_cast_overflow(device)
    expect(overflow is not None,
           f"fp8: {describe(values)} is a bare cast to float8_e4m3fn with no clamp, and what torch "
           f"{torch.__version__}'s cast on {device} makes of values past 448 is neither saturation nor NaN past "
           "464 (see the warning); `.clamp(-448, 448)` before the cast makes it the op's math")
    expect(is_op(scaled, aten.div.Tensor), f"fp8: rows are scaled by {describe(scaled)}; the op divides by kv_scale "
                                           "(a true division: a multiply by 1/kv_scale rounds differently)")
    x, scale = scaled.args[:2]
    sv = val(scale)
    expect(isinstance(scale, torch.fx.Node) and sv.dtype == torch.float32 and sv.numel() == 1 and sv.dim() <= 1,
           f"fp8: divisor {describe(scale)} is not a device fp32 kv_scale of shape [1] or []")
    saturate = overflow == "saturate"
    if val(x).dtype == torch.bfloat16 and val(scaled).dtype == torch.float32:  # promoted: an fp32 division
        return x, scale, saturate
    rows = convert_source(x, torch.float32)
    if rows is not None and val(rows).dtype == torch.bfloat16:  # bf16 rows widened: exactly their values
        return rows, scale, saturate
    expect(rounding_dropped(x), f"fp8: {describe(x)} is not bf16 rows cast to fp32")
    return x, scale, saturate


def _unquantised_rows(values, cache_dtype) -> tuple[torch.fx.Node, torch.fx.Node | None, bool]:
    """(the bf16 rows, kv_scale or None, saturate) a cache write stores: through the fp8
    quantisation into an e4m3 cache (``_fp8_rows``), as they are into a bf16 one."""
    scale, saturate = None, True
    if cache_dtype == torch.uint8:  # vLLM's "fp8" cache: e4m3fn codes stored as their bytes
        codes = values.args[0] if is_op(values, aten.view.dtype) else None
        expect(codes is not None and val(codes).dtype == torch.float8_e4m3fn and len(values.args) == 2,
               f"write: rows {describe(values)} into a uint8 cache are not float8_e4m3fn codes viewed as uint8 "
               "(`.to(torch.float8_e4m3fn).view(torch.uint8)`): the op writes e4m3fn codes into uint8 caches")
        values = codes
        cache_dtype = torch.float8_e4m3fn
    if cache_dtype == torch.float8_e4m3fn:
        values, scale, saturate = _fp8_rows(values)
    expect(val(values).dtype == torch.bfloat16 or (scale is not None and rounding_dropped(values)),
           f"write: rows are {val(values).dtype}, the op writes bfloat16 values")
    return values, scale, saturate


def slot_count(slots) -> object:
    """How many rows a write's slots (a node, or ``BlockRows``) address."""
    return shape(slots.block if isinstance(slots, BlockRows) else slots)[0]


def slot_nodes(slots) -> tuple[torch.fx.Node, ...]:
    """The nodes a write's slots are read from."""
    return slots.nodes() if isinstance(slots, (BlockRows, SliceRows)) else (slots,)


def paged_cache_of_slot_view(cache) -> torch.fx.Node | None:
    """The paged cache ``[NB, bs, Hkv, D]`` of which ``cache`` is the flat slot view
    ``[NB * bs, Hkv, D]`` (``k_cache.view(-1, Hkv, D)``: blocks and their rows merged, so slot
    ``s`` is row ``s % bs`` of block ``s // bs``), or None. Only sizes the graph knows as
    numbers are compared, so no guard is added."""
    if not is_op(cache, *RESHAPES):
        return None
    base = cache.args[0]
    bv, cv = val(base), val(cache)
    if not isinstance(bv, torch.Tensor) or bv.dim() != 4:
        return None
    sizes, strides = tuple(bv.shape), tuple(bv.stride())
    if not all(isinstance(n, int) for n in (*sizes, *strides, *cv.shape, *cv.stride())):
        return None
    merged = sizes[0] * sizes[1] == cv.shape[0] and sizes[2:] == tuple(cv.shape[1:])
    same_rows = strides[0] == sizes[1] * strides[1] and strides[1:] == tuple(cv.stride())
    return base if merged and same_rows else None


def _slice_write(put: torch.fx.Node) -> CacheWrite:
    """Pattern (a static cache of B sequences written at consecutive positions, the slice's
    functional form ``slice_scatter(cache, copy(slice(cache, ..), rows), dim, start, end)``)::

        cache[:, :, start:end] = k      # [B, Hkv, S, D], rows [B, Hkv, T, D] ("sequence")
        cache[:, start:end] = k         # [B, S, Hkv, D], rows [B, T, Hkv, D] (B blocks of S)
      ->  the op at slots b * S + start + t (``SliceRows``, computed in front of the call)
    """
    cache, src = put.args[:2]
    dim, start, end, _ = slice_params(put.args[2:], put.kwargs)
    cv = val(cache)
    expect(cv.dtype in CACHE_DTYPES, f"write: the cache is {cv.dtype}, the op writes bfloat16, float8_e4m3fn or "
                                     "uint8 (e4m3fn codes) caches")
    expect(cv.stride(-1) == 1, f"write: the cache has strides {tuple(cv.stride())}, the op writes dense head rows")
    values = src
    if is_op(src, aten.copy.default):  # x[..] = rows: the rows copied into the slice, then scattered
        target = src.args[0]
        expect(is_op(target, aten.slice.Tensor) and target.args[0] is cache
               and slice_params(target.args[1:], target.kwargs) == (dim, start, end, 1),
               f"write: {describe(src)} copies into {describe(target)}, not the slice it scatters back")
        values = src.args[1]
        expect(tuple(shape(values)) == tuple(shape(src)) and val(values).dtype == val(src).dtype,
               f"write: rows {list(shape(values))} {val(values).dtype} are broadcast or cast into the "
               f"{list(shape(src))} {val(src).dtype} slice, not one row per position")
    expect(start is None or isinstance(start, (int, torch.fx.Node)), f"write: slice start {describe(start)}")
    expect(not (isinstance(start, int) and start < 0), f"write: slice start {start} counts from the end")
    if end is None or (isinstance(end, int) and end > cv.shape[dim]):  # `cache[:, a:] = k`: to the last position
        end = cv.shape[dim]
    rows = tuple(shape(values))
    if dim == 2:  # [B, Hkv, S, D]: heads first, one block of S positions per sequence
        layout = "sequence"
        ok = (rows[0], rows[1], rows[3]) == (cv.shape[0], cv.shape[1], cv.shape[3])
    else:  # [B, S, Hkv, D]: a paged cache of B blocks of S slots, rows token-major
        layout = "paged"
        ok = (rows[0], rows[2], rows[3]) == (cv.shape[0], cv.shape[2], cv.shape[3])
    expect(ok, f"write: rows {list(rows)} are not one set per sequence of the {list(cv.shape)} cache's "
               f"positions {describe(start)}:{describe(end)}")
    expect(all(isinstance(n, int) for n in cv.shape), f"write: a {list(cv.shape)} cache of dynamic size; the op's "
                                                      "slots b * S + position need B and S as numbers")
    values, scale, saturate = _unquantised_rows(values, cv.dtype)
    return CacheWrite(put, cache, SliceRows(start or 0, end), values, scale, saturate, layout=layout, per_sequence=True)


def _is_sequence_index(node, batch) -> bool:
    """``node`` is each sequence's own index as a column, ``arange(B)[:, None]`` (or viewed
    ``[B, 1]``): the batch index of a write that gives every sequence its own positions."""
    column = (is_op(node, aten.unsqueeze.default) and node.args[1] in (1, -1)) or (
        is_op(node, *RESHAPES) and len(shape(node)) == 2 and same_size(shape(node)[1], 1))
    if not column:
        return False
    iota = node.args[0]
    kwargs = iota.kwargs if isinstance(iota, torch.fx.Node) else {}
    return (is_op(iota, prims.iota.default) and same_size(iota.args[0], batch) and kwargs.get("start", 0) == 0
            and kwargs.get("step", 1) == 1 and len(shape(iota)) == 1)


def _sequence_positions_write(put: torch.fx.Node, cache: torch.fx.Node, indices) -> CacheWrite:
    """Pattern (a static cache of B sequences, each written at its own positions: an engine
    batching sequences of different lengths onto one static cache)::

        cache[arange(B)[:, None], pos] = k      # [B, S, Hkv, D], pos [B, T], rows [B, T, Hkv, D]
        cache[arange(B)[:, None], :, pos] = k   # heads first [B, Hkv, S, D], rows as above
      ->  the op at slots b * S + pos[b, t] (computed in front of the call), token (b, t)
          being row b * T + t; a position outside [0, S) stays outside every sequence's rows

    (Advanced indices split by a slice put their broadcast dims first: the rows are
    token-major in both layouts.)"""
    cv = val(cache)
    expect(_is_sequence_index(indices[0], cv.shape[0]),
           f"write: sequence index {describe(indices[0])} with [B, T] positions: the pass writes each sequence's own "
           "positions into its own rows, cache[arange(B)[:, None], pos] = k, not rows of sequences an index picks")
    heads_first = len(indices) == 3
    positions = indices[-1]
    expect(not heads_first or indices[1] is None,
           f"write: indices {[describe(i) for i in indices]}: a sequence index, then positions, expected every head "
           "between them (cache[b, :, pos] = k)")
    expect(isinstance(positions, torch.fx.Node), f"write: positions {describe(positions)} are not a tensor")
    pv = val(positions)
    expect(pv.dtype == torch.int64 and pv.dim() == 2 and same_size(pv.shape[0], cv.shape[0]),
           f"write: positions are {pv.dtype} {tuple(pv.shape)}, not int64 [B, T] of the cache's {cv.shape[0]} sequences")
    values = put.args[2]  # as written: a one-token reshape is not looked through (put_rows)
    heads, dim = (cv.shape[1], cv.shape[3]) if heads_first else (cv.shape[2], cv.shape[3])
    rows = tuple(shape(values))
    if len(rows) == 3 and same_size(pv.shape[0], 1):  # one sequence: torch's decomposition drops its batch dim
        if is_op(values, *RESHAPES) and tuple(shape(values.args[0])) == (1, *rows):
            values = values.args[0]  # the rows as the model made them (an fp8 cast sits under the reshape)
        rows = (1, *rows)
    expect(len(rows) == 4 and same_size(rows[0], pv.shape[0]) and same_size(rows[1], pv.shape[1])
           and (rows[2], rows[3]) == (heads, dim),
           f"write: rows {list(rows)} are not [B, T, Hkv, D] of the {list(cv.shape)} cache at positions "
           f"{list(pv.shape)}")
    expect(all(isinstance(n, int) for n in cv.shape), f"write: a {list(cv.shape)} cache of dynamic size; the op's "
                                                      "slots b * S + position need B and S as numbers")
    values, scale, saturate = _unquantised_rows(values, cv.dtype)
    return CacheWrite(put, cache, positions, values, scale, saturate,
                      layout="heads_first" if heads_first else "paged", per_sequence=True)


def match_cache_write(put: torch.fx.Node) -> CacheWrite:
    """Pattern (``cache [NB, bs, Hkv, D]``; or heads first ``[NB, Hkv, bs, D]`` written as
    ``cache[slots // bs, :, slots % bs]``; or a flat token pool ``[N, Hkv, D]`` written
    ``cache[loc]``; or through a page table, ``cache[page_table[pos // bs], pos % bs]``, any
    block index with a row ``x % bs``: ``BlockRows``; bf16 or e4m3)::

        cache[slots // bs, slots % bs] = rows[:n]                   # bf16 cache
        cache[slots // bs, slots % bs] = (rows[:n].float() / kv_scale).clamp(-448, 448).to(e4m3)
        # functional: index_put(cache, [div, remainder], ..), copy_(cache, index_put) at the end
      ->  (the k write and the v write of one qkv, with its q)
        af = auto_functionalized(gqa_qknorm_rope_kv_insert, .., k_cache=k_cache, v_cache=v_cache, ..)
        (every reader of the written caches reads af[k_cache], af[v_cache])
    """
    if is_op(put, aten.slice_scatter.default):
        return _slice_write(put)
    cache, indices = put.args[:2]
    values = put_rows(put)  # [n, Hkv, D], also for a single slot
    cv = val(cache)
    expect(cv.dtype in CACHE_DTYPES, f"write: the cache is {cv.dtype}, the op writes bfloat16, float8_e4m3fn or "
                                     "uint8 (e4m3fn codes) caches")
    expect(cv.stride(-1) == 1, f"write: the cache has strides {tuple(cv.stride())}, the op writes dense head rows")
    if cv.dim() == 4 and len(indices) == 3 and indices[0] is None and indices[1] is None and \
            isinstance(indices[2], torch.fx.Node) and len(shape(values)) in (3, 4):
        # cache[:, :, pos] = k of B sequences at the same positions (gpt-fast; StaticCache's
        # index_copy_ decomposes to it): [B, Hkv, S, D] is a heads-first paged cache of B
        # blocks of S slots, token (b, t) at slot b * S + pos[t]; the rows [B, Hkv, T, D]
        # (one sequence: [Hkv, T, D] or [1, Hkv, T, D]) hold the heads before the tokens
        layout = "sequence"
        slots = indices[2]
        sv = val(slots)
        expect(sv.dtype == torch.int64 and sv.dim() == 1, f"write: positions are {sv.dtype} {tuple(sv.shape)}, not int64 [n]")
        heads, tokens, dim = shape(values)[-3:]
        batch = shape(values)[0] if len(shape(values)) == 4 else 1
        expect(same_size(batch, cv.shape[0]),
               f"write: rows {list(shape(values))} into a cache of {cv.shape[0]} sequences: the same rows for every "
               "sequence (broadcast), not one set of rows per sequence")
        expect((heads, dim) == (cv.shape[1], cv.shape[3]) and same_size(tokens, sv.shape[0]),
               f"write: rows {shape(values)} are not [B, Hkv, T, D] of the {list(cv.shape)} cache at "
               f"{sv.shape[0]} positions")
        expect(isinstance(cv.shape[0], int) and isinstance(cv.shape[2], int),
               f"write: a {list(cv.shape)} cache of a dynamic number of sequences or positions; the op's slots "
               "b * S + pos need both as numbers")
        values, scale, saturate = _unquantised_rows(values, cv.dtype)
        return CacheWrite(put, cache, slots, values, scale, saturate, layout=layout, per_sequence=True)
    if cv.dim() == 4 and len(indices) in (2, 3) and (_is_sequence_index(indices[0], cv.shape[0]) or all(
            isinstance(indices[i], torch.fx.Node) and len(shape(indices[i])) == 2 for i in (0, -1))):
        return _sequence_positions_write(put, cache, indices)
    written = put
    if cv.dim() == 3:  # cache[loc] = rows: a flat [N, Hkv, D] token pool
        layout = "flat"
        expect(len(indices) == 1 and isinstance(indices[0], torch.fx.Node),
               f"write: indices {[describe(i) for i in indices]} into a [N, Hkv, D] cache, expected cache[loc] = rows")
        slots = indices[0]
        sv = val(slots)
        expect(sv.dtype == torch.int64 and sv.dim() == 1, f"write: slots are {sv.dtype} {tuple(sv.shape)}, not int64 [n]")
        expect(tuple(shape(values)[1:]) == tuple(cv.shape[1:]), f"write: rows {shape(values)} do not fill [Hkv, D] of the pool")
        paged = paged_cache_of_slot_view(cache)
        if paged is not None:
            # k_cache.view(-1, Hkv, D)[slots] = rows: slot s is row s % bs of block s // bs of
            # the paged cache under the view, so the op writes that cache at the same slots,
            # and the view's scatter back (the paged cache after the write) is what readers read
            cache, layout, written = paged, "paged", scatter_back(put, [cache])
    elif len(indices) == 3 and indices[1] is None and indices[0] is not None:  # cache[s // bs, :, s % bs] = rows
        layout = "heads_first"
        slots = paged_slots([indices[0], indices[2]], cv.shape[2])
        expect((shape(values)[1], shape(values)[2]) == (cv.shape[1], cv.shape[3]),
               f"write: rows {shape(values)} do not fill [Hkv, D] of the [NB, Hkv, bs, D] cache")
    else:
        layout = "paged"
        expect(all(i is not None for i in indices),
               f"write: indices {[describe(i) for i in indices]} select positions along a dim of a {list(cv.shape)} "
               "cache; the op writes paged caches ([NB, bs, Hkv, D], heads first [NB, Hkv, bs, D]), a token pool "
               "[N, Hkv, D], or one sequence's [1, Hkv, S, D] at cache[:, :, pos]")
        try:
            slots = paged_slots(list(indices), cv.shape[1])
        except NoMatch as err:  # a block index of its own: a page table (the row still x % bs)
            try:
                slots = block_rows(list(indices), cv.shape[1])
            except NoMatch:
                raise err from None
        expect(tuple(shape(values)[1:]) == tuple(cv.shape[2:]), f"write: rows {shape(values)} do not fill [Hkv, D] of the cache")
    rows_n, slots_n = shape(values)[0], slot_count(slots)
    at_run_time = not same_size(rows_n, slots_n)
    expect(not (at_run_time and isinstance(rows_n, int) and isinstance(slots_n, int)),
           f"write: {rows_n} rows for {slots_n} slots, not one row per slot")
    values = first_rows_of(values, slots_n)  # rows[:n], sliced after quantisation
    values, scale, saturate = _unquantised_rows(values, cv.dtype)
    while is_op(values, *CONVERTS) and val(values.args[0]).dtype == torch.bfloat16:
        values = values.args[0]  # a no-op cast kept by the graph
    return CacheWrite(written, cache, slots, first_rows_of(values, slots_n), scale, saturate,
                      rows_per_slot_at_run_time=at_run_time and first_rows_of(values, slots_n) is values,
                      layout=layout)
