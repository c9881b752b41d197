"""Compile one op's Triton kernel for sm_90 on a machine without a GPU, and count what it does.

    python bench/kernel_sass.py gqa-qwen3-8b 16384 [--launch-config 16,2] [--dedupe lock] [--kv-first] [--out DIR]

The case names and inputs are ``bench/profile_kernels.py``'s (the benchmarks' own, made on
the CPU), so the kernel compiled here is the one the benchmark times, with the same
specialisations (which int arguments triton marks divisible by 16, which constexprs).
Triton's CUDA driver is replaced by a stand-in that names an sm_90 target, and each launch
becomes a compile-only ``warmup``; ``ptxas`` and ``nvdisasm`` ship with triton. The TTGIR,
PTX, cubin and SASS go to ``--out``; the summary lists registers, shared memory, layout
conversions (shared-memory round trips), the global/shared load and store instructions by
width, and the int arguments triton could not mark divisible by 16.

This is how the GQA kernel's scalar row loads were found (``docs/ops.md``): ``LDG.E.U16``,
32 a thread, because the benchmark's token stride was no multiple of 16 elements. It
complements, never replaces, ncu on the GPU (``gpu_session.sh profile``): it shows what the
kernel asks for, not how long it waits. Use the triton the GPU machine has (a wheel of that
version on ``PYTHONPATH``): layouts differ between versions.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import harness  # puts the repository on sys.path

harness.DEVICE = "cpu"


def _compile_only() -> list:
    """Make every Triton launch compile for sm_90 and return; the compiled kernels land in
    the returned list as ``(name, CompiledKernel)``."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, jit

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Sm90())
    compiled = []
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only
    return compiled


def _kernels() -> dict:
    import bench_dsv4_indexer_rope_quant_insert as indexer_bench
    from prepfuse.ops.dsv4_indexer_rope_fp8_insert import dsv4_indexer_rope_fp8_insert_triton
    from prepfuse.ops.dsv4_indexer_rope_mxfp4_insert import dsv4_indexer_rope_mxfp4_insert_triton
    from prepfuse.ops.dsv4_qnorm_rope_kv_insert import dsv4_qnorm_rope_kv_insert_triton
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import gqa_qknorm_rope_kv_insert_triton

    indexer_bench.DEVICE = "cpu"
    return {"gqa": gqa_qknorm_rope_kv_insert_triton, "dsv4": dsv4_qnorm_rope_kv_insert_triton,
            "indexer-fp8": dsv4_indexer_rope_fp8_insert_triton, "indexer-mxfp4": dsv4_indexer_rope_mxfp4_insert_triton}


def summary(kernel, stem: Path) -> str:
    import triton

    def named(suffix: str) -> Path:
        # not Path.with_suffix: a case name with a dot (gqa-llama3.2-1b) would lose its tail
        return stem.parent / f"{stem.name}.{suffix}"

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for key, text in kernel.asm.items():
        named(key).write_bytes(text if isinstance(text, bytes) else text.encode())
    cubin = str(named("cubin"))
    sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    named("sass").write_text(sass)
    usage = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    ops = collections.Counter(m.group(1) for m in re.finditer(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)", sass, re.M))
    memory = {k: v for k, v in sorted(ops.items()) if k.startswith(("LDG", "STG", "LDS", "STS", "BAR", "MUFU"))}
    ttgir = kernel.asm["ttgir"]
    return "\n".join([
        f"registers {regs.group(1) if regs else '?'}, shared {kernel.metadata.shared} B, "
        f"warps {kernel.metadata.num_warps}, SASS instructions {sum(ops.values())}",
        f"layout conversions (TTGIR convert_layout) {ttgir.count('ttg.convert_layout')}",
        "memory and special instructions: " + ", ".join(f"{k} {v}" for k, v in memory.items()),
        "int arguments not marked divisible by 16: " + (", ".join(re.findall(r"%(\w+): i32 loc", ttgir)) or "none"),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", help="a bench/profile_kernels.py case, e.g. gqa-qwen3-8b, indexer-mxfp4, dsv4-h16")
    p.add_argument("tokens", type=int)
    p.add_argument("--launch-config", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--dedupe", choices=["off", "scan", "lock"], default=None)
    p.add_argument("--kv-first", action="store_true",
                   help="the cache-insert programs first: GQA kv_first, indexer k_first")
    p.add_argument("--out", type=Path, default=Path("/tmp/prepfuse_sass"))
    args = p.parse_args(argv)
    compiled = _compile_only()
    import profile_kernels

    kernel_fn = next(f for prefix, f in _kernels().items() if args.case.startswith(prefix))
    _, inputs, _ = profile_kernels.CASES[args.case](args.tokens)
    options = {k: v for k, v in (("launch_config", args.launch_config), ("dedupe", args.dedupe),
                                 ("k_first" if args.case.startswith("indexer") else "kv_first",
                                  args.kv_first or None)) if v is not None}
    kernel_fn(*inputs.args(), **options)
    if not compiled:
        print("no Triton kernel was launched", file=sys.stderr)
        return 1
    name, kernel = compiled[-1]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.case}_T{args.tokens}"
    print(f"{args.case} T={args.tokens}: {name} -> {stem}.*")
    print(summary(kernel, stem))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
