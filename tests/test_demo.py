"""The README's main command as a user runs it on the CPU: every check passes, one line per
check and under 40 lines in all; ``--verbose`` adds the tables; a failing check says FAIL
on its line and the demo exits non-zero."""

import pytest
import torch

from prepfuse._compat import has_triton
from prepfuse.demo import dsv4, dsv4_indexer, gqa
from prepfuse.demo.__main__ import main
from prepfuse.demo.rows import Bound, Row
from prepfuse.fx_passes import pass_manager

# on a GPU the demo runs at model sizes and times each line, minutes rather than seconds
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the demo's CPU run")

MODELS = ("DeepSeek-V4 block", "Qwen3-style", "Qwen3 HF-style", "Llama-style", "DeepSeek-V4 indexer")
OPS = ("dsv4_qnorm_rope_kv_insert", "gqa_qknorm_rope_kv_insert")


def rows_of(lines: list[str], name: str) -> list[str]:
    return [line for line in lines if line.startswith(f"  {name} ")]


def test_default_output_is_one_line_per_check(capsys, caplog, monkeypatch):
    monkeypatch.setattr(pass_manager, "_warned_returned", False)  # said once per process: let it be said here
    assert main(["--layers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 40, "\n".join(lines)
    for model in MODELS:
        (line,) = rows_of(lines, model)
        assert "fused 2/2" in line and line.endswith("  ok"), line
    impls = {"dispatcher", "triton"} if has_triton() else {"dispatcher"}
    for op in OPS:
        rows = rows_of(lines, op)
        assert {row.split()[1] for row in rows} == impls and all(row.endswith("  ok") for row in rows), rows
    assert lines[1].startswith("timings: skipped, no GPU"), lines[1]
    assert not [line for line in lines if "prepfuse graph" in line]  # the passes' reports: --verbose only
    assert not [r.getMessage() for r in caplog.records if "scratch arena" in r.getMessage()]
    assert lines[-1] == "demo: all checks ok"


def test_verbose_adds_the_tables(capsys, monkeypatch):
    # one compiled model is enough to see the report
    monkeypatch.setattr(gqa, "run_gqa_models", lambda *args, **kwargs: iter(()))
    monkeypatch.setattr(dsv4_indexer, "run_dsv4_indexer",
                        lambda *args, **kwargs: Row("DeepSeek-V4 indexer", fused=(1, 1)))
    assert main(["--verbose", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    for op in OPS:
        assert f"== prepfuse::{op}" in out
    assert out.count("implementation ") == len(OPS)  # each op's table of implementations
    assert "prepfuse graph" in out and "  where:" in out  # the passes' report
    assert "prep sequences fused: 1 of 1 (100%)" in out
    (line,) = rows_of(out.splitlines(), "DeepSeek-V4 block")
    assert line.endswith("  ok"), line


def test_a_failing_check_says_fail_on_its_line_and_exits_nonzero(capsys, monkeypatch):
    monkeypatch.setattr(dsv4, "run_dsv4_op", lambda *args, **kwargs: [])
    monkeypatch.setattr(gqa, "run_gqa_op", lambda *args, **kwargs: [])
    monkeypatch.setattr(dsv4, "run_dsv4_block", lambda *args, **kwargs: Row(
        "DeepSeek-V4 block", (Bound("out err", 0.2, 5e-2),), fused=(3, 3)))
    monkeypatch.setattr(gqa, "run_gqa_models", lambda *args, **kwargs: iter([Row("Qwen3-style", fused=(2, 3))]))
    monkeypatch.setattr(dsv4_indexer, "run_dsv4_indexer", lambda *args, **kwargs: Row(
        "DeepSeek-V4 indexer", (Bound("cache bytes differing", 0, 0),), fused=(3, 3)))
    assert main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    (block,) = rows_of(lines, "DeepSeek-V4 block")
    assert "out err 2.0e-01 <= 5.0e-02" in block and block.endswith("  FAIL"), block
    (qwen,) = rows_of(lines, "Qwen3-style")
    assert "fused 2/3" in qwen and qwen.endswith("  FAIL"), qwen
    (indexer,) = rows_of(lines, "DeepSeek-V4 indexer")
    assert indexer.endswith("  ok"), indexer
    assert lines[-1] == "demo: FAIL: DeepSeek-V4 block, Qwen3-style"
