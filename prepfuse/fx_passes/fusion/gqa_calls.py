"""The GQA op's calls: the math of a matched region as the op's arguments.

``gqa.py`` finds a layer's q, k write and v write and their sources; ``rewrite/cache_views.py``
gives the caches' views and slots. This module holds the hypotheses about the math
(``Math``): RoPE style and operand form, norm form, eps, kv scale semantics, fp8 overflow,
a factor on q. The search (``rewrite/search.py``) keeps the first call that computes the
region on probes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import where
from prepfuse.fx_passes.matching.rope_operands import RopeOperand

__all__ = ["Math", "math_candidates"]

# --------------------------------------------------------------------------------------
# The math: one hypothesis per candidate call
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Math:
    rope: RopeOperand
    is_neox: bool
    norm: str  # "none" | "bf16" (weight after the rounding) | "fp32" (weight before it) | "unweighted"
    eps: float | torch.fx.Node  # k's, and q's unless its norm reads its own; a node: read when the graph runs
    scale: str  # "none" | "divide" (rows / kv_scale) | "multiply" (rows * s: kv_scale = 1 / s)
    saturate: bool
    q_factor: float = 1.0  # q's normed values times a number before the rotation (q's weight carries it)

    def rounding_of(self) -> Math:
        """This math but for where it rounds, the norm weight applied after the bf16 rounding
        or in fp32 (``search.Candidate.rounding_of``: of two that agree, the closer is kept).
        The eps and the scale's use are other math, which the edge probe tells apart."""
        return replace(self, norm="weighted") if self.norm in ("bf16", "fp32") else self

    def describe(self) -> str:
        norm = {"none": "no q/k norm", "bf16": "q/k RMSNorm (bf16 weight after the rounding)",
                "fp32": "q/k RMSNorm (weight applied in fp32)", "unweighted": "q/k RMSNorm without a weight"}[self.norm]
        text = f"{'NeoX' if self.is_neox else 'GPT-J'} RoPE on {self.rope.describe()}, {norm}"
        if self.norm != "none":
            text += f", eps read when the graph runs ({where(self.eps)})" if isinstance(self.eps, torch.fx.Node) \
                else f", eps {self.eps:g}"
        if self.scale != "none":
            text += f", fp8 rows {'/ kv_scale' if self.scale == 'divide' else '* a scale'}" + \
                ("" if self.saturate else ", NaN past 464")
        if self.q_factor != 1.0:
            text += f", q's normed values times {self.q_factor:g}"
        return text


def math_candidates(ropes: list[RopeOperand], weight_dtype, has_reduction: bool, eps_values: list,
                    fp8: bool, gptj_first: bool, q_factors: tuple = (), limit: int = 64) -> list[Math]:
    """Every ``Math`` the region's operands allow, likeliest first. ``eps_values``: k's eps
    constants, or the run-time floats it reads as its eps (``regions.eps_inputs``). ``q_factors``: numbers
    only q's steps use (Muse's ``q_norm(q) * qk_scale_factor``), each offered as a factor of
    q's norm weight after every candidate without one."""
    styles = (False, True) if gptj_first else (True, False)
    if weight_dtype == torch.bfloat16:
        norms = ("bf16", "fp32")
    elif weight_dtype == torch.float32:
        norms = ("fp32",)
    else:
        norms = ("unweighted", "none") if has_reduction else ("none",)
    eps = [e for e in eps_values if isinstance(e, torch.fx.Node) or 0 < e < 0.1] or [1e-6]
    scales = ("divide", "multiply") if fp8 else ("none",)
    saturates = (True, False) if fp8 else (True,)
    found = []
    for rope, neox, norm in itertools.product(ropes, styles, norms):
        for e, scale, sat in itertools.product(eps if norm != "none" else [0.0], scales, saturates):
            found.append(Math(rope, neox, norm, e, scale, sat))
    found = found[:limit]
    scaled = [replace(m, q_factor=f) for f in q_factors for m in found if m.norm != "none"]
    return found + scaled[:limit]
