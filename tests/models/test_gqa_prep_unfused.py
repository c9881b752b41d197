"""The GQA benchmark's unfused baseline computes exactly what the op's reference computes.

With all slots valid (the only slot mappings ``gqa_prep_unfused`` accepts), q_out and
both whole caches, untouched rows included, must be byte-identical to
``gqa_qknorm_rope_kv_insert_reference`` on the same inputs.
"""

import pytest
import torch

from prepfuse.ops import gqa_qknorm_rope_kv_insert_reference
from prepfuse.testing import make_gqa_inputs
from prepfuse.models import gqa_prep_unfused

FP8 = torch.float8_e4m3fn
CASES = [
    # (T, Hq, Hkv, D, R, block_size, T', neox, norm, cache dtype)
    pytest.param(7, 4, 2, 64, 64, 16, 7, True, True, torch.bfloat16, id="qwen3-like"),
    pytest.param(9, 4, 2, 128, 128, 16, 4, True, False, torch.bfloat16, id="llama-like-short-slots"),
    pytest.param(5, 2, 1, 256, 64, 16, 5, False, True, FP8, id="gptj-partial-fp8"),
]


def _run_both(case, fn):
    t, hq, hkv, d, r, bs, n, neox, norm, dtype = case
    base = make_gqa_inputs(t, hq, hkv, d, bs, "cpu", rotary_dim=r, is_neox=neox, norm=norm, cache_dtype=dtype,
                           num_inserted=n, skip_fraction=0.0)
    assert bool((base.slot_mapping >= 0).all())
    expected, actual = base.fresh_outputs(), base.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*expected.args())
    fn(*actual.args())
    return expected, actual


def _assert_same_bytes(expected, actual):
    assert torch.equal(actual.q_out.view(torch.int16), expected.q_out.view(torch.int16))
    for a, b in ((actual.k_cache, expected.k_cache), (actual.v_cache, expected.v_cache)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("case", [c.values for c in CASES], ids=[c.id for c in CASES])
def test_unfused_matches_reference_bytes(case):
    _assert_same_bytes(*_run_both(case, gqa_prep_unfused))


def test_unfused_traces_as_one_graph():
    """The benchmark compiles it with fullgraph=True: dynamo must see no graph break."""
    torch._dynamo.reset()
    compiled = torch.compile(gqa_prep_unfused, backend="eager", fullgraph=True, dynamic=False)
    _assert_same_bytes(*_run_both(CASES[2].values, compiled))
