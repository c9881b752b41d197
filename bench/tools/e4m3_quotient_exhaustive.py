"""Exhaustive check of the claim behind ``_e4m3_quotient`` (prepfuse/ops/_triton_helpers.py):
for every bf16 significand x and every fp32 significand s,

    r = RN(1/s), q0 = RN(x * r), q1 = RN(q0 + RN(x - s * q0) * r)  ==  RN(x / s)

with fp32 FMAs emulated exactly (``tests/ops/test_triton_helpers.fma32``). Significands
suffice: without under- or overflow (the helper's window) every step scales exactly with
powers of two of x and s, and both signs round alike. 128 x significands by 2^23 s ones,
on the CPU in float64, a few minutes; writes its verdict to stdout (and the result file
given as the first argument). Run: ``.venv/bin/python bench/tools/e4m3_quotient_exhaustive.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "ops"))
from test_triton_helpers import fma32  # noqa: E402


def main() -> int:
    s = (torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)  # [1, 2)
    r = 1.0 / s
    start, bad, product_off = time.time(), 0, 0
    for m in range(128):
        x = torch.full_like(s, torch.tensor((127 << 23) | (m << 16), dtype=torch.int32).view(torch.float32).item())
        want = x / s
        q0 = x * r
        q1 = fma32(fma32(-q0, s, x), r, q0)
        bad += int((q1 != want).sum())
        product_off += int((q0 != want).sum())
    lines = [
        f"x significands: 128 (every bf16), s significands: {s.numel()} (every fp32): {128 * s.numel()} pairs",
        f"RN(x * RN(1/s)) != RN(x/s): {product_off} pairs",
        f"one FMA correction step != RN(x/s): {bad} pairs",
        f"{time.time() - start:.0f} s, torch {torch.__version__}",
    ]
    print("\n".join(lines))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
