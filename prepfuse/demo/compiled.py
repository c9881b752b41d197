"""What every example-model section of the demo does: compile with ``backend="prepfuse"``
(a fresh compile, so the passes run and report), show the report (``--verbose``), and on a
GPU time the compiled code beside ``torch.compile``'s default backend."""

from __future__ import annotations

from typing import Callable

import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.testing import graph_replay_us


def compile_with_prepfuse(fn, **options) -> tuple[Callable, PrepfuseBackend]:
    """``fn`` compiled with ``backend="prepfuse"`` and ``options``, and the backend holding
    its reports.

    Inductor's FX graph cache would serve a graph compiled by an earlier run without running
    the passes, and so without a report: the demo asks for a fresh compile."""
    torch._dynamo.reset()
    backend = PrepfuseBackend({"inductor_config": {"fx_graph_cache": False}, **options})
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def show_report(backend: PrepfuseBackend, matched: int, expected: int) -> None:
    print(backend.reports.format())
    print(f"prep sequences fused: {matched} of {expected} ({100 * matched / expected:.0f}%)")


def time_beside_default(fn, compiled: Callable, args_prepfuse: tuple, args_default: tuple) -> str:
    """CUDA-graph replay medians of ``compiled(*args_prepfuse)`` and of ``fn`` under
    ``torch.compile``'s default backend (own buffers: ``args_default``); a baseline that
    does not compile is reported, not fatal."""
    us_prepfuse = graph_replay_us(lambda: compiled(*args_prepfuse))
    torch._dynamo.reset()
    try:
        default = torch.compile(fn, fullgraph=True)
        baseline = f"torch.compile default {graph_replay_us(lambda: default(*args_default)):.1f} us"
    except Exception as err:  # noqa: BLE001 - a baseline that does not compile is reported, not fatal
        baseline = f"torch.compile default failed to compile: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return f"prepfuse {us_prepfuse:.1f} us, {baseline}"
