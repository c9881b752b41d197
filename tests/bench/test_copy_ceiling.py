"""``bench/tools/copy_ceiling.py`` without a GPU: the byte counts it times a copy at are the
benchmarks' own (a renamed or changed count there must not leave it timing other sizes)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH), str(BENCH / "tools")]

import bench_dsv4_indexer_rope_quant_insert as idx  # noqa: E402
import bench_dsv4_qnorm_rope_kv_insert as dsv4  # noqa: E402
import bench_gqa_qknorm_rope_kv_insert as gqa  # noqa: E402
import copy_ceiling  # noqa: E402


def test_sizes_are_the_benchmarks_byte_counts():
    sizes = copy_ceiling.op_bytes(4096)
    assert set(sizes) == ({f"gqa {m}" for m in gqa.MODELS} | {"indexer fp8", "indexer mxfp4"}
                          | {"dsv4 H=16", "dsv4 H=64"})
    # Qwen3-8B: per token 48 heads read, 32 written (bf16), 16 cache rows written, and its
    # cos/sin row (64 cos and 64 sin, fp32)
    assert sizes["gqa qwen3-8b"] == 4096 * ((48 + 32 + 16) * 128 * 2 + 128 * 4)
    assert sizes["gqa qwen3-8b-fp8"] < sizes["gqa qwen3-8b"]
    assert sizes["indexer mxfp4"] == idx.indexer_bytes_moved(4096, 1024, 64, "mxfp4")
    assert sizes["dsv4 H=16"] == dsv4.bytes_moved(4096, 16, 64, 4096)


def test_pages_rate_each_row_against_the_copy_of_its_own_size():
    import json

    import harness

    ceiling, name = harness.same_size_copy("nvidia-h200")
    assert name == "copy_ceiling_nvidia-h200.json"
    data = json.loads((BENCH / "results" / "gqa_qknorm_rope_kv_insert_nvidia-h200.json").read_text())
    page = gqa.render_markdown(data, "x.json", "x.png")
    assert "% same-size copy" in page and name in page
    fused = next(r for r in data["rows"] if (r["model"], r["impl"], r["T"]) == ("qwen3-8b", "fused", 4096))
    share = f"{100 * fused['GBps'] / ceiling[('gqa qwen3-8b', 4096)]:.0f}%"
    row = next(line for line in page.splitlines() if line.startswith("| qwen3-8b | 4096 |"))
    assert row.split(" | ")[5] == share
    # T=1 has no copy of its size: no share
    assert next(line for line in page.splitlines() if line.startswith("| qwen3-8b | 1 |")).split(" | ")[5] == "-"
    # a device without a ceiling run: the column stays, empty, and the page names no file
    assert harness.same_size_copy("no-such-device") == ({}, "")
    other = gqa.render_markdown({**data, "device_slug": "no-such-device"}, "x.json", "x.png")
    assert name not in other and row.split(" | ")[:5] == next(
        line for line in other.splitlines() if line.startswith("| qwen3-8b | 4096 |")).split(" | ")[:5]
