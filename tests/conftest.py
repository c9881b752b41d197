"""Suite-wide set-up.

On a machine without CUDA, triton kernels run under its CPU interpreter: the variable
must be set before any ``@triton.jit`` function is decorated, i.e. before prepfuse is
imported, which is why it is set here at conftest import time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import prepfuse  # noqa: E402,F401  (registers the ops once for the whole session)


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo and no Inductor FX graph cache for the test: a cached graph runs no
    pass, so a pass test would see nothing matched. Modules that compile ask for it
    (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
