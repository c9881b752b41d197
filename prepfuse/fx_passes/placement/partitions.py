"""Which CUDA-graph partition each node of a post-grad graph lands in.

With ``cudagraphs="piecewise"`` Inductor's graph partition cuts the graph at every
*splitting op* (``custom_should_partition_ops``: an attention op that must run eagerly)
and captures each stretch between them with cudagraph trees as one partition; the
generated code calls them ``partition_0``, ``partition_1`` ... in graph order, and runs
the splitting ops in between. With ``"full"`` the engine captures the whole forward
itself: one captured region, no cut. This module computes that assignment from the FX
graph the passes leave, for the report and the placement check::

    graph order           kind       partition
    mm                    captured   0
    dsv4_qnorm_rope_...   captured   0
    attention             eager      -   (splitting op)
    add                   captured   1

Nodes that launch no kernel (views, ``getitem``, size arithmetic) take no partition of
their own. The assignment is the *intended* one: a cudagraph-unsafe node (``.item()``, a
CPU scalar, see ``cudagraph_safety``) is listed in the partition it sits in, with its
reason; Inductor would cut the partition there and run it eagerly, which the placement
check refuses. With no such node, the assignment is exactly Inductor's: prepfuse turns
off the scheduler reorders that could move nodes across a splitting op
(``_compat.graph_partition_patches``), so partitions follow the graph order the
placement pass chose (checked against Inductor's generated code on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from prepfuse._compat import static_input_indices
from prepfuse.fx_passes.placement.buffer_access import storages
from prepfuse.fx_passes.placement.cudagraph_safety import capture_device, input_mutation_reason, launches_work, unsafe_reason
from prepfuse.fx_passes.graph_print import short_source, target_name
from prepfuse.fx_passes.placement.policy import PlacementPolicy, is_prep_call, op_of

@dataclass(frozen=True)
class NodePlacement:
    """One node that launches work: its captured partition index, or why it runs eagerly."""

    node: str
    target: str
    partition: int | None  # index of the captured partition (Inductor's partition_<i>)
    splitting: bool = False  # a splitting op: runs between partitions, by design
    unsafe: str = ""  # why a CUDA graph cannot hold it ("" when it can)
    source: str = ""  # model line, from the node's stack trace


@dataclass
class PartitionPlan:
    """Every work-launching node of one graph, in graph order, with its partition."""

    policy: PlacementPolicy
    device: str
    nodes: list[NodePlacement] = field(default_factory=list)
    prepfuse_nodes: list[str] = field(default_factory=list)  # names of the prepfuse calls

    @property
    def num_captured(self) -> int:
        return 1 + max((p.partition for p in self.nodes if p.partition is not None), default=-1)

    def of(self, name: str) -> NodePlacement:
        found = {p.node: p for p in self.nodes}.get(name)
        if found is None:
            raise KeyError(f"no work-launching node named {name!r} in the plan")
        return found

    def prepfuse_placements(self) -> list[NodePlacement]:
        by_name = {p.node: p for p in self.nodes}
        return [by_name[name] for name in self.prepfuse_nodes]

    def layout(self) -> str:
        """``captured 0 | eager attention | captured 1``: the partitions in order."""
        parts: list[str] = []
        kind = "partition" if self.policy.cudagraphs == "none" else "captured"
        for p in self.nodes:
            label = f"eager {p.target}" if p.partition is None else f"{kind} {p.partition}"
            if not parts or parts[-1] != label or p.partition is None:
                parts.append(label)
        return " | ".join(parts) or "(no kernels)"


def static_placeholders(graph: torch.fx.Graph) -> frozenset[str] | None:
    """Names of the graph's static inputs, from AOTAutograd's metadata; None when unknown
    (outside a compile, or a graph whose inputs are not the forward's, e.g. a backward)."""
    found = static_input_indices()
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if found is None or found[1] != len(placeholders):
        return None
    return frozenset(placeholders[i] for i in found[0] if i < len(placeholders))


def _input_label(placeholder: torch.fx.Node) -> str:
    """``arg6_1 (uint8[5, 9792])``: enough to tell which of the caller's tensors it is."""
    val = placeholder.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return placeholder.name
    return f"{placeholder.name} ({str(val.dtype).replace('torch.', '')}{list(val.shape)})"


def plan_partitions(
    graph: torch.fx.Graph, policy: PlacementPolicy, static_inputs: frozenset[str] | None = None
) -> PartitionPlan:
    """Assign every node that launches work to its captured partition (see module doc).

    ``"piecewise"`` and ``"none"``: a splitting op ends the current partition and runs
    eagerly; ``"full"``: one region, partition 0 (splitting ops, if any, are captured too).
    With ``"piecewise"`` and ``static_inputs`` known (placeholder names), a write into any
    other graph input is uncapturable too: cudagraph trees skip such partitions.
    """
    non_static: dict = {}
    if policy.cudagraphs == "piecewise" and static_inputs is not None:
        for n in graph.nodes:
            if n.op == "placeholder" and n.name not in static_inputs:
                non_static.update(dict.fromkeys(storages(n), _input_label(n)))
    device = capture_device(graph)
    plan = PartitionPlan(policy=policy, device=str(device))
    cuts = policy.cudagraphs != "full"
    current, open_partition = 0, False
    for node in graph.nodes:
        if not launches_work(node):
            continue
        splitting = cuts and policy.is_splitting(node)
        if splitting:
            partition = None
            if open_partition:
                current, open_partition = current + 1, False
        else:
            partition, open_partition = current, True
        name = target_name(op_of(node) or node.target)
        plan.nodes.append(NodePlacement(
            node=node.name,
            target=name,
            partition=partition,
            splitting=splitting,
            unsafe="" if splitting else (
                unsafe_reason(node, device) or input_mutation_reason(node, non_static) or ""),
            source=short_source(node.meta.get("stack_trace")),
        ))
        if is_prep_call(node):  # fused calls; an arena view (prepfuse::scratch) is no work
            plan.prepfuse_nodes.append(node.name)
    return plan
