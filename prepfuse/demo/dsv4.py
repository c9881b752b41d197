"""Demo sections for DeepSeek-V4: ``prepfuse::dsv4_qnorm_rope_kv_insert``'s implementations on
the same seeded inputs, compared with the plain-PyTorch reference and timed on a GPU; and an
example attention block compiled with ``backend="prepfuse"``."""

from __future__ import annotations

import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_INSERT,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
)
from prepfuse.demo.compiled import compile_with_prepfuse, print_fused, time_beside_default
from prepfuse.models import dsv4_prep_unfused
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.testing import CACHE_POISON, compare_dsv4, graph_replay_us, make_dsv4_inputs


def _padded_heads(num_heads: int) -> int:
    """FlashMLA's choice: 64 padded heads up to 64 real ones, else 128."""
    return 64 if num_heads <= 64 else 128


def run_dsv4_demo(device: torch.device, num_tokens: int, num_heads: int, block_size: int, seed: int = 0) -> bool:
    generator = torch.Generator().manual_seed(seed)
    padded = _padded_heads(num_heads)
    base = make_dsv4_inputs(num_tokens, num_heads, padded, block_size, device, generator=generator)
    print(
        f"\n== prepfuse::dsv4_qnorm_rope_kv_insert  T={num_tokens} H={num_heads} HP={padded} "
        f"block_size={block_size} inserted={int((base.slot_mapping >= 0).sum())}/{num_tokens}"
    )
    reference = base.fresh_outputs()
    dsv4_qnorm_rope_kv_insert_reference(*reference.args())

    impls = {"torch.ops.prepfuse (dispatcher)": DSV4_QNORM_ROPE_KV_INSERT}
    # the kernel runs on CUDA tensors, or on CPU ones only under the interpreter
    if has_triton() and (device.type == "cuda" or triton_interpret_mode()):
        label = "triton kernel" + ("" if device.type == "cuda" else " (CPU interpreter)")
        impls[label] = dsv4_qnorm_rope_kv_insert_triton

    all_ok = True
    print(f"{'implementation':40s} {'q_out != ref':>14s} {'max ULP':>8s} {'cache != ref':>13s} {'max code':>9s}  ok")
    for name, fn in impls.items():
        run = base.fresh_outputs()
        fn(*run.args())
        cmp = compare_dsv4(reference, run)
        padded_zero = bool((run.q_out[:, num_heads:] == 0).all())
        ok = cmp.within_spec() and padded_zero
        all_ok &= ok
        print(
            f"{name:40s} {cmp.q_mismatches:>7d}/{cmp.q_elements:<7d}{cmp.q_max_ulp:>7d} "
            f"{cmp.cache_mismatches:>6d}/{cmp.cache_bytes:<7d}{cmp.cache_max_code_diff:>8d}  {'yes' if ok else 'NO'}"
        )
    untouched = int((reference.k_cache == CACHE_POISON).sum())
    print(f"reference left {untouched} of {reference.k_cache.numel()} cache bytes at the poison value (unwritten slots)")

    if device.type == "cuda":
        print("\nCUDA-graph replay, median of 100 (bench/ has the full method):")
        # the unfused sequence the op replaces, in eager PyTorch; it cannot skip
        # negative slots without a host sync, so it gets an all-valid slot mapping
        unfused = base.fresh_outputs()
        slots = torch.randperm(unfused.k_cache.shape[0] * block_size, generator=generator)[:num_tokens]
        unfused.slot_mapping = slots.to(device)
        rows = {"unfused PyTorch eager": (dsv4_prep_unfused, unfused)}
        rows.update({name: (fn, base.fresh_outputs()) for name, fn in impls.items()})
        for name, (fn, run) in rows.items():
            us = graph_replay_us(lambda fn=fn, run=run: fn(*run.args()))
            print(f"  {name:40s} {us:9.1f} us")
    return all_ok


def _dequantized_rows(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 values [T', 512] of the given slots of an fp8_ds_mla cache (all slots valid)."""
    blk, row = (slots // block_size)[:, None], (slots % block_size)[:, None]
    data = cache[blk, row * 576 + torch.arange(576, device=cache.device)]
    scales = cache[blk, block_size * 576 + row * 8 + torch.arange(7, device=cache.device)]
    nope = data[:, :448].view(torch.float8_e4m3fn).float().unflatten(-1, (7, 64))
    nope = nope * torch.exp2(scales.float() - 127)[..., None]
    rope = data[:, 448:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope.flatten(-2), rope), dim=-1)


def run_dsv4_block_demo(device: torch.device, num_layers: int = 3, seed: int = 0) -> bool:
    """A DeepSeek-V4-style attention block (``prepfuse.models.dsv4.Dsv4AttentionBlock``: q/kv
    projections, q head RMSNorm + GPT-J RoPE + head padding, kv RoPE + UE8M0 FP8 quant +
    paged insert, an attention-like consumer) compiled with ``backend="prepfuse"``: the
    report, the fraction of layers' prep sequences fused, and the comparison with eager."""
    generator = torch.Generator().manual_seed(seed)
    on_gpu = device.type == "cuda"
    tokens, heads, padded, block_size, dim = (512, 64, 64, 64, 1024) if on_gpu else (7, 3, 8, 16, 64)
    print(
        f"\n== example model: {num_layers}-layer DeepSeek-V4-style attention block, T={tokens} H={heads} "
        f"HP={padded} block_size={block_size}, compiled with backend=\"prepfuse\""
    )
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
    print_fused(backend, matched, num_layers)

    # Upstream of the fused op, Inductor computes the projections and the kv norm with
    # its own rounding, so outputs and cache values are compared with a tolerance.
    out_err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    slots = inputs.slot_mapping
    cache_errs, same_bytes = [], 0
    for c, r in zip(caches, eager_caches):
        got, want = _dequantized_rows(c, slots, block_size), _dequantized_rows(r, slots, block_size)
        cache_errs.append((got - want).abs().max().item() / want.abs().max().item())
        same_bytes += int((c == r).sum())
    total_bytes = sum(c.numel() for c in caches)
    print(f"output vs eager: max |diff| / max |eager| = {out_err:.2e}")
    print(
        f"cache vs eager: {same_bytes}/{total_bytes} bytes identical; dequantised inserted rows "
        f"max |diff| / max |eager| = {max(cache_errs):.2e} (one e4m3 code is at most 1/7 of it)"
    )
    # A kv value one bf16 ULP off upstream can land one e4m3 code away; if it moves its
    # block's amax across a power of two, the block's scale doubles and every value is
    # requantised. Either way the difference is at most one code of the top binade, 32,
    # relative to an amax that scales into (224, 448]: 32/224 = 1/7 of the block's amax.
    ok = matched == num_layers and out_err < 5e-2 and max(cache_errs) <= 1 / 7

    if on_gpu:
        time_beside_default(block, compiled, (*args, caches), (*args, [c.clone() for c in caches]), "whole block")
    return ok
