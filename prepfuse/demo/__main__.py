"""The README's main command: run every available implementation of each fused op on
seeded random data and print how they compare (and, on a GPU, how fast they are); then
compile the example models (DeepSeek-V4-style, Qwen3-style, Llama-style, and the
DeepSeek-V4 indexer preparation) with
``backend="prepfuse"``, show what was fused and where, and check each against eager
(timed beside ``torch.compile``'s default on a GPU).

Run as ``python -m prepfuse.demo`` (``scripts/demo.sh`` sets up the environment first).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=None, help="T (default: 7 on CPU, 4096 on GPU)")
    parser.add_argument("--heads", type=int, default=None, help="H (default: 3 on CPU, 64 on GPU)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seed of every random input")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    from prepfuse._compat import has_triton, triton_interpret_mode

    if not on_gpu and has_triton() and not triton_interpret_mode():
        # No GPU: the triton kernel can still run, under triton's CPU interpreter, which
        # must be chosen before prepfuse (already imported with this package) decorates
        # its kernels; so start again with it switched on.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "prepfuse.demo", *(argv if argv is not None else sys.argv[1:])])
    from prepfuse.demo.dsv4 import run_dsv4_block_demo, run_dsv4_demo
    from prepfuse.demo.dsv4_indexer import run_indexer_demo
    from prepfuse.demo.gqa import run_gqa_models_demo

    torch.manual_seed(args.seed)  # anything not drawn from the sections' own generators
    device = torch.device("cuda" if on_gpu else "cpu")
    print(f"prepfuse demo: torch {torch.__version__}, device {device}, triton {'yes' if has_triton() else 'no'}, "
          f"seed {args.seed}")
    tokens = args.tokens or (4096 if on_gpu else 7)
    heads = args.heads or (64 if on_gpu else 3)
    ok = run_dsv4_demo(device, tokens, heads, args.block_size, seed=args.seed)
    ok &= run_dsv4_block_demo(device, seed=args.seed)
    ok &= run_gqa_models_demo(device, seed=args.seed)
    ok &= run_indexer_demo(device, seed=args.seed)
    print("\ndemo:", "all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
