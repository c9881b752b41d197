"""Launch-configuration sweep of the DeepSeek-V4 indexer kernel (both formats).

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/tools/sweep_dsv4_indexer_launch.py --out-dir $OUT

Times ``launch_indexer_kernel`` alone at each (heads per program, warps per program),
on the shapes, inputs, byte count and byte-for-byte gate of
``bench_dsv4_indexer_rope_quant_insert.py`` (H = 64, Tk = max(1, T // 4), block size 64),
with the timing method of ``bench_dsv4_qnorm_rope_kv_insert.py`` (graphs of back-to-back
calls, median, L2 rotation over input copies for big calls). Prints the best
configuration per shape beside ``_launch_config``'s choice and writes
``dsv4_indexer_launch_sweep_<formats>_<device>.json``; the op's ``_launch_config`` table
is read off it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and the indexer benchmark

import bench_dsv4_indexer_rope_quant_insert as ibench  # noqa: E402
import harness  # noqa: E402

TOKENS = (1, 64, 4096, 16384)
SWEEP_BLOCK_H = (1, 2, 4, 8, 16, 32)
SWEEP_NUM_WARPS = (1, 2, 4)


def kernel_call(fmt: str, launch_config):
    from prepfuse.ops.dsv4_indexer_common import launch_indexer_kernel

    def call(inp):
        launch_indexer_kernel(
            inp.q, inp.weights, inp.k, inp.q_out, inp.q_scale, inp.weights_out, inp.k_cache, inp.slot_mapping,
            inp.positions, inp.k_positions, inp.cos_sin_cache, inp.weights_scale, inp.block_size,
            mxfp4=fmt == "mxfp4", launch_config=launch_config,
        )

    return call


def main(argv: list[str] | None = None) -> int:
    from prepfuse.ops.dsv4_indexer_common import _launch_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=harness.parse_int_list, default=list(TOKENS))
    parser.add_argument("--formats", type=lambda s: s.split(","), default=["fp8", "mxfp4"])
    parser.add_argument("--target-ms", type=float, default=40.0)
    parser.add_argument("--block-h", type=harness.parse_int_list, default=list(SWEEP_BLOCK_H),
                        help="heads per program to try")
    parser.add_argument("--warps", type=harness.parse_int_list, default=list(SWEEP_NUM_WARPS),
                        help="warps per program to try")
    parser.add_argument("--maxnreg", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                        help="register caps per thread to try (0: none)")
    parser.add_argument("--name-suffix", default="", help="appended to the JSON name")
    args = parser.parse_args(argv)
    info = harness.device_info()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"dsv4_indexer_launch_sweep_{'-'.join(args.formats)}_{info['device_slug']}{args.name_suffix}.json"
    data = {"op": "dsv4_indexer (launch_indexer_kernel)", "H": ibench.HEADS, "block_size": ibench.BLOCK_SIZE, **info,
            "rows": [], "best": []}
    harness.spin_up_clocks()
    for fmt in args.formats:
        for t in args.tokens:
            num_k = ibench.key_rows(t)
            nbytes = ibench.indexer_bytes_moved(t, num_k, ibench.HEADS, fmt)
            copies_needed = harness.rotation_copies(nbytes, info["l2_bytes"], ibench.WARM_BELOW_L2)
            gate = ibench.make_inputs(fmt, t, skip_fraction=0.1)
            copies = [ibench.make_inputs(fmt, t, skip_fraction=0.0) for _ in range(copies_needed)]
            heuristic = (tuple(_launch_config(t, ibench.HEADS)) + (0,))[:3]
            rows = []
            for bh, w, nreg in itertools.product(args.block_h, args.warps, args.maxnreg):
                fn = kernel_call(fmt, (bh, w, nreg))
                row = {"format": fmt, "T": t, "Tk": num_k, "BLOCK_H": bh, "num_warps": w, "maxnreg": nreg,
                       "heuristic": (bh, w, nreg) == heuristic, "bytes": nbytes}
                try:
                    row["correct"], _ = ibench.gate("fused", fmt, fn, gate)
                    graphs = harness.capture_graphs(fn, copies, warmup=2)
                    row.update(harness.time_graphs(graphs, args.target_ms, 10, 100))
                    row["GBps"] = row["bytes"] / (row["us_median"] * 1e-6) / 1e9
                    del graphs
                except Exception as err:  # noqa: BLE001 - record and go on: the sweep stays complete
                    row["error"] = f"{type(err).__name__}: {err}"
                rows.append(row)
            data["rows"].extend(rows)
            timed = [r for r in rows if "us_median" in r and r["correct"]]
            heur = next((r for r in rows if r["heuristic"]), {})
            if timed:
                best = min(timed, key=lambda r: r["us_median"])
                data["best"].append({"format": fmt, "T": t, "best": [best["BLOCK_H"], best["num_warps"], best["maxnreg"]],
                                     "us": best["us_median"], "GBps": best["GBps"], "heuristic": list(heuristic),
                                     "heuristic_us": heur.get("us_median")})
                print(f"{fmt:5s} T={t:5d}: best {best['BLOCK_H']}/{best['num_warps']}/{best['maxnreg']} {best['us_median']:.2f} us "
                      f"({best['GBps']:.0f} GB/s); heuristic {'/'.join(map(str, heuristic))} "
                      f"{heur.get('us_median', float('nan')):.2f} us"
                      + ("" if len(timed) == len(rows) else f"  ({len(rows) - len(timed)} configs failed or inexact)"),
                      flush=True)
            else:
                harness.loud(f"{fmt} T={t}: no configuration ran correctly: {rows[0].get('error')}")
            del copies, gate
            torch.cuda.empty_cache()
            harness.write_json(path, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
