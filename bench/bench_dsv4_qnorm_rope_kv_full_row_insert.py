"""Time ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert`` beside the fp8_ds_mla op at the same shapes.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_full_row_insert.py --out-dir $OUT

Rows: the full-row op in vLLM's two formats ("bf16": bf16 q_out and cache; "fp8": e4m3 q_out and
cache, one scale each), q unpadded as vLLM calls its full-cache ops, and the fp8_ds_mla op
("ds_mla") with q padded to FlashMLA's 64 or 128 heads, block size 64, about 10% of slots
skipped. Where vLLM's op library is present (``vllm_ops``) each row also times vLLM's op for that
format on the same inputs (``vllm_us_median``, its gate against prepfuse's reference in
``vllm_correct``). Each is the op through
the dispatcher, CUDA-graph replay medians with the shared method (``harness``: back-to-back calls
a graph, input sets rotated so big calls find a cold L2, index checks off as under capture), the
bytes the call must move and the share of the copy bandwidth measured in the same run. Writes
``dsv4_qnorm_rope_kv_full_row_insert_<device>.json`` and prints the table; a correctness gate
against the reference runs first at every shape.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402  (also puts the repository on sys.path)
import vllm_ops  # noqa: E402

DEFAULT_TOKENS = (1, 8, 64, 512, 4096)  # inputs are drawn on the host: 16384 x 128 heads takes minutes
DEFAULT_HEADS = (16, 64, 128)
BLOCK_SIZE = 64
FORMATS = ("bf16", "fp8", "ds_mla")


def make(fmt: str, num_tokens: int, num_heads: int):
    """(fresh inputs, the op, its checked reference, compare(a, b) -> within the bound)."""
    from prepfuse.ops import (
        DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, DSV4_QNORM_ROPE_KV_INSERT, dsv4_qnorm_rope_kv_full_row_insert_reference,
        dsv4_qnorm_rope_kv_insert_reference,
    )
    from prepfuse.testing import compare_dsv4, compare_dsv4_full_row, make_dsv4_full_row_inputs, make_dsv4_inputs

    if fmt == "ds_mla":
        padded = 64 if num_heads <= 64 else 128
        inputs = make_dsv4_inputs(num_tokens, num_heads, padded, BLOCK_SIZE, "cuda")
        return inputs, DSV4_QNORM_ROPE_KV_INSERT, dsv4_qnorm_rope_kv_insert_reference, compare_dsv4
    inputs = make_dsv4_full_row_inputs(num_tokens, num_heads, num_heads, BLOCK_SIZE, "cuda", fmt=fmt)
    return (inputs, DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, dsv4_qnorm_rope_kv_full_row_insert_reference,
            compare_dsv4_full_row)


def bytes_moved(inputs) -> int:
    """The fewest bytes a call moves: q, kv rows, positions, slots and one cos/sin row per token
    read; q_out and one cache row (fp8_ds_mla: 584 bytes) per inserted slot written."""
    t, tp = inputs.q.shape[0], inputs.slot_mapping.shape[0]
    row = 584 if inputs.k_cache.dtype == torch.uint8 else 512 * inputs.k_cache.element_size()
    return (inputs.q.numel() * 2 + tp * 1024 + t * 8 + tp * 8 + t * 256
            + inputs.q_out.numel() * inputs.q_out.element_size() + tp * row)


def vllm_launch(vllm, fmt: str):
    """vLLM's op for ``fmt`` as a function of the inputs, or None."""
    if vllm is None:
        return None
    return vllm.dsv4_fp8_ds_mla_insert if fmt == "ds_mla" else vllm.dsv4_full_row_insert


def run(args) -> tuple[dict, Path]:
    info = harness.device_info()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"dsv4_qnorm_rope_kv_full_row_insert_{info['device_slug']}.json"
    harness.spin_up_clocks()
    copy = harness.measure_copy_bandwidth(4 << 30)
    vllm = vllm_ops.load()
    print(f"vLLM ops: {vllm.path if vllm else vllm_ops.absent_reason()}", flush=True)
    data = {"what": "DeepSeek-V4 prep: full-row caches beside fp8_ds_mla", "block_size": BLOCK_SIZE,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **info,
            "copy": copy, "vllm": vllm_ops.column_info(), "rows": []}
    for h in args.heads:
        for t in args.tokens:
            line = []
            for fmt in FORMATS:
                inputs, op, reference, compare = make(fmt, t, h)
                want, got = inputs.fresh_outputs(), inputs.fresh_outputs()
                reference(*want.args())
                op(*got.args())
                correct = compare(want, got).within_spec()
                if not correct:
                    harness.loud(f"{fmt} T={t} H={h}: differs from the reference: {compare(want, got)}")
                nbytes = bytes_moved(inputs)
                k = harness.rotation_copies(nbytes, info["l2_bytes"], 0.25)
                copies = [inputs] + [make(fmt, t, h)[0] for _ in range(k - 1)]
                with harness.IndexChecksOff():
                    graphs = harness.capture_graphs(lambda inp: op(*inp.args()), copies, warmup=3)
                    row = {"format": fmt, "T": t, "H": h, "HP": inputs.q_out.shape[1], "copies": k,
                           "correct": correct, "bytes": nbytes, **harness.time_graphs(graphs, args.target_ms, 10, 200)}
                row["GBps"] = nbytes / row["us_median"] / 1e3
                row["frac_of_copy_bw"] = row["GBps"] / copy["GBps"]
                text = f"{fmt} {row['us_median']:8.2f} us ({row['frac_of_copy_bw']:.0%})"
                launch = vllm_launch(vllm, fmt)
                if launch is not None and (fmt != "ds_mla" or vllm_ops.dsv4_fits(t, inputs.q_out.shape[1])):
                    # vLLM's outputs on fresh copies against prepfuse's reference, by the same bound
                    row["vllm_correct"] = compare(want, vllm.dsv4_outputs(inputs)).within_spec()
                    with harness.IndexChecksOff():
                        vgraphs = harness.capture_graphs(launch, [c.fresh_outputs() for c in copies], warmup=3)
                        row["vllm_us_median"] = harness.time_graphs(vgraphs, args.target_ms, 10, 200)["us_median"]
                    row["speedup_vs_vllm"] = row["vllm_us_median"] / row["us_median"]
                    text += f" vLLM {row['vllm_us_median']:7.2f} ({row['speedup_vs_vllm']:.2f}x{'' if row['vllm_correct'] else ' GATE'})"
                    del vgraphs
                data["rows"].append(row)
                line.append(text)
                del graphs, copies
                torch.cuda.empty_cache()
            print(f"H={h:3d} T={t:5d}: " + "  ".join(line), flush=True)
            harness.write_json(path, data)
    return data, path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--tokens", type=harness.parse_int_list, default=list(DEFAULT_TOKENS))
    p.add_argument("--heads", type=harness.parse_int_list, default=list(DEFAULT_HEADS))
    p.add_argument("--target-ms", type=float, default=200.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    data, path = run(args)
    print(f"wrote {path}")
    return 0 if all(r["correct"] for r in data["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
