"""``prepfuse._compat``: the version gates hold for the torch that runs them.

Each gate decided by probing torch is checked against what a real compile does, so a torch
release that changes the behaviour fails here rather than in a pattern test far away.
"""

from __future__ import annotations

import logging

import pytest
import torch

from prepfuse import _compat
from prepfuse._compat import TORCH_VERSION, inductor_drops_narrowing_round_trips
from prepfuse.backend import PrepfuseBackend

# what was seen in each torch's joint_graph.py (pointless_convert), for the versions at hand
KNOWN_LOSSY = {(2, 11): True, (2, 13): False, (2, 14): False}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def quantise_rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp8 cache write's rounding: bf16 first, then e4m3 of x / scale."""
    y = x * 2  # an intermediate, as a RoPE result is
    return (y.to(torch.bfloat16).float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def test_round_trip_probe_agrees_with_a_compile():
    """The post-grad graph keeps ``.to(bf16).float()`` exactly where the probe says Inductor
    keeps narrowing round trips. (Kept in the graph, the rounding may still be skipped by
    Inductor's code generation with ``emulate_precision_casts`` off; the passes read graphs.)"""
    backend = PrepfuseBackend({"passes": (), "record_graphs": True})
    torch.compile(quantise_rounded, backend=backend, fullgraph=True)(torch.randn(8, 64), torch.tensor([0.5]))
    (report,) = backend.reports
    kept = "bfloat16" in report.graph
    assert kept != inductor_drops_narrowing_round_trips(), report.graph


@pytest.mark.skipif(TORCH_VERSION not in KNOWN_LOSSY, reason="no recorded behaviour for this torch")
def test_round_trip_probe_matches_the_known_versions():
    assert inductor_drops_narrowing_round_trips() == KNOWN_LOSSY[TORCH_VERSION]


def test_round_trip_probe_falls_back_to_the_version_with_a_warning(monkeypatch, caplog):
    """Should torch's joint-graph internals move, the gate answers by version and says so once."""
    from torch._inductor.fx_passes import joint_graph

    monkeypatch.delattr(joint_graph, "patterns")
    inductor_drops_narrowing_round_trips.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="prepfuse"):
            first, second = inductor_drops_narrowing_round_trips(), inductor_drops_narrowing_round_trips()
    finally:
        inductor_drops_narrowing_round_trips.cache_clear()
    assert first == second == (TORCH_VERSION < (2, 13))
    warnings = [r for r in caplog.records if "pointless_convert" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_round_trip_probe_leaves_inductor_counters_alone():
    from torch._dynamo.utils import counters

    counters.clear()
    _compat.inductor_drops_narrowing_round_trips.cache_clear()
    inductor_drops_narrowing_round_trips()
    assert not counters["inductor"]


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
