"""The paged cache a rows write writes, as the ops address it, and each token's slot.

The ops write ``[N0, N1, H, D]`` with slot ``s`` at ``(s // N1, s % N1)`` (``N1 = 1``: a
token pool), any strides. A write of any layout (``writes.RowsWrite``) is that: its per-row
indices address one or two *token* dims of the written tensor (a block and a row; a pool's
slot; a static cache's sequence and position, the sequence addressed by the row's place in
the batch), its heads dim (none: one head) and its head dim are the rest. The call writes
the cache through that strided view; the slot per token is the indices composed,
``i0 * N1 + i1``, computed in front of the call only where it is not one tensor already
(``s // bs, s % bs`` of one ``s`` is ``s``). The ops count a negative slot from the cache's
end (``wrap_indices``), as eager indexing does, so an outer index needs no wrapping; an
inner one does unless it is known to be in range (``x % N1``, a slice's positions).
Used by every family whose cache holds rows of values (GQA's heads, DeepSeek-V4's full rows).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import NoMatch, aten, concrete, expect, is_op, same_size, shape, val, where
from prepfuse.fx_passes.matching.writes import RowsWrite
from prepfuse.fx_passes.rewrite.emitter import Emitter

__all__ = ["CacheView", "cache_view", "emit_slots", "probe_roles"]


@dataclass(frozen=True)
class CacheView:
    """The ``[N0, N1, Hkv, D]`` view of ``root``'s storage the op writes for one write."""

    write: RowsWrite
    sizes: tuple
    strides: tuple
    offset: int
    token_dims: tuple[int, ...]  # the written tensor's dims that address tokens, outer first
    direct: bool  # the written tensor is the graph input itself, already in that form

    def fake(self):
        return val(self.write.root).as_strided(self.sizes, self.strides, self.offset)

    @property
    def slots(self) -> int:
        """How many slots the cache holds, at the traced sizes (for the probes)."""
        return concrete(self.sizes[0]) * concrete(self.sizes[1])

    def size(self, emit: Emitter, i: int):
        """``sizes[i]`` as a call argument: a number, or (a direct cache of dynamic size) the
        root's ``sym_size``, read when the graph runs."""
        return self.sizes[i] if isinstance(self.sizes[i], int) else emit.size(self.write.root, i)


def cache_view(write: RowsWrite, value_roles: list[str], num_heads: int, head_dim: int) -> CacheView:
    """The op's view of a write's cache, from the roles of the written values' dims
    (``sources.dim_roles``: tokens, heads, head, one)."""
    target = val(write.target)
    expect(target.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8),
           f"write: the cache is {target.dtype}; the op writes bfloat16, float8_e4m3fn or uint8 (e4m3fn codes) caches")
    heads = head = None
    tokens = list(write.dims)
    for (kind, d), role in zip(write.value_dims, value_roles):
        if kind == "broadcast":
            raise NoMatch(f"write: the same rows are written at every position of the cache's dim {d} "
                          f"(size {target.shape[d]}): not one set of rows per sequence")
        if kind != "dim":
            expect(role in ("tokens", "one"), f"write: an index selects the cache's {role} dim")
            continue
        if role == "heads":
            heads = d
        elif role == "head":
            expect(head is None, "write: the cache holds a head in more than one dim")
            head = d
        elif role == "tokens":
            tokens.append(d)
    expect(head is not None, f"write: the cache's head dim is not {head_dim} dense values")
    expect(heads is not None or num_heads == 1, "write: the cache has no heads dim")
    tokens = sorted(set(tokens))
    expect(len(tokens) in (1, 2), f"write: rows address {len(tokens)} dims of the cache; the op's slots address "
                                  "a block and a row, or one slot")
    root = val(write.root)
    if write.target is write.root and tokens == [0, 1] and (heads, head) == (2, 3) and root.dim() == 4 \
            and not all(isinstance(x, int) for x in (*root.shape, *root.stride())) and same_size(root.stride(3), 1):
        # the paged cache itself, [N0, N1, Hkv, D], of dynamic sizes (``dynamic=True`` makes
        # every cache dim one): the op reads its sizes when the graph runs and checks the
        # heads and head dims against the rows', so no number is needed here
        return CacheView(write, (root.shape[0], root.shape[1], num_heads, head_dim), tuple(root.stride()), 0,
                         (0, 1), direct=True)
    # any other view of the cache is one the op reads through ``as_strided``: numbers
    geometry = [target.shape[head], target.stride(head), target.storage_offset()]
    geometry += [target.shape[heads], target.stride(heads)] if heads is not None else []
    geometry += [x for d in tokens for x in (target.shape[d], target.stride(d))]
    expect(all(isinstance(x, int) for x in geometry),
           f"write: the cache view written at {where(write.write)} has dynamic sizes {list(target.shape)} "
           "(dynamic=True makes every cache dim one); the op reads a view through as_strided, which needs them as "
           "numbers: mark the caches static (torch._dynamo.mark_static)")
    expect(target.stride(head) == 1 and target.shape[head] == head_dim,
           f"write: the cache's head dim is not {head_dim} dense values")
    expect(heads is None or target.shape[heads] == num_heads,
           f"write: the cache holds {target.shape[heads] if heads is not None else 1} heads, the rows {num_heads}")
    sizes = [target.shape[d] for d in tokens] + ([1] if len(tokens) == 1 else [])
    strides = [target.stride(d) for d in tokens] + ([target.stride(tokens[0])] if len(tokens) == 1 else [])
    sizes += [num_heads, head_dim]
    strides += [target.stride(heads) if heads is not None else head_dim, 1]
    direct = write.target is write.root and tuple(root.shape) == tuple(sizes) and tuple(root.stride()) == tuple(strides)
    return CacheView(write, tuple(sizes), tuple(strides), target.storage_offset(), tuple(tokens), direct)


def _index_of(write: RowsWrite, dim: int):
    """The per-row index of written dim ``dim``: ("tensor", node), ("slice", Index) or ("place", None)."""
    if dim in write.dims:
        index = write.indices[write.dims.index(dim)]
        return ("tensor", index.node) if index.node is not None else ("slice", index)
    return ("place", None)


def _same_slot(a, b, inner) -> torch.fx.Node | None:
    """``s`` where ``a`` is ``s // inner`` and ``b`` is ``s % inner`` (``inner`` certainly)."""
    if is_op(a, aten.div.Tensor_mode) and a.kwargs.get("rounding_mode") == "floor" and _is_size(a.args[1], inner) \
            and is_op(b, aten.remainder.Scalar, aten.remainder.Tensor) and _is_size(b.args[1], inner) \
            and a.args[0] is b.args[0]:
        return a.args[0]
    return None


def _is_size(arg, size) -> bool:
    """Whether a node's scalar argument is ``size`` (a number, or a ``sym_size`` node's value)."""
    return same_size(val(arg) if isinstance(arg, torch.fx.Node) else arg, size)


def emit_slots(emit: Emitter, view: CacheView, value_roles: list[str], token_order: list[int], device):
    """The op's ``slot_mapping`` (one per token, in the op's token order), emitted where needed."""
    write = view.write
    kinds = [_index_of(write, d) for d in view.token_dims]
    if len(kinds) == 2 and kinds[0][0] == kinds[1][0] == "tensor":
        s = _same_slot(kinds[0][1], kinds[1][1], view.sizes[1])
        if s is not None and len(shape(s)) == 1:
            return s
    if len(kinds) == 1 and kinds[0][0] == "tensor" and len(shape(kinds[0][1])) == 1 \
            and sum(1 for k, _ in write.value_dims if k == "index") == 1:
        return kinds[0][1]
    # the general case: each token dim's index over the values' token dims, composed
    value_token_dims = [i for i, r in enumerate(value_roles) if r == "tokens"]
    rank = len(value_token_dims)
    index_at = {k_index: pos for pos, i in enumerate(value_token_dims)
                for k_index in [write.value_dims[i][1]] if write.value_dims[i][0] == "index"}

    def placed(node, positions):  # a tensor over the value token dims, sized 1 where it does not vary
        sizes = [1] * rank
        for p, size in zip(positions, shape(node)):
            if p is None:  # an index dim of the one-sized value dims ("one"): nothing to place
                expect(same_size(size, 1), "write: an index varies over a dim of the rows that is not tokens")
                continue
            sizes[p] = size
        return emit.node(aten.reshape.default, node, [s if isinstance(s, int) else -1 for s in sizes])

    parts = []
    for j, (kind, node) in enumerate(kinds):
        dim = view.token_dims[j]
        if kind == "tensor":
            n_index = sum(1 for k, _ in write.value_dims if k == "index")
            dims_of = list(range(n_index - len(shape(node)), n_index))
            index = placed(node, [index_at.get(k) for k in dims_of])
        elif kind == "slice":
            count = _count(emit, node, view)
            index = emit.node(aten.add.Tensor, emit.node(aten.mul.Tensor, emit.iota(count, device), node.step), node.start) \
                if (node.start, node.step) != (0, 1) else emit.iota(count, device)
            index = placed(index, [index_at.get(0)])  # none at one token: a dim of one
        else:
            pos = next(p for p, i in enumerate(value_token_dims) if write.value_dims[i] == ("dim", dim))
            index = placed(emit.iota(emit.size(write.target, dim), device), [pos])
        parts.append((kind, node, index))
    if len(parts) == 1:
        slot = parts[0][2]
    else:
        inner, outer_size = view.size(emit, 1), view.size(emit, 0)
        (_, _, outer), (kind, node, idx) = parts
        inside = None
        if kind == "tensor" and not (is_op(node, aten.remainder.Scalar, aten.remainder.Tensor)
                                     and _is_size(node.args[1], view.sizes[1])):
            # a row index in [-S, S) counts from its sequence's end as eager's indexing does;
            # one outside it (eager raises) must not land in a neighbour's rows
            inside = emit.node(aten.bitwise_and.Tensor, emit.node(aten.ge.Scalar, idx, _neg(emit, inner)),
                               emit.node(aten.lt.Scalar, idx, inner))
            idx = emit.node(aten.remainder.Scalar, idx, inner)
        if parts[0][0] == "tensor":  # a block or sequence index in [-B, B): the op wraps the slot
            ok = emit.node(aten.bitwise_and.Tensor, emit.node(aten.ge.Scalar, outer, _neg(emit, outer_size)),
                           emit.node(aten.lt.Scalar, outer, outer_size))
            inside = ok if inside is None else emit.node(aten.bitwise_and.Tensor, inside, ok)
        slot = emit.node(aten.add.Tensor, emit.node(aten.mul.Tensor, outer, inner), idx)
        if inside is not None:  # out of range: a slot past the cache, which the op rejects (or skips unchecked)
            if isinstance(outer_size, int) and isinstance(inner, int):
                slot = emit.node(aten.where.ScalarOther, inside, slot, outer_size * inner)
            else:  # Inductor lowers a symbolic ``other`` only as a tensor
                past = emit.node(aten.scalar_tensor.default, emit.node(operator.mul, outer_size, inner),
                                 dtype=val(slot).dtype, device=device)
                slot = emit.node(aten.where.self, inside, slot, past)
    full = [s for s in _broadcast_sizes(parts, rank)]
    slot = emit.node(aten.expand.default, slot, full) if any(not same_size(a, b) for a, b in zip(shape(slot), full)) else slot
    order = [value_token_dims.index(d) for d in token_order]
    if order != sorted(order):
        slot = emit.node(aten.permute.default, slot, order)
    return emit.node(aten.reshape.default, slot, [-1])


def _neg(emit, size):
    return -size if isinstance(size, int) else emit.node(operator.neg, size)


def _count(emit, index, view):
    start, stop = index.start, index.stop
    if isinstance(start, int) and isinstance(stop, int):
        return -(-(stop - start) // index.step)
    return emit.node(operator.sub, stop, start)


def _broadcast_sizes(parts, rank):
    sizes = [1] * rank
    for _, _, index in parts:
        for i, s in enumerate(shape(index)):
            if not (isinstance(s, int) and s == 1):
                sizes[i] = s
    return sizes


def _numel(node) -> int:
    n = 1
    for size in shape(node):
        n *= concrete(size)
    return n


def probe_roles(view: CacheView) -> dict:
    """The probes' roles and limits for a write's slots (``Probes``'s keyword arguments):
    one slot tensor split ``s // bs, s % bs``, a (block, row) pair drawn as distinct pairs,
    a block per row of positions (distinct blocks, distinct positions within each), a pool's
    slot, or a sequence's positions. Distinct, because off the CPU a position written twice
    holds either row."""
    w = view.write
    kinds = [(w.indices[w.dims.index(d)].node if d in w.dims else None) for d in view.token_dims]
    roles, extra = {}, {}
    if len(kinds) == 2 and all(n is not None for n in kinds):
        s = _same_slot(kinds[0], kinds[1], view.sizes[1])
        if s is not None:
            roles[s] = "slots"
        elif _numel(kinds[0]) == _numel(kinds[1]):
            roles.update({kinds[0]: "slot_block", kinds[1]: "slot_row"})
        else:  # one block index per row of positions (``cache[arange(B)[:, None], pos]``)
            roles.update({kinds[0]: "sequence_blocks", kinds[1]: "sequence_rows"})
    elif len(kinds) == 1 and kinds[0] is not None:
        roles[kinds[0]] = "slots"
    elif len(kinds) == 2 and kinds[1] is not None:  # a sequence's positions
        roles[kinds[1]] = "sequence_slots" if len(shape(kinds[1])) == 2 else "slots"
        extra["slots"] = concrete(view.sizes[1])
    return {"roles": roles, "slots": extra.get("slots", view.slots), "block_size": concrete(view.sizes[1])}
