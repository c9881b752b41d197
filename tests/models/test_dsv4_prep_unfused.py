"""The benchmark's unfused baseline computes exactly what the op's reference computes.

With all slots valid (the only slot mappings ``dsv4_prep_unfused`` accepts), q_out and
the whole cache, untouched bytes included, must be byte-identical to
``dsv4_qnorm_rope_kv_insert_reference`` on the same inputs.
"""

import pytest
import torch

from prepfuse.ops import dsv4_qnorm_rope_kv_insert_reference
from prepfuse.testing import make_dsv4_inputs
from prepfuse.models import dsv4_prep_unfused

SHAPES = [
    # (T, H, HP, block_size, T')
    (7, 3, 8, 16, 7),  # irregular
    (9, 5, 8, 16, 4),  # fewer rows inserted than tokens (data-parallel padding)
    (33, 16, 64, 64, 33),  # production head padding
    (5, 16, 16, 256, 5),  # no padded heads
]


def _run_both(num_tokens, num_heads, padded_heads, block_size, num_inserted, fn):
    base = make_dsv4_inputs(
        num_tokens, num_heads, padded_heads, block_size, "cpu", num_inserted=num_inserted, skip_fraction=0.0
    )
    assert bool((base.slot_mapping >= 0).all())
    expected, actual = base.fresh_outputs(), base.fresh_outputs()
    dsv4_qnorm_rope_kv_insert_reference(*expected.args())
    fn(*actual.args())
    return expected, actual


@pytest.mark.parametrize("num_tokens,num_heads,padded_heads,block_size,num_inserted", SHAPES)
def test_unfused_matches_reference_bytes(num_tokens, num_heads, padded_heads, block_size, num_inserted):
    expected, actual = _run_both(num_tokens, num_heads, padded_heads, block_size, num_inserted, dsv4_prep_unfused)
    assert torch.equal(actual.q_out.view(torch.int16), expected.q_out.view(torch.int16))
    assert torch.equal(actual.k_cache, expected.k_cache)


def test_unfused_traces_as_one_graph():
    """The benchmark compiles it with fullgraph=True: dynamo must see no graph break."""
    torch._dynamo.reset()
    compiled = torch.compile(dsv4_prep_unfused, backend="eager", fullgraph=True, dynamic=False)
    expected, actual = _run_both(7, 3, 8, 16, 7, compiled)
    assert torch.equal(actual.q_out.view(torch.int16), expected.q_out.view(torch.int16))
    assert torch.equal(actual.k_cache, expected.k_cache)
