"""prepfuse/ops/_library.py: registration helpers shared by every op."""

import dataclasses
import logging

import pytest
import torch

from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT, GQA_QKNORM_ROPE_KV_INSERT, _library
from prepfuse.testing import make_dsv4_inputs, make_gqa_inputs


def test_cuda_fallback_to_the_reference_warns_once(caplog):
    """Where triton cannot be imported, the CUDA impl is the reference, and says so once."""
    calls = []
    fallback = _library._reference_with_warning("prepfuse::some_op", lambda *args: calls.append(args))
    with caplog.at_level(logging.WARNING, logger="prepfuse.ops"):
        fallback(torch.zeros(1), 1.0)
        fallback(torch.zeros(1), 2.0)
    assert len(calls) == 2
    warnings = [r for r in caplog.records if "falls back to the PyTorch reference" in r.getMessage()]
    assert len(warnings) == 1 and "prepfuse::some_op" in warnings[0].getMessage()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_call_autograd_would_record_is_refused_on_every_device(device):
    """The ops have no backward: an input that requires grad, with grad mode on, is a
    RuntimeError naming it on every device (the CPU reference used to be recorded as
    differentiable, the CUDA kernel not), nothing written; detached or under no_grad, the
    same call runs."""
    out = make_gqa_inputs(5, 4, 2, 64, 16, device).fresh_outputs()
    grad = dataclasses.replace(out, qkv=out.qkv.clone().requires_grad_())
    before = out.q_out.clone()
    with pytest.raises(RuntimeError, match=r"gqa_qknorm_rope_kv_insert: qkv requires grad; the op is not "
                                           r"differentiable .* torch.no_grad\(\)"):
        GQA_QKNORM_ROPE_KV_INSERT(*grad.args())
    assert torch.equal(out.q_out.view(torch.uint8), before.view(torch.uint8))
    with torch.no_grad():
        GQA_QKNORM_ROPE_KV_INSERT(*grad.args())
    assert not out.q_out.requires_grad
    dsv4 = make_dsv4_inputs(5, 3, 8, 16, device).fresh_outputs()
    with pytest.raises(RuntimeError, match="dsv4_qnorm_rope_kv_insert: kv requires grad"):
        DSV4_QNORM_ROPE_KV_INSERT(*dataclasses.replace(dsv4, kv=dsv4.kv.clone().requires_grad_()).args())
