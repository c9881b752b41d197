"""Index values, every op and every implementation: what the checks reject, and what the ops
do when the checks cannot run (CUDA-graph capture, ``PREPFUSE_CHECK_INDEX_VALUES=0``).

Checked: a slot given to two tokens is a ValueError naming ``slot_mapping`` and both tokens,
with nothing written (negative slots may repeat: they mean "skip"). Unchecked, the reference
does what the kernels do (``prepfuse/ops/_indices.py``): a slot beyond the cache is skipped
(no IndexError after a partial write), a position outside the table is clamped into it
(-1 reads row 0, not the last row), and a duplicated slot is written whole by its last
token; the kernels write it whole too (``prepfuse/ops/_duplicate_slots.py``: the last token
by a scan of the slots, or one of them under the slot's lock). The Triton kernels run here
under the CPU interpreter (on CUDA: the kernels themselves, and the GPU-marked contended case).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from prepfuse._compat import has_triton
from prepfuse.ops import _checks
from prepfuse.ops import _duplicate_slots
from prepfuse.testing import make_dsv4_full_row_inputs, make_dsv4_indexer_inputs, make_dsv4_inputs, make_gqa_inputs
from prepfuse.testing.duplicate_slots import call_on_fresh_outputs as run
from prepfuse.testing.duplicate_slots import contended_inputs, sharing_slots, torn_slots
from prepfuse.testing.duplicate_slots import written_outputs as outputs
from prepfuse.testing.impls import implementations

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")

# op: fresh inputs, every slot valid (OPS adds the op's reference and kernel launch)
INPUTS = {
    "dsv4": lambda: make_dsv4_inputs(6, 3, 8, 16, DEVICE, skip_fraction=0.0),
    "dsv4-full-row": lambda: make_dsv4_full_row_inputs(6, 3, 3, 16, DEVICE, skip_fraction=0.0),
    "dsv4-full-row-fp8": lambda: make_dsv4_full_row_inputs(6, 3, 8, 16, DEVICE, fmt="fp8", skip_fraction=0.0),
    "gqa": lambda: make_gqa_inputs(6, 4, 2, 64, 16, DEVICE, skip_fraction=0.0),
    "gqa-fp8": lambda: make_gqa_inputs(6, 4, 2, 64, 16, DEVICE, skip_fraction=0.0, cache_dtype=torch.float8_e4m3fn),
    "indexer-fp8": lambda: make_dsv4_indexer_inputs("fp8", 6, 3, 16, DEVICE, num_k=6, skip_fraction=0.0),
    "indexer-mxfp4": lambda: make_dsv4_indexer_inputs("mxfp4", 6, 3, 16, DEVICE, num_k=6, skip_fraction=0.0),
}
OPS = {op: (make, *implementations(op)) for op, make in INPUTS.items()}


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
    earlier one were skipped. (The kernels' scan likewise; under the locks any one writer's.)"""
    make, reference, _ = OPS[op]
    inputs = make()
    slot = int(inputs.slot_mapping[1])
    duplicated = run(reference, inputs, slot_mapping=with_value(inputs.slot_mapping, 4, slot))
    earlier_skipped = run(reference, inputs, slot_mapping=with_value(with_value(inputs.slot_mapping, 4, slot), 1, -1))
    assert same(duplicated, earlier_skipped)


@needs_triton
@pytest.mark.parametrize("dedupe", ["scan", "lock"])
@pytest.mark.parametrize("op", list(OPS))
def test_the_kernel_writes_a_duplicated_slot_as_one_tokens_whole_row(op, dedupe):
    """Unchecked (the launch itself), tokens 0-2 share a slot and 3-4 another: each slot holds
    one writer's whole row (data and scale bytes; k and v of every head), every other byte
    is as without them, and every row lock is released. The scan (``_duplicate_slots``; the
    launch's own choice at 6 rows) writes the last token's row, as if the others were
    skipped. Programs run one after the other in the CPU interpreter, so there the locks are
    never contended; the contended case is the GPU test below."""
    make, _, kernel = OPS[op]
    launch = functools.partial(kernel, dedupe=dedupe)
    inputs = make()
    slots = sharing_slots(inputs.slot_mapping, [(0, 3), (3, 5)])
    assert _duplicate_slots.dedupe_mode(slots) == _duplicate_slots.DEDUPE_SCAN
    got = run(launch, inputs, slot_mapping=slots)
    assert torn_slots(got, launch, inputs, slots) == []
    if dedupe == "scan":
        earlier_skipped = slots.clone()
        earlier_skipped[[0, 1, 3]] = -1
        assert same(got, run(launch, inputs, slot_mapping=earlier_skipped))
    assert not _duplicate_slots.row_locks(inputs.k_cache.device).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: programs run at once only on a GPU")
@pytest.mark.parametrize("dedupe", ["scan", "lock"])
@pytest.mark.parametrize("op", list(OPS))
def test_contended_duplicate_slots_are_whole_rows_on_the_gpu(op, dedupe):
    """Runs of 96 consecutive tokens (programs that run at the same time) on each of three
    slots, five calls on fresh data: no slot mixes two tokens' rows, with the scan (forced:
    1024 rows is past SCAN_MAX) and with the locks (the launch's choice there). Without
    either the same calls tore rows (``bench/duplicate_slots.py`` counts them)."""
    launch = functools.partial(OPS[op][2], dedupe=dedupe)
    for _ in range(5):
        inputs, slots = contended_inputs(op, DEVICE)
        got = run(launch, inputs, slot_mapping=slots)
        assert torn_slots(got, launch, inputs, slots) == []
    assert not _duplicate_slots.row_locks(inputs.k_cache.device).any()


def test_a_capture_cannot_make_the_lock_table(monkeypatch):
    """The table is made outside a capture (a capture cannot allocate it): a first call inside
    one is a RuntimeError that says to warm up, not a captured allocation."""
    monkeypatch.setattr(_duplicate_slots, "_TABLES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run the model .* once before capturing"):
        _duplicate_slots.row_locks(torch.device("cuda", 0))


def test_the_launch_chooses_how_to_keep_duplicated_slots_whole():
    """One row: nothing to keep apart; up to SCAN_MAX rows the scan; beyond, the locks."""
    def mode(rows, override=None):
        return _duplicate_slots.dedupe_mode(torch.zeros(rows, dtype=torch.int64), override)

    assert mode(0) == mode(1) == _duplicate_slots.DEDUPE_OFF
    assert mode(2) == mode(_duplicate_slots.SCAN_MAX) == _duplicate_slots.DEDUPE_SCAN
    assert mode(_duplicate_slots.SCAN_MAX + 1) == _duplicate_slots.DEDUPE_LOCK
    assert mode(2, "off") == _duplicate_slots.DEDUPE_OFF and mode(1, "lock") == _duplicate_slots.DEDUPE_LOCK
    with pytest.raises(ValueError, match="^dedupe: expected one of"):
        mode(2, "locks")
    assert [_duplicate_slots.scan_block(torch.zeros(n)) for n in (1, 16, 17, 512)] == [16, 16, 32, 512]


@pytest.mark.parametrize("op", ["dsv4", "gqa"])
def test_torn_slots_finds_a_row_mixed_from_two_tokens(op):
    """The checker of the tests above can fail: a slot holding token 0's data (k) beside token
    1's scale bytes (v) is torn; either token's whole row is not."""
    make, reference, _ = OPS[op]
    inputs = make()
    slots = sharing_slots(inputs.slot_mapping, [(0, 2)])
    slot = int(slots[0])
    first = run(reference, inputs, slot_mapping=with_value(slots, 1, -1))
    second = run(reference, inputs, slot_mapping=with_value(slots, 0, -1))
    assert torn_slots(first, reference, inputs, slots) == []
    assert torn_slots(second, reference, inputs, slots) == []
    if op == "gqa":
        first.v_cache.copy_(second.v_cache)
    else:
        block, row = divmod(slot, inputs.block_size)
        scales = slice(inputs.block_size * 576 + row * 8, inputs.block_size * 576 + row * 8 + 8)
        first.k_cache[block, scales] = second.k_cache[block, scales]
    assert torn_slots(first, reference, inputs, slots) == [slot]
