"""``ScratchArena`` on the CPU: reservations, growth before ``freeze()``, the error after
it, views, and that names never share a byte.

Everything here that needs a stream, an event, ``memory_reserved`` or a CUDA-graph
capture is in ``test_arena_streams.py`` (GPU).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from prepfuse.scratch import ScratchArena, current_arena, default_arena, use_arena

CPU = torch.device("cpu")


def test_take_is_a_contiguous_view_of_the_reservation():
    arena = ScratchArena()
    arena.reserve("q_out", [7, 8, 512], torch.bfloat16, "cpu")
    (reservation,) = arena.reservations()
    view = arena.take("q_out", [7, 8, 512], torch.bfloat16, CPU)
    assert view.shape == (7, 8, 512) and view.dtype == torch.bfloat16 and view.is_contiguous()
    assert view.data_ptr() == reservation.storage.data_ptr()
    assert reservation.nbytes >= 7 * 8 * 512 * 2
    assert arena.reserved_bytes() == arena.reserved_bytes("cpu") == reservation.nbytes
    # a fresh reservation reads as zeros; a write is seen by the next handout (same bytes)
    assert not view.any()
    view.fill_(3.0)
    assert torch.equal(arena.take("q_out", [7, 8, 512], torch.bfloat16, CPU), view)


def test_smaller_and_other_dtype_views_share_the_start():
    arena = ScratchArena()
    big = arena.take("x", [16, 4], torch.float32, CPU)
    others = (([3, 4], torch.float32), ([5, 2, 3], torch.bfloat16), ([256], torch.uint8), ([0, 8], torch.int64))
    for shape, dtype in others:
        view = arena.take("x", shape, dtype, CPU)
        assert (view.shape, view.dtype) == (torch.Size(shape), dtype)
        if view.numel():
            assert view.data_ptr() == big.data_ptr()
    assert len(arena.reservations()) == 1


def test_grows_before_freeze_and_keeps_its_address_after():
    arena = ScratchArena()
    small = arena.take("q_out", [2, 8, 512], torch.bfloat16, CPU)
    assert arena.reserved_bytes() >= small.nbytes
    # the profiling run with the largest token count grows the reservation
    large = arena.take("q_out", [12, 8, 512], torch.bfloat16, CPU)
    assert arena.reserved_bytes() >= large.nbytes
    arena.freeze()
    assert arena.frozen
    addresses = {arena.take("q_out", [t, 8, 512], torch.bfloat16, CPU).data_ptr() for t in (12, 1, 7, 12)}
    assert addresses == {large.data_ptr()}


def test_growth_keeps_storage_a_capture_took():
    """A storage whose address a CUDA graph captured (``captured``, set by a ``take``
    inside a capture; ``test_arena_streams.py`` does it for real) is retired on growth,
    never freed: the graph still replays into it."""
    arena = ScratchArena()
    first = arena.take("q_out", [1000], torch.float32, CPU)
    (reservation,) = arena.reservations()
    reservation.captured = True
    grown = arena.take("q_out", [5000], torch.float32, CPU)
    assert grown.data_ptr() != first.data_ptr()
    assert [t.data_ptr() for t in reservation.retired] == [first.data_ptr()]
    assert not reservation.captured and reservation.nbytes == 20480
    assert arena.reserved_bytes() == reservation.held_bytes == 4096 + 20480
    arena.take("q_out", [6000], torch.float32, CPU)  # an uncaptured storage is just replaced
    assert len(reservation.retired) == 1 and arena.reserved_bytes() == 4096 + 24064


def test_frozen_arena_refuses_more_than_reserved():
    arena = ScratchArena()
    arena.reserve("dsv4.q_out.0", [12, 8, 512], torch.bfloat16, CPU)
    reserved = arena.reserved_bytes()
    arena.freeze()
    arena.reserve("dsv4.q_out.0", [12, 8, 512], torch.bfloat16, CPU)  # fits: a no-op
    assert reserved == 12 * 8 * 512 * 2  # a multiple of the 512-byte granularity already
    message = r"'dsv4.q_out.0' on cpu needs 106496 bytes \(\(13, 8, 512\) torch.bfloat16\) but only 98304 were reserved"
    with pytest.raises(RuntimeError, match=message):
        arena.take("dsv4.q_out.0", [13, 8, 512], torch.bfloat16, CPU)
    with pytest.raises(RuntimeError, match="'other' on cpu needs 4 bytes .* only 0 were reserved before freeze"):
        arena.take("other", [1], torch.float32, CPU)
    with pytest.raises(RuntimeError, match="only 0 were reserved"):
        arena.reserve("other", [1], torch.float32, CPU)
    assert arena.reserved_bytes() == reserved  # nothing was allocated by the refusals
    # zero bytes need no reservation, frozen or not
    assert arena.take("empty", [4, 0, 512], torch.bfloat16, CPU).numel() == 0


def test_names_never_overlap():
    """Every pair of reservations is disjoint, and a write through one name's view
    changes no byte of any other name's, however they grew."""
    arena = ScratchArena()
    names = [f"buf{i}" for i in range(5)]
    for step, name in itertools.product(range(3), names):  # interleaved growth
        arena.take(name, [1 + 300 * step + names.index(name)], torch.float32, CPU)
    ranges = sorted(r.address_range for r in arena.reservations())
    assert len(ranges) == len(names)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(ranges, ranges[1:]))

    views = {name: arena.take(name, [600], torch.float32, CPU) for name in names}
    for i, name in enumerate(names):
        views[name].fill_(float(i))
    for i, name in enumerate(names):
        assert torch.equal(views[name], torch.full((600,), float(i))), name


def test_devices_are_separate_reservations():
    arena = ScratchArena()
    arena.take("x", [4], torch.float32, "cpu")
    arena.take("x", [4], torch.float32, "meta")
    assert sorted(str(r.device) for r in arena.reservations()) == ["cpu", "meta"]
    assert arena.reserved_bytes("cpu") == arena.reserved_bytes("meta") == 512


@pytest.mark.parametrize(
    "args, message",
    [
        (("", [1], torch.float32, "cpu"), "name: expected a non-empty string"),
        ((3, [1], torch.float32, "cpu"), "name: expected a non-empty string"),
        (("x", [2, -1], torch.float32, "cpu"), r"shape: sizes must be >= 0"),
        (("x", "12", torch.float32, "cpu"), "shape: expected a sequence"),
        (("x", [2.0], torch.float32, "cpu"), "shape: sizes must be ints"),
        (("x", [2], "float32", "cpu"), "dtype: expected a torch.dtype"),
        (("x", [2], torch.float32, "nowhere"), "device: expected a torch.device"),
        (("x", [2**62], torch.float32, "cpu"), r"shape: \[4611686018427387904\] torch.float32 is .* bytes, more than"),
        (("x", [2**31, 2**31], torch.float32, "cpu"), r"shape: .* more than any device can hold"),
    ],
)
def test_bad_arguments_name_the_argument(args, message):
    arena = ScratchArena()
    with pytest.raises(ValueError, match=message):
        arena.take(*args)
    with pytest.raises(ValueError, match=message):
        arena.reserve(*args)
    assert arena.reservations() == []


def test_record_stream_needs_a_reservation():
    with pytest.raises(ValueError, match="name: no reservation 'x' on cpu"):
        ScratchArena().record_stream("x", "cpu", None)


def test_record_stream_is_for_cuda_streams():
    arena = ScratchArena()
    arena.take("x", [4], torch.float32, "cpu")
    with pytest.raises(ValueError, match="^device: record_stream orders CUDA streams, and 'x' is on cpu"):
        arena.record_stream("x", "cpu", None)


def test_use_arena_nests_and_restores():
    outer, inner = ScratchArena(), ScratchArena()
    assert current_arena() is default_arena()
    with use_arena(outer):
        assert current_arena() is outer
        with use_arena(inner):
            assert current_arena() is inner
        assert current_arena() is outer
    assert current_arena() is default_arena()
    with pytest.raises(ValueError, match="arena: expected a ScratchArena"):
        with use_arena(object()):
            pass


def test_nested_use_of_one_arena_restores_the_one_around_it():
    a, b = ScratchArena(), ScratchArena()
    with use_arena(a):
        with use_arena(b):
            with use_arena(a):
                assert current_arena() is a
            assert current_arena() is b  # was a: the outer entry of a had been removed
        assert current_arena() is a
    assert current_arena() is default_arena()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_a_cuda_take_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ScratchArena().take("x.0", [4], torch.float32, "cuda")


def test_reset_drops_reservations_and_the_freeze():
    arena = ScratchArena()
    arena.take("x.0", [4], torch.float32, "cpu")
    arena.freeze()
    arena.reset()
    assert not arena.frozen and arena.reservations() == []
    assert arena.take("x.0", [64], torch.float32, "cpu").shape == (64,)  # grows again
