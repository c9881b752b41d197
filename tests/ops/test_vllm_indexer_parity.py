"""prepfuse's DeepSeek-V4 indexer ops against vLLM 0.33's own indexer q kernels on the same inputs
(``bench/vllm_indexer.py``: the CuTe DSL kernels vLLM's ``fused_indexer_q_rope_quant`` runs on
CUDA), T = 1 to 16384, in both formats where vLLM serves both (MXFP4: sm_10x only). vLLM's kernels write q and the scaled weights only (its
key rows go through the compressor), so the calls here have no key rows. ``gpu`` tests, skipped
with the reason where the kernels are absent or do not load (bench/README.md says how to make
and carry them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from prepfuse.ops import DSV4_INDEXER_ROPE_FP8_INSERT, DSV4_INDEXER_ROPE_MXFP4_INSERT
from prepfuse.testing import make_dsv4_indexer_inputs, seeded_generator
from tests.ops.test_vllm_parity import BETWEEN_TWO  # the spec's rate between two implementations

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import vllm_indexer  # noqa: E402

pytestmark = pytest.mark.gpu
HEADS = 64  # DeepSeek-V4's indexer heads (vLLM's kernels tile 4 heads; any multiple of 4 runs)


@pytest.fixture(scope="module")
def kernels():
    loaded = vllm_indexer.load()
    if loaded is None:
        pytest.skip(vllm_indexer.absent_reason())
    return loaded


def run_both(kernels, fmt: str, num_tokens: int):
    """(prepfuse's outputs, vLLM's outputs, the seed) of one call with no key rows and bf16
    weights (vLLM's kernels are compiled for bf16 weights only)."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_indexer_inputs(fmt, num_tokens, HEADS, 64, "cuda", num_k=0, generator=generator)
    ours, theirs = inputs.fresh_outputs(), inputs.fresh_outputs()
    if fmt == "fp8":
        DSV4_INDEXER_ROPE_FP8_INSERT(*ours.args())
        kernels.fp8(inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache, inputs.weights_scale,
                    theirs.q_out, theirs.weights_out)
    else:
        DSV4_INDEXER_ROPE_MXFP4_INSERT(*ours.args())
        kernels.mxfp4(inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache, inputs.weights_scale,
                      theirs.q_out, theirs.q_scale, theirs.weights_out)
    torch.cuda.synchronize()
    return ours, theirs, seed


def code_steps(a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
    """How many codes apart two tensors of sign-magnitude codes of ``bits`` bits are, per code
    (codes of opposite signs count their magnitudes' sum: -0 and +0 are 0 apart)."""
    sign, mag = 1 << (bits - 1), (1 << (bits - 1)) - 1
    a, b = a.to(torch.int32), b.to(torch.int32)
    sa = torch.where(a & sign != 0, -(a & mag), a & mag)
    sb = torch.where(b & sign != 0, -(b & mag), b & mag)
    return (sa - sb).abs()


def agreement(fmt: str, ours, theirs) -> dict:
    """Per output: values that differ and the largest difference in codes (q, scale bytes) or
    relative (weights)."""
    if fmt == "fp8":
        steps = {"q": code_steps(ours.q_out.view(torch.uint8), theirs.q_out.view(torch.uint8), 8)}
    else:
        def nibbles(x):
            return torch.stack((x & 0xF, x >> 4), dim=-1)

        steps = {"q": code_steps(nibbles(ours.q_out), nibbles(theirs.q_out), 4),
                 "scale": (ours.q_scale.int() - theirs.q_scale.int()).abs()}
    out = {name: {"differing": int((s != 0).sum()), "of": s.numel(), "max_steps": int(s.max())}
           for name, s in steps.items()}
    rel = ((ours.weights_out - theirs.weights_out).abs() / theirs.weights_out.abs().clamp_min(1e-30))
    out["weights"] = {"differing": int((ours.weights_out.view(torch.int32) != theirs.weights_out.view(torch.int32)).sum()),
                      "of": rel.numel(), "max_rel": float(rel.max())}
    return out


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 4096, 16384])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_indexer_matches_vllm(kernels, fmt, num_tokens):
    if fmt not in kernels.formats():
        pytest.skip(kernels.missing_reason(fmt))
    ours, theirs, seed = run_both(kernels, fmt, num_tokens)
    result = agreement(fmt, ours, theirs)
    report = f"seed={seed}: {result}"
    print(f"{fmt} T={num_tokens}: {result}")
    # the spec's parity bound between two implementations: codes at most one apart, in at
    # most BETWEEN_TWO per million values; the scaled weights one fp32 rounding apart at most
    for name in ("q", "scale"):
        if name in result:
            assert result[name]["max_steps"] <= 1, report
            assert result[name]["differing"] <= BETWEEN_TWO * 1e-6 * result[name]["of"] + 1, report
    assert result["weights"]["max_rel"] <= 2**-23, report
