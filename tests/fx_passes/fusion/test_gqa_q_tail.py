"""A q the model keeps changing after its RoPE: the op's q is the rotated one, and the
model's later steps (a transpose, a scaling by a number, in place or not) stay the model's,
reading the op's q. Code written for eager attention scales q by ``head_dim ** -0.5`` right
before the scores (gemma_pytorch: ``q.mul_(self.scaling)``); the scaled q is what attention
reads, and no RoPE candidate computes it, while the rotated q before it is the op's.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from tests.fx_passes.fusion.test_gqa_shared_buffers import BLOCK, D, HQ, T, prepared, split_qkv
from tests.fx_passes.fusion.test_gqa_strided_heads import inputs as head_layout_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

SCALING = D**-0.5


def scaled_in_place(qkv, w, table, positions, slots, k_cache, v_cache):
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v
    q = q.transpose(0, 1)
    q.mul_(SCALING)
    return q


def divided_after_a_view(qkv, w, table, positions, slots, k_cache, v_cache):
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v
    return q.reshape(T, HQ * D) / 8.0


def scaled_by_a_tensor(qkv, w, table, positions, slots, k_cache, v_cache, scale):
    """A scale the graph reads as a tensor is no number: the scaled q is not the op's."""
    q, k, v = prepared(*split_qkv(qkv), *w, table, positions)
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v
    return q * scale


def inputs():
    return head_layout_inputs(HQ)


@pytest.mark.parametrize("fn", [scaled_in_place, divided_after_a_view])
def test_rotated_q_is_the_ops_and_the_scaling_stays_the_models(fn):
    qkv, weights, table, positions, slots, caches = inputs()
    eager, compiled = [c.clone() for c in caches], [c.clone() for c in caches]
    want = fn(qkv, weights, table, positions, slots, *eager)
    backend = PrepfuseBackend({})
    got = torch.compile(fn, backend=backend, fullgraph=True)(qkv, weights, table, positions, slots, *compiled)
    assert backend.reports.pattern_counts().get("gqa_qknorm_rope_kv") == 1, backend.reports.format(verbose=True)
    assert torch.equal(got, want)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))


def test_a_tensor_scale_is_left_to_the_model():
    """Declined, naming the tensor scale q is multiplied by (the op holds a q factor as a
    number); the code is then Inductor's, value for value."""
    qkv, weights, table, positions, slots, caches = inputs()
    scale = torch.tensor(SCALING, dtype=torch.bfloat16)
    prepfuse = PrepfuseBackend({})
    outs = []
    for backend in (prepfuse, "inductor"):
        torch._dynamo.reset()
        written = [c.clone() for c in caches]
        got = torch.compile(scaled_by_a_tensor, backend=backend, fullgraph=True)(
            qkv, weights, table, positions, slots, *written, scale)
        outs.append((got, written))
    assert not prepfuse.reports.pattern_counts(), prepfuse.reports.format(verbose=True)
    why = prepfuse.reports.near_misses()[0].why
    assert "one-value torch.bfloat16 tensor the code passes" in why and "holds that number fixed" in why, why
    (got, written), (want, inductor_written) = outs
    assert torch.equal(got, want)
    assert all(torch.equal(c, e) for c, e in zip(written, inductor_written))
