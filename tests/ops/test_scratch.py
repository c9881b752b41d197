"""``prepfuse::scratch`` (``SCRATCH``): the arena's view as an op, its fake impl, and what
Inductor does with its output.

The schema snapshot, opcheck and the fake impl's argument check are in
``test_schemas.py`` with every other op's.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import FileCheck

from prepfuse.ops import SCRATCH
from prepfuse.ops.scratch import ensure_inductor_lowering
from prepfuse.scratch import ScratchArena, use_arena

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def test_returns_a_view_of_the_current_arena():
    with use_arena(ScratchArena()) as arena:
        first = SCRATCH("q", [7, 8, 512], torch.bfloat16, CPU)
        (reservation,) = arena.reservations()
        assert (reservation.name, reservation.device) == ("q", CPU)
        assert first.shape == (7, 8, 512) and first.dtype == torch.bfloat16 and first.is_contiguous()
        again = SCRATCH("q", [3, 8, 512], torch.bfloat16, CPU)
        assert again.data_ptr() == first.data_ptr() == reservation.storage.data_ptr()
        arena.freeze()
        with pytest.raises(RuntimeError, match=r"'q' on cpu needs 65536 bytes .* only 57344 were reserved"):
            SCRATCH("q", [8, 8, 512], torch.bfloat16, CPU)


def test_fake_impl_touches_no_arena():
    with use_arena(ScratchArena()) as arena, FakeTensorMode():
        out = SCRATCH("q", [5, 2], torch.float32, CPU)
    assert out.shape == (5, 2) and out.dtype == torch.float32
    assert arena.reservations() == []


def _scratch_then_pointwise(x):
    """The scratch is read once by a pointwise kernel of the same size and then dead:
    the output could be written in place into its buffer if Inductor could reuse it."""
    s = SCRATCH("probe", [x.shape[0]], torch.float32, x.device)
    return torch.mm((s.relu() + x).view(8, -1), torch.ones(x.shape[0] // 8, 4, device=x.device))


def _scratch_then_same_sized_buffers(w):
    s = SCRATCH("probe", [8, 8], torch.float32, w.device)
    t = torch.mm(s, w)  # the last reader of s
    return torch.mm(torch.mm(t.relu(), w).relu(), w)  # buffers of s's size, made after it died


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fn", [_scratch_then_pointwise, _scratch_then_same_sized_buffers])
def test_inductor_never_reuses_the_scratch_buffer(fn, device):
    """Inductor must not hand the scratch's bytes (shared with every other handout of the
    name) to one of its own buffers: no output or intermediate lands in the arena, and
    no ``# reuse`` line takes the scratch buffer. (On torch 2.13's CPU code Inductor does
    not reuse a fallback's output even without prepfuse's lowering; the lowering is for
    the cases where it would, e.g. a Triton kernel writing in place into a dead input:
    the CUDA parameter.)"""
    ensure_inductor_lowering()  # as emit_scratch does; this code calls the op itself
    x = torch.randn(64, device=device) if fn is _scratch_then_pointwise else torch.randn(8, 8, device=device)
    with use_arena(ScratchArena()) as arena:
        arena.take("probe", [64], torch.float32, device).fill_(-1.0)
        out, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True), x)
        torch.testing.assert_close(out, fn(x))  # the compiled code only read the scratch
        start, end = arena.reservations()[0].address_range
    assert not start <= out.data_ptr() < end
    FileCheck().check_count("torch.ops.prepfuse.scratch.default(", 1, exactly=True).run(code)
    lines = [line.strip() for line in code.splitlines()]
    scratch = {line.split(" = ")[0] for line in lines if "torch.ops.prepfuse.scratch.default(" in line}
    scratch |= {line.split(" = ")[0] for line in lines if line.count(" = ") == 1 and line.split(" = ")[1] in scratch}
    reused = [line for line in lines if "# reuse" in line and line.split(";")[0].split(" = ")[1] in scratch]
    assert reused == [], (scratch, reused)

