"""A cache slot that two tokens name holds one token's whole row, never a mix: how the kernels
make sure of it, and what it costs.

With the index checks on, ``slot_mapping: slot S is given to tokens i and j`` stops such a
call before anything is written (``_checks``). Under CUDA-graph capture, and with
``PREPFUSE_CHECK_INDEX_VALUES=0``, nothing reads the values, and the kernels write each
inserted row from its own programs: two programs writing one slot at once left the data
bytes of one token beside the scale bytes of the other (DeepSeek-V4, the indexer), or k of
one token beside v of the other (GQA); ``bench/duplicate_slots.py`` counted 5 to 30 of 30
contended slots torn on the H200. So a launch that inserts more than one row deduplicates,
in one of two ways (``dedupe_mode``):

- ``SCAN`` (up to ``SCAN_MAX`` inserted rows): every program that writes a row first
  reads the whole ``slot_mapping`` (one vector load, issued beside the row's own loads)
  and stores only if no later row names its slot. The last token writes the slot, as the
  reference does, and each of a row's programs (GQA: k and v, every head block) decides
  alike, so none mixes; no atomics, nothing on the critical path but a compare.
- ``LOCK`` (more rows, where a scan per program would read ``T'^2`` slots): the row is
  written under its slot's lock: one program writes all of its bytes (GQA: k and v of
  every kv head, ``KV_BLOCK`` heads a step) between taking the lock and releasing it, so
  the slot holds the row of whichever writer took it last (any one of them on the GPU; the
  CPU interpreter runs programs in order: the last).

What the locks cost (H200 A/B, 2026-12-03): about 1% of the DSV4 and indexer
ops at T=4096 and 16384, whose locked rows are a few hundred bytes
(``docs/benchmarks_duplicate_slots.md``), but 3-6% of the GQA op, whose locked program writes
8 KB of k and v before it may release: the same launch without the lock (unsafe; a
measurement) ran Qwen3-8B T=4096 29.7 -> 28.5 us and T=16384 106.9 -> 103.5. A release
without its fence gave back about half, an unlock without the acquire nothing. A scheme
without a release was built and timed (H200, 2026-12-03) and was no faster:
the first program to claim a slot (a compare-and-swap into a hash table of exact slot keys,
one table per stream and scratch lane, an epoch per launch from one atomic add that the
launch's programs together make exactly 2^24) writes it, the others skip it; Qwen3-8B
T=4096 29.64 us against the locks' 29.67, T=16384 105.79 against 105.93, fp8 100.02
against 99.96, where the lock taken out gave 28.41 and 102.92 (fp8 96.70). Whatever
decides who writes (a claim or a lock) is an atomic that can be issued only once the slot
has arrived, and the stores wait for its answer. The lock then waits once more, at the fence; the
claim, before its compare-and-swap, for the epoch that the swap's key holds. An epoch
that costs no round trip (PTX's ``%gridid`` is unique per launch, but 64 bits that a
64-bit word cannot hold beside a slot key) might give back what a fence-free release did,
about half; hiding the rest needs a program that works on several tokens (the next
token's loads and atomic in flight while this one stores), not another protocol.

The locks are one int32 table per device, ``N_ROW_LOCKS`` words (256 KiB); slot ``s`` uses
word ``s % N_ROW_LOCKS``, so two slots sharing a word only wait for each other, and a run of
up to 65536 consecutive slots (a prefill chunk) shares none. Every lock is released by the
program that took it, so the table is all zeros between launches and never reset. The
first launch on a device makes it (an engine's profiling run, so KV sizing counts it); a
launch inside a CUDA-graph capture must find it there, as a capture cannot allocate it
(warm up first, as the scratch arena needs too). A launch inserting one row (decode of one
sequence) does neither: one row cannot meet another.
"""

from __future__ import annotations

import torch

__all__ = ["DEDUPE_OFF", "DEDUPE_SCAN", "DEDUPE_LOCK", "SCAN_MAX", "N_ROW_LOCKS", "dedupe_mode", "scan_block",
           "row_locks"]

# the kernels' DEDUPE constexpr
DEDUPE_OFF, DEDUPE_SCAN, DEDUPE_LOCK = 0, 1, 2
_MODES = {"off": DEDUPE_OFF, "scan": DEDUPE_SCAN, "lock": DEDUPE_LOCK}
SCAN_MAX = 1024  # most inserted rows a scan reads (bench/duplicate_slots.py: scan against lock)
N_ROW_LOCKS = 1 << 16
_TABLES: dict[torch.device, torch.Tensor] = {}


def dedupe_mode(slot_mapping: torch.Tensor, override: str | None = None) -> int:
    """How a launch keeps a duplicated slot whole: off for one inserted row, a scan up to
    ``SCAN_MAX``, the row locks beyond. ``override`` ("off", "scan", "lock") forces one (the
    benchmark measures each, a GPU test what a launch without either does)."""
    if override is not None:
        if override not in _MODES:
            raise ValueError(f"dedupe: expected one of {sorted(_MODES)}, got {override!r}")
        return _MODES[override]
    rows = slot_mapping.shape[0]
    return DEDUPE_OFF if rows <= 1 else DEDUPE_SCAN if rows <= SCAN_MAX else DEDUPE_LOCK


def scan_block(slot_mapping: torch.Tensor) -> int:
    """The scan's vector width: ``T'`` rounded up to a power of two, at least 16 (a constexpr:
    one compiled variant per power of two)."""
    rows = slot_mapping.shape[0]
    return max(16, 1 << max(rows - 1, 0).bit_length())


def row_locks(device: torch.device) -> torch.Tensor:
    """The device's lock table, ``[N_ROW_LOCKS]`` int32 zeros, made by its first caller."""
    table = _TABLES.get(device)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"prepfuse: the row-lock table of {device} is made by the first fused-op call outside "
                "a CUDA-graph capture, and this capture is the first call: run the model (or the op) "
                "once before capturing (a warm-up; the scratch arena needs one too)"
            )
        table = _TABLES.setdefault(device, torch.zeros(N_ROW_LOCKS, dtype=torch.int32, device=device))
    return table
