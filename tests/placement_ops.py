"""A stand-in attention op to split graphs at, for the placement tests and GPU scripts.

Engines run their attention op eagerly between CUDA graphs (``splitting_ops``). Tests
need such an op without an engine: ``prepfuse_test::attention`` is an opaque custom op
(Inductor cannot fuse into or see through it) that reads a query and a second tensor
(keys, a KV cache) and returns a tensor like the query. Its math is deliberately small
and deterministic: what the tests check is where it runs and what it reads, e.g. that a
cache insert moved ahead of it would change its output.

It lives in its own namespace, outside ``prepfuse``: the placement pass treats every
``prepfuse`` op as preparation to move, and the schema snapshot covers prepfuse ops only.
Importing this module registers it once per process.
"""

from __future__ import annotations

import torch

__all__ = ["ATTENTION", "attention_reference"]


def attention_reference(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``q * (1 + mean(kv) / 256)`` in fp32, rounded once to q's dtype.

    The scale depends on every element of ``kv``, so an output changes whenever any byte
    of a cache it reads changed, which is what the ordering tests look for.
    """
    scale = 1.0 + kv.float().mean() / 256.0
    return (q.float() * scale).to(q.dtype)


@torch.library.custom_op("prepfuse_test::attention", mutates_args=())
def _attention(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    if q.device != kv.device:
        raise ValueError(f"kv: expected a tensor on {q.device} like q, got {kv.device}")
    return attention_reference(q, kv)


@_attention.register_fake
def _attention_fake(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    if q.device != kv.device:
        raise ValueError(f"kv: expected a tensor on {q.device} like q, got {kv.device}")
    return torch.empty_like(q)


ATTENTION = torch.ops.prepfuse_test.attention.default
