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
- ``flat``: the skeleton's programs writing every row into one buffer like qkv (one write
  stream, no slot): its grid as a copy;
- ``merged``, ``merged + lock``, ``merged + chain``, ``merged + chain + lock``: no kv programs;
  the last q program of each token also loads its k and v rows and stores them (under the lock),
  and stores its own q rows only after the release, so that the release's wait for the k and v
  stores has work behind it;
- ``op``: ``prepfuse::gqa_qknorm_rope_kv_insert`` itself (norm, RoPE, the locks);
- ``triton copy``: the op's bytes copied by Triton programs of the skeleton's q program size
  and warps (tells the program shape's cost from the rows' layout);
- with ``--programs-per-sm N,...``: the skeleton, the skeleton with chain and lock, and the
  Triton copy on persistent grids of N programs per SM, each walking the work items.

Each skeleton is checked first: q_out and the written cache rows must equal qkv's own rows
(the chain adds exact zeros). The differences between rows say what the grid, the lock, the
chain and the math each cost; the JSON keeps every row. ``--contiguous-qkv`` gives qkv as a
projection GEMM does instead of the benchmark's view of a wider buffer. The skeletons take
qkv's token stride in the op's units (``stride_unit``): without them a stride of 6168
elements (the view's) left every row load a scalar 2-byte load, and the skeleton 10% slower
than the op's vectorised loads (stop 34's ladder; ``bench/results/ab_stop35.md``). A
measurement, not a kernel: nothing in the package uses this.
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
from prepfuse.ops.gqa_qknorm_rope_kv_insert import stride_unit

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
def _store_kv_row(k_cache_ptr, v_cache_ptr, locks_ptr, slot, k, v, offsets, block_size, stride_cb, stride_cr,
                  LOCK: tl.constexpr):
    """Store a token's k and v rows (``offsets`` within a slot) at ``slot``, under its row lock
    with LOCK."""
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cr + offsets
    if LOCK:
        _lock_row(locks_ptr, slot)
    tl.store(k_cache_ptr + dst, k)
    tl.store(v_cache_ptr + dst, v)
    if LOCK:
        _unlock_row(locks_ptr, slot)


@triton.jit
def _move_work_item(
    w,  # the work item: token w // (Q_COLS + 1), column w % (Q_COLS + 1)
    qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, table_ptr, locks_ptr, stride_qkv,
    stride_table, block_size, stride_cb, stride_cr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, CHAIN: tl.constexpr,
    LOCK: tl.constexpr, FLAT: tl.constexpr,
):
    """One program's work in the op's locked grid: per token HQ // BLOCK_H q columns, then one
    kv column. With FLAT every row goes to ``q_out_ptr`` as a copy of qkv (one write stream, no
    slot) instead of to q_out and the caches."""
    Q_COLS: tl.constexpr = HQ // BLOCK_H
    col = w % (Q_COLS + 1)
    t = w // (Q_COLS + 1)
    d = tl.arange(0, D)[None, :]
    row = qkv_ptr + t * stride_qkv
    if col < Q_COLS:
        h = col * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        x = tl.load(row + h * D + d)
        x = (x.to(tl.float32) + _cos_zero(pos_ptr, table_ptr, t, stride_table, d, CHAIN)).to(tl.bfloat16)
        if FLAT:
            tl.store(q_out_ptr + t * stride_qkv + h * D + d, x)
        else:
            tl.store(q_out_ptr + (t * HQ + h) * D + d, x)
    else:
        hk = tl.arange(0, HKV)[:, None]
        k = tl.load(row + (HQ + hk) * D + d)
        v = tl.load(row + (HQ + HKV + hk) * D + d)
        zero = _cos_zero(pos_ptr, table_ptr, t, stride_table, d, CHAIN)
        k = (k.to(tl.float32) + zero).to(tl.bfloat16)
        v = (v.to(tl.float32) + zero).to(tl.bfloat16)
        if FLAT:
            tl.store(q_out_ptr + t * stride_qkv + (HQ + hk) * D + d, k)
            tl.store(q_out_ptr + t * stride_qkv + (HQ + HKV + hk) * D + d, v)
        else:
            _store_kv_row(k_cache_ptr, v_cache_ptr, locks_ptr, tl.load(slot_ptr + t), k, v, hk * D + d, block_size,
                          stride_cb, stride_cr, LOCK)


@triton.jit
def _merged_kernel(
    qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, table_ptr, locks_ptr, stride_qkv, stride_table,
    block_size, stride_cb, stride_cr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, CHAIN: tl.constexpr,
    LOCK: tl.constexpr, STRIDE_UNIT: tl.constexpr,
):
    """The grid without kv programs of their own: per token HQ // BLOCK_H q programs, the last
    of which also writes the token's k and v rows (loaded with its q rows, stored under the
    lock) and stores its q rows only after the release, so that the release's wait for the
    k and v stores has work behind it."""
    Q_COLS: tl.constexpr = HQ // BLOCK_H
    stride_qkv *= STRIDE_UNIT
    pid = tl.program_id(0).to(tl.int64)
    col = pid % Q_COLS
    t = pid // Q_COLS
    d = tl.arange(0, D)[None, :]
    row = qkv_ptr + t * stride_qkv
    h = col * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    x = tl.load(row + h * D + d)
    zero = _cos_zero(pos_ptr, table_ptr, t, stride_table, d, CHAIN)
    if col == Q_COLS - 1:
        hk = tl.arange(0, HKV)[:, None]
        slot = tl.load(slot_ptr + t)
        k = (tl.load(row + (HQ + hk) * D + d).to(tl.float32) + zero).to(tl.bfloat16)
        v = (tl.load(row + (HQ + HKV + hk) * D + d).to(tl.float32) + zero).to(tl.bfloat16)
        _store_kv_row(k_cache_ptr, v_cache_ptr, locks_ptr, slot, k, v, hk * D + d, block_size, stride_cb, stride_cr,
                      LOCK)
    tl.store(q_out_ptr + (t * HQ + h) * D + d, (x.to(tl.float32) + zero).to(tl.bfloat16))


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
    n_work,  # work items: T * (HQ // BLOCK_H + 1)
    n_programs,  # programs of the grid (read with PERSISTENT)
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHAIN: tl.constexpr,
    LOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,  # n_programs programs walk the work items (w, w + n_programs, ...)
    FLAT: tl.constexpr,  # q_out_ptr is a buffer like qkv that takes every row (_move_work_item)
    STRIDE_UNIT: tl.constexpr,  # stride_qkv is in units of this many elements (the op's stride_unit)
):
    stride_qkv *= STRIDE_UNIT
    pid = tl.program_id(0).to(tl.int64)
    if PERSISTENT:
        for w in range(pid, n_work, n_programs):
            _move_work_item(w, qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, table_ptr, locks_ptr,
                            stride_qkv, stride_table, block_size, stride_cb, stride_cr, HQ, HKV, D, BLOCK_H, CHAIN,
                            LOCK, FLAT)
    else:
        _move_work_item(pid, qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, table_ptr, locks_ptr,
                        stride_qkv, stride_table, block_size, stride_cb, stride_cr, HQ, HKV, D, BLOCK_H, CHAIN, LOCK,
                        FLAT)


@triton.jit
def _flat_copy_kernel(src_ptr, dst_ptr, n_blocks, n_programs, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr):
    """dst = src, BLOCK elements a work item: a Triton copy whose programs are the size of the
    skeleton's, to tell the program shape's cost from the rows' layout."""
    pid = tl.program_id(0).to(tl.int64)
    if PERSISTENT:
        for b in range(pid, n_blocks, n_programs):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def skeleton(inp, chain: bool, lock: bool, num_warps: int = NUM_WARPS, block_h: int = BLOCK_H,
             programs: int = 0, flat_out: torch.Tensor | None = None) -> None:
    """The skeleton kernel on one set of the benchmark's inputs (``make_inputs``); ``programs``
    > 0 launches that many programs, each walking the work items ``programs`` apart (a
    persistent grid), else one program a work item as the op launches. ``flat_out`` (like
    qkv): every row is copied there instead (no lock: no slot)."""
    from prepfuse.ops._duplicate_slots import row_locks

    num_tokens, hq, d = inp.q_out.shape
    hkv = inp.k_cache.shape[2]
    n_work = num_tokens * (hq // block_h + 1)
    grid = (min(programs, n_work) if programs else n_work,)
    unit = stride_unit(inp.qkv.stride(0))
    _skeleton_kernel[grid](
        inp.qkv, inp.q_out if flat_out is None else flat_out, inp.k_cache, inp.v_cache, inp.slot_mapping, inp.positions,
        inp.cos_sin_cache,
        row_locks(inp.qkv.device), inp.qkv.stride(0) // unit, inp.cos_sin_cache.stride(0), inp.k_cache.shape[1],
        inp.k_cache.stride(0), inp.k_cache.stride(1), n_work, grid[0],
        HQ=hq, HKV=hkv, D=d, BLOCK_H=block_h, CHAIN=chain, LOCK=lock, PERSISTENT=programs > 0,
        FLAT=flat_out is not None, STRIDE_UNIT=unit, num_warps=num_warps,
    )


def merged_skeleton(inp, chain: bool, lock: bool, num_warps: int = NUM_WARPS, block_h: int = BLOCK_H) -> None:
    """The skeleton whose last q program per token also writes its k and v (``_merged_kernel``)."""
    from prepfuse.ops._duplicate_slots import row_locks

    num_tokens, hq, d = inp.q_out.shape
    unit = stride_unit(inp.qkv.stride(0))
    _merged_kernel[(num_tokens * (hq // block_h),)](
        inp.qkv, inp.q_out, inp.k_cache, inp.v_cache, inp.slot_mapping, inp.positions, inp.cos_sin_cache,
        row_locks(inp.qkv.device), inp.qkv.stride(0) // unit, inp.cos_sin_cache.stride(0), inp.k_cache.shape[1],
        inp.k_cache.stride(0), inp.k_cache.stride(1),
        HQ=hq, HKV=inp.k_cache.shape[2], D=d, BLOCK_H=block_h, CHAIN=chain, LOCK=lock, STRIDE_UNIT=unit,
        num_warps=num_warps,
    )


def triton_copy(pair, block: int, num_warps: int, programs: int = 0) -> None:
    """``pair[1][:] = pair[0]`` (1-D, a multiple of ``block`` elements) by ``_flat_copy_kernel``:
    one program a block, or ``programs`` persistent ones."""
    src, dst = pair
    n_blocks = src.numel() // block
    grid = (min(programs, n_blocks) if programs else n_blocks,)
    _flat_copy_kernel[grid](src, dst, n_blocks, grid[0], BLOCK=block, PERSISTENT=programs > 0, num_warps=num_warps)


def time_triton_copy(nbytes: int, l2_bytes: int, block: int, num_warps: int, programs: int = 0) -> dict:
    """``triton_copy`` of ``nbytes`` read + write bytes (bf16, rounded down to whole blocks), checked,
    then timed as ``copy_ceiling.time_copy`` times the SM copy."""
    n = max(block, (nbytes // 4) // block * block)
    k = harness.rotation_copies(4 * n, l2_bytes, 0.25)
    pairs = [(torch.randn(n, device=harness.DEVICE, dtype=torch.bfloat16),
              torch.empty(n, device=harness.DEVICE, dtype=torch.bfloat16)) for _ in range(k)]
    triton_copy(pairs[0], block, num_warps, programs)
    if not torch.equal(pairs[0][0], pairs[0][1]):
        raise SystemExit(f"triton copy (block {block}, programs {programs}) did not copy; no time is reported")
    graphs = harness.capture_graphs(lambda p: triton_copy(p, block, num_warps, programs), pairs, warmup=2)
    stats = harness.time_graphs(graphs, target_ms=40, min_replays=10, max_replays=100)
    return {"bytes": 4 * n, "copies": k, **stats}


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
                block_h: int = BLOCK_H, num_sms: int = 0, programs_per_sm: tuple[int, ...] = (),
                contiguous_qkv: bool = False) -> dict:
    """The ladder at T = ``num_tokens``; each of ``programs_per_sm`` adds the bare skeleton, the
    skeleton with chain and lock, and the Triton copy on a persistent grid of that many programs
    per SM (of ``num_sms``)."""
    import bench_gqa_qknorm_rope_kv_insert as gqa
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import GQA_QKNORM_ROPE_KV_INSERT

    model = gqa.MODELS[MODEL]
    nbytes = gqa.gqa_bytes_moved(num_tokens, model)
    k = harness.rotation_copies(nbytes, l2_bytes, 0.25)
    copies = [gqa.make_inputs(num_tokens, model, skip_fraction=0.0) for _ in range(k)]
    if contiguous_qkv:  # qkv as a projection GEMM gives it: rows back to back from an aligned start
        for inp in copies:
            inp.qkv = inp.qkv.contiguous()
    if sequential_slots:  # token t to slot t: the cache rows written front to back, not block by random block
        for inp in copies:
            inp.slot_mapping.copy_(torch.arange(num_tokens, device=inp.slot_mapping.device))
    steps = {name: (lambda inp, chain=chain, lock=lock: skeleton(inp, chain, lock, num_warps, block_h))
             for name, (chain, lock) in SKELETONS.items()}
    for per_sm in programs_per_sm:
        for name in ("skeleton", "+ chain + lock"):
            chain, lock = SKELETONS[name]
            steps[f"{name}, {per_sm}/SM"] = (lambda inp, chain=chain, lock=lock, n=per_sm * num_sms:
                                             skeleton(inp, chain, lock, num_warps, block_h, programs=n))
    # every row to one buffer like qkv (one write stream, no slot): the grid's programs as a copy
    flat = {id(inp): torch.empty_strided(inp.qkv.shape, inp.qkv.stride(), dtype=inp.qkv.dtype,
                                         device=inp.qkv.device) for inp in copies}  # qkv's token stride
    steps["flat"] = lambda inp: skeleton(inp, False, False, num_warps, block_h, flat_out=flat[id(inp)])
    for name, (chain, lock) in SKELETONS.items():
        steps[f"merged {name.replace('skeleton', '').strip()}".strip()] = (
            lambda inp, chain=chain, lock=lock: merged_skeleton(inp, chain, lock, num_warps, block_h))
    checked = set(steps)
    steps["op"] = lambda inp: GQA_QKNORM_ROPE_KV_INSERT(*inp.args())
    rows = {}
    for name, fn in steps.items():
        if name in checked:  # (the op is checked by its benchmark's gate and tests, not here)
            probe = copies[0]
            for out in (probe.q_out, probe.k_cache, probe.v_cache, flat[id(probe)]):
                out.fill_(float("nan"))
            fn(probe)
            moved = torch.equal(flat[id(probe)], probe.qkv) if name == "flat" else skeleton_moves_the_rows(probe)
            if not moved:
                raise SystemExit(f"T={num_tokens} {name}: the skeleton did not move qkv's rows; no time is reported")
        graphs = harness.capture_graphs(fn, copies, warmup=2)
        rows[name] = harness.time_graphs(graphs, target_ms=40, min_replays=10, max_replays=100)
        del graphs
    rows["copy"] = copy_ceiling.time_copy(nbytes, l2_bytes)
    # the same bytes by Triton programs of the skeleton's q program (BLOCK_H heads, its warps)
    block = block_h * model[2]  # q heads x head dim
    rows["triton copy"] = time_triton_copy(nbytes, l2_bytes, block, num_warps)
    for per_sm in programs_per_sm:
        rows[f"triton copy, {per_sm}/SM"] = time_triton_copy(nbytes, l2_bytes, block, num_warps, per_sm * num_sms)
    for stats in rows.values():
        stats["GBps_op_bytes"] = nbytes / (stats["us_median"] * 1e-6) / 1e9
    return {"T": num_tokens, "model": MODEL, "op_bytes": nbytes, "copies": k, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=harness.parse_int_list, default=[4096, 16384])
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--name-suffix", default="")
    p.add_argument("--warps", type=int, default=NUM_WARPS,
                   help="the skeletons' warps per program (the op keeps its own)")
    p.add_argument("--block-h", type=int, default=BLOCK_H, help="the skeletons' q heads per program (a divisor of 32)")
    p.add_argument("--programs-per-sm", type=harness.parse_int_list, default=[],
                   help="also time the skeleton and the Triton copy on persistent grids of these many programs per SM")
    p.add_argument("--contiguous-qkv", action="store_true",
                   help="qkv contiguous (every timed call, the op's too), instead of the benchmark's view of a wider "
                        "buffer (rows 12336 bytes apart from 16 bytes past an aligned start: most start mid-line)")
    p.add_argument("--sequential-slots", action="store_true",
                   help="token t writes slot t (every timed call, the op's too), instead of the benchmark's blocks in "
                        "random order")
    args = p.parse_args(argv)
    info = harness.device_info()
    harness.spin_up_clocks()
    data = {"what": "the GQA op beside skeletons of its grid", "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), **info, "block_h": args.block_h, "num_warps": args.warps,
        "sequential_slots": args.sequential_slots, "contiguous_qkv": args.contiguous_qkv,
        "programs_per_sm": args.programs_per_sm, "shapes": []}
    out = Path(args.out_dir) / f"gqa_skeleton_{info['device_slug']}{args.name_suffix}.json"
    for t in args.tokens:
        shape = ladder_rows(t, info["l2_bytes"], args.warps, args.sequential_slots, args.block_h, info["num_sms"],
                            tuple(args.programs_per_sm), args.contiguous_qkv)
        data["shapes"].append(shape)
        harness.write_json(out, data)
        for name, stats in shape["rows"].items():
            print(f"T={t:6d} {name:26s} {stats['us_median']:9.2f} us  {stats['GBps_op_bytes']:6.0f} GB/s (op bytes)",
                  flush=True)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
