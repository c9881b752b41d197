"""Launch-configuration sweep of the DeepSeek-V4 full-row kernel at the small T where vLLM's op is close.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/tools/sweep_dsv4_full_row_launch.py --out-dir $OUT [--tokens 1,8,64] [--heads 16,128]

Times ``dsv4_qnorm_rope_kv_full_row_insert_triton`` at each (heads per program, warps per
program) on the inputs, gate and timing method of ``bench_dsv4_qnorm_rope_kv_full_row_insert.py``
(block size 64, CUDA-graph replay medians), beside the op through the dispatcher with its own
table and, when its library is carried, vLLM's op on the same inputs. Prints the best
configuration per row and writes ``dsv4_full_row_launch_sweep_<device>.json``: the full-row
kernel borrows the fp8_ds_mla kernel's table, and this says whether its own rows want another.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and the full-row benchmark

import bench_dsv4_qnorm_rope_kv_full_row_insert as fbench  # noqa: E402
import harness  # noqa: E402
import vllm_ops  # noqa: E402

TOKENS = (1, 8, 64, 512)
HEADS = (16, 64, 128)
SWEEP = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2))


def timed(fn, copies, target_ms) -> float:
    with harness.IndexChecksOff():
        graphs = harness.capture_graphs(fn, copies, warmup=3)
        return harness.time_graphs(graphs, target_ms, 10, 200)["us_median"]


def main(argv: list[str] | None = None) -> int:
    from prepfuse.ops.dsv4_qnorm_rope_kv_full_row_insert import dsv4_qnorm_rope_kv_full_row_insert_triton
    from prepfuse.ops.dsv4_qnorm_rope_kv_insert import _launch_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=harness.parse_int_list, default=list(TOKENS))
    parser.add_argument("--heads", type=harness.parse_int_list, default=list(HEADS))
    parser.add_argument("--formats", type=lambda s: s.split(","), default=["bf16", "fp8"])
    parser.add_argument("--target-ms", type=float, default=40.0)
    args = parser.parse_args(argv)
    info = harness.device_info()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"dsv4_full_row_launch_sweep_{info['device_slug']}.json"
    vllm = vllm_ops.load()
    data = {"op": "dsv4_qnorm_rope_kv_full_row_insert (triton launcher)", "block_size": fbench.BLOCK_SIZE, **info,
            "vllm": vllm_ops.column_info(), "rows": []}
    harness.spin_up_clocks()
    for fmt, h, t in itertools.product(args.formats, args.heads, args.tokens):
        inputs, op, reference, compare = fbench.make(fmt, t, h)
        want = inputs.fresh_outputs()
        reference(*want.args())
        k = harness.rotation_copies(fbench.bytes_moved(inputs), info["l2_bytes"], 0.25)
        copies = [inputs] + [fbench.make(fmt, t, h)[0] for _ in range(k - 1)]
        row = {"format": fmt, "T": t, "H": h, "heuristic": list(_launch_config(t, h)), "configs": []}
        for bh, w in SWEEP:
            def launch(inp, cfg=(bh, w)):
                dsv4_qnorm_rope_kv_full_row_insert_triton(*inp.args(), launch_config=cfg)
            got = inputs.fresh_outputs()
            launch(got)
            entry = {"BLOCK_H": bh, "num_warps": w, "correct": compare(want, got).within_spec()}
            if entry["correct"]:
                entry["us_median"] = timed(launch, copies, args.target_ms)
            row["configs"].append(entry)
        row["op_us_median"] = timed(lambda inp: op(*inp.args()), copies, args.target_ms)
        if vllm is not None:
            row["vllm_us_median"] = timed(vllm.dsv4_full_row_insert, [c.fresh_outputs() for c in copies], args.target_ms)
        data["rows"].append(row)
        ok = [c for c in row["configs"] if "us_median" in c]
        best = min(ok, key=lambda c: c["us_median"]) if ok else None
        text = " ".join(f"{c['BLOCK_H']}/{c['num_warps']} {c.get('us_median', float('nan')):.2f}" for c in row["configs"])
        print(f"{fmt:4s} H={h:3d} T={t:4d}: op {row['op_us_median']:.2f} us, vLLM {row.get('vllm_us_median', float('nan')):.2f}"
              f"; best {best['BLOCK_H']}/{best['num_warps']} {best['us_median']:.2f}; table {row['heuristic']}; {text}"
              if best else f"{fmt} H={h} T={t}: no configuration gave the reference's outputs", flush=True)
        del copies
        torch.cuda.empty_cache()
        harness.write_json(path, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
