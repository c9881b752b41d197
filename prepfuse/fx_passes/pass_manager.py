"""Run prepfuse's passes in order over one post-grad graph, and report what they did.

The backend installs one ``PrepfusePassManager`` as Inductor's
``post_grad_custom_post_pass`` for its own compile. Per graph it

1. runs each pass in order (the fusion passes, then ``defunctionalize``),
2. gathers their match logs into a ``GraphReport`` (``report.py``), with the source line
   of each anchor node taken from the graph before the pass rewrote it,
3. optionally writes the graph before and after every pass to ``debug_dir``::

       <debug_dir>/<seq>_<compile id>_g<graph index>/
           00_fuse_dsv4_prep.before.py   00_fuse_dsv4_prep.after.py
           01_defunctionalize.before.py  01_defunctionalize.after.py
           report.txt

4. with ``strict``, fails the compile if an ``auto_functionalized`` call of a prepfuse
   op survived (so a new op the passes do not handle cannot slip through silently),
5. with ``output_buffers="graph"`` or ``cudagraphs="piecewise"``, turns arena views
   into graph buffers (under piecewise, cudagraph trees keep them in their pool;
   ``scratch_buffers.scratch_to_pool_buffers``),
6. with a ``placement`` policy (``splitting_ops`` / ``cudagraphs``), assigns each node of
   the final graph its CUDA-graph partition (``partitions.py``), puts each prepfuse op's
   partition in the report, and fails the compile when a prepfuse op would run outside
   every captured partition or an uncapturable node sits inside one (``placement.py``).

``uuid()`` hashes this module, every pass's own uuid (its source, patterns and settings)
in running order, the placement policy (its settings and the partition rules' source)
and the manager's settings, so Inductor's FX graph cache never serves
code compiled by different passes.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
import os
import re
import sys
from typing import Callable, Sequence

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from prepfuse._compat import current_compile_id
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.graph_print import normalized_graph
from prepfuse.fx_passes.placement import PlacementPolicy, placement_uuid, plan_and_check, raise_on_problems
from prepfuse.fx_passes.matching import MATCHING_MODULES
from prepfuse.fx_passes.matching import engine_writes
from prepfuse.fx_passes.matching.canonical import canonicalize
from prepfuse.fx_passes.matching.op_references import inline as inline_references, references, restore as restore_references
from prepfuse.fx_passes.rewrite.scratch_buffers import returned_scratch, scratch_to_pool_buffers
from prepfuse.fx_passes.report import GraphReport
from prepfuse.ops import NAMESPACE

log = logging.getLogger("prepfuse.passes")
_dump_seq = itertools.count()  # keeps dump folders of one process apart


class PrepfuseStrictError(RuntimeError):
    """``strict`` was set and a prepfuse op is still auto_functionalized after the passes."""


class PrepfusePassManager(CustomGraphPass):
    """Runs ``passes`` in order; ``reports`` holds one ``GraphReport`` per graph it ran on.

    ``settings`` is anything else that changes the compiled code (the backend passes its
    options); it only enters ``uuid()``. ``on_report`` is called with every new report.
    """

    def __init__(
        self,
        passes: Sequence[PrepfusePass],
        *,
        debug_dir: str | os.PathLike | None = None,
        record_graphs: bool = False,
        strict: bool = False,
        settings: tuple = (),
        on_report: Callable[[GraphReport], None] | None = None,
        placement: PlacementPolicy | None = None,
        output_buffers: str = "arena",
    ) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"a pass appears twice in {names}")
        self.passes = tuple(passes)
        self.debug_dir = None if debug_dir is None else os.fspath(debug_dir)
        self.record_graphs = record_graphs
        self.strict = strict
        self.settings = settings
        self.on_report = on_report
        self.placement = placement if placement is not None and placement.active else None
        self.graph_buffers = (placement or PlacementPolicy()).graph_buffers(output_buffers)
        self.reports: list[GraphReport] = []
        self._uuid: str | None = None

    @property
    def pass_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        compile_id = current_compile_id() or "?"
        report = GraphReport(graph_id=f"{compile_id}#{len(self.reports)}", passes=self.pass_names)
        dump_to = self._dump_folder(report.graph_id) if self.debug_dir else None
        inlined = []
        if any(p.canonical_graph for p in self.passes):
            inlined = inline_references(graph)  # engine ops read through their references
            report.note_opaque_ops(graph, engine_writes.is_declared)
            canonicalize(graph)  # one form per concept, before any family
        for i, p in enumerate(self.passes):
            stack_traces = {n.name: n.meta.get("stack_trace") for n in graph.nodes if n.meta.get("stack_trace")}
            if dump_to:
                _write(os.path.join(dump_to, f"{i:02d}_{p.name}.before.py"), _graph_text(graph))
            p(graph)
            report.add_pass(p, stack_traces)
            if dump_to:
                _write(os.path.join(dump_to, f"{i:02d}_{p.name}.after.py"), _graph_text(graph))
        if inlined:  # an engine call back wherever its reference's values are still read
            restore_references(graph, inlined)
        if self.graph_buffers:  # output_buffers="graph", or cudagraph trees' pool (piecewise)
            moved = scratch_to_pool_buffers(graph)
            if moved:
                log.debug("%d scratch views -> graph buffers", moved)
        else:
            _warn_if_returned(graph)
        # prepfuse's namespace first, then the others in the order the passes were given them
        namespaces = dict.fromkeys([NAMESPACE, *(n for p in self.passes for n in getattr(p, "namespaces", ()))])
        report.finish(graph, tuple(namespaces))
        problems: list[str] = []
        if self.placement is not None:
            report.placement, problems = plan_and_check(graph, self.placement)
        if self.record_graphs:
            report.graph = normalized_graph(graph)
        if dump_to:
            _write(os.path.join(dump_to, "report.txt"), report.format(verbose=True) + "\n")
        self.reports.append(report)
        if self.on_report is not None:
            self.on_report(report)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", report.format())
        if self.strict and report.functionalized_left:
            raise PrepfuseStrictError(
                "prepfuse (strict): auto_functionalized calls of prepfuse ops survived the passes: "
                + ", ".join(report.functionalized_left)
                + "\n"
                + report.format(verbose=True)
            )
        if problems:
            raise_on_problems(report.placement, problems, report.format(verbose=True))

    def uuid(self) -> str:
        """The passes' sources and settings, hashed once per manager (fixed when it is made),
        and each pass's ``compile_state()`` as it is now: the backend keys the compile's kept
        report by it and Inductor its cache."""
        if self._uuid is None:
            self._uuid = self._compute_uuid()
        state = [(name, now) for name, now in ((p.name, p.compile_state()) for p in self.passes) if now]
        if references() and any(p.canonical_graph for p in self.passes):
            state.append(("references", references()))
        return self._uuid if not state else hashlib.sha256(f"{self._uuid}{state!r}".encode()).hexdigest()

    def _compute_uuid(self) -> str:
        digest = hashlib.sha256()
        digest.update(inspect.getsource(sys.modules[__name__]).encode())
        for module in MATCHING_MODULES:  # the canonical form the manager makes, and what it reads
            digest.update(inspect.getsource(module).encode())
        for p in self.passes:
            digest.update(f"{p.name}:{p.uuid()};".encode())
        if self.placement is not None:
            digest.update(f"placement:{placement_uuid(self.placement)};".encode())
        if self.graph_buffers:
            digest.update(inspect.getsource(scratch_to_pool_buffers).encode())
        digest.update(repr((self.strict, self.settings, self.graph_buffers)).encode())
        return digest.hexdigest()

    def _dump_folder(self, graph_id: str) -> str:
        name = f"{next(_dump_seq):03d}_" + re.sub(r"[^0-9A-Za-z]+", "_", graph_id).strip("_")
        folder = os.path.join(self.debug_dir, name)
        os.makedirs(folder, exist_ok=True)
        return folder


_warned_returned = False


def _warn_if_returned(graph: torch.fx.Graph) -> None:
    """Once per process: a graph returns a fused op's output buffer, an arena view that the
    next run of any graph taking the same name overwrites (``output_buffers``)."""
    global _warned_returned
    if _warned_returned:
        return
    names = returned_scratch(graph)
    if names:
        _warned_returned = True
        log.warning("prepfuse: this graph returns views of the scratch arena (%s; output_buffers='arena'): the "
                    "next call of any compiled graph fusing the same op overwrites them. Use them before the next "
                    "call, clone them, or compile with options={'output_buffers': 'graph'} (said once per process)",
                    ", ".join(sorted(set(names))))


def _graph_text(graph: torch.fx.Graph) -> str:
    """The graph as Python, falling back to FX's own print where codegen cannot cope."""
    try:
        return graph.python_code(root_module="self").src
    except Exception:  # noqa: BLE001 - a dump must never break a compile
        return str(graph)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
