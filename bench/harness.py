"""The timing method every benchmark under ``bench/`` shares (``bench/README.md``: the method).

CUDA-graph replay of back-to-back calls (per-call times: a graph of one call would time its
own launch), medians over many replays queued behind a GPU sleep (the GPU never waits for
the host between the timed events), input sets rotated so replays find a cold L2 for big
inputs, the copy bandwidth measured in the same run (the ceiling a fused op competes with),
one tiny kernel in a graph (the floor of every row), GPU launches counted by the profiler,
and the device facts a result file records.

Scripts import it as ``import harness`` (``bench/`` is on ``sys.path`` when a script runs);
importing it puts the repository on ``sys.path`` too, for scripts run without
``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import prepfuse
except ImportError:  # run without PYTHONPATH=.
    sys.path.insert(0, str(REPO_ROOT))
    import prepfuse

del prepfuse  # imported for its op registrations

import torch  # noqa: E402

DEVICE = "cuda"  # where the timing helpers allocate (a CPU dry run of a script never calls them)
COLD_FACTOR = 3  # rotated working set >= COLD_FACTOR * L2
MAX_COPIES = 16
SLEEP_US_PER_REPLAY = 25  # GPU sleep queued ahead of each batch of replays, per replay
REPLAY_BATCH = 50


def rotation_copies(nbytes: int, l2_bytes: int, warm_below: float) -> int:
    """How many input/output sets to rotate through so replays find cold L2 (1 = warm)."""
    if nbytes < warm_below * l2_bytes:
        return 1
    return max(1, min(MAX_COPIES, math.ceil(COLD_FACTOR * l2_bytes / nbytes)))


def slugify(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_times(times_us: list[float]) -> dict:
    s = sorted(times_us)
    return {"us_median": _quantile(s, 0.5), "us_p10": _quantile(s, 0.1), "us_p90": _quantile(s, 0.9), "replays": len(s)}


_SYNC_RECORD = re.compile(r"^(Context|Stream|Event) (Sync|Wait)")  # CUPTI synchronisation records


def classify_gpu_activities(names: list[str]) -> dict:
    """Split profiler GPU activity names into kernels / memsets / memcpys; drop syncs."""
    work = [n for n in names if not _SYNC_RECORD.match(n)]
    memsets = sum(n.startswith("Memset") for n in work)
    memcpys = sum(n.startswith("Memcpy") for n in work)
    return {"launches": len(work), "kernels": len(work) - memsets - memcpys, "memsets": memsets, "memcpys": memcpys}


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# --------------------------------------------------------------------------------------
# Compiling the baselines, and the ops' host-side checks
# --------------------------------------------------------------------------------------
def allow_recompiles() -> None:
    """Room for one compiled graph per benchmarked shape (``dynamic=False`` recompiles per T)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 256))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 1024)


class IndexChecksOff:
    """Skip the op's host-side index check (as it is skipped inside a CUDA graph)."""

    def __enter__(self):
        import prepfuse.ops._checks as mod

        self._mod, self._saved = mod, mod.CHECK_INDEX_VALUES
        mod.CHECK_INDEX_VALUES = False

    def __exit__(self, *exc):
        self._mod.CHECK_INDEX_VALUES = self._saved


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------
CALLS_PER_GRAPH = 20  # calls captured back to back in one graph; times are per call


class GraphBatch:
    """One captured graph holding ``calls`` back-to-back calls, round-robin over copies.

    docs/design.md times a kernel as one node among others in a replayed graph (its
    "one tiny kernel in a graph: 1.09 us" is a per-kernel figure): timing a graph of
    one call would add the graph's own launch latency (about 2 us) to every row.
    """

    def __init__(self, graph, calls: int):
        self.graph, self.calls = graph, calls

    def replay(self) -> None:
        self.graph.replay()


def capture_graphs(fn, copies: list, warmup: int, calls: int = CALLS_PER_GRAPH) -> list:
    """Warm ``fn`` up on a side stream (compiling it), then capture one graph of
    ``calls`` calls (rounded up to a multiple of the copies) cycling over ``copies``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(copies[0])
        for c in copies[1:]:
            fn(c)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    n_calls = len(copies) * max(1, -(-calls // len(copies)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fn(copies[i % len(copies)])
    torch.cuda.synchronize()
    return [GraphBatch(g, n_calls)]


def replay_times_us(graphs: list, n: int) -> list[float]:
    """Per-call GPU times (us) from ``n`` replays, round-robin over ``graphs``.

    Each batch is queued behind a GPU sleep long enough for the host to enqueue it, so
    the GPU never waits for the host between the events it is timing.
    """
    times: list[float] = []
    i = 0
    while len(times) < n:
        b = min(REPLAY_BATCH, n - len(times))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(b)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(b)]
        batch = [graphs[(i + j) % len(graphs)] for j in range(b)]
        torch.cuda._sleep(int(b * SLEEP_US_PER_REPLAY * 2000))  # cycles at ~2 GHz
        for j in range(b):
            starts[j].record()
            batch[j].replay()
            ends[j].record()
        i += b
        torch.cuda.synchronize()
        times.extend(s.elapsed_time(e) * 1000.0 / g.calls for s, e, g in zip(starts, ends, batch))
    return times


def time_graphs(graphs: list, target_ms: float, min_replays: int, max_replays: int) -> dict:
    for g in graphs:  # the first replays upload the graphs
        g.replay()
        g.replay()
    torch.cuda.synchronize()
    probe = sorted(replay_times_us(graphs, max(5, len(graphs))))
    estimate = probe[len(probe) // 2] * graphs[0].calls  # us per replay
    n = int(min(max_replays, max(min_replays, target_ms * 1000.0 / max(estimate, 1e-3))))
    return summarize_times(replay_times_us(graphs, n))


def spin_up_clocks(seconds: float = 0.5) -> None:
    """Keep the GPU busy long enough to leave its idle clocks (345 MHz seen at start)."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            b.copy_(a)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1000:
            break


def measure_copy_bandwidth(nbytes: int) -> dict:
    """Device-to-device copy bandwidth (read + write bytes), CUDA-graph replay median.

    Two copies are timed and the faster one is the ceiling: ``copy_`` of uint8 (a
    memcpy node in the graph, which on the first H200 run reached only 2.7 TB/s) and an
    SM copy kernel (``torch.neg`` on fp32, 16-byte vectors), which is what a fused
    kernel competes with. Both are kept in the JSON.
    """
    free, _ = torch.cuda.mem_get_info()
    while 2 * nbytes > 0.8 * free and nbytes > (256 << 20):
        nbytes //= 2
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 256)  # not zeros
    dst = torch.empty_like(src)
    src_f, dst_f = src.view(torch.float32), dst.view(torch.float32)
    spin_up_clocks()
    variants = {"memcpy": lambda _: dst.copy_(src), "sm_kernel": lambda _: torch.neg(src_f, out=dst_f)}
    results = {}
    for name, fn in variants.items():
        graphs = capture_graphs(fn, [None], warmup=2, calls=4)
        stats = time_graphs(graphs, target_ms=100, min_replays=10, max_replays=30)
        del graphs
        results[name] = {**stats, "GBps": 2 * nbytes / (stats["us_median"] * 1e-6) / 1e9}
    best = max(results, key=lambda k: results[k]["GBps"])
    return {"bytes_per_copy": nbytes, "bytes_counted": 2 * nbytes, "method": best, **results[best], "variants": results}


def measure_tiny_graph() -> dict:
    """One tiny kernel in a graph (docs/design.md: 1.09 us): the floor of every row."""
    x = torch.ones(1, device=DEVICE)
    graphs = capture_graphs(lambda _: x.add_(1.0), [None], warmup=2)
    stats = time_graphs(graphs, target_ms=5, min_replays=200, max_replays=200)
    del graphs
    return stats


DECODE_MARGIN_US = 0.5  # the T=1 target: a decode-sized call within this of one tiny kernel in a graph


def decode_target_note(data: dict, key: str, names) -> str:
    """A page's line on the T=1 target: the fused T=1 median of each of ``names`` (the rows'
    ``key`` field: a model, a format) against one tiny kernel in a graph timed in the same
    run (``data["tiny_graph"]``, ``measure_tiny_graph``) plus ``DECODE_MARGIN_US``; a JSON
    from before the floor was timed with the rows says so rather than borrow another run's
    floor."""
    if "tiny_graph" not in data:
        return (f"- **T=1 target** (within {DECODE_MARGIN_US} us of one tiny kernel in a graph, same run): not "
                "judged, this run did not time the tiny kernel (its JSON predates it)")
    floor = data["tiny_graph"]["us_median"]
    limit = floor + DECODE_MARGIN_US
    t1_us = {r[key]: r["us_median"] for r in data["rows"]
             if r["impl"] == "fused" and r["T"] == 1 and "us_median" in r}
    cells = [f"{name} {t1_us[name]:.2f} us ({'yes' if t1_us[name] <= limit else f'no, +{t1_us[name] - limit:.2f}'})"
             for name in names if name in t1_us]
    return (f"- **T=1 target** (one tiny kernel in a graph, this run: {floor:.2f} us, + {DECODE_MARGIN_US}: "
            f"<= {limit:.2f} us): " + ("; ".join(cells) if cells else "no T=1 row timed"))


def _gpu_events(fn) -> list:
    """torch.profiler's GPU activity records over one call of ``fn``, in the profiler's order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def count_launches(fn) -> list[str]:
    """GPU activity names recorded by torch.profiler over one call of ``fn``."""
    return [e.name for e in _gpu_events(fn)]


def kernel_durations(fn) -> list[tuple[str, float]]:
    """``(name, us)`` of each GPU kernel, memset and memcpy that one call of ``fn`` ran, in
    launch order (synchronisation records dropped): what makes up a time."""
    events = sorted((e for e in _gpu_events(fn) if not _SYNC_RECORD.match(e.name)), key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in events]


# --------------------------------------------------------------------------------------
# Result files
# --------------------------------------------------------------------------------------
def device_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    return {
        "device": torch.cuda.get_device_name(),
        "device_slug": slugify(torch.cuda.get_device_name()),
        "capability": f"{props.major}.{props.minor}",
        "num_sms": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "l2_bytes": l2 if l2 > 0 else 50 << 20,
        "l2_bytes_reported": l2 > 0,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def same_size_copy(device_slug: str) -> tuple[dict, str]:
    """The SM copy kernel's GB/s at each op's own byte count, keyed ``(op, T)`` (ops named as
    ``bench/tools/copy_ceiling.py`` names them: ``"gqa <model>"``, ``"indexer <format>"``), and the
    name of the file that holds them, the committed ``bench/results/copy_ceiling_<device>.json``;
    ``({}, "")`` where the device has none. A page divides its op's GB/s by this: the share of
    what a launch of that size reaches at all (a separate run, so a page names the file)."""
    path = Path(__file__).resolve().parent / "results" / f"copy_ceiling_{device_slug}.json"
    if not path.exists():
        return {}, ""
    data = json.loads(path.read_text())
    return {(r["op"], r["T"]): r["GBps"] for r in data["rows"]}, path.name


def same_size_note(ceiling_file: str) -> list[str]:
    """A page's line saying what its "% same-size copy" column divides by (none without a file)."""
    if not ceiling_file:
        return []
    return [f"- **% same-size copy:** the fused op's GB/s over the copy kernel's at the row's own bytes "
            f"(`bench/tools/copy_ceiling.py`, a separate run: `bench/results/{ceiling_file}`; T = 4096 and 16384): the "
            "share of what a launch of that size reaches at all."]


def same_size_share(ceiling: dict, op: str, num_tokens: int, gbps: float | None) -> str:
    """``gbps`` as a percentage of ``ceiling[(op, T)]`` (``same_size_copy``), or "-"."""
    ref = ceiling.get((op, num_tokens))
    return f"{100 * gbps / ref:.0f}%" if ref and gbps else "-"


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def loud(msg: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\n{msg}\n{bar}\n", flush=True)


def write_page(render_markdown, render_plot, data: dict, json_path: Path, docs_path: Path) -> str:
    """A result file's plot (``json_path`` with ``.png``; skipped, said, without matplotlib)
    and page (``render_markdown(data, json name, png name)`` into ``docs_path``); returns the page."""
    png_path = json_path.with_suffix(".png")
    try:
        render_plot(data, png_path)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    md = render_markdown(data, json_path.name, png_path.name)
    docs_path.write_text(md)
    return md


def from_json_or_cuda(args, write_reports) -> int | None:
    """What a benchmark's ``main`` does before measuring: with ``--from-json``, regenerate the
    page and plot from that result file (0); without a CUDA device, say so (2); else None."""
    if args.from_json:
        path = Path(args.from_json)
        write_reports(json.loads(path.read_text()), path, Path(args.docs) if args.docs else None)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    return None
