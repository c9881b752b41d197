"""The README's main command: run every available implementation of each fused op
(DeepSeek-V4 and GQA) beside its plain-PyTorch reference on seeded random data; then compile
the example models (DeepSeek-V4-style, Qwen3-style, Llama-style, and the DeepSeek-V4 indexer
preparation) with ``backend="prepfuse"`` and check each against eager. One line per check:
calls fused of calls expected, the numbers against their bounds, ok or FAIL, and on a GPU
the time (beside the unfused code, or beside ``torch.compile``'s default backend).
``--verbose`` adds each section's tables: the implementations' comparison, and per model
the passes' report (what was fused, and where).

Run as ``python -m prepfuse.demo`` (``scripts/demo.sh`` sets up the environment first).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None,
                        help="T of the op comparison (default: 7 on CPU, 4096 on GPU)")
    parser.add_argument("--heads", type=int, default=None,
                        help="H of the DeepSeek-V4 op comparison (default: 3 on CPU, 64 on GPU)")
    parser.add_argument("--block-size", type=int, default=64, help="cache block size of the op comparison")
    parser.add_argument("--layers", type=int, default=3, help="layers of each example model")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random input")
    parser.add_argument("--verbose", action="store_true", help="each section's tables and the passes' reports")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    from prepfuse._compat import has_triton, triton_interpret_mode

    if not on_gpu and has_triton() and not triton_interpret_mode():
        # No GPU: the triton kernel can still run, under triton's CPU interpreter, which
        # must be chosen before prepfuse (already imported with this package) decorates
        # its kernels; so start again with it switched on.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "prepfuse.demo", *(argv if argv is not None else sys.argv[1:])])
    from prepfuse.demo.dsv4 import run_dsv4_block, run_dsv4_op
    from prepfuse.demo.dsv4_indexer import run_dsv4_indexer
    from prepfuse.demo.gqa import run_gqa_models, run_gqa_op

    torch.manual_seed(args.seed)  # anything not drawn from the sections' own generators
    device = torch.device("cuda" if on_gpu else "cpu")
    tokens = args.tokens or (4096 if on_gpu else 7)
    heads = args.heads or (64 if on_gpu else 3)
    common = {"seed": args.seed, "verbose": args.verbose}
    print(f"prepfuse demo: torch {torch.__version__}, device {device}, triton {'yes' if has_triton() else 'no'}, "
          f"seed {args.seed}")
    print("timings: CUDA-graph replay median of one call (bench/ has the full method)" if on_gpu else
          "timings: skipped, no GPU (on a CUDA device each line also gives its time)")

    # each section: its title, then what draws its rows (a row is printed as soon as it is made)
    sections = [
        (f"fused ops beside their reference, T={tokens}{'' if on_gpu else ', triton under its CPU interpreter'} "
         f"(the bounds: docs/ops.md)", [
            lambda: run_dsv4_op(device, tokens, heads, args.block_size, **common),
            lambda: run_gqa_op(device, tokens, args.block_size, **common),
        ]),
        (f"example models, {args.layers} layers each, compiled with backend=\"prepfuse\" beside eager "
         f"(err: max |diff| / max |eager|)", [
            lambda: [run_dsv4_block(device, args.layers, **common)],
            lambda: run_gqa_models(device, args.layers, **common),
            lambda: [run_dsv4_indexer(device, args.layers, **common)],
        ]),
    ]
    failed = []
    for title, parts in sections:
        print(title)
        for part in parts:
            for row in part():
                print(row.format(), flush=True)
                if not row.ok:
                    failed.append(row.name)
    print("demo: all checks ok" if not failed else f"demo: FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
