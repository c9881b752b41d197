"""GQA attention-input preparation from separate q, k and v projections: one fused op.

Schema (the contract; ``tests/golden/schemas.txt`` holds it verbatim)::

    prepfuse::gqa_separate_qknorm_rope_kv_insert(Tensor q, Tensor k, Tensor v,
        Tensor? q_norm_weight, Tensor? k_norm_weight, Tensor(a!) q_out, Tensor(b!) k_cache,
        Tensor(c!) v_cache, Tensor slot_mapping, Tensor? positions, Tensor? cos_sin_cache,
        Tensor? kv_scale, bool is_neox, float eps, bool full_cos_sin=False, Tensor? cos=None,
        Tensor? sin=None, bool fp8_saturate=True) -> ()

The math, the caches and every other argument are ``prepfuse::gqa_qknorm_rope_kv_insert``'s
(``gqa_qknorm_rope_kv_insert.py``, whose docstring is the contract); only the source
differs. Models written the Hugging Face way (``q_proj``, ``k_proj``, ``v_proj``: three
``Linear`` layers) have three tensors, not one fused qkv, and concatenating them would
cost the copy the fusion exists to save::

    q              [T, Hq*D]     bf16   the q projection's output; any token stride, last dim dense
    k              [T, Hkv*D]    bf16   the k projection's output
    v              [T, Hkv*D]    bf16   the v projection's output

``Hq`` and ``D`` are ``q_out``'s sizes 1 and 2, ``Hkv`` is ``k_cache``'s size 2 (the op has
no head-count arguments: the outputs already say them). One kernel serves both ops: it
reads q, k and v through three base pointers, which for the fused op are qkv's column
ranges.
"""

from __future__ import annotations

import torch

from prepfuse.ops._checks import check_size, check_tensor, check_unit_last_stride, require
from prepfuse.ops._library import define_op
from prepfuse.ops.gqa_qknorm_rope_kv_insert import (
    HEAD_DIMS,
    check_index_values,
    check_k_eps,
    check_prep_args,
    launch_gqa_kernel,
    sources_reference,
)

SCHEMA = (
    "gqa_separate_qknorm_rope_kv_insert(Tensor q, Tensor k, Tensor v, Tensor? q_norm_weight, "
    "Tensor? k_norm_weight, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, "
    "Tensor? positions, Tensor? cos_sin_cache, Tensor? kv_scale, bool is_neox, float eps, bool full_cos_sin=False, "
    "Tensor? cos=None, Tensor? sin=None, bool fp8_saturate=True, bool wrap_indices=False, Tensor? v_scale=None, "
    "float? k_eps=None) -> ()"
)


def check_separate_inputs(
    q, k, v, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions,
    cos_sin_cache, kv_scale, is_neox, eps, full_cos_sin=False, cos=None, sin=None, fp8_saturate=True,
    wrap_indices=False, v_scale=None, k_eps=None,
) -> None:
    """Dtypes, shapes, devices and strides; raises ValueError naming the argument.

    Heads and head size are read off ``q_out`` and ``k_cache`` and each source's width is
    checked against them. Runs in the eager paths and in the fake impl.
    """
    device = q.device if isinstance(q, torch.Tensor) else None
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtype=torch.bfloat16, ndim=2, device=device)
    check_tensor("q_out", q_out, dtype=torch.bfloat16, ndim=3, device=device)
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        got = tuple(k_cache.shape) if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise ValueError(f"k_cache: expected a 4-d [num_blocks, block_size, Hkv, D] tensor, got {got}")
    num_tokens, num_q_heads, head_dim = q_out.shape
    num_kv_heads = k_cache.shape[2]
    require(
        (head_dim == 64) | (head_dim == 128) | (head_dim == 256),
        f"q_out: head size {head_dim} (its last dim) is not one of {HEAD_DIMS}",
    )
    check_size("q", q, 1, num_q_heads * head_dim, "Hq * D, from q_out's heads and head size")
    for name, t in (("k", k), ("v", v)):
        check_size(name, t, 0, q.shape[0], "T, q's token count")
        check_size(name, t, 1, num_kv_heads * head_dim, "Hkv * D, from k_cache's heads and q_out's head size")
        check_unit_last_stride(name, t)
    check_unit_last_stride("q", q)
    check_k_eps(k_eps)
    check_prep_args(q_norm_weight, k_norm_weight, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin_cache,
                    kv_scale, is_neox, eps, full_cos_sin, cos, sin, fp8_saturate, wrap_indices, v_scale,
                    num_tokens=q.shape[0],
                    num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, device=device, source="q")


# one kernel launch and one reference serve both GQA ops: these are the three-source forms
gqa_separate_qknorm_rope_kv_insert_triton = launch_gqa_kernel

_OP = define_op(
    SCHEMA, check=check_separate_inputs, index_check=check_index_values, reference=sources_reference,
    triton=gqa_separate_qknorm_rope_kv_insert_triton,
)
gqa_separate_qknorm_rope_kv_insert = _OP.packet
# the plain-PyTorch path as a function, checks included (tests and benchmarks call it)
gqa_separate_qknorm_rope_kv_insert_reference = _OP.reference
GQA_SEPARATE_QKNORM_ROPE_KV_INSERT = gqa_separate_qknorm_rope_kv_insert.default
