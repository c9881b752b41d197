"""The vLLM column without a GPU: ``bench/vllm_ops.py`` says why it is absent instead of
failing, unpacks a carried library, holds GQA writes to its bound, and the DeepSeek-V4 and GQA
pages render result files with the column and without it (committed pages unchanged), and
the full-row page names every row where vLLM's op was faster."""

from __future__ import annotations

import copy
import json
import lzma
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_dsv4_qnorm_rope_kv_full_row_insert as full_row  # noqa: E402
import bench_dsv4_qnorm_rope_kv_insert as dsv4  # noqa: E402
import bench_gqa_qknorm_rope_kv_insert as gqa  # noqa: E402
import vllm_ops  # noqa: E402

RESULTS = BENCH / "results"
DOCS = BENCH.parent / "docs"


@pytest.fixture
def fresh_state(monkeypatch):
    """vllm_ops's once-a-process answer recomputed for the test, and again after it."""
    vllm_ops._state.cache_clear()
    yield monkeypatch
    vllm_ops._state.cache_clear()


def test_absent_library_gives_none_and_the_reason(fresh_state, tmp_path):
    fresh_state.setenv(vllm_ops.LIB_ENV, str(tmp_path / "nowhere.so.xz"))
    assert vllm_ops.load() is None
    assert "absent" in vllm_ops.absent_reason() and "nowhere.so.xz" in vllm_ops.absent_reason()
    assert "absent" in vllm_ops.column_info()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_present_library_without_cuda_is_not_unpacked(fresh_state, tmp_path):
    lib = tmp_path / "lib.so.xz"
    lib.write_bytes(lzma.compress(b"not a library"))
    fresh_state.setenv(vllm_ops.LIB_ENV, str(lib))
    assert vllm_ops.load() is None
    assert vllm_ops.absent_reason() == "vLLM's op library needs a CUDA device"
    assert not (tmp_path / "lib.so").exists()


def test_unpacked_writes_the_library_beside_its_xz(tmp_path):
    lib = tmp_path / "lib.so.xz"
    lib.write_bytes(lzma.compress(b"\x7fELF library bytes"))
    so = vllm_ops.unpacked(lib)
    assert so == tmp_path / "lib.so" and so.read_bytes() == b"\x7fELF library bytes"
    assert vllm_ops.unpacked(so) == so
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_dsv4_fits_below_2_to_the_31_bytes_of_q():
    assert vllm_ops.dsv4_fits(16384, 64) and vllm_ops.dsv4_fits(8192, 128)
    assert not vllm_ops.dsv4_fits(16384, 128)


# --------------------------------------------------------------------------------------
# GQA operands and the agreement bound, on the CPU reference
# --------------------------------------------------------------------------------------
def _reference_run(inputs):
    from prepfuse.ops import gqa_qknorm_rope_kv_insert_reference

    out = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*out.args())
    return out


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gqa_call_holds_vllms_operands(cache_dtype):
    from prepfuse.testing import make_gqa_inputs

    inputs = make_gqa_inputs(5, 4, 2, 64, 16, "cpu", cache_dtype=cache_dtype)
    call = vllm_ops.gqa_call(inputs)
    assert call.qkv.is_contiguous() and torch.equal(call.qkv, inputs.qkv)
    assert call.qkv.data_ptr() != inputs.qkv.data_ptr()  # vLLM rewrites its qkv in place
    assert call.cos_sin_cache.dtype == torch.bfloat16 and call.head_dim == 64
    assert call.k_cache.data_ptr() == inputs.k_cache.data_ptr()  # the same caches
    fp8 = cache_dtype != torch.bfloat16
    assert call.kv_cache_dtype == ("fp8" if fp8 else "auto")
    assert call.k_cache.dtype == (torch.uint8 if fp8 else torch.bfloat16)
    assert float(call.k_scale) == (float(inputs.kv_scale) if fp8 else 1.0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gqa_agreement_holds_and_catches(cache_dtype):
    from prepfuse.testing import make_gqa_inputs

    inputs = vllm_ops.with_bf16_table(make_gqa_inputs(6, 4, 2, 64, 16, "cpu", cache_dtype=cache_dtype))
    ref, got = _reference_run(inputs), _reference_run(inputs)
    assert vllm_ops.gqa_agreement(ref, got) == {"q_ratio": 0.0, "k_ratio": 0.0, "v_equal": True,
                                                "others_equal": True, "within": True}
    q_missing = _reference_run(inputs)
    q_missing.q_out[2, 1, 5] = -123.0  # a value not written
    assert not vllm_ops.gqa_agreement(ref, q_missing)["within"]
    k_off = _reference_run(inputs)
    slot = int(inputs.slot_mapping[inputs.slot_mapping >= 0][0])
    row = k_off.k_cache[slot // 16, slot % 16]
    row.copy_((row.float() * 2 if cache_dtype == torch.bfloat16 else row.float() * 0 + 100).to(row.dtype))
    assert vllm_ops.gqa_agreement(ref, k_off)["k_ratio"] > 1


# --------------------------------------------------------------------------------------
# Pages with and without the column
# --------------------------------------------------------------------------------------
def with_vllm_rows(data: dict, impls: tuple, key) -> dict:
    """``data`` with a row per impl of ``impls`` beside each fused row (1.5 times as slow)."""
    data = copy.deepcopy(data)
    data["vllm"] = {"library": ".vllm/vllm_ops_sm90.so", "version": vllm_ops.VLLM_VERSION}
    extra = []
    for r in data["rows"]:
        if r["impl"] == "fused" and "us_median" in r:
            for impl in impls:
                extra.append({**r, "impl": impl, "us_median": 1.5 * r["us_median"], "correct": True})
    data["rows"] += extra
    vllm_ops.add_speedup(data["rows"], key)
    return data


def table_widths(md: str) -> set[int]:
    """How many cells the rows of the page's tables hold, per table."""
    return {line.count("|") for line in md.splitlines() if line.startswith("|")}


def test_dsv4_page_with_and_without_the_column():
    stem = "dsv4_qnorm_rope_kv_insert_nvidia-h200"
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    plain = dsv4.render_markdown(data, f"{stem}.json", f"{stem}.png")
    assert plain == (DOCS / "benchmarks.md").read_text() and "vLLM" not in plain
    timed = with_vllm_rows(data, ("vllm",), lambda r: (r["T"], r["H"], r["block_size"]))
    fused = next(r for r in timed["rows"] if r["impl"] == "fused" and "us_median" in r)
    assert fused["speedup_vs_vllm"] == pytest.approx(1.5)
    md = dsv4.render_markdown(timed, f"{stem}.json", f"{stem}.png")
    assert "| vLLM | x vLLM |" in md and "| 1.5 |" in md and dsv4.VLLM_LABEL in md
    assert "vLLM column:** vLLM 0.33.0" in md
    assert len(table_widths(md)) == len(table_widths(plain))  # every row as wide as its header
    absent = {**data, "vllm": {"absent": "vLLM's op library needs a CUDA device"}}
    assert "absent from this run: vLLM's op library needs a CUDA device" in dsv4.render_markdown(
        absent, f"{stem}.json", f"{stem}.png")


def test_gqa_page_with_and_without_the_column():
    stem = "gqa_qknorm_rope_kv_insert_nvidia-h200"
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    plain = gqa.render_markdown(data, f"{stem}.json", f"{stem}.png")
    assert plain == (DOCS / "benchmarks_gqa.md").read_text() and "vLLM us" not in plain
    md = gqa.render_markdown(with_vllm_rows(data, tuple(gqa.VLLM_IMPLS), lambda r: (r["model"], r["T"])),
                             f"{stem}.json", f"{stem}.png")
    header = next(line for line in md.splitlines() if line.startswith("| model"))
    assert "| vLLM us | vLLM default us | x vLLM | vLLM gate |" in header
    rows = [line for line in md.splitlines() if line.startswith("| qwen3-8b |")]
    assert rows and all(line.count("|") == header.count("|") for line in rows)
    assert all("| 1.5x | pass/pass |" in line for line in rows)


def test_full_row_page_is_the_committed_one_and_names_the_slower_rows():
    stem = "dsv4_qnorm_rope_kv_full_row_insert_nvidia-h100-80gb-hbm3"
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    md = full_row.render_markdown(data, f"{stem}.json")
    assert md == (DOCS / "benchmarks_full_row.md").read_text()
    assert len(table_widths(md)) == 1
    slower = full_row.slower_rows(data)
    assert slower and all(r["vllm_us_median"] < r["us_median"] for r in slower)
    assert md.count(" slower, ") == len(slower)
    absent = {**data, "vllm": {"absent": "vLLM's op library needs a CUDA device"},
              "rows": [{k: v for k, v in r.items() if not k.startswith(("vllm", "speedup"))} for r in data["rows"]]}
    plain = full_row.render_markdown(absent, f"{stem}.json")
    assert "absent (vLLM's op library needs a CUDA device)" in plain and "| - | - | - |" in plain
    assert "No row timed vLLM's op." in plain and "faster in" not in plain


def test_vllm_rows_only_where_vllm_has_the_form():
    assert gqa.vllm_applies("vllm", gqa.MODELS["qwen3-8b-fp8-uint8"])
    assert gqa.vllm_applies("vllm", gqa.MODELS["llama3-8b"])
    assert not gqa.vllm_applies("vllm-default", gqa.MODELS["llama3-8b"])  # no norm: the same launches
    assert not gqa.vllm_applies("vllm", gqa.MODELS["qwen3-8b-heads-first"])
