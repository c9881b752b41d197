"""Where a rotation's cos/sin come from, and the table the fused op reads instead.

The GQA ops read a ``[P, R]`` fp32 table (per position ``R/2`` cos, then ``R/2`` sin) and
a position per token, or ``cos`` and ``sin`` as two tensors (fp32 or bf16, any row stride)
with positions or with ``positions=None`` (token t reads row t). Models make cos/sin in many
ways (a table gathered by positions, vLLM's layout; Hugging Face's rotary module computing
``cos(cat(freqs, freqs))`` from ``inv_freq`` in the forward, scaled, cast to bf16; tables
passed in). What varies is left to Inductor: the pass takes the values the graph computes,
per token, as the operand (``CosSin.per_token``): the emitted call reads them as its ``cos``
and ``sin`` ``[T, R/2]``, where Inductor put them, with ``positions=None``, so the op
rotates by exactly the values the model multiplies with (bf16-rounded ones where the model
rounds them) and nothing is built in front of the call (``emitter.cos_sin_args``).

Full-width cos/sin (Hugging Face's ``[.., R]``, the same ``R/2`` values twice) are taken by
their first half where the graph proves the halves equal: the values are, up to
elementwise steps (casts, a scalar factor such as ``attention_scaling``, ``cos``, ``sin``),
``cat((f, f), -1)`` or its decomposed form (``duplicated_halves``); the op then reads the
half table (``4R`` bytes per token). Where the graph cannot prove it (cos/sin passed in from
outside the compiled code), the op reads all ``R`` entries of each (``full_cos_sin``,
``[T, R]`` each): the formula as written, whatever the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from prepfuse.fx_passes.matching.layouts import VIEW_OPS, Layout
from prepfuse.fx_passes.matching.recognizers import (
    CONVERTS, NoMatch, aten, cos_sin_rows, describe, expect, is_op, repeated_halves, same_size, scalar, shape, val,
)
from prepfuse.ops.gqa_qknorm_rope_kv_insert import COS_SIN_DTYPES

__all__ = ["CosSin", "cos_sin_operand", "duplicated_halves"]

# steps that act on each value alone: a duplication below them is one above them too
_ELEMENTWISE = (aten.cos.default, aten.sin.default, aten.neg.default, *CONVERTS)
_SCALAR_STEPS = (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar)


@dataclass(frozen=True)
class CosSin:
    """The op's cos/sin operand: a gathered table (``table``, ``positions``), or the values
    the graph computes per token (``cos``, ``sin``: ``[T, R/2]`` after ``reshape`` and, when
    ``full``, ``[T, R]``: the first half where ``equal_halves``, all of it otherwise)."""

    table: torch.fx.Node | None = None
    positions: torch.fx.Node | None = None
    cos: torch.fx.Node | None = None
    sin: torch.fx.Node | None = None
    full: bool = False  # per-token cos/sin are R wide
    equal_halves: bool = True  # (full) the graph proves each the same R/2 values twice
    # per-token values shared by the sequences of a batch (gpt-fast's ``freqs_cis.view(1, S, ..)``
    # against ``[B, S, H, D]`` heads): size 1 on the outer token dims, so token i reads row
    # ``i % rows`` of the values (``rows`` their count, ``cos_sin_args`` makes the positions)
    shared_by_sequences: bool = False

    @property
    def full_operand(self) -> bool:
        """Whether the op must read all R entries (``full_cos_sin=True``)."""
        return self.full and not self.equal_halves

    @property
    def per_token(self) -> bool:
        return self.table is None

    def key(self) -> tuple:
        """What two rotations must share to be one call's (q and k): the same nodes
        (``repeated_steps`` merged copies of one computation first)."""
        return (self.table, self.positions) if self.table is not None else (self.cos, self.sin)


def duplicated_halves(node: torch.fx.Node) -> bool:
    """Whether the graph proves ``node[..., :n] == node[..., n:]`` (``node`` ``2n`` wide): up
    to views that keep the last dim, elementwise steps and scalar factors, it is
    ``cat((f, f), -1)`` (or that cat's decomposition, ``repeated_halves``)."""
    width = shape(node)[-1]
    while isinstance(node, torch.fx.Node) and shape(node)[-1] == width:
        try:
            repeated_halves(node)
            return True
        except NoMatch:
            pass
        if is_op(node, *VIEW_OPS) and shape(node.args[0])[-1] == width and \
                not is_op(node, aten.permute.default, aten.transpose.int, aten.t.default):
            node = node.args[0]  # a view that keeps the last dim whole (unsqueeze, a batch reshape)
        elif is_op(node, *_ELEMENTWISE):
            node = node.args[0]
        elif is_op(node, *_SCALAR_STEPS) and scalar(node.args[1]) is not None and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        elif is_op(node, aten.mul.Tensor) and scalar(node.args[0]) is not None and isinstance(node.args[1], torch.fx.Node):
            node = node.args[1]
        else:
            return False
    return False


def _per_token(c: torch.fx.Node, x_layout: Layout, x_shape: tuple, width: int, name: str) -> bool:
    """Checks that ``c`` broadcasts against the rotated ``x`` per token: size 1 on x's heads
    (and size-1) dims, x's sizes on its token dims, ``width`` last; and that the token dims
    come in x in order (outer first), so ``c.reshape(T, width)`` lists tokens as the op does.
    Returns whether ``c`` has size 1 on x's outer token dims (one row per position, shared by
    the sequences of a batch: token i reads row ``i % rows``; one row for all, at one token
    per sequence)."""
    cs = shape(c)
    expect(len(cs) <= len(x_shape), f"rope: {name} {describe(c)} has more dims than the rotated heads")
    cs = (1,) * (len(x_shape) - len(cs)) + tuple(cs)
    expect(cs[-1] == width, f"rope: {name} is {cs[-1]} wide, expected {width}")
    token_strides, shared = [], []  # per token dim of x: c has size 1 on it where x has more
    for i, (group, size) in enumerate(zip(x_layout.dims[:-1], cs[:-1])):
        is_token = bool(group) and group[0].dim == 0
        if is_token:
            shared.append(isinstance(size, int) and size == 1 and not same_size(x_shape[i], 1))
            expect(shared[-1] or same_size(size, x_shape[i]),
                   f"rope: {name} {describe(c)} is not one row per token (size {size} on a token dim of {x_shape[i]})")
            token_strides.append(group[0].stride)
        else:
            expect(isinstance(size, int) and size == 1,
                   f"rope: {name} {describe(c)} differs across heads (size {size} on dim {i}); the op takes one per token")
    expect(all(a > b if isinstance(a, int) and isinstance(b, int) else statically_known_true(a > b)
               for a, b in zip(token_strides, token_strides[1:])),
           f"rope: {name}: the rotated heads hold tokens out of order")
    outer = shared.index(False) if False in shared else len(shared)
    expect(not any(shared[outer:]), f"rope: {name} {describe(c)} is shared across an inner token dim (size 1 "
                                    "where the heads have more); the op reads one row per token, or per position "
                                    "shared by the sequences of a batch")
    return outer > 0


def cos_sin_operand(cos: torch.fx.Node, sin: torch.fx.Node, x_layout: Layout, x_shape: tuple, num_tokens,
                    rotary_dim: int, *, full: bool, table_rank: int | None) -> CosSin:
    """The operand for a rotation of ``x`` (layout ``x_layout`` over its ``[T, W]`` source)
    by ``cos``, ``sin`` (each ``R/2`` wide, or ``R`` wide when ``full``).

    A gather ``table[positions]`` of a ``[P, R]`` fp32 table is taken as it is where the heads
    are ``[T, H, D]`` (``table_rank``: the rank ``cos_sin_rows`` reads); otherwise the values
    themselves, per token, when they broadcast so (``full``: noting whether their halves are
    proven equal, which lets the op read half of each).
    """
    if table_rank is not None and not full:
        try:
            table, positions = cos_sin_rows(cos, sin, num_tokens, rank=table_rank, dtypes=COS_SIN_DTYPES)
            return CosSin(table=table, positions=positions)
        except NoMatch as err:
            gathered_reason = str(err)
    else:
        gathered_reason = None
    width = rotary_dim if full else rotary_dim // 2
    try:
        shared = []
        for c, name in ((cos, "cos"), (sin, "sin")):
            shared.append(_per_token(c, x_layout, x_shape, width, name))
            expect(val(c).dtype in (torch.float32, torch.bfloat16, torch.float16),
                   f"rope: {name} is {val(c).dtype}")
        expect(shared[0] == shared[1], "rope: cos is per token and sin per position of the sequences, or the other way")
    except NoMatch as err:
        if gathered_reason is not None:
            raise NoMatch(f"{gathered_reason}; nor per-token values: {err}") from None
        raise
    return CosSin(cos=cos, sin=sin, full=full, equal_halves=not full or (duplicated_halves(cos) and duplicated_halves(sin)),
                  shared_by_sequences=shared[0])
