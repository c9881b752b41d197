"""transformers' own ``DeepseekV4Attention`` (``prepfuse.models.hf_dsv4``), its k written into
vLLM's fp8_ds_mla cache by the engine's attention function: both sides of both layers fuse
into ``prepfuse::dsv4_qnorm_rope_kv_insert``, in one call a layer, with no near miss.

Numerics against eager (two layers, T=7, CPU). The first layer's cache, decoded: every NoPE
value within one e4m3 step of eager's (a block whose amax sits at a power of two may take the
next UE8M0 scale, its codes then halved), the RoPE values within 2^-6 of their row's largest
(the op rotates the kv_norm output Inductor computes, whose rounding may differ from eager's by
a bf16 ULP). The second layer reads the first one's output, which carries the
op's q (one fp32 rounding where HF rounds the norm factor and the product to bf16): its rows
are within one e4m3 step (2^-3) of their row's largest value. The layers' output within 0.05.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.hf_dsv4 import build_hf_dsv4_client
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import NOPE_DIM
from prepfuse.testing import fp8_ds_mla_values, max_row_rel_diff

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

PASS = "fuse_dsv4_prep"


def compiled_and_eager(seed: int, num_tokens: int = 7, dynamic: bool = False):
    module, (x, positions, slots, caches, block_size) = build_hf_dsv4_client(num_tokens=num_tokens, seed=seed)
    backend = PrepfuseBackend()
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(x, positions, slots, got,
                                                                                      block_size)
        ref = module(x, positions, slots, want, block_size)
    return backend, (out, got), (ref, want), (slots, block_size)


@pytest.mark.parametrize("seed", [0, 1])
def test_both_sides_of_every_layer_fuse(seed):
    backend, (out, got), (ref, want), (slots, block_size) = compiled_and_eager(seed)
    (report,) = backend.reports
    assert report.matched_counts.get(PASS, 0) == 2, report.format(verbose=True)
    assert [m.pattern for m in report.matches() if m.pass_name == PASS] == ["dsv4_q+kv"] * 2
    assert not report.near_misses(PASS), report.format(verbose=True)

    rows, ref_rows = (fp8_ds_mla_values(c, slots, block_size) for c in (got[0], want[0]))
    nope, ref_nope = rows[:, :NOPE_DIM], ref_rows[:, :NOPE_DIM]
    step = torch.maximum(ref_nope.abs() * 2**-3, ref_nope.abs().amax(-1, keepdim=True) * 2**-9)
    assert ((nope - ref_nope).abs() <= step).all()  # one e4m3 step of the value (of a tiny one, of its row)
    assert max_row_rel_diff([rows[:, NOPE_DIM:]], [ref_rows[:, NOPE_DIM:]]) <= 2**-6
    second = [fp8_ds_mla_values(c, slots, block_size) for c in (got[1], want[1])]
    assert max_row_rel_diff([second[0]], [second[1]]) <= 2**-3
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)
