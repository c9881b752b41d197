"""What several project modules share, no one project's code: sizes, the SDPA reader, bases, Meta's RoPE table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_pos: int  # rows of every position table (the sources' own lengths are larger)
    num_layers: int


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))


def _norm_weight(dim: int, low: float = 0.5, high: float = 1.5) -> nn.Parameter:
    return nn.Parameter(torch.empty(dim).uniform_(low, high))


def attend(q, k, v, scale=None):
    """SDPA of ``q [B, Hq, Sq, D]`` over ``k, v [B, Hkv, Sk, D]`` (``Sk >= Sq``, the step's tokens
    last, causal), read back in q's dtype; ``[B, Sq, Hq * D]`` out. Not a source's attention: the
    reader that makes the prepared q, k and v live."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype).repeat_interleave(groups, 1), v.to(q.dtype).repeat_interleave(groups, 1)
    sq, sk = q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], sq, -1)


class _Layer(nn.Module):
    def __init__(self, case, s: Sizes):
        super().__init__()
        self.case, self.s = case, s
        self.n_heads, self.n_kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def finish(self) -> None:
        """What stays fp32 or complex after the module's cast to bf16 (tables, fp32 weights)."""


class _Model(nn.Module):
    layer_cls: type = _Layer

    def __init__(self, case, s: Sizes):
        super().__init__()
        self.case, self.s = case, s
        self.layers = nn.ModuleList(self.layer_cls(case, s) for _ in range(s.num_layers))

    def finish(self) -> None:
        for layer in self.layers:
            layer.finish()

    def prologue(self, x, step):
        """What the source computes once per forward for every layer (a position table's rows)."""
        return None

    def forward(self, x, step, caches):
        ctx = self.prologue(x, step)
        for i, layer in enumerate(self.layers):
            x = x + layer(x, ctx, step, caches, i).view(x.shape)
        return x


# meta-llama/llama llama/model.py; its table serves mistral-inference and gemma_pytorch too
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)  # type: ignore
    freqs = torch.outer(t, freqs).float()  # type: ignore
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def _rotate_half_cat(x):  # torchtitan CosSinRoPE._rotate_half, litgpt, TensorRT-LLM
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
