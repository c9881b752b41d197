"""Survey: every decoder attention of the installed transformers (``prepfuse.models.hf_zoo``),
run engine-style and compiled with ``backend="prepfuse"``: what fuses, and why the rest does not.

Per model (two layers, T=7, block 16, CPU): build it, run it eagerly, then compile it with a
``PrepfuseBackend`` (``fullgraph=True``, fresh Dynamo, no FX graph cache) and run it on the same
inputs; record the fused calls (the fusion passes' matched counts over every graph) against
the layers, the passes' first near misses, the largest relative row error of the written
cache rows and of the output against eager, and the error of whichever stage failed. Each
model runs in a subprocess of its own (a crash, a hang or a memory blow-up costs only that
model: ``--timeout``, ``--memory-gb``).

    PYTHONPATH=. python bench/tools/survey_transformers.py [--only qwen3,llama] [--limit N] [--jobs 2]
    PYTHONPATH=. python bench/tools/survey_transformers.py --from-json bench/results/survey_transformers.json

Writes the raw results to ``bench/results/survey_transformers.json`` and the table to
``docs/corpus_transformers.md`` (``--from-json`` rewrites the table from a JSON alone).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import resource
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]  # not resolved: a copied tree surveys its own prepfuse
sys.path.insert(0, str(REPO_ROOT))
NUM_LAYERS = 2
GATE = 2**-5  # compiled against eager, per written row: tests/corpus/test_transformers.py's bound
MARK = "SURVEY-RESULT "  # a worker's result line on stdout


def survey_one(name: str) -> dict:
    """One model's row: build, eager, compile, compare. Runs in a worker process."""
    import torch

    if not torch.cuda.is_available():  # the ops' Triton kernels run under the interpreter (as tests/conftest.py sets)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from prepfuse.backend import PrepfuseBackend
    from prepfuse.fx_passes.registry import LAST_PASS
    from prepfuse.models.hf_zoo import build_zoo_model, discover, zoo_cache_rows
    from prepfuse.models.hf_zoo_limits import op_limits
    from prepfuse.testing import max_row_rel_diff

    model = next(m for m in discover() if m.name == name)
    row = {"model": name, "attention": model.attention, "source": model.source, "config": model.config,
           "rotary": model.rotary, "expected": NUM_LAYERS, "fused": None, "stage": "build"}
    try:
        module, args = build_zoo_model(model, num_layers=NUM_LAYERS)
        row.update(kv_shapes=module.kv_shapes, rope=module.rope(), stage="limits")
        row["limits"] = op_limits(module, args)
        row["stage"] = "eager"
        x, positions, slots, caches = args
        eager_caches = [tuple(c.clone() for c in pair) for pair in caches]
        with torch.no_grad():
            eager = module(x, positions, slots, eager_caches)
        row["stage"] = "compile"
        torch._dynamo.reset()
        backend = PrepfuseBackend()
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            out = torch.compile(module, backend=backend, fullgraph=True)(x, positions, slots, caches)
        reports = backend.reports
        row["fused"] = sum(n for r in reports for p, n in r.matched_counts.items() if p != LAST_PASS)
        row["patterns"] = dict(collections.Counter(r.pattern for r in reports.matches() if r.pass_name != LAST_PASS))
        row["near_misses"] = list(dict.fromkeys(f"{r.pass_name}: {r.why}" for r in reports.near_misses()))[:3]
        row["cache_err"] = max_row_rel_diff(*(zoo_cache_rows(c, slots, module.block_size) for c in (caches, eager_caches)))
        row["out_err"] = max_row_rel_diff([out.float()], [eager.float()])
        row["stage"] = "done"
    except Exception as err:  # noqa: BLE001  (a model's failure is its row)
        row["error"] = f"{type(err).__name__}: {err}".strip()
        row["traceback"] = traceback.format_exc(limit=-4)
    return row


def run_worker(name: str, timeout: float, memory_gb: float) -> dict:
    """``survey_one(name)`` in a subprocess; a timeout, crash or kill is the row's error."""
    def limit():  # the worker's address space: a model that builds huge fails alone
        resource.setrlimit(resource.RLIMIT_AS, (int(memory_gb * 2**30),) * 2)

    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=limit, cwd=REPO_ROOT)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
        row = json.loads(lines[-1][len(MARK):]) if lines else {
            "model": name, "stage": "crash", "error": f"worker exited {done.returncode}: "
                                                      f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}"}
    except subprocess.TimeoutExpired:
        row = {"model": name, "stage": "timeout", "error": f"timed out after {timeout:.0f} s"}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def tree_label() -> str:
    """The surveyed tree: git's short HEAD, and whether tracked files differ from it."""
    def git(*argv):
        return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO_ROOT).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    return (head + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")) \
        if head else "an unknown tree"


def expressible(row: dict) -> int:
    """How many of the row's layers an op call could express (``hf_zoo_limits``)."""
    return sum(limit is None for limit in row.get("limits", [None] * row["expected"]))


def reason(row: dict) -> str:
    """Why a row fused less than its layers, or failed, or is off eager, in one line ("" if none):
    the near miss where an expressible layer did not fuse, else what no op can express."""
    if row.get("error"):
        return f"{row['stage']}: {row['error'].splitlines()[0][:200]}"
    limits = [limit for limit in row.get("limits", []) if limit]
    if row["fused"] >= row["expected"]:
        why = []
    elif row["fused"] < expressible(row):
        why = [(row["near_misses"] or ["no candidate (no near miss)"])[0]]
    else:
        why = [f"the ops cannot express: {limits[0]}"]
    return "; ".join(why + ([f"numerics: cache rows {row['cache_err']:.3g} from eager"] if row["cache_err"] > GATE else []))


def shapes(row: dict) -> str:
    """``Hkv x D`` of the first layer's k (and v where its head dim differs)."""
    if not row.get("kv_shapes"):
        return "-"
    heads, dk, dv = row["kv_shapes"][0]
    return f"{heads} x {dk}" + (f" / {dv}" if dv != dk else "")


def render_markdown(data: dict) -> str:
    rows = data["rows"]
    built = [r for r in rows if r["stage"] in ("compile", "done")]  # the builder runs the layers once
    compiled = [r for r in rows if r["stage"] == "done"]
    whole = [r for r in compiled if r["fused"] >= r["expected"]]
    fused = sum(r["fused"] for r in compiled)
    can = [r for r in compiled if expressible(r)]
    can_whole = [r for r in can if r["fused"] >= expressible(r)]
    can_calls = sum(expressible(r) for r in can)
    lines = [
        "# The transformers corpus: every decoder attention", "",
        "Generated by `bench/tools/survey_transformers.py` (raw results: `bench/results/survey_transformers.json`); "
        "the models are `prepfuse.models.hf_zoo.discover()`'s, each built and run engine-style by "
        "`build_zoo_model` (two layers, T=7, block 16, bf16, CPU) and compiled with `backend=\"prepfuse\"`. "
        "*expressible* counts the layers whose math an op call could compute (`prepfuse.models.hf_zoo_limits`: "
        "no RoPE, MLA's shared rope head, k/v widths, norms over all heads, LayerNorm, a norm after the rotation or "
        "on v, a gated q rule a layer out); *fused* counts the fusion passes' rewrites against the two layers; "
        "*reason* is the first near miss where an expressible layer did not fuse, what rules the layers out "
        "otherwise, or the error of the stage that failed.", "",
        f"transformers {data['transformers']}, torch {data['torch']}, prepfuse at {data['commit']}, {data['date']}"
        + (f" (surveyed again there, after the whole run: {', '.join(data['updated'])})" if data.get("updated") else "")
        + ".", "",
        f"- models: {len(rows)}; built and run eagerly: {len(built)}; compiled: {len(compiled)}",
        f"- fully fused: {len(whole)}; fused calls {fused} of {NUM_LAYERS * len(compiled)} over the compiled models",
        f"- whose math the ops can express (a layer at least; `prepfuse.models.hf_zoo_limits`): {len(can)}; "
        f"each such layer fused: {len(can_whole)} ({100 * len(can_whole) / max(len(can), 1):.0f}%); "
        f"calls {min(fused, can_calls)} of {can_calls} expressible",
        f"- compiled caches within {GATE:g} of eager per row: {sum(r['cache_err'] <= GATE for r in compiled)}"
        f" of {len(compiled)}", "",
        "| model | attention | kv heads x head dim (k / v) | rope | expressible | fused | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        got = "-" if r.get("fused") is None else f"{r['fused']}/{r['expected']}"
        can_r = f"{expressible(r)}/{r['expected']}" if "limits" in r else "-"
        lines.append(f"| {r['model']} | `{r.get('attention', '?')}` | {shapes(r)} | {r.get('rope', '-')} | {can_r} | "
                     f"{got} | {reason(r).replace('|', '/')} |")
    # counted by kind: a node's graph name (slice_scatter_1, mm_1) differs between models, its op does not
    counts = collections.Counter(re.sub(r"\b([a-z][a-z0-9_]*?)_\d+\b", r"\1", reason(r)) for r in rows if reason(r))
    lines += ["", "## Reasons, by count", "", "Node names without their numbers.", "", "| count | reason |", "|---|---|"]
    lines += [f"| {n} | {why.replace('|', '/')} |" for why, n in counts.most_common()]
    if data.get("excluded"):
        lines += ["", "## Entry points without a model of their own", "",
                  "Model types of the auto mappings that `discover()` looked at and left out, and why.", "",
                  "| model type | why |", "|---|---|"]
        lines += [f"| {t} | {why} |" for t, why in sorted(data["excluded"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated model names")
    parser.add_argument("--limit", type=int, default=None, help="the first N models")
    parser.add_argument("--jobs", type=int, default=1, help="models surveyed at once, one subprocess each")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a model may take")
    parser.add_argument("--memory-gb", type=float, default=8.0, help="a worker's address space")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench/results/survey_transformers.json")
    parser.add_argument("--docs", type=Path, default=REPO_ROOT / "docs/corpus_transformers.md")
    parser.add_argument("--from-json", type=Path, default=None, help="rewrite the table from this JSON only")
    parser.add_argument("--label", default=None, help="the prepfuse tree surveyed (default: git's HEAD and state)")
    parser.add_argument("--update", action="store_true",
                        help="with --only: replace those models' rows in the JSON, keep the others")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(MARK + json.dumps(survey_one(args.worker)), flush=True)
        return 0
    if args.from_json:
        args.docs.write_text(render_markdown(json.loads(args.from_json.read_text())))
        return 0

    import torch
    import transformers

    from prepfuse.models.hf_zoo import discover

    excluded: dict[str, str] = {}
    models = discover(excluded)
    if args.only:
        wanted = args.only.split(",")
        models = [m for m in models if m.name in wanted]
    models = models[:args.limit]
    data = {"transformers": transformers.__version__, "torch": torch.__version__, "commit": args.label or tree_label(),
            "date": datetime.date.today().isoformat(), "excluded": excluded, "rows": []}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for i, row in enumerate(pool.map(lambda m: run_worker(m.name, args.timeout, args.memory_gb), models)):
            data["rows"].append(row)
            print(f"[{i + 1}/{len(models)}] {row['model']}: {row.get('fused', '-')}/{NUM_LAYERS} "
                  f"{reason(row) or 'fused'} ({row['seconds']} s)", flush=True)
            if not args.update:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(data, indent=1) + "\n")  # after each model: a cut run keeps its rows
    if args.update:  # the surveyed rows into the whole table, in its order
        whole = json.loads(args.json.read_text()) if args.json.exists() else {"rows": []}
        fresh = {r["model"]: r for r in data["rows"]}
        whole["rows"] = [fresh.pop(r["model"], r) for r in whole["rows"]] + list(fresh.values())
        whole["updated"] = sorted(set(whole.get("updated", [])) | {r["model"] for r in data["rows"]})
        data = {**whole, **{k: data[k] for k in ("transformers", "torch", "commit", "date")}}
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    args.docs.write_text(render_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
