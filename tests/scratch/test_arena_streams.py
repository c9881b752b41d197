"""``ScratchArena`` on CUDA: cross-stream ordering, ``memory_reserved``, capture.

The stream tests make the race deterministic: every consumer sleeps
(``torch.cuda._sleep``, about 50 ms) between the producer's write and its own read, far
longer than it takes the host to queue the next producer on the other stream. Each runs
twice, with the arena's ordering on and off (``ScratchArena(order_streams=False)``, the
testing switch): off, the test must see corrupt output, which shows it would catch a
regression; on, the output must equal a single-stream run's.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.scratch import ScratchArena

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 100_000_000  # ~50 ms at the H200's ~2 GHz
ROUNDS = 6
N = 1 << 20  # floats per handout


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(N, device="cuda", generator=gen) for _ in range(ROUNDS)]


def _producers_on_two_streams(arena: ScratchArena, streams, inputs) -> list[torch.Tensor]:
    """Round i on streams[i % 2]: take the shared name, write input i into it, sleep,
    then read it (``view * 2``). Round i + 1 takes the same bytes on the other stream."""
    start = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(start)  # the inputs are ready
    outs = []
    for i, x in enumerate(inputs):
        with torch.cuda.stream(streams[i % len(streams)]):
            view = arena.take("shared", [N], torch.float32, "cuda")
            view.copy_(x)
            torch.cuda._sleep(SLEEP_CYCLES)  # a slow consumer ...
            outs.append(view * 2)  # ... reads after the next producer was queued
    torch.cuda.synchronize()
    return outs


def _consumer_on_a_side_stream(arena: ScratchArena, inputs, record: bool) -> list[torch.Tensor]:
    """Every round produces on one stream and consumes on a side stream (which waits for
    the producer, sleeps, reads); ``record`` tells the arena the side stream reads."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for x in inputs:
        with torch.cuda.stream(producer):
            view = arena.take("shared", [N], torch.float32, "cuda")
            view.copy_(x)
        consumer.wait_stream(producer)
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(SLEEP_CYCLES)
            outs.append(view * 2)
        if record:
            arena.record_stream("shared", "cuda", consumer)
    torch.cuda.synchronize()
    return outs


def _mismatched_rounds(outs, expected) -> list[int]:
    return [i for i, (o, e) in enumerate(zip(outs, expected)) if not torch.equal(o, e)]


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_two_producer_streams_share_a_name(ordered):
    inputs = _inputs()
    single = _producers_on_two_streams(ScratchArena(), [torch.cuda.current_stream()], inputs)
    assert _mismatched_rounds(single, [2 * x for x in inputs]) == []

    arena = ScratchArena(order_streams=ordered)
    arena.reserve("shared", [N], torch.float32, "cuda")
    arena.freeze()
    outs = _producers_on_two_streams(arena, [torch.cuda.Stream(), torch.cuda.Stream()], inputs)
    bad = _mismatched_rounds(outs, single)
    if ordered:
        assert bad == []
    else:  # the next producer overwrote the bytes during the consumer's sleep
        assert bad, "the unordered run was not corrupted: the test cannot detect a missing event"


@pytest.mark.parametrize("ordered, record", [(True, True), (True, False), (False, True)],
                         ids=["ordered-recorded", "ordered-not-recorded", "unordered-recorded"])
def test_consumer_on_a_side_stream_needs_record_stream(ordered, record):
    """A reader on a stream that never took the name is only waited for once it is
    recorded (as with the caching allocator's ``record_stream``)."""
    inputs = _inputs()
    outs = _consumer_on_a_side_stream(ScratchArena(order_streams=ordered), inputs, record)
    bad = _mismatched_rounds(outs, [2 * x for x in inputs])
    if ordered and record:
        assert bad == []
    else:
        assert bad, "the run was not corrupted: the test cannot detect a missing event"


def test_memory_reserved_counts_reservations_and_frozen_takes_allocate_nothing():
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    arena = ScratchArena()
    size = 64 << 20
    arena.reserve("q_out", [size], torch.uint8, "cuda")
    assert arena.reserved_bytes("cuda") == size
    assert torch.cuda.memory_allocated() - allocated == size
    # the bytes are an allocated block of a caching-allocator segment: memory_reserved,
    # which KV-cache sizing reads, includes them
    start = arena.reservations()[0].storage.data_ptr()
    blocks = [block for segment in torch.cuda.memory_snapshot() for block in segment["blocks"]]
    (block,) = [b for b in blocks if b["address"] == start]
    assert block["state"] == "active_allocated" and block["size"] == size
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated() >= size
    arena.freeze()
    before = torch.cuda.memory_stats()
    for tokens in (4096, 1, 777, 4096):
        view = arena.take("q_out", [tokens, 16, 512], torch.bfloat16, "cuda")  # 64 MiB at 4096
        view.fill_(1.0)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated"):
        assert after[key] == before[key], key
    with pytest.raises(RuntimeError, match=r"'q_out' on cuda:\d needs 67109888 bytes"):
        arena.take("q_out", [size + 1024], torch.uint8, "cuda")


def test_capture_keeps_the_captured_storage():
    """A capture takes the reservation the warm-up sized (frozen or not) and replays into
    it; growing inside a capture is refused; growing after it (before freeze) gives the
    name new storage and keeps the captured one alive, so old replays stay correct."""
    arena = ScratchArena()
    static_in = torch.randn(1000, device="cuda")
    eager = arena.take("out", [1000], torch.float32, "cuda")  # the warm-up sizes it
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"'out' on cuda:\d needs 8000 bytes .* inside a CUDA-graph capture"):
        with torch.cuda.graph(graph):
            arena.take("out", [2000], torch.float32, "cuda")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its own capture stream: the eager user is not waited for
        captured = arena.take("out", [1000], torch.float32, "cuda")
        captured.copy_(static_in * 3)
    assert captured.data_ptr() == eager.data_ptr()

    grown = arena.take("out", [5000], torch.float32, "cuda")  # not frozen: may grow
    assert grown.data_ptr() != captured.data_ptr()
    assert arena.reserved_bytes("cuda") == 4096 + 20480  # the captured storage is still held
    grown.fill_(-1.0)
    for _ in range(3):
        fresh = torch.randn(1000, device="cuda")
        static_in.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fresh * 3)
        assert (grown == -1.0).all()  # the replays write the captured storage only

    arena.freeze()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again = arena.take("out", [5000], torch.float32, "cuda")
        again.copy_(torch.cat((static_in, static_in, static_in, static_in, static_in)))
    assert again.data_ptr() == grown.data_ptr()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(arena.take("out", [1000], torch.float32, "cuda"), static_in)
