"""Benchmark ``prepfuse::gqa_qknorm_rope_kv_insert`` against the unfused sequence it replaces.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/bench_gqa_qknorm_rope_kv_insert.py --out-dir $OUT
    PYTHONPATH=. python bench/bench_gqa_qknorm_rope_kv_insert.py --sweep-config --out-dir $OUT
    PYTHONPATH=. python bench/bench_gqa_qknorm_rope_kv_insert.py --from-json bench/results/<file>.json

Model rows (``MODELS``): Qwen3-8B heads (32 q, 8 kv, D 128, full NeoX rotary, q/k norm)
with a bf16 and with an fp8 cache, Llama-3-8B heads (no norm, bf16 cache), the operand
forms and cache layouts of Qwen3-8B, and the other head dims (Llama-3.2-1B's 64 and
Gemma-3-12B's 256, each with both caches), block 16.
Implementations, as in ``bench_dsv4_qnorm_rope_kv_insert.py`` (whose timing code this
script imports, so both use one method): ``fused`` (the op through the dispatcher),
``eager`` (``prepfuse.models.gqa_prep_unfused``) and ``compile`` (that function under
``torch.compile``, ``dynamic=False``, ``fullgraph=True``); where vLLM's op library loads
(``bench/vllm_ops.py``), ``vllm``: what vLLM 0.33 runs with its QK-norm + RoPE fusion pass
(``fused_qk_norm_rope``, or ``rotary_embedding`` without a norm, then
``reshape_and_cache_flash``), and for the normed models ``vllm-default``: what it runs without
(two ``rms_norm``, ``rotary_embedding``, ``reshape_and_cache_flash``).

Method: per shape, a correctness gate first (fresh random inputs from
``prepfuse.testing.make_gqa_inputs``, poisoned outputs, each implementation against
``gqa_qknorm_rope_kv_insert_reference``: without the norm bit for bit, with it within
the GPU test's bound, ``gqa_within_bound``); then CUDA graphs of 20 back-to-back calls,
replayed behind a GPU sleep, median per call; L2 rotation over input copies once a call
moves more than a quarter of L2; bytes moved are the fewest the op must move
(``gqa_bytes_moved``), against the copy bandwidth measured at the start.
Writes ``gqa_qknorm_rope_kv_insert_<device>.json``, a PNG beside it and
``docs/benchmarks_gqa.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402  (also puts the repository on sys.path)
import vllm_ops  # noqa: E402

OP = "gqa_qknorm_rope_kv_insert"
IMPLS = ("fused", "eager", "compile", "vllm", "vllm-default")
VLLM_IMPLS = {"vllm": "fused", "vllm-default": "default"}  # impl -> vllm_ops.GQA_PATHS
# operand forms vLLM has a counterpart of (paged caches, the half table, positions; indices
# and caches of other dtypes are converted or viewed before timing)
VLLM_FORMS = ("half", "int32", "v-scale", "uint8")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 16384)
BLOCK_SIZE = 16
SWEEP_BLOCK_H = (1, 2, 4, 8)
SWEEP_NUM_WARPS = (1, 2, 4)
SWEEP_TOKENS = (1,)  # tokens per program; --sweep-tokens 1,2,4 adds the multi-token tiles
FP8 = torch.float8_e4m3fn
# name -> (Hq, Hkv, D, rotary dim, NeoX, norm, cache dtype[, operand form]); the form
# "full" reads a [P, 2R] full-width table (full_cos_sin=True, Hugging Face's cos/sin
# passed in) instead of the [P, R] half table; "heads-first" and "token-pool" write caches
# laid out [NB, Hkv, bs, D] and [N, Hkv, D] (prepfuse.testing.with_cache_layout), as the
# pass emits the op for heads-first paged caches and SGLang's token pool; "operands" reads
# each token's bf16 cos and sin rows as two tensors with positions=None, as the pass hands
# the op the values a Hugging Face rotary module computes (prepfuse.testing.with_cos_sin_operands)
MODELS = {
    "qwen3-8b": (32, 8, 128, 128, True, True, torch.bfloat16),
    "qwen3-8b-fp8": (32, 8, 128, 128, True, True, FP8),
    "llama3-8b": (32, 8, 128, 128, True, False, torch.bfloat16),
    "qwen3-8b-full-cos-sin": (32, 8, 128, 128, True, True, torch.bfloat16, "full"),
    "qwen3-8b-heads-first": (32, 8, 128, 128, True, True, torch.bfloat16, "heads-first"),
    "qwen3-8b-token-pool": (32, 8, 128, 128, True, True, torch.bfloat16, "token-pool"),
    "qwen3-8b-cos-sin-operands": (32, 8, 128, 128, True, True, torch.bfloat16, "operands"),
    # the operands real code needs, each beside the row it extends: int32 slots and positions,
    # negative ones counted from the end (wrap_indices), v's own fp8 scale, fp8 codes into
    # uint8 caches (vLLM's "fp8" cache, a bitcast view), one kv head, and
    # half the head rotated (partial rotary at every T)
    "qwen3-8b-int32": (32, 8, 128, 128, True, True, torch.bfloat16, "int32"),
    "qwen3-8b-wrap": (32, 8, 128, 128, True, True, torch.bfloat16, "wrap"),
    "qwen3-8b-fp8-v-scale": (32, 8, 128, 128, True, True, FP8, "v-scale"),
    "qwen3-8b-fp8-uint8": (32, 8, 128, 128, True, True, FP8, "uint8"),
    "qwen3-8b-one-kv-head": (32, 1, 128, 128, True, True, torch.bfloat16),
    "qwen3-8b-partial": (32, 8, 128, 64, True, True, torch.bfloat16),
    # the other head dims the kernel takes: Llama-3.2-1B's 64, Gemma-3-12B's 256 (its q/k
    # norm here with bf16 weights; Gemma's fp32 1 + w reads 1 KB more a call)
    "llama3.2-1b": (32, 8, 64, 64, True, False, torch.bfloat16),
    "llama3.2-1b-fp8": (32, 8, 64, 64, True, False, FP8),
    "gemma3-12b": (16, 8, 256, 256, True, True, torch.bfloat16),
    "gemma3-12b-fp8": (16, 8, 256, 256, True, True, FP8),
}
# a run's models unless --models names others: the head-dim-128 rows of docs/benchmarks_gqa.md;
# the other head dims are their own run and page (gpu_steps.sh gqa-head-dims), so that
# each fits one GPU call
# the operand rows run as their own page beside the rows they extend (gpu_steps.sh gqa-operands)
OPERAND_FORMS = ("qwen3-8b-int32", "qwen3-8b-wrap", "qwen3-8b-one-kv-head", "qwen3-8b-partial",
                 "qwen3-8b-fp8-v-scale", "qwen3-8b-fp8-uint8")
OPERAND_MODELS = ("qwen3-8b", "qwen3-8b-fp8", *OPERAND_FORMS)
DEFAULT_MODELS = tuple(m for m, v in MODELS.items() if v[2] == 128 and m not in OPERAND_FORMS)


FORM_NOTES = {"full": ", full-width cos/sin (full_cos_sin)", "heads-first": ", heads-first [NB, Hkv, bs, D] caches",
              "token-pool": ", token-pool [N, Hkv, D] caches",
              "operands": ", per-token bf16 cos and sin operands (positions=None)",
              "int32": ", int32 slot_mapping and positions",
              "wrap": ", wrap_indices=True, half the slots and positions negative (counted from the end)",
              "v-scale": ", v_scale beside kv_scale (k's)",
              "uint8": ", fp8 codes into uint8 caches"}


def operand_form(model: tuple) -> str:
    return model[7] if len(model) > 7 else "half"


def full_cos_sin(model: tuple) -> bool:
    return operand_form(model) == "full"


def gqa_bytes_moved(num_tokens: int, model: tuple) -> int:
    """Fewest bytes a call must move: qkv and the cos/sin rows read, q_out and the k and v
    cache rows written (every row inserted; the norm weights are negligible)."""
    hq, hkv, d, rot, _, _, dtype = model[:7]
    cache_elem = 1 if dtype == FP8 else 2
    table_row = rot * {"full": 8, "operands": 2}.get(operand_form(model), 4)
    per_token = (hq + 2 * hkv) * d * 2 + table_row + hq * d * 2 + 2 * hkv * d * cache_elem
    return num_tokens * per_token


def make_inputs(num_tokens: int, model: tuple, *, skip_fraction: float):
    from prepfuse.testing import (
        make_gqa_inputs, seeded_generator, with_cache_layout, with_cos_sin_operands, with_full_cos_sin,
        with_wrapped_indices,
    )

    hq, hkv, d, rot, neox, norm, dtype = model[:7]
    if operand_form(model) == "wrap":  # a negative slot is a row counted from the end there, never a skip
        skip_fraction = 0.0
    inputs = make_gqa_inputs(num_tokens, hq, hkv, d, BLOCK_SIZE, harness.DEVICE, rotary_dim=rot, is_neox=neox,
                             norm=norm, cache_dtype=dtype, skip_fraction=skip_fraction)
    if full_cos_sin(model):  # full width with every entry its own value: the kernel reads all 2R of them
        return with_full_cos_sin(inputs, seeded_generator()[0])
    form = operand_form(model)
    if form == "operands":
        return with_cos_sin_operands(inputs, dtype=torch.bfloat16, per_token=True)[0]
    if form == "int32":
        return dataclasses.replace(inputs, slot_mapping=inputs.slot_mapping.int(), positions=inputs.positions.int())
    if form == "wrap":  # every other index as the same row counted from the end: the same writes
        return with_wrapped_indices(inputs, inputs.k_cache.shape[0] * inputs.k_cache.shape[1])
    if form == "v-scale":
        return dataclasses.replace(inputs, v_scale=inputs.kv_scale * 0.5)
    if form == "uint8":
        return dataclasses.replace(inputs, k_cache=inputs.k_cache.view(torch.uint8),
                                   v_cache=inputs.v_cache.view(torch.uint8))
    if form != "half":
        return with_cache_layout(inputs, form)
    return inputs


def gqa_within_bound(cmp, norm: bool, cache_fp8: bool) -> bool:
    """The fused op against the reference, from the comparison's counts: exact without
    the norm; with it, a one-ulp fp32 difference of the RMS (summation order) may move a
    normed value by one bf16 ULP, carried by RoPE, on at most 0.1% of the values."""
    if not norm:
        return cmp.exact()
    # counts, not sizes: where a*cos - b*sin cancels, one normed ULP is many ULPs (or fp8
    # codes) of the tiny result (the parity test bounds each value by 2^-6 (|a| + |b|));
    # an H200 run saw 3 fp8 codes on 4 of 33.7M cache values at T=16384
    return cmp.q_mismatches <= max(8, cmp.q_elements // 1000) and cmp.cache_mismatches <= max(8, cmp.cache_elements // 1000)


class _Counts:
    """A stored comparison (a dict in the JSON) read like ``GqaComparison``."""

    def __init__(self, counts: dict):
        self.__dict__.update(counts)

    def exact(self) -> bool:
        return self.q_mismatches == 0 and self.cache_mismatches == 0


def vllm_applies(impl: str, model: tuple) -> bool:
    """Whether a vLLM impl has a row for ``model``: its form has a vLLM counterpart, and the
    default path (which differs from the fused one only by the norm) needs the norm."""
    return operand_form(model) in VLLM_FORMS and (impl == "vllm" or model[5])


def make_impls(names) -> dict:
    """impl -> callable; prepfuse's take GqaInputs, vLLM's a vllm_ops.GqaCall (and return q)."""
    from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT
    from prepfuse.models import gqa_prep_unfused

    ops = vllm_ops.load()
    if ops is None and any(n in VLLM_IMPLS for n in names):
        print(f"no vllm column: {vllm_ops.absent_reason()}", flush=True)
    impls = {}
    for name in names:
        if name in VLLM_IMPLS and ops is not None:
            impls[name] = lambda call, path=VLLM_IMPLS[name]: ops.gqa(call, path)
        if name == "fused":
            impls[name] = lambda inp: GQA_QKNORM_ROPE_KV_INSERT(*inp.args())
        elif name == "eager":
            impls[name] = lambda inp: gqa_prep_unfused(*inp.args())
        elif name == "compile":
            compiled = torch.compile(gqa_prep_unfused, dynamic=False, fullgraph=True)
            impls[name] = lambda inp, f=compiled: f(*inp.args())
    return impls


def _gate(fn, inputs, model) -> tuple[bool, dict]:
    import dataclasses

    from prepfuse.ops import gqa_qknorm_rope_kv_insert_reference
    from prepfuse.testing import compare_gqa

    ref, run = inputs.fresh_outputs(), inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*ref.args())
    fn(run)
    torch.cuda.synchronize()
    cmp = compare_gqa(ref, run)
    return gqa_within_bound(cmp, model[5], model[6] == FP8), dataclasses.asdict(cmp)


def _gate_vllm(fn, inputs) -> tuple[bool, dict]:
    """A vLLM path against the reference on the same call, its cos/sin table rounded to bf16
    as vLLM holds it: within ``vllm_ops.gqa_agreement``'s bound."""
    from prepfuse.ops import gqa_qknorm_rope_kv_insert_reference

    inputs = vllm_ops.with_bf16_table(inputs)
    ref, run = inputs.fresh_outputs(), inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*ref.args())
    run.q_out.copy_(fn(vllm_ops.gqa_call(run)))
    torch.cuda.synchronize()
    agreement = vllm_ops.gqa_agreement(ref, run)
    return agreement["within"], agreement


def run_benchmark(args) -> dict:
    t_start = time.time()
    info = harness.device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{OP}_{info['device_slug']}{args.name_suffix}.json"
    harness.allow_recompiles()
    data = {"op": f"prepfuse::{OP}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **info, "block_size": BLOCK_SIZE, "models": {k: list(map(str, MODELS[k])) for k in args.models},
            "vllm": vllm_ops.column_info(), "rows": []}
    data["copy_bandwidth"] = harness.measure_copy_bandwidth(4 << 30)
    copy_bw = data["copy_bandwidth"]["GBps"]
    print(f"{info['device']}: copy bandwidth {copy_bw:.0f} GB/s ({data['copy_bandwidth']['method']})", flush=True)
    data["tiny_graph"] = harness.measure_tiny_graph()  # the T=1 target's floor, this run's
    print(f"one tiny kernel in a graph {data['tiny_graph']['us_median']:.2f} us", flush=True)
    impls = make_impls(args.impls)
    for name in args.models:
        model = MODELS[name]
        for t in sorted(args.tokens):
            nbytes = gqa_bytes_moved(t, model)
            k = harness.rotation_copies(nbytes, info["l2_bytes"], 0.25)
            gate_fused = make_inputs(t, model, skip_fraction=0.1)
            gate_valid = make_inputs(t, model, skip_fraction=0.0)
            copies = [make_inputs(t, model, skip_fraction=0.0) for _ in range(k)]
            line = []
            timed = copies
            for impl, fn in impls.items():
                if impl in VLLM_IMPLS and not vllm_applies(impl, model):
                    continue
                row = {"model": name, "impl": impl, "T": t, "bytes": nbytes, "copies": k}
                try:
                    if impl in VLLM_IMPLS:  # vLLM's operands (its qkv rewritten in place), the same caches
                        row["correct"], row["comparison"] = _gate_vllm(fn, gate_fused)
                        timed = [vllm_ops.gqa_call(c) for c in copies]
                    else:
                        row["correct"], row["comparison"] = _gate(fn, gate_fused if impl == "fused" else gate_valid,
                                                                  model)
                        timed = copies
                    if not row["correct"]:
                        harness.loud(f"{impl} {name} T={t}: outside the bound: {row['comparison']}")
                    graphs = harness.capture_graphs(fn, timed, warmup=3)
                    row.update(harness.time_graphs(graphs, args.target_ms, 10, 200))
                    del graphs
                    row["GBps"] = nbytes / (row["us_median"] * 1e-6) / 1e9
                    row["frac_of_copy_bw"] = row["GBps"] / copy_bw
                    with harness.IndexChecksOff():  # as inside a graph: no host-side check
                        row["launches"] = harness.classify_gpu_activities(
                            harness.count_launches(lambda c=timed[0]: fn(c)))["launches"]
                    line.append(f"{impl} {row['us_median']:.2f} us")
                except Exception as err:  # noqa: BLE001 - record and go on: the table stays complete
                    row["error"] = f"{type(err).__name__}: {err}"
                    harness.loud(f"{impl} {name} T={t}: {row['error']}")
                data["rows"].append(row)
            print(f"[{time.time() - t_start:6.1f} s] {name:13s} T={t:5d}: " + "  ".join(line), flush=True)
            vllm_ops.add_speedup(data["rows"], lambda r: (r["model"], r["T"]))
            del copies, gate_fused, gate_valid, timed
            torch.cuda.empty_cache()
            harness.write_json(path, data)
    data["elapsed_s"] = round(time.time() - t_start, 1)
    harness.write_json(path, data)
    return data


def run_sweep(args) -> dict:
    """Time the fused kernel alone at each (BLOCK_H, num_warps, tokens per program, register
    cap, eviction hints); print the best per shape beside the op's ``_launch_config`` choice
    (with its own ``_row_eviction`` hints, "rule"). Each configuration is gated first."""
    from prepfuse.ops._duplicate_slots import DEDUPE_LOCK, dedupe_mode
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import _launch_config, gqa_qknorm_rope_kv_insert_triton

    info = harness.device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{OP}_sweep_{info['device_slug']}{args.name_suffix}.json"
    data = {"op": f"prepfuse::{OP}", "mode": "sweep-config", **info, "rows": [], "best": []}
    harness.spin_up_clocks()
    # the first timing of a run is discarded (earlier sweeps each had their outlier in the first row timed)
    discard = True
    for name in args.models:
        model = MODELS[name]
        hq, hkv, d = model[:3]
        for t in sorted(args.tokens):
            nbytes = gqa_bytes_moved(t, model)
            k = harness.rotation_copies(nbytes, info["l2_bytes"], 0.25)
            gate = make_inputs(t, model, skip_fraction=0.1)
            copies = [make_inputs(t, model, skip_fraction=0.0) for _ in range(k)]
            locked = dedupe_mode(copies[0].slot_mapping) == DEDUPE_LOCK
            heuristic = _launch_config(t, d, max(hq, hkv), model[5], locked, full_cos_sin(model), model[6] == FP8)
            rows = []
            for bh, w, tp, nreg, ev in itertools.product(args.sweep_block_h, args.sweep_warps, args.sweep_tokens,
                                                         args.sweep_maxnreg, args.sweep_eviction):
                fn = lambda inp, c=(bh, w, tp, nreg), e=(None if ev == "rule" else ev): (  # noqa: E731
                    gqa_qknorm_rope_kv_insert_triton(*inp.args(), launch_config=c, eviction=e))
                row = {"model": name, "T": t, "BLOCK_H": bh, "num_warps": w, "tokens_per_program": tp,
                       "maxnreg": nreg, "eviction": ev,
                       "heuristic": (bh, w, tp, nreg) == (tuple(heuristic) + (0,))[:4] and ev == "rule"}
                try:
                    row["correct"], _ = _gate(fn, gate, model)
                    graphs = harness.capture_graphs(fn, copies, warmup=2)
                    if discard:
                        harness.time_graphs(graphs, args.target_ms, 10, 100)
                        discard = False
                    row.update(harness.time_graphs(graphs, args.target_ms, 10, 100))
                    del graphs
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"
                rows.append(row)
            data["rows"].extend(rows)
            timed = [r for r in rows if "us_median" in r and r["correct"]]
            best = min(timed, key=lambda r: r["us_median"])
            heur = next((r for r in rows if r["heuristic"]), {})  # {} where the sweep leaves it out
            best_config = [best["BLOCK_H"], best["num_warps"], best["tokens_per_program"]] + (
                [best["maxnreg"]] if best["maxnreg"] else []) + ([best["eviction"]] if best["eviction"] != "rule" else [])
            data["best"].append({"model": name, "T": t, "best": best_config, "us": best["us_median"],
                                 "heuristic": list(heuristic), "heuristic_us": heur.get("us_median")})
            print(f"{name:13s} T={t:5d}: best {'/'.join(map(str, best_config))} {best['us_median']:.2f} us; "
                  f"heuristic {'/'.join(map(str, heuristic))} {heur.get('us_median', float('nan')):.2f} us"
                  + ("" if len(timed) == len(rows) else f"  ({len(rows) - len(timed)} configs failed or incorrect)"),
                  flush=True)
            del copies, gate
            torch.cuda.empty_cache()
            harness.write_json(path, data)
    return data


# --------------------------------------------------------------------------------------
# Report: markdown and plot, regenerated from the JSON
# --------------------------------------------------------------------------------------
def render_markdown(data: dict, json_name: str, png_name: str) -> str:
    bw = data["copy_bandwidth"]
    ceiling, ceiling_file = harness.same_size_copy(data["device_slug"])
    vllm = vllm_ops.has_column(data)
    lines = [
        "# Benchmark: prepfuse::gqa_qknorm_rope_kv_insert",
        "",
        "Generated by `bench/bench_gqa_qknorm_rope_kv_insert.py` from "
        f"`bench/results/{json_name}`; do not edit by hand. Plot: `bench/results/{png_name}`.",
        "",
        f"- **Date:** {data['date']}; **device:** {data['device']} ({data['num_sms']} SMs); torch {data['torch']}, "
        f"triton {data['triton']}",
        f"- **Copy bandwidth:** {bw['GBps']:.0f} GB/s ({bw['method']}, read + write bytes)",
        f"- **Method:** as `docs/benchmarks.md` (CUDA graphs of 20 calls, median, L2 rotation for large T); "
        f"block size {data['block_size']}; all slots valid for timing; the gate before timing uses ~10% skipped "
        "slots for the fused op.",
        "- **Models:** " + "; ".join(
            f"`{k}`: Hq {v[0]}, Hkv {v[1]}, D {v[2]}, rotary {v[3]}, {'NeoX' if v[4] == 'True' else 'GPT-J'}, "
            f"{'q/k norm' if v[5] == 'True' else 'no norm'}, {v[6].replace('torch.', '')} cache"
            f"{FORM_NOTES.get(operand_form(v), '')}"
            for k, v in data["models"].items()),
        *(f"- **Note:** {note}" for note in data.get("notes", [])),
        *vllm_ops.page_note(data),
        *harness.same_size_note(ceiling_file),
        harness.decode_target_note(data, "model", data["models"]),
        "",
        "| model | T | fused us | GB/s | % copy BW | % same-size copy | eager us | compile us | fused vs compile | "
        + ("vLLM us | vLLM default us | x vLLM | vLLM gate | " if vllm else "")
        + "launches (f/e/c) | fused gate | q values differing from the reference (f/e/c) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---|" if vllm else "") + "---|---|---|",
    ]
    rows = {(r["model"], r["impl"], r["T"]): r for r in data["rows"]}
    for model in data["models"]:
        for t in sorted({r["T"] for r in data["rows"] if r["model"] == model}):
            f, e, c, v, vd = (rows.get((model, i, t), {}) for i in IMPLS)

            def us(r):
                return f"{r['us_median']:.2f}" if "us_median" in r else "-"
            speed = f"{c['us_median'] / f['us_median']:.1f}x" if "us_median" in f and "us_median" in c else "-"
            # judged from the stored counts with the current bound (gqa_within_bound)
            norm, fp8 = data["models"][model][5] == "True", "float8" in data["models"][model][6]
            cmp = f.get("comparison")
            gate = "-" if cmp is None else ("pass" if gqa_within_bound(_Counts(cmp), norm, fp8) else "FAIL")
            differing = "/".join(str(r["comparison"]["q_mismatches"]) if r.get("comparison") else "-" for r in (f, e, c))
            launches = "/".join(str(r.get("launches", "-")) for r in (f, e, c))
            same_size = harness.same_size_share(ceiling, f"gqa {model}", t, f.get("GBps"))
            vcells = ""
            if vllm:
                x_vllm = f"{f['speedup_vs_vllm']:.1f}x" if "speedup_vs_vllm" in f else "-"
                vgate = "/".join("-" if "correct" not in r else ("pass" if r["correct"] else "FAIL") for r in (v, vd))
                vcells = f" {us(v)} | {us(vd)} | {x_vllm} | {vgate} |"
            lines.append(f"| {model} | {t} | {us(f)} | {f.get('GBps', 0):.0f} | {100 * f.get('frac_of_copy_bw', 0):.0f}% "
                         f"| {same_size} | {us(e)} | {us(c)} | {speed} |{vcells} {launches} | {gate} | {differing} |")
    lines += ["", "The baselines are not gated. Inductor's code for the unfused math rounds its own way: torch 2.11's "
              "`pointless_convert` drops the bf16 round trip of the normed value (the 40% of Qwen3 q values above) "
              "and products may be contracted; eager PyTorch, with valid slots, matches the reference.",
              "", "The fused gate is judged from the stored counts with `gqa_within_bound`; a run's own verdict "
              "(`correct` in the JSON) used the bound of its day (the first H200 run's one-e4m3-code rule failed "
              "Qwen3 fp8 at T=16384 on 4 cache values 3 codes apart where RoPE cancels; the rule is now a count)."]
    if vllm:
        lines += ["", "`vLLM us` is what vLLM 0.33 runs with its QK-norm + RoPE fusion pass (`fused_qk_norm_rope`, "
                  "or `rotary_embedding` without a norm, then `reshape_and_cache_flash`), `vLLM default us` what it "
                  "runs without (two `rms_norm`, `rotary_embedding`, `reshape_and_cache_flash`); `x vLLM` is the "
                  "former's time over the fused op's. vLLM reads its cos/sin table in bf16 and rewrites qkv in "
                  "place; its gate (fusion-pass / default path) holds its writes against the reference on that "
                  "table within `vllm_ops.gqa_agreement`'s bound."]
    return "\n".join(lines) + "\n"


def render_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(data["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 8), squeeze=False)
    for j, model in enumerate(models):
        for impl in IMPLS:
            pts = sorted((r["T"], r) for r in data["rows"] if r["model"] == model and r["impl"] == impl and "us_median" in r)
            if not pts:
                continue
            ts = [t for t, _ in pts]
            label = f"{impl} (vLLM 0.33)" if impl in VLLM_IMPLS else impl
            axes[0][j].plot(ts, [r["us_median"] for _, r in pts], marker="o", label=label)
            axes[1][j].plot(ts, [r["GBps"] for _, r in pts], marker="o", label=label)
        axes[1][j].axhline(data["copy_bandwidth"]["GBps"], color="grey", linestyle="--", label="copy BW")
        axes[0][j].set(title=model, xscale="log", yscale="log", ylabel="us per call", xlabel="T")
        axes[1][j].set(xscale="log", ylabel="GB/s (fewest bytes)", xlabel="T")
        axes[0][j].legend()
        axes[1][j].legend()
    fig.suptitle(f"prepfuse::{OP} on {data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(data: dict, json_path: Path, docs_path: Path | None) -> None:
    """Plot and page of a result file; the page by default named after the JSON:
    ``<OP>_<device><suffix>.json`` -> ``docs/benchmarks_gqa<suffix>.md``."""
    suffix = json_path.stem.removeprefix(f"{OP}_{data['device_slug']}")
    docs_path = docs_path or HERE.parent / "docs" / f"benchmarks_gqa{suffix}.md"
    print(harness.write_page(render_markdown, render_plot, data, json_path, docs_path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=harness.parse_int_list, default=list(DEFAULT_TOKENS))
    p.add_argument("--models", type=lambda s: s.split(","), default=list(DEFAULT_MODELS))
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--docs", default=None,
                   help="the page (default docs/benchmarks_gqa.md, with --from-json docs/benchmarks_gqa<the "
                        "JSON's suffix>.md; a run with --name-suffix writes benchmarks_gqa<suffix>.md beside its JSON)")
    p.add_argument("--name-suffix", default="")
    p.add_argument("--target-ms", type=float, default=60.0)
    p.add_argument("--sweep-config", action="store_true")
    p.add_argument("--sweep-block-h", type=harness.parse_int_list, default=list(SWEEP_BLOCK_H))
    p.add_argument("--sweep-warps", type=harness.parse_int_list, default=list(SWEEP_NUM_WARPS))
    p.add_argument("--sweep-tokens", type=harness.parse_int_list, default=list(SWEEP_TOKENS),
                   help="tokens per program (powers of two)")
    p.add_argument("--sweep-maxnreg", type=lambda s: [int(v) for v in s.split(",")], default=[0],
                   help="registers a thread at most (0: the compiler's choice)")
    p.add_argument("--sweep-eviction", type=lambda s: s.split(","), default=["rule"],
                   help="row-load / output-store L2 hints: rule (the op's _row_eviction), none, loads, stores, both")
    p.add_argument("--from-json", default=None)
    args = p.parse_args(argv)
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import EVICTIONS

    for e in args.sweep_eviction:
        if e != "rule" and e not in EVICTIONS:
            p.error(f"--sweep-eviction: unknown {e!r}; known: rule, {', '.join(EVICTIONS)}")
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; known: {', '.join(MODELS)}")
    early = harness.from_json_or_cuda(args, write_reports)
    if early is not None:
        return early
    import prepfuse  # noqa: F401  (registers the ops)

    if args.sweep_config:
        run_sweep(args)
        return 0
    data = run_benchmark(args)
    json_path = Path(args.out_dir) / f"{OP}_{data['device_slug']}{args.name_suffix}.json"
    # a partial run (--name-suffix) keeps its page beside its JSON, not over the repository's
    docs = Path(args.docs) if args.docs else (json_path.parent / f"benchmarks_gqa{args.name_suffix}.md"
                                              if args.name_suffix else None)
    write_reports(data, json_path, docs)
    bad = [r for r in data["rows"] if r["impl"] == "fused" and not r.get("correct")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
