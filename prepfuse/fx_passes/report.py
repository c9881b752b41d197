"""What the passes did to one compiled graph: which pattern matched how often and where.

The pass manager fills one ``GraphReport`` per post-grad graph (an inference graph, or a
forward and a backward graph under autograd) from the passes' logs; the backend keeps
them (``prepfuse.backend.reports()``, ``last_reports()``, or ``PrepfuseBackend.reports``)::

    compiled = torch.compile(model, backend="prepfuse")
    compiled(*inputs)
    print(prepfuse.backend.last_reports().format())

``format()`` prints a table of matches with their anchor node and, where the graph
recorded one, the line of model code it came from; near misses (candidates a pass
declined, with why) are added with ``verbose=True`` or when the ``prepfuse`` logger is at
DEBUG. A graph served from Inductor's cache ran no pass: it carries the report of the compile
that wrote the cached code (``report_store``) and says so (``cached``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch.fx

from prepfuse.fx_passes.base import PassEvent, PrepfusePass
from prepfuse.fx_passes.graph_print import short_source, target_name
from prepfuse.fx_passes.mutation_info import functionalized_op
from prepfuse.fx_passes.placement.partitions import PartitionPlan
from prepfuse.ops import NAMESPACE

log = logging.getLogger("prepfuse.report")


@dataclass(frozen=True)
class Rewrite:
    """One matched rewrite or one near miss, with where it happened."""

    pass_name: str
    kind: str  # "matched" | "declined"
    pattern: str
    anchor: str  # name of the anchor node in the post-grad graph
    node: str  # the anchor node as FX prints it
    source: str = ""  # "model.py:42  q = self.norm(q)", from the node's stack trace
    why: str = ""  # near misses: why declined; matches: how the rewrite was checked ("validated on 2 probes")


def _anchor_name(where: str) -> str:
    # PassEvent.where is Node.format_node(): "%name : [num_users=..] = call_function[...]"
    return where[1:].split(" ", 1)[0] if where.startswith("%") else where


@dataclass
class GraphReport:
    """The passes' work on one post-grad graph."""

    graph_id: str  # "<dynamo compile id>#<graph index>", e.g. "0/0#0"
    passes: tuple[str, ...]
    matched_counts: dict[str, int] = field(default_factory=dict)  # pass name -> rewrites
    rewrites: list[Rewrite] = field(default_factory=list)
    ops_after: dict[str, int] = field(default_factory=dict)  # prepfuse op -> calls left in the graph
    functionalized_left: list[str] = field(default_factory=list)  # auto_functionalized calls left (of ``namespaces``)
    namespaces: tuple[str, ...] = (NAMESPACE,)  # what defunctionalize took: prepfuse's, then those it was given
    cached: bool = False  # served from Inductor's cache: no pass ran; what follows is the report of the compile
    # that wrote the cached code (``report_store``), if one was kept
    opaque_ops: dict[str, int] = field(default_factory=dict)  # ops of other namespaces the families read as one step
    graph: str | None = None  # normalized post-pass graph, when the backend records graphs
    placement: PartitionPlan | None = None  # partitions, when splitting_ops or cudagraphs are set

    # -- filling ------------------------------------------------------------------
    def add_pass(self, p: PrepfusePass, stack_traces: dict[str, str]) -> None:
        self.matched_counts[p.name] = self.matched_counts.get(p.name, 0) + p.matched_count
        for event in p.log.events:
            self.rewrites.append(_rewrite_from_event(event, stack_traces))

    def note_opaque_ops(self, graph: torch.fx.Graph, readable: Callable[[torch._ops.OpOverload], bool]) -> None:
        """Count the calls (or ``auto_functionalized`` calls) of ops outside aten, prims and
        prepfuse that ``readable`` says no family reads: a model's engine ops, each one step
        whose inside the passes cannot see (why a layer built from them may not fuse)."""
        ops: Counter[str] = Counter()
        for node in graph.nodes:
            op = functionalized_op(node) or (node.target if isinstance(node.target, torch._ops.OpOverload) else None)
            if op is not None and op.namespace not in ("aten", "prims", NAMESPACE) and not readable(op):
                ops[target_name(op)] += 1
        self.opaque_ops = dict(ops)

    def finish(self, graph: torch.fx.Graph, namespaces: tuple[str, ...] = (NAMESPACE,)) -> None:
        """Count what is left: the prepfuse ops called, and the ``auto_functionalized`` calls of
        ops in ``namespaces`` (prepfuse's, and those defunctionalize was given) still functional."""
        self.namespaces = tuple(namespaces)
        ops: Counter[str] = Counter()
        for node in graph.nodes:
            op = functionalized_op(node)
            if op is not None and op.namespace in namespaces:
                self.functionalized_left.append(f"{node.name} ({op})")
            elif isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == NAMESPACE:
                ops[target_name(node.target)] += 1
        self.ops_after = dict(ops)

    # -- reading ------------------------------------------------------------------
    def partition_of(self) -> dict[str, int | None]:
        """prepfuse call (node name) -> its captured partition index (None: runs eagerly)."""
        if self.placement is None:
            return {}
        return {p.node: p.partition for p in self.placement.prepfuse_placements()}

    def _of(self, kind: str, pattern: str | None) -> list[Rewrite]:
        return [r for r in self.rewrites if r.kind == kind and pattern in (None, r.pattern, r.pass_name)]

    def matches(self, pattern: str | None = None) -> list[Rewrite]:
        """Matched rewrites, all or those of one pattern (or one pass, by its name)."""
        return self._of("matched", pattern)

    def near_misses(self, pattern: str | None = None) -> list[Rewrite]:
        """Declined candidates, all or those of one pattern (or one pass, by its name)."""
        return self._of("declined", pattern)

    def count(self, pattern: str) -> int:
        """How often ``pattern`` (or every pattern of the pass of that name) matched."""
        return len(self.matches(pattern))

    def pattern_counts(self) -> dict[str, int]:
        return dict(Counter(r.pattern for r in self.matches()))

    def format(self, verbose: bool | None = None) -> str:
        if verbose is None:
            verbose = logging.getLogger("prepfuse").isEnabledFor(logging.DEBUG)
        head = f"prepfuse graph {self.graph_id}: passes {', '.join(self.passes) or '(none)'}"
        if self.cached and not self.matched_counts:
            return head + ("\n  served from Inductor's cache, and no report of the compile that wrote it was kept: "
                           "compile with options={'inductor_config': {'fx_graph_cache': False}} to run the passes")
        lines = [head + (" (served from Inductor's cache: the report of the compile that wrote it)"
                         if self.cached else "")]
        rows = [("pass", "pattern", "matched")]
        rows += [(p, pat, str(n)) for (p, pat), n in Counter((r.pass_name, r.pattern) for r in self.matches()).items()]
        for name in self.passes:
            if not any(r.pass_name == name for r in self.matches()):
                rows.append((name, "-", str(self.matched_counts.get(name, 0))))
        lines += _table(rows)
        if self.matches():
            lines.append("  where:")
            lines += _table([("pass", "pattern", "anchor", "checked", "source")] + [
                (r.pass_name, r.pattern, r.anchor, r.why or "-", r.source or "-") for r in self.matches()
            ], indent=4)
        misses = self.near_misses()
        if verbose and misses:
            lines.append(f"  near misses ({len(misses)}):")
            lines += _table([("pass", "pattern", "anchor", "why")] + [
                (r.pass_name, r.pattern, r.anchor, r.why) for r in misses
            ], indent=4)
        elif misses:
            lines.append(f"  near misses: {len(misses)} (format(verbose=True) or DEBUG logging lists them)")
        if self.opaque_ops:
            opaque = ", ".join(f"{op} x{n}" for op, n in sorted(self.opaque_ops.items()))
            lines.append(f"  engine ops read as one opaque step: {opaque} (a reference makes one readable: "
                         "docs/kit.md, engine ops read through a reference)")
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(self.ops_after.items())) or "none"
        lines.append(f"  prepfuse ops in the compiled graph: {ops}")
        lines.append(f"  auto_functionalized {_spoken_list(self.namespaces)} calls left: "
                     f"{', '.join(self.functionalized_left) or 'none'}")
        if self.placement is not None:
            lines += _placement_lines(self.placement)
        return "\n".join(lines)


class Reports(Sequence[GraphReport]):
    """The reports of several graphs, with totals; what the backend hands out."""

    def __init__(self, reports: Sequence[GraphReport] = ()) -> None:
        self._reports = list(reports)

    def __getitem__(self, i):
        return self._reports[i]

    def __len__(self) -> int:
        return len(self._reports)

    def __iter__(self) -> Iterator[GraphReport]:
        return iter(self._reports)

    def __repr__(self) -> str:
        return f"Reports({len(self)} graphs, {self.pattern_counts()})"

    def matches(self, pattern: str | None = None) -> list[Rewrite]:
        return [r for rep in self for r in rep.matches(pattern)]

    def near_misses(self, pattern: str | None = None) -> list[Rewrite]:
        return [r for rep in self for r in rep.near_misses(pattern)]

    def count(self, pattern: str) -> int:
        return sum(rep.count(pattern) for rep in self)

    def pattern_counts(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for rep in self:
            total.update(rep.pattern_counts())
        return dict(total)

    def format(self, verbose: bool | None = None) -> str:
        if not self._reports:
            return "prepfuse: no graph compiled"
        return "\n".join(rep.format(verbose) for rep in self)


def _placement_lines(plan: PartitionPlan) -> list[str]:
    policy = plan.policy
    split = ", ".join(policy.splitting_ops) or "none"
    lines = [f"  cudagraphs={policy.cudagraphs}, splitting ops: {split}; partitions: {plan.layout()}"]
    rows = [("prepfuse op", "node", "partition")]
    for p in plan.prepfuse_placements():
        where = "eager" if p.partition is None else f"captured {p.partition}"
        if policy.cudagraphs == "none" and p.partition is not None:
            where = f"{p.partition} (not captured: cudagraphs='none')"
        rows.append((p.target, p.node, where))
    if len(rows) > 1:
        lines += _table(rows, indent=4)
    return lines


def _rewrite_from_event(event: PassEvent, stack_traces: dict[str, str]) -> Rewrite:
    anchor = _anchor_name(event.where)
    return Rewrite(
        pass_name=event.pass_name,
        kind=event.kind,
        pattern=event.pattern,
        anchor=anchor,
        node=event.where,
        source=short_source(stack_traces.get(anchor)),
        why=event.why,
    )


def _spoken_list(words: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, (", ".join(words[:-1]), words[-1]))) if words else "no"


def _table(rows: list[tuple[str, ...]], indent: int = 2) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [" " * indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
