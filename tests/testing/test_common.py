"""``prepfuse.testing.common.with_wrapped_indices``: the same rows through the wrap, on the
GQA and DeepSeek-V4 references; a skipped slot has no wrapped form and is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse.ops import dsv4_qnorm_rope_kv_insert_reference, gqa_qknorm_rope_kv_insert_reference
from prepfuse.testing import make_dsv4_inputs, make_gqa_inputs, with_wrapped_indices


def test_wrapped_gqa_inputs_write_the_same_rows():
    base = make_gqa_inputs(5, 4, 2, 64, 16, "cpu", skip_fraction=0.0)
    wrapped = with_wrapped_indices(base, base.k_cache.shape[0] * base.k_cache.shape[1])
    assert wrapped.wrap_indices and (wrapped.slot_mapping < 0).any() and (wrapped.positions < 0).any()
    plain, through = base.fresh_outputs(), wrapped.fresh_outputs()
    gqa_qknorm_rope_kv_insert_reference(*plain.args())
    gqa_qknorm_rope_kv_insert_reference(*through.args())
    for a, b in ((plain.q_out, through.q_out), (plain.k_cache, through.k_cache), (plain.v_cache, through.v_cache)):
        assert torch.equal(a, b)


def test_wrapped_dsv4_inputs_write_the_same_rows():
    base = make_dsv4_inputs(5, 3, 8, 16, "cpu", skip_fraction=0.0)
    wrapped = with_wrapped_indices(base, base.k_cache.shape[0] * base.block_size)
    plain, through = base.fresh_outputs(), wrapped.fresh_outputs()
    dsv4_qnorm_rope_kv_insert_reference(*plain.args())
    dsv4_qnorm_rope_kv_insert_reference(*through.args())
    assert torch.equal(plain.q_out, through.q_out) and torch.equal(plain.k_cache, through.k_cache)


def test_a_skipped_slot_is_refused():
    base = make_gqa_inputs(5, 4, 2, 64, 16, "cpu", skip_fraction=0.0)
    skipped = dataclasses.replace(base, slot_mapping=torch.where(torch.arange(5) == 2, -1, base.slot_mapping))
    with pytest.raises(ValueError, match="slot_mapping"):
        with_wrapped_indices(skipped, base.k_cache.shape[0] * base.k_cache.shape[1])
