"""Demo section: compile an example DeepSeek-V4-style attention block with
``backend="prepfuse"``, show what was fused and where, check it against eager, and on a
GPU time it beside ``torch.compile``'s default backend.

The block (``prepfuse.models.dsv4.Dsv4AttentionBlock``) is plain PyTorch: q/kv
projections, q head RMSNorm + GPT-J RoPE + head padding, kv RoPE + UE8M0 FP8 quant +
paged insert, and an attention-like consumer. Each layer's preparation is one fusable
sequence, so "fused" below is matched sequences over layers.
"""

from __future__ import annotations

import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.dsv4 import DSV4_SPELLINGS, Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.testing import graph_replay_us, make_dsv4_inputs


def _dequantized_rows(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 values [T', 512] of the given slots of an fp8_ds_mla cache (all slots valid)."""
    blk, row = (slots // block_size)[:, None], (slots % block_size)[:, None]
    data = cache[blk, row * 576 + torch.arange(576, device=cache.device)]
    scales = cache[blk, block_size * 576 + row * 8 + torch.arange(7, device=cache.device)]
    nope = data[:, :448].view(torch.float8_e4m3fn).float().unflatten(-1, (7, 64))
    nope = nope * torch.exp2(scales.float() - 127)[..., None]
    rope = data[:, 448:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope.flatten(-2), rope), dim=-1)


def run_model_demo(device: torch.device, num_layers: int = 3) -> bool:
    on_gpu = device.type == "cuda"
    tokens, heads, padded, block_size, dim = (512, 64, 64, 64, 1024) if on_gpu else (7, 3, 8, 16, 64)
    print(
        f"\n== example model: {num_layers}-layer DeepSeek-V4-style attention block, T={tokens} H={heads} "
        f"HP={padded} block_size={block_size}, compiled with backend=\"prepfuse\""
    )
    torch._dynamo.reset()
    block = Dsv4AttentionBlock(num_layers, dim, heads, padded, block_size=block_size, spelling=DSV4_SPELLINGS[0]).to(device)
    inputs = make_dsv4_inputs(tokens, heads, padded, block_size, device, skip_fraction=0.0)
    x = torch.randn(tokens, dim, device=device).to(torch.bfloat16)
    num_blocks = inputs.k_cache.shape[0]
    args = (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)

    # Inductor's FX graph cache would serve a graph compiled by an earlier run without
    # running the passes, and so without a report: the demo asks for a fresh compile.
    backend = PrepfuseBackend({"inductor_config": {"fx_graph_cache": False}})
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    caches = [fp8_ds_mla_cache(num_blocks, block_size, device) for _ in range(num_layers)]
    eager_caches = [c.clone() for c in caches]
    out = compiled(*args, caches)
    ref = block(*args, eager_caches)

    print(backend.reports.format())
    # whole sequences only: a q-only or kv-only match leaves the other half unfused
    matched = len(backend.reports.matches("dsv4_q+kv"))
    print(f"prep sequences fused: {matched} of {num_layers} ({100 * matched / num_layers:.0f}%)")

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
        torch._dynamo.reset()
        default = torch.compile(block, fullgraph=True)
        default_caches = [c.clone() for c in caches]
        us_prepfuse = graph_replay_us(lambda: compiled(*args, caches))
        us_default = graph_replay_us(lambda: default(*args, default_caches))
        print(
            f"whole block, CUDA-graph replay median: backend=prepfuse {us_prepfuse:.1f} us, "
            f"torch.compile default {us_default:.1f} us"
        )
    return ok


def _written_rows(cache: torch.Tensor, slots: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values [T', Hkv, D] of the given slots of a paged GQA cache (dequantised if fp8)."""
    block_size = cache.shape[1]
    # gathered as bytes: not every torch indexes float8 tensors on every device
    rows = cache.view(torch.uint8)[slots // block_size, slots % block_size].view(cache.dtype).float()
    return rows * kv_scale if kv_scale is not None else rows


def run_gqa_models_demo(device: torch.device, num_layers: int = 3) -> bool:
    """Each GQA example model (``prepfuse.models.gqa.EXAMPLE_MODELS``: Qwen3-style with a
    fused qkv and with separate projections, Llama-style) compiled with ``backend="prepfuse"``: the report, the fraction of prep
    sequences fused, and the comparison with eager."""
    from prepfuse.models.gqa import EXAMPLE_MODELS, GqaAttentionBlock, kv_cache
    from prepfuse.testing import make_gqa_inputs

    on_gpu = device.type == "cuda"
    # (tokens, q heads, kv heads, head size, block size, model dim)
    tokens, hq, hkv, head_dim, block_size, dim = (512, 32, 8, 128, 16, 4096) if on_gpu else (7, 4, 2, 64, 16, 64)
    ok = True
    for title, spelling in EXAMPLE_MODELS.items():
        print(f"\n== example model: {num_layers}-layer {title}, T={tokens} Hq={hq} Hkv={hkv} D={head_dim} "
              f"block_size={block_size}, compiled with backend=\"prepfuse\"")
        torch._dynamo.reset()
        block = GqaAttentionBlock(num_layers, dim, hq, hkv, head_dim, spelling=spelling).to(device)
        inputs = make_gqa_inputs(tokens, hq, hkv, head_dim, block_size, device, cache_dtype=spelling.cache_dtype,
                                 skip_fraction=0.0)
        x = (torch.randn(tokens, dim) * 0.5).to(torch.bfloat16).to(device)
        args = (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache)
        num_blocks = inputs.k_cache.shape[0]
        caches = [tuple(kv_cache(num_blocks, block_size, hkv, head_dim, spelling, device) for _ in range(2))
                  for _ in range(num_layers)]
        eager_caches = [tuple(c.clone() for c in pair) for pair in caches]
        backend = PrepfuseBackend({"inductor_config": {"fx_graph_cache": False}})
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        out = compiled(*args, caches, inputs.kv_scale)
        ref = block(*args, eager_caches, inputs.kv_scale)

        print(backend.reports.format())
        matched = sum(r.matched_counts.get("fuse_gqa_prep", 0) for r in backend.reports)
        print(f"prep sequences fused: {matched} of {num_layers} ({100 * matched / num_layers:.0f}%)")
        out_err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        cache_err = max(
            ((_written_rows(c, inputs.slot_mapping, inputs.kv_scale) - _written_rows(r, inputs.slot_mapping, inputs.kv_scale))
             .abs().max() / _written_rows(r, inputs.slot_mapping, inputs.kv_scale).abs().max()).item()
            for pair, ref_pair in zip(caches, eager_caches) for c, r in zip(pair, ref_pair))
        print(f"output vs eager: max |diff| / max |eager| = {out_err:.2e}")
        print(f"cache vs eager: inserted rows max |diff| / max |eager| = {cache_err:.2e}")
        # The fused op rotates in fp32 where HF rounds cos/sin and each step to bf16
        # (<= 2^-7 * (|a| + |b|) per value, docs/ops.md), and Inductor computes the
        # projections and attention upstream of later layers in its own order: a few
        # bf16 ULPs of the largest value; an fp8 cache adds one e4m3 step (1/8 of a value).
        cache_tol = 1 / 7 if spelling.cache_dtype == torch.float8_e4m3fn else 5e-2
        ok &= matched == num_layers and out_err < 5e-2 and cache_err <= cache_tol

        if on_gpu:
            torch._dynamo.reset()
            default = torch.compile(block, fullgraph=True)
            default_caches = [tuple(c.clone() for c in pair) for pair in caches]
            us_prepfuse = graph_replay_us(lambda: compiled(*args, caches, inputs.kv_scale))
            us_default = graph_replay_us(lambda: default(*args, default_caches, inputs.kv_scale))
            print(f"whole block, CUDA-graph replay median: backend=prepfuse {us_prepfuse:.1f} us, "
                  f"torch.compile default {us_default:.1f} us")
    return ok
