"""Pass tests in a few lines: one compile beside its eager run, and the questions a test
asks of the compiled graph's report (matched count, patterns, declines).

prepfuse's own pass tests use these, and so can an engine team's: compile the model code
with the passes (theirs as the ``PrepfusePass`` class or instance itself, or prepfuse's by
name), then assert numerics against eager, the exact matched count, and the
normalized post-pass graph against a golden file (``prepfuse.testing.golden``)::

    out, ref, report = compile_beside_eager(fn, args, clone(args), passes=(MyPass,), v2=True)
    torch.testing.assert_close(out, ref)
    assert report.matched_counts["my_pass"] == 1
    GoldenFiles.beside(__file__).check(report.graph, "my_pattern")

Each of prepfuse's pass test modules keeps its own run record (inputs and outputs differ
by op) and mixes in :class:`PassReportQueries`.
"""

from __future__ import annotations

import re

import torch

from prepfuse.backend import PrepfuseBackend

__all__ = ["PassReportQueries", "compile_beside_eager", "RECOMPILE_TOKEN_COUNTS", "internal_error_named"]

# Python's exception names: a near miss says what about the user's code stopped a rewrite,
# never which error the pass met (``fx_passes.base.unreadable_step``)
_INTERNAL_ERRORS = re.compile(r"\b(IndexError|TypeError|KeyError|AttributeError|RuntimeError|ValueError|"
                              r"AssertionError|ZeroDivisionError|NotImplementedError)\b")


def internal_error_named(why: str) -> bool:
    """Whether a near miss's text names a Python exception (an internal error shown as a reason)."""
    return _INTERNAL_ERRORS.search(why) is not None

# The token counts a dynamic-shape test runs under ``fail_on_recompile`` after its warm-up:
# every count to 17 (the 0/1 specialisation, small alignments), each side of every power of
# two from 32 to 256 (the CUDA-graph batch sizes) and 300. A guard a pass adds on the count
# (a bound, an equality, a divisibility) fails on one of them.
RECOMPILE_TOKEN_COUNTS = (*range(1, 18), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300)


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
