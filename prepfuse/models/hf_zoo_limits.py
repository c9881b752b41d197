"""What of a zoo model's attention the fused ops cannot express (``hf_zoo``'s layers).

The survey counts a model against the matcher only where an op call could compute what its
layer writes. ``op_limits`` says, per layer, the first property that rules every call out,
each read off the running layer (what it writes, and whether that moves with the positions)
or off its modules (which norms it holds, in what order its forward calls them):

- k and v heads of different widths (the ops write one head dim);
- no RoPE: k does not move when every position moves (the ops rotate);
- a part of k shared by every kv head (MLA's rotated k: one rope head broadcast);
- a q or k norm over all heads at once (the ops norm each head), or a LayerNorm (they are RMS);
- a weighted norm applied after the rotation (the ops norm, then rotate; an unweighted RMS
  norm commutes with the rotation, which keeps each pair's sum of squares);
- a norm on v (the ops write v as projected);
- a q projection holding a gate beside each head (q's heads are not one projection's columns).

``None`` for a layer means none holds: a call could express it, and the matcher is expected
to find that call. Why: a fused fraction means something only against what could fuse.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

__all__ = ["op_limits", "SHIFT"]

SHIFT = 1000  # positions added for the no-RoPE test: any rotation frequency moves k by then
_MOVED = 0.05  # relative change of k that counts as moving with the positions (bf16 noise is ~1e-2)


def op_limits(module, args) -> list[str | None]:
    """Per layer of ``module`` (a ``hf_zoo.ZooLayers``) run on ``args`` (``build_zoo_model``'s),
    the first property no op call can express, or None."""
    x, positions, slots, caches = args
    seen, shifted = ([{} for _ in caches] for _ in range(2))
    with torch.no_grad():
        module(x, positions, slots, seen)
        module(x, positions + SHIFT, slots, shifted)
    return [_limit(layer, a, b) for layer, a, b in zip(module.layers, seen, shifted)]


def _limit(layer: nn.Module, seen: dict, shifted: dict) -> str | None:
    q, k, v = seen["q"], seen["k"], seen["v"]  # [B, H, S, D] as the attention function got them
    if k.shape[-1] != v.shape[-1]:
        return f"k and v heads differ in width ({k.shape[-1]} / {v.shape[-1]}): the ops write one head dim"
    moved = (k.float() - shifted["k"].float()).norm() / k.float().norm().clamp_min(1e-30)
    if moved < _MOVED:
        return f"no RoPE: k moves by {moved:.2g} when every position moves by {SHIFT} (the ops rotate)"
    shared = _shared_tail(k)
    if shared:
        return f"the last {shared} of k's {k.shape[-1]} dims are one head shared by every kv head (MLA)"
    norms = _norms(layer)
    for name, norm in norms.items():
        width = _weight_width(norm)
        if isinstance(norm, nn.LayerNorm) or "LayerNorm" in type(norm).__name__ and hasattr(norm, "bias"):
            return f"{name} is a LayerNorm (the ops' norm is RMS)"
        if width is not None and width not in (q.shape[-1], k.shape[-1]):
            return f"{name} norms {width} values at once, all heads together (the ops norm each head)"
        if re.match(r"(v|value)[_a-z]*norm", name):
            return f"{name} norms v (the ops write v as projected)"
    after = _called_after_rope(layer, norms)
    if after:
        return f"{after}, a weighted norm, is applied after the rotation (the ops norm, then rotate)"
    q_proj = getattr(layer, "q_proj", None)
    if isinstance(q_proj, nn.Linear) and q_proj.out_features == 2 * q.shape[1] * q.shape[-1]:
        return f"q_proj gives {q_proj.out_features} columns for {q.shape[1]} heads of {q.shape[-1]}: a gate beside each head"
    return None


def _shared_tail(k: torch.Tensor) -> int:
    """How many trailing dims of k are equal across its heads (0: none, or one head)."""
    if k.shape[1] < 2:
        return 0
    equal = (k == k[:, :1]).all(1).all(0).all(0)  # per dim: every head holds head 0's value
    tail = 0
    for same in reversed(equal.tolist()):
        if not same:
            break
        tail += 1
    return tail if 1 < tail < k.shape[-1] else 0


def _norms(layer: nn.Module) -> dict[str, nn.Module]:
    """The attention's own norm modules, by attribute name."""
    return {name: sub for name, sub in layer.named_children() if "norm" in type(sub).__name__.lower()}


def _weight_width(norm: nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    return weight.numel() if isinstance(weight, torch.Tensor) else None


def _called_after_rope(layer: nn.Module, norms: dict) -> str | None:
    """The first weighted norm the forward calls after its rotation, by the order of its
    source lines (an unweighted one is the same before the rotation)."""
    try:
        lines = inspect.getsource(type(layer).forward).splitlines()
    except (OSError, TypeError):
        return None
    rope = next((i for i, ln in enumerate(lines) if re.search(r"apply_\w*(rotary|rope)", ln, re.I)
                 and not ln.strip().startswith("#")), None)
    if rope is None:
        return None
    weighted = [name for name, norm in norms.items() if _weight_width(norm) is not None]
    for ln in lines[rope + 1:]:
        for name in weighted:
            if f"self.{name}(" in ln:
                return name
    return None
