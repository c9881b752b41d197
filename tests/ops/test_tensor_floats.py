"""The ops' ``tensor_floats`` overloads and the GQA ops' ``k_eps``.

``torch.compile(dynamic=True)`` under torch's defaults makes a Python float (an RMSNorm's
eps) a 0-d CPU graph input; a fused call reads it through the op's ``tensor_floats``
overload, each ``float`` a one-value CPU tensor read on the host when the op runs. Held
here: the overload writes what the default overload writes for the same values, bit for
bit; a malformed float tensor is a ValueError naming the argument with nothing written
(eager and fake impl); and ``k_eps`` norms k's rows with its own eps (Hugging Face's q_norm
and k_norm are two modules, each with an eps), on the reference and on the kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_INSERT,
    GQA_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    floats_as_tensors,
    gqa_qknorm_rope_kv_insert_triton,
    tensor_floats_overload,
)
from prepfuse.testing import call_with_fake_tensors, compare_gqa, make_dsv4_inputs, seeded_gqa_inputs
from tests.ops.gqa_parity import run
from tests.ops.test_gqa_qknorm_rope_kv_insert import needs_triton

GQA_FLOATS = tensor_floats_overload(GQA_QKNORM_ROPE_KV_INSERT)
DSV4_FLOATS = tensor_floats_overload(DSV4_QNORM_ROPE_KV_INSERT)
IMPLS = [
    pytest.param(gqa_qknorm_rope_kv_insert_reference, id="reference"),
    pytest.param(gqa_qknorm_rope_kv_insert_triton, id="triton", marks=needs_triton),
]


def test_gqa_overload_writes_what_the_default_writes():
    inputs, seed = seeded_gqa_inputs(9, 4, 2, 64, 16, "cpu", eps=1e-3)
    want = run(GQA_QKNORM_ROPE_KV_INSERT, inputs)
    got = inputs.fresh_outputs()
    GQA_FLOATS(*floats_as_tensors(GQA_QKNORM_ROPE_KV_INSERT, got.args()))
    assert compare_gqa(want, got).exact(), f"seed={seed}: {compare_gqa(want, got)}"


def test_dsv4_overload_writes_what_the_default_writes():
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu")
    want, got = inputs.fresh_outputs(), inputs.fresh_outputs()
    DSV4_QNORM_ROPE_KV_INSERT(*want.args())
    DSV4_FLOATS(*floats_as_tensors(DSV4_QNORM_ROPE_KV_INSERT, got.args()))
    assert torch.equal(want.q_out, got.q_out) and torch.equal(want.k_cache, got.k_cache)


@pytest.mark.parametrize("bad, why", [
    (torch.tensor([1e-6, 1e-6]), "one-value float tensor on the CPU, got a torch.float32 tensor of shape \\(2,\\)"),
    (torch.tensor(1, dtype=torch.int64), "torch.int64"),
    (torch.tensor(-1.0, dtype=torch.float64), "eps: must be >= 0.0"),
], ids=["two-values", "int", "negative"])
def test_a_malformed_float_tensor_is_named_and_nothing_is_written(bad, why):
    inputs, _ = seeded_gqa_inputs(5, 4, 2, 64, 16, "cpu")
    out = inputs.fresh_outputs()
    before = [t.clone() for t in (out.q_out, out.k_cache, out.v_cache)]
    args = list(floats_as_tensors(GQA_QKNORM_ROPE_KV_INSERT, out.args()))
    eps_at = [a.name for a in GQA_QKNORM_ROPE_KV_INSERT._schema.arguments].index("eps")
    args[eps_at] = bad
    with pytest.raises(ValueError, match=f"eps: .*{why}" if "must be" not in why else why):
        GQA_FLOATS(*args)
    assert all(torch.equal(b, a) for b, a in zip(before, (out.q_out, out.k_cache, out.v_cache)))
    if "must be" not in why:  # the fake impl cannot read a value: it checks the tensor's form
        with pytest.raises(ValueError, match=f"eps: .*{why}"):
            call_with_fake_tensors(GQA_FLOATS, dict(enumerate(args)))


@pytest.mark.parametrize("impl", IMPLS)
def test_k_eps_norms_k_and_eps_norms_q(impl):
    """With ``k_eps``, k's rows are those of a call whose eps is ``k_eps`` and q's those of
    one whose eps is ``eps``: on rows of magnitude 2^-10, where the two eps differ visibly."""
    inputs, seed = seeded_gqa_inputs(9, 4, 2, 64, 16, "cpu", eps=1e-6)
    inputs = dataclasses.replace(inputs, qkv=inputs.qkv * 2.0**-10)
    q_eps, k_eps = 1e-6, 4e-6
    for_q, for_k = (run(impl, dataclasses.replace(inputs, eps=e)) for e in (q_eps, k_eps))
    both = inputs.fresh_outputs()
    impl(*both.args(), k_eps)
    assert torch.equal(both.q_out, for_q.q_out), seed
    assert torch.equal(both.k_cache, for_k.k_cache) and torch.equal(both.v_cache, for_k.v_cache), seed
    assert not torch.equal(for_q.k_cache, for_k.k_cache), "the eps values must matter on these rows"
