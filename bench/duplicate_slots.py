"""Duplicated slots: what a slot that several tokens name holds, and what keeping it whole costs.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/duplicate_slots.py --out-dir $OUT
    PYTHONPATH=. python bench/duplicate_slots.py --from-json bench/results/duplicate_slots_<device>.json

With the index checks off (CUDA-graph capture, ``PREPFUSE_CHECK_INDEX_VALUES=0``) a kernel
that inserts more than one row keeps a duplicated slot whole (``prepfuse/ops/_duplicate_slots.py``):
by a scan of the slots (the last writer stores; up to ``SCAN_MAX`` rows) or under the row
locks. Two parts, every op, the kernel launched directly with ``dedupe`` forced to "off",
"scan" and "lock":

- **torn rows**: calls of 1024 tokens whose runs of 96 consecutive tokens share a slot
  (three such slots a call, fresh data each call: ``contended_inputs``, the GPU test's
  calls); a slot holding no single writer's whole row is torn (``torn_slots``, both in
  ``prepfuse.testing.duplicate_slots``). "off" shows what the GPU test would see without
  either; "scan" and "lock" must be 0.
- **cost**: the kernel alone, distinct slots, CUDA-graph replay medians (``harness``: 20
  calls a graph, L2 rotation for big inputs), each mode at the models' sizes (the scan
  only up to ``SCAN_TIMED_MAX`` rows: it reads T'^2 slots); where the scan stops paying
  for itself is ``SCAN_MAX``.

Writes ``duplicate_slots_<device>.json`` and ``docs/benchmarks_duplicate_slots.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402  (also puts the repository on sys.path)

FP8 = torch.float8_e4m3fn
DEFAULT_TOKENS = (2, 8, 64, 256, 512, 1024, 2048, 4096, 16384)
MODES = ("off", "scan", "lock")
SCAN_TIMED_MAX = 2048
TORN_CALLS = 10


def cases() -> dict:
    """name -> (make(T, device) fresh inputs with distinct slots, kernel launch taking
    dedupe=); the indexer inserts T/4 key rows (its benchmark's Tk)."""
    from prepfuse.testing import make_dsv4_indexer_inputs, make_dsv4_inputs, make_gqa_inputs
    from prepfuse.testing.impls import implementations

    dsv4, gqa = implementations("dsv4")[1], implementations("gqa")[1]

    def indexer(fmt):
        return lambda t, dev: make_dsv4_indexer_inputs(fmt, t, 64, 64, dev, num_k=max(1, t // 4), skip_fraction=0.0)

    return {
        "dsv4 H=64": (lambda t, dev: make_dsv4_inputs(t, 64, 64, 64, dev, skip_fraction=0.0),
                      dsv4),
        "dsv4 H=16": (lambda t, dev: make_dsv4_inputs(t, 16, 64, 64, dev, skip_fraction=0.0),
                      dsv4),
        "qwen3-8b": (lambda t, dev: make_gqa_inputs(t, 32, 8, 128, 16, dev, skip_fraction=0.0),
                     gqa),
        "qwen3-8b-fp8": (lambda t, dev: make_gqa_inputs(t, 32, 8, 128, 16, dev, skip_fraction=0.0, cache_dtype=FP8),
                         gqa),
        "llama-3-8b": (lambda t, dev: make_gqa_inputs(t, 32, 8, 128, 16, dev, skip_fraction=0.0, norm=False),
                       gqa),
        "indexer fp8": (indexer("fp8"), implementations("indexer-fp8")[1]),
        "indexer mxfp4": (indexer("mxfp4"), implementations("indexer-mxfp4")[1]),
    }


def count_torn(op: str, dedupe: str) -> dict:
    from prepfuse.testing.duplicate_slots import call_on_fresh_outputs, contended_inputs, slot_writers, torn_slots
    from prepfuse.testing.impls import implementations

    kernel = implementations(op)[1]
    launch = lambda *args: kernel(*args, dedupe=dedupe)  # noqa: E731
    torn = slots_seen = 0
    for _ in range(TORN_CALLS):
        inputs, slots = contended_inputs(op, harness.DEVICE)
        got = call_on_fresh_outputs(launch, inputs, slot_mapping=slots)
        torn += len(torn_slots(got, launch, inputs, slots))
        slots_seen += len(slot_writers(slots))
    return {"op": op, "dedupe": dedupe, "calls": TORN_CALLS, "duplicated_slots": slots_seen, "torn": torn}


def input_bytes(inputs) -> int:
    return sum(v.numel() * v.element_size() for v in vars(inputs).values() if isinstance(v, torch.Tensor))


def run(args) -> tuple[dict, Path]:
    info = harness.device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"duplicate_slots_{info['device_slug']}{args.name_suffix}.json"
    from prepfuse.ops._duplicate_slots import SCAN_MAX

    data = {"what": "duplicated slots: torn rows, and the scan's and the locks' cost", "scan_max": SCAN_MAX,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **info,
            "torn": [], "cost": []}
    harness.spin_up_clocks()
    t_start = time.time()
    from prepfuse.testing.duplicate_slots import CONTENDED_OPS

    for op in CONTENDED_OPS if args.torn else ():
        for dedupe in MODES:
            row = count_torn(op, dedupe)
            data["torn"].append(row)
            print(f"[{time.time() - t_start:6.1f} s] {op:14s} {dedupe:4s}: "
                  f"{row['torn']} of {row['duplicated_slots']} duplicated slots torn", flush=True)
        harness.write_json(path, data)
    for name, (make, kernel) in cases().items():
        if name not in args.cases:
            continue
        for t in args.tokens:
            copies = [make(t, harness.DEVICE)]
            k = harness.rotation_copies(input_bytes(copies[0]), info["l2_bytes"], 0.25)
            copies += [make(t, harness.DEVICE) for _ in range(k - 1)]
            line = []
            for dedupe in MODES:
                if dedupe == "scan" and t > SCAN_TIMED_MAX:
                    continue
                fn = lambda inp, d=dedupe: kernel(*inp.args(), dedupe=d)  # noqa: E731
                graphs = harness.capture_graphs(fn, copies, warmup=3)
                row = {"case": name, "T": t, "dedupe": dedupe, "copies": k,
                       **harness.time_graphs(graphs, args.target_ms, 10, 200)}
                del graphs
                data["cost"].append(row)
                line.append(f"{dedupe} {row['us_median']:.2f} us")
            print(f"[{time.time() - t_start:6.1f} s] {name:14s} T={t:5d}: " + "  ".join(line), flush=True)
            del copies
            torch.cuda.empty_cache()
            harness.write_json(path, data)
    data["elapsed_s"] = round(time.time() - t_start, 1)
    harness.write_json(path, data)
    return data, path


def write_reports(data: dict, json_path: Path, docs_path: Path) -> None:
    md = render_markdown(data, json_path.name)
    docs_path.write_text(md)
    print(md)


def render_markdown(data: dict, json_name: str) -> str:
    lines = [
        "# Duplicated slots: torn rows, and what keeping them whole costs",
        "",
        f"{data['device']}, torch {data['torch']}, triton {data['triton']}, {data['date']}; "
        f"`bench/duplicate_slots.py`, raw numbers in `bench/results/{json_name}`.",
        "",
        "A kernel that inserts more than one row keeps a slot that several rows name whole "
        "(`prepfuse/ops/_duplicate_slots.py`, docs/ops.md \"Index values\"): up to `SCAN_MAX` rows "
        "by a scan of the slots (the last writer stores), beyond that under the row locks "
        f"(`SCAN_MAX` was {data.get('scan_max', '?')} when this ran). Below, the kernels launched directly "
        "with each mode forced (\"off\": neither, what the kernels did before).",
        "",
        f"## Torn rows: {TORN_CALLS} calls of 1024 tokens, runs of 96 tokens sharing each of 3 slots",
        "",
        "| op | " + " | ".join(f"{m}: torn / duplicated" for m in MODES) + " |",
        "|---|" + "---|" * len(MODES),
    ]
    by_op: dict = {}
    for row in data["torn"]:
        by_op.setdefault(row["op"], {})[row["dedupe"]] = row
    for op, rows in by_op.items():
        cells = [f"{rows[m]['torn']} / {rows[m]['duplicated_slots']}" if m in rows else "-" for m in MODES]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "## Cost: the kernel alone, distinct slots, CUDA-graph replay median (us)", "",
              "| op | T | " + " | ".join(MODES) + " | scan / off | lock / off |",
              "|---|---|" + "---|" * (len(MODES) + 2)]
    cost: dict = {}
    for row in data["cost"]:
        cost.setdefault((row["case"], row["T"]), {})[row["dedupe"]] = row["us_median"]
    for (case, t), us in cost.items():
        cells = [f"{us[m]:.2f}" if m in us else "-" for m in MODES]
        ratios = [f"{us[m] / us['off']:.3f}" if m in us and "off" in us else "-" for m in ("scan", "lock")]
        lines.append(f"| {case} | {t} | " + " | ".join(cells + ratios) + " |")
    lines += ["", f"Scan against locks, summed over the ops: the scan costs no more up to T = {scan_pays_up_to(cost)} "
              "(where `SCAN_MAX` belongs); past it the scan's T'^2 reads cost more than the locks."]
    return "\n".join(lines) + "\n"


def scan_pays_up_to(cost: dict) -> int | None:
    """The largest T up to which, at every measured T, the scan's time summed over the ops is
    no more than the locks'."""
    best = None
    for t in sorted({t for _, t in cost}):
        pairs = [us for (_, tt), us in cost.items() if tt == t and "scan" in us and "lock" in us]
        if not pairs:
            break
        if sum(us["scan"] for us in pairs) > sum(us["lock"] for us in pairs):
            break
        best = t
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--docs", default=str(harness.REPO_ROOT / "docs" / "benchmarks_duplicate_slots.md"))
    parser.add_argument("--from-json", default=None)
    parser.add_argument("--tokens", type=harness.parse_int_list, default=list(DEFAULT_TOKENS))
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(cases()))
    parser.add_argument("--target-ms", type=float, default=150.0)
    parser.add_argument("--no-torn", dest="torn", action="store_false", help="only the cost part")
    parser.add_argument("--name-suffix", default="")
    args = parser.parse_args(argv)
    done = harness.from_json_or_cuda(args, write_reports)
    if done is not None:
        return done
    write_reports(*run(args), Path(args.docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
