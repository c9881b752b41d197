"""What a decode-sized (T=1) launch costs, step by step: from one tiny kernel to each fused op.

The performance issue asks every fused op at T=1 to come within 0.5 us of one tiny kernel
in a graph (``harness.measure_tiny_graph``). This script times, in one run and by the
harness's method (CUDA-graph replay of back-to-back calls, median per call), a ladder of
Triton kernels that each add one thing a fused op does at T=1, then the ops themselves:

- ``torch add_``: the harness floor (one element, one PyTorch kernel);
- ``copy 1 program``: one warp loads 128 bf16 and stores them;
- ``copy 48 programs``: the GQA op's T=1 grid (Qwen3-8B: 32 q + 8 k + 8 v heads), one head each;
- ``gather 48``: each program first loads an int64 index (the slot), then its row at it;
- ``chain 48``: a position load, then a table row at that position (cos/sin), then the row;
- ``norm 48``: ``copy 48`` plus a correctly rounded RMSNorm of the row (sum, sqrt_rn, div_rn);
- ``chain+norm 48``: a GQA q program's dependencies, ``chain 48`` and ``norm 48`` in one
  program (the norm's arithmetic can overlap the table row's round trip: how much does it?);
- ``chain+norm 48, rsqrt.approx`` and ``chain+sum 48``: the same with the correctly rounded
  ``1 / sqrt`` replaced by one approximate instruction, and with no root at all (the
  reduction alone): which part of the norm stands out past the table row's round trip;
- ``chain 48, 3 KB more code``: ``chain 48`` with about 210 more instructions, independent
  integer work that sm_90 runs while the table row is in flight (where ``chain+norm 48``
  runs the norm): if it costs what the norm added there, a program pays for the code it
  runs during the round trip, not for the norm's latency;
- ``chain 48, after a 3 KB jump``: ``chain 48`` reached by a branch over that code, as the
  GQA op's k and v programs reach theirs (Qwen3-8B T=1: 2.8 and 6.3 KB in): what a
  branch target far from the first instructions costs a program that runs once;
- ``chain 48, 35 arguments``: ``chain 48`` with as many kernel arguments as the GQA op's
  kernel (31 unused ints): what the op's larger argument block costs a launch;
- each op at T=1 on the benchmarks' inputs (``bench/profile_kernels.py``'s cases);
- each GQA op's launch cut to the first programs of its grid (``_grid_cut``: at T=1
  one head a program, the q heads', then the k heads', then the v heads'): its first
  program alone, its q programs, its q and k programs. The op's time is its slowest
  program's, so these rows say which kind of program holds a T=1 launch above the
  ladder's minimal kernels. They store only part of the op's outputs and are not gated
  (the whole op is, before them);
- the q and k cut and the whole GQA op with every slot -1 (``gqa_slots_skipped``): the
  same programs with their cache stores masked off, what those stores cost;
- the whole GQA op with its kv programs first (``launch_gqa_kernel``'s ``kv_first``: the
  grid dispatches a token's k and v programs before its q programs), and that launch cut
  to its k programs: whether the normed k programs, dispatched last in the op's own
  order, are what holds it, and how long a launch of only them takes beside ``first
  program only`` (one q program);
- each indexer op's launch cut to its q programs (one head each at T=1; the grid's last
  program is the one k row's), and the launch with that k program first
  (``launch_indexer_kernel``'s ``k_first``), whole and cut to it: whether the k row,
  dispatched last, holds the launch.

The difference between neighbouring rows is what that step costs; the JSON keeps them all.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
from pathlib import Path

import harness
import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
HEAD_DIM = 128
PROGRAMS = 48


@triton.jit
def _copy_kernel(src, dst, D: tl.constexpr):
    p = tl.program_id(0)
    d = tl.arange(0, D)
    tl.store(dst + p * D + d, tl.load(src + p * D + d))


@triton.jit
def _gather_kernel(src, dst, index, D: tl.constexpr):
    p = tl.program_id(0)
    d = tl.arange(0, D)
    row = tl.load(index + p)
    tl.store(dst + row * D + d, tl.load(src + p * D + d))


@triton.jit
def _chain_step(src, dst, pos_ptr, table, D: tl.constexpr):
    p = tl.program_id(0)
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr)
    x = tl.load(src + p * D + d).to(tl.float32)
    c = tl.load(table + pos * D + d)
    tl.store(dst + p * D + d, (x * c).to(tl.bfloat16))


@triton.jit
def _chain_kernel(src, dst, pos_ptr, table, D: tl.constexpr):
    _chain_step(src, dst, pos_ptr, table, D)


@triton.jit
def _norm_kernel(src, dst, eps, D: tl.constexpr):
    p = tl.program_id(0)
    d = tl.arange(0, D)
    x = tl.load(src + p * D + d).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
    tl.store(dst + p * D + d, (x * rstd).to(tl.bfloat16))


@triton.jit
def _chain_norm_kernel(src, dst, pos_ptr, table, eps, D: tl.constexpr, RSTD: tl.constexpr = 0):
    # RSTD 0: the op's correctly rounded 1/sqrt (sqrt_rn, then div_rn); 1: rsqrt.approx, one
    # MUFU instruction; 2: no root at all, the sum of squares itself scales the row (the
    # reduction alone). Rows 1 and 2 split chain+norm's time over chain into the reduction's
    # shuffles and the two correctly rounded operations.
    p = tl.program_id(0)
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr)
    x = tl.load(src + p * D + d).to(tl.float32)
    c = tl.load(table + pos * D + d)
    mean_sq = tl.sum(x * x, axis=0) / D + eps
    if RSTD == 0:
        rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq))
    elif RSTD == 1:
        rstd = tl.math.rsqrt(mean_sq)
    else:
        rstd = mean_sq
    tl.store(dst + p * D + d, (x * rstd * c).to(tl.bfloat16))


@triton.jit
def _chain_code_step(src, dst, pos_ptr, table, D: tl.constexpr, STEPS: tl.constexpr):
    p = tl.program_id(0)
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr)
    x = tl.load(src + p * D + d).to(tl.float32)
    # xorshift32 of each lane's index, STEPS rounds (6 instructions a round and value, four
    # values a thread, four independent chains): code with no load behind it. It maps only 0
    # to 0, so the where below changes lane 0 of program 0 alone and keeps the rounds alive.
    h = (p * D + d).to(tl.uint32)
    for _ in tl.static_range(STEPS):
        h ^= h << 13
        h ^= h >> 17
        h ^= h << 5
    c = tl.load(table + pos * D + d)
    tl.store(dst + p * D + d, tl.where(h == 0, 0.0, x * c).to(tl.bfloat16))


@triton.jit
def _chain_code_kernel(src, dst, pos_ptr, table, D: tl.constexpr, STEPS: tl.constexpr):
    _chain_code_step(src, dst, pos_ptr, table, D, STEPS)


@triton.jit
def _chain_far_kernel(src, dst, pos_ptr, table, path, D: tl.constexpr, STEPS: tl.constexpr):
    # path is 3 at run time (an int argument of 1 would be specialised away): every program
    # branches over the first branch's code to the chain before any load, as the op's k and
    # v programs do. The first branch (never run) reads other addresses, so that the compiler
    # cannot hoist the chain's loads above the branch.
    if path == 2:
        _chain_code_step(src + D, dst, pos_ptr + 1, table, D, STEPS)
    else:
        _chain_step(src, dst, pos_ptr, table, D)


@triton.jit
def _chain_args_kernel(src, dst, pos_ptr, table, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5,
                       b6, b7, b8, b9, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, e0, D: tl.constexpr):
    _chain_step(src, dst, pos_ptr, table, D)


def ladder() -> dict:
    dev = harness.DEVICE
    src = torch.randn(PROGRAMS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    index = torch.randperm(PROGRAMS, device=dev)
    pos = torch.tensor([3], device=dev)
    table = torch.randn(16, HEAD_DIM, device=dev)
    x = torch.ones(1, device=dev)
    return {
        "torch add_ (harness floor)": lambda: x.add_(1.0),
        "copy 1 program": lambda: _copy_kernel[(1,)](src, dst, HEAD_DIM, num_warps=1),
        "copy 48 programs": lambda: _copy_kernel[(PROGRAMS,)](src, dst, HEAD_DIM, num_warps=1),
        "gather 48 (index, then row)": lambda: _gather_kernel[(PROGRAMS,)](src, dst, index, HEAD_DIM, num_warps=1),
        "chain 48 (position, then table row)": lambda: _chain_kernel[(PROGRAMS,)](src, dst, pos, table, HEAD_DIM,
                                                                                  num_warps=1),
        "norm 48 (sum, sqrt_rn, div_rn)": lambda: _norm_kernel[(PROGRAMS,)](src, dst, 1e-6, HEAD_DIM, num_warps=1),
        "chain+norm 48 (a q program's dependencies)": lambda: _chain_norm_kernel[(PROGRAMS,)](
            src, dst, pos, table, 1e-6, HEAD_DIM, num_warps=1),
        "chain+norm 48, rsqrt.approx": lambda: _chain_norm_kernel[(PROGRAMS,)](
            src, dst, pos, table, 1e-6, HEAD_DIM, 1, num_warps=1),
        "chain+sum 48 (the norm's reduction, no root)": lambda: _chain_norm_kernel[(PROGRAMS,)](
            src, dst, pos, table, 1e-6, HEAD_DIM, 2, num_warps=1),
        "chain 48, 3 KB more code": lambda: _chain_code_kernel[(PROGRAMS,)](src, dst, pos, table, HEAD_DIM, 8,
                                                                           num_warps=1),
        "chain 48, after a 3 KB jump": lambda: _chain_far_kernel[(PROGRAMS,)](src, dst, pos, table, 3, HEAD_DIM, 8,
                                                                             num_warps=1),
        # unused odd ints from 17 (none 1, none a multiple of 16: triton specialises neither)
        "chain 48, 35 arguments": lambda: _chain_args_kernel[(PROGRAMS,)](
            src, dst, pos, table, *[17 + 2 * i for i in range(31)], HEAD_DIM, num_warps=1),
    }


# the module and kernel of each op family whose launch the cut rows cut
CUT_KERNELS = {
    "gqa": ("prepfuse.ops.gqa_qknorm_rope_kv_insert", "_gqa_qknorm_rope_kv_insert_kernel"),
    "indexer": ("prepfuse.ops.dsv4_indexer_common", "_dsv4_indexer_rope_quant_insert_kernel"),
}


@contextlib.contextmanager
def _grid_cut(family: str, programs: int):
    """While open, the family's op (``CUT_KERNELS``) launches its kernel on the first
    ``programs`` programs of the grid it asks for (the module's kernel stands in behind an
    object whose ``[grid]`` cuts the grid). A CUDA graph captured inside keeps the cut launch."""
    module_name, attr = CUT_KERNELS[family]
    module = importlib.import_module(module_name)
    kernel = getattr(module, attr)

    class _Cut:
        def __getitem__(self, grid):
            return kernel[(min(grid[0], programs),)]

    setattr(module, attr, _Cut())
    try:
        yield
    finally:
        setattr(module, attr, kernel)


def _cut(family: str, launch, inputs, programs: int) -> None:
    with _grid_cut(family, programs):
        launch(inputs)


def gqa_prefixes(case: str) -> dict[str, int]:
    """Row names and program counts of a GQA case's cut launches at T=1 (one head a program:
    Hq q programs, then Hkv k and Hkv v programs)."""
    import bench_gqa_qknorm_rope_kv_insert as gqa

    hq, hkv = gqa.MODELS[case.removeprefix("gqa-")][:2]
    total = hq + 2 * hkv
    return {f"op {case}, first program only": 1,
            f"op {case}, q programs only ({hq} of {total})": hq,
            f"op {case}, q and k programs ({hq + hkv} of {total})": hq + hkv}


def gqa_slots_skipped(inputs):
    """The same inputs with every slot -1: the k and v programs compute as before and store
    nothing (a skipped slot masks their stores), so beside the op's rows this says what the
    cache stores, whose address waits on the slot, cost a T=1 launch."""
    import dataclasses

    return dataclasses.replace(inputs, slot_mapping=torch.full_like(inputs.slot_mapping, -1))


def gqa_kv_first_rows(case: str, inputs) -> dict:
    """The kv-first rows of a GQA case at T=1: the whole launch with each token's kv programs
    first, gated first as the op's own launch is, and that launch cut to its Hkv k programs."""
    import bench_gqa_qknorm_rope_kv_insert as gqa

    from prepfuse.ops import gqa_qknorm_rope_kv_insert_triton

    model = gqa.MODELS[case.removeprefix("gqa-")]
    hq, hkv = model[:2]

    def kv_first(inp):
        gqa_qknorm_rope_kv_insert_triton(*inp.args(), kv_first=True)

    ok, _ = gqa._gate(kv_first, inputs, model)
    if not ok:
        raise SystemExit(f"{case}: the kv-first launch's gate failed at T=1; no time is reported")
    return {f"op {case}, kv programs first": lambda: kv_first(inputs),
            f"op {case}, kv programs first, k programs only ({hkv} of {hq + 2 * hkv})":
                lambda: _cut("gqa", kv_first, inputs, hkv)}


def gqa_rows(case: str, launch, inputs) -> dict:
    """A GQA case's rows beside the whole op: its cut launches (``gqa_prefixes``), the q and k
    cut and the whole op with every slot -1, and the kv-first rows."""
    rows = {name: (lambda programs=programs: _cut("gqa", launch, inputs, programs))
            for name, programs in gqa_prefixes(case).items()}
    # the q and k cut (the last) and the whole op again, with no cache store
    name, programs = list(gqa_prefixes(case).items())[-1]
    skipped = gqa_slots_skipped(inputs)
    rows[f"{name}, slot -1"] = lambda: _cut("gqa", launch, skipped, programs)
    rows[f"op {case}, slot -1"] = lambda: launch(skipped)
    return {**rows, **gqa_kv_first_rows(case, inputs)}


def indexer_rows(case: str, launch, inputs) -> dict:
    """An indexer case's rows beside the whole op at T=1, whose grid is the H q programs (one
    head each) and then the one k program: the launch cut to its q programs, and the launch
    with the k program first (``k_first``, gated first), whole and cut to that program."""
    import bench_dsv4_indexer_rope_quant_insert as idx

    from prepfuse.ops import dsv4_indexer_rope_fp8_insert_triton, dsv4_indexer_rope_mxfp4_insert_triton
    from prepfuse.ops.dsv4_indexer_common import _launch_config

    fmt = case.removeprefix("indexer-")
    triton_impl = dsv4_indexer_rope_fp8_insert_triton if fmt == "fp8" else dsv4_indexer_rope_mxfp4_insert_triton
    num_tokens, num_heads = inputs.q.shape[:2]
    # the q programs as the launcher counts them (its rule's heads per program)
    n_q = num_tokens * triton.cdiv(num_heads, _launch_config(num_tokens, num_heads)[0])
    n_k = inputs.k.shape[0]

    def k_first(inp):
        triton_impl(*inp.args(), k_first=True)

    ok, _ = idx.gate("fused", fmt, k_first, inputs)
    if not ok:
        raise SystemExit(f"{case}: the k-first launch's gate failed at T=1; no time is reported")
    total = n_q + n_k
    return {f"op {case}, q programs only ({n_q} of {total})": lambda: _cut("indexer", launch, inputs, n_q),
            f"op {case}, k programs first": lambda: k_first(inputs),
            f"op {case}, k programs first, k programs only ({n_k} of {total})":
                lambda: _cut("indexer", k_first, inputs, n_k)}


def op_rows(cases: list[str]) -> dict:
    import profile_kernels

    rows = {}
    for case in cases:
        launch, inputs, gate = profile_kernels.CASES[case](1)
        ok, _ = gate()
        if not ok:
            raise SystemExit(f"{case}: the fused op's gate failed at T=1; no time is reported")
        rows[f"op {case}"] = (lambda launch=launch, inputs=inputs: launch(inputs))
        if case.startswith("gqa-"):
            rows.update(gqa_rows(case, launch, inputs))
        elif case.startswith("indexer-"):
            rows.update(indexer_rows(case, launch, inputs))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="gqa-qwen3-8b,gqa-qwen3-8b-fp8,gqa-llama3-8b,dsv4-h64,indexer-fp8,indexer-mxfp4")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--name-suffix", default="")
    args = p.parse_args(argv)
    harness.spin_up_clocks()
    rows = {**ladder(), **op_rows([c for c in args.cases.split(",") if c])}
    results = {}
    for name, fn in rows.items():
        fn()
        torch.cuda.synchronize()
        graphs = harness.capture_graphs(lambda _: fn(), [None], warmup=2)
        results[name] = harness.time_graphs(graphs, target_ms=5, min_replays=200, max_replays=200)
        print(f"{name:45s} {results[name]['us_median']:6.2f} us", flush=True)
    info = harness.device_info()
    data = {"device": info, "per_call_us": {k: v["us_median"] for k, v in results.items()}, "stats": results}
    out = Path(args.out_dir) / f"decode_floor_{info['device_slug']}{args.name_suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
