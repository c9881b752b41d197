"""The copy bandwidth a fused op's own byte count allows: an SM copy kernel of the same size.

The benchmarks rate each op against one copy bandwidth, measured on a 4 GiB copy
(``harness.measure_copy_bandwidth``). A smaller launch cannot reach that rate: a graph of
back-to-back kernels pays each kernel's ramp-up and tail, and the smaller the launch the
larger their share. This script times the same SM copy kernel (``torch.neg`` on fp32, 16-byte
vectors), by the benchmarks' method (CUDA-graph replay of 20 back-to-back calls, median per
call, inputs rotated so that large sizes find L2 cold), at the read + write bytes of each op
at the given token counts, and reports each as a share of the 4 GiB copy: how close to the
ceiling of its own size a fused op's "% of copy bandwidth" already is.

    PYTHONPATH=. python bench/tools/copy_ceiling.py --tokens 4096,16384 --out-dir bench/results
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # the harness and the benchmarks whose byte counts it times

import harness  # noqa: E402
import torch  # noqa: E402


def op_bytes(tokens: int) -> dict[str, int]:
    """Read + write bytes of each benchmarked op at ``tokens`` (the benchmarks' own counts)."""
    import bench_dsv4_indexer_rope_quant_insert as idx
    import bench_dsv4_qnorm_rope_kv_insert as dsv4
    import bench_gqa_qknorm_rope_kv_insert as gqa

    sizes = {f"gqa {name}": gqa.gqa_bytes_moved(tokens, model) for name, model in gqa.MODELS.items()}
    sizes.update({f"indexer {fmt}": idx.indexer_bytes_moved(tokens, idx.key_rows(tokens), idx.HEADS, fmt)
                  for fmt in ("fp8", "mxfp4")})
    sizes.update({f"dsv4 H={h}": dsv4.bytes_moved(tokens, h, dsv4.padded_heads(h), tokens) for h in (16, 64)})
    return sizes


def time_copy(nbytes: int, l2_bytes: int) -> dict:
    """The SM copy of ``nbytes`` read + write bytes (half each way), per call."""
    n = max(4, (nbytes // 2) // 16 * 4)  # fp32 elements, a multiple of 4 (16-byte vectors)
    k = harness.rotation_copies(8 * n, l2_bytes, 0.25)
    pairs = [(torch.randn(n, device=harness.DEVICE), torch.empty(n, device=harness.DEVICE)) for _ in range(k)]
    graphs = harness.capture_graphs(lambda p: torch.neg(p[0], out=p[1]), pairs, warmup=2)
    stats = harness.time_graphs(graphs, target_ms=40, min_replays=10, max_replays=100)
    return {"bytes": 8 * n, "copies": k, **stats, "GBps": 8 * n / (stats["us_median"] * 1e-6) / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=harness.parse_int_list, default=[4096, 16384])
    p.add_argument("--out-dir", default=str(BENCH / "results"))
    args = p.parse_args()
    info = harness.device_info()
    harness.spin_up_clocks()
    big = harness.measure_copy_bandwidth(4 << 30)
    data = {"what": "an SM copy kernel at each op's byte count, as a share of the 4 GiB copy",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **info,
            "copy_bandwidth": big, "rows": []}
    print(f"4 GiB copy: {big['GBps']:.0f} GB/s ({big['method']})")
    for t in args.tokens:
        for name, nbytes in op_bytes(t).items():
            row = {"op": name, "T": t, **time_copy(nbytes, info["l2_bytes"])}
            row["share_of_4gib_copy"] = row["GBps"] / big["GBps"]
            data["rows"].append(row)
            print(f"T={t:6d} {name:32s} {row['bytes'] / 1e6:8.1f} MB  copy {row['us_median']:8.2f} us "
                  f"{row['GBps']:6.0f} GB/s = {100 * row['share_of_4gib_copy']:5.1f}% of the 4 GiB copy")
    out = Path(args.out_dir) / f"copy_ceiling_{info['device_slug']}.json"
    harness.write_json(out, data)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
