"""One form per concept: the graph pass every fusion family runs after.

Model code spells one computation many ways, and Dynamo, AOT autograd and decomposition
keep most of the difference. Before any family looks, ``canonicalize`` rewrites the
post-grad graph into one form per concept, with rewrites that compute the same bits (so a
graph nothing fuses in runs as before):

- **no aliases**: ``detach`` and ``alias`` are their input;
- **one node per computation**: repeated pure steps merge (vLLM casts cos/sin once per
  rotated tensor; gpt-fast indexes ``xshaped[..., 0]`` twice). Validation would otherwise
  give the copies unrelated probe values;
- **one square**: ``x.pow(2)`` and ``x.square()`` become ``x * x`` (torch computes all three
  as the one product);
- **one write form**: ``index_copy(c, dim, idx, rows)`` and ``scatter(c, dim, idx, rows)``
  with an index that is one position per row (``slots[:, None, None].expand(..)``) become
  the ``index_put`` the cache-write reader reads (``writes.py``), as slice assignment and
  ``cache[idx] = rows`` already are;
- **a cache is its own bytes**: a write into a bitcast view (``cache.view(torch.int16)[s] =
  k.view(torch.int16)``, TensorRT-LLM's and text-generation-inference's spelling) becomes the
  write of the values into the cache itself.

What a family reads needs no more than this: which math a region computes is decided by
running candidate calls against it on probes (``probes.py``), not by reading its spelling,
so ``rsqrt`` against ``1 / sqrt``, or complex against real-pair RoPE, need no rewrite here.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import CONVERTS, RESHAPES, VIEW_OPS, aten, is_op, remove_dead, scalar, shape, val

__all__ = ["canonicalize", "PURE_STEPS", "merge_repeated_steps"]

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
    counts = {"aliases": _no_aliases(graph), "squares": _one_square(graph), "writes": _one_write_form(graph),
              "bitcast writes": _bitcast_writes(graph)}
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
        if is_op(node, aten.index_copy.default):
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
    """``index_put(x.view(d), idx, v.view(d))`` with ``d`` of x's item size, read back as
    ``.view(x.dtype)``: the write of ``v`` into ``x``."""
    done = 0
    for node in list(graph.nodes):
        if not is_op(node, aten.index_put.default) or not is_op(node.args[0], aten.view.dtype):
            continue
        bytes_view, indices, values = node.args[:3]
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
            put = graph.call_function(aten.index_put.default, (cache, indices, values, *node.args[3:]), dict(node.kwargs))
            back = graph.call_function(aten.view.dtype, (put, seen))
        put.meta.update(node.meta)
        put.meta["val"] = val(node).view(own)
        back.meta["val"] = val(node)
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        for user in list(back.users):  # the functional write-back's view to the cache's own dtype
            if is_op(user, aten.view.dtype) and val(user).dtype == own:
                user.replace_all_uses_with(put)
        done += 1
    return done


# --------------------------------------------------------------------------------------
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
