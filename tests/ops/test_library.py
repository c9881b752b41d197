"""prepfuse/ops/_library.py: registration helpers shared by every op."""

import logging

import torch

from prepfuse.ops import _library


def test_cuda_fallback_to_the_reference_warns_once(caplog):
    """Where triton cannot be imported, the CUDA impl is the reference, and says so once."""
    calls = []
    fallback = _library._reference_with_warning("some_op", lambda *args: calls.append(args))
    with caplog.at_level(logging.WARNING, logger="prepfuse.ops"):
        fallback(torch.zeros(1), 1.0)
        fallback(torch.zeros(1), 2.0)
    assert len(calls) == 2
    warnings = [r for r in caplog.records if "falls back to the PyTorch reference" in r.getMessage()]
    assert len(warnings) == 1 and "prepfuse::some_op" in warnings[0].getMessage()
