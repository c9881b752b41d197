"""Demo section for ``prepfuse::dsv4_qnorm_rope_kv_insert``: every implementation on the
same fresh inputs, compared with the plain-PyTorch reference, and timed on a GPU."""

from __future__ import annotations

import torch

from prepfuse._compat import has_triton
from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_INSERT,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
)
from prepfuse.testing import CACHE_POISON, compare_dsv4, make_dsv4_inputs


def _padded_heads(num_heads: int) -> int:
    """FlashMLA's choice: 64 padded heads up to 64 real ones, else 128."""
    return 64 if num_heads <= 64 else 128


def _graph_replay_us(fn, iters: int = 200) -> float:
    """Median microseconds of one call replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture: compiles kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


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
    if has_triton():
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
        print("\nCUDA-graph replay, median of 200:")
        for name, fn in {"unfused PyTorch (reference)": dsv4_qnorm_rope_kv_insert_reference, **impls}.items():
            if name.startswith("unfused"):
                # the reference filters negative slots with a boolean mask (a host sync),
                # so time it on an all-valid slot mapping, which it can capture
                run = base.fresh_outputs()
                run.slot_mapping = run.slot_mapping.abs()
            else:
                run = base.fresh_outputs()
            try:
                us = _graph_replay_us(lambda: fn(*run.args()))
                print(f"  {name:40s} {us:9.1f} us")
            except RuntimeError as err:  # capture can fail for host-syncing code
                print(f"  {name:40s}  not capturable: {str(err).splitlines()[0]}")
    return all_ok
