"""The DeepSeek-V4 indexer's MXFP4 format, read back out of a post-grad graph.

``match_mxfp4_q_side`` starts from the nibble-packing ``bitwise_or`` of ``[T, H, ..]`` codes,
``match_mxfp4_k_rows`` reads the 64 packed bytes and 4 scale bytes of a k row (the write
itself: ``dsv4_indexer_patterns.match_k_side``); each returns what
``prepfuse::dsv4_indexer_rope_mxfp4_insert`` needs or raises :class:`NoMatch` naming the
step that differs. ``weights_products`` lists the ``weights.float() * c`` candidates for
the op's ``weights_out``. The RoPE step is the family's (``rope_tail``); new here are the
three MXFP4 steps:

- ``block_quant``: ``e = ceil(log2(max(amax(|y|, blocks of 32), 6 * 2^-126) / 6))``
  (maybe clamped to [-127, 127]: it never binds for finite input), ``v = y * 2^-e``;
- ``e2m1_nibbles``: the nibble of ``v``, magnitude by comparisons with the grid's midpoints
  (``compare``) or rounded to the grid's step (``round``), the sign from ``signbit(v)``;
- ``packed_pairs``: ``codes[..., 0::2] | codes[..., 1::2] << 4``, of the ``[.., 4, 32]``
  codes or of them flattened to ``[.., 128]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.fusion.dsv4_indexer_patterns import rope_tail
from prepfuse.fx_passes.matching.recognizers import (
    RESHAPES, _pair_slice, aten, clamp_bounds, convert_source, describe, expect, is_op, NoMatch, pow2_scaled,
    put_rows, same_size, scalar, shape, split_operands, strip, val,
)
from prepfuse.ops.dsv4_indexer_common import (
    E2M1_MAX, HEAD_DIM, MXFP4_AMAX_FLOOR, MXFP4_BLOCK, MXFP4_BLOCKS, MXFP4_PACKED,
)

__all__ = ["Mxfp4QSide", "is_pack", "packed_outputs", "match_mxfp4_q_side", "match_mxfp4_k_rows", "weights_products"]

LSHIFTS = (aten.__lshift__.Scalar, aten.bitwise_left_shift.Tensor_Scalar)
# the e2m1 midpoints as the comparisons that count them: ties go to the even code
E2M1_COMPARISONS = frozenset({("gt", 0.25), ("ge", 0.75), ("gt", 1.25), ("ge", 1.75), ("gt", 2.5), ("ge", 3.5), ("gt", 5.0)})


@dataclass
class Mxfp4QSide:
    """``packed, scale_bytes = mxfp4(rope_tail(q))`` for q [T, H, 128]."""

    packed: torch.fx.Node  # uint8 [T, H, 64]
    scale_bytes: list[torch.fx.Node]  # uint8 [T, H, 4], every (e + 127).to(uint8) of the exponent
    q: torch.fx.Node  # bf16 [T, H, 128]
    positions: torch.fx.Node
    cos_sin_cache: torch.fx.Node

    @property
    def anchor(self) -> torch.fx.Node:
        return self.packed

    def outputs(self) -> list[tuple[str, torch.fx.Node]]:
        """(op output, the node it replaces)."""
        return [("q_out", self.packed)] + [("q_scale", node) for node in self.scale_bytes]

    def inputs(self) -> list[torch.fx.Node]:
        return [self.q, self.positions, self.cos_sin_cache]


# --------------------------------------------------------------------------------------
# The MXFP4 steps: packing, e2m1 nibbles, block scales
# --------------------------------------------------------------------------------------
def is_pack(node) -> bool:
    """``a | (b << 4)`` of uint8 tensors: where a pattern's walk starts."""
    return (is_op(node, aten.bitwise_or.Tensor) and val(node).dtype == torch.uint8
            and any(_shift_of(a, 4) is not None for a in node.args[:2]))


def _shift_of(node, bits: int):
    """x for ``x << bits``, else None."""
    return node.args[0] if is_op(node, *LSHIFTS) and node.args[1] == bits else None


def packed_pairs(pack: torch.fx.Node) -> torch.fx.Node:
    """The nibbles ``[.., 4, 32]`` for ``pack = codes[..., 0::2] | codes[..., 1::2] << 4`` with
    ``codes`` the nibbles or the nibbles flattened to ``[.., 128]`` (pairs never straddle a
    block of 32 either way)."""
    lo, hi = split_operands(pack, lambda n: _shift_of(n, 4) is None)
    expect(lo is not None and _shift_of(hi, 4) is not None, f"pack: {describe(pack)} is not lo | hi << 4")
    codes = _pair_slice(lo, 0)
    expect(codes is not None and _pair_slice(_shift_of(hi, 4), 1) is codes,
           "pack: the low nibble is not the even element and the high nibble the odd one of the same codes")
    blocks = strip(codes, *RESHAPES)
    bs, cs = shape(blocks), shape(codes)
    expect(bs[-2:] == (MXFP4_BLOCKS, MXFP4_BLOCK), f"pack: codes of shape {bs}, expected blocks [.., 4, 32]")
    expect(blocks is codes or (cs[-1] == HEAD_DIM and len(cs) == len(bs) - 1
                               and all(same_size(a, b) for a, b in zip(cs[:-1], bs[:-2]))),
           f"pack: codes reshaped to {cs}, not flattened blocks [.., 128]")
    return blocks


def e2m1_nibbles(code: torch.fx.Node) -> torch.fx.Node:
    """``v`` (fp32) for ``code = magnitude(|v|) | signbit(v) << 3``, e2m1 round to nearest even."""
    expect(is_op(code, aten.bitwise_or.Tensor), f"e2m1: {describe(code)} is not magnitude | sign << 3")
    mag, sign = split_operands(code, lambda n: _shift_of(n, 3) is None)
    expect(mag is not None and _shift_of(sign, 3) is not None, f"e2m1: {describe(code)} is not magnitude | sign << 3")
    neg = convert_source(_shift_of(sign, 3), torch.uint8)
    expect(not is_op(neg, aten.lt.Scalar), "e2m1: the sign is v < 0, which drops the sign of -0.0; the op takes signbit(v)")
    expect(is_op(neg, aten.signbit.default), f"e2m1: the sign is {describe(neg)}, not signbit(v)")
    v = neg.args[0]
    expect(val(v).dtype == torch.float32, f"e2m1: v is {val(v).dtype}, not float32")
    a = _compare_codes(mag) if is_op(mag, aten.add.Tensor) else _round_codes(mag)
    expect(is_op(a, aten.abs.default) and a.args[0] is v, f"e2m1: the magnitude is of {describe(a)}, not of |v|")
    return v


def _compare_codes(total: torch.fx.Node) -> torch.fx.Node:
    """``a`` for ``(a > .25) + (a >= .75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5)``,
    each a bool cast to uint8, summed in any order."""
    terms, stack = [], [total]
    while stack:
        node = stack.pop()
        if is_op(node, aten.add.Tensor):
            stack += [x for x in node.args[:2] if scalar(x) != 0.0]
        else:
            terms.append(node)
    found, sources = set(), set()
    for term in terms:
        cmp = convert_source(term, torch.uint8)
        expect(is_op(cmp, aten.gt.Scalar, aten.ge.Scalar), f"e2m1: term {describe(term)} is not (|v| > m).to(uint8)")
        found.add(("gt" if cmp.target is aten.gt.Scalar else "ge", scalar(cmp.args[1])))
        sources.add(cmp.args[0])
    expect(len(sources) == 1 and len(terms) == len(E2M1_COMPARISONS), f"e2m1: {len(terms)} comparisons of {len(sources)} tensors")
    if found != E2M1_COMPARISONS:
        want = ", ".join(f"{'>' if op == 'gt' else '>='} {m}" for op, m in sorted(E2M1_COMPARISONS, key=lambda t: t[1]))
        got = ", ".join(f"{'>' if op == 'gt' else '>='} {m}" for op, m in sorted(found, key=lambda t: t[1] or 0))
        raise NoMatch(f"e2m1: codes count midpoints {got}; round to nearest even counts {want}")
    return sources.pop()


def _round_codes(code: torch.fx.Node) -> torch.fx.Node:
    """``a`` for ``where(c < 2, round(2c), where(c < 4, round(c) + 2, round(c / 2) + 4))`` cast to
    uint8, ``c = a`` or ``a.clamp(max=6)`` (the block scale keeps ``a <= 6``; the clamp saturates)."""
    outer = convert_source(code, torch.uint8)
    expect(is_op(outer, aten.where.self), f"e2m1: {describe(code)} is neither midpoint comparisons nor a where of grid roundings")
    c = _lt_source(outer.args[0], 2.0)
    expect(_rounded(outer.args[1], c, 2.0) == 0.0, "e2m1: below 2 the code is not round(2 |v|)")
    inner = outer.args[2]
    expect(is_op(inner, aten.where.self) and _lt_source(inner.args[0], 4.0) is c,
           f"e2m1: {describe(inner)} is not where(|v| < 4, ..)")
    expect(_rounded(inner.args[1], c, 1.0) == 2.0, "e2m1: from 2 to 4 the code is not round(|v|) + 2")
    expect(_rounded(inner.args[2], c, 0.5) == 4.0, "e2m1: from 4 the code is not round(|v| / 2) + 4")
    a, lo, hi = clamp_bounds(c)
    expect(lo is None and hi in (None, E2M1_MAX), f"e2m1: |v| clamped to [{lo}, {hi}], expected at most 6")
    return a


def _lt_source(node, bound: float):
    expect(is_op(node, aten.lt.Scalar) and scalar(node.args[1]) == bound, f"e2m1: {describe(node)} is not |v| < {bound:g}")
    return node.args[0]


def _rounded(node, c, factor: float) -> float:
    """k for ``round(c * factor) + k`` (k = 0 without the add); ``c / 2`` is ``c * 0.5``."""
    k = 0.0
    if is_op(node, aten.add.Tensor) and scalar(node.args[1]) is not None:
        node, k = node.args[0], scalar(node.args[1])
    expect(is_op(node, aten.round.default), f"e2m1: {describe(node)} is not a round")
    x = node.args[0]
    if factor == 1.0:
        expect(x is c, f"e2m1: round of {describe(x)}, not of |v|")
    elif is_op(x, aten.div.Tensor):
        expect(x.args[0] is c and scalar(x.args[1]) == 1 / factor, f"e2m1: {describe(x)} is not |v| * {factor:g}")
    else:
        expect(is_op(x, aten.mul.Tensor), f"e2m1: {describe(x)} is not |v| * {factor:g}")
        c2, f = split_operands(x, lambda n: n is c)
        expect(c2 is c and scalar(f) == factor, f"e2m1: {describe(x)} is not |v| * {factor:g}")
    return k


def block_quant(v: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(y, e) for ``v = blocks * exp2(-e)[..., None]``, ``blocks = y.unflatten(-1, (4, 32))``,
    ``e = ceil(log2(max(amax(|blocks|, -1), 6 * 2^-126) / 6))`` (maybe clamped to [-127, 127])."""
    blocks, e = pow2_scaled(v, E2M1_MAX, MXFP4_AMAX_FLOOR, "quant", values="blocks",
                            floor_text=f"6 * 2^-126 ({MXFP4_AMAX_FLOOR})", exponent_clamp=(-127.0, 127.0))
    expect(shape(blocks)[-2:] == (MXFP4_BLOCKS, MXFP4_BLOCK) and is_op(blocks, *RESHAPES),
           f"quant: blocks of shape {shape(blocks)}, expected y.unflatten(-1, (4, 32))")
    y = blocks.args[0]
    expect(shape(y)[-1] == HEAD_DIM and len(shape(y)) == len(shape(blocks)) - 1,
           f"quant: blocks of {describe(y)} {shape(y)}, the indexer quantises rows of 128")
    return y, e


def _scale_bytes(e: torch.fx.Node) -> list[torch.fx.Node]:
    """Every ``(e + 127).to(uint8)`` reading the exponent (the UE8M0 bytes)."""
    found = []
    for add in (u for u in e.users if is_op(u, aten.add.Tensor) and scalar(u.args[1]) == 127.0):
        found += [u for u in add.users if convert_source(u, torch.uint8) is add]
    return found


def mxfp4_quant(packed: torch.fx.Node, rank: int) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """(src, positions, cos_sin_cache, e) for ``packed = mxfp4(rope_tail(src))``, ``src`` of ``rank`` dims."""
    pack = strip(packed, *RESHAPES)
    expect(is_pack(pack), f"pack: {describe(packed)} is not lo | hi << 4")
    expect(len(shape(packed)) == rank and shape(packed)[-1] == MXFP4_PACKED,
           f"pack: packed bytes of shape {shape(packed)}, expected {rank} dims, 64 bytes a row")
    y, e = block_quant(e2m1_nibbles(packed_pairs(pack)))
    src, positions, table = rope_tail(y, rank=rank)
    expect(all(same_size(a, b) for a, b in zip(shape(src)[:-1], shape(packed)[:-1])),
           f"pack: packed bytes {shape(packed)} are not one row per row of {shape(src)}")
    return src, positions, table, e


# --------------------------------------------------------------------------------------
# q side and its weights
# --------------------------------------------------------------------------------------
def packed_outputs(pack: torch.fx.Node) -> list[torch.fx.Node]:
    """The packed bytes ``[.., 64]``: the pack itself (flat codes) or its reshapes (blocks)."""
    if shape(pack)[-1] == MXFP4_PACKED:
        return [pack]
    return [u for u in pack.users if is_op(u, *RESHAPES) and shape(u)[-1] == MXFP4_PACKED]


def match_mxfp4_q_side(packed: torch.fx.Node) -> Mxfp4QSide:
    """Pattern (T tokens, H heads)::

        y = bf16(cat(x[..., :64], rope(x[..., 64:], cos, sin))).float(),  x = q.float()
        blocks = y.unflatten(-1, (4, 32)); e = ceil(log2(blocks.abs().amax(-1).clamp_min(6 * 2^-126) / 6))
        codes = e2m1(blocks * exp2(-e)[..., None])          (compare or round spelling)
        packed = (codes[..., 0::2] | codes[..., 1::2] << 4).reshape(T, H, 64)
        scale_bytes = (e + 127).to(uint8)
      ->
        af = auto_functionalized(dsv4_indexer_rope_mxfp4_insert, q, .., q_out=scratch, q_scale=scratch, ..)
        packed, scale_bytes = af[q_out], af[q_scale]
    """
    q, positions, table, e = mxfp4_quant(packed, rank=3)
    return Mxfp4QSide(packed, _scale_bytes(e), q, positions, table)


def weights_products(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node, float]]:
    """(product, weights, c) for every ``weights.float() * c`` (or fp32 ``weights * c``), ``c``
    constant, giving fp32 ``[T, H]``: what the op's ``weights_out`` computes. No data links it
    to q (the MXFP4 q scales travel apart), so the pass pairs one by shape."""
    found = []
    for node in graph.nodes:
        if not is_op(node, aten.mul.Tensor) or val(node).dtype != torch.float32 or val(node).dim() != 2:
            continue
        w32, c = split_operands(node, lambda n: isinstance(n, torch.fx.Node))
        if w32 is None or scalar(c) is None:
            continue
        weights = convert_source(w32, torch.float32)
        weights = w32 if weights is None else weights
        wv = val(weights)
        if wv.dtype in (torch.bfloat16, torch.float32) and wv.dim() == 2 and wv.stride(-1) == 1:
            found.append((node, weights, scalar(c)))
    return found


# --------------------------------------------------------------------------------------
# k side
# --------------------------------------------------------------------------------------
def match_mxfp4_k_rows(data_put: torch.fx.Node, scale_put: torch.fx.Node):
    """(k, k_positions, table) for the MXFP4 rows: 64 packed bytes and 4 UE8M0 bytes::

        packed, e = mxfp4(rope_tail(k[:n]))                         (as on the q side)
        data = packed; scales = (e + 127).to(uint8)
    """
    k, k_positions, table, e = mxfp4_quant(put_rows(data_put), rank=2)
    scale_bytes = put_rows(scale_put)
    expect(scale_bytes in _scale_bytes(e),
           f"k scales: {describe(scale_bytes)} is not (e + 127).to(uint8) of the packed rows' exponent")
    return k, k_positions, table
