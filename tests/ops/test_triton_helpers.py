"""The shared ``@triton.jit`` helpers, element by element against plain PyTorch.

``_to_e2m1_code`` rounds by an add-and-subtract of 1.5 * 2^23 rather than by counting
midpoints; its edge cases are the e2m1 midpoints and grid points, so every one of them
and the fp32 values a few ULPs either side are checked, with random values of both signs.
Runs under the CPU interpreter and compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops.dsv4_indexer_common import e2m1_codes_reference

pytestmark = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if has_triton():
    import triton
    import triton.language as tl

    from prepfuse.ops._triton_helpers import _to_e2m1_code

    @triton.jit
    def _e2m1_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, _to_e2m1_code(v).to(tl.uint8), mask=i < n)


def near(points: list[float], ulps: int) -> torch.Tensor:
    """Each point and the fp32 values up to ``ulps`` ULPs either side, both signs."""
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    offsets = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    values = (bits[:, None] + offsets[None, :]).flatten().view(torch.float32)
    values = values[(values >= 0) & (values <= 6.0)]
    return torch.cat((values, -values))


def test_e2m1_code_matches_the_reference_at_every_edge():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    smallest = [2.0**-149, 2.0**-126, 2.0**-24]  # subnormal, smallest normal, tiny
    gen = torch.Generator().manual_seed(0)
    random = (torch.rand(1 << 14, generator=gen) * 12 - 6).to(torch.float32)
    x = torch.cat((near(grid + midpoints, 3), torch.tensor(smallest), -torch.tensor(smallest), random))
    out = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    block = 1024
    _e2m1_kernel[(triton.cdiv(x.numel(), block),)](x.to(DEVICE), out, x.numel(), BLOCK=block)
    expected = e2m1_codes_reference(x)
    got = out.cpu()
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} values encoded differently (interpreter: {triton_interpret_mode()}), first: "
        + ", ".join(f"{x[i].item()!r}: {got[i].item()} != {expected[i].item()}" for i in bad[:5])
    )
