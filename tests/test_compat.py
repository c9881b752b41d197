"""``prepfuse._compat``: the version gates hold for the torch that runs them.

Each gate decided by probing torch is checked against what a real compile does, so a torch
release that changes the behaviour fails here rather than in a pattern test far away.
"""

from __future__ import annotations


import pytest
import torch

from prepfuse import _compat
from prepfuse._compat import TORCH_VERSION

# what was seen: torch 2.13's CPU cast saturates; torch 2.11's CUDA cast gives NaN (H200, 2026-12-02)
KNOWN_CPU_OVERFLOW = {(2, 13): "saturate"}


def test_e4m3_overflow_probe_agrees_with_casts_over_the_range():
    """The gate casts eight values; torch's cast of everything from 448 to fp32's largest
    value, and of -inf, must then behave the way it says: all +-448 where it says
    "saturate"; 448 up to 464 and NaN from just past 464 where it says "nan"."""
    big = torch.tensor([450.0, 464.0, 464.1, 479.9, 480.0, 481.0, 1e4, 3e38, float("inf")])
    codes = torch.cat([big, -big]).to(torch.float8_e4m3fn).view(torch.uint8).view(2, -1)
    overflow = _compat.e4m3_cast_overflow("cpu")
    assert overflow in _compat.E4M3_OVERFLOW_CODES, overflow
    if overflow == "saturate":
        assert bool(((codes & 0x7F) == 0x7E).all()), codes
    else:
        assert bool(((codes[:, :2] & 0x7F) == 0x7E).all()) and bool(((codes[:, 2:] & 0x7F) == 0x7F).all()), codes
    assert codes[0].lt(0x80).all() and codes[1].ge(0x80).all(), codes  # the sign kept


@pytest.mark.skipif(TORCH_VERSION not in KNOWN_CPU_OVERFLOW, reason="no recorded behaviour for this torch")
def test_e4m3_overflow_probe_matches_the_known_versions():
    assert _compat.e4m3_cast_overflow("cpu") == KNOWN_CPU_OVERFLOW[TORCH_VERSION]


def test_e4m3_overflow_probe_says_none_without_a_device():
    assert _compat.e4m3_cast_overflow("no_such_device") is None
