"""The DeepSeek-V4 indexer preparation patterns, read back out of a post-grad graph: the
steps both formats share, and the FP8 format's quantisation.

Shared: ``rope_tail`` (GPT-J RoPE on the last 64 of 128 dims with a bf16 round trip) and
``match_k_side`` (a paged write of the format's data rows and its 4 scale bytes, the rows read
back by the format's ``k_rows``). FP8: ``match_fp8_q_side`` starts from an e4m3 cast of
``[T, H, 128]`` rows, ``match_fp8_k_rows`` reads 128 code bytes and the fp32 scale. The MXFP4
steps are in ``dsv4_indexer_mxfp4_patterns.py``. Each returns what the fused op needs or
raises :class:`NoMatch` naming the step that differs; ``dsv4_indexer.py`` decides what to
rewrite.

Torch 2.11's Inductor removes the bf16 round trip ``bf16(cat(..)).float()`` before the
quantisation (``_compat.inductor_drops_narrowing_round_trips``); where it does, ``rope_tail``
reads the fp32 ``cat`` as the rounded rows the code wrote, and the fused op rounds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse._compat import inductor_drops_narrowing_round_trips
from prepfuse.fx_passes.matching.cache_writes import ByteRowWrite, scale_partner
from prepfuse.fx_passes.matching.recognizers import (
    RESHAPES, aten, clamp_bounds, columns, convert_source, cos_sin_rows, describe, expect, is_op, NoMatch,
    pow2_scaled, put_rows, rope_gptj, same_shape, same_size, scalar, shape, strip, val,
)
from prepfuse.fx_passes.matching.validation import read_as_rounded
from prepfuse.ops.dsv4_indexer_common import FP8_AMAX_FLOOR, FP8_MAX, HEAD_DIM, NOPE_DIM, ROPE_DIM

__all__ = ["NoMatch", "Fp8QSide", "KSide", "rope_tail", "is_fp8_q_anchor", "match_fp8_q_side", "match_fp8_k_rows",
           "match_k_side"]
SCALE_ROW_BYTES = 4  # FP8: one fp32 scale; MXFP4: four UE8M0 bytes


@dataclass
class Fp8QSide:
    """``q_fp8, w_out = quant(rope_tail(q)), weights * 2^e * weights_scale``."""

    codes: torch.fx.Node  # float8_e4m3fn [T, H, 128]
    weights_out: torch.fx.Node  # fp32 [T, H]
    q: torch.fx.Node  # bf16 [T, H, 128]
    weights: torch.fx.Node  # bf16 or fp32 [T, H]
    weights_scale: float
    positions: torch.fx.Node
    cos_sin_cache: torch.fx.Node

    @property
    def anchor(self) -> torch.fx.Node:
        return self.codes

    def outputs(self) -> list[tuple[str, torch.fx.Node]]:
        """(op output, the node it replaces)."""
        return [("q_out", self.codes), ("weights_out", self.weights_out)]

    def inputs(self) -> list[torch.fx.Node]:
        return [self.q, self.weights, self.positions, self.cos_sin_cache]


@dataclass
class KSide:
    """The rows of ``k`` quantised and written at ``slots`` into ``cache_in``, giving ``cache_out``."""

    anchor: torch.fx.Node  # the index_put of the data bytes (FP8 codes, MXFP4 packed nibbles)
    k: torch.fx.Node  # bf16 [n, 128]
    k_positions: torch.fx.Node  # int64 [n]
    cos_sin_cache: torch.fx.Node
    slots: torch.fx.Node  # int64 [n]
    block_size: int
    cache_in: torch.fx.Node
    cache_out: torch.fx.Node


# --------------------------------------------------------------------------------------
# The shared steps: RoPE on the last 64 dims with a bf16 round trip, then row quantisation
# --------------------------------------------------------------------------------------
def row_quant(codes: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(y, e) for ``codes = e4m3(clamp(y * 2^-e, -448, 448))`` with
    ``e = ceil(log2(max(amax(|y|, -1), 1e-4) / 448))``, one exponent per row of 128."""
    clamped = convert_source(codes, torch.float8_e4m3fn)
    expect(clamped is not None, f"quant: {describe(codes)} is not an e4m3 cast")
    scaled, lo, hi = clamp_bounds(clamped)
    expect((lo, hi) == (-FP8_MAX, FP8_MAX), f"quant: clamp to [{lo}, {hi}], expected [-448, 448]")
    y, e = pow2_scaled(scaled, FP8_MAX, FP8_AMAX_FLOOR, "quant")
    expect(shape(y)[-1] == HEAD_DIM, f"quant: rows of {shape(y)[-1]} values, the indexer quantises 128")
    return y, e


def rope_tail(y: torch.fx.Node, rank: int) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """(src, positions, cos_sin_cache) for ``y = bf16(cat(x[..., :64], rope(x[..., 64:]))).float()``,
    ``x = src.float()``, ``src`` bf16 with dense rows, cos/sin gathered by positions.

    Where Inductor drops narrowing round trips (torch 2.11), ``y`` is the fp32 ``cat`` itself:
    read as rounded, since the graph no longer tells it from code that skipped the rounding.
    """
    rounded = convert_source(y, torch.float32)
    if rounded is None and inductor_drops_narrowing_round_trips() and is_op(y, aten.cat.default):
        cat = y  # Inductor removed the round trip (``.to(bf16)`` had no other reader)
        read_as_rounded(cat)
    else:
        expect(rounded is not None and val(rounded).dtype == torch.bfloat16,
               f"rope: {describe(y)} is not a bf16 round trip of the rotated rows")
        cat = convert_source(rounded, torch.bfloat16)
    expect(is_op(cat, aten.cat.default) and len(cat.args[0]) == 2,
           f"rope: {describe(cat)} is not a cat of NoPE and RoPE dims")
    parts = cat.args[0]
    widths = tuple(shape(p)[-1] for p in parts)
    expect(widths == (NOPE_DIM, ROPE_DIM), f"rope: parts of widths {widths}, expected (64, 64)")
    nope, pe_rot = parts
    expect(not _is_rotation(nope), "rope: the first 64 dims are rotated (DeepSeek-V3.2's indexer); V4 rotates the last 64")
    pe, cos, sin = rope_gptj(pe_rot)
    x = columns(pe, NOPE_DIM, HEAD_DIM, "rope: rotated dims")
    expect(columns(nope, 0, NOPE_DIM, "rope: pass-through dims") is x, "rope: NoPE and RoPE dims of different tensors")
    src = convert_source(x, torch.float32)
    if src is None and inductor_drops_narrowing_round_trips() and val(x).dtype == torch.float32:
        # the source's own rounding, fp32 -> bf16 (an upstream norm's .to(bf16), read only by
        # this .float()), was dropped too: the source is that fp32 value, and the call rounds
        # it to bf16 first (the passes emit the cast, ``Emitter.as_bf16``)
        src = x
    expect(src is not None, f"rope: {describe(x)} is not a cast to fp32")
    sv = val(src)
    expect(sv.dtype == torch.bfloat16 or src is x, f"rope: input is {sv.dtype}, the op reads bfloat16")
    expect(sv.dim() == rank and sv.stride(-1) == 1, f"rope: input has shape {tuple(sv.shape)} strides {tuple(sv.stride())}")
    table, positions = cos_sin_rows(cos, sin, sv.shape[0], rank=rank)
    return src, positions, table


def _is_rotation(node) -> bool:
    try:
        rope_gptj(node)
    except NoMatch:
        return False
    return True


# --------------------------------------------------------------------------------------
# q side
# --------------------------------------------------------------------------------------
def is_fp8_q_anchor(node: torch.fx.Node) -> bool:
    """An e4m3 cast of ``[T, H, 128]`` rows: where an FP8 q-side walk starts."""
    return convert_source(node, torch.float8_e4m3fn) is not None and len(shape(node)) == 3 \
        and shape(node)[-1] == HEAD_DIM


def match_fp8_q_side(codes: torch.fx.Node) -> Fp8QSide:
    """Pattern (T tokens, H heads)::

        y = bf16(cat(x[..., :64], rope(x[..., 64:], cos, sin))).float(),  x = q.float()
        e = ceil(log2(y.abs().amax(-1).clamp_min(1e-4) / 448))
        q_fp8 = (y * exp2(-e)[..., None]).clamp(-448, 448).to(e4m3)
        w_out = weights.float() * exp2(e) * weights_scale     (either order of the factors)
      ->
        af = auto_functionalized(dsv4_indexer_rope_fp8_insert, q, weights, .., q_out=empty, weights_out=empty, ..)
        q_fp8, w_out = af[q_out], af[weights_out]
    """
    y, e = row_quant(codes)
    q, positions, table = rope_tail(y, rank=3)
    w_out, weights, weights_scale = weights_fold(e)
    expect(same_shape(weights, e), f"weights: shape {shape(weights)}, expected one per token and head {shape(e)}")
    return Fp8QSide(codes, w_out, q, weights, weights_scale, positions, table)


def weights_fold(e: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float]:
    """(w_out, weights, weights_scale) for the one reader chain ``w * exp2(e) * c`` (or
    ``w * c * exp2(e)``) of the exponent, ``w`` the weights cast to fp32 (or fp32 already).
    Both orders give the op's bits: multiplying by a power of two is exact."""
    found = []
    for power in (u for u in e.users if is_op(u, aten.exp2.default)):
        for m in (u for u in power.users if is_op(u, aten.mul.Tensor)):
            other = m.args[1] if m.args[0] is power else m.args[0]
            w, c = _weights_times_scalar(other)
            if w is not None:  # (w * c) * exp2(e)
                found.append((m, w, c))
            elif isinstance(other, torch.fx.Node):  # (w * exp2(e)) * c
                outer = [(u, _scalar_operand(u, m)) for u in m.users if is_op(u, aten.mul.Tensor)]
                found += [(u, other, c) for u, c in outer if c is not None]
    expect(len(found) == 1, f"weights: {len(found)} products weights * 2^e * scale read the q exponent, expected one")
    w_out, w32, c = found[0]
    expect(val(w32).dtype == torch.float32, f"weights: {describe(w32)} is {val(w32).dtype}, not fp32")
    weights = convert_source(w32, torch.float32)
    weights = w32 if weights is None else weights
    expect(val(weights).dtype in (torch.bfloat16, torch.float32), f"weights: {describe(weights)} is {val(weights).dtype}")
    expect(val(weights).stride(-1) == 1, f"weights: strides {tuple(val(weights).stride())}, the op reads dense rows")
    return w_out, weights, c


def _scalar_operand(mul: torch.fx.Node, other: torch.fx.Node) -> float | None:
    a, b = mul.args[0], mul.args[1]
    if a is other:
        return scalar(b)
    return scalar(a) if b is other else None


def _weights_times_scalar(node) -> tuple[torch.fx.Node | None, float | None]:
    """(w, c) for ``node = w * c`` with a constant ``c`` and a tensor ``w``, else (None, None)."""
    if not is_op(node, aten.mul.Tensor):
        return None, None
    a, b = node.args[0], node.args[1]
    if scalar(b) is not None and isinstance(a, torch.fx.Node):
        return a, scalar(b)
    if scalar(a) is not None and isinstance(b, torch.fx.Node):
        return b, scalar(a)
    return None, None


# --------------------------------------------------------------------------------------
# k side
# --------------------------------------------------------------------------------------
def match_k_side(data: ByteRowWrite, writes, row_bytes: int, k_rows) -> KSide:
    """Pattern (n rows, bs = block_size, W = the format's row bytes; the two writes in either order)::

        data, scales = quant(rope_tail(k[:n]))                     (the format's, as on the q side)
        cache[:, :bs*W].view(NB, bs, W)[slots // bs, slots % bs] = data
        cache[:, bs*W:bs*(W+4)].view(NB, bs, 4)[slots // bs, slots % bs] = scales
        (or the byte-column form of both writes)
      ->
        af = auto_functionalized(dsv4_indexer_rope_<format>_insert, .., k=k[:n], k_cache=cache, slot_mapping=slots, ..)
        (every reader of the written cache reads af[k_cache])

    ``k_rows(data put, scale put)`` reads the format's rows back to ``(k, k_positions, table)``.
    """
    expect((data.first, data.pitch, data.width) == (0, row_bytes, row_bytes),
           f"write: rows of {data.width} bytes {data.pitch} apart from column {data.first}; "
           f"indexer rows are {row_bytes} bytes, {row_bytes} apart, from 0")
    scales, cache_in, cache_out = scale_partner(data, writes, SCALE_ROW_BYTES)
    k, k_positions, table = k_rows(data.put, scales.put)
    expect(same_size(shape(k)[0], shape(data.slots)[0]), "k: one slot per row expected")
    return KSide(data.put, k, k_positions, table, data.slots, data.block_size, cache_in, cache_out)


def match_fp8_k_rows(data_put: torch.fx.Node, scale_put: torch.fx.Node):
    """(k, k_positions, table) for the FP8 rows: 128 code bytes and the fp32 scale's 4 bytes::

        codes, e = quant(rope_tail(k[:n]))                          (as on the q side)
        data = codes.view(u8); scales = exp2(e)[:, None].view(u8)   (or exp2(e).view(u8).view(n, 4))
    """
    codes = put_rows(data_put)  # [n, 128] (one row: index_put's decomposition squeezed it)
    expect(is_op(codes, aten.view.dtype) and codes.args[1] == torch.uint8, f"k row: {describe(codes)} is not codes.view(uint8)")
    y, e = row_quant(codes.args[0])
    k, k_positions, table = rope_tail(y, rank=2)
    # exp2(e)[:, None].view(u8), or exp2(e).view(u8).view(n, 4); one row may come squeezed
    scale_bytes = strip(put_rows(scale_put), *RESHAPES)
    expect(is_op(scale_bytes, aten.view.dtype) and scale_bytes.args[1] == torch.uint8,
           f"k scales: {describe(scale_bytes)} is not a view as uint8")
    power = strip(scale_bytes.args[0], aten.unsqueeze.default, *RESHAPES)
    expect(is_op(power, aten.exp2.default) and power.args[0] is e and val(power).dtype == torch.float32,
           f"k scales: {describe(power)} is not exp2(e) in fp32 of the codes' exponent")
    return k, k_positions, table
