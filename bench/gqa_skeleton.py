"""Where a large GQA launch's time goes: the fused op beside skeletons of its own grid.

    python bench/gqa_skeleton.py --tokens 4096,16384 --out-dir bench/results

The GQA op at Qwen3-8B sizes is a line in T: 4.2 us plus 0.2469 us/MB, where the SM copy
kernel of the same bytes is 2.2 us plus 0.2351 us/MB (``bench/results/ab_stop34.md``). This
script times, by the benchmarks' method (CUDA-graph replay of 20 back-to-back calls, median per
call, inputs rotated so that L2 is cold) and on the benchmark's own inputs (Qwen3-8B, block 16,
every slot valid), a ladder that adds one thing the op does at a time:

- ``copy``: the SM copy kernel (``torch.neg``) of the op's read + write bytes;
- ``skeleton``: the op's grid and programs (two q programs of 16 heads and one kv program per
  token, two warps, the row locks' launch shape) moving the same rows with no arithmetic:
  q heads to q_out, k and v heads to the paged caches at the token's slot;
- ``+ lock``: the kv program stores under its slot's row lock (``_duplicate_slots``);
- ``+ chain``: every program first loads its token's position and then a cos row at it, and
  adds the row times zero to its values (a use the compiler keeps: IEEE ``c * 0`` is no
  constant), the op's position -> table round trip;
- ``+ chain + lock``: both;
- ``op``: ``prepfuse::gqa_qknorm_rope_kv_insert`` itself (norm, RoPE, the locks).

Each skeleton is checked first: q_out and the written cache rows must equal qkv's own rows
(the chain adds exact zeros). The differences between rows say what the grid, the lock, the
chain and the math each cost; the JSON keeps every row. A measurement, not a kernel: nothing
in the package uses this.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

import copy_ceiling
import harness
import torch
import triton
import triton.language as tl

from prepfuse.ops._triton_helpers import _lock_row, _unlock_row

HERE = Path(__file__).resolve().parent
MODEL = "qwen3-8b"
BLOCK_H = 16  # q heads per program, as the op's launch table gives at these T
NUM_WARPS = 2
# the ladder's skeletons: (position -> table chain, row lock)
SKELETONS = {"skeleton": (False, False), "+ lock": (False, True), "+ chain": (True, False),
             "+ chain + lock": (True, True)}


@triton.jit
def _cos_zero(pos_ptr, table_ptr, t, stride_table, d, CHAIN: tl.constexpr):
    """0.0 as the sum of the token's cos row times zero (the position, then the row: two
    round trips to memory), or a plain 0.0 without CHAIN."""
    if CHAIN:
        pos = tl.load(pos_ptr + t)
        return tl.load(table_ptr + pos * stride_table + d % 64) * 0.0
    else:
        return 0.0


@triton.jit
def _skeleton_kernel(
    qkv_ptr,  # [T, (HQ + 2 HKV) * D] bf16
    q_out_ptr,  # [T, HQ, D] bf16
    k_cache_ptr,  # [NB, BS, HKV, D] bf16
    v_cache_ptr,  # as k_cache
    slot_ptr,  # [T] int64, every slot valid
    pos_ptr,  # [T] int64 (read with CHAIN)
    table_ptr,  # [P, R] fp32 cos/sin table (read with CHAIN)
    locks_ptr,  # the row-lock table (taken with LOCK)
    stride_qkv,  # elements between tokens of qkv
    stride_table,  # elements between rows of the table
    block_size,  # slots per cache block
    stride_cb,  # elements between cache blocks
    stride_cr,  # elements between slots of a block
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHAIN: tl.constexpr,
    LOCK: tl.constexpr,
):
    # the op's locked grid: per token HQ // BLOCK_H q programs, then one kv program
    Q_COLS: tl.constexpr = HQ // BLOCK_H
    pid = tl.program_id(0).to(tl.int64)
    col = pid % (Q_COLS + 1)
    t = pid // (Q_COLS + 1)
    d = tl.arange(0, D)[None, :]
    row = qkv_ptr + t * stride_qkv
    if col < Q_COLS:
        h = col * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        x = tl.load(row + h * D + d)
        x = (x.to(tl.float32) + _cos_zero(pos_ptr, table_ptr, t, stride_table, d, CHAIN)).to(tl.bfloat16)
        tl.store(q_out_ptr + (t * HQ + h) * D + d, x)
    else:
        hk = tl.arange(0, HKV)[:, None]
        slot = tl.load(slot_ptr + t)
        k = tl.load(row + (HQ + hk) * D + d)
        v = tl.load(row + (HQ + HKV + hk) * D + d)
        zero = _cos_zero(pos_ptr, table_ptr, t, stride_table, d, CHAIN)
        k = (k.to(tl.float32) + zero).to(tl.bfloat16)
        v = (v.to(tl.float32) + zero).to(tl.bfloat16)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cr + hk * D + d
        if LOCK:
            _lock_row(locks_ptr, slot)
        tl.store(k_cache_ptr + dst, k)
        tl.store(v_cache_ptr + dst, v)
        if LOCK:
            _unlock_row(locks_ptr, slot)


def skeleton(inp, chain: bool, lock: bool, num_warps: int = NUM_WARPS, block_h: int = BLOCK_H) -> None:
    """The skeleton kernel on one set of the benchmark's inputs (``make_inputs``)."""
    from prepfuse.ops._duplicate_slots import row_locks

    num_tokens, hq, d = inp.q_out.shape
    hkv = inp.k_cache.shape[2]
    grid = (num_tokens * (hq // block_h + 1),)
    _skeleton_kernel[grid](
        inp.qkv, inp.q_out, inp.k_cache, inp.v_cache, inp.slot_mapping, inp.positions, inp.cos_sin_cache,
        row_locks(inp.qkv.device), inp.qkv.stride(0), inp.cos_sin_cache.stride(0), inp.k_cache.shape[1],
        inp.k_cache.stride(0), inp.k_cache.stride(1),
        HQ=hq, HKV=hkv, D=d, BLOCK_H=block_h, CHAIN=chain, LOCK=lock, num_warps=num_warps,
    )


def skeleton_moves_the_rows(inp) -> bool:
    """Whether a skeleton call left q_out and the caches' written rows equal to qkv's rows."""
    num_tokens, hq, d = inp.q_out.shape
    hkv = inp.k_cache.shape[2]
    heads = inp.qkv.unflatten(1, (-1, d))
    bs = inp.k_cache.shape[1]
    blocks, rows = inp.slot_mapping // bs, inp.slot_mapping % bs
    return bool(torch.equal(inp.q_out, heads[:, :hq])
                and torch.equal(inp.k_cache[blocks, rows], heads[:, hq:hq + hkv])
                and torch.equal(inp.v_cache[blocks, rows], heads[:, hq + hkv:]))


def ladder_rows(num_tokens: int, l2_bytes: int, num_warps: int = NUM_WARPS, sequential_slots: bool = False,
                block_h: int = BLOCK_H) -> dict:
    import bench_gqa_qknorm_rope_kv_insert as gqa
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import GQA_QKNORM_ROPE_KV_INSERT

    model = gqa.MODELS[MODEL]
    nbytes = gqa.gqa_bytes_moved(num_tokens, model)
    k = harness.rotation_copies(nbytes, l2_bytes, 0.25)
    copies = [gqa.make_inputs(num_tokens, model, skip_fraction=0.0) for _ in range(k)]
    if sequential_slots:  # token t to slot t: the cache rows written front to back, not block by random block
        for inp in copies:
            inp.slot_mapping.copy_(torch.arange(num_tokens, device=inp.slot_mapping.device))
    steps = {name: (lambda inp, chain=chain, lock=lock: skeleton(inp, chain, lock, num_warps, block_h))
             for name, (chain, lock) in SKELETONS.items()}
    steps["op"] = lambda inp: GQA_QKNORM_ROPE_KV_INSERT(*inp.args())
    rows = {}
    for name, fn in steps.items():
        if name in SKELETONS:  # (the op is checked by its benchmark's gate and tests, not here)
            probe = copies[0]
            for out in (probe.q_out, probe.k_cache, probe.v_cache):
                out.fill_(float("nan"))
            fn(probe)
            if not skeleton_moves_the_rows(probe):
                raise SystemExit(f"T={num_tokens} {name}: the skeleton did not move qkv's rows; no time is reported")
        graphs = harness.capture_graphs(fn, copies, warmup=2)
        rows[name] = harness.time_graphs(graphs, target_ms=40, min_replays=10, max_replays=100)
        del graphs
    rows["copy"] = copy_ceiling.time_copy(nbytes, l2_bytes)
    for stats in rows.values():
        stats["GBps_op_bytes"] = nbytes / (stats["us_median"] * 1e-6) / 1e9
    return {"T": num_tokens, "model": MODEL, "op_bytes": nbytes, "copies": k, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=harness.parse_int_list, default=[4096, 16384])
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--name-suffix", default="")
    p.add_argument("--warps", type=int, default=NUM_WARPS, help="the skeletons' warps per program (the op keeps its own)")
    p.add_argument("--block-h", type=int, default=BLOCK_H, help="the skeletons' q heads per program (a divisor of 32)")
    p.add_argument("--sequential-slots", action="store_true",
                   help="token t writes slot t (every timed call, the op's too), instead of the benchmark's blocks in "
                        "random order")
    args = p.parse_args(argv)
    info = harness.device_info()
    harness.spin_up_clocks()
    data = {"what": "the GQA op beside skeletons of its grid", "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), **info, "block_h": args.block_h, "num_warps": args.warps,
        "sequential_slots": args.sequential_slots, "shapes": []}
    out = Path(args.out_dir) / f"gqa_skeleton_{info['device_slug']}{args.name_suffix}.json"
    for t in args.tokens:
        shape = ladder_rows(t, info["l2_bytes"], args.warps, args.sequential_slots, args.block_h)
        data["shapes"].append(shape)
        harness.write_json(out, data)
        for name, stats in shape["rows"].items():
            print(f"T={t:6d} {name:16s} {stats['us_median']:9.2f} us  {stats['GBps_op_bytes']:6.0f} GB/s (op bytes)",
                  flush=True)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
