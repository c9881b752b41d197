"""Move preparation ahead of splitting ops, into the captured partition; check the result.

A splitting op (an attention op that runs eagerly between CUDA graphs) cuts the graph into
captured partitions. Preparation a model writes *after* such an op without reading its
output -- a KV insert or the next stage's q preparation -- would otherwise land in the
next partition, or, where an engine splits the graph itself, outside the captured region
(docs/design.md, lesson 5: moving preparation out of the eager break into the captured
region was worth measured TTFT). ``PlacementPass`` moves every ``prepfuse`` call (any op
of the namespace: fused ops, a scratch allocation with its consumer) and the nodes it
needs to just before the first splitting op it does not depend on::

    before                                   after
    a = mm(x, w)                             a = mm(x, w)
    o = attention(a, ...)    # splitting     q_out = empty(...)        # moved
    q_out = empty(...)                       af = dsv4_prep(q, ..., q_out, k_cache)   # moved
    af = dsv4_prep(q, ..., q_out, k_cache)   o = attention(a, ...)     # splitting
    y = o + 1                                y = o + 1

A node never moves ahead of a splitting op it depends on: through data (it reads the
op's output, directly or not), or through a buffer (it writes a buffer, e.g. the KV
cache, that the splitting op or another node it would jump reads or writes; it reads a
buffer such a node writes). It runs on the functional graph, before ``defunctionalize``,
so the buffers an ``auto_functionalized`` call writes come from its schema
(``mutation_info``) and everything else is explicit data flow.

``check_placement`` then reads the final graph's partitions (``partitions.py``) and fails
the compile, naming each node and why, when a ``prepfuse`` op would run outside every
captured partition, or (``"piecewise"``, ``"full"``) when a node a CUDA graph cannot hold
(``.item()``, a CPU scalar, a data-dependent size, a device copy) sits in a captured
region: Inductor would quietly cut the partition there, or cudagraph trees would skip it.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from prepfuse.fx_passes import mutation_info
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.graph_print import target_name
from prepfuse.fx_passes.mutation_info import functionalized_op
from prepfuse.fx_passes.placement import buffer_access, cudagraph_safety, partitions, policy
from prepfuse.fx_passes.placement.buffer_access import read_storages, written_storages
from prepfuse.fx_passes.placement.partitions import PartitionPlan
from prepfuse.fx_passes.placement.policy import PlacementPolicy, is_prep_call

log = logging.getLogger("prepfuse.passes")


class PlacementError(RuntimeError):
    """A prepfuse op outside every captured partition, or an uncapturable node inside one."""


class PlacementPass(PrepfusePass):
    """Moves prepfuse calls (and what they need) ahead of splitting ops they do not depend on.

    ``matched_count`` is the number of prepfuse calls moved; a prepfuse call left after a
    splitting op is logged as declined with the dependency that holds it there.
    """

    name = "placement"
    uuid_sources = (policy, partitions, cudagraph_safety, buffer_access, mutation_info)

    def __init__(self, policy: PlacementPolicy | None = None) -> None:
        super().__init__()
        self.policy = policy or PlacementPolicy()

    def settings(self) -> tuple:
        return (self.policy.splitting_ops, self.policy.cudagraphs)

    def run(self, graph: torch.fx.Graph) -> int:
        nodes = list(graph.nodes)
        splits = [n for n in nodes if self.policy.is_splitting(n)]
        if not splits:
            log.debug("placement: no splitting op (%s) in this graph; nothing to move", ", ".join(self.policy.splitting_ops))
            return 0
        split_index = {s: i for i, s in enumerate(splits)}
        segment: dict[torch.fx.Node, int] = {}  # node -> how many splitting ops precede it
        k = 0
        for n in nodes:
            if n in split_index:
                k += 1
            else:
                segment[n] = k
        needed = _ancestors([n for n in nodes if is_prep_call(n) and segment.get(n, 0) > 0])

        access = _BufferAccess(nodes)
        # bound[n]: the earliest segment n may run in, and the dependency that sets it
        bound: dict[torch.fx.Node, tuple[int, str]] = {}
        for n in nodes:
            if n in needed and n.op == "call_function" and n not in split_index:
                bound[n] = self._bound(n, access, split_index, segment, bound)

        # Each prep call that can go earlier goes to its bound; what it needs goes with it,
        # as late as its consumers allow (a scratch allocation stays next to its user).
        target: dict[torch.fx.Node, int] = {}
        for n in reversed(nodes):
            if n not in bound:
                continue
            if is_prep_call(n) and bound[n][0] < segment[n]:
                target[n] = bound[n][0]
            later = [target[u] for u in n.users if u in target]
            if later:
                target[n] = min(target.get(n, segment[n]), *later)
        moved = 0
        for n in nodes:
            if n in target and target[n] < segment[n]:
                splits[target[n]].prepend(n)
                if is_prep_call(n):
                    moved += 1
                    self.log.matched(self.name, f"ahead of {_op_name(splits[target[n]])}", n)
            elif is_prep_call(n) and n in bound and segment[n] > 0:
                self.log.declined(self.name, f"after {_op_name(splits[segment[n] - 1])}", n, f"it {bound[n][1]}")
        return moved

    @staticmethod
    def _bound(n, access, split_index, segment, bound) -> tuple[int, str]:
        """The earliest segment ``n`` can run in (segment i: after i splitting ops), and why."""
        lowest, cause = 0, ""
        preds = [(p, "reads the output of") for p in n.all_input_nodes] + access.hazards_before(n)
        for p, how in preds:
            if p in split_index:
                here = (split_index[p] + 1, f"{how} splitting op {p.name}")
            elif p in bound and p in n.all_input_nodes:  # an input moves along with n
                here = bound[p]
            else:  # a buffer hazard: p stays where it is
                here = (segment[p], f"{how} {p.name}")
            if here[0] > lowest:
                lowest, cause = here
        return lowest, cause


class _BufferAccess:
    """Who reads and who writes each buffer, in graph order, to find the earlier nodes a
    node may not jump without a data edge saying so."""

    def __init__(self, nodes: list[torch.fx.Node]) -> None:
        self.position = {n: i for i, n in enumerate(nodes)}
        self.reads: dict[torch.fx.Node, set] = {}
        self.writes: dict[torch.fx.Node, set] = {}
        self.readers: dict[object, list[torch.fx.Node]] = {}
        self.writers: dict[object, list[torch.fx.Node]] = {}
        for n in nodes:
            if n.op != "call_function":
                continue
            self.reads[n], self.writes[n] = read_storages(n), written_storages(n)
            for storage in self.reads[n]:
                self.readers.setdefault(storage, []).append(n)
            for storage in self.writes[n]:
                self.writers.setdefault(storage, []).append(n)

    def hazards_before(self, n: torch.fx.Node) -> list[tuple[torch.fx.Node, str]]:
        """Earlier nodes that read or write a buffer ``n`` writes, or write one it reads."""
        here = self.position[n]
        found: dict[torch.fx.Node, str] = {}
        for storage in self.writes.get(n, ()):
            for p in self.readers.get(storage, []) + self.writers.get(storage, []):
                if self.position[p] < here:
                    found.setdefault(p, "writes a buffer read or written earlier by")
        for storage in self.reads.get(n, ()):
            for p in self.writers.get(storage, []):
                if self.position[p] < here:
                    found.setdefault(p, "reads a buffer written by")
        return sorted(found.items(), key=lambda item: self.position[item[0]])


def _op_name(node: torch.fx.Node) -> str:
    return target_name(functionalized_op(node) or node.target)


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def check_placement(plan: PartitionPlan) -> list[str]:
    """What would defeat capture in ``plan``'s graph, one line per node ([] when nothing)."""
    mode = plan.policy.cudagraphs
    if mode == "none":
        return []
    problems = []
    for p in plan.nodes:
        where = f"{p.node} ({p.target}{', ' + p.source if p.source else ''})"
        if p.unsafe:
            region = "the captured forward" if mode == "full" else f"captured partition {p.partition}"
            problems.append(f"{where} is in {region} but a CUDA graph cannot hold it: {p.unsafe}")
        if p.node in plan.prepfuse_nodes and p.partition is None:
            problems.append(
                f"fused op {where} lands outside every captured partition: it is one of splitting_ops "
                f"({', '.join(plan.policy.splitting_ops)}), which run eagerly"
            )
    return problems


def raise_on_problems(plan: PartitionPlan, problems: list[str], report_text: str) -> None:
    if problems:
        raise PlacementError(
            f"prepfuse (cudagraphs={plan.policy.cudagraphs!r}): the graph cannot be captured as placed:\n  "
            + "\n  ".join(problems)
            + f"\npartitions: {plan.layout()}\n"
            + report_text
        )
