"""A cache slot that two tokens name holds one token's whole row, never a mix: how the kernels
make sure of it.

With the index checks on, ``slot_mapping: slot S is given to tokens i and j`` stops such a call
before anything is written (``_checks``). Under CUDA-graph capture, and with
``PREPFUSE_CHECK_INDEX_VALUES=0``, nothing reads the values, and two programs writing one slot at
once would leave the data bytes of one token beside the scale bytes of another (DeepSeek-V4, the
indexer), or k of one beside v of another (GQA). So a launch that inserts more than one row
deduplicates, in one of two ways (``dedupe_mode``):

- ``SCAN`` (up to ``SCAN_MAX`` inserted rows): every program that writes a row first reads the
  whole ``slot_mapping`` (one vector load beside the row's own loads) and stores only if no later
  row names its slot. The last token writes the slot, as the reference does, and each of a row's
  programs (GQA: k and v, every head block) decides alike; no atomics.
- ``LOCK`` (more rows, where a scan per program would read ``T'^2`` slots): one program writes all
  of a row's bytes (GQA: k and v of every kv head, ``KV_BLOCK`` heads a step) between taking its
  slot's lock and releasing it, so the slot holds the row of whichever writer took it last (any
  one on the GPU; the last under the CPU interpreter, which runs programs in order).

The locks are one int32 table per device, ``N_ROW_LOCKS`` words (256 KiB); slot ``s`` uses word
``s % N_ROW_LOCKS``, so two slots sharing a word only wait for each other, and a run of up to 65536
consecutive slots (a prefill chunk) shares none. Every lock is released by the program that took
it, so the table is all zeros between launches and never reset. The first launch on a device
makes it (an engine's profiling run, so KV sizing counts it); a launch inside a CUDA-graph capture
must find it there (warm up first, as the scratch arena needs too). A launch inserting one row
does neither. Why a scan below the threshold, what the locks cost, and the lock-free claim that
was no faster: docs/decisions.md (Duplicated slots).
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
