"""A pass that cannot read a step of the user's code declines there, in the user's terms.

An unexpected error while a family searches for one kind of side (``PrepfusePass.scan``) or
tries one rewrite (``PrepfusePass.attempt``) is a near miss at the node being read, naming
the model line that made it and what about its value stopped the reading; no exception's
name reaches the report, and the family's other sides are still fused."""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.base import unreadable_step
from prepfuse.fx_passes.fusion import dsv4
from prepfuse.models.dsv4 import Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.testing import make_dsv4_inputs
from prepfuse.testing.passes import internal_error_named

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

def _compile_block(tokens=7):
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu", skip_fraction=0.0)
    block = Dsv4AttentionBlock(1, 64, 3, 8, block_size=16)
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    backend = PrepfuseBackend({"inductor_config": {"fx_graph_cache": False}})
    args = (x, inputs.positions[:tokens], inputs.slot_mapping[:tokens], inputs.cos_sin_cache)
    caches, ref_caches = [fp8_ds_mla_cache(5, 16)], [fp8_ds_mla_cache(5, 16)]
    out = torch.compile(block, backend=backend, fullgraph=True)(*args, caches)
    torch.testing.assert_close(out, block(*args, ref_caches), atol=0.1, rtol=0.05)
    return backend.reports


def test_a_failing_side_search_is_a_near_miss_and_the_other_side_still_fuses(monkeypatch):
    def unreadable(self, graph, kv_starts):
        for node in graph.nodes:
            if dsv4._heads_of_512(node):
                raise IndexError("index 0 is out of bounds for dimension 0 with size 0")
        return []

    monkeypatch.setattr(dsv4.FuseDsv4PrepPass, "_q_sides", unreadable)
    reports = _compile_block()
    assert [r.pattern for r in reports.matches(dsv4.FuseDsv4PrepPass.name)] == ["dsv4_kv"]
    (miss,) = [r for r in reports.near_misses(dsv4.FuseDsv4PrepPass.name) if r.pattern == "dsv4_q"]
    assert miss.why.startswith("prepfuse could not read the step at dsv4.py:"), miss.why
    assert not internal_error_named(miss.why), miss.why


def test_a_failing_rewrite_names_the_users_step(monkeypatch):
    def fails(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for *: 'int' and 'Node'")

    monkeypatch.setattr(dsv4, "first_agreeing", fails)
    reports = _compile_block()
    misses = reports.near_misses(dsv4.FuseDsv4PrepPass.name)
    assert misses and all(m.why.startswith("prepfuse could not read the step at ") for m in misses), misses
    assert not any(internal_error_named(m.why) for m in misses)


def test_a_step_of_no_tokens_is_said_so():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = torch.empty(0, 3, 512)
    assert "holds no elements (no tokens)" in unreadable_step(node)


def test_zero_tokens_compile_as_written():
    """A batch of no tokens runs as eager does; nothing the report says is an internal error."""
    reports = _compile_block(tokens=0)
    assert not any(internal_error_named(m.why) for m in reports.near_misses())
