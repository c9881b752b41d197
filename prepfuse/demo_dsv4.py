"""Demo section for ``prepfuse::dsv4_qnorm_rope_kv_insert``: every implementation on the
same fresh inputs, compared with the plain-PyTorch reference, and timed on a GPU."""

from __future__ import annotations

import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_INSERT,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
)
from prepfuse.testing import CACHE_POISON, compare_dsv4, graph_replay_us, make_dsv4_inputs
from prepfuse.unfused import dsv4_prep_unfused


def _padded_heads(num_heads: int) -> int:
    """FlashMLA's choice: 64 padded heads up to 64 real ones, else 128."""
    return 64 if num_heads <= 64 else 128


def run_dsv4_demo(device: torch.device, num_tokens: int, num_heads: int, block_size: int) -> bool:
    padded = _padded_heads(num_heads)
    base = make_dsv4_inputs(num_tokens, num_heads, padded, block_size, device)
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
        unfused.slot_mapping = torch.randperm(unfused.k_cache.shape[0] * block_size, device=device)[:num_tokens]
        rows = {"unfused PyTorch eager": (dsv4_prep_unfused, unfused)}
        rows.update({name: (fn, base.fresh_outputs()) for name, fn in impls.items()})
        for name, (fn, run) in rows.items():
            us = graph_replay_us(lambda fn=fn, run=run: fn(*run.args()))
            print(f"  {name:40s} {us:9.1f} us")
    return all_ok
