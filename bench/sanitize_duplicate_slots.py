"""Every op's kernel on a contended call (1024 tokens, runs of 96 sharing three slots), with
the scan and with the row locks (``prepfuse/ops/_duplicate_slots.py``), for compute-sanitizer:

    compute-sanitizer --tool memcheck  python3 bench/sanitize_duplicate_slots.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_duplicate_slots.py [gqa,gqa-fp8]

(an optional comma-separated list of ops limits it to those: a changed kernel's).

A lock left taken fails the run too. (Whether the rows are whole is the GPU test's and
``bench/duplicate_slots.py``'s question: checking it here relaunches every op some 300
times, for minutes under racecheck.)
"""

import sys

import torch

from prepfuse.ops import _duplicate_slots
from prepfuse.testing.duplicate_slots import CONTENDED_OPS, call_on_fresh_outputs, contended_inputs
from prepfuse.testing.impls import implementations


def main() -> int:
    failures = 0
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else CONTENDED_OPS
    for op in ops:
        kernel = implementations(op)[1]
        for dedupe in ("scan", "lock"):
            inputs, slots = contended_inputs(op, "cuda")
            call_on_fresh_outputs(lambda *args: kernel(*args, dedupe=dedupe), inputs, slot_mapping=slots)
            torch.cuda.synchronize()
            held = int(_duplicate_slots.row_locks(inputs.k_cache.device).count_nonzero())
            failures += held > 0
            print(f"{op} {dedupe}: 1024 tokens, 3 slots shared by 96 each: locks still held {held}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
