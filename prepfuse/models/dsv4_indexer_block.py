"""DeepSeek-V4 lightning-indexer preparation inside a model: q, k and the head weights projected
from the hidden state, then the unfused preparation of ``models.dsv4_indexer`` (fp8 cache) or
``models.dsv4_indexer_mxfp4`` (MXFP4 cache), one cache per layer.

As a model holds it, the projections' widths come from its weights, so under
``torch.compile(dynamic=True)`` only the token counts and the caches' sizes are symbolic and
the head dims stay constants the op can take (where q and k are graph inputs, Dynamo makes
their widths symbolic too, and the rewrite declines: docs/decisions.md, dynamic=True).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from prepfuse.models import dsv4_indexer, dsv4_indexer_mxfp4
from prepfuse.ops.dsv4_indexer_common import HEAD_DIM

__all__ = ["Dsv4IndexerBlock", "indexer_cache"]

_FORMATS = {
    "fp8": (dsv4_indexer, next(s for s in dsv4_indexer.INDEXER_SPELLINGS if s.name == "slice-strided-view-bytes"),
            dsv4_indexer.indexer_fp8_cache),
    "mxfp4": (dsv4_indexer_mxfp4, dsv4_indexer_mxfp4.MXFP4_SPELLINGS[0], dsv4_indexer_mxfp4.indexer_mxfp4_cache),
}


def indexer_cache(fmt: str, num_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """An empty indexer cache of ``fmt`` ("fp8" or "mxfp4") as the block's layers write it."""
    return _FORMATS[fmt][2](num_blocks, block_size, device)


class _IndexerLayer(nn.Module):
    def __init__(self, fmt: str, dim: int, num_heads: int, block_size: int, weights_scale: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.module, self.spelling, _ = _FORMATS[fmt]
        self.num_heads, self.block_size, self.weights_scale = num_heads, block_size, weights_scale

        def weight(*shape):
            return nn.Parameter((torch.randn(*shape, generator=generator) * shape[-1] ** -0.5).to(torch.bfloat16),
                                requires_grad=False)

        self.wq = weight(num_heads * HEAD_DIM, dim)
        self.wk = weight(HEAD_DIM, dim)
        self.weights_proj = weight(num_heads, dim)

    def forward(self, x, k_cache, slot_mapping, positions, cos_sin_cache):
        num_tokens = x.shape[0]
        q = F.linear(x, self.wq).view(num_tokens, self.num_heads, HEAD_DIM)
        weights = F.linear(x, self.weights_proj)
        prepared = self.module.indexer_q_prep(q, weights, positions, cos_sin_cache, self.weights_scale, self.spelling)
        self.module.indexer_k_insert(F.linear(x, self.wk), k_cache, slot_mapping, positions, cos_sin_cache,
                                     self.block_size, self.spelling)
        return prepared


class Dsv4IndexerBlock(nn.Module):
    """A few indexer layers with random weights: each returns its prepared q (codes, with the
    block scales for MXFP4) and head weights, and writes its tokens' k into its own cache."""

    def __init__(self, fmt: str = "fp8", num_layers: int = 2, dim: int = 64, num_heads: int = 4,
                 block_size: int = 16, weights_scale: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        if fmt not in _FORMATS:
            raise ValueError(f"fmt: must be one of {tuple(_FORMATS)}, got {fmt!r}")
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(_IndexerLayer(fmt, dim, num_heads, block_size, weights_scale, generator)
                                    for _ in range(num_layers))

    def forward(self, x, k_caches: list[torch.Tensor], slot_mapping, positions, cos_sin_cache) -> list[tuple]:
        return [layer(x, k_cache, slot_mapping, positions, cos_sin_cache)
                for layer, k_cache in zip(self.layers, k_caches)]
