"""Run the full-row op on a few small CUDA shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 bench/sanitize_dsv4_qnorm_rope_kv_full_row_insert.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_dsv4_qnorm_rope_kv_full_row_insert.py

Shapes cover both of vLLM's formats and a mixed one, unpadded and padded q, a slot mapping
shorter than T with skipped rows, each block size, cache blocks that are not adjacent, int32
slots and positions, and negative ones counted from the end (``wrap_indices``); the check at
the end makes a wrong result fail the run too.
"""

import dataclasses

import torch

import prepfuse  # noqa: F401
from prepfuse.ops import DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, dsv4_qnorm_rope_kv_full_row_insert_reference
from prepfuse.testing import compare_dsv4_full_row, make_dsv4_full_row_inputs, with_wrapped_indices

SHAPES = [  # (format, T, H, HP, block_size, T'[, form])
    ("bf16", 1, 1, 1, 16, 1),
    ("fp8", 7, 3, 8, 16, 4),
    ("bf16", 64, 16, 64, 64, 64, "padded-blocks"),
    ("fp8", 33, 128, 128, 256, 30),
    ("bf16-q-fp8-cache", 9, 3, 3, 16, 9, "int32"),
    ("fp8", 33, 16, 64, 64, 33, "wrap+int32"),
]


def main() -> int:
    failures = 0
    for fmt, num_tokens, heads, padded, block_size, inserted, *form in SHAPES:
        form = form[0] if form else ""
        base = make_dsv4_full_row_inputs(num_tokens, heads, padded, block_size, "cuda", fmt=fmt, num_inserted=inserted,
                                         skip_fraction=0.0 if "wrap" in form else 0.1,
                                         block_padding=40 if "padded-blocks" in form else 0)
        if "wrap" in form:  # every other row addressed from the end: the same rows, through the wrap
            base = with_wrapped_indices(base, base.k_cache.shape[0] * block_size)
        if "int32" in form:
            base = dataclasses.replace(base, slot_mapping=base.slot_mapping.int(), positions=base.positions.int())
        fused, ref = base.fresh_outputs(), base.fresh_outputs()
        DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT(*fused.args())
        dsv4_qnorm_rope_kv_full_row_insert_reference(*ref.args())
        torch.cuda.synchronize()
        cmp = compare_dsv4_full_row(ref, fused)
        ok = cmp.within_spec() and bool((fused.q_out[:, heads:].view(torch.uint8) == 0).all())
        failures += not ok
        print(f"{fmt} T={num_tokens} H={heads} HP={padded} bs={block_size} T'={inserted} {form}: "
              f"{'ok' if ok else cmp}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
