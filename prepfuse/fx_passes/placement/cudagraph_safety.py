"""Which post-grad nodes launch work, and which of those a CUDA graph cannot hold.

A CUDA graph replays recorded device work; it cannot replay anything the host does
between launches. Inductor's graph partition (``Scheduler.should_partition``) therefore
cuts the graph around nodes that read a device value on the host (``.item()``), run on
or read from another device (CPU tensors, CPU scalars folded into a kernel's launch
arguments), have data-dependent output sizes, copy between devices, or that torch lists
or tags as capture-unsafe. This module mirrors those rules on the FX graph, before
Inductor sees it, so prepfuse can say which partition each node lands in and refuse a
graph that would silently leave work eager.

A node that launches no kernel (placeholders, ``getitem``, views, size arithmetic,
shape assertions) is *neutral*: Inductor folds it into the wrapper or into its
neighbours, so it neither starts nor ends a partition.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from prepfuse._compat import cudagraph_forbidden_ops, cudagraph_unsafe_tag
from prepfuse.fx_passes.placement.buffer_access import node_tensors, written_storages
from prepfuse.fx_passes.graph_print import target_name

aten = torch.ops.aten
HOST_SYNC_OPS = (aten._local_scalar_dense.default,)
# Size bookkeeping and shape assertions: evaluated on the host from sizes it already
# knows (no device read), emitted as wrapper code rather than kernels.
HOST_ONLY_OPS = frozenset({
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
})
DEVICE_COPY_OPS = frozenset({aten._to_copy.default, aten.copy_.default, aten.copy.default})
BOOL_INDEX_OPS = frozenset({aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default})


def launches_work(node: torch.fx.Node) -> bool:
    """Whether ``node`` becomes device work (a kernel, an extern call), not wrapper code."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return not (target.is_view or target in HOST_ONLY_OPS)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    # Python callables (operator.mul on SymInts, torch.sym_max ...) are host arithmetic
    # unless they produce a tensor.
    return bool(node_tensors(node))


def capture_device(graph: torch.fx.Graph) -> torch.device:
    """The device CUDA graphs would capture: the first non-CPU device a node produces on,
    else the CPU (so the rules can be exercised by CPU-only tests, CPU standing in)."""
    for node in graph.nodes:
        for t in node_tensors(node):
            if t.device.type not in ("cpu", "meta"):
                return t.device
    return torch.device("cpu")


def _input_tensors(node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    return [(arg, t) for arg in node.all_input_nodes for t in node_tensors(arg)]


def unsafe_reason(node: torch.fx.Node, device: torch.device) -> str | None:
    """Why ``node`` cannot be captured in a CUDA graph on ``device``; None when it can.

    Only nodes that launch work are judged; a neutral node is never unsafe.
    """
    if not launches_work(node):
        return None
    target = node.target
    if target in HOST_SYNC_OPS:
        return "host sync: .item() copies a device value to the host on every call"
    if isinstance(target, torch._ops.OpOverload):
        forbidden = cudagraph_forbidden_ops()
        if str(target) in forbidden or str(target.overloadpacket) in forbidden:
            return f"{target_name(target)} is on Inductor's list of ops CUDA graphs cannot hold"
        tag = cudagraph_unsafe_tag()
        if tag is not None and tag in target.tags:
            return f"{target_name(target)} is tagged cudagraph_unsafe"
        if target in BOOL_INDEX_OPS and _has_bool_index(node):
            return "boolean-mask indexing: the number of selected rows is read on the host (nonzero)"
    if node.meta.get("unbacked_bindings"):
        return "data-dependent output size: the host must read a device value to learn it"
    return _device_reason(node, device)


def _has_bool_index(node: torch.fx.Node) -> bool:
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
    for index in indices or ():
        if isinstance(index, torch.fx.Node):
            for t in node_tensors(index):
                if t.dtype in (torch.bool, torch.uint8):
                    return True
    return False


def _device_reason(node: torch.fx.Node, device: torch.device) -> str | None:
    outputs = node_tensors(node)
    inputs = _input_tensors(node)
    off_device_out = [t for t in outputs if t.device != device and t.device.type != "meta"]
    off_device_in = [(arg, t) for arg, t in inputs if t.device != device and t.device.type != "meta"]
    if node.target in DEVICE_COPY_OPS and (off_device_out or off_device_in):
        devices = sorted({str(t.device) for t in outputs} | {str(t.device) for _, t in inputs})
        return f"device copy between {' and '.join(devices)}"
    if off_device_out:
        return f"runs on {off_device_out[0].device}, not on the captured device {device}"
    for arg, t in off_device_in:
        if t.dim() == 0:
            return (
                f"reads {arg.name}, a {t.device} scalar tensor: its value is read on the host at "
                f"launch and would be frozen into the graph"
            )
        return f"reads {arg.name}, a tensor on {t.device}, not on the captured device {device}"
    return None


def input_mutation_reason(node: torch.fx.Node, non_static_inputs: dict) -> str | None:
    """Why cudagraph trees would not capture ``node``'s partition: it writes a graph input
    that is not static (``non_static_inputs``: storage -> placeholder name).

    A captured graph writes fixed addresses; cudagraph trees copy a non-static input into
    the graph's own buffer on every replay, so a write into it would not reach the
    caller's tensor, and they skip the partition instead ("mutated inputs").
    """
    for storage in written_storages(node):
        if storage in non_static_inputs:
            return (
                f"writes graph input {non_static_inputs[storage]} in place, and it is not static: cudagraph trees skip "
                f"a partition that mutates a non-static input (make it a module buffer or call "
                f"torch._dynamo.mark_static_address on it)"
            )
    return None
