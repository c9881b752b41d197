"""What the pattern-pass test modules share: one compile beside its eager run, and the
questions they ask of the compiled graph's report.

Each pass test module keeps its own ``Run`` record (its inputs and outputs differ by op)
and mixes in :class:`PassReportQueries`; ``compile_beside_eager`` is the one place a test
compiles with the prepfuse backend and records the graph.
"""

from __future__ import annotations

import torch

from prepfuse.backend import PrepfuseBackend


class PassReportQueries:
    """For a run record with ``report`` (the single compiled graph's ``GraphReport``, or
    None for a record built by hand) and a class attribute ``pass_name``."""

    pass_name: str
    report: object

    @property
    def matched(self) -> int:
        """The pass's ``matched_count`` in the graph (0 without a report)."""
        return self.report.matched_counts.get(self.pass_name, 0) if self.report else 0

    def events(self, kind: str) -> list:
        """The pass's rewrites of ``kind``: patterns when matched, (pattern, why) when declined."""
        return [(r.pattern, r.why) if kind == "declined" else r.pattern
                for r in self.report.rewrites if r.pass_name == self.pass_name and r.kind == kind]


def compile_beside_eager(fn, compiled_args: tuple, eager_args: tuple, *, passes, v2: bool):
    """``fn(*compiled_args)`` compiled by the prepfuse backend (only ``passes``, graphs
    recorded, ``auto_functionalized_v2`` as ``v2`` says) and ``fn(*eager_args)`` eagerly:
    (compiled output, eager output, the single graph's report)."""
    backend = PrepfuseBackend({"passes": passes, "record_graphs": True, "auto_functionalized_v2": v2})
    out = torch.compile(fn, backend=backend, fullgraph=True)(*compiled_args)
    ref_out = fn(*eager_args)
    (report,) = backend.reports
    return out, ref_out, report
