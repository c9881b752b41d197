"""``bench/kernel_sass.py`` without a GPU: it compiles a benchmark case's kernel for sm_90
and its summary shows the GQA kernel's row loads as 16-byte vectors on the benchmark's
inputs, whose token stride (6168) is a multiple of 16 bytes but not of 16 elements. Before
``stride_unit`` every row load there was a scalar ``LDG.E.U16`` (32 a thread)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prepfuse._compat import has_triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernel_sass.py"


@pytest.mark.skipif(not has_triton(), reason="needs triton (its ptxas and nvdisasm)")
def test_gqa_rows_load_as_vectors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "gqa-llama3-8b", "16", "--launch-config", "8,1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    counts = dict(re.findall(r"(LDG\.E[.A-Z0-9]*) (\d+)", result.stdout))
    # 16-byte loads with or without an eviction hint (LDG.E.EF.128: evict_first)
    assert sum(int(n) for op, n in counts.items() if op.endswith(".128")) >= 4, result.stdout
    assert not any("U16" in op for op in counts), result.stdout
    assert (tmp_path / "gqa-llama3-8b_T16.sass").stat().st_size > 0


@pytest.mark.skipif(not has_triton(), reason="needs triton (its ptxas and nvdisasm)")
def test_a_case_name_with_a_dot_keeps_its_files_apart(tmp_path):
    """gqa-llama3.2-1b's files are named after the whole case: Path.with_suffix once cut the
    name at its dot (gqa-llama3.sass), so two such cases overwrote each other's SASS."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "gqa-llama3.2-1b", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "gqa-llama3.2-1b_T1.sass").stat().st_size > 0
    assert not (tmp_path / "gqa-llama3.sass").exists()
