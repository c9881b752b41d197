"""Launch one fused op's kernel a few times on benchmark-shaped inputs, for Nsight Compute.

    ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:'^_(gqa|dsv4)' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python3 bench/profile_kernels.py --case gqa-qwen3-8b-fp8 --tokens 16384

The inputs are the benchmarks' own (``make_inputs``/``random_inputs`` of the benchmark
scripts), so the profile is of the row the tables report. The first launch is the
benchmark's own gate, so a profile of a kernel that writes wrong bytes is never read.
``bench/gpu_session.sh profile`` runs it under ncu per case and T (six cases at T=16384 and two at
T=1 by default) and keeps ncu's text. The ``skeleton-*`` cases are ``bench/gqa_skeleton.py``'s
grid with the chain and the lock but no arithmetic, and ``*-contiguous-qkv`` gives qkv as a
projection GEMM does (the benchmark's is a view of a wider buffer): the op beside its own grid
doing nothing but moving bytes, on either layout.
"""

from __future__ import annotations

import argparse

import bench_gqa_qknorm_rope_kv_insert as gqa
import harness  # also puts the repository on sys.path
import torch

LAUNCHES = 3  # after the gate's launch, which ncu skips (--launch-skip 1)


def _gqa(model_name: str, tokens: int, contiguous_qkv: bool = False):
    from prepfuse.ops import GQA_QKNORM_ROPE_KV_INSERT

    model = gqa.MODELS[model_name]
    inputs = gqa.make_inputs(tokens, model, skip_fraction=0.0)
    if contiguous_qkv:  # as a projection GEMM gives it, not the benchmark's view of a wider buffer
        inputs.qkv = inputs.qkv.contiguous()

    def launch(inp):
        GQA_QKNORM_ROPE_KV_INSERT(*inp.args())

    return launch, inputs, lambda: gqa._gate(launch, inputs, model)


def _skeleton(tokens: int, contiguous_qkv: bool):
    """``bench/gqa_skeleton.py``'s skeleton with the chain and the lock (Qwen3-8B), checked
    to move the rows: the op's grid without its arithmetic, to profile beside the op."""
    import gqa_skeleton

    inputs = gqa.make_inputs(tokens, gqa.MODELS[gqa_skeleton.MODEL], skip_fraction=0.0)
    if contiguous_qkv:
        inputs.qkv = inputs.qkv.contiguous()

    def launch(inp):
        gqa_skeleton.skeleton(inp, chain=True, lock=True)

    def gate():
        launch(inputs)
        return gqa_skeleton.skeleton_moves_the_rows(inputs), "skeleton rows moved"

    return launch, inputs, gate


def _indexer(fmt: str, tokens: int):
    import bench_dsv4_indexer_rope_quant_insert as idx

    inputs = idx.make_inputs(fmt, tokens, skip_fraction=0.0)
    launch, _ = idx.make_impl("fused", fmt, inputs.weights_scale, inputs.block_size)
    return launch, inputs, lambda: idx.gate("fused", fmt, launch, inputs)


def _dsv4(heads: int, tokens: int):
    import bench_dsv4_qnorm_rope_kv_insert as dsv4
    from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
    from prepfuse.testing import rope_cos_sin_cache

    gen = torch.Generator(device=harness.DEVICE)
    gen.manual_seed(0)
    cos_sin = rope_cos_sin_cache(dsv4.MAX_POS, harness.DEVICE)
    inputs = dsv4.random_inputs(tokens, heads, dsv4.padded_heads(heads), 64, harness.DEVICE, gen, cos_sin, slots="blocks")

    def launch(inp):
        DSV4_QNORM_ROPE_KV_INSERT(*inp.args())

    return launch, inputs, lambda: dsv4._gate(launch, inputs, {})


CASES = {
    # every model row of the GQA benchmark, as gqa-<model>
    **{f"gqa-{name}": (lambda t, name=name: _gqa(name, t)) for name in gqa.MODELS},
    "gqa-qwen3-8b-contiguous-qkv": lambda t: _gqa("qwen3-8b", t, contiguous_qkv=True),
    "skeleton-qwen3-8b": lambda t: _skeleton(t, contiguous_qkv=False),
    "skeleton-qwen3-8b-contiguous-qkv": lambda t: _skeleton(t, contiguous_qkv=True),
    "indexer-fp8": lambda t: _indexer("fp8", t),
    "indexer-mxfp4": lambda t: _indexer("mxfp4", t),
    "dsv4-h16": lambda t: _dsv4(16, t),
    "dsv4-h64": lambda t: _dsv4(64, t),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    launch, inputs, gate = CASES[args.case](args.tokens)
    ok, comparison = gate()  # the reference (PyTorch kernels) and one launch of the op
    if not ok:
        print(f"{args.case} T={args.tokens}: the kernel's result is outside its bound: {comparison}")
        return 1
    for _ in range(LAUNCHES):
        launch(inputs)
    torch.cuda.synchronize()
    print(f"{args.case} T={args.tokens}: checked, {LAUNCHES} launches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
