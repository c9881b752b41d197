"""Same-run A/B tables: the fused op's median per (model or case, T) in each of several result
files, one column a file, as markdown.

    python bench/ab_table.py bench/results/gqa_qknorm_rope_kv_insert_nvidia-h200_ab32_{base,new}_{1,2}.json

Reads the GQA, DeepSeek-V4 and indexer benchmarks' JSON (``rows[]`` with ``us_median``; the
fused rows only) and ``bench/decode_floor.py``'s (``per_call_us``: one row a ladder step or
op, T=1). A column is named by what its file name adds to the first file's common prefix
(``base_1``, ``new_2``), so the table reads as the A/B it is. ``gpu_session.sh ab`` writes
such files: variants of one tree timed alternately in one device call, where a difference
between the variants can be told from the spread between two runs of one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def medians(path: Path) -> dict[tuple[str, str], float]:
    """``{(row name, T): us}`` of one result file's fused rows (decode floor: T = "1")."""
    data = json.loads(path.read_text())
    if "per_call_us" in data:
        return {(name, "1"): us for name, us in data["per_call_us"].items()}
    out = {}
    for row in data.get("rows", []):
        if row.get("impl", "fused") != "fused" or "us_median" not in row:
            continue
        # GQA rows name a model, indexer rows a format; DeepSeek-V4 rows are (H, block size),
        # both needed: its runs time each H at two block sizes
        name = row.get("model") or row.get("format") or f"H={row.get('H')} bs={row.get('block_size')}"
        out[(str(name), str(row["T"]))] = row["us_median"]
    return out


def column_names(paths: list[Path]) -> list[str]:
    stems = [p.stem for p in paths]
    prefix = os.path.commonprefix(stems) if len(stems) > 1 else ""
    cut = prefix.rfind("_") + 1 if "_" in prefix else len(prefix)
    return [s[cut:] or s for s in stems]


def table(paths: list[Path]) -> str:
    columns = [medians(p) for p in paths]
    keys = list(dict.fromkeys(k for c in columns for k in c))
    lines = ["| row | T | " + " | ".join(column_names(paths)) + " |",
             "|---|---:|" + "---:|" * len(paths)]
    for name, t in keys:
        cells = [f"{c[(name, t)]:.2f}" if (name, t) in c else "-" for c in columns]
        lines.append(f"| {name} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    print(table(args.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
