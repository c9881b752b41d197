"""The DeepSeek-V4 preparation patterns, read back out of a post-grad graph.

``match_q_side`` and ``match_kv_side`` each start from an anchor node and either return
what the fused op needs (its inputs and constants) or raise :class:`NoMatch` naming the
step that differs. They are built from the step recognisers of ``matching/recognizers.py``;
``dsv4.py`` decides what to rewrite. Each pattern's docstring draws the
unfused graph and the fused one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse._compat import inductor_drops_narrowing_round_trips
from prepfuse.fx_passes.matching import recognizers
from prepfuse.fx_passes.matching.cache_writes import ByteRowWrite, scale_partner
from prepfuse.fx_passes.matching.recognizers import (
    RESHAPES, aten, bf16_columns, clamp_bounds, columns, convert_source, cos_sin_rows, describe, expect, is_op,
    last_dim_slice, NoMatch, pow2_scaled, put_rows, rms_norm, rope_gptj, same_size, shape, strip, val,
)
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    AMAX_FLOOR, CACHE_ROW_BYTES, FP8_MAX, HEAD_DIM, N_QUANT_BLOCKS, NOPE_DIM, QUANT_BLOCK, ROPE_DIM, SCALE_BYTES,
)

__all__ = ["NoMatch", "QSide", "KvSide", "Padding", "match_q_side", "head_padding", "match_kv_side", "kv_columns"]


@dataclass
class QSide:
    """``out = pad(bf16(cat(y[..., :448], rope(y[..., 448:]))))``, ``y = rms_norm(q.float())``."""

    prepared: torch.fx.Node  # bf16 [T, H, 512], before padding
    q: torch.fx.Node
    positions: torch.fx.Node
    cos_sin_cache: torch.fx.Node
    eps: float


@dataclass
class KvSide:
    """The bytes of ``kv`` rows written at ``slots`` into ``cache_in``, giving ``cache_out``."""

    anchor: torch.fx.Node  # the index_put of the 576-byte rows
    # bf16 [n, 512]; fp32 where the code rounded kv to bf16 before ``.float()``, a round trip
    # torch 2.11's Inductor dropped (``kv_columns``): the call rounds it first
    kv: torch.fx.Node
    positions: torch.fx.Node  # int64 [n]
    cos_sin_cache: torch.fx.Node
    slots: torch.fx.Node  # int64 [n]
    block_size: int
    cache_in: torch.fx.Node
    cache_out: torch.fx.Node


# --------------------------------------------------------------------------------------
# q side
# --------------------------------------------------------------------------------------
def match_q_side(cat: torch.fx.Node) -> QSide:
    """Pattern (T tokens, H heads; the padding is matched later, per user)::

        x = q.float(); y = x * rsqrt(mean(x*x, -1, keepdim) + eps)
        e, o = y[..., 448::2], y[..., 449::2]; c, s = cache[positions].split(32) (unsqueezed)
        prepared = cat(y[..., :448], stack(e*c - o*s, e*s + o*c).flatten(-2)).to(bf16)
        out = pad(prepared, heads H -> HP)
      ->
        q_out = scratch(T, HP, 512)                      # prepfuse_q_out_scratch (arena view)
        af = auto_functionalized(dsv4_qnorm_rope_kv_insert, q, kv=.., q_out, k_cache=.., ..)
        out = af[q_out]
    """
    if val(cat).dtype == torch.float32:
        converts = [u for u in cat.users if convert_source(u, torch.float32) is None and is_op(u, *recognizers.CONVERTS)]
        expect(len(converts) >= 1, "q: the prepared fp32 q is never rounded to a 16-bit type")
        prepared = converts[0]
        nope, pe_rot = cat.args[0]
    else:
        prepared = cat
        nope, pe_rot = (convert_source(p, val(cat).dtype) for p in cat.args[0])
        expect(nope is not None and pe_rot is not None, "q: the 16-bit halves are not casts of fp32 math")
    dtype = val(prepared).dtype
    expect(dtype == torch.bfloat16, f"q: the prepared q is {dtype}, the op writes bfloat16")
    pe, cos, sin = rope_gptj(pe_rot)
    y = columns(nope, 0, NOPE_DIM, "q NoPE")
    expect(columns(pe, NOPE_DIM, HEAD_DIM, "q RoPE") is y, "q: NoPE and RoPE columns come from different tensors")
    x, eps = rms_norm(y)
    q = convert_source(x, torch.float32)
    expect(q is not None, f"q: the norm's input {describe(x)} is not a cast to fp32 of q")
    qv = val(q)
    expect(qv.dtype == torch.bfloat16, f"q: q is {qv.dtype}, the op reads bfloat16")
    expect(qv.dim() == 3 and qv.stride(2) == 1, f"q: q has shape {tuple(qv.shape)} strides {tuple(qv.stride())}")
    table, positions = cos_sin_rows(cos, sin, qv.shape[0], rank=3)
    return QSide(prepared, q, positions, table, eps)


@dataclass
class Padding:
    """A reader of the prepared q that pads it to ``padded_heads`` with zero heads."""

    node: torch.fx.Node  # the padded [T, HP, 512] value
    padded_heads: int
    buffer: torch.fx.Node | None  # a caller's [T, HP, 512] buffer written whole, else None


def _heads_scatter(node, start, end) -> bool:
    return is_op(node, aten.slice_scatter.default) and recognizers.slice_params(node.args[2:], node.kwargs) in (
        (1, start, end, 1), (-2, start, end, 1))


def _zeros_into(scatter, src) -> bool:
    """``scatter`` writes zeros into heads ``H:`` of ``src`` (a broadcast ``copy`` or a zero tensor)."""
    z = scatter.args[1]
    if is_op(z, aten.copy.default) and is_op(z.args[0], aten.slice.Tensor) and z.args[0].args[0] is src:
        z = z.args[1]
    return is_op(z, aten.full.default) and z.args[1] == 0


def head_padding(user: torch.fx.Node, prepared: torch.fx.Node) -> Padding | None:
    """How ``user`` pads ``prepared [T, H, 512]`` with zero heads, or None.

    Three forms: ``F.pad(q, (0, 0, 0, HP - H))`` is one ``constant_pad_nd``;
    ``out = q.new_zeros(T, HP, 512); out[:, :H] = q`` is ``slice_scatter(full(0),
    [copy(slice(full), ] q [)], 1, 0, H)``; writing a caller's buffer whole,
    ``buf[:, :H] = q; buf[:, H:] = 0`` (either order), is the same scatter into ``buf``
    chained with a scatter of zeros into heads ``H:``.
    """
    num_heads = shape(prepared)[1]
    if is_op(user, aten.constant_pad_nd.default):
        pad = list(user.args[1])
        value = user.args[2] if len(user.args) > 2 else 0.0
        if len(pad) == 4 and pad[:3] == [0, 0, 0] and value == 0 and isinstance(pad[3], int) and pad[3] >= 0:
            return Padding(user, num_heads + pad[3], None)
        return None
    written = user
    if is_op(user, aten.copy.default) and user.args[1] is prepared and len(user.users) == 1:
        written = next(iter(user.users))
    if not (_heads_scatter(written, 0, num_heads) and written.args[1] is (user if written is not user else prepared)):
        return None
    dest = written.args[0]
    out_shape = shape(dest)
    if (len(out_shape) != 3 or not same_size(out_shape[0], shape(prepared)[0]) or out_shape[2] != HEAD_DIM
            or val(dest).dtype != val(prepared).dtype):
        return None
    if is_op(dest, aten.full.default) and dest.args[1] == 0:
        return Padding(written, out_shape[1], None)
    end = (out_shape[1], recognizers.INT_MAX)
    if any(_heads_scatter(dest, num_heads, e) for e in end) and _zeros_into(dest, dest.args[0]):  # zeros first
        return Padding(written, out_shape[1], dest.args[0])
    zeroing = [u for u in written.users if any(_heads_scatter(u, num_heads, e) for e in end) and u.args[0] is written]
    if len(zeroing) == 1 and _zeros_into(zeroing[0], written) and all(
            u is zeroing[0] or is_op(u, aten.slice.Tensor) for u in written.users):  # zeros after
        return Padding(zeroing[0], out_shape[1], dest)
    return None


# --------------------------------------------------------------------------------------
# kv side
# --------------------------------------------------------------------------------------
def _quant_codes(codes) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(kv, e) for ``codes [n, 448] uint8`` = e4m3 bytes of ``kv[:, :448]`` scaled by ``2^-e``::

        blocks = kv.float()[:, :448].view(n, 7, 64); amax = blocks.abs().amax(-1).clamp_min(1e-4)
        e = ceil(log2(amax / 448)); codes = (blocks * exp2(-e)[..., None]).clamp(-448, 448).to(e4m3).view(u8)
    """
    node = strip(codes, *RESHAPES, aten.view.dtype, aten.slice.Tensor)  # slices: checked by the shapes below
    clamped = convert_source(node, torch.float8_e4m3fn)
    expect(clamped is not None, f"kv quant: NoPE bytes are {describe(node)}, not an e4m3 cast")
    blocks_shape = shape(node)
    expect(blocks_shape[1:] == (N_QUANT_BLOCKS, QUANT_BLOCK),
           f"kv quant: blocks of {blocks_shape[-1]} values {blocks_shape[1:]}, fp8_ds_mla uses 7 blocks of 64")
    scaled, lo, hi = clamp_bounds(clamped)
    expect((lo, hi) == (-FP8_MAX, FP8_MAX), f"kv quant: clamp to [{lo}, {hi}], expected [-448, 448]")
    blocks, e = pow2_scaled(scaled, FP8_MAX, AMAX_FLOOR, "kv quant", values="blocks")
    expect(is_op(blocks, *RESHAPES), f"kv quant: blocks {describe(blocks)} are not a view of the NoPE columns")
    return blocks.args[0], e


def _cat_last(node, widths: tuple[int, int], what: str):
    expect(is_op(node, aten.cat.default) and len(node.args[0]) == 2, f"{what}: {describe(node)} is not a cat of two parts")
    parts = node.args[0]
    expect(tuple(shape(p)[-1] for p in parts) == widths, f"{what}: parts of widths {[shape(p)[-1] for p in parts]}, expected {widths}")
    return parts


def match_kv_side(data: ByteRowWrite, writes) -> KvSide:
    """Pattern (n rows, bs = block_size; the two writes in either order)::

        x = kv.float(); codes, e = quant(x[:, :448]); pe = rope(x[:, 448:], c, s).to(bf16)
        (x maybe an fp32 kv whose .to(bf16).float() Inductor dropped: ``kv_columns``)
        data = cat(codes, pe.view(u8)); scales = cat((e + 127).clamp(0, 255).to(u8), zeros(n, 1))
        cache[:, :bs*576].view(NB, bs, 576)[slots // bs, slots % bs] = data
        cache[:, bs*576:bs*584].view(NB, bs, 8)[slots // bs, slots % bs] = scales
        # functional: index_put -> reshape -> slice_scatter, twice, then copy_(cache, ..)
      ->
        af = auto_functionalized(dsv4_qnorm_rope_kv_insert, .., k_cache=cache, slot_mapping=slots, ..)
        (every reader of the written cache reads af[k_cache])
    """
    expect((data.first, data.pitch, data.width) == (0, CACHE_ROW_BYTES, CACHE_ROW_BYTES),
           f"write: rows of {data.width} bytes {data.pitch} apart from column {data.first}; "
           "fp8_ds_mla rows are 576 bytes, 576 apart, from 0")
    scales, cache_in, cache_out = scale_partner(data, writes, SCALE_BYTES)
    data_put, scale_put, slots = data.put, scales.put, data.slots

    codes, rope_bytes = _cat_last(put_rows(data_put), (NOPE_DIM, 2 * ROPE_DIM), "kv row")
    expect(is_op(rope_bytes, aten.view.dtype), f"kv row: RoPE bytes {describe(rope_bytes)} are not values viewed as uint8")
    dtype = val(rope_bytes.args[0]).dtype
    expect(dtype == torch.bfloat16, f"kv row: RoPE values are {dtype}, the op writes bfloat16")
    pe_rot = convert_source(rope_bytes.args[0], torch.bfloat16)
    expect(pe_rot is not None, "kv row: RoPE values are not rounded from fp32")
    pe, cos, sin = rope_gptj(pe_rot)
    kv = kv_columns(pe, NOPE_DIM, HEAD_DIM, "kv RoPE")
    nope, e = _quant_codes(codes)
    expect(kv_columns(nope, 0, NOPE_DIM, "kv NoPE") is kv, "kv: NoPE and RoPE columns come from different tensors")
    scale_bytes, zeros = _cat_last(put_rows(scale_put), (N_QUANT_BLOCKS, 1), "kv scales")
    clamped = convert_source(scale_bytes, torch.uint8)
    expect(clamped is not None, f"kv scales: {describe(scale_bytes)} is not a cast to uint8")
    biased, lo, hi = clamp_bounds(clamped)
    expect((lo, hi) == (0, 255) and recognizers.add_scalar(biased) == (e, 127.0), "kv scales: not (e + 127).clamp(0, 255)")
    expect(is_op(zeros, aten.full.default) and zeros.args[1] == 0, "kv scales: the 8th byte is not zero")
    rows = shape(kv)[0]
    expect(same_size(rows, shape(slots)[0]), "kv: one slot per row expected")
    expect(val(kv).stride(-1) == 1, f"kv: strides {tuple(val(kv).stride())}, the op reads dense rows")
    table, positions = cos_sin_rows(cos, sin, rows, rank=2)
    return KvSide(data_put, kv, positions, table, slots, data.block_size, cache_in, cache_out)


def kv_columns(node, start: int, end: int, what: str) -> torch.fx.Node:
    """kv for ``node = kv.float()[:, start:end]`` (or ``kv[:, start:end].float()``), kv bf16.

    Torch 2.11's Inductor drops the round trip of an upstream ``kv = norm(..).to(bf16)`` read
    only by this ``kv.float()`` (``inductor_drops_narrowing_round_trips``): the columns are
    then of the fp32 norm output itself, returned as it is (fp32), and the call rounds it to
    bf16 as the code says (``Emitter.as_bf16``). The graph cannot tell that from code that never rounded kv.
    """
    if inductor_drops_narrowing_round_trips() and convert_source(node, torch.float32) is None:
        found = last_dim_slice(node)
        if found is not None and found[1:] == (start, end, 1) and val(found[0]).dtype == torch.float32 \
                and convert_source(found[0], torch.float32) is None:
            return found[0]
    return bf16_columns(node, start, end, what)
