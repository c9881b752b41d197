"""Demo sections for GQA: ``prepfuse::gqa_qknorm_rope_kv_insert``'s implementations on the same
seeded inputs, compared with the plain-PyTorch reference and timed on a GPU; and each example
model (``prepfuse.models.gqa.EXAMPLE_MODELS``: Qwen3-style with a fused qkv and with separate
projections, Llama-style with an fp8 cache) compiled with ``backend="prepfuse"``."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import torch

from prepfuse.demo.compiled import compile_with_prepfuse, show_report, time_beside_default
from prepfuse.demo.op_impls import run_beside_reference
from prepfuse.demo.rows import Bound, Row
from prepfuse.models.gqa import EXAMPLE_MODELS, GqaAttentionBlock, gqa_prep_unfused, kv_cache
from prepfuse.ops import (
    GQA_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)
from prepfuse.testing import GqaInputs, compare_gqa, make_gqa_inputs, normed_pair_sum

OP = "gqa_qknorm_rope_kv_insert"


def _normed_ulp_error(reference: GqaInputs, run: GqaInputs) -> tuple[float, int]:
    """(the largest ``|run - reference|`` of a q value or an inserted k value over ``|a| + |b|``
    of its normed RoPE pair, the count of other cache elements that differ: v, and k outside
    the inserted rows). bf16 caches."""
    slots = reference.slot_mapping
    tokens = torch.nonzero(slots >= 0).flatten()
    block, row = slots[tokens] // reference.k_cache.shape[1], slots[tokens] % reference.k_cache.shape[1]
    errors = []
    for got, want, pair in ((run.q_out, reference.q_out, normed_pair_sum(reference, "q")),
                            (run.k_cache[block, row], reference.k_cache[block, row],
                             normed_pair_sum(reference, "k")[tokens])):
        diff = (got.float() - want.float()).abs()
        errors.append(float(torch.where(diff == 0, 0.0, diff / pair).max()) if diff.numel() else 0.0)
    k_elsewhere = run.k_cache.clone()
    k_elsewhere[block, row] = reference.k_cache[block, row]
    others = compare_gqa(reference, replace(run, k_cache=k_elsewhere)).cache_mismatches
    return max(errors), others


def run_gqa_op(device: torch.device, num_tokens: int, block_size: int, *, seed: int = 0,
               verbose: bool = False) -> list[Row]:
    """Each implementation of the op beside the reference on the same Qwen3-like inputs (q/k
    norm, NeoX RoPE, bf16 cache): a row each, within the op's bound (docs/ops.md): q and the
    written k within one normed bf16 ULP carried through RoPE, ``2^-6 (|a| + |b|)`` per
    value (the summation order of ``mean(x^2)``), every other byte identical."""
    generator = torch.Generator().manual_seed(seed)
    hq, hkv, head_dim = (32, 8, 128) if device.type == "cuda" else (4, 2, 128)  # Qwen3-8B's heads on a GPU
    base = make_gqa_inputs(num_tokens, hq, hkv, head_dim, block_size, device, generator=generator)
    reference, runs = run_beside_reference(base, gqa_qknorm_rope_kv_insert_reference, GQA_QKNORM_ROPE_KV_INSERT,
                                           gqa_qknorm_rope_kv_insert_triton, gqa_prep_unfused, block_size, generator)
    if verbose:
        print(f"\n== prepfuse::{OP}  T={num_tokens} Hq={hq} Hkv={hkv} D={head_dim} block_size={block_size} "
              f"inserted={int((base.slot_mapping >= 0).sum())}/{num_tokens}")
        print(f"{'implementation':40s} {'q_out != ref':>14s} {'max ULP':>8s} {'cache != ref':>13s} {'max ULP':>8s} "
              f"{'q/k err':>8s}  ok")

    rows = []
    for name, run, timing in runs:
        error, others = _normed_ulp_error(reference, run)
        bounds = (Bound("q/k |diff| / (|a|+|b|)", error, 2**-6), Bound("other cache values differing", others, 0))
        row = Row(OP, bounds, impl=name, timing=timing)
        rows.append(row)
        if verbose:
            cmp = compare_gqa(reference, run)
            print(f"{name:40s} {cmp.q_mismatches:>7d}/{cmp.q_elements:<7d}{cmp.q_max_ulp:>7d} "
                  f"{cmp.cache_mismatches:>6d}/{cmp.cache_elements:<7d}{cmp.cache_max_diff:>7d} {error:>8.1e}  "
                  f"{'yes' if row.ok else 'NO'}")
    return rows


def _written_rows(cache: torch.Tensor, slots: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values [T', Hkv, D] of the given slots of a paged GQA cache (dequantised if fp8)."""
    block_size = cache.shape[1]
    # gathered as bytes: not every torch indexes float8 tensors on every device
    rows = cache.view(torch.uint8)[slots // block_size, slots % block_size].view(cache.dtype).float()
    return rows * kv_scale if kv_scale is not None else rows


def run_gqa_models(device: torch.device, num_layers: int = 3, *, seed: int = 0,
                   verbose: bool = False, timed: bool = True) -> Iterator[Row]:
    """Each GQA example model compiled with ``backend="prepfuse"``: a row each, as it is made,
    with the layers' prep sequences fused and the output and written cache rows against eager."""
    on_gpu = device.type == "cuda"
    # (tokens, q heads, kv heads, head size, block size, model dim)
    tokens, hq, hkv, head_dim, block_size, dim = (512, 32, 8, 128, 16, 4096) if on_gpu else (7, 4, 2, 64, 16, 64)
    for title, spelling in EXAMPLE_MODELS.items():
        generator = torch.Generator().manual_seed(seed)
        block = GqaAttentionBlock(num_layers, dim, hq, hkv, head_dim, spelling=spelling, seed=seed).to(device)
        inputs = make_gqa_inputs(tokens, hq, hkv, head_dim, block_size, device, cache_dtype=spelling.cache_dtype,
                                 generator=generator, skip_fraction=0.0)
        x = (torch.randn(tokens, dim, generator=generator) * 0.5).to(torch.bfloat16).to(device)
        args = (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
        num_blocks = inputs.k_cache.shape[0]
        caches = [tuple(kv_cache(num_blocks, block_size, hkv, head_dim, spelling, device) for _ in range(2))
                  for _ in range(num_layers)]
        eager_caches = [tuple(c.clone() for c in pair) for pair in caches]
        compiled, backend = compile_with_prepfuse(block)
        out = compiled(*args, caches, inputs.kv_scale)
        ref = block(*args, eager_caches, inputs.kv_scale)

        matched = sum(r.matched_counts.get("fuse_gqa_prep", 0) for r in backend.reports)
        out_err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        cache_err = max(
            ((_written_rows(c, inputs.slot_mapping, inputs.kv_scale) - _written_rows(r, inputs.slot_mapping, inputs.kv_scale))
             .abs().max() / _written_rows(r, inputs.slot_mapping, inputs.kv_scale).abs().max()).item()
            for pair, ref_pair in zip(caches, eager_caches) for c, r in zip(pair, ref_pair))
        if verbose:
            print(f"\n== example model: {num_layers}-layer {title}, T={tokens} Hq={hq} Hkv={hkv} D={head_dim} "
                  f"block_size={block_size}, compiled with backend=\"prepfuse\"")
            show_report(backend, matched, num_layers)
            print(f"output vs eager: max |diff| / max |eager| = {out_err:.2e}")
            print(f"cache vs eager: inserted rows max |diff| / max |eager| = {cache_err:.2e}")
        # The fused op rotates in fp32 where HF rounds cos/sin and each step to bf16
        # (<= 2^-7 * (|a| + |b|) per value, docs/ops.md), and Inductor computes the
        # projections and attention upstream of later layers in its own order: a few
        # bf16 ULPs of the largest value; an fp8 cache adds one e4m3 step (1/8 of a value).
        cache_tol = 1 / 7 if spelling.cache_dtype == torch.float8_e4m3fn else 5e-2
        bounds = (Bound("out err", out_err, 5e-2), Bound("cache err", cache_err, cache_tol))
        timing = ""
        if on_gpu and timed:
            default_caches = [tuple(c.clone() for c in pair) for pair in caches]
            timing = time_beside_default(block, compiled, (*args, caches, inputs.kv_scale),
                                         (*args, default_caches, inputs.kv_scale))
        name = title.split(" (")[0]  # "Qwen3-style (q/k RMSNorm, ...)": the part before the details
        yield Row(name, bounds, fused=(matched, num_layers), timing=timing)
