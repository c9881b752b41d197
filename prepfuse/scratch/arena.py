"""A scratch arena: named, persistent buffers that fused ops write instead of allocating.

Why (docs/design.md, lessons 1 and 2): an op that allocates its padded q on every call allocates
*after* the engine has sized its KV cache from the memory left, and OOMs under long context; so
the scratch is reserved during the profiling run (``memory_reserved`` counts it when the KV cache is
sized) and views of it are handed out on every forward. Sharing scratch broke the model-wide pool
before (views of the same bytes live at once on two streams), so the arena keeps three rules:

- **Names never overlap.** Each (name, device) has its own storage, so scratch that can be live at
  once (different names) never shares a byte. A name's handout is live from one ``take`` to the
  next ``take`` of the name: two handouts that must be live together take two names.
- **Reuse across streams is ordered.** ``take`` on stream S of a name last used on stream U != S
  makes S wait for an event recorded on U then (everything queued on U by then, its reads of the
  old handout included). ``record_stream`` adds a stream that reads a handout without taking it,
  as the caching allocator's ``record_stream`` does.
- **Frozen means fixed.** Before ``freeze()`` a ``take`` larger than the reservation grows it (the
  profiling run, at the largest token count, sizes each name). After it nothing is allocated: a view
  of at most the reserved bytes, at the same address every time (CUDA-graph replays rely on it), and
  a larger request is a ``RuntimeError`` naming the name and both sizes.

Capture: a ``take`` inside a CUDA-graph capture must fit the reservation (warm up, or ``reserve``,
first); the arena keeps a captured storage (a later growth before ``freeze()`` gives the name new
storage and retires, never frees, the old), and only a frozen arena guarantees one address for
every graph. Inside a capture only streams of that capture are ordered with events (work queued
before it began is finished: ``torch.cuda.graph`` synchronizes when it starts). Replays are
invisible to the arena: eager work on another stream taking a name a graph replays on must be
ordered by the engine, or ``record_stream`` the replay stream.

Lanes: a name's storage is per lane too. Every thread has its own (the main thread's lane is the
plain name, others ``<name>@thread<k>``, ``k`` numbering the threads alive at once, so a thread
starting after another ended takes its lane), and ``micro_batch(i)`` gives micro-batch ``i >= 1``
its own (``<name>@mb<i>``), so two micro-batches of a dual-batch-overlap forward run on two streams
at once. The profiling run reserves every lane it will use (each micro-batch once, or ``reserve``
under ``micro_batch(i)``, from as many threads at once as will call); after ``freeze()`` a lane
nobody reserved is the usual ``RuntimeError`` naming it, every time.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from dataclasses import dataclass, field

import torch

_MAX_BYTES = 2**62  # a size past this overflows the allocator's int64 byte count on the way up
_ALIGN = 512  # bytes; the caching allocator's own granularity, so growth never wastes a block
_LANE = threading.local()  # .micro_batch: the index ``micro_batch`` set; .thread: this thread's _ThreadLane
_THREAD_LANES_LOCK = threading.Lock()
_THREAD_LANES_HELD: set[int] = set()  # thread lane numbers held by live threads


class _ThreadLane:
    """A thread's lane number, held while the thread lives: the smallest number no live
    thread holds, given back when the thread ends (its thread-local dies with it). Numbered
    by how many threads call at once, not by thread id, so a thread started after
    ``freeze()`` takes the lane of one that ended (ids are reused, and a new id must not
    decide whether a reservation exists)."""

    def __init__(self) -> None:
        with _THREAD_LANES_LOCK:
            self.number = next(i for i in range(1, len(_THREAD_LANES_HELD) + 2) if i not in _THREAD_LANES_HELD)
            _THREAD_LANES_HELD.add(self.number)
        weakref.finalize(self, _release_thread_lane, self.number)


def _release_thread_lane(number: int) -> None:
    with _THREAD_LANES_LOCK:
        _THREAD_LANES_HELD.discard(number)


def current_lane() -> str:
    """The calling thread's lane: "" on the main thread outside any micro-batch; else
    ``thread<k>`` (``k``: the smallest number no other live thread holds) and/or ``mb<i>``
    joined by "." (see the module docstring)."""
    parts = []
    if threading.current_thread() is not threading.main_thread():
        lane = getattr(_LANE, "thread", None)
        if lane is None:
            lane = _LANE.thread = _ThreadLane()
        parts.append(f"thread{lane.number}")
    index = getattr(_LANE, "micro_batch", 0)
    if index:
        parts.append(f"mb{index}")
    return ".".join(parts)


@contextlib.contextmanager
def micro_batch(index: int):
    """Scratch of its own for micro-batch ``index`` (0: the thread's own lane, as outside):
    wrap each micro-batch's forward, in the profiling run too, so KV sizing counts both.

    ``with prepfuse.scratch.micro_batch(1), torch.cuda.stream(side): model(batch_1)``
    """
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"index: expected a micro-batch index, an int >= 0, got {index!r}")
    previous = getattr(_LANE, "micro_batch", 0)
    _LANE.micro_batch = index
    try:
        yield
    finally:
        _LANE.micro_batch = previous


def _laned(name: str) -> str:
    lane = current_lane()
    return f"{name}@{lane}" if lane else name


@dataclass
class Reservation:
    """One name's storage on one device and the streams its current handout is used on."""

    name: str
    device: torch.device
    storage: torch.Tensor  # uint8 [nbytes]
    captured: bool = False  # a CUDA graph captured this storage's address
    retired: list = field(default_factory=list)  # captured storages replaced by growth, kept alive
    users: dict = field(default_factory=dict)  # stream id -> torch.cuda.Stream
    events: dict = field(default_factory=dict)  # stream id -> a reusable torch.cuda.Event

    @property
    def nbytes(self) -> int:
        """Bytes a view of this name may use."""
        return self.storage.numel()

    @property
    def held_bytes(self) -> int:
        """Bytes held: the storage and any retired storage a CUDA graph still writes."""
        return self.nbytes + sum(t.numel() for t in self.retired)

    @property
    def address_range(self) -> tuple[int, int]:
        """[first byte, one past the last byte) of the reserved storage."""
        start = self.storage.data_ptr()
        return start, start + self.nbytes


class ScratchArena:
    """Named scratch buffers, reserved once and handed out as views on every call.

    ``take(name, shape, dtype, device)`` returns a contiguous view of ``name``'s storage;
    ``reserve`` sizes a name ahead of time; ``freeze()`` ends growth. See the module
    docstring for lifetimes, streams and capture.

    ``order_streams=False`` turns the cross-stream event ordering off. It exists only so
    a test can show that its workload corrupts without the ordering (i.e. that the test
    would catch a regression); nothing else should set it.
    """

    def __init__(self, *, order_streams: bool = True) -> None:
        self._reservations: dict[tuple[str, torch.device], Reservation] = {}
        self._frozen = False
        self._order_streams = order_streams
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------
    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self) -> None:
        """End growth: from now on every ``take`` fits its reservation or raises."""
        self._frozen = True

    def reset(self) -> None:
        """Drop every reservation and end the freeze: the arena as new. For an engine that
        re-profiles (a new maximum batch) or a test; only when no view it handed out is in
        use and no CUDA graph captured on it will replay (their bytes go back to the
        caching allocator)."""
        with self._lock:
            self._reservations.clear()
            self._frozen = False

    def reservations(self) -> list[Reservation]:
        """Every reservation, by name then device."""
        return sorted(self._reservations.values(), key=lambda r: (r.name, str(r.device)))

    def reserved_bytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held, on ``device`` or on every device (retired captured storage included)."""
        device = None if device is None else _device(device)
        return sum(r.held_bytes for r in self._reservations.values() if device is None or r.device == device)

    def reserve(self, name: str, shape, dtype: torch.dtype, device) -> None:
        """Make ``name`` on ``device`` hold at least a ``shape`` ``dtype`` tensor.

        Before ``freeze()`` this grows the reservation when needed; after it, it checks
        that the reservation already fits (``RuntimeError`` if not)."""
        name, nbytes, device = _checked(name, shape, dtype, device)
        with self._lock:
            self._fitting(name, nbytes, device, shape, dtype)

    def take(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A contiguous ``shape`` ``dtype`` view of ``name``'s storage on ``device``.

        Its bytes are whatever the previous handout left (zeros when just reserved).
        The view stays valid until the next ``take`` of the same name in the same lane
        (thread, micro-batch); on CUDA the current stream first waits for the streams that
        used the previous handout."""
        name, nbytes, device = _checked(name, shape, dtype, device)
        with self._lock:
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            reservation = self._fitting(name, nbytes, device, shape, dtype, capturing)
            if capturing:
                reservation.captured = True
            if device.type == "cuda":
                self._hand_over(reservation, torch.cuda.current_stream(device))
            return reservation.storage[:nbytes].view(dtype).view(shape)

    def record_stream(self, name: str, device, stream: torch.cuda.Stream) -> None:
        """Mark ``stream`` as reading ``name``'s current handout, so that the next ``take``
        from any other stream waits for what ``stream`` has queued by then."""
        key = (_laned(name), _device(device))
        if key not in self._reservations:
            raise ValueError(f"name: no reservation {name!r} on {key[1]}")
        if key[1].type != "cuda":
            raise ValueError(f"device: record_stream orders CUDA streams, and {name!r} is on {key[1]}")
        if not isinstance(stream, torch.cuda.Stream):
            raise ValueError(f"stream: expected a torch.cuda.Stream, got {stream!r}")
        with self._lock:
            self._reservations[key].users[stream.stream_id] = stream

    # ----------------------------------------------------------------------------------
    def _fitting(self, name: str, nbytes: int, device: torch.device, shape, dtype,
                 capturing: bool = False) -> Reservation:
        """The reservation of (name, device), grown to ``nbytes`` if the arena may grow."""
        reservation = self._reservations.get((name, device))
        have = 0 if reservation is None else reservation.nbytes
        if reservation is not None and nbytes <= have:
            return reservation
        if self._frozen and nbytes > 0:
            lane = "@thread" in name and reservation is None
            raise RuntimeError(
                f"scratch arena: {name!r} on {device} needs {nbytes} bytes ({tuple(shape)} {dtype}) but only {have} "
                "were reserved before freeze(); reserve it during the profiling run, with the largest token count"
                + ("; a thread's lane is its number among the threads calling at once: run the profiling run "
                   "from as many threads at once as will serve" if lane else "")
            )
        if capturing and nbytes > 0:
            raise RuntimeError(
                f"scratch arena: {name!r} on {device} needs {nbytes} bytes ({tuple(shape)} {dtype}) inside a "
                f"CUDA-graph capture but only {have} are reserved; growing would allocate inside the capture: warm up (or "
                "reserve) with this size before capturing"
            )
        size = -(-nbytes // _ALIGN) * _ALIGN
        storage = torch.zeros(size, dtype=torch.uint8, device=device)
        if reservation is None:
            reservation = self._reservations[(name, device)] = Reservation(name, device, storage)
        else:
            if reservation.captured:  # a graph replays into the old storage: keep it alive
                reservation.retired.append(reservation.storage)
                reservation.captured = False
            # otherwise the old storage goes back to the caching allocator once its views are gone
            reservation.storage = storage
        return reservation

    def _hand_over(self, reservation: Reservation, stream: torch.cuda.Stream) -> None:
        """Order ``stream`` after every other stream that used the previous handout."""
        if self._order_streams:
            capturing = torch.cuda.is_current_stream_capturing()
            for stream_id, user in reservation.users.items():
                if stream_id == stream.stream_id or (capturing and not _is_capturing(user)):
                    continue
                event = reservation.events.get(stream_id)
                if event is None:
                    event = reservation.events[stream_id] = torch.cuda.Event()
                event.record(user)
                stream.wait_event(event)
        reservation.users = {stream.stream_id: stream}


def _is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is capturing now. The legacy default stream never is (capturing
    on it is illegal), and asking about it while another stream captures is an error."""
    if stream.cuda_stream == 0:
        return False
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def _device(device) -> torch.device:
    """``device`` as a torch.device with an index on CUDA (so "cuda" and "cuda:0" are one key)."""
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device: expected a torch.device or device string, got {device!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device: {device} asked for, but CUDA is not available to this process")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _checked(name, shape, dtype, device) -> tuple[str, int, torch.device]:
    """(name, bytes a ``shape`` ``dtype`` tensor needs, device), or ValueError naming the argument."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    check_shape(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if isinstance(nbytes, int) and nbytes > _MAX_BYTES:
        raise ValueError(f"shape: {list(shape)} {dtype} is {nbytes} bytes, more than any device can hold "
                         f"(at most {_MAX_BYTES})")
    return _laned(name), nbytes, _device(device)


def check_shape(shape) -> None:
    """ValueError unless ``shape`` is a sequence of sizes, none known to be negative."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ValueError(f"shape: expected a sequence of sizes, got {shape!r}")
    for size in shape:
        if not isinstance(size, (int, torch.SymInt)) or isinstance(size, bool):
            raise ValueError(f"shape: sizes must be ints, got {size!r} in {list(shape)!r}")
        if isinstance(size, int) and size < 0:
            raise ValueError(f"shape: sizes must be >= 0, got {list(shape)!r}")
