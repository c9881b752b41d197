"""What the demo's op sections share: each implementation of an op run beside its
reference on the same inputs, and on a GPU timed beside the unfused PyTorch code the op
replaces."""

from __future__ import annotations

from typing import Callable

import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.testing import graph_replay_us


def run_beside_reference(base, reference: Callable, op, triton_fn: Callable, unfused: Callable, block_size: int,
                         generator: torch.Generator) -> tuple[object, list[tuple[str, object, str]]]:
    """(the reference's outputs, ``[(implementation, its outputs, its time)]``) on ``base``'s
    inputs (``make_<family>_inputs``), each on fresh poisoned outputs. The implementations: the
    dispatcher (the op as models call it) and, where it runs, the triton kernel by itself (on
    CUDA tensors, or on CPU ones under triton's interpreter); their time only on a GPU."""
    expected = base.fresh_outputs()
    reference(*expected.args())
    device = base.slot_mapping.device
    impls = {"dispatcher": op}
    if has_triton() and (device.type == "cuda" or triton_interpret_mode()):
        impls["triton"] = triton_fn
    times = _time_beside_unfused(impls, unfused, base, block_size, generator) if device.type == "cuda" else {}
    runs = []
    for name, fn in impls.items():
        run = base.fresh_outputs()
        fn(*run.args())
        runs.append((name, run, times.get(name, "")))
    return expected, runs


def _time_beside_unfused(impls: dict[str, Callable], unfused: Callable, base, block_size: int,
                         generator: torch.Generator) -> dict[str, str]:
    """Per implementation, the CUDA-graph replay median of one call on ``base``'s inputs
    beside ``unfused`` (eager PyTorch) on the same inputs. ``unfused`` cannot skip negative
    slots without a host sync, so it gets an all-valid slot mapping."""
    run = base.fresh_outputs()
    num_slots = run.k_cache.shape[0] * block_size
    run.slot_mapping = torch.randperm(num_slots, generator=generator)[: len(base.slot_mapping)].to(run.k_cache.device)
    us_unfused = graph_replay_us(lambda: unfused(*run.args()))
    times = {}
    for name, fn in impls.items():
        out = base.fresh_outputs()
        us = graph_replay_us(lambda fn=fn, out=out: fn(*out.args()))
        times[name] = f"{us:.1f} us, unfused eager {us_unfused:.1f} us"
    return times
