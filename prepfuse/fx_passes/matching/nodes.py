"""What every matching module reads off a post-grad node: its op, its fake value, its sizes
(symbolic sizes compared without adding a guard), and where in the model it came from.

Declines name the model's own source line (``where``), never an internal node: a user
reading the report has never seen the post-grad graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
CONVERTS = (prims.convert_element_type.default, aten._to_copy.default)
VIEW_OPS = (*RESHAPES, aten.permute.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.default, aten.squeeze.dims, aten.alias.default, aten.t.default)
# views a write's functional form scatters back (``scatter_back``)
WRITE_VIEWS = (*RESHAPES, aten.slice.Tensor, aten.as_strided.default, aten.select.int, aten.view.dtype,
               aten.unsqueeze.default)
INT_MAX = 2**63 - 1

__all__ = ["NoMatch", "expect", "is_op", "val", "shape", "same_size", "divides", "same_shape", "scalar", "concrete", "where",
           "aten", "prims", "RESHAPES", "CONVERTS", "VIEW_OPS", "WRITE_VIEWS", "INT_MAX", "view_chain",
           "scatter_back", "slice_params", "getitem_of", "graph_order", "remove_dead", "call_node"]


class NoMatch(Exception):
    """The graph does not hold what a pass looks for here; the message says what it holds."""


def expect(cond, why: str) -> None:
    if not cond:
        raise NoMatch(why)


def is_op(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def val(node):
    """The fake tensor (or SymInt, or constant) a node holds."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def shape(node) -> tuple:
    return tuple(val(node).shape)


def call_node(graph: torch.fx.Graph, target, args, kwargs=None, meta=None) -> torch.fx.Node:
    """A new node computing ``target(*args)`` where the graph inserts now, its fake value
    computed from its inputs'; ``meta`` (a source line's) copied onto it."""
    node = graph.call_function(target, tuple(args), dict(kwargs or {}))
    if meta:
        node.meta.update(meta)
    fake_args, fake_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), val)
    node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def same_size(a, b) -> bool:
    """Sizes certainly equal, without adding a guard (``T`` may be symbolic)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def divides(d: int, size) -> bool:
    """``size % d == 0`` certainly, without adding a guard (a dynamic size need not be)."""
    if isinstance(size, int):
        return size % d == 0
    return statically_known_true(size % d == 0)


def same_shape(a, b) -> bool:
    sa, sb = shape(a), shape(b)
    return len(sa) == len(sb) and all(same_size(x, y) for x, y in zip(sa, sb))


def scalar(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def concrete(size) -> int:
    """An int for a size: itself, or a dynamic size's traced value (its hint)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else int(size.node.shape_env.size_hint(size.node.expr))
    return int(size)


def where(node) -> str:
    """The model source line that made ``node`` (``file.py:123 `code```), or its op's name."""
    trace = node.meta.get("stack_trace") if isinstance(node, torch.fx.Node) else None
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith("File "):
                parts = lines[i].split('"')
                path = parts[1].rsplit("/", 1)[-1] if len(parts) > 1 else "?"
                line = lines[i].split("line ")[-1].split(",")[0]
                code = lines[i + 1] if i + 1 < len(lines) else ""
                return f"{path}:{line} `{code}`"
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        return "an input of the compiled code"
    target = getattr(getattr(node, "target", None), "__name__", None)
    return f"a {target} step" if target else repr(node)


def graph_order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def getitem_of(node, index: int):
    """The ``getitem(node, index)`` reader of a multi-output node, or None."""
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def slice_params(args, kwargs) -> tuple:
    """(dim, start, end, step) of a slice or slice_scatter, defaults filled in."""
    names = ("dim", "start", "end", "step")
    defaults = (0, None, None, 1)
    return tuple(args[i] if i < len(args) else kwargs.get(k, d) for i, (k, d) in enumerate(zip(names, defaults)))


def view_chain(node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(root, [view ops from the root down to ``node``]) through the views a write can go through."""
    chain = []
    while is_op(node, *WRITE_VIEWS):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _same_value(a, b) -> bool:
    """One node, or the same view step of the same node (functionalization regenerates a view)."""
    if a is b:
        return True
    return (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and a.op == b.op == "call_function"
            and a.target is b.target and a.target in WRITE_VIEWS and a.kwargs == b.kwargs
            and len(a.args) == len(b.args) and all(_same_value(x, y) if isinstance(x, torch.fx.Node) else x == y
                                                   for x, y in zip(a.args, b.args)))


def scatter_back(written, chain: list[torch.fx.Node]) -> torch.fx.Node:
    """The root's new value after ``written`` replaced the view ``chain[-1]``: functionalization
    undoes each view step, a reshape by a reshape back, ``unsqueeze`` by ``squeeze``, ``slice`` by ``slice_scatter``,
    ``select`` by ``select_scatter``, ``as_strided`` by ``as_strided_scatter``, a dtype view
    by a dtype view back. Raises NoMatch on anything else."""
    node = written
    for step in reversed(chain):
        users = list(node.users)
        expect(len(users) == 1, f"write: the written view is read {len(users)} times, expected one scatter back")
        (user,) = users
        if step.target in RESHAPES:
            ok = is_op(user, *RESHAPES) and user.args[0] is node and same_shape(user, step.args[0])
        elif step.target is aten.unsqueeze.default:  # undone by squeezing the same dim
            ok = is_op(user, aten.squeeze.dim) and user.args[0] is node and same_shape(user, step.args[0])
        elif step.target is aten.view.dtype:
            ok = is_op(user, aten.view.dtype) and user.args[0] is node and val(user).dtype == val(step.args[0]).dtype
        elif step.target is aten.slice.Tensor:
            ok = (is_op(user, aten.slice_scatter.default) and _same_value(user.args[0], step.args[0])
                  and user.args[1] is node
                  and slice_params(user.args[2:], user.kwargs) == slice_params(step.args[1:], step.kwargs))
        elif step.target is aten.select.int:
            ok = (is_op(user, aten.select_scatter.default) and _same_value(user.args[0], step.args[0])
                  and user.args[1] is node and tuple(user.args[2:]) == tuple(step.args[1:]))
        else:
            ok = (is_op(user, aten.as_strided_scatter.default) and _same_value(user.args[0], step.args[0])
                  and user.args[1] is node and tuple(user.args[2:]) == tuple(step.args[1:]))
        expect(ok, f"write: the written view of {where(step)} is not scattered back into its buffer")
        node = user
    return node


def remove_dead(nodes) -> None:
    """Erase ``nodes`` that nothing reads and, in turn, what only they read: the dead code a
    rewrite leaves, without a scan of the whole graph (``Graph.eliminate_dead_code`` asks
    every node whether it is impure, most of a pass's cost on a large graph)."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op in ("placeholder", "output") or node.is_impure():
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)
