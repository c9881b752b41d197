"""CUDA-graph placement: where each fused op runs relative to the captured regions.

Stages, in the order the pass manager uses them:

- ``policy.py``: ``PlacementPolicy``, the one object behind the ``splitting_ops`` and
  ``cudagraphs`` options (validation, Inductor config, buffer ownership);
- ``hoist.py``: ``PlacementPass``, which moves prepfuse calls ahead of splitting ops they do
  not depend on, and ``check_placement``;
- ``partitions.py``: which captured partition each node of the final graph lands in;
- ``cudagraph_safety.py`` / ``buffer_access.py``: what a CUDA graph cannot hold, and which
  buffers a node reads and writes.

``plan_and_check`` is what the pass manager calls on the final graph; ``placement_uuid``
hashes the policy and every rule's source for Inductor's cache.
"""

from __future__ import annotations

import hashlib
import inspect

import torch.fx

from prepfuse.fx_passes.placement import buffer_access, cudagraph_safety, hoist, partitions, policy
from prepfuse.fx_passes.placement.hoist import PlacementError, PlacementPass, check_placement, raise_on_problems
from prepfuse.fx_passes.placement.partitions import PartitionPlan, plan_partitions, static_placeholders
from prepfuse.fx_passes.placement.policy import CUDAGRAPH_MODES, OUTPUT_BUFFERS, PlacementPolicy

__all__ = [
    "CUDAGRAPH_MODES", "OUTPUT_BUFFERS", "PartitionPlan", "PlacementError", "PlacementPass", "PlacementPolicy",
    "plan_and_check", "placement_uuid", "raise_on_problems",
]


def plan_and_check(graph: torch.fx.Graph, placement: PlacementPolicy) -> tuple[PartitionPlan, list[str]]:
    """The partition of every work-launching node of the final ``graph``, and what would
    defeat capture there (one line per node; [] when nothing)."""
    plan = plan_partitions(graph, placement, static_placeholders(graph))
    return plan, check_placement(plan)


def placement_uuid(placement: PlacementPolicy) -> str:
    """The policy's settings and the source of every placement rule: a changed rule is a
    changed compile."""
    digest = hashlib.sha256(repr((placement.splitting_ops, placement.cudagraphs)).encode())
    for module in (policy, partitions, cudagraph_safety, buffer_access, hoist):
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()
