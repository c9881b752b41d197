"""Quick GPU timing for the demo (``bench/harness.py`` has the benchmarks' full method)."""

from __future__ import annotations

import torch

__all__ = ["graph_replay_us"]


def graph_replay_us(fn, warmup: int = 3, iters: int = 50, calls: int = 20) -> float:
    """Median microseconds of one ``fn()``, from a CUDA graph of ``calls`` back-to-back
    calls replayed ``iters`` times (the demo's quick timing, warm L2; ``bench/`` has the
    full method: cold L2, bandwidth, baselines).

    A graph of one call would time the graph's own launch (a few us) and an idle GPU's
    clocks with it: the first H200 run read 15 us for a 2 us kernel that way. ``fn`` is
    warmed up on a side stream first, which also compiles what it compiles.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(warmup):  # uploads the graph and takes the clocks out of idle
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]
