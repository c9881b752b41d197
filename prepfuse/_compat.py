"""Everything that differs between the torch and triton versions prepfuse supports.

prepfuse supports torch 2.11 through 2.14 (CI runs 2.13 on the CPU, the GPU machine
2.11 with triton 3.6). Any API that moved between those versions is gated here, once,
so the rest of the package reads as if there were one torch.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether triton can be imported at all (it is absent on macOS and Windows)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpret_mode() -> bool:
    """Whether triton kernels run on the CPU through its interpreter.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so this must be set
    before prepfuse is imported; the test suite's conftest does that on CPU machines.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def auto_functionalized_ops() -> tuple[object, object | None]:
    """The ``auto_functionalized`` and ``auto_functionalized_v2`` higher-order ops.

    v2 exists in every supported torch, but engines pinned to older torch still meet v1
    graphs, so callers treat v2 as optional.
    """
    from torch._higher_order_ops import auto_functionalize as af

    return af.auto_functionalized, getattr(af, "auto_functionalized_v2", None)
