"""Which buffers a post-grad node reads and writes, by the storage of its fake values.

Reordering a graph and judging it for CUDA-graph capture both need more than data edges:
an in-place op (a KV cache insert) writes a buffer that an earlier node may read without
any edge between them, and a write into a graph input matters to cudagraph trees. What a
node writes comes from its op's schema (``Tensor(a!)`` arguments) or, for an
``auto_functionalized`` call, from the buffers its in-place form would write
(``mutation_info``); buffers are told apart by the storage of each node's fake value
(``meta['val']``), which every view of a buffer shares.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from prepfuse.fx_passes.mutation_info import functionalized_op, mutated_inputs


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def node_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """The fake tensors ``node`` produces (``meta['val']``)."""
    return _tensors(node.meta.get("val"))


def storages(node) -> set[StorageWeakRef]:
    """The storages of ``node``'s fake values (none for non-nodes and non-tensors)."""
    found = set()
    if isinstance(node, torch.fx.Node):
        for t in node_tensors(node):
            if torch._C._has_storage(t):
                found.add(StorageWeakRef(t.untyped_storage()))
    return found


def written_storages(node: torch.fx.Node) -> set[StorageWeakRef]:
    """The buffers ``node`` writes in place: its schema's ``(a!)`` arguments, or, for an
    ``auto_functionalized`` call, those the in-place op would write."""
    written: set[StorageWeakRef] = set()
    if node.op != "call_function":
        return written
    if functionalized_op(node) is not None:
        for target in mutated_inputs(node).values():
            written |= storages(target)
    elif isinstance(node.target, torch._ops.OpOverload):
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written |= storages(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return written


def read_storages(node: torch.fx.Node) -> set[StorageWeakRef]:
    """The buffers ``node`` reads: those of every input node."""
    found: set[StorageWeakRef] = set()
    for arg in node.all_input_nodes:
        found |= storages(arg)
    return found
