"""Reports kept beside Inductor's cache: a warm compile still says what its code holds.

Inductor's FX graph cache (and AOTAutograd's) serves a compiled graph without running the
post-grad passes, so a compile served from it has no report of its own: a script run a
second time reported "0 fused" for fused code. The backend keeps each compile's reports on
disk under Inductor's cache folder (``<cache_dir>/prepfuse_reports``), keyed by what makes
the cached code the same: the Dynamo graph's code, the inputs' sizes, strides, dtypes and
devices, the pass manager's ``uuid()`` (its passes' sources and the options) and the mode.
A compile served from the cache gets the reports of the compile that wrote it, marked
``cached``. Nothing here decides what is compiled; a store that cannot be read or written
(a read-only folder, another torch) only loses the report, with one DEBUG line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile

import torch
import torch.fx

from prepfuse.fx_passes.report import GraphReport

__all__ = ["report_key", "store_reports", "load_reports"]

log = logging.getLogger("prepfuse.report")


def report_key(gm: torch.fx.GraphModule, example_inputs, manager_uuid: str, mode: str | None) -> str:
    """What makes two compiles share Inductor's cached code, hashed."""
    digest = hashlib.sha256()
    digest.update(torch.__version__.encode())
    digest.update(manager_uuid.encode())
    digest.update(repr(mode).encode())
    digest.update(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            digest.update(repr((tuple(x.shape), x.stride(), x.dtype, x.device.type)).encode())
        else:
            digest.update(repr(type(x)).encode())
    return digest.hexdigest()


def _folder() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "prepfuse_reports")


def store_reports(key: str, reports: list[GraphReport]) -> None:
    """Keep ``reports`` for the compiles that Inductor will serve this compile's code to."""
    try:
        folder = _folder()
        os.makedirs(folder, exist_ok=True)
        data = pickle.dumps(list(reports))
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
            f.write(data)
        os.replace(f.name, os.path.join(folder, key))
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as err:
        log.debug("prepfuse: the report of this compile is not kept for warm compiles: %s", err)


def load_reports(key: str) -> list[GraphReport] | None:
    """The reports of the compile that wrote the cached code, or None where none was kept."""
    try:
        with open(os.path.join(_folder(), key), "rb") as f:
            reports = pickle.load(f)
    except FileNotFoundError:
        return None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
        log.debug("prepfuse: the kept report of this compile cannot be read: %s", err)
        return None
    if not isinstance(reports, list) or not all(isinstance(r, GraphReport) for r in reports):
        return None
    return reports
