"""Run the fused op on a few small CUDA shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 bench/sanitize_dsv4_qnorm_rope_kv_insert.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_dsv4_qnorm_rope_kv_insert.py

Shapes cover padded heads, a slot mapping shorter than T with skipped rows, each block
size, int32 slots and positions, negative ones counted from the end (``wrap_indices``), and
DeepSeek-V4.1's flags (no q norm, MXFP8 records);
the check at the end makes a wrong result fail the run too.
"""

import dataclasses

import torch

import prepfuse  # noqa: F401
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT, dsv4_qnorm_rope_kv_insert_reference
from prepfuse.testing import compare_dsv4, make_dsv4_inputs, with_wrapped_indices

SHAPES = [  # (T, H, HP, block_size, T'[, form])
    (1, 1, 8, 16, 1),
    (7, 3, 8, 16, 4),
    (64, 16, 64, 64, 64),
    (33, 128, 128, 256, 30),
    (9, 3, 8, 16, 9, "int32"),
    (33, 16, 64, 64, 33, "wrap+int32"),
    (7, 3, 8, 32, 5, "v41"),
    (129, 16, 64, 32, 120, "v41+wrap"),
]


def main() -> int:
    failures = 0
    for num_tokens, heads, padded, block_size, inserted, *form in SHAPES:
        form = form[0] if form else ""
        v41 = "v41" in form
        base = make_dsv4_inputs(num_tokens, heads, padded, block_size, "cuda", num_inserted=inserted,
                                skip_fraction=0.0 if "wrap" in form else 0.1, apply_q_norm=not v41, kv_mxfp8=v41)
        if "wrap" in form:  # every other row addressed from the end: the same rows, through the wrap
            base = with_wrapped_indices(base, base.k_cache.shape[0] * block_size)
        if "int32" in form:
            base = dataclasses.replace(base, slot_mapping=base.slot_mapping.int(), positions=base.positions.int())
        fused, ref = base.fresh_outputs(), base.fresh_outputs()
        DSV4_QNORM_ROPE_KV_INSERT(*fused.args())
        dsv4_qnorm_rope_kv_insert_reference(*ref.args())
        torch.cuda.synchronize()
        cmp = compare_dsv4(ref, fused)
        ok = cmp.within_spec() and bool((fused.q_out[:, heads:] == 0).all())
        failures += not ok
        print(f"T={num_tokens} H={heads} HP={padded} bs={block_size} T'={inserted} {form}: {'ok' if ok else cmp}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
