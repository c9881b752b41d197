"""The cos/sin a fused call reads, found among a region's operands however the model makes them.

Models make cos/sin a dozen ways: a table gathered by positions (vLLM's ``[P, R]``), a
rotary module computing ``cos(positions * inv_freq)`` in the forward (Hugging Face,
full-width ``cat((f, f))``, cast to bf16), a complex ``polar`` table (Meta's reference,
gpt-fast's real pairs), tables passed in. What they share is their place in the region:
operands (``regions.operands``) of the rotated values, per token. So ``rope_forms`` takes
the region's per-token operands and offers the forms a call could read them in, each a
``RopeOperand``:

- *table*: the operands are columns of one gather ``table[positions]``: the call reads the
  table and the positions (no cos/sin materialised; an fp32 ``[P, R]`` table as the op's
  ``cos_sin_cache``, any other as two column views);
- *values*: the operands as the graph computes them, ``[T, w]`` per token (or per position
  of one sequence, shared by a batch's sequences: token ``i`` reads row ``i % rows``),
  read where Inductor puts them; a complex operand as its real and imaginary parts.

A ``w``-wide operand is offered as half of an ``R = 2w`` rotation, and as a full-width one
(``R = w``): by its first half where the probes show both halves equal (Hugging Face's
``cat((f, f))``), whole otherwise (``full_cos_sin``). Which form, and which of two
operands is cos, the probes decide; the order here is only the likeliest first.

A rotation runs one way or the other: ``rotate_half`` as ``cat((-x2, x1))`` turns each
pair by +angle, as ``cat((x2, -x1))`` (nanochat's) by -angle, which is the op's rotation
with sin negated. Each per-token form is offered turned the other way too, after every
form turned the usual way, so a model of the usual direction never pays for it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import CONVERTS, RESHAPES, NoMatch, aten, is_op, prims, same_size, shape, val

__all__ = ["RopeOperand", "rope_forms", "emit_rope", "emit_table", "per_token_operands"]

_LOOK_THROUGH = (*RESHAPES, *CONVERTS, aten.unsqueeze.default, aten.expand.default, aten.clone.default,
                 aten.squeeze.dim, aten.squeeze.default, aten.alias.default)


@dataclass(frozen=True)
class RopeOperand:
    kind: str  # "table" | "values"
    cos: torch.fx.Node  # table: the table; values: the cos operand (or the complex operand)
    sin: torch.fx.Node | None  # values: the sin operand (None for a complex operand)
    positions: torch.fx.Node | None  # table: the positions
    width: int  # entries per row of cos (and of sin)
    columns: tuple = ()  # table: (cos start, sin start, step) of the table's last dim
    rotary_dim: int = 0  # R
    full: bool = False  # cos/sin are R wide, read whole (``full_cos_sin``)
    half_of_full: bool = False  # R wide with equal halves, read by the first half
    pairs_of_full: bool = False  # R wide with equal adjacent pairs (``repeat_interleave``), read every other one
    rows: object = None  # values: rows of per-token values (tokens, or one sequence's positions)
    reversed: bool = False  # values: the rotation turns by -angle (the call reads -sin)

    def describe(self) -> str:
        what = (f"a {str(val(self.cos).dtype).removeprefix('torch.')} table gathered by positions"
                if self.kind == "table" else "the per-token cos/sin the model computes")
        how = (" (full width)" if self.full else " (the first half of two equal halves)" if self.half_of_full
               else " (every other one of equal pairs)" if self.pairs_of_full else "")
        turn = ", turned by -angle (sin negated)" if self.reversed else ""
        return f"{what}, rotary dim {self.rotary_dim}{how}{turn}"


def per_token_operands(operands: list[torch.fx.Node], weight_like) -> list[torch.fx.Node]:
    """The operands that vary per token: float or complex, more than one dim, not a weight."""
    found = []
    for n in operands:
        v = val(n)
        if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex) and v.dim() >= 2 \
                and v.numel() != 1 and not weight_like(n):
            found.append(n)
    return found


def _complex_parts(node: torch.fx.Node):
    """``(cos, sin)`` where ``node`` is ``torch.complex(cos, sin)`` (through views), else None."""
    while is_op(node, *_LOOK_THROUGH):
        node = node.args[0]
    return tuple(node.args[:2]) if is_op(node, aten.complex.default) else None


def _gather_of(node: torch.fx.Node):
    """(gather, [column steps from the gather to node]) where ``node`` is columns of rows
    gathered from a table by positions, else None."""
    steps = []
    while True:
        if is_op(node, aten.index.Tensor, aten.index_select.default, aten.embedding.default):
            return node, steps[::-1]
        if is_op(node, *_LOOK_THROUGH):
            node = node.args[0]
        elif is_op(node, aten.slice.Tensor, aten.select.int):
            steps.append(node)
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and is_op(
                node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
            steps.append(node)
            node = node.args[0].args[0]
        else:
            return None


def _table_and_positions(gather: torch.fx.Node):
    if is_op(gather, aten.index.Tensor):
        idx = gather.args[1]
        if len(idx) == 1 and isinstance(idx[0], torch.fx.Node):
            return gather.args[0], idx[0]
        return None
    if is_op(gather, aten.index_select.default):
        return (gather.args[0], gather.args[2]) if gather.args[1] == 0 else None
    return gather.args[0], gather.args[1]  # embedding(table, positions)


def _hint_is_sin(node: torch.fx.Node, depth: int = 40) -> bool | None:
    """True where ``node``'s computation takes a sin and no cos; False the other way; else None."""
    seen, stack, kinds = set(), [node], set()
    while stack and len(seen) < depth:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if is_op(n, aten.sin.default):
            kinds.add("sin")
        elif is_op(n, aten.cos.default):
            kinds.add("cos")
        stack.extend(n.all_input_nodes)
    return None if len(kinds) != 1 else kinds == {"sin"}


def rope_forms(per_token: list[torch.fx.Node], num_tokens, head_dim: int, halves_equal,
               pairs_equal=lambda n: False) -> list[RopeOperand]:
    """The ways a call can read the rotation's cos/sin, likeliest first. ``halves_equal(node)``
    tells (on probes) whether a full-width operand is two equal halves, ``pairs_equal(node)``
    whether its adjacent entries come in equal pairs (GPT-J's ``repeat_interleave(2)``)."""
    forms: list[RopeOperand] = []
    complexes, reals = [], []
    for n in per_token:
        pair = _complex_parts(n) if val(n).dtype.is_complex else None
        if pair is not None:  # torch.complex(cos, sin): its real operands, as they are made
            reals += [p for p in pair if p not in reals]
        elif val(n).dtype.is_complex:
            complexes.append(n)
        else:
            reals.append(n)
    pairs = []
    for i, a in enumerate(reals):
        for b in reals[i + 1:]:
            if len(shape(a)) == len(shape(b)) and all(same_size(x, y) for x, y in zip(shape(a), shape(b))):
                first_sin = _hint_is_sin(a)
                pairs.append((b, a) if first_sin else (a, b))
                if first_sin is None:
                    pairs.append((b, a))
    for cos, sin in pairs:
        forms += _table_forms(cos, sin, head_dim) + _value_forms(cos, sin, head_dim, halves_equal, pairs_equal)
    for c in complexes:
        forms += _value_forms(c, None, head_dim, halves_equal, pairs_equal)
    return forms + [replace(f, reversed=True) for f in forms if f.kind == "values"]


def _table_forms(cos, sin, head_dim) -> list[RopeOperand]:
    a, b = _gather_of(cos), _gather_of(sin)
    if a is None or b is None or a[0] is not b[0]:
        return []
    found = _table_and_positions(a[0])
    if found is None:
        return []
    table, positions = found
    tv = val(table)
    if tv.dim() != 2 or val(positions).dtype not in (torch.int64, torch.int32):
        return []
    cols = [_columns(steps, tv.shape[1]) for steps in (a[1], b[1])]
    if None in cols or cols[0][1] != cols[1][1] or cols[0][2] != cols[1][2]:
        return []
    (c0, width, step), (s0, _, _) = cols
    if 2 * width > head_dim or width == 0:
        return []
    return [RopeOperand("table", table, None, positions, width, (c0, s0, step), rotary_dim=2 * width)]


def _columns(steps, table_width):
    """(start, count, step) of the table's last-dim columns the steps take, or None."""
    start, count, step = 0, table_width, 1
    for s in steps:
        if is_op(s, aten.slice.Tensor):
            dim = s.args[1] if len(s.args) > 1 else 0
            if dim not in (-1, len(shape(s.args[0])) - 1):
                return None
            lo = s.args[2] if len(s.args) > 2 else 0
            hi = s.args[3] if len(s.args) > 3 else count
            st = s.args[4] if len(s.args) > 4 else 1
            lo = lo + count if lo < 0 else lo
            hi = min(hi + count if hi < 0 else hi, count)
            start, count, step = start + lo * step, -(-(hi - lo) // st), step * st
        elif is_op(s, aten.select.int):  # one column of pairs: x.view(.., n, 2)[..., k]
            return None
        else:  # a split's piece
            split = s.args[0]
            sizes = list(split.args[1]) if split.target is aten.split_with_sizes.default else \
                [split.args[1]] * -(-count // split.args[1])
            lo = sum(sizes[:s.args[1]])
            start, count = start + lo * step, sizes[s.args[1]]
    return start, count, step


def _value_forms(cos, sin, head_dim, halves_equal, pairs_equal) -> list[RopeOperand]:
    width = shape(cos)[-1]
    if not isinstance(width, int):
        return []
    numel = 1
    for s in shape(cos)[:-1]:
        numel = numel * s
    rows = numel
    forms = []
    if 2 * width <= head_dim:
        forms.append(RopeOperand("values", cos, sin, None, width, rotary_dim=2 * width, rows=rows))
    if width % 2 == 0 and width <= head_dim and not val(cos).dtype.is_complex:
        if halves_equal(cos) and halves_equal(sin):
            forms.insert(0, RopeOperand("values", cos, sin, None, width, rotary_dim=width, half_of_full=True, rows=rows))
        elif pairs_equal(cos) and pairs_equal(sin):
            forms.insert(0, RopeOperand("values", cos, sin, None, width, rotary_dim=width, pairs_of_full=True, rows=rows))
        else:
            forms.append(RopeOperand("values", cos, sin, None, width, rotary_dim=width, full=True, rows=rows))
    return forms


def emit_rope(emit, rope: RopeOperand, tokens, device) -> dict:
    """The call's ``positions``, ``cos_sin_cache``, ``cos``, ``sin`` (and ``full_cos_sin``) for ``rope``."""
    if rope.kind == "table":
        table = rope.cos
        c0, s0, step = rope.columns
        if val(table).dtype == torch.float32 and (c0, s0, step) == (0, rope.width, 1) \
                and val(table).shape[1] == 2 * rope.width and val(table).stride(1) == 1:
            return {"positions": rope.positions, "cos_sin_cache": table}
        views = {name: _contiguous(emit, emit.node(aten.slice.Tensor, table, 1, start, start + step * rope.width, step))
                 for name, start in (("cos", c0), ("sin", s0))}
        return {"positions": rope.positions, "cos_sin_cache": None, **views}
    if rope.sin is None:  # a complex operand: its real and imaginary parts
        pairs = emit.node(aten.view_as_real.default, rope.cos)
        parts = {name: emit.node(aten.select.int, pairs, -1, i) for i, name in enumerate(("cos", "sin"))}
    else:
        parts = {"cos": rope.cos, "sin": rope.sin}
    operands = {}
    for name, node in parts.items():
        rows = emit.node(aten.reshape.default, node, [-1, rope.width])
        if rope.half_of_full:
            rows = emit.node(aten.slice.Tensor, rows, 1, 0, rope.width // 2)
        elif rope.pairs_of_full:
            rows = emit.node(aten.slice.Tensor, rows, 1, 0, rope.width, 2)
        if val(rows).dtype not in (torch.float32, torch.bfloat16):
            rows = emit.node(prims.convert_element_type.default, rows, torch.float32)
        if name == "sin" and rope.reversed:
            rows = emit.node(aten.neg.default, rows)
        operands[name] = _contiguous(emit, rows)
    positions = None
    token_count = val(tokens) if isinstance(tokens, torch.fx.Node) else tokens
    if not same_size(rope.rows, token_count):  # one row per position, shared by the sequences of a batch
        positions = emit.node(aten.remainder.Scalar, emit.iota(tokens, device), emit.size(operands["cos"], 0))
    extra = {"full_cos_sin": True} if rope.full else {}
    return {"positions": positions, "cos_sin_cache": None, **operands, **extra}


def emit_table(emit, rope: RopeOperand, tokens, device) -> tuple:
    """``(positions, table)`` for an op that reads one fp32 ``[P, R]`` table by positions (R/2
    cos, then R/2 sin per row): the gathered table itself where it is one, else each token's
    cos and sin in front of the call, ``cat``-ed into a ``[T, R]`` table read at ``0 .. T-1``."""
    if rope.kind == "table" and val(rope.cos).dtype == torch.float32 and rope.columns == (0, rope.width, 1) \
            and val(rope.cos).shape[1] == 2 * rope.width and val(rope.cos).stride(1) == 1:
        return rope.positions, rope.cos
    parts = emit_rope(emit, rope, tokens, device)
    if parts.get("full_cos_sin"):
        raise NoMatch("rope: full-width cos/sin with unequal halves; the op reads one cos and one sin per pair")
    cos, sin = parts["cos"], parts["sin"]
    if parts["positions"] is not None:  # rows of a table or of shared values: each token's own rows
        cos = emit.node(aten.index.Tensor, cos, [parts["positions"]])
        sin = emit.node(aten.index.Tensor, sin, [parts["positions"]])
    table = emit.node(aten.cat.default, [cos, sin], 1)
    if val(table).dtype != torch.float32:
        table = emit.node(prims.convert_element_type.default, table, torch.float32)
    return emit.iota(tokens, device), table


def _contiguous(emit, node):
    """``node`` with unit stride along its rows (the op reads each row's entries densely)."""
    if val(node).stride(-1) == 1:
        return node
    return emit.node(aten.clone.default, node, memory_format=torch.contiguous_format)
