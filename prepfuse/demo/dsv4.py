"""Demo sections for DeepSeek-V4: ``prepfuse::dsv4_qnorm_rope_kv_insert``'s implementations on
the same seeded inputs, compared with the plain-PyTorch reference and timed on a GPU; and an
example attention block compiled with ``backend="prepfuse"``."""

from __future__ import annotations

import torch

from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_INSERT,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
)
from prepfuse.demo.compiled import compile_with_prepfuse, show_report, time_beside_default
from prepfuse.demo.op_impls import run_beside_reference
from prepfuse.demo.rows import Bound, Row
from prepfuse.models import dsv4_prep_unfused
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.testing import CACHE_POISON, compare_dsv4, fp8_ds_mla_values, make_dsv4_inputs

OP = "dsv4_qnorm_rope_kv_insert"


def _padded_heads(num_heads: int) -> int:
    """FlashMLA's choice: 64 padded heads up to 64 real ones, else 128."""
    return 64 if num_heads <= 64 else 128


def run_dsv4_op(device: torch.device, num_tokens: int, num_heads: int, block_size: int, *, seed: int = 0,
                verbose: bool = False) -> list[Row]:
    """Each implementation of the op beside the reference on the same inputs: a row each,
    within the DeepSeek-V4 bound (``Dsv4Comparison.within_spec``) and the padded heads zero."""
    generator = torch.Generator().manual_seed(seed)
    padded = _padded_heads(num_heads)
    base = make_dsv4_inputs(num_tokens, num_heads, padded, block_size, device, generator=generator)
    reference, runs = run_beside_reference(base, dsv4_qnorm_rope_kv_insert_reference, DSV4_QNORM_ROPE_KV_INSERT,
                                           dsv4_qnorm_rope_kv_insert_triton, dsv4_prep_unfused, block_size, generator)
    if verbose:
        print(f"\n== prepfuse::{OP}  T={num_tokens} H={num_heads} HP={padded} block_size={block_size} "
              f"inserted={int((base.slot_mapping >= 0).sum())}/{num_tokens}")
        print(f"{'implementation':40s} {'q_out != ref':>14s} {'max ULP':>8s} {'cache != ref':>13s} {'max code':>9s}  ok")

    rows = []
    for name, run, timing in runs:
        cmp = compare_dsv4(reference, run)
        padded_zero = bool((run.q_out[:, num_heads:] == 0).all())
        ok = cmp.within_spec() and padded_zero
        rows.append(Row(
            OP, numerics=f"q max {cmp.q_max_ulp} ULP, cache max {cmp.cache_max_code_diff} codes, "
            f"{cmp.q_mismatches + cmp.cache_mismatches} values differing: bound 1 ULP / 1 code on a few per million",
            holds=ok, impl=name, timing=timing))
        if verbose:
            print(f"{name:40s} {cmp.q_mismatches:>7d}/{cmp.q_elements:<7d}{cmp.q_max_ulp:>7d} {cmp.cache_mismatches:>6d}/"
                  f"{cmp.cache_bytes:<7d}{cmp.cache_max_code_diff:>8d}  {'yes' if ok else 'NO'}")
    if verbose:
        untouched = int((reference.k_cache == CACHE_POISON).sum())
        print(f"reference left {untouched} of {reference.k_cache.numel()} cache bytes at the poison value "
              f"(unwritten slots)")
    return rows


def run_dsv4_block(device: torch.device, num_layers: int = 3, *, seed: int = 0, verbose: bool = False,
                   timed: bool = True, sizes: tuple[int, int, int, int, int] | None = None) -> Row:
    """A DeepSeek-V4-style attention block (``prepfuse.models.dsv4.Dsv4AttentionBlock``: q/kv
    projections, q head RMSNorm + GPT-J RoPE + head padding, kv RoPE + UE8M0 FP8 quant +
    paged insert, an attention-like consumer) compiled with ``backend="prepfuse"``: the
    layers' prep sequences fused, and the output and cache against eager. ``sizes``:
    (tokens, heads, padded heads, block size, model dim) in place of the device's; ``timed``:
    time on a GPU beside ``torch.compile``'s default."""
    generator = torch.Generator().manual_seed(seed)
    on_gpu = device.type == "cuda"
    tokens, heads, padded, block_size, dim = sizes or ((512, 64, 64, 64, 1024) if on_gpu else (7, 3, 8, 16, 64))
    block = Dsv4AttentionBlock(num_layers, dim, heads, padded, block_size=block_size, spelling=DSV4_SPELLINGS[0],
                               seed=seed).to(device)
    inputs = make_dsv4_inputs(tokens, heads, padded, block_size, device, generator=generator, skip_fraction=0.0)
    x = torch.randn(tokens, dim, generator=generator).to(torch.bfloat16).to(device)
    num_blocks = inputs.k_cache.shape[0]
    args = (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)

    compiled, backend = compile_with_prepfuse(block)
    caches = [fp8_ds_mla_cache(num_blocks, block_size, device) for _ in range(num_layers)]
    eager_caches = [c.clone() for c in caches]
    out = compiled(*args, caches)
    ref = block(*args, eager_caches)

    # whole sequences only: a q-only or kv-only match leaves the other half unfused
    matched = len(backend.reports.matches("dsv4_q+kv"))
    # Upstream of the fused op, Inductor computes the projections and the kv norm with
    # its own rounding, so outputs and cache values are compared with a tolerance.
    out_err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    slots = inputs.slot_mapping
    cache_errs, same_bytes = [], 0
    for c, r in zip(caches, eager_caches):
        got, want = fp8_ds_mla_values(c, slots, block_size), fp8_ds_mla_values(r, slots, block_size)
        cache_errs.append((got - want).abs().max().item() / want.abs().max().item())
        same_bytes += int((c == r).sum())
    if verbose:
        print(f"\n== example model: {num_layers}-layer DeepSeek-V4-style attention block, T={tokens} H={heads} "
              f"HP={padded} block_size={block_size}, compiled with backend=\"prepfuse\"")
        show_report(backend, matched, num_layers)
        print(f"output vs eager: max |diff| / max |eager| = {out_err:.2e}")
        print(f"cache vs eager: {same_bytes}/{sum(c.numel() for c in caches)} bytes identical; dequantised inserted "
              f"rows max |diff| / max |eager| = {max(cache_errs):.2e} (one e4m3 code is at most 1/7 of it)")
    # A kv value one bf16 ULP off upstream can land one e4m3 code away; if it moves its
    # block's amax across a power of two, the block's scale doubles and every value is
    # requantised. Either way the difference is at most one code of the top binade, 32,
    # relative to an amax that scales into (224, 448]: 32/224 = 1/7 of the block's amax.
    bounds = (Bound("out err", out_err, 5e-2), Bound("cache err", max(cache_errs), 1 / 7))
    timing = ""
    if on_gpu and timed:
        timing = time_beside_default(block, compiled, (*args, caches), (*args, [c.clone() for c in caches]))
    return Row("DeepSeek-V4 block", bounds, fused=(matched, num_layers), timing=timing)
