"""One node per computation: repeated pure steps of a post-grad graph merged before matching.

Model code often writes one value twice: vLLM casts cos/sin once per rotated tensor
(``cos.unsqueeze(-2).to(x.dtype)`` for q and again for k), gpt-fast indexes ``xshaped[..., 0]``
and ``freqs_cis[..., 1]`` in both the real and the imaginary part, and Dynamo traces each
spelling into nodes of its own. A recogniser that asks "is this the same tensor" would see two,
and a rewrite validated on probes would give the two copies independent probe values
(``validation.py``): the region would compute with values the model never pairs. So before a
fusion pass matches, ``merge_repeated_steps`` keeps the first of each set of nodes that apply
the same pure step (views, casts, gathers, elementwise arithmetic: ``recognizers.PURE_STEPS``)
to the same arguments, and points the others' readers at it. The graph computes what it did
(Inductor would have computed the copies identically); nothing is merged past the first node
that mutates a tensor, where "the same arguments" would no longer mean the same values.
"""

from __future__ import annotations

import torch
import torch.fx

from prepfuse.fx_passes.matching.recognizers import PURE_STEPS

__all__ = ["merge_repeated_steps"]


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
    """Merge nodes applying one pure step to the same arguments; returns how many went.
    The merged copies are erased (they have no readers left)."""
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
