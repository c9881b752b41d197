"""vLLM 0.33.0's indexer q kernels, run the way vLLM runs them on CUDA: the production column of
the indexer's benchmark page and the other side of its parity tests.

vLLM's ``fused_indexer_q_rope_quant`` (``vllm/models/deepseek_v4/common/ops/fused_indexer_q.py``)
runs CuTe DSL kernels on CUDA wherever nvidia-cutlass-dsl imports (``has_cutedsl()``): RoPE on
the last 64 dims of each 128-dim head, quantisation to fp8 (a power-of-two scale per token and
head, folded into the weights) or MXFP4 (packed e2m1 and UE8M0 bytes per 32 values), and the
scaled weights. They are Python source compiled on first use, not a kernel of vLLM's op
library, so they come from the payload ``bench/tools/vllm_indexer_payload.py`` writes into the
git-ignored ``.vllm/cutedsl/`` (or ``$PREPFUSE_VLLM_INDEXER_DIR``): its parts are unpacked once
into ``site/`` beside them, and the kernel module is imported from there with the vllm packages
on its way made empty (vllm's ``__init__`` and the rest of vLLM are not needed).

vLLM 0.33 serves the MXFP4 indexer on Blackwell only (``dsa_indexer_uses_fp4`` refuses it below
sm_100, and its kernel converts with ``cvt.e2m1x2.f32``, which sm_90's assembler rejects), so
on an earlier GPU there is only the fp8 kernel (``formats()``).

``load()`` gives the kernels or None, ``absent_reason()`` says why not. The callables write
caller-owned outputs, as vLLM's wrapper writes the ones it allocates, so that a CUDA graph of
a call holds vLLM's kernel and nothing else. vLLM's kernel has no key side: prepfuse's op is
timed beside it on the q side alone (no key rows).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
import tarfile
import types
from pathlib import Path

import torch

DIR_ENV = "PREPFUSE_VLLM_INDEXER_DIR"
PAYLOAD_DIR = Path(__file__).resolve().parents[1] / ".vllm" / "cutedsl"
VLLM_VERSION = "0.33.0"
MXFP4_CAPABILITY = (10, 0)  # vLLM's MXFP4 indexer: sm_10x only
KERNEL_MODULE = "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl"


def payload_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or PAYLOAD_DIR)


def unpack(directory: Path | None = None) -> Path | None:
    """Unpack every ``part*.tar.xz`` of the payload into ``site/`` once (a marker per part);
    the site folder, or None where no part was ever unpacked there."""
    directory = directory or payload_dir()
    site = directory / "site"
    for part in sorted(directory.glob("part*.tar.xz")):
        marker = site / f".{part.name}.unpacked"
        if marker.is_file() and marker.stat().st_mtime >= part.stat().st_mtime:
            continue
        site.mkdir(parents=True, exist_ok=True)
        with tarfile.open(part) as tar:
            tar.extractall(site, filter="data")
        marker.touch()
    return site if site.is_dir() and any(site.glob(".part*.unpacked")) else None


def _empty_packages(site: Path, module: str) -> None:
    """Make each package above ``module`` an empty module over its folder in ``site``, so that
    importing ``module`` runs none of their ``__init__`` files."""
    parts = module.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(site.joinpath(*parts[:i]))]
        sys.modules[name] = pkg
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], pkg)


@dataclasses.dataclass
class VllmIndexer:
    """vLLM's two indexer q kernels (``IndexerQMxFp4Kernel``, ``IndexerQFp8Kernel`` objects)."""

    site: Path
    mxfp4_kernel: object
    fp8_kernel: object

    @staticmethod
    def formats() -> tuple[str, ...]:
        """The formats vLLM serves on this GPU."""
        major, _ = torch.cuda.get_device_capability()
        return ("fp8", "mxfp4") if major == MXFP4_CAPABILITY[0] else ("fp8",)

    @staticmethod
    def missing_reason(fmt: str) -> str:
        """Why vLLM has no kernel of ``fmt`` on this GPU ("" where it has one)."""
        if fmt in VllmIndexer.formats():
            return ""
        major, minor = torch.cuda.get_device_capability()
        return (f"vLLM 0.33 serves the MXFP4 indexer on sm_10x only (this GPU is sm_{major}{minor}: "
                "dsa_indexer_uses_fp4 refuses it, and its kernel's cvt.e2m1x2.f32 does not assemble here)")

    def mxfp4(self, q, weights, positions, cos_sin_cache, weights_scale, q_packed, q_scale, weights_out) -> None:
        """The MXFP4 branch of ``fused_indexer_q_rope_quant``: ``q_packed`` [T, H, 64] and
        ``q_scale`` [T, H, 4] uint8, ``weights_out`` [T, H] fp32 written. vLLM passes the
        softmax and head scales apart and the kernel multiplies them once; ``weights_scale`` is
        that product."""
        self.mxfp4_kernel(positions=positions, q=q, cos_sin_cache=cos_sin_cache, weights=weights,
                          weights_softmax_scale=weights_scale, weights_head_scale=1.0,
                          q_packed=q_packed, q_scale=q_scale, weights_out=weights_out)

    def fp8(self, q, weights, positions, cos_sin_cache, weights_scale, q_fp8, weights_out) -> None:
        """The fp8 branch: ``q_fp8`` [T, H, 128] e4m3fn codes, ``weights_out`` = weights x the
        token-head scale x ``weights_scale``."""
        self.fp8_kernel(positions=positions, q=q, cos_sin_cache=cos_sin_cache, weights=weights,
                        weights_softmax_scale=weights_scale, weights_head_scale=1.0,
                        q_fp8=q_fp8.view(torch.uint8), weights_out=weights_out)


@functools.lru_cache(maxsize=1)
def _state() -> tuple[VllmIndexer | None, str]:
    """(the kernels, "") or (None, why not); computed once a process."""
    if not torch.cuda.is_available():
        return None, "vLLM's indexer kernels need a CUDA device"
    directory = payload_dir()
    try:
        site = unpack(directory)
    except (OSError, tarfile.TarError) as err:
        return None, f"vLLM's indexer payload did not unpack ({directory}): {type(err).__name__}: {err}"
    if site is None:
        return None, (f"vLLM's indexer payload is absent ({directory}/part*.tar.xz; "
                      "bench/tools/vllm_indexer_payload.py makes it)")
    for path in (site, site / "nvidia_cutlass_dsl" / "dsl_packages"):  # the second: the wheel's .pth
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    try:
        _empty_packages(site, KERNEL_MODULE)
        module = importlib.import_module(KERNEL_MODULE)
    except Exception as err:  # noqa: BLE001 - any import failure makes the column absent, with why
        return None, f"vLLM's indexer kernels did not import from {site}: {type(err).__name__}: {err}"
    return VllmIndexer(site, module._INDEXER_Q_MXFP4_KERNEL, module._INDEXER_Q_FP8_KERNEL), ""


def load() -> VllmIndexer | None:
    """vLLM's indexer kernels, or None where they cannot run here (``absent_reason`` says why)."""
    return _state()[0]


def absent_reason() -> str:
    """Why ``load()`` is None; "" when the kernels are loaded."""
    return _state()[1]


def column_info() -> dict:
    """The result file's record of the column: where the kernels came from, or why absent."""
    kernels = load()
    return {"source": str(kernels.site), "version": VLLM_VERSION} if kernels else {"absent": absent_reason()}
