"""Projections whose rows Inductor padded for alignment: on CUDA its ``pad_mm`` pass may
write ``mm(x, w)`` as ``slice(mm(constant_pad_nd(x, [0, 0, 0, p]), w), 0, 0, T)`` (whether it
does depends on a timing it takes, so a layer may be padded in one compile and not in the
next). The padded product holds T + p tokens; the matcher must read its first T rows as the
projection. On the CPU a pre-pass pads every projection's rows the same way, so the CI
machine sees the graphs the GPU sees.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from prepfuse.backend import PrepfuseBackend  # noqa: E402
from prepfuse.models.clients import CLIENT_CASES, build_client  # noqa: E402
from prepfuse.testing import max_row_rel_diff  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

aten = torch.ops.aten
CASES = {c.name: c for c in CLIENT_CASES}


def pad_projection_rows(graph: torch.fx.Graph) -> None:
    """Every 2-d ``mm`` becomes Inductor's padded form: one zero row more, sliced off."""
    for node in list(graph.nodes):
        if node.target is not aten.mm.default:
            continue
        rows = node.args[0].meta["val"].shape[0]
        with graph.inserting_before(node):
            padded = graph.call_function(aten.constant_pad_nd.default, (node.args[0], [0, 0, 0, 1]))
            product = graph.call_function(aten.mm.default, (padded, node.args[1]))
            first = graph.call_function(aten.slice.Tensor, (product, 0, 0, rows))
        for new in (padded, product, first):
            new.meta.update(node.meta)
        padded.meta["val"] = torch.ops.aten.constant_pad_nd(node.args[0].meta["val"], [0, 0, 0, 1])
        product.meta["val"] = padded.meta["val"] @ node.args[1].meta["val"]
        first.meta["val"] = product.meta["val"][:rows]
        node.replace_all_uses_with(first)
        graph.erase_node(node)


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen3"])
def test_padded_projections_fuse_every_layer(name):
    case = CASES[name]
    backend = PrepfuseBackend({"inductor_config": {"post_grad_custom_pre_pass": pad_projection_rows}})
    model, args = build_client(case, seed=1234)
    caches = [tuple(c.clone() for c in pair) for pair in args[3]]
    want = [tuple(c.clone() for c in pair) for pair in args[3]]
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(*args[:3], caches, *args[4:])
        ref = model(*args[:3], want, *args[4:])
    report = backend.reports[0]
    assert report.matched_counts.get("fuse_gqa_prep", 0) == 2, report.format(verbose=True)
    for got, expected in zip(caches, want):  # each written row within 2^-6 of its largest value (two layers)
        assert max_row_rel_diff(list(got), list(expected)) <= 2**-6
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05)
