"""``bench/ab_table.py`` without a GPU: one column a result file, named by what the file adds
to the others' common name, the fused rows only, and the decode floor's ladder read alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ab_table  # noqa: E402


def _bench_file(path: Path, fused_t1_us: float) -> Path:
    rows = [
        {"model": "qwen3-8b", "impl": "fused", "T": 1, "us_median": fused_t1_us},
        {"model": "qwen3-8b", "impl": "compile", "T": 1, "us_median": 9.0},  # not the fused op: left out
        {"model": "qwen3-8b", "impl": "fused", "T": 4096, "error": "no time"},  # not timed: left out
    ]
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_columns_are_the_files_variants_and_rows_the_fused_ones(tmp_path):
    base = _bench_file(tmp_path / "gqa_x_ab9_base_1.json", 1.8)
    new = _bench_file(tmp_path / "gqa_x_ab9_new_1.json", 1.7)
    lines = ab_table.table([base, new]).splitlines()
    assert lines[0] == "| row | T | base_1 | new_1 |"
    assert lines[2:] == ["| qwen3-8b | 1 | 1.80 | 1.70 |"]


def test_decode_floor_ladder_and_a_row_missing_from_one_file(tmp_path):
    a = tmp_path / "decode_floor_dev_ab9_base_1.json"
    b = tmp_path / "decode_floor_dev_ab9_new_1.json"
    a.write_text(json.dumps({"per_call_us": {"torch add_ (harness floor)": 0.99, "op gqa-qwen3-8b": 1.85}}))
    b.write_text(json.dumps({"per_call_us": {"torch add_ (harness floor)": 0.98}}))
    lines = ab_table.table([a, b]).splitlines()
    assert lines[2] == "| torch add_ (harness floor) | 1 | 0.99 | 0.98 |"
    assert lines[3] == "| op gqa-qwen3-8b | 1 | 1.85 | - |"


def test_deepseek_rows_keep_each_block_size(tmp_path):
    rows = [{"impl": "fused", "T": 1, "H": 64, "block_size": bs, "us_median": us} for bs, us in ((64, 1.6), (256, 1.7))]
    path = tmp_path / "dsv4_x.json"
    path.write_text(json.dumps({"rows": rows}))
    assert ab_table.medians(path) == {("H=64 bs=64", "1"): 1.6, ("H=64 bs=256", "1"): 1.7}
