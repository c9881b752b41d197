"""Where captured regions end, and who captures: the one object behind ``splitting_ops``
and ``cudagraphs``.

Every decision those two options drive is made here: which values are valid (``full``
takes no splitting ops), which nodes split, the Inductor config a ``piecewise`` compile
needs (``_compat.graph_partition_patches`` holds the version differences) and the config
keys it owns, whether the fused ops' outputs must be graph buffers (cudagraph trees own
every partition's memory), and whether a placement pass runs at all. The backend, the pass
manager and the placement pass read this object; none of them decides on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse._compat import graph_partition_patches
from prepfuse.fx_passes.mutation_info import functionalized_op
from prepfuse.ops import NAMESPACE

CUDAGRAPH_MODES = ("none", "piecewise", "full")
# Inductor settings cudagraphs="piecewise" sets (``_compat.graph_partition_patches``)
PIECEWISE_CONFIG = ("graph_partition", "custom_should_partition_ops", "triton.cudagraphs",
                    "triton.cudagraph_trees", "triton.reorder_for_reducing_graph_partitions",
                    "reorder_for_peak_memory")
# where the fused ops' output buffers live: views of the scratch arena, or graph buffers
OUTPUT_BUFFERS = ("arena", "graph")


def op_of(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The op a node calls, looking through ``auto_functionalized`` wrappers."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target
    return functionalized_op(node)


def is_prep_call(node: torch.fx.Node) -> bool:
    """A ``prepfuse`` call that does work: its op writes an argument (a fused op, in place
    or functional). An op that writes nothing (``prepfuse::scratch``, an arena view) is
    an allocation: the placement pass moves it only along with its consumer."""
    op = op_of(node)
    return (
        op is not None
        and op.namespace == NAMESPACE
        and any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
    )


def op_names(op: torch._ops.OpOverload) -> tuple[str, str]:
    """``("ns::name", "ns::name.overload")``: the spellings Inductor's
    ``custom_should_partition_ops`` accepts for ``op``."""
    packet = op._schema.name
    return packet, f"{packet}.{op._overloadname}"


def normalize_op_name(op, *, option: str = "splitting_ops") -> str:
    """``op`` (an OpOverload, OpOverloadPacket or ``"ns::name[.overload]"``) as the string
    Inductor's ``custom_should_partition_ops`` takes; ValueError naming ``option`` if no
    such op is registered."""
    if isinstance(op, torch._ops.OpOverload):
        return op_names(op)[1]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if not isinstance(op, str) or "::" not in op:
        raise ValueError(f"{option}: expected ops or 'namespace::name[.overload]' strings, got {op!r}")
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        if overload:
            getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise ValueError(f"{option}: no op {op!r} is registered (is the library that defines it imported?)") from None
    return op


@dataclass(frozen=True)
class PlacementPolicy:
    """Where captured regions end: the splitting ops, and who captures (``cudagraphs``).

    ``splitting_ops`` may be given as op objects or ``"ns::name[.overload]"`` strings; they
    are kept as the strings Inductor's ``custom_should_partition_ops`` takes.
    """

    splitting_ops: tuple[str, ...] = ()
    cudagraphs: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.cudagraphs, str) or self.cudagraphs not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraphs: expected one of {', '.join(map(repr, CUDAGRAPH_MODES))}, got {self.cudagraphs!r}")
        ops = self.splitting_ops
        if isinstance(ops, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or not isinstance(ops, (list, tuple)):
            raise ValueError(f"splitting_ops: expected a list of ops, got {ops!r}")
        names = tuple(normalize_op_name(op, option="splitting_ops") for op in ops)
        if len(set(names)) != len(names):
            raise ValueError(f"splitting_ops: an op is named twice in {names}")
        for name in names:  # "ns::op.overload" beside "ns::op", which names every overload already
            packet = name.rsplit(".", 1)[0] if "." in name.split("::", 1)[1] else None
            if packet in names:
                raise ValueError(f"splitting_ops: {name!r} is already covered by {packet!r}")

        if self.cudagraphs == "full" and names:
            raise ValueError(
                "splitting_ops: cudagraphs='full' captures the whole forward, splitting ops included; "
                "use cudagraphs='piecewise' to run them eagerly between captured partitions"
            )
        object.__setattr__(self, "splitting_ops", names)

    @property
    def active(self) -> bool:
        """Whether prepfuse places or checks anything (else it stays out of the way)."""
        return bool(self.splitting_ops) or self.cudagraphs != "none"

    @property
    def moves_prep(self) -> bool:
        """Whether the placement pass runs: only where there are splitting ops to move across."""
        return bool(self.splitting_ops)

    def is_splitting(self, node: torch.fx.Node) -> bool:
        op = op_of(node)
        return op is not None and not set(op_names(op)).isdisjoint(self.splitting_ops)

    def graph_buffers(self, output_buffers: str) -> bool:
        """Whether the fused ops' outputs become graph buffers: asked for (``"graph"``), or
        under ``piecewise``, where cudagraph trees own every partition's buffers."""
        if output_buffers not in OUTPUT_BUFFERS:
            raise ValueError(f"output_buffers: expected one of {', '.join(map(repr, OUTPUT_BUFFERS))}, "
                             f"got {output_buffers!r}")
        return output_buffers == "graph" or self.cudagraphs == "piecewise"

    def owned_config(self) -> tuple[str, ...]:
        """The Inductor config keys this policy sets, which a user's ``inductor_config`` must not."""
        return PIECEWISE_CONFIG if self.cudagraphs == "piecewise" else ()

    def config_patches(self) -> dict:
        """Inductor config for a compile under this policy (piecewise: partition and capture)."""
        return graph_partition_patches(self.splitting_ops) if self.cudagraphs == "piecewise" else {}
