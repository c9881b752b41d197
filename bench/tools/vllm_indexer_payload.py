"""vLLM 0.33.0's indexer q kernels (CuTe DSL) and what they need, packed to be carried to a GPU
machine that has no package index: the other side of the indexer's parity tests and the
production column of its benchmark page (``bench/vllm_indexer.py`` loads them there).

On CUDA, vLLM's ``fused_indexer_q_rope_quant`` runs CuTe DSL kernels
(``vllm/models/deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl.py``), compiled on first use by
nvidia-cutlass-dsl, not a kernel of its op library. This tool downloads (pip, no dependencies)
the vllm wheel and the pinned packages those kernels import (nvidia-cutlass-dsl 4.8.0 with its
CUDA 13 libraries, quack-kernels 0.6.5, apache-tvm-ffi), keeps the handful of vLLM source files
the kernels import, and writes them as xz tar parts under ``OUT_DIR`` (default ``.vllm/cutedsl``)::

    python3 bench/tools/vllm_indexer_payload.py [OUT_DIR] [--python 3.12]

The CuTe DSL compiler library alone is about 52 MB compressed, so the payload is two parts of
at most ``PART_LIMIT`` bytes each: a GPU call carries one part at a time (a call carries 64 MiB
at most), and ``bench/vllm_indexer.py`` unpacks each part once into ``OUT_DIR/site``, which
stays on the machine between calls while it is held. Never commit the parts.
"""

from __future__ import annotations

import argparse
import io
import lzma
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
PACKAGES = (  # pip name==version: the versions vLLM 0.33.0 pins, where it pins one
    f"vllm=={VLLM_VERSION}",
    "nvidia-cutlass-dsl==4.8.0",
    "nvidia-cutlass-dsl-libs-base==4.8.0",
    "nvidia-cutlass-dsl-libs-core==4.8.0",
    "nvidia-cutlass-dsl-libs-cu13==4.8.0",
    "quack-kernels==0.6.5",
    "apache-tvm-ffi==0.1.15.post2",
)
# the vLLM sources the indexer kernels import (vllm/__init__.py is not among them: the loader
# makes the packages on the way without running it)
VLLM_SOURCES = (
    "vllm/models/deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl.py",
    "vllm/cute_utils/",
    "vllm/model_executor/warmup/",
    "vllm/vllm_flash_attn/cute/",
)
PART_LIMIT = 60 << 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")


def download(dest: Path, python: str) -> list[Path]:
    """The wheels of ``PACKAGES`` for CPython ``python`` on x86-64 Linux."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", str(dest), *[a for p in PLATFORMS for a in ("--platform", p)], *PACKAGES]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def members(wheel: Path) -> list[tuple[str, bytes]]:
    """(path in the site folder, bytes) of what ``wheel`` installs; of vllm, ``VLLM_SOURCES`` only."""
    keep_all = not wheel.name.startswith("vllm-")
    out = []
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith("/") or ".dist-info/" in name:
                continue
            if keep_all or (name.endswith(".py") and any(name.startswith(s) for s in VLLM_SOURCES)):
                out.append((name, zf.read(name)))
    return out


def pack(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".so") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue(), preset=6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", default=str(Path(__file__).resolve().parents[2] / ".vllm" / "cutedsl"))
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (its wheels' tag)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = [m for wheel in download(Path(tmp), args.python) for m in members(wheel)]
    # the largest file (the compiler library) alone in the first part, the rest in the second
    files.sort(key=lambda m: len(m[1]), reverse=True)
    parts = [files[:1], files[1:]]
    for i, part in enumerate(parts, start=1):
        data = pack(part)
        if len(data) > PART_LIMIT:
            raise SystemExit(f"part {i} is {len(data) >> 20} MiB, over {PART_LIMIT >> 20} MiB")
        path = out / f"part{i}.tar.xz"
        path.write_bytes(data)
        print(f"{path}: {len(part)} files, {len(data) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
