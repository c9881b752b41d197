"""Benchmark ``prepfuse::dsv4_qnorm_rope_kv_insert`` against the unfused sequence it replaces.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_insert.py --out-dir $OUT
    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_insert.py --sweep-config --out-dir $OUT
    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_insert.py --from-json bench/results/<file>.json
    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_insert.py --v41 --out-dir $OUT

``--v41``: DeepSeek-V4.1's flags on every implementation (``apply_q_norm=False, kv_mxfp8=True``:
q rotated without a norm, kv as 528-byte MXFP8 records, vLLM's call with the same flags), block
32 by default, results named ``..._v41`` and the page ``docs/benchmarks_v41.md``.

Three implementations, one shape at a time (T tokens, H heads, HP padded heads, block size):

- ``fused``: the op through the dispatcher (``torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert``,
  on CUDA the Triton kernel);
- ``eager``: ``prepfuse.models.dsv4_prep_unfused``, the same math as plain PyTorch ops;
- ``compile``: that function under ``torch.compile`` (default mode, ``dynamic=False``,
  ``fullgraph=True``);
- ``vllm``: vLLM 0.33's own op for an fp8_ds_mla cache
  (``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``, ``bench/vllm_ops.py``), where its op
  library is present (left out, with the reason in the JSON and the page, where it is not).

Method (bench/README.md says more):

1. Correctness gate per shape, before any timing: fresh random inputs, poisoned outputs,
   each implementation against ``dsv4_qnorm_rope_kv_insert_reference`` by
   ``compare_dsv4(...).within_spec()`` (the fused op with ~10% skipped slots, the
   baselines, which require valid slots, with all slots valid). Failures are printed
   loudly and recorded; timing goes on so the table stays complete, marked FAIL.
2. Each implementation is captured in CUDA graphs (warm-up on a side stream first, which
   also compiles) and timed by replay: CUDA events around each replay, replays queued
   behind a ``torch.cuda._sleep`` so the events measure GPU time, not host launch cost.
   Median, p10, p90 over N replays, N chosen for ~``--target-ms`` of replays (20..200).
3. L2: the H200's L2 (50 MiB usable) would serve repeated replays of a mid-sized shape
   from cache. When a call moves at least ``--warm-below-l2`` of L2, the benchmark
   rotates among K copies of the whole input/output set, one graph per copy, replayed
   round-robin, with K * bytes >= 3 * L2 (K <= 16), so every replay finds its data in
   HBM. Rotation rather than flushing with a 256 MB write between replays: a write
   flush leaves L2 full of dirty lines whose write-back lands inside the next timed
   replay, and a production call's inputs come from the preceding op, not from a
   freshly emptied cache. Below the threshold (T <= 64 at these H) the op is latency
   bound and is timed warm, as a decode step finds its q in L2 after the q projection.
4. Bytes per call are the fewest the op must move (``bytes_moved``); GB/s is bytes over
   the median; ``frac_of_copy_bw`` divides by the device-to-device copy bandwidth
   measured at the start (4 GiB ``dst.copy_(src)``, read + write bytes, graph replay).
5. Launches per call: after all timing (so profiling never precedes a timed replay),
   ``torch.profiler`` with CUDA activity over one non-graph call of each implementation
   at each shape, counting GPU activities (kernels, memsets, memcpys; CUPTI's
   synchronisation records are not work and are dropped). The fused op's host-side
   index check (reductions and a device-to-host copy, skipped inside a CUDA graph) is
   switched off for that call, so the count is what the graph holds. For T <= 512 one
   graph replay is profiled too, as a cross-check (``launches_graph``).

Outputs: ``<out-dir>/dsv4_qnorm_rope_kv_insert_<device>.json`` (raw rows, written after
every shape), ``.png`` beside it, ``<out-dir>/benchmarks.md`` and ``docs/benchmarks.md``
(regenerated wholly from the JSON by ``render_markdown``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

import vllm_ops  # noqa: E402  (bench/ is on sys.path: the script's own folder)
from harness import (  # noqa: E402  (harness also puts the repository on sys.path)
    CALLS_PER_GRAPH, COLD_FACTOR, MAX_COPIES, REPO_ROOT, IndexChecksOff, allow_recompiles, capture_graphs,
    classify_gpu_activities, count_launches, device_info, loud, measure_copy_bandwidth, measure_tiny_graph,
    parse_int_list, rotation_copies, spin_up_clocks, time_graphs, write_json,
)

from prepfuse.ops.dsv4_qnorm_rope_kv_insert import HEAD_DIM, MXFP8_SLOT_BYTES, ROPE_DIM, SLOT_BYTES

OP = "dsv4_qnorm_rope_kv_insert"
IMPLS = ("fused", "eager", "compile", "vllm")
BASELINES = ("eager", "compile")
VLLM_LABEL = "vLLM 0.33 op, this run"
DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 16384)
DEFAULT_HEADS = (16, 64, 128)
DEFAULT_BLOCK_SIZES = (64, 256)
SWEEP_BLOCK_H = (1, 2, 4, 8)
SWEEP_NUM_WARPS = (2, 4, 8)

DEVICE = "cuda"  # every tensor the benchmark makes lives here (a CPU dry run may rebind it)
V41 = False  # --v41: DeepSeek-V4.1's flags (apply_q_norm=False, kv_mxfp8=True) on every call
EPS = 1e-6
MAX_POS = 8192  # rows of cos_sin_cache, as make_dsv4_inputs
SPARE_SLOTS = 64  # cache slots beyond the inserted rows, as make_dsv4_inputs
HOST_DRAW_LIMIT = 1 << 23  # q elements up to which gate inputs come from make_dsv4_inputs

# docs/design.md (measured floors), fused op, H=64 HP=64: T -> ("us", max) or ("frac", min of copy bandwidth)
TARGETS = {1: ("us", 1.8), 64: ("us", 4.5), 512: ("us", 25.0), 4096: ("frac", 0.90), 16384: ("frac", 0.92)}
# docs/design.md, production CUDA kernel: H -> {T: us}
PRODUCTION_US = {
    64: {1: 2.0, 8: 2.2, 64: 5.4, 512: 32.0, 4096: 149.0, 16384: 562.0},
    16: {1: 2.0, 64: 3.6, 512: 16.3, 4096: 97.0, 16384: 369.0},
}
# docs/design.md, unfused PyTorch at H=64: impl -> (kernels, {T: us})
UNFUSED_MEASURED = {"eager": (46, {1: 76.0, 16384: 10100.0}), "compile": (13, {1: 15.5, 16384: 1330.0})}
DESIGN_COPY_BW_GBPS = 4240.0


# --------------------------------------------------------------------------------------
# Shapes, bytes, names
# --------------------------------------------------------------------------------------
def padded_heads(num_heads: int) -> int:
    """FlashMLA's q head padding: 64 up to 64 real heads, else 128."""
    return 64 if num_heads <= 64 else 128


def bytes_moved(num_tokens: int, num_heads: int, padded: int, num_inserted: int) -> int:
    """The fewest bytes one call must move through HBM (each input read once, each output
    written once).

    reads:  q            T * H * 512 * 2     (bf16)
            kv           T' * 512 * 2        (only inserted rows are needed)
            positions    T * 8
            slot_mapping T' * 8
            cos/sin      T * 64 * 4          (one row per token; an upper bound on the
                                              distinct rows, < 1% of the total at H >= 16)
    writes: q_out        T * HP * 512 * 2    (padded heads included: they are written)
            cache        T' * 584            (576 data bytes + 8 scale bytes per slot; 528
                                              bytes, an MXFP8 record, with --v41)
    """
    t, tp = num_tokens, num_inserted
    return (
        t * num_heads * HEAD_DIM * 2
        + tp * HEAD_DIM * 2
        + t * 8
        + tp * 8
        + t * ROPE_DIM * 4
        + t * padded * HEAD_DIM * 2
        + tp * (MXFP8_SLOT_BYTES if V41 else SLOT_BYTES)
    )


def result_paths(out_dir: Path, slug: str, suffix: str = "") -> tuple[Path, Path]:
    stem = f"{OP}_{slug}{suffix}"
    return out_dir / f"{stem}.json", out_dir / f"{stem}.png"


def _parse_impls(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in IMPLS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"implementations must be among {','.join(IMPLS)}, got {text!r}")
    return values


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------
def random_inputs(num_tokens, num_heads, padded, block_size, device, gen, cos_sin, *, slots, skip_fraction=0.0):
    """Inputs with make_dsv4_inputs's shapes and distributions, drawn on the device.

    (Drawing 1e9 normals on the host takes ~30 s; on the GPU, milliseconds.)
    ``slots="random"``: distinct random slots (as make_dsv4_inputs), ~``skip_fraction``
    of them -1. ``slots="blocks"``: a paged sequence, blocks in random order, rows
    consecutive inside a block, none skipped. Outputs come poisoned.
    """
    from prepfuse.testing import Dsv4Inputs

    t, h = num_tokens, num_heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = (randn(t, h, HEAD_DIM) * torch.exp(randn(t, h, 1) * 2)).to(torch.bfloat16)
    kv_scale = torch.exp(randn(t, 8, 1) * 4).clamp(1e-6, 1e3)
    kv = (randn(t, 8, 64) * kv_scale).reshape(t, HEAD_DIM).to(torch.bfloat16)
    num_blocks = -(-(t + SPARE_SLOTS) // block_size)
    slot_bytes, page = (MXFP8_SLOT_BYTES, 512) if V41 else (SLOT_BYTES, 576)
    row_stride = -(-block_size * slot_bytes // page) * page
    if slots == "random":
        slot_mapping = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:t]
        skip = torch.rand(t, generator=gen, device=device) < skip_fraction
        slot_mapping = torch.where(skip, torch.full_like(slot_mapping, -1), slot_mapping)
    elif slots == "blocks":
        block_order = torch.randperm(num_blocks, generator=gen, device=device)
        tok = torch.arange(t, device=device)
        slot_mapping = block_order[tok // block_size] * block_size + tok % block_size
    else:
        raise ValueError(f"slots: 'random' or 'blocks', got {slots!r}")
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, device=device)
    return Dsv4Inputs(
        q=q,
        kv=kv,
        q_out=torch.empty(t, padded, HEAD_DIM, dtype=torch.bfloat16, device=device),
        k_cache=torch.empty(num_blocks, row_stride, dtype=torch.uint8, device=device),
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin,
        eps=EPS,
        block_size=block_size,
        apply_q_norm=not V41,
        kv_mxfp8=V41,
    ).fresh_outputs()


def gate_inputs(num_tokens, num_heads, padded, block_size, device, gen, cos_sin):
    """Fresh random gate inputs with ~10% skipped slots: prepfuse.testing.make_dsv4_inputs
    where drawing on the host is quick, else the same distributions drawn on the device."""
    if num_tokens * num_heads * HEAD_DIM <= HOST_DRAW_LIMIT:
        from prepfuse.testing import make_dsv4_inputs

        return make_dsv4_inputs(
            num_tokens, num_heads, padded, block_size, device, spare_slots=SPARE_SLOTS, max_pos=MAX_POS, eps=EPS,
            apply_q_norm=not V41, kv_mxfp8=V41,
        )
    return random_inputs(num_tokens, num_heads, padded, block_size, device, gen, cos_sin, slots="random", skip_fraction=0.1)


def with_valid_slots(inputs, gen):
    """The same inputs with distinct random slots, none skipped, and fresh poisoned outputs."""
    n_slots = inputs.k_cache.shape[0] * inputs.block_size
    perm = torch.randperm(n_slots, generator=gen, device=inputs.q.device)[: inputs.slot_mapping.shape[0]]
    return dataclasses.replace(inputs, slot_mapping=perm).fresh_outputs()


def same_shapes(a, b) -> bool:
    return all(
        x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
        for x, y in zip(a.args()[:7], b.args()[:7])
    )


# --------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------
def compiled_unfused():
    """``dsv4_prep_unfused`` under torch.compile; room for one graph per benchmarked shape."""
    from prepfuse.models import dsv4_prep_unfused

    allow_recompiles()
    return torch.compile(dsv4_prep_unfused, dynamic=False, fullgraph=True)


def make_impls(names: list[str]) -> dict:
    """impl name -> callable(Dsv4Inputs)."""
    from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
    from prepfuse.models import dsv4_prep_unfused

    impls = {}
    for name in names:
        if name == "fused":
            impls[name] = lambda inp: DSV4_QNORM_ROPE_KV_INSERT(*inp.args())
        elif name == "eager":
            impls[name] = lambda inp: dsv4_prep_unfused(*inp.args())
        elif name == "compile":
            compiled = compiled_unfused()
            impls[name] = lambda inp, f=compiled: f(*inp.args())
        elif name == "vllm" and vllm_ops.load() is not None:
            impls[name] = vllm_ops.load().dsv4_fp8_ds_mla_insert  # returns the padded q it allocates
    return impls


# --------------------------------------------------------------------------------------
# The measuring run
# --------------------------------------------------------------------------------------
def _plan(args) -> tuple[list[tuple], list[dict]]:
    """(shapes to run as (H, block_size, T, impls), rows deliberately left out)."""
    heads = sorted(args.heads, key=lambda h: (h != 64, h))  # the target shapes first
    shapes, left_out = [], []
    for h in heads:
        for bs in args.block_sizes:
            for t in sorted(args.tokens):
                impls = []
                for impl in args.impls:
                    if impl == "vllm" and not vllm_ops.dsv4_fits(t, padded_heads(h)):
                        left_out.append({"impl": impl, "T": t, "H": h, "block_size": bs, "reason": "vLLM's op faults "
                                         "where q reaches 2^31 bytes (an illegal memory access on an H100)"})
                    elif impl in BASELINES and not args.full_baselines and bs != min(args.block_sizes) and h != 64:
                        left_out.append({"impl": impl, "T": t, "H": h, "block_size": bs, "reason": "plan: baselines "
                                         "at the smallest block size only, except H=64 (--full-baselines)"})
                    else:
                        impls.append(impl)
                shapes.append((h, bs, t, impls))
    return shapes, left_out


def _gate(impl_fn, inputs, reference_cache: dict):
    """Run ``impl_fn`` on fresh outputs of ``inputs``; compare with the reference."""
    from prepfuse.ops import dsv4_qnorm_rope_kv_insert_reference
    from prepfuse.testing import compare_dsv4

    key = id(inputs)
    if key not in reference_cache:
        ref = inputs.fresh_outputs()
        dsv4_qnorm_rope_kv_insert_reference(*ref.args())
        reference_cache[key] = ref
    ref = reference_cache[key]
    run = inputs.fresh_outputs()
    q = impl_fn(run)
    if isinstance(q, torch.Tensor):  # vLLM's op allocates and returns the padded q
        run.q_out.copy_(q)
    torch.cuda.synchronize()
    cmp = compare_dsv4(ref, run)
    return cmp.within_spec(), dataclasses.asdict(cmp)


def _replay_matches_eager(impl_fn, copy0) -> bool:
    """The bytes the timed graph replays left in copy 0 equal one plain call's on fresh
    outputs (docs/design.md, lesson 5: a captured region can differ from eager)."""
    run = copy0.fresh_outputs()
    impl_fn(run)
    torch.cuda.synchronize()
    return torch.equal(run.q_out.view(torch.int16), copy0.q_out.view(torch.int16)) and torch.equal(
        run.k_cache, copy0.k_cache
    )


def run_benchmark(args) -> dict:
    from prepfuse.testing import CACHE_POISON, Q_POISON, rope_cos_sin_cache

    t_start = time.time()
    info = device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = result_paths(out_dir, info["device_slug"], args.name_suffix)
    print(f"prepfuse bench {OP}: {info['device']} (sm_{info['capability'].replace('.', '')}, "
          f"{info['num_sms']} SMs, L2 {info['l2_bytes'] / 2**20:.0f} MiB), torch {info['torch']}, "
          f"triton {info['triton']}, CUDA {info['cuda']}", flush=True)

    copy_bw = measure_copy_bandwidth(args.copy_bytes)
    torch.cuda.empty_cache()  # the copy's 8 GiB went with its frame
    tiny = measure_tiny_graph()
    print(f"copy bandwidth {copy_bw['GBps']:.0f} GB/s ({copy_bw['bytes_per_copy'] / 2**30:.1f} GiB copy, read+write; "
          f"design.md: {DESIGN_COPY_BW_GBPS:.0f}); one tiny kernel in a graph {tiny['us_median']:.2f} us (design.md: 1.09)",
          flush=True)

    if "vllm" in args.impls and vllm_ops.load() is None:
        print(f"no vllm column: {vllm_ops.absent_reason()}", flush=True)
        args.impls = [i for i in args.impls if i != "vllm"]
    shapes, left_out = _plan(args)
    data = {
        "op": f"prepfuse::{OP}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **info,
        "copy_bw": copy_bw,
        "tiny_graph": tiny,
        "args": {k: v for k, v in vars(args).items() if k not in ("from_json",)},
        "method": {
            "timing": "CUDA-graph replay, CUDA events around each replay, replays queued behind a GPU sleep; "
                      "median/p10/p90 over N replays (N for ~target_ms, 20..200)",
            "l2": f"copies rotated round-robin (one graph each) when bytes >= {args.warm_below_l2} * L2, "
                  f"K * bytes >= {COLD_FACTOR} * L2, K <= {MAX_COPIES}; otherwise warm (one copy)",
            "bytes": "fewest bytes per call: q, kv[:T'], positions, slots, cos/sin rows (T * 256), "
                     "q_out incl. padded heads, 584 cache bytes per inserted slot",
            "launches": "torch.profiler CUDA activities over one non-graph call (fused: host index check off), "
                        "kernels + memsets + memcpys; launches_graph: one profiled graph replay (T <= 512)",
            "correctness": "fresh random inputs, poisoned outputs, compare_dsv4(reference, impl).within_spec(); "
                           "fused with ~10% skipped slots (a failure is fatal), baselines with all slots valid "
                           "(a difference is their own rounding, recorded); replay_matches_eager: the bytes copy 0 "
                           "holds after the timed replays equal one plain call's",
            "slots_timed": "all valid: blocks in random order, consecutive rows within a block",
        },
        "vllm": vllm_ops.column_info(),
        "rows": [],
        "left_out": left_out,
        "skipped": [],
        "status": "running",
    }
    write_json(json_path, data)

    impls = make_impls(args.impls)
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little"))
    cos_sin = rope_cos_sin_cache(MAX_POS, DEVICE)
    failures = []

    for h, bs, t, shape_impls in shapes:
        hp = padded_heads(h)
        nbytes = bytes_moved(t, h, hp, t)
        elapsed = time.time() - t_start
        todo = []
        for impl in shape_impls:
            if impl in BASELINES and elapsed > args.budget_s:
                data["skipped"].append({"impl": impl, "T": t, "H": h, "block_size": bs,
                                        "reason": f"time budget ({args.budget_s:.0f} s) spent"})
            else:
                todo.append(impl)
        if not todo:
            continue
        k = rotation_copies(nbytes, info["l2_bytes"], args.warm_below_l2)
        print(f"\n[{elapsed:6.1f} s] T={t} H={h} HP={hp} block_size={bs}: {nbytes / 1e6:.2f} MB/call, "
              f"{'warm L2' if k == 1 and nbytes < args.warm_below_l2 * info['l2_bytes'] else f'{k} rotated copies'}",
              flush=True)

        # correctness gate (fresh inputs; reference on the device)
        gate = gate_inputs(t, h, hp, bs, DEVICE, gen, cos_sin)
        gate_valid = with_valid_slots(gate, gen)
        references: dict = {}
        gates = {}
        for impl in todo:
            t0 = time.time()
            try:
                ok, detail = _gate(impls[impl], gate if impl in ("fused", "vllm") else gate_valid, references)
            except Exception as err:  # noqa: BLE001 - a broken impl must not end the run
                ok, detail = False, {"error": f"{type(err).__name__}: {err}"}
            detail["seconds"] = round(time.time() - t0, 2)
            gates[impl] = (ok, detail)
            if impl == "fused" and not ok or "error" in detail:
                failures.append((impl, t, h, bs))
                loud(f"CORRECTNESS GATE FAILED: {impl} T={t} H={h} block_size={bs}: {detail}")
            elif not ok:  # a baseline's own rounding (fp contraction, reduction order): recorded, not fatal
                print(f"  note: {impl} differs from the reference beyond the DeepSeek-V4 bound: "
                      f"{detail['q_mismatches']} q values (max {detail['q_max_ulp']} ULP), "
                      f"{detail['cache_mismatches']} cache bytes (max {detail['cache_max_code_diff']} codes)", flush=True)
        del references

        copies = [random_inputs(t, h, hp, bs, DEVICE, gen, cos_sin, slots="blocks") for _ in range(k)]
        if not same_shapes(copies[0], gate_valid):
            loud(f"timing inputs differ in shape from the gate inputs at T={t} H={h} block_size={bs}")
        del gate, gate_valid

        for impl in todo:
            ok, detail = gates[impl]
            row = {"impl": impl, "T": t, "H": h, "HP": hp, "block_size": bs, "n_insert": t, "bytes": nbytes,
                   "copies": k, "l2": "warm" if k == 1 and nbytes < args.warm_below_l2 * info["l2_bytes"] else "cold",
                   "correct": ok, "gate": detail}
            if impl == "compile":
                row["compile_s"] = detail.get("seconds")
            try:
                graphs = capture_graphs(impls[impl], copies, warmup=3 if impl == "compile" else 2)
                for c in copies:  # capturing runs nothing: from here on only the replays write
                    c.q_out.fill_(Q_POISON)
                    c.k_cache.fill_(CACHE_POISON)
                stats = time_graphs(graphs, args.target_ms, args.min_replays, args.max_replays)
                del graphs
                row.update(stats)
                row["GBps"] = nbytes / (stats["us_median"] * 1e-6) / 1e9
                row["frac_of_copy_bw"] = row["GBps"] / copy_bw["GBps"]
                row["replay_matches_eager"] = _replay_matches_eager(impls[impl], copies[0])
                if not row["replay_matches_eager"]:
                    failures.append((impl + " (replay)", t, h, bs))
                    loud(f"GRAPH REPLAY OUTPUT DIFFERS FROM A PLAIN CALL: {impl} T={t} H={h} block_size={bs}")
                gate_word = "pass" if ok else ("FAIL" if impl == "fused" else "differs")
                print(f"  {impl:8s} {stats['us_median']:10.2f} us  (p10 {stats['us_p10']:.2f}, p90 {stats['us_p90']:.2f},"
                      f" n={stats['replays']})  {row['GBps']:8.0f} GB/s  {100 * row['frac_of_copy_bw']:5.1f}% copy"
                      f"  gate {gate_word}", flush=True)
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {err}"
                failures.append((impl + " (error)", t, h, bs))
                loud(f"{impl} T={t} H={h} block_size={bs} could not be timed: {row['error']}")
            data["rows"].append(row)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        vllm_ops.add_speedup(data["rows"], lambda r: (r["T"], r["H"], r["block_size"]))
        del copies
        torch.cuda.empty_cache()
        data["elapsed_s"] = round(time.time() - t_start, 1)
        write_json(json_path, data)

    if not args.no_launches:
        print(f"\n[{time.time() - t_start:6.1f} s] counting launches (torch.profiler)", flush=True)
        _count_all_launches(data, impls, gen, cos_sin)
    data["status"] = "done"
    data["failures"] = [list(f) for f in failures]
    data["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(json_path, data)
    write_reports(data, json_path, png_path, out_dir / "benchmarks.md", None if args.no_docs else Path(args.docs))
    print_summary(data)
    if failures:
        loud(f"{len(failures)} correctness failure(s): {failures}")
    print(f"\nwrote {json_path}, {png_path}, {out_dir / 'benchmarks.md'}"
          + ("" if args.no_docs else f", {args.docs}") + f"  ({data['elapsed_s']:.0f} s)")
    return data


def _count_all_launches(data: dict, impls: dict, gen, cos_sin) -> None:
    x = torch.ones(1, device=DEVICE)
    count_launches(lambda: x.add_(1.0))  # a throwaway first profile initialises CUPTI
    for row in data["rows"]:
        if "error" in row:
            continue
        fn = impls[row["impl"]]
        try:
            inp = random_inputs(row["T"], row["H"], row["HP"], row["block_size"], DEVICE, gen, cos_sin, slots="blocks")
            with IndexChecksOff():
                fn(inp)  # compiled already; a cache miss would compile here, outside the profile
                names = count_launches(lambda: fn(inp))
            row.update(classify_gpu_activities(names))
            if row["T"] == min(r["T"] for r in data["rows"]):
                row["launch_names"] = names
            if row["T"] <= 512:
                graphs = capture_graphs(fn, [inp], warmup=1, calls=1)
                row["launches_graph"] = classify_gpu_activities(count_launches(graphs[0].replay))["launches"]
        except Exception as err:  # noqa: BLE001
            row["launches_error"] = f"{type(err).__name__}: {err}"
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# Launch-configuration sweep of the fused kernel
# --------------------------------------------------------------------------------------
def launch_fused_kernel(inp, block_h: int, num_warps: int) -> None:
    """The op's own launcher with a chosen (BLOCK_H, num_warps); ``run_sweep`` still
    checks each configuration against the reference before timing it."""
    from prepfuse.ops import dsv4_qnorm_rope_kv_insert_triton

    dsv4_qnorm_rope_kv_insert_triton(*inp.args(), launch_config=(block_h, num_warps))


def run_sweep(args) -> dict:
    from prepfuse.ops.dsv4_qnorm_rope_kv_insert import _launch_config
    from prepfuse.testing import rope_cos_sin_cache

    t_start = time.time()
    info = device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{OP}_sweep_{info['device_slug']}{args.name_suffix}.json"
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little"))
    cos_sin = rope_cos_sin_cache(MAX_POS, DEVICE)
    bs = args.block_sizes[0]
    configs = [(bh, w) for bh in args.sweep_block_h for w in args.sweep_warps]
    data = {"op": f"prepfuse::{OP}", "mode": "sweep-config", "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), **info, "block_size": bs, "rows": [], "best": []}
    print(f"sweep of the fused kernel's launch config on {info['device']}, block_size={bs}", flush=True)
    spin_up_clocks()
    # the first timing of a run is discarded (each H200 sweep's first row timed was its outlier)
    discard = True

    for h in args.heads:
        hp = padded_heads(h)
        for t in sorted(args.tokens):
            nbytes = bytes_moved(t, h, hp, t)
            heuristic = tuple(_launch_config(t, hp))
            gate = gate_inputs(t, h, hp, bs, DEVICE, gen, cos_sin)
            references: dict = {}
            k = rotation_copies(nbytes, info["l2_bytes"], args.warm_below_l2)
            copies = [random_inputs(t, h, hp, bs, DEVICE, gen, cos_sin, slots="blocks") for _ in range(k)]
            shape_rows = []
            for bh, w in configs:
                row = {"T": t, "H": h, "HP": hp, "block_size": bs, "BLOCK_H": bh, "num_warps": w, "bytes": nbytes,
                       "copies": k, "heuristic": (bh, w) == heuristic}
                try:
                    fn = lambda inp, bh=bh, w=w: launch_fused_kernel(inp, bh, w)  # noqa: E731
                    row["correct"], _ = _gate(fn, gate, references)
                    graphs = capture_graphs(fn, copies, warmup=2)
                    if discard:
                        time_graphs(graphs, args.target_ms, args.min_replays, args.max_replays)
                        discard = False
                    row.update(time_graphs(graphs, args.target_ms, args.min_replays, args.max_replays))
                    del graphs
                    row["GBps"] = nbytes / (row["us_median"] * 1e-6) / 1e9
                except Exception as err:  # noqa: BLE001 - e.g. out of registers for one config
                    row["error"] = f"{type(err).__name__}: {err}"
                shape_rows.append(row)
                data["rows"].append(row)
            del copies, gate, references
            torch.cuda.empty_cache()
            timed = [r for r in shape_rows if "us_median" in r and r.get("correct")]
            if timed:
                best = min(timed, key=lambda r: r["us_median"])
                heur = next((r for r in shape_rows if r["heuristic"] and "us_median" in r), None)
                data["best"].append({
                    "T": t, "H": h, "BLOCK_H": best["BLOCK_H"], "num_warps": best["num_warps"], "us": best["us_median"],
                    "heuristic": list(heuristic), "heuristic_us": heur["us_median"] if heur else None,
                })
            bad = [(r["BLOCK_H"], r["num_warps"]) for r in shape_rows if not r.get("correct")]
            print(f"[{time.time() - t_start:6.1f} s] T={t:5d} H={h:3d}: "
                  + "  ".join(f"{r['BLOCK_H']}/{r['num_warps']}:{r['us_median']:.1f}" for r in timed)
                  + (f"  INCORRECT or failed: {bad}" if bad else ""), flush=True)
            write_json(path, data)

    print("\nbest launch config per shape (BLOCK_H / num_warps), vs the op's _launch_config:")
    print(f"{'T':>6s} {'H':>4s} {'best':>6s} {'us':>9s} {'heuristic':>10s} {'us':>9s} {'heur/best':>9s}")
    for b in data["best"]:
        hu = b["heuristic_us"]
        print(f"{b['T']:>6d} {b['H']:>4d} {b['BLOCK_H']:>3d}/{b['num_warps']:<2d} {b['us']:9.2f} "
              f"{b['heuristic'][0]:>6d}/{b['heuristic'][1]:<3d} {hu if hu is not None else float('nan'):9.2f} "
              f"{(hu / b['us']) if hu else float('nan'):9.2f}")
    data["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(path, data)
    print(f"\nwrote {path} ({data['elapsed_s']:.0f} s)")
    return data


# --------------------------------------------------------------------------------------
# Reports: markdown and plot, regenerated wholly from the JSON
# --------------------------------------------------------------------------------------
def _index_rows(data: dict) -> dict:
    return {(r["impl"], r["T"], r["H"], r["block_size"]): r for r in data.get("rows", [])}


def _timed(row) -> bool:
    return row is not None and "us_median" in row


def _fmt_us(us: float) -> str:
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    if us >= 100:
        return f"{us:.0f} us"
    if us >= 10:
        return f"{us:.1f} us"
    return f"{us:.2f} us"


def _row_ok(row) -> bool:
    """No error, replays reproduce a plain call, and (for the fused op) the gate passed."""
    return (
        "error" not in row
        and row.get("replay_matches_eager", True) is not False
        and (row["impl"] != "fused" or bool(row.get("correct")))
    )


def _target_cell(row, kind: str, value: float) -> str:
    if not _timed(row):
        return "not measured"
    measured = row["us_median"] if kind == "us" else row["frac_of_copy_bw"]
    met = measured <= value if kind == "us" else measured >= value
    shown = _fmt_us(measured) if kind == "us" else f"{100 * measured:.1f}% ({_fmt_us(row['us_median'])})"
    mark = "yes" if met else "**no**"
    if not _row_ok(row):
        mark += ", **gate FAIL**"
    return f"{shown} ({mark})"


def render_markdown(data: dict, json_name: str, png_name: str) -> str:
    """docs/benchmarks.md, wholly from the JSON written by the measuring run."""
    rows = _index_rows(data)
    heads = sorted({r["H"] for r in data.get("rows", [])})
    block_sizes = sorted({r["block_size"] for r in data.get("rows", [])})
    tokens = sorted({r["T"] for r in data.get("rows", [])})
    bw = data["copy_bw"]["GBps"]
    vllm = vllm_ops.has_column(data)
    v41 = data["args"].get("v41", False)
    lines = [
        f"# Benchmarks: `prepfuse::{OP}`" + (", DeepSeek-V4.1's flags" if v41 else ""),
        "",
        *(["Every call with `apply_q_norm=False, kv_mxfp8=True` (vLLM's call too): q rotated without a norm, kv "
           "written as 528-byte MXFP8 records, 528 cache bytes a slot in the bytes moved.", ""] if v41 else []),
        f"Generated by `bench/bench_{OP}.py` from `bench/results/{json_name}`; do not edit by hand",
        f"(regenerate: `PYTHONPATH=. python bench/bench_{OP}.py --from-json bench/results/{json_name}`).",
        "",
        f"- **Date:** {data['date']}",
        f"- **Device:** {data['device']} (sm_{data['capability'].replace('.', '')}, {data['num_sms']} SMs, "
        f"L2 {data['l2_bytes'] / 2**20:.0f} MiB); torch {data['torch']}, triton {data['triton']}, CUDA {data['cuda']}",
        f"- **Copy bandwidth:** {bw:.0f} GB/s ({data['copy_bw']['bytes_per_copy'] / 2**30:.1f} GiB, the faster of "
        + ", ".join(f"{k} {v['GBps']:.0f}" for k, v in data["copy_bw"].get("variants", {}).items())
        + f"; read + write bytes, graph replay median; docs/design.md: {DESIGN_COPY_BW_GBPS:.0f}). "
        f"One tiny kernel in a graph: {data['tiny_graph']['us_median']:.2f} us (docs/design.md: 1.09 us).",
        f"- **Method:** each implementation captured in one CUDA graph of {CALLS_PER_GRAPH} back-to-back calls and "
        "timed by replay with CUDA events, per call (replays queued behind a GPU sleep, so host launch cost is not "
        "timed); median of N replays (10..200), "
        f"p10/p90 kept in the JSON. Shapes moving >= {data['args'].get('warm_below_l2', 0.25)} x L2 per call rotate "
        f"round-robin over K copies of all inputs and outputs (inside the graph, K x bytes >= {COLD_FACTOR} x L2) so "
        "every replay reads HBM; smaller shapes are timed warm. Bytes are the fewest the op must move "
        "(q, kv of inserted rows, positions, slots, one cos/sin row per token, q_out with padded heads, "
        f"{MXFP8_SLOT_BYTES if v41 else SLOT_BYTES} cache bytes per slot). Launches: GPU activities (kernels, memsets, memcpys) in `torch.profiler` over one "
        "non-graph call. Before timing at each shape, the fused op passed a correctness gate against the "
        "reference (fresh random inputs with ~10% skipped slots, poisoned outputs, `compare_dsv4(...).within_spec()`) "
        "unless marked FAIL; the baselines were checked the same way with all slots valid (differences listed "
        "under Correctness), and every implementation's graph replays had to write the bytes a plain call writes. "
        "All slots valid in timed calls (blocks in random order, consecutive rows within a block).",
        "- **Implementations:** `fused` = the op through `torch.ops.prepfuse` (Triton kernel); `eager` = "
        "`prepfuse.models.dsv4_prep_unfused` in PyTorch eager; `compile` = the same under `torch.compile` "
        "(default mode, `dynamic=False`, `fullgraph=True`), captured in the same CUDA graphs"
        + ("; `vllm` = vLLM's `fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert` ("
           + ("MXFP8 records, `kv_mxfp8=True`" if v41 else "fp8_ds_mla cache")
           + ", the padded q allocated by the op), gated like the fused op." if vllm else "."),
        *vllm_ops.page_note(data),
        "",
        f"![latency and bandwidth](../bench/results/{png_name})",
        "",
        "## Targets (fused, H=64, HP=64; docs/design.md, measured floors)",
        "",
        "| T | target | " + " | ".join(f"block {bs}" for bs in block_sizes) + " | production CUDA kernel (docs/design.md) |"
        + (f" {VLLM_LABEL}, block {block_sizes[0]} |" if vllm else ""),
        "|---:|---|" + "---|" * len(block_sizes) + "---|" + ("---:|" if vllm else ""),
    ]
    prod = PRODUCTION_US[64]
    for t in sorted(set(TARGETS) | set(prod)):
        if t not in tokens:
            continue
        kind, value = TARGETS.get(t, (None, None))
        target = "-" if kind is None else (f"<= {value} us" if kind == "us" else f">= {100 * value:.0f}% copy BW")
        cells = []
        for bs in block_sizes:
            r = rows.get(("fused", t, 64, bs))
            if kind is None:
                cells.append(_fmt_us(r["us_median"]) if _timed(r) else "not measured")
            else:
                cells.append(_target_cell(r, kind, value))
        p = prod.get(t)
        ptxt = "-" if p is None else _fmt_us(p)
        if p is not None and t >= 4096:
            nbytes = bytes_moved(t, 64, 64, t)
            ptxt += f" ({100 * nbytes / (p * 1e-6) / 1e9 / DESIGN_COPY_BW_GBPS:.0f}%)"
        vcell = ""
        if vllm:
            v = rows.get(("vllm", t, 64, block_sizes[0]))
            vcell = f" {_fmt_us(v['us_median']) if _timed(v) else '-'} |"
        lines.append(f"| {t} | {target} | " + " | ".join(cells) + f" | {ptxt} |" + vcell)
    lines += [
        "",
        "docs/design.md also gives the unfused PyTorch at H=64: eager "
        + ", ".join(f"T={t} {_fmt_us(us)}" for t, us in UNFUSED_MEASURED["eager"][1].items())
        + f" ({UNFUSED_MEASURED['eager'][0]} kernels); torch.compile "
        + ", ".join(f"T={t} {_fmt_us(us)}" for t, us in UNFUSED_MEASURED["compile"][1].items())
        + f" ({UNFUSED_MEASURED['compile'][0]} kernels).",
        "",
        "## All shapes",
        "",
        "Times are medians; `x eager` / `x compile` is that baseline's time over the fused time; launches are "
        "fused / eager / compile; L2 `cold xK` means K rotated copies."
        + (" `vLLM` is vLLM's own op, `x vLLM` its time over the fused time." if vllm else ""),
    ]
    for h in heads:
        hp = padded_heads(h)
        lines += [
            "",
            f"### H={h} (HP={hp})",
            "",
            "| T | block | MB/call | L2 | fused | fused GB/s | % copy BW | eager | compile | x eager | x compile "
            + ("| vLLM | x vLLM " if vllm else "") + "| launches | gate |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if vllm else "") + "---|---|",
        ]
        for t in tokens:
            for bs in block_sizes:
                f, e, c, v = (rows.get((i, t, h, bs)) for i in IMPLS)
                if f is None and e is None and c is None and v is None:
                    continue
                any_row = f or e or c or v
                l2 = "warm" if any_row.get("l2") == "warm" else f"cold x{any_row.get('copies', 1)}"

                def us(r):
                    return _fmt_us(r["us_median"]) if _timed(r) else ("error" if r and "error" in r else "-")

                def ratio(r):
                    return f"{r['us_median'] / f['us_median']:.1f}" if _timed(r) and _timed(f) else "-"

                def launches(r):
                    return str(r["launches"]) if r and "launches" in r else "-"

                gate_bad = [r["impl"] for r in (f, e, c, v) if r is not None and not _row_ok(r)]
                gbps = f"{f['GBps']:.0f}" if _timed(f) else "-"
                frac = f"{100 * f['frac_of_copy_bw']:.1f}" if _timed(f) else "-"
                differs = [r["impl"] for r in (e, c, v) if r is not None and _row_ok(r) and r.get("correct") is False]
                gate = "pass" if not gate_bad else "**FAIL: " + ", ".join(gate_bad) + "**"
                if differs:
                    gate += " (" + ", ".join(differs) + " differs)"
                lines.append(
                    f"| {t} | {bs} | {any_row['bytes'] / 1e6:.2f} | {l2} | {us(f)} | {gbps} | {frac} | "
                    f"{us(e)} | {us(c)} | {ratio(e)} | {ratio(c)} | "
                    + (f"{us(v)} | {ratio(v)} | " if vllm else "")
                    + f"{launches(f)} / {launches(e)} / {launches(c)} | {gate} |"
                )
    failed = [r for r in data.get("rows", []) if not _row_ok(r)]
    lines += ["", "## Correctness", ""]
    if failed:
        lines.append(f"**{len(failed)} row(s) failed the fused gate, the replay check, or could not run:**")
        lines.append("")
        for r in failed:
            if "error" in r:
                why = r["error"].splitlines()[0]
            elif r.get("replay_matches_eager") is False:
                why = "graph replays wrote other bytes than a plain call"
            else:
                why = "gate: " + json.dumps(r.get("gate"))
            lines.append(f"- {r['impl']} T={r['T']} H={r['H']} block {r['block_size']}: {why}")
    else:
        lines.append(f"All {len(data.get('rows', []))} timed rows ran; the fused op passed the gate at every shape, "
                     "and every implementation's graph replays wrote the same bytes as a plain call.")
    differs = [r for r in data.get("rows", []) if r["impl"] != "fused" and _row_ok(r) and r.get("correct") is False]
    if differs:
        lines += ["", "Baselines and vLLM's op outside the DeepSeek-V4 bound against the reference (their own "
                  "rounding: fp contraction and reduction order; recorded, not a failure):", ""]
        for r in differs:
            g = r.get("gate", {})
            lines.append(f"- {r['impl']} T={r['T']} H={r['H']} block {r['block_size']}: "
                         f"{g.get('q_mismatches')} q values differ (max {g.get('q_max_ulp')} ULP), "
                         f"{g.get('cache_mismatches')} cache bytes (max {g.get('cache_max_code_diff')} fp8 codes)")
    missing = data.get("left_out", []) + data.get("skipped", [])
    if missing:
        lines += ["", "## Rows not measured", ""]
        by_reason: dict = {}
        for m in missing:
            by_reason.setdefault(m["reason"], []).append(m)
        for reason, ms in by_reason.items():
            combos: dict = {}
            for m in ms:
                combos.setdefault((m["impl"], m["H"], m["block_size"]), []).append(m["T"])
            lines.append(f"- {reason}: " + "; ".join(
                f"{i} H={hh} block {b} (T={', '.join(str(x) for x in sorted(ts))})"
                for (i, hh, b), ts in sorted(combos.items())))
    if data.get("status") != "done":
        lines += ["", f"**The run did not finish (status: {data.get('status')}); the tables hold what it measured.**"]
    return "\n".join(lines) + "\n"


def render_plot(data: dict, path: Path) -> None:
    """Latency (log-log) and achieved bandwidth against T; one row of panels per H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data.get("rows", [])
    heads = sorted({r["H"] for r in rows})
    block_sizes = sorted({r["block_size"] for r in rows})
    colors = {"fused": "tab:blue", "eager": "tab:red", "compile": "tab:green", "vllm": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    bw = data["copy_bw"]["GBps"]
    fig, axes = plt.subplots(len(heads), 2, figsize=(13, 3.8 * max(1, len(heads))), squeeze=False)
    for i, h in enumerate(heads):
        ax_t, ax_b = axes[i]
        for impl in IMPLS:
            for j, bs in enumerate(block_sizes):
                pts = sorted((r["T"], r) for r in rows if r["impl"] == impl and r["H"] == h
                             and r["block_size"] == bs and _timed(r))
                if not pts:
                    continue
                ts = [p[0] for p in pts]
                label = f"{VLLM_LABEL if impl == 'vllm' else impl}, block {bs}"
                style = dict(color=colors[impl], linestyle=styles[j % len(styles)], marker="o", markersize=4)
                ax_t.plot(ts, [p[1]["us_median"] for p in pts], label=label, **style)
                ax_b.plot(ts, [p[1]["GBps"] for p in pts], label=label, **style)
                bad = [p for p in pts if not _row_ok(p[1])]
                if bad:
                    ax_t.plot([p[0] for p in bad], [p[1]["us_median"] for p in bad], "x", color="black",
                              markersize=10, label="gate FAIL" if j == 0 else None)
        prod = PRODUCTION_US.get(h)
        if prod:
            ax_t.plot(list(prod), list(prod.values()), "k^", markersize=6, fillstyle="none",
                      label="production CUDA kernel (docs/design.md)")
            ax_b.plot(list(prod), [bytes_moved(t, h, padded_heads(h), t) / (us * 1e-6) / 1e9 for t, us in prod.items()],
                      "k^", markersize=6, fillstyle="none", label="production CUDA kernel (docs/design.md)")
        if h == 64:
            tus = [(t, v) for t, (k, v) in TARGETS.items() if k == "us"]
            tfr = [(t, v) for t, (k, v) in TARGETS.items() if k == "frac"]
            ax_t.plot([t for t, _ in tus], [v for _, v in tus], "v", color="tab:purple", markersize=8,
                      label="target (at most)")
            ax_b.plot([t for t, _ in tfr], [v * bw for _, v in tfr], "^", color="tab:purple", markersize=8,
                      label="target (at least)")
        ax_b.axhline(bw, color="gray", linestyle="--", linewidth=1, label=f"copy bandwidth {bw:.0f} GB/s")
        ax_t.set_xscale("log")
        ax_t.set_yscale("log")
        ax_b.set_xscale("log")
        top = max([bw] + [r["GBps"] for r in rows if r["H"] == h and _timed(r)])
        ax_b.set_ylim(0, top * 1.1)
        ax_t.set_ylabel("us per call (median)")
        ax_b.set_ylabel("GB/s (fewest bytes / time)")
        for ax in (ax_t, ax_b):
            ax.set_xlabel("T (tokens)")
            ax.set_title(f"H={h} (HP={padded_heads(h)})")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7, loc="upper left")
        ax_b.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"prepfuse::{OP} on {data['device']}  ({data['date'][:10]}, torch {data['torch']}, "
                 f"triton {data['triton']}; CUDA-graph replay medians)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(data: dict, json_path: Path, png_path: Path, md_path: Path | None, docs_path: Path | None) -> None:
    render_plot(data, png_path)
    text = render_markdown(data, json_path.name, png_path.name)
    for p in (md_path, docs_path):
        if p is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)


def print_summary(data: dict) -> None:
    """A short table, last in the output (what a log's tail shows)."""
    rows = _index_rows(data)
    print(f"\nsummary: median us (GB/s, % of {data['copy_bw']['GBps']:.0f} GB/s copy) per impl; block size "
          f"{min(r['block_size'] for r in data['rows']) if data['rows'] else '-'}")
    heads = sorted({r["H"] for r in data["rows"]})
    tokens = sorted({r["T"] for r in data["rows"]})
    bs = min((r["block_size"] for r in data["rows"]), default=64)
    print(f"{'H':>4s} {'T':>6s} {'fused':>10s} {'GB/s':>6s} {'%copy':>6s} {'eager':>10s} {'compile':>10s} "
          f"{'vllm':>10s} {'gate':>5s}")
    for h in heads:
        for t in tokens:
            f, e, c, v = (rows.get((i, t, h, bs)) for i in IMPLS)
            if f is None and e is None and c is None and v is None:
                continue

            def us(r):
                return f"{r['us_median']:10.2f}" if _timed(r) else f"{'-':>10s}"

            ok = all(_row_ok(r) for r in (f, e, c, v) if r is not None)
            print(f"{h:>4d} {t:>6d} {us(f)} {f['GBps'] if _timed(f) else 0:6.0f} "
                  f"{100 * f['frac_of_copy_bw'] if _timed(f) else 0:6.1f} {us(e)} {us(c)} {us(v)} {'ok' if ok else 'FAIL':>5s}")


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=f"Benchmark prepfuse::{OP} (fused) against the unfused sequence in eager and torch.compile.",
        epilog="Run from the repository root: PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_insert.py --out-dir $OUT",
    )
    p.add_argument("--tokens", type=parse_int_list, default=list(DEFAULT_TOKENS), help="T values (default %(default)s)")
    p.add_argument("--heads", type=parse_int_list, default=list(DEFAULT_HEADS), help="H values (default %(default)s)")
    p.add_argument("--block-sizes", type=parse_int_list, default=list(DEFAULT_BLOCK_SIZES),
                   help="cache block sizes (default %(default)s; --sweep-config uses the first)")
    p.add_argument("--impls", type=_parse_impls, default=list(IMPLS),
                   help="subset of fused,eager,compile,vllm (vllm: where vLLM's op library loads)")
    p.add_argument("--full-baselines", action="store_true",
                   help="time eager/compile at every block size for every H (default: every block size only at "
                        "H=64, the smallest block size elsewhere)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="after this many seconds, remaining eager/compile rows are skipped (recorded in the JSON); "
                        "fused rows always run (default %(default)s)")
    p.add_argument("--target-ms", type=float, default=100.0, help="GPU time of timed replays per row (default %(default)s)")
    p.add_argument("--min-replays", type=int, default=10)
    p.add_argument("--max-replays", type=int, default=200)
    p.add_argument("--warm-below-l2", type=float, default=0.25,
                   help="rows moving less than this fraction of L2 per call are timed warm, larger ones rotate "
                        "copies (default %(default)s)")
    p.add_argument("--copy-bytes", type=int, default=4 << 30, help="size of the bandwidth-calibration copy")
    p.add_argument("--seed", type=int, default=None, help="seed for the device RNG (default: fresh)")
    p.add_argument("--no-launches", action="store_true", help="skip the profiler launch counts")
    p.add_argument("--out-dir", default=None,
                   help="where the JSON, PNG and a copy of the markdown go (default bench/results; with "
                        "--from-json, the JSON's folder)")
    p.add_argument("--name-suffix", default="", help="appended to the result file names (partial reruns)")
    p.add_argument("--docs", default=None, help="markdown table path (default docs/benchmarks.md, with --v41 "
                                                  "docs/benchmarks_v41.md)")
    p.add_argument("--v41", action="store_true",
                   help="DeepSeek-V4.1's flags on every call (apply_q_norm=False, kv_mxfp8=True); block 32 unless "
                        "--block-sizes says otherwise, results named ..._v41")
    p.add_argument("--no-docs", action="store_true", help="do not write --docs")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--from-json", metavar="PATH", default=None,
                      help="only regenerate the markdown and PNG from an existing JSON (no GPU needed)")
    mode.add_argument("--sweep-config", action="store_true",
                      help="time the fused kernel for BLOCK_H x num_warps (--sweep-block-h, --sweep-warps) and "
                           "print the best per (T, H), to choose _launch_config's heuristic")
    p.add_argument("--sweep-block-h", type=parse_int_list, default=list(SWEEP_BLOCK_H), help="--sweep-config's BLOCK_H")
    p.add_argument("--sweep-warps", type=parse_int_list, default=list(SWEEP_NUM_WARPS), help="--sweep-config's warps")
    return p


def main(argv: list[str] | None = None) -> int:
    global V41
    args = build_parser().parse_args(argv)
    data = json.loads(Path(args.from_json).read_text()) if args.from_json else None
    V41 = args.v41 or (data is not None and data["args"].get("v41", False))
    if args.docs is None:
        args.docs = str(REPO_ROOT / "docs" / ("benchmarks_v41.md" if V41 else "benchmarks.md"))
    if data is not None:
        json_path = Path(args.from_json)
        out_dir = Path(args.out_dir) if args.out_dir else json_path.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        png_path = out_dir / (json_path.stem + ".png")
        write_reports(data, json_path, png_path, None, None if args.no_docs else Path(args.docs))
        print(f"wrote {png_path}" + ("" if args.no_docs else f" and {args.docs}"))
        return 0

    if V41:
        args.name_suffix = "_v41" + args.name_suffix
        if args.block_sizes == list(DEFAULT_BLOCK_SIZES):
            args.block_sizes = [32]
    args.out_dir = args.out_dir or str(REPO_ROOT / "bench" / "results")
    from prepfuse._compat import has_triton, triton_interpret_mode

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device (use --from-json to render existing results)", file=sys.stderr)
        return 2
    if not has_triton() or triton_interpret_mode():
        print("needs triton, compiled (unset TRITON_INTERPRET): the fused op would not run its kernel", file=sys.stderr)
        return 2
    if args.sweep_config:
        run_sweep(args)
        return 0
    data = run_benchmark(args)
    return 1 if data.get("failures") else 0


if __name__ == "__main__":
    raise SystemExit(main())
