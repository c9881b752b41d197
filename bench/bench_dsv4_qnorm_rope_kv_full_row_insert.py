"""Time ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert`` beside the fp8_ds_mla op at the same shapes.

Run from the repository root on a CUDA machine::

    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_full_row_insert.py --out-dir $OUT --docs $OUT/page.md
    PYTHONPATH=. python bench/bench_dsv4_qnorm_rope_kv_full_row_insert.py --from-json bench/results/<file>.json

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
against the reference runs first at every shape. ``--docs`` (default with ``--from-json``:
docs/benchmarks_full_row.md) writes the page from the result file.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
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


FORMAT_NAMES = {"bf16": "full row, bf16", "fp8": "full row, e4m3", "ds_mla": "fp8_ds_mla"}


def slower_rows(data: dict) -> list[dict]:
    """The rows where vLLM's op was faster than prepfuse's."""
    return [r for r in data["rows"] if r.get("speedup_vs_vllm", 2.0) < 1.0]


def render_markdown(data: dict, json_name: str) -> str:
    """The page: one row per (H, T, format), prepfuse's time beside vLLM's where it ran."""
    vllm = data.get("vllm", {})
    column = (f"vLLM {vllm['version']}'s own CUDA ops from its op library, timed in this run by the same method"
              if "version" in vllm else f"absent ({vllm.get('absent', 'not recorded')})")
    lines = [
        "# Benchmark: prepfuse::dsv4_qnorm_rope_kv_full_row_insert",
        "",
        f"Generated by `bench/bench_dsv4_qnorm_rope_kv_full_row_insert.py` from `bench/results/{json_name}`; "
        "do not edit by hand.",
        "",
        f"- **Date:** {data['date']}; **device:** {data['device']} ({data['num_sms']} SMs); torch {data['torch']}, "
        f"triton {data['triton']}",
        f"- **Copy bandwidth:** {data['copy']['GBps']:.0f} GB/s",
        "- **Method:** as `docs/benchmarks.md` (CUDA graphs, median, L2 rotation for large T); block size "
        f"{data['block_size']}; q unpadded for the full-row formats (as vLLM calls its full-cache ops), padded to "
        "FlashMLA's 64 or 128 heads for fp8_ds_mla; a gate against the reference before timing.",
        f"- **vLLM column:** {column}: `fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert` and "
        "`..._fp8_insert` for the full rows, `fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert` for fp8_ds_mla; "
        "`x vLLM` is vLLM's time over prepfuse's.",
        "",
        "| H | T | format | prepfuse us | % copy BW | gate | vLLM us | x vLLM | vLLM gate |",
        "|---:|---:|---|---:|---:|---|---:|---:|---|",
    ]
    for r in data["rows"]:
        timed = "vllm_us_median" in r
        lines.append(
            f"| {r['H']} | {r['T']} | {FORMAT_NAMES[r['format']]} | {r['us_median']:.2f} | {r['frac_of_copy_bw']:.0%} | "
            f"{'pass' if r['correct'] else 'FAIL'} | {r['vllm_us_median']:.2f} | {r['speedup_vs_vllm']:.2f}x | "
            f"{'pass' if r['vllm_correct'] else 'outside'} |" if timed else
            f"| {r['H']} | {r['T']} | {FORMAT_NAMES[r['format']]} | {r['us_median']:.2f} | {r['frac_of_copy_bw']:.0%} | "
            f"{'pass' if r['correct'] else 'FAIL'} | - | - | - |")
    slower = slower_rows(data)
    timed = [r for r in data["rows"] if "speedup_vs_vllm" in r]
    lines += ["", f"prepfuse is faster in {len(timed) - len(slower)} of {len(timed)} timed rows." if timed
              else "No row timed vLLM's op."]
    if slower:
        lines.append("Where it is not: " + "; ".join(
            f"{FORMAT_NAMES[r['format']]} H={r['H']} T={r['T']} {r['us_median']:.2f} us against {r['vllm_us_median']:.2f} "
            f"({(1 / r['speedup_vs_vllm'] - 1):.0%} slower, {r['us_median'] - r['vllm_us_median']:.2f} us)"
            for r in slower) + ".")
    lines += [
        "",
        "`vLLM gate` holds vLLM's outputs to the bound prepfuse's op is held to against its reference: full rows "
        "exact in the cache, q within the DeepSeek-V4 spec; fp8_ds_mla the spec's few per million. `outside` marks "
        "rows where vLLM's outputs are not: the bf16 full-row cache in a few values per million where the rotation "
        "cancels to almost nothing (tests/ops/test_vllm_parity.py holds both ops to 10 per million there); "
        "fp8_ds_mla's q where one-ULP values pass the spec's 10 per million (the parity test's H100 run at T=64, "
        "H=128 saw 42 in 4.2M).",
        "",
    ]
    return "\n".join(lines)


def write_reports(data: dict, json_path: Path, docs_path: Path | None) -> None:
    docs_path = docs_path or ROOT / "docs" / "benchmarks_full_row.md"
    docs_path.write_text(render_markdown(data, json_path.name))
    print(f"wrote {docs_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--tokens", type=harness.parse_int_list, default=list(DEFAULT_TOKENS))
    p.add_argument("--heads", type=harness.parse_int_list, default=list(DEFAULT_HEADS))
    p.add_argument("--target-ms", type=float, default=200.0)
    p.add_argument("--docs", default=None, help="the page to write (default with --from-json: docs/benchmarks_full_row.md)")
    p.add_argument("--from-json", default=None)
    args = p.parse_args(argv)
    early = harness.from_json_or_cuda(args, write_reports)
    if early is not None:
        return early
    data, path = run(args)
    print(f"wrote {path}")
    if args.docs:
        write_reports(data, path, Path(args.docs))
    return 0 if all(r["correct"] for r in data["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
