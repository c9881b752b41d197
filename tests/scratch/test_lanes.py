"""Arena lanes: every thread, and every micro-batch (``prepfuse.scratch.micro_batch``), has
storage of its own for a name, so concurrent calls never write one reservation.

Two threads calling one compiled model 300 times each, every returned padded q checked
against eager right after its call: 0 wrong (before lanes, the issue measured 28 and 22
wrong of 300). Micro-batches: distinct reservations, reserved by running each once (the
profiling run), results equal to running them one after the other, and a lane nobody
reserved is refused after ``freeze()`` by name. The GPU overlap of two micro-batches on two
streams is measured by ``bench/bench_micro_batches.py``.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models import dsv4 as model
from prepfuse.models.dsv4 import DSV4_SPELLINGS
from prepfuse.scratch import ScratchArena, current_lane, micro_batch, use_arena
from prepfuse.testing import compare_dsv4_q, make_dsv4_inputs

H, HP, BLOCK, EPS, T = 3, 8, 16, 1e-6, 7
CALLS = 300

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def prep(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    spelling = DSV4_SPELLINGS[0]
    q_padded = model.dsv4_q_prep(q, positions, cos_sin_cache, EPS, HP, spelling)
    model.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, BLOCK, spelling)
    return q_padded


def call_and_check(compiled, generator) -> bool:
    """One call on fresh inputs; whether its returned q is eager's (the DeepSeek-V4 bound)."""
    inputs = make_dsv4_inputs(T, H, HP, BLOCK, "cpu", skip_fraction=0.0, generator=generator)
    rest = (inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    out = compiled(inputs.q, inputs.kv, inputs.k_cache.clone(), *rest)
    ref = prep(inputs.q, inputs.kv, inputs.k_cache.clone(), *rest)
    return compare_dsv4_q(ref, out).within_spec()


@pytest.fixture
def arena():
    with use_arena(ScratchArena()) as arena:
        yield arena


def test_two_threads_calling_one_compiled_model_never_share_a_reservation(arena):
    compiled = torch.compile(prep, backend=PrepfuseBackend({"strict": True}), fullgraph=True)
    assert call_and_check(compiled, torch.Generator().manual_seed(0))  # compile once, on this thread
    wrong, errors = [0, 0], []

    def worker(i: int) -> None:
        try:
            gen = torch.Generator().manual_seed(100 + i)
            for _ in range(CALLS):
                wrong[i] += not call_and_check(compiled, gen)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert wrong == [0, 0]
    names = sorted(r.name for r in arena.reservations() if "q_out" in r.name)
    assert len(names) == 3 and names[0].endswith(".q_out.0")  # this thread's, then one per worker
    assert all(re.search(r"@thread\d+$", n) for n in names[1:])


def test_lane_names():
    assert current_lane() == ""
    with micro_batch(2):
        assert current_lane() == "mb2"
        with micro_batch(0):
            assert current_lane() == ""
        assert current_lane() == "mb2"
    seen = []
    t = threading.Thread(target=lambda: seen.append(current_lane()))
    t.start()
    t.join()
    assert len(seen) == 1 and re.fullmatch(r"thread\d+", seen[0])
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="index: expected a micro-batch index"):
            with micro_batch(bad):
                pass


def test_a_thread_started_after_freeze_takes_the_lane_of_one_that_ended(arena):
    """Lanes number the threads alive at once, not their ids: after ``freeze()``, every new
    thread finds the lane the profiling thread reserved (the id-named lanes failed a new
    thread nondeterministically, when the OS handed it an id no reserving thread had had)."""
    def take():
        arena.take("x", [64], torch.float32, "cpu")

    profiler = threading.Thread(target=take)
    profiler.start()
    profiler.join()
    arena.freeze()
    errors = []
    for _ in range(20):
        t = threading.Thread(target=lambda: _record_errors(take, errors))
        t.start()
        t.join()
    assert errors == []
    assert [r.name for r in arena.reservations()] == ["x@thread1"]


def test_more_threads_at_once_than_reserved_fail_every_time_saying_what_to_do(arena):
    def take():
        arena.take("x", [64], torch.float32, "cpu")

    take()  # the main thread's lane
    profiler = threading.Thread(target=take)
    profiler.start()
    profiler.join()
    arena.freeze()
    for _ in range(3):
        errors, together = [], threading.Barrier(2)

        def worker():
            together.wait()  # both alive: two lanes at once, one reserved
            _record_errors(take, errors)
            together.wait()

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 1
        assert "'x@thread2'" in str(errors[0]) and "from as many threads at once as will serve" in str(errors[0])


def _record_errors(fn, errors: list) -> None:
    try:
        fn()
    except RuntimeError as err:
        errors.append(err)


def test_micro_batches_have_their_own_scratch(arena):
    """Each micro-batch's q lives in its own reservation: both stay valid together, equal
    to running the two one after the other in one lane."""
    compiled = torch.compile(prep, backend=PrepfuseBackend({"strict": True}), fullgraph=True)
    batches = [make_dsv4_inputs(T, H, HP, BLOCK, "cpu", skip_fraction=0.0) for _ in range(2)]

    def run(inputs):
        return compiled(inputs.q, inputs.kv, inputs.k_cache.clone(), inputs.slot_mapping, inputs.positions,
                        inputs.cos_sin_cache)

    serial = [run(b).clone() for b in batches]
    with micro_batch(0):
        first = run(batches[0])
    with micro_batch(1):
        second = run(batches[1])
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first.view(torch.int16), serial[0].view(torch.int16))
    assert torch.equal(second.view(torch.int16), serial[1].view(torch.int16))
    names = {r.name for r in arena.reservations()}
    assert any(n.endswith("q_out.0@mb1") for n in names) and any(n.endswith("q_out.0") for n in names)

    arena.freeze()
    with micro_batch(2), pytest.raises(RuntimeError, match=r"q_out\.0@mb2' on cpu needs"):
        run(batches[0])
