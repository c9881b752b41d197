"""Index values, every op and every implementation: what the checks reject, and what the ops
do when the checks cannot run (CUDA-graph capture, ``PREPFUSE_CHECK_INDEX_VALUES=0``).

Checked: a slot given to two tokens is a ValueError naming ``slot_mapping`` and both tokens,
with nothing written (negative slots may repeat: they mean "skip"). Unchecked, the reference
does what the kernels do (``prepfuse/ops/_indices.py``): a slot beyond the cache is skipped
(no IndexError after a partial write), a position outside the table is clamped into it
(-1 reads row 0, not the last row), and a duplicated slot is written whole by its last
token. The Triton kernels run here under the CPU interpreter (on CUDA: the GPU-marked test).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse._compat import has_triton
from prepfuse.ops import _checks
from prepfuse.testing import make_dsv4_indexer_inputs, make_dsv4_inputs, make_gqa_inputs
from tests.ops.impls import IMPLS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")

# op: fresh inputs, every slot valid (OPS adds the op's reference and kernel launch)
INPUTS = {
    "dsv4": lambda: make_dsv4_inputs(6, 3, 8, 16, DEVICE, skip_fraction=0.0),
    "gqa": lambda: make_gqa_inputs(6, 4, 2, 64, 16, DEVICE, skip_fraction=0.0),
    "gqa-fp8": lambda: make_gqa_inputs(6, 4, 2, 64, 16, DEVICE, skip_fraction=0.0, cache_dtype=torch.float8_e4m3fn),
    "indexer-fp8": lambda: make_dsv4_indexer_inputs("fp8", 6, 3, 16, DEVICE, num_k=6, skip_fraction=0.0),
    "indexer-mxfp4": lambda: make_dsv4_indexer_inputs("mxfp4", 6, 3, 16, DEVICE, num_k=6, skip_fraction=0.0),
}
OPS = {op: (make, *IMPLS[op.removesuffix("-fp8") if op == "gqa-fp8" else op]) for op, make in INPUTS.items()}


def outputs(inputs) -> list[torch.Tensor]:
    """Every tensor the call may write, as bytes."""
    names = [n for n in ("q_out", "q_scale", "weights_out", "k_cache", "v_cache") if getattr(inputs, n, None) is not None]
    return [getattr(inputs, n).view(torch.uint8) for n in names]


def run(impl, inputs, **changes):
    """``impl`` on fresh poisoned outputs of ``inputs`` with ``changes`` (index tensors)."""
    out = dataclasses.replace(inputs.fresh_outputs(), **changes)
    impl(*out.args())
    return out


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(outputs(a), outputs(b), strict=True))


def with_value(t: torch.Tensor, index: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def capacity(inputs) -> int:
    block = inputs.k_cache.shape[1] if inputs.k_cache.dim() == 4 else inputs.block_size
    return inputs.k_cache.shape[0] * block


@pytest.fixture
def unchecked(monkeypatch):
    monkeypatch.setattr(_checks, "CHECK_INDEX_VALUES", False)


@pytest.mark.parametrize("op", list(OPS))
def test_a_slot_given_to_two_tokens_is_rejected_and_nothing_written(op):
    make, reference, _ = OPS[op]
    inputs = make()
    slots = with_value(inputs.slot_mapping, 3, int(inputs.slot_mapping[1]))
    out = dataclasses.replace(inputs.fresh_outputs(), slot_mapping=slots)
    before = [t.clone() for t in outputs(out)]
    with pytest.raises(ValueError, match=rf"^slot_mapping: slot {int(slots[1])} is given to tokens 1 and 3"):
        reference(*out.args())
    assert all(torch.equal(a, b) for a, b in zip(before, outputs(out)))


@pytest.mark.parametrize("op", list(OPS))
def test_negative_slots_may_repeat(op):
    make, reference, _ = OPS[op]
    inputs = make()
    slots = with_value(with_value(inputs.slot_mapping, 0, -1), 2, -1)
    run(reference, inputs, slot_mapping=slots)


# every op, by both implementations
EVERY_IMPL = [pytest.param(op, i, id=f"{op}-{name}", marks=() if i == 1 else needs_triton)
              for op in OPS for i, name in ((1, "reference"), (2, "triton"))]


@pytest.mark.parametrize("op, impl", EVERY_IMPL)
def test_unchecked_slot_beyond_the_cache_is_skipped(op, impl, unchecked):
    inputs, impl = OPS[op][0](), OPS[op][impl]
    beyond = run(impl, inputs, slot_mapping=with_value(inputs.slot_mapping, 2, capacity(inputs) + 5))
    skipped = run(impl, inputs, slot_mapping=with_value(inputs.slot_mapping, 2, -1))
    assert same(beyond, skipped)


@pytest.mark.parametrize("op, impl", EVERY_IMPL)
def test_unchecked_positions_are_clamped_into_the_table(op, impl, unchecked):
    inputs, impl = OPS[op][0](), OPS[op][impl]
    rows = inputs.cos_sin_cache.shape[0]
    for bad, clamped in ((-1, 0), (rows + 3, rows - 1)):
        changes = {"positions": with_value(inputs.positions, 1, bad)}
        want = {"positions": with_value(inputs.positions, 1, clamped)}
        if hasattr(inputs, "k_positions"):
            changes["k_positions"] = with_value(inputs.k_positions, 1, bad)
            want["k_positions"] = with_value(inputs.k_positions, 1, clamped)
        assert same(run(impl, inputs, **changes), run(impl, inputs, **want)), (bad, clamped)


@pytest.mark.parametrize("op", list(OPS))
def test_unchecked_duplicate_slot_is_written_whole_by_its_last_token(op, unchecked):
    """The reference: the row (data and scale bytes, k and v) of the later token, as if the
    earlier one were skipped. (The kernels write it from two programs at once: one of the
    writers' or a mix; docs/ops.md.)"""
    make, reference, _ = OPS[op]
    inputs = make()
    slot = int(inputs.slot_mapping[1])
    duplicated = run(reference, inputs, slot_mapping=with_value(inputs.slot_mapping, 4, slot))
    earlier_skipped = run(reference, inputs, slot_mapping=with_value(with_value(inputs.slot_mapping, 4, slot), 1, -1))
    assert same(duplicated, earlier_skipped)
