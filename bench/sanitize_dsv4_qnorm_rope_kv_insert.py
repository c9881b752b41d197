"""Run the fused op on a few small CUDA shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 bench/sanitize_dsv4_qnorm_rope_kv_insert.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_dsv4_qnorm_rope_kv_insert.py

Shapes cover padded heads, a slot mapping shorter than T with skipped rows, and each
block size; the check at the end makes a wrong result fail the run too.
"""

import torch

import prepfuse  # noqa: F401
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT, dsv4_qnorm_rope_kv_insert_reference
from prepfuse.testing import compare_dsv4, make_dsv4_inputs

SHAPES = [  # (T, H, HP, block_size, T')
    (1, 1, 8, 16, 1),
    (7, 3, 8, 16, 4),
    (64, 16, 64, 64, 64),
    (33, 128, 128, 256, 30),
]


def main() -> int:
    failures = 0
    for num_tokens, heads, padded, block_size, inserted in SHAPES:
        base = make_dsv4_inputs(num_tokens, heads, padded, block_size, "cuda", num_inserted=inserted)
        fused, ref = base.fresh_outputs(), base.fresh_outputs()
        DSV4_QNORM_ROPE_KV_INSERT(*fused.args())
        dsv4_qnorm_rope_kv_insert_reference(*ref.args())
        torch.cuda.synchronize()
        cmp = compare_dsv4(ref, fused)
        ok = cmp.within_spec() and bool((fused.q_out[:, heads:] == 0).all())
        failures += not ok
        print(f"T={num_tokens} H={heads} HP={padded} bs={block_size} T'={inserted}: {'ok' if ok else cmp}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
