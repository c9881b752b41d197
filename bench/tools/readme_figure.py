"""The README's picture and headline table, from the benchmark pages' JSON of one GPU run.

One panel per family: the fused op, vLLM's production ops (where the run had vLLM's op
library: ``bench/vllm_ops.py``) and ``torch.compile`` of the unfused code, median microseconds
against T, log-log. The table gives, per family and T, each column's time and the fused op's
speedup over vLLM's and over ``torch.compile``.

    PYTHONPATH=. python bench/tools/readme_figure.py --gqa bench/results/gqa_...json \\
        --dsv4 bench/results/dsv4_...json [--indexer bench/results/dsv4_indexer_...json] \\
        [--png bench/results/readme_<device>.png] [--readme README.md]

With ``--readme`` the table replaces the lines between ``<!-- headline:begin -->`` and
``<!-- headline:end -->``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = {"fused": "prepfuse", "vllm": "vLLM", "vllm-default": "vLLM (no fusion pass)", "compile": "torch.compile"}
COLORS = {"fused": "tab:blue", "vllm": "tab:orange", "vllm-default": "tab:red", "compile": "tab:green"}
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"


def series(data: dict, keep) -> dict[str, dict[int, float]]:
    """impl -> {T: median us} over the rows ``keep`` accepts: the fused op's and vLLM's where
    their gate passed; torch.compile's as timed (it compiles the model's code, whose roundings
    the op's bit-level gate need not match)."""
    out: dict[str, dict[int, float]] = {}
    for row in data.get("rows", []):
        impl = row.get("impl")
        gated = impl == "compile" or row.get("correct", True)
        if impl in COLUMNS and keep(row) and gated and "us_median" in row:
            out.setdefault(impl, {})[int(row["T"])] = float(row["us_median"])
    return out


def families(args) -> list[tuple[str, dict]]:
    found = []
    if args.gqa:
        data = json.loads(Path(args.gqa).read_text())
        found.append((f"GQA ({args.gqa_model})", series(data, lambda r: r.get("model") == args.gqa_model)))
    if args.dsv4:
        data = json.loads(Path(args.dsv4).read_text())
        found.append((f"DeepSeek-V4 (H={args.heads}, fp8_ds_mla)",
                      series(data, lambda r: r.get("H") == args.heads and r.get("block_size", 64) == 64)))
    if args.indexer:
        data = json.loads(Path(args.indexer).read_text())
        found.append((f"DeepSeek-V4 indexer ({args.indexer_format})",
                      series(data, lambda r: r.get("format") == args.indexer_format)))
    return found


def table(found: list[tuple[str, dict]]) -> str:
    lines = ["| family | T | prepfuse us | vLLM us | torch.compile us | x vLLM | x compile |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in found:
        fused = s.get("fused", {})
        for t in sorted(fused):
            v, c = s.get("vllm", {}).get(t), s.get("compile", {}).get(t)
            cell = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
            ratio = lambda x: f"{x / fused[t]:.2f}x" if x is not None else "-"  # noqa: E731
            lines.append(f"| {name} | {t} | {fused[t]:.2f} | {cell(v)} | {cell(c)} | {ratio(v)} | {ratio(c)} |")
    return "\n".join(lines)


def plot(found: list[tuple[str, dict]], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 4), squeeze=False)
    for ax, (name, s) in zip(axes[0], found):
        for impl, label in COLUMNS.items():
            if impl in s:
                ts = sorted(s[impl])
                ax.plot(ts, [s[impl][t] for t in ts], marker="o", label=label, color=COLORS[impl])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("median us (CUDA-graph replay)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"attention-input prep on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gqa")
    p.add_argument("--gqa-model", default="qwen3-8b")
    p.add_argument("--dsv4")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--indexer")
    p.add_argument("--indexer-format", default="mxfp4")
    p.add_argument("--png")
    p.add_argument("--device", default="NVIDIA H200")
    p.add_argument("--readme")
    args = p.parse_args(argv)
    found = [(name, s) for name, s in families(args) if s.get("fused")]
    text = table(found)
    print(text)
    if args.png:
        plot(found, Path(args.png), args.device)
    if args.readme:
        readme = Path(args.readme)
        body = readme.read_text()
        if BEGIN not in body or END not in body:
            raise SystemExit(f"{readme}: no {BEGIN} ... {END} lines to replace")
        head, rest = body.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
