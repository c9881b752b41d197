"""What the DeepSeek-V4 indexer's pass tests share across its formats (FP8, MXFP4): the model
functions a test compiles, the compile-beside-eager run, and the byte-exact comparison.

A format's test module passes its ``model`` module (``prepfuse.models.dsv4_indexer`` or
``dsv4_indexer_mxfp4``), its pass name and its inputs; everything else is the same.
"""

from __future__ import annotations

import dataclasses

import torch

from prepfuse.testing.passes import PassReportQueries, compile_beside_eager

T, H, TK, BLOCK, SCALE = 7, 3, 5, 16, 0.01


def prep(model, spelling, block_size: int = BLOCK):
    """The q side and the k side of one layer, returning the q side's outputs."""
    def fn(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        out = model.indexer_q_prep(q, weights, positions, cos_sin_cache, SCALE, spelling)
        model.indexer_k_insert(k, k_cache, slot_mapping, k_positions, cos_sin_cache, block_size, spelling)
        return out
    return fn


def q_only(model, spelling):
    def fn(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        return model.indexer_q_prep(q, weights, positions, cos_sin_cache, SCALE, spelling)
    return fn


def k_only(model, spelling):
    def fn(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        model.indexer_k_insert(k, k_cache, slot_mapping, k_positions, cos_sin_cache, BLOCK, spelling)
    return fn


@dataclasses.dataclass
class Run(PassReportQueries):
    out: tuple | None
    cache: torch.Tensor
    ref_out: tuple | None
    ref_cache: torch.Tensor
    report: object
    pass_name: str = ""  # the format's pass (``PassReportQueries`` reads it)


def run(fn, inputs, pass_name: str, *, passes=None, v2=True) -> Run:
    """``fn`` compiled by the prepfuse backend and eagerly, each on its own copy of the cache."""
    cache, ref_cache = inputs.k_cache.clone(), inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    out, ref_out, report = compile_beside_eager(
        fn, (inputs.q, inputs.weights, inputs.k, cache, *rest), (inputs.q, inputs.weights, inputs.k, ref_cache, *rest),
        passes=(pass_name,) if passes is None else passes, v2=v2)
    return Run(out, cache, ref_out, ref_cache, report, pass_name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width: fp8 codes as bytes, fp32 as int32 (-0.0 is not 0.0)."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.uint8) if t.dtype.is_floating_point else t


def assert_same_as_eager(r: Run) -> None:
    """Every q-side output and every cache byte identical to eager (no sums in this math)."""
    for got, want in zip(r.out or (), r.ref_out or ()):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), int((_bits(got) != _bits(want)).sum())
    assert torch.equal(r.cache, r.ref_cache), int((r.cache != r.ref_cache).sum())


def assert_same_as_rounded_eager(r: Run, model, spelling, inputs, block_size: int = BLOCK) -> None:
    """``r``'s outputs and cache are, byte for byte, eager's for ``spelling`` with its bf16
    rounding of the rotation (what the op computes where the code quantised it unrounded)."""
    ref_cache = inputs.k_cache.clone()
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    rounded = prep(model, dataclasses.replace(spelling, bf16_round=True), block_size)
    ref_out = rounded(inputs.q, inputs.weights, inputs.k, ref_cache, *rest)
    assert_same_as_eager(Run(r.out, r.cache, ref_out, ref_cache, None))
