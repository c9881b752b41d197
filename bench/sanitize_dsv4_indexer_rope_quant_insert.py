"""Run both DeepSeek-V4 indexer ops on a few small CUDA shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 bench/sanitize_dsv4_indexer_rope_quant_insert.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_dsv4_indexer_rope_quant_insert.py

Shapes cover one head and the production 64, fewer and more key rows than tokens, a slot
mapping shorter than the key rows with skipped rows, and two block sizes, each launched by
the op and again with the k programs first (``k_first``, the launcher's other grid order); the byte
comparison with the reference at the end makes a wrong result fail the run too.
"""

import torch

import prepfuse  # noqa: F401
from prepfuse.ops import (
    DSV4_INDEXER_ROPE_FP8_INSERT,
    DSV4_INDEXER_ROPE_MXFP4_INSERT,
    dsv4_indexer_rope_fp8_insert_reference,
    dsv4_indexer_rope_fp8_insert_triton,
    dsv4_indexer_rope_mxfp4_insert_reference,
    dsv4_indexer_rope_mxfp4_insert_triton,
)
from prepfuse.testing import CACHE_POISON, compare_dsv4_indexer, indexer_written_bytes, make_dsv4_indexer_inputs

OPS = {
    "fp8": (DSV4_INDEXER_ROPE_FP8_INSERT, dsv4_indexer_rope_fp8_insert_reference, dsv4_indexer_rope_fp8_insert_triton),
    "mxfp4": (DSV4_INDEXER_ROPE_MXFP4_INSERT, dsv4_indexer_rope_mxfp4_insert_reference,
              dsv4_indexer_rope_mxfp4_insert_triton),
}
SHAPES = [  # (T, H, block_size, Tk, Tk')
    (1, 1, 16, 1, 1),
    (7, 3, 16, 9, 6),
    (64, 64, 64, 16, 16),
    (33, 64, 64, 2, 1),
]


def main() -> int:
    failures = 0
    for fmt, (op, reference, triton_impl) in OPS.items():
        launches = (("op", lambda o: op(*o.args())), ("k_first", lambda o: triton_impl(*o.args(), k_first=True)))
        for num_tokens, heads, block_size, num_k, inserted in SHAPES:
            base = make_dsv4_indexer_inputs(
                fmt, num_tokens, heads, block_size, "cuda", num_k=num_k, num_inserted=inserted
            )
            ref = base.fresh_outputs()
            reference(*ref.args())
            for how, launch in launches:
                fused = base.fresh_outputs()
                launch(fused)
                torch.cuda.synchronize()
                diffs = compare_dsv4_indexer(ref, fused)
                untouched = bool((fused.k_cache[~indexer_written_bytes(fused)] == CACHE_POISON).all())
                ok = not any(diffs.values()) and untouched
                failures += not ok
                print(f"{fmt} T={num_tokens} H={heads} bs={block_size} Tk={num_k} Tk'={inserted} launch={how}: "
                      f"{'ok' if ok else (diffs, 'untouched' if untouched else 'stray writes')}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
