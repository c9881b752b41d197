"""A stable, one-line-per-node print of an FX graph, for golden tests and debug dumps.

``str(graph)`` carries ``num_users`` counts, and Inductor's node names drift between torch
versions (``arg0_1`` / ``primals_1``, ``auto_functionalized`` / ``auto_functionalized_v2``);
neither belongs in a golden file. This print renames nodes by their role and order and
writes each node as ``name = target(args)``, the placeholders on one line::

    arg0, arg1, arg2 = placeholders()
    dsv4_qnorm_rope_kv_insert = prepfuse.dsv4_qnorm_rope_kv_insert.default(arg0, arg1, arg2, ...)
    return ()

Placeholders become ``arg0, arg1 ...`` in the order the graph first *uses* them: Dynamo
lifts inputs in an order that differs between torch versions (2.11 and 2.13 disagree on
the same function), while the order of use is the program's. Placeholders nothing uses
are left out, and so are torch's runtime shape assertions (``aten._assert_scalar`` and
the symbolic comparisons that only feed them), which some versions emit and others do
not; neither says anything about what a pass did. Every other node is named after its
target (``getitem``, ``getitem_1`` ... the way FX numbers duplicates). Nothing in the
output depends on memory addresses or on the names the graph had before.
"""

from __future__ import annotations

import operator
import os

import torch
import torch.fx

__all__ = ["normalized_graph", "target_name"]


def target_name(target) -> str:
    """A short, version-stable spelling of a node target.

    ``aten.slice.Tensor``, ``prepfuse.dsv4_qnorm_rope_kv_insert.default``,
    ``auto_functionalized_v2`` for higher-order ops, ``getitem`` for Python builtins.
    """
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # namespace.name.overload
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    if isinstance(target, str):
        return target
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", repr(target))


def _base_name(node: torch.fx.Node) -> str:
    if node.op == "call_function" or node.op == "call_method":
        name = target_name(node.target)
        # "prepfuse.dsv4_qnorm_rope_kv_insert.default" -> "dsv4_qnorm_rope_kv_insert"
        parts = name.split(".")
        return parts[1] if isinstance(node.target, torch._ops.OpOverload) and len(parts) >= 2 else parts[-1]
    if node.op == "get_attr":
        return "const"
    return node.op


def _format_arg(arg, names: dict[torch.fx.Node, str]) -> str:
    if isinstance(arg, torch.fx.Node):
        return names[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a, names) for a in arg)
        if isinstance(arg, tuple):
            return f"({inner},)" if len(arg) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_format_arg(v, names)}" for k, v in arg.items()) + "}"
    if isinstance(arg, torch._ops.OpOverload) or isinstance(arg, torch._ops.HigherOrderOperator):
        return target_name(arg)
    if isinstance(arg, torch.dtype):
        return str(arg).replace("torch.", "")
    if isinstance(arg, torch.device):
        return repr(str(arg))
    if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(arg)
    return repr(arg)


_RUNTIME_ASSERTS = {"_assert_scalar", "_assert_async", "sym_constrain_range", "sym_constrain_range_for_size"}


def _runtime_assert_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Shape-assertion nodes and the non-tensor nodes that only feed them."""
    dropped: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        name = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", "")
        is_assert = name in _RUNTIME_ASSERTS
        only_feeds_asserts = bool(node.users) and all(u in dropped for u in node.users)
        if is_assert or (only_feeds_asserts and not isinstance(node.meta.get("val"), torch.Tensor)):
            dropped.add(node)
    return dropped


def normalized_graph(graph: torch.fx.Graph | torch.fx.GraphModule) -> str:
    """One line per node, ``name = target(args, key=value)``, with stable names.

    Accepts a graph or a graph module. Keyword arguments keep the order the node holds
    them in, which is the schema's order for functionalized calls.
    """
    if isinstance(graph, torch.fx.GraphModule):
        graph = graph.graph
    dropped = _runtime_assert_nodes(graph)
    body = [n for n in graph.nodes if n.op != "placeholder" and n not in dropped]

    names: dict[torch.fx.Node, str] = {}
    for node in body:  # placeholders, numbered by first use
        for used in node.all_input_nodes:
            if used.op == "placeholder" and used not in names:
                names[used] = f"arg{len(names)}"
    lines = [f"{', '.join(names.values())} = placeholders()"] if names else []

    seen: dict[str, int] = {}
    for node in body:
        if node.op == "output":
            lines.append(f"return {_format_arg(node.args[0], names)}")
            continue
        base = _base_name(node)
        k = seen.get(base, 0)
        seen[base] = k + 1
        names[node] = base if k == 0 else f"{base}_{k}"
        if node.op == "get_attr":
            lines.append(f"{names[node]} = get_attr({node.target!r})")
            continue
        parts = [_format_arg(a, names) for a in node.args]
        parts += [f"{key}={_format_arg(v, names)}" for key, v in node.kwargs.items()]
        lines.append(f"{names[node]} = {target_name(node.target)}({', '.join(parts)})")
    return "\n".join(lines)


def short_source(stack_trace: str | None) -> str:
    """``file.py:LINE  code`` for the innermost frame of an FX node's stack trace."""
    if not stack_trace:
        return ""
    lines = [ln for ln in stack_trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('", line ')
            lineno = rest.split(",", 1)[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{os.path.basename(path)}:{lineno}  {code}".rstrip()
    return lines[-1].strip()
