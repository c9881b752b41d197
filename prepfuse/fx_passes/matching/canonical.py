"""One form per concept: the graph pass every fusion family runs after.

Model code spells one computation many ways, and Dynamo, AOT autograd and decomposition
keep most of the difference. Before any family looks, ``canonicalize`` rewrites the
post-grad graph into one form per concept, with rewrites that compute the same bits (so a
graph nothing fuses in runs as before):

- **no aliases**: ``detach`` and ``alias`` are their input;
- **one node per computation**: repeated pure steps merge (vLLM casts cos/sin once per
  rotated tensor; gpt-fast indexes ``xshaped[..., 0]`` twice). Validation would otherwise
  give the copies unrelated probe values;
- **one selection**: an item of ``unbind`` (``k_cache, v_cache = kv_cache.unbind(0)``, vLLM's
  ``[2, blocks, ...]`` buffer) is the ``select`` of it, which every reader follows;
- **one square**: ``x.pow(2)`` and ``x.square()`` become ``x * x`` (torch computes all three
  as the one product);
- **one write form**: ``index_copy(c, dim, idx, rows)`` and ``scatter(c, dim, idx, rows)``
  with an index that is one position per row (``slots[:, None, None].expand(..)``) become
  the ``index_put`` the cache-write reader reads (``writes.py``), as slice assignment and
  ``cache[idx] = rows`` already are; rows that broadcast into the indexed shape over leading
  dims of one (``cache[slots] = rows`` with one token, whose ``[1, H, D]`` Inductor reshaped
  to ``[H, D]``) are given it, so that every write names its token dims;
- **one write per tensor written** (``written_pieces.py``): ``cache[slots] = cat((k, v), dim=1)``
  (k|v heads side by side in one buffer), rows whose k heads were overwritten in place
  (lightllm's ``cache_kv[:, :Hk] = rope(norm(..))``), or a slice write of a packed row whose
  k was overwritten in place (flash-attention's ``kv[:, :, 0] = rope(..)`` then
  ``kv_cache[b0:b1, s0:s1, ...] = kv``), becomes the write of each piece into its slice (or
  select) of the cache, ``cache[:, :Hk][slots] = k`` then ``cache[:, Hk:][slots] = v``: the
  same bytes;
- **a cache is its own bytes**: a write into a bitcast view (``cache.view(torch.int16)[s] =
  k.view(torch.int16)``, TensorRT-LLM's and text-generation-inference's spelling) becomes the
  write of the values into the cache itself;
- **no writes into views in between**: code that rotates a view of its projection in place
  (``q1 = q[..., :32]; q1.copy_(...)``, text-generation-inference, lmdeploy) reaches the
  post-grad graph as ``slice_scatter``/``select_scatter`` back into the projection and views
  of that. A read of such a scatter is what it reads: the scattered values, where it reads
  exactly them, or the same read of what was there before, where it reads none of them
  (decided by running the views on element numbers, so every view spelling is one case);
  scatters that together overwrite a whole dim are the ``cat`` of what they wrote; a
  reshape of a reshape is one reshape (none, back to the input's shape); a functional
  ``copy(dst, src)`` of dst's shape is ``src`` in dst's dtype.

What a family reads needs no more than this: which math a region computes is decided by
running candidate calls against it on probes (``rewrite/probes.py``), not by reading its spelling,
so ``rsqrt`` against ``1 / sqrt``, or complex against real-pair RoPE, need no rewrite here.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import (
    CONVERTS, RESHAPES, VIEW_OPS, aten, call_node, is_op, prims, remove_dead, same_size, scalar, shape, slice_params,
    val,
)
from prepfuse.fx_passes.matching.written_pieces import one_write_per_piece

__all__ = ["canonicalize", "PURE_STEPS", "merge_repeated_steps", "reads_through_scatters"]

# steps whose value is a function of their arguments alone (no randomness, no mutation)
PURE_STEPS = (
    *VIEW_OPS, *CONVERTS, aten.slice.Tensor, aten.as_strided.default, aten.select.int, aten.expand.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.index.Tensor, aten.index_select.default,
    aten.cat.default, aten.stack.default, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.neg.default, aten.cos.default, aten.sin.default, aten.remainder.Scalar, aten.remainder.Tensor,
    aten.div.Tensor_mode, aten.view_as_real.default, aten.view_as_complex.default, aten.view.dtype,
    aten.clone.default, aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.mean.dim,
    aten.pow.Tensor_Scalar, operator.getitem,
)


def canonicalize(graph: torch.fx.Graph) -> dict[str, int]:
    """Rewrite ``graph`` into its canonical form; returns how often each rule applied."""
    counts = {"aliases": _no_aliases(graph), "selections": _one_selection(graph), "squares": _one_square(graph),
              "writes": _one_write_form(graph), "bitcast writes": _bitcast_writes(graph),
              "copies": _plain_copies(graph), "reads through scatters": reads_through_scatters(graph)}
    counts["written pieces"] = one_write_per_piece(graph)  # reads the values as the reads above leave them
    if counts["written pieces"]:  # the pieces' new reads of what a scatter left
        counts["reads through scatters"] += reads_through_scatters(graph)
    counts["merged steps"] = merge_repeated_steps(graph)
    remove_dead([n for n in graph.nodes if n.op == "call_function" and not n.users])
    return counts


# --------------------------------------------------------------------------------------
def _replace(graph, old: torch.fx.Node, target, args, kwargs=None) -> torch.fx.Node:
    with graph.inserting_before(old):
        new = graph.call_function(target, tuple(args), kwargs or {})
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


def _no_aliases(graph) -> int:
    """``detach`` and ``alias`` of a functional graph are their input (no copy, no effect)."""
    done = 0
    for node in list(graph.nodes):
        if is_op(node, aten.detach.default, aten.alias.default):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            done += 1
    return done


def _one_selection(graph) -> int:
    """``unbind(x, dim)[i]`` becomes ``select(x, dim, i)``: the same view, one spelling."""
    done = 0
    for node in list(graph.nodes):
        if is_op(node, aten.unbind.int) and all(u.target is operator.getitem for u in node.users):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            for item in list(node.users):
                _replace(graph, item, aten.select.int, (node.args[0], dim, item.args[1]))
                done += 1
    return done


def _one_square(graph) -> int:
    done = 0
    for node in list(graph.nodes):
        if (is_op(node, aten.pow.Tensor_Scalar) and scalar(node.args[1]) == 2.0) or is_op(node, aten.square.default):
            x = node.args[0]
            _replace(graph, node, aten.mul.Tensor, (x, x))
            done += 1
    return done


def _one_position_per_row(index: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """The 1-d ``idx`` of which ``index`` is ``idx`` along ``dim`` repeated along every
    other dim (``idx[:, None, None].expand(n, H, D)``), or None."""
    node = index
    while is_op(node, aten.expand.default, aten.unsqueeze.default, aten.clone.default, *RESHAPES) \
            and len(shape(node)) > 1:
        node = node.args[0]
    if node is index or len(shape(node)) != 1:
        return None
    return node if _is_expand_of(index, node, dim) else None


def _one_write_form(graph) -> int:
    done = 0
    for node in list(graph.nodes):
        if is_op(node, aten.index_put.default):
            done += _full_rank_rows(graph, node)
        elif is_op(node, aten.index_copy.default):
            cache, dim, idx, rows = node.args[:4]
            dim = dim % len(shape(cache))
            _replace(graph, node, aten.index_put.default, (cache, [None] * dim + [idx], rows))
            done += 1
        elif is_op(node, aten.scatter.src) and not node.kwargs.get("reduce"):
            cache, dim, index, rows = node.args[:4]
            dim = dim % len(shape(cache))
            full = shape(index) == shape(rows) and all(
                a == b for d, (a, b) in enumerate(zip(shape(index), shape(cache))) if d != dim)
            idx = _one_position_per_row(index, dim) if full else None
            if idx is not None:
                _replace(graph, node, aten.index_put.default, (cache, [None] * dim + [idx], rows))
                done += 1
    return done


def _full_rank_rows(graph, put: torch.fx.Node) -> int:
    """Give ``put``'s values the indexed shape where they broadcast into it over leading dims
    of one only (the same values, each dim named: reshaped where every size is a number,
    else unsqueezed, naming no symbolic size); 1 if it did."""
    dst, indices, values = put.args[:3]
    if not isinstance(values, torch.fx.Node) or not isinstance(indices, (list, tuple)):
        return 0
    at = [i for i, ix in enumerate(indices) if ix is not None]
    if not at or at != list(range(at[0], at[-1] + 1)) or any(not isinstance(indices[i], torch.fx.Node) for i in at):
        return 0
    index_shapes = [shape(indices[i]) for i in at]
    if any(any(not isinstance(d, int) for d in sizes) for sizes in index_shapes):
        return 0
    indexed = [*shape(dst)[:at[0]], *torch.broadcast_shapes(*index_shapes), *shape(dst)[at[-1] + 1:]]
    rows = list(shape(values))
    lead = len(indexed) - len(rows)
    if lead <= 0 or any(not (isinstance(d, int) and d == 1) for d in indexed[:lead]) \
            or any(not same_size(a, b) for a, b in zip(indexed[lead:], rows)):  # no guard: known sizes
        return 0
    with graph.inserting_before(put):
        if all(isinstance(d, int) for d in indexed):  # a reshape, which ``_reshape_chains`` folds into one before
            full = call_node(graph, aten.reshape.default, (values, indexed), meta=values.meta)
        else:  # symbolic sizes: leading ones, no size named
            full = values
            for _ in range(lead):
                full = call_node(graph, aten.unsqueeze.default, (full, 0), meta=values.meta)
    put.update_arg(2, full)
    return 1


def _is_expand_of(index: torch.fx.Node, idx: torch.fx.Node, dim: int) -> bool:
    """``index`` holds ``idx`` along ``dim`` and repeats it along every other dim: read by
    running the broadcast on a fake ``arange`` (exact, whatever the view spelling)."""
    chain, node = [], index
    while node is not idx:
        chain.append(node)
        node = node.args[0]
    probe = torch.arange(shape(idx)[0])
    try:
        for step in reversed(chain):
            probe = step.target(probe, *step.args[1:], **step.kwargs)
    except Exception:  # noqa: BLE001 - a step the probe cannot run: not this form
        return False
    want = torch.arange(shape(idx)[0]).reshape([-1 if d == dim else 1 for d in range(probe.dim())])
    return tuple(probe.shape) == tuple(shape(index)) and bool((probe == want).all())


def _bitcast_writes(graph) -> int:
    """``index_put(x.view(d)[.reshape(..)], idx, v.view(d))`` with ``d`` of x's item size,
    read back as ``[.reshape(..)].view(x.dtype)``: the write of ``v`` into ``x`` (or its
    reshape)."""
    done = 0
    for node in list(graph.nodes):
        if not is_op(node, aten.index_put.default):
            continue
        reshapes, bytes_view = [], node.args[0]
        while is_op(bytes_view, *RESHAPES):
            reshapes.append(bytes_view)
            bytes_view = bytes_view.args[0]
        if not is_op(bytes_view, aten.view.dtype):
            continue
        indices, values = node.args[1:3]
        cache = bytes_view.args[0]
        own, seen = val(cache).dtype, val(bytes_view).dtype
        if own.itemsize != seen.itemsize or own == seen:
            continue
        if is_op(values, aten.view.dtype) and val(values.args[0]).dtype == own:
            values = values.args[0]
        elif val(values).dtype == seen:
            with graph.inserting_before(node):
                values = graph.call_function(aten.view.dtype, (values, own))
            values.meta["val"] = val(values.args[0]).view(own)
        else:
            continue
        with graph.inserting_before(node):
            target = _reshaped_as(graph, cache, reversed(reshapes), own)
            put = graph.call_function(aten.index_put.default, (target, indices, values, *node.args[3:]), dict(node.kwargs))
            back = graph.call_function(aten.view.dtype, (put, seen))
        put.meta.update(node.meta)
        put.meta["val"] = val(node).view(own)
        back.meta["val"] = val(node)
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        _read_in_own_dtype(graph, back, put, own)
        done += 1
    return done


def _reshaped_as(graph, node: torch.fx.Node, reshapes, own) -> torch.fx.Node:
    """``reshapes`` (nodes of a byte view, outer first) applied to ``node``, held in ``own``."""
    for r in reshapes:
        node = graph.call_function(r.target, (node, *r.args[1:]), dict(r.kwargs))
        node.meta.update(r.meta)
        node.meta["val"] = val(r).view(own)
    return node


def _read_in_own_dtype(graph, back: torch.fx.Node, put: torch.fx.Node, own) -> None:
    """Readers of ``back`` (``put`` seen as bytes) that reshape it and view it as ``own``
    again (the functional write-back) read the same reshapes of ``put``."""
    frontier = [(u, []) for u in back.users]
    while frontier:
        user, chain = frontier.pop()
        if is_op(user, aten.view.dtype) and val(user).dtype == own:
            with graph.inserting_before(user):
                user.replace_all_uses_with(_reshaped_as(graph, put, chain, own))
        elif is_op(user, *RESHAPES):
            frontier += [(u, chain + [user]) for u in user.users]


# --------------------------------------------------------------------------------------
SCATTERS = (aten.slice_scatter.default, aten.select_scatter.default)
# steps that read a part of their first argument: what a read of a scatter may go through
_READS = (*VIEW_OPS, aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
          operator.getitem)
MAX_SCATTER_ROUNDS = 32


def _plain_copies(graph) -> int:
    """``copy(dst, src)`` (functionalization's ``dst.copy_(src)``) with src of dst's shape:
    src, in dst's dtype."""
    done = 0
    for node in list(graph.nodes):
        if not is_op(node, aten.copy.default) or node.kwargs.get("non_blocking") or len(node.args) > 2:
            continue
        dst, src = node.args[:2]
        if not isinstance(src, torch.fx.Node) or tuple(shape(src)) != tuple(shape(dst)):
            continue
        if val(src).dtype == val(dst).dtype:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
        else:
            _replace(graph, node, prims.convert_element_type.default, (src, val(dst).dtype))
        done += 1
    return done


def reads_through_scatters(graph: torch.fx.Graph) -> int:
    """Reads of ``slice_scatter``/``select_scatter`` results become reads of what they read
    (the module docstring's rule), and scatters tiling a dim become a ``cat``, until nothing
    changes; a scatter into a graph input (a cache's write-back) is left as it is. Returns
    how many reads and tilings went."""
    done = 0
    for _ in range(MAX_SCATTER_ROUNDS):
        step = _reshape_chains(graph) + _tiling_scatters(graph)
        for node in list(graph.nodes):
            if is_op(node, *SCATTERS) and node.users and not _into_input(node):
                step += _resolve_reads(graph, node)
        remove_dead([n for n in graph.nodes if n.op == "call_function" and not n.users])
        done += step
        if not step:
            break
    return done


def _into_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a view of, or a write into, a graph input (through views and
    other writes): a cache's functional write-back, which the cache-write reader reads as
    it is."""
    while is_op(node, *_READS, *SCATTERS, aten.index_put.default, aten.view.dtype):
        node = node.args[0]
    return node.op == "placeholder"


def _concrete_shape(node) -> list[int] | None:
    v = val(node)
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
        return None
    return list(v.shape)


def _resolve_reads(graph, scatter: torch.fx.Node) -> int:
    base, src = scatter.args[:2]
    base_shape, src_shape = _concrete_shape(base), _concrete_shape(src)
    if base_shape is None or src_shape is None:
        return 0
    base_ids = torch.arange(_numel(base_shape)).reshape(base_shape)
    src_ids = -1 - torch.arange(_numel(src_shape)).reshape(src_shape)
    try:
        ids = scatter.target(base_ids, src_ids, *scatter.args[2:], **scatter.kwargs)
    except Exception:  # noqa: BLE001 - a scatter the element numbers cannot replay: left as it is
        return 0
    done = 0
    frontier = [(u, [u], ids) for u in scatter.users if is_op(u, *_READS) and u.args[0] is scatter]
    while frontier:
        node, chain, parent_ids = frontier.pop(0)
        try:
            got = node.target(parent_ids, *node.args[1:], **node.kwargs)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(got, torch.Tensor) and got.numel() and _concrete_shape(node) == list(got.shape):
            new = _read_of(graph, node, chain, got, base, src, src_shape)
            if new is not None:
                node.replace_all_uses_with(new)
                done += 1
                continue
        frontier += [(u, chain + [u], got) for u in node.users if is_op(u, *_READS) and u.args[0] is node]
    return done


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _read_of(graph, node, chain, ids: torch.Tensor, base, src, src_shape) -> torch.fx.Node | None:
    """What ``node`` (``chain`` of reads from a scatter, giving element numbers ``ids``)
    reads: the scattered values in their order (a reshape of ``src``), or the same chain of
    reads from ``base``; None when it reads some of each."""
    if bool((ids < 0).all()):
        if ids.numel() != _numel(src_shape) or not bool(((-1 - ids).flatten() == torch.arange(ids.numel())).all()):
            return None
        if list(ids.shape) == src_shape:
            return src
        with graph.inserting_before(node):
            new = graph.call_function(aten.reshape.default, (src, list(ids.shape)))
        new.meta.update(node.meta)
        return new
    if not bool((ids >= 0).all()):
        return None
    made = {chain[0].args[0]: base}
    with graph.inserting_before(node):
        for step in chain:
            new = graph.call_function(step.target, (made[step.args[0]], *step.args[1:]), dict(step.kwargs))
            new.meta.update(step.meta)
            made[step] = new
    return made[node]


def _reshape_chains(graph) -> int:
    """A reshape of a reshape is one reshape of the first input, and a reshape back to the
    input's own shape is the input (reshapes keep the elements' order); not on a graph
    input's views, whose chains the cache-write reader follows back."""
    done = 0
    for node in list(graph.nodes):
        if not is_op(node, *RESHAPES) or not is_op(node.args[0], *RESHAPES) or not node.users or _into_input(node):
            continue
        root = node.args[0]
        while is_op(root, *RESHAPES):
            root = root.args[0]
        if _concrete_shape(root) is not None and _concrete_shape(root) == _concrete_shape(node):
            node.replace_all_uses_with(root)
        else:
            node.replace_input_with(node.args[0], root)
        done += 1
    return done


def _tiling_scatters(graph) -> int:
    """``slice_scatter(... slice_scatter(base, a, d, 0, m) ..., b, d, m, n)`` where the
    ranges written along ``d`` cover it whole: the ``cat`` of the written values along
    ``d``, in their order (the inner scatters stay for their other readers)."""
    done = 0
    for node in list(graph.nodes):
        if not is_op(node, aten.slice_scatter.default) or _into_input(node):
            continue
        pieces, at = [], node
        dim = None
        while is_op(at, aten.slice_scatter.default):
            base_shape = _concrete_shape(at.args[0])
            d, start, end, step = slice_params(at.args[2:], at.kwargs)
            if base_shape is None or step != 1 or (dim is not None and d % len(base_shape) != dim) or not all(
                    isinstance(x, int) for x in (d, 0 if start is None else start, 0 if end is None else end)):
                break
            dim = d % len(base_shape)
            size = base_shape[dim]
            start, end = _clamp(0 if start is None else start, size), _clamp(size if end is None else end, size)
            pieces.append((start, end, at.args[1]))
            at = at.args[0]
        if len(pieces) < 2:
            continue
        size = _concrete_shape(node)[dim]
        ranges = sorted((a, b) for a, b, _ in pieces)
        if ranges[0][0] != 0 or ranges[-1][1] != size or any(b != c for (_, b), (c, _) in zip(ranges, ranges[1:])):
            continue
        srcs = [s for _, _, s in sorted(pieces, key=lambda p: p[0])]
        _replace(graph, node, aten.cat.default, (srcs, dim))
        done += 1
    return done


def _clamp(i: int, size: int) -> int:
    if i < 0:
        i += size
    return max(0, min(i, size))


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _key(node: torch.fx.Node):
    """A hashable key of (step, arguments), or None when an argument cannot be hashed."""
    def freeze(a):
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, freeze(v)) for k, v in a.items()))
        hash(a)  # raises TypeError for what cannot be a key
        return a

    try:
        return node.target, freeze(node.args), freeze(node.kwargs)
    except TypeError:
        return None


def merge_repeated_steps(graph: torch.fx.Graph) -> int:
    """Keep the first of each set of nodes applying one pure step to the same arguments and
    point the others' readers at it; nothing past the first node that mutates a tensor,
    where "the same arguments" would no longer mean the same values. Returns how many went."""
    first: dict = {}
    merged = []
    for node in graph.nodes:
        if _mutates(node):
            break
        if node.op != "call_function" or node.target not in PURE_STEPS:
            continue
        key = _key(node)  # arguments already point at the kept nodes: chains merge top down
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            merged.append(node)
    for node in reversed(merged):
        graph.erase_node(node)
    return len(merged)
