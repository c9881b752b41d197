"""Benchmark the DeepSeek-V4 indexer ops against the unfused model code they replace.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/bench_dsv4_indexer_rope_quant_insert.py --out-dir $OUT
    PYTHONPATH=. python bench/bench_dsv4_indexer_rope_quant_insert.py --tokens 1,4096 --formats fp8 --impls fused
    PYTHONPATH=. python bench/bench_dsv4_indexer_rope_quant_insert.py --from-json bench/results/<file>.json

Ops: ``prepfuse::dsv4_indexer_rope_fp8_insert`` and ``prepfuse::dsv4_indexer_rope_mxfp4_insert``
(format ``fp8`` and ``mxfp4``), H = 64 indexer heads of 128 dims, Tk = max(1, T // 4)
compressed key rows (one per 4 tokens, every one inserted), block size 64.
Implementations, per format:

- ``fused``: the op through the dispatcher (one Triton launch);
- ``eager``: the unfused model code, ``indexer_q_prep`` + ``indexer_k_insert`` of
  ``prepfuse.models.dsv4_indexer`` (fp8, spelling ``slice-strided-view-bytes``: torch 2.11's
  Inductor cannot lower the ``unsqueeze`` scales spelling) or ``prepfuse.models.dsv4_indexer_mxfp4``
  (mxfp4, spelling ``compare-blocks-slice-strided-view``), in PyTorch eager;
- ``compile``: that function under ``torch.compile`` (default backend, ``fullgraph=True``,
  ``dynamic=False``);
- ``prepfuse``: the same function under ``torch.compile(backend=PrepfuseBackend({"strict": True}))``
  (Inductor's FX graph cache off, so that the pass runs), whose pass should replace it by one
  op call (the row records the pass's matched count);
- ``fused-q`` and ``vllm``: the q side alone (no key rows): the op, and vLLM 0.33's own
  indexer q kernel (``fused_indexer_q_rope_quant``'s CuTe DSL kernel, ``bench/vllm_indexer.py``)
  where its payload loads; vLLM writes its key rows in the compressor, so this pair is the
  like-for-like comparison.

Method (``bench_dsv4_qnorm_rope_kv_insert.py``'s, whose timing code this script imports):
per shape a correctness gate first (fresh random inputs from
``prepfuse.testing.make_dsv4_indexer_inputs``, poisoned outputs, each implementation against
``dsv4_indexer_rope_{fp8,mxfp4}_insert_reference``, ``within_bound``); then CUDA graphs of 20
back-to-back calls replayed behind a GPU sleep, median per call; L2 rotation over input copies
once a call moves more than a quarter of L2; bytes moved are the fewest the op must move
(``indexer_bytes_moved``), against the copy bandwidth measured at the start; launches counted
with the profiler after timing. Writes ``dsv4_indexer_rope_quant_insert_<device>.json``, a PNG
beside it and the markdown page (``--docs``, default ``docs/benchmarks_indexer.md``). Exit code
1 when a ``fused`` or ``prepfuse`` row failed its gate or could not run, or the pass did not
make exactly one op call of a ``prepfuse`` row's graph.
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
import vllm_indexer  # noqa: E402  (bench/ is on sys.path: the script's own folder)
import vllm_ops  # noqa: E402

STEM = "dsv4_indexer_rope_quant_insert"
FORMATS = ("fp8", "mxfp4")
IMPLS = ("fused", "eager", "compile", "prepfuse", "fused-q", "vllm")
Q_SIDE = ("fused-q", "vllm")  # timed on calls with no key rows
DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 16384)
HEADS = 64
HEAD_DIM = 128
BLOCK_SIZE = 64
DEVICE = "cuda"  # where the inputs live (the CPU test of the loop rebinds it)
# the model code's spelling per format (a name in its module's spellings table); a format
# missing here has only the fused row
MODEL_SPELLINGS = {"fp8": "slice-strided-view-bytes", "mxfp4": "compare-blocks-slice-strided-view"}
PASS_NAMES = {"fp8": "fuse_dsv4_indexer_prep", "mxfp4": "fuse_dsv4_indexer_mxfp4_prep"}
# the pattern of a match that took q and k together (a pass match may take one side alone)
WHOLE_PATTERNS = {"fp8": "dsv4_indexer_q+k", "mxfp4": "dsv4_indexer_mxfp4_q+k"}
OP_NAMES = {"fp8": "dsv4_indexer_rope_fp8_insert", "mxfp4": "dsv4_indexer_rope_mxfp4_insert"}
WARM_BELOW_L2 = 0.25  # a call moving less than this share of L2 is timed warm, larger ones cold
COMPILE_DIFF_SHARE = 10  # compile: at most 1 in this many written elements of an output may differ


def key_rows(num_tokens: int) -> int:
    """Compressed key rows per call: one per 4 tokens (compress ratio 4), at least one."""
    return max(1, num_tokens // 4)


def indexer_bytes_moved(num_tokens: int, num_k: int, num_heads: int, fmt: str) -> int:
    """Fewest bytes one call must move, every key row inserted.

    Per token: q read (H x 128 bf16 = 256 H), weights read (bf16, 2 H), its cos/sin row
    (64 fp32 = 256), q written (fp8: 128 H codes; mxfp4: 64 H packed bytes and 4 H scale
    bytes), the scaled weights written (fp32, 4 H), its position (8). Per key row: k read
    (128 bf16 = 256), its cos/sin row (256), its cache slot written (fp8: 128 codes and a
    4-byte scale = 132; mxfp4: 64 packed and 4 scale bytes = 68), its slot and its position
    read (8 each).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt: must be one of {FORMATS}, got {fmt!r}")
    q_out = 128 * num_heads if fmt == "fp8" else 64 * num_heads + 4 * num_heads
    per_token = 256 * num_heads + 2 * num_heads + 256 + q_out + 4 * num_heads + 8
    per_key = 256 + 256 + (132 if fmt == "fp8" else 68) + 2 * 8
    return num_tokens * per_token + num_k * per_key


# --------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------
def make_inputs(fmt: str, num_tokens: int, *, skip_fraction: float, num_k: int | None = None):
    """One call's inputs: ``num_k`` key rows, by default ``key_rows(num_tokens)``."""
    from prepfuse.testing import make_dsv4_indexer_inputs

    num_k = key_rows(num_tokens) if num_k is None else num_k
    return make_dsv4_indexer_inputs(fmt, num_tokens, HEADS, BLOCK_SIZE, DEVICE, num_k=num_k,
                                    skip_fraction=skip_fraction)


def vllm_call(fmt: str):
    """vLLM's indexer q kernel of ``fmt`` as a call on prepfuse's inputs, writing their q outputs."""
    kernels = vllm_indexer.load()
    if fmt == "fp8":
        return lambda inp: kernels.fp8(inp.q, inp.weights, inp.positions, inp.cos_sin_cache, inp.weights_scale,
                                       inp.q_out, inp.weights_out)
    return lambda inp: kernels.mxfp4(inp.q, inp.weights, inp.positions, inp.cos_sin_cache, inp.weights_scale,
                                     inp.q_out, inp.q_scale, inp.weights_out)


def model_step(fmt: str, weights_scale: float, block_size: int):
    """The format's unfused model code as one function of the call's tensors: returns the
    q outputs (fp8: codes, weights; mxfp4: packed codes, scale bytes, weights) and writes
    the key rows into ``k_cache``."""
    if fmt == "fp8":
        from prepfuse.models import dsv4_indexer as model

        spellings = model.INDEXER_SPELLINGS
    else:
        from prepfuse.models import dsv4_indexer_mxfp4 as model

        spellings = model.MXFP4_SPELLINGS
    spelling = next(s for s in spellings if s.name == MODEL_SPELLINGS[fmt])

    def step(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        out = model.indexer_q_prep(q, weights, positions, cos_sin_cache, weights_scale, spelling)
        model.indexer_k_insert(k, k_cache, slot_mapping, k_positions, cos_sin_cache, block_size, spelling)
        return out

    return step


def _step_args(inp) -> tuple:
    return inp.q, inp.weights, inp.k, inp.k_cache, inp.slot_mapping, inp.positions, inp.k_positions, inp.cos_sin_cache


def make_impl(impl: str, fmt: str, weights_scale: float, block_size: int):
    """(callable(Dsv4IndexerInputs), the PrepfuseBackend or None). Compiled ones start from a
    reset Dynamo, so each compiles exactly this shape and a backend's reports are its own."""
    from prepfuse.backend import PrepfuseBackend
    from prepfuse.ops import DSV4_INDEXER_ROPE_FP8_INSERT, DSV4_INDEXER_ROPE_MXFP4_INSERT

    if impl in ("fused", "fused-q"):
        op = DSV4_INDEXER_ROPE_FP8_INSERT if fmt == "fp8" else DSV4_INDEXER_ROPE_MXFP4_INSERT
        return (lambda inp: op(*inp.args())), None
    if impl == "vllm":
        return vllm_call(fmt), None
    step = model_step(fmt, weights_scale, block_size)
    backend = None
    if impl == "compile":
        torch._dynamo.reset()
        step = torch.compile(step, fullgraph=True, dynamic=False)
    elif impl == "prepfuse":
        torch._dynamo.reset()
        # Inductor's FX graph cache off: a graph served from it runs no pass, and the row's
        # matched count would be unknown
        backend = PrepfuseBackend({"strict": True, "inductor_config": {"fx_graph_cache": False}})
        step = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    return (lambda inp: step(*_step_args(inp))), backend


def store_outputs(fmt: str, outs: tuple, run) -> None:
    """Copy the model code's returned q outputs into ``run``'s (poisoned) output buffers."""
    if fmt == "fp8":
        q_codes, weights = outs
        run.q_out.view(torch.uint8).copy_(q_codes.view(torch.uint8))
    else:
        packed, scale_bytes, weights = outs
        run.q_out.copy_(packed)
        run.q_scale.copy_(scale_bytes)
    run.weights_out.copy_(weights)


def written_elements(inp) -> dict[str, int]:
    """Per output, the elements a call writes (the denominators of the compile bound)."""
    written = {"q_out": inp.q_out.numel(), "weights_out": inp.weights_out.numel(),
               "k_cache": int((inp.slot_mapping >= 0).sum()) * inp.slot_bytes}
    if inp.q_scale is not None:
        written["q_scale"] = inp.q_scale.numel()
    return written


def within_bound(impl: str, comparison: dict) -> bool:
    """The gate's verdict from a comparison ``{"differing": {output: n}, "written": {output: n}}``.

    ``fused``, ``fused-q``, ``eager`` and ``prepfuse`` must equal the reference byte for byte:
    there are no sums in this math (the op's GPU tests and the pass tests assert equality).
    ``vllm`` is held to the spec's bound between two implementations (at most 20 in a million
    values of each output differ; ``tests/ops/test_vllm_indexer_parity.py`` checks that each is
    one code apart). ``compile`` is
    Inductor's code for the unfused math, which rounds its own way (torch 2.11 drops the
    bf16 round trip; a product may be contracted into an FMA): as the pass tests bound
    Inductor's code for the look-alikes it leaves alone, at most 1 in ``COMPILE_DIFF_SHARE``
    of each output's written elements may differ (garbage differs in most).
    """
    differing = comparison["differing"]
    if impl == "vllm":
        return all(n <= 1 + 20e-6 * comparison["written"].get(name, 0) for name, n in differing.items())
    if impl != "compile":
        return not any(differing.values())
    return all(n <= max(2, comparison["written"].get(name, 0) // COMPILE_DIFF_SHARE) for name, n in differing.items())


def gate(impl: str, fmt: str, fn, inputs) -> tuple[bool, dict]:
    """Run ``fn`` and the reference on fresh poisoned outputs of ``inputs``; compare every byte."""
    from prepfuse.ops import dsv4_indexer_rope_fp8_insert_reference, dsv4_indexer_rope_mxfp4_insert_reference
    from prepfuse.testing import compare_dsv4_indexer

    reference = dsv4_indexer_rope_fp8_insert_reference if fmt == "fp8" else dsv4_indexer_rope_mxfp4_insert_reference
    ref, run = inputs.fresh_outputs(), inputs.fresh_outputs()
    reference(*ref.args())
    outs = fn(run)
    if impl not in ("fused", "fused-q", "vllm"):
        store_outputs(fmt, outs, run)
    _sync()
    comparison = {"differing": compare_dsv4_indexer(ref, run), "written": written_elements(inputs)}
    return within_bound(impl, comparison), comparison


def fusion_record(backend, fmt: str) -> dict:
    """What the prepfuse backend did to this row's graph: the pass's matched count, how many of
    its matches took q and k together (``whole``: 1 = the whole prep became one op call), the
    patterns, the prepfuse ops left in the graph."""
    reports = list(backend.reports)
    ops_after: dict[str, int] = {}
    for rep in reports:
        for op, n in rep.ops_after.items():
            ops_after[op] = ops_after.get(op, 0) + n
    patterns = backend.reports.pattern_counts()
    return {"matched": sum(rep.matched_counts.get(PASS_NAMES[fmt], 0) for rep in reports),
            "whole": patterns.get(WHOLE_PATTERNS[fmt], 0), "patterns": patterns, "ops_after": ops_after,
            "cached": any(rep.cached for rep in reports), "graphs": len(reports)}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------
# The measuring run
# --------------------------------------------------------------------------------------
def measure_row(row: dict, impl: str, fmt: str, gate_inputs, copies: list, args, copy_bw: float) -> None:
    """Fill ``row``: gate, timing, bandwidth, launches; an exception becomes ``row["error"]``."""
    label = f"{fmt} {impl} T={row['T']}"
    try:
        start = time.time()
        fn, backend = make_impl(impl, fmt, gate_inputs.weights_scale, gate_inputs.block_size)
        row["correct"], row["comparison"] = gate(impl, fmt, fn, gate_inputs)
        if impl in ("compile", "prepfuse"):
            row["compile_s"] = round(time.time() - start, 2)  # the first call compiles (gate included)
        if backend is not None:
            row["fusion"] = fusion_record(backend, fmt)
            if not fused_whole(row["fusion"]):
                harness.loud(f"{label}: the pass matched {row['fusion']['matched']} times "
                             f"({row['fusion'].get('whole')} of q and k together), expected one of both\n"
                              + backend.reports.format(verbose=True))
        if not row["correct"]:
            harness.loud(f"{label}: differs from the reference: {row['comparison']}")
        graphs = harness.capture_graphs(fn, copies, warmup=3)
        row.update(harness.time_graphs(graphs, args.target_ms, 10, 200))
        del graphs
        row["GBps"] = row["bytes"] / (row["us_median"] * 1e-6) / 1e9
        row["frac_of_copy_bw"] = row["GBps"] / copy_bw
        with harness.IndexChecksOff():  # as inside a graph: no host-side index check
            row.update(harness.classify_gpu_activities(harness.count_launches(lambda c=copies[0]: fn(c))))
    except Exception as err:  # noqa: BLE001 - record and go on: the table stays complete
        row["error"] = f"{type(err).__name__}: {err}"
        harness.loud(f"{label}: {row['error']}")


def measure_shape(data: dict, fmt: str, t: int, tk: int, impls: list[str], args, info: dict,
                  copy_bw: float) -> list[str]:
    """Append one row per implementation of ``impls`` at T=``t`` with ``tk`` key rows to
    ``data["rows"]``; the progress line's pieces."""
    nbytes = indexer_bytes_moved(t, tk, HEADS, fmt)
    k = harness.rotation_copies(nbytes, info["l2_bytes"], WARM_BELOW_L2)
    l2 = "warm" if nbytes < WARM_BELOW_L2 * info["l2_bytes"] else "cold"  # 1 copy when >= 3x L2
    copies, gate_skips, failure = [], None, None
    try:
        # timed inputs: every slot valid (what the model code needs); the fused op's gate also
        # meets skipped (negative) slots
        copies = [make_inputs(fmt, t, skip_fraction=0.0, num_k=tk) for _ in range(k)]
        gate_skips = make_inputs(fmt, t, skip_fraction=0.1, num_k=tk) if "fused" in impls else None
    except Exception as err:  # noqa: BLE001 - every row of this shape says why
        failure = f"inputs: {type(err).__name__}: {err}"
        harness.loud(f"{fmt} T={t}: {failure}")
    line = []
    for impl in impls:
        row = {"format": fmt, "impl": impl, "T": t, "Tk": tk, "H": HEADS, "block_size": BLOCK_SIZE,
               "bytes": nbytes, "copies": k, "l2": l2}
        if failure is None:
            measure_row(row, impl, fmt, gate_skips if impl == "fused" else copies[0], copies, args, copy_bw)
        else:
            row["error"] = failure
        data["rows"].append(row)
        line.append(f"{impl} {row['us_median']:.2f} us" if "us_median" in row else f"{impl} error")
    del copies, gate_skips
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return line


def run_benchmark(args) -> dict:
    t_start = time.time()
    info = harness.device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{STEM}_{info['device_slug']}{args.name_suffix}.json"
    harness.allow_recompiles()
    data = {
        "ops": {fmt: f"prepfuse::{OP_NAMES[fmt]}" for fmt in args.formats},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **info, "H": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "key_rows": "max(1, T // 4)",
        "model_spellings": {fmt: MODEL_SPELLINGS.get(fmt) for fmt in args.formats},
        "args": {"tokens": args.tokens, "formats": args.formats, "impls": args.impls, "target_ms": args.target_ms},
        "status": "running", "rows": [],
    }
    if "vllm" in args.impls and vllm_indexer.load() is None:
        print(f"no vllm column: {vllm_indexer.absent_reason()}", flush=True)
        args.impls = [i for i in args.impls if i != "vllm"]
    data["vllm"] = vllm_indexer.column_info()
    data["copy_bandwidth"] = harness.measure_copy_bandwidth(4 << 30)
    copy_bw = data["copy_bandwidth"]["GBps"]
    print(f"{info['device']}: copy bandwidth {copy_bw:.0f} GB/s ({data['copy_bandwidth']['method']})", flush=True)
    data["tiny_graph"] = harness.measure_tiny_graph()  # the T=1 target's floor, this run's
    print(f"one tiny kernel in a graph {data['tiny_graph']['us_median']:.2f} us", flush=True)
    for fmt in args.formats:
        impls = [i for i in args.impls if i in ("fused", *Q_SIDE) or fmt in MODEL_SPELLINGS]
        missing = vllm_indexer.load().missing_reason(fmt) if "vllm" in impls else ""
        if missing:
            print(f"no vllm column for {fmt}: {missing}", flush=True)
            data.setdefault("vllm_missing", {})[fmt] = missing
            impls.remove("vllm")
        for t in sorted(args.tokens):
            line = []
            for group in ([i for i in impls if i not in Q_SIDE], [i for i in impls if i in Q_SIDE]):
                if group:
                    tk = 0 if group[0] in Q_SIDE else key_rows(t)
                    line += measure_shape(data, fmt, t, tk, group, args, info, copy_bw)
            print(f"[{time.time() - t_start:6.1f} s] {fmt:5s} T={t:5d}: " + "  ".join(line), flush=True)
            harness.write_json(path, data)
    data["status"] = "done"
    data["elapsed_s"] = round(time.time() - t_start, 1)
    harness.write_json(path, data)
    return data


def failed_rows(data: dict) -> list[dict]:
    """The rows that make the run fail: prepfuse's own (``fused``, ``fused-q``, ``prepfuse``) that did not
    run or differ from the reference (judged by today's bound), and ``prepfuse`` rows whose
    compile the pass did not turn into exactly one op call."""

    def failed(r: dict) -> bool:
        if "error" in r or "comparison" not in r or not within_bound(r["impl"], r["comparison"]):
            return True
        fusion = r.get("fusion")
        return fusion is not None and not fused_whole(fusion)

    return [r for r in data["rows"] if r["impl"] in ("fused", "fused-q", "prepfuse") and failed(r)]


def fused_whole(fusion: dict) -> bool:
    """Whether a row's compile became one op call of q and k together (a cached compile ran no
    pass: nothing to judge; records from before ``whole`` count the pass's matches)."""
    return fusion["cached"] or (fusion["matched"] == 1 and fusion.get("whole", 1) == 1)


# --------------------------------------------------------------------------------------
# Report: markdown and plot, regenerated from the JSON
# --------------------------------------------------------------------------------------
def _us(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['us_median']:.2f}" if "us_median" in row else "error"


def _gate_cell(row: dict | None) -> str:
    if row is None or "comparison" not in row:
        return "-" if row is None or "error" not in row else "error"
    return "ok" if within_bound(row["impl"], row["comparison"]) else "FAIL"


def _fusion_cell(row: dict | None) -> str:
    if row is None or "fusion" not in row:
        return "-"
    fusion = row["fusion"]
    if fusion["cached"]:
        return "cached"
    return str(fusion["matched"]) + ("" if fused_whole(fusion) else " (!)")


def q_side_table(data: dict, fmt: str, rows: dict) -> list[str]:
    """The format's q side against vLLM's kernel (rows ``fused-q`` and ``vllm``), or nothing
    where the run has no such rows."""
    ts = sorted({r["T"] for r in data["rows"] if r["format"] == fmt and r["impl"] in Q_SIDE})
    if not ts:
        return []
    missing = data.get("vllm_missing", {}).get(fmt)
    lines = ["", f"### {fmt}, q side alone against vLLM", "",
             "No key rows: the op (`fused-q`) and vLLM's `fused_indexer_q_rope_quant` kernel write the same q "
             "outputs and scaled weights. `x vLLM` is vLLM's time over the op's."
             + (f" No vLLM rows: {missing}." if missing else ""), "",
             "| T | MB | fused-q us | % copy BW | vLLM us | % copy BW | x vLLM | gate (fused-q/vLLM) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in ts:
        f, v = rows.get((fmt, "fused-q", t)), rows.get((fmt, "vllm", t))
        any_row = f or v

        def frac(r):
            return f"{100 * r['frac_of_copy_bw']:.1f}%" if r and "us_median" in r else "-"

        ratio = (f"{v['us_median'] / f['us_median']:.2f}x"
                 if f and v and "us_median" in f and "us_median" in v else "-")
        lines.append(f"| {t} | {any_row['bytes'] / 1e6:.2f} | {_us(f)} | {frac(f)} | {_us(v)} | {frac(v)} | {ratio} "
                     f"| {_gate_cell(f)}/{_gate_cell(v)} |")
    return lines


def render_markdown(data: dict, json_name: str, png_name: str) -> str:
    bw = data["copy_bandwidth"]
    ceiling, ceiling_file = harness.same_size_copy(data["device_slug"])
    formats = [f for f in FORMATS if any(r["format"] == f for r in data["rows"])]
    lines = [
        "# Benchmark: prepfuse::dsv4_indexer_rope_fp8_insert and prepfuse::dsv4_indexer_rope_mxfp4_insert",
        "",
        "Generated by `bench/bench_dsv4_indexer_rope_quant_insert.py` from "
        f"`bench/results/{json_name}`; do not edit by hand. Plot: `bench/results/{png_name}`.",
        "",
        f"- **Date:** {data['date']}; **device:** {data['device']} ({data['num_sms']} SMs); torch {data['torch']}, "
        f"triton {data['triton']}",
        f"- **Copy bandwidth:** {bw['GBps']:.0f} GB/s ({bw['method']}, read + write bytes)",
        f"- **Shapes:** H = {data['H']} indexer heads of {data['head_dim']} dims, Tk = {data['key_rows']} key rows "
        f"(all inserted), block size {data['block_size']}.",
        *(f"- **Note:** {note}" for note in data.get("notes", [])),
        *vllm_ops.page_note(data, "indexer q kernels (CuTe DSL, what `fused_indexer_q_rope_quant` runs on CUDA), "
                            "compiled from vLLM's source", "bench/vllm_indexer.py"),
        *harness.same_size_note(ceiling_file),
        harness.decode_target_note(data, "format", formats),
        "",
        "**Method.** As `docs/benchmarks.md`: per shape, a gate before timing compares each implementation "
        "with the op's reference on fresh random inputs and poisoned outputs (the fused op with ~10% skipped "
        "slots; the model code, which cannot skip a slot, with all slots valid). `fused`, `fused-q`, `eager` "
        "and `prepfuse` must match byte for byte (no sums in this math); `vllm` may differ in at most 20 in a "
        "million written values of each output (two implementations, each within the spec); `compile` may differ "
        "in at most 1 in "
        f"{COMPILE_DIFF_SHARE} written elements of each output (Inductor's own rounding of the unfused math: "
        "torch 2.11 drops the bf16 round trip, products may become FMAs). Then CUDA graphs of 20 back-to-back "
        "calls, replayed behind a GPU sleep; median per call; once a call moves a quarter of L2 the graph "
        "rotates over copies of the inputs and outputs (>= 3x L2 in all) so that every call starts from cold "
        "L2. Bytes are the fewest a call must move (`indexer_bytes_moved`: q, weights, k and one cos/sin row "
        "per token and key row read, q codes (+ MXFP4 scales), fp32 weights and the cache slots written, "
        "8 B per index); GB/s is bytes over the median. Launches: GPU activities of one plain call "
        "(profiler), f/e/c/p = fused / eager / compile / prepfuse.",
        "",
        "**Implementations.** `fused`: the op; `eager`: the unfused model code "
        "(`prepfuse.models.dsv4_indexer` / `dsv4_indexer_mxfp4`, `indexer_q_prep` + `indexer_k_insert`, "
        "spelling " + ", ".join(f"{f}: `{s}`" for f, s in data.get("model_spellings", {}).items() if s)
        + "); `compile`: that code under `torch.compile` (default backend, `fullgraph=True`, `dynamic=False`); "
        "`prepfuse`: the same code under `torch.compile(backend=PrepfuseBackend({\"strict\": True}))` "
        "(FX graph cache off, so that the pass runs and reports), whose pass should make it one op call "
        "(`pass matched`: 1 = fused). The model code returns fresh q tensors (`prepfuse`: views of the "
        "scratch arena); the fused op writes preallocated outputs.",
    ]
    missing = [f for f in formats if not data.get("model_spellings", {}).get(f)]
    if missing:
        lines += ["", f"No unfused model code for {', '.join(missing)}: only the fused row."]
    rows = {(r["format"], r["impl"], r["T"]): r for r in data["rows"]}
    for fmt in formats:
        lines += [
            "", f"## {fmt} (`prepfuse::{OP_NAMES[fmt]}`)", "",
            "| T | Tk | MB | L2 (copies) | fused us | GB/s | % copy BW | % same-size copy | eager us | compile us "
            "| prepfuse us | fused vs compile | launches (f/e/c/p) | gate (f/e/c/p) | pass matched |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
        ]
        for t in sorted({r["T"] for r in data["rows"] if r["format"] == fmt and r["impl"] not in Q_SIDE}):
            f, e, c, p = (rows.get((fmt, impl, t)) for impl in IMPLS[:4])
            any_row = next(r for r in (f, e, c, p) if r is not None)
            timed_f = f is not None and "us_median" in f
            speed = f"{c['us_median'] / f['us_median']:.1f}x" if timed_f and c and "us_median" in c else "-"
            gbps = f"{f['GBps']:.0f}" if timed_f else "-"
            frac = f"{100 * f['frac_of_copy_bw']:.1f}%" if timed_f else "-"
            same_size = harness.same_size_share(ceiling, f"indexer {fmt}", t, f["GBps"] if timed_f else None)
            launches = "/".join(str(r.get("launches", "-")) if r else "-" for r in (f, e, c, p))
            gates = "/".join(_gate_cell(r) for r in (f, e, c, p))
            l2 = any_row["l2"] if any_row["copies"] == 1 else f"{any_row['l2']} x{any_row['copies']}"
            shape = f"| {t} | {any_row['Tk']} | {any_row['bytes'] / 1e6:.2f} | {l2} "
            lines.append(shape + f"| {_us(f)} | {gbps} | {frac} | {same_size} | {_us(e)} | {_us(c)} | {_us(p)} | {speed} "
                         f"| {launches} | {gates} | {_fusion_cell(p)} |")
        lines += q_side_table(data, fmt, rows)
    errors = [r for r in data["rows"] if "error" in r]
    if errors:
        lines += ["", "Rows that could not run:", ""]
        lines += [f"- {r['format']} {r['impl']} T={r['T']}: `{r['error'][:300]}`" for r in errors]
    outside = [r for r in data["rows"] if "comparison" in r and not within_bound(r["impl"], r["comparison"])]
    if outside:
        lines += ["", "Gate failures (elements differing from the reference, per output):", ""]
        lines += [f"- {r['format']} {r['impl']} T={r['T']}: {r['comparison']['differing']}" for r in outside]
    return "\n".join(lines) + "\n"


IMPL_COLORS = {"fused": "C0", "eager": "C1", "compile": "C2", "prepfuse": "C3", "fused-q": "C4", "vllm": "C5"}
FORMAT_STYLES = {"fp8": {"linestyle": "-", "marker": "o"}, "mxfp4": {"linestyle": "--", "marker": "s"}}


def render_plot(data: dict, path: Path) -> None:
    """Latency and bandwidth against T (log axes), one line per format x implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_us, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.8))
    for fmt in FORMATS:
        for impl in IMPLS:
            pts = sorted((r["T"], r) for r in data["rows"]
                         if r["format"] == fmt and r["impl"] == impl and "us_median" in r)
            if not pts:
                continue
            ts = [t for t, _ in pts]
            style = {"color": IMPL_COLORS[impl], **FORMAT_STYLES[fmt], "label": f"{fmt} {impl}"}
            ax_us.plot(ts, [r["us_median"] for _, r in pts], **style)
            ax_bw.plot(ts, [r["GBps"] for _, r in pts], **style)
    ax_bw.axhline(data["copy_bandwidth"]["GBps"], color="grey", linestyle=":", label="copy BW")
    ax_us.set(xscale="log", yscale="log", xlabel="T (tokens; Tk = T/4 key rows)", ylabel="us per call (median)")
    ax_bw.set(xscale="log", yscale="log", xlabel="T (tokens; Tk = T/4 key rows)", ylabel="GB/s (fewest bytes)")
    for ax in (ax_us, ax_bw):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"DeepSeek-V4 indexer prep, H={data['H']}, block {data['block_size']}, on {data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(data: dict, json_path: Path, docs_path: Path | None) -> None:
    print(harness.write_page(render_markdown, render_plot, data, json_path, docs_path or json_path.parent / "benchmarks_indexer.md"))


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected some of {','.join(allowed)}, got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=harness.parse_int_list, default=list(DEFAULT_TOKENS), help="T values, e.g. 1,64")
    p.add_argument("--formats", type=_choices(FORMATS), default=list(FORMATS), help="fp8,mxfp4")
    p.add_argument("--impls", type=_choices(IMPLS), default=list(IMPLS), help=",".join(IMPLS))
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where the JSON and the PNG go")
    p.add_argument("--docs", default=str(HERE.parent / "docs" / "benchmarks_indexer.md"), help="the markdown page")
    p.add_argument("--name-suffix", default="", help="appended to the JSON name; the page then goes beside it")
    p.add_argument("--target-ms", type=float, default=60.0, help="replays per row: about this much GPU time")
    p.add_argument("--from-json", default=None, help="regenerate the page and the plot from a result file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    early = harness.from_json_or_cuda(args, write_reports)
    if early is not None:
        return early
    data = run_benchmark(args)
    json_path = Path(args.out_dir) / f"{STEM}_{data['device_slug']}{args.name_suffix}.json"
    write_reports(data, json_path, Path(args.docs) if not args.name_suffix else None)
    bad = failed_rows(data)
    for r in bad:
        print(f"FAILED: {r['format']} {r['impl']} T={r['T']}: {r.get('error') or r['comparison']['differing']}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
