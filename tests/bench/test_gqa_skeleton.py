"""``bench/gqa_skeleton.py`` without a GPU: each skeleton of the GQA grid (with and without the
position -> table chain and the row lock) moves qkv's rows where the op would put them, under
the Triton interpreter, so that its check before timing means what it says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.skipif(not (has_triton() and triton_interpret_mode()),
                                reason="needs triton under TRITON_INTERPRET=1")


def _poisoned_inputs():
    """Five tokens at Qwen3-8B's head counts, every slot valid, q_out and the caches NaN: a row
    a skeleton leaves unwritten fails ``skeleton_moves_the_rows``."""
    from prepfuse.testing import make_gqa_inputs

    inp = make_gqa_inputs(5, 32, 8, 128, 16, "cpu", skip_fraction=0.0)
    for out in (inp.q_out, inp.k_cache, inp.v_cache):
        out.fill_(float("nan"))
    return inp


@pytest.mark.parametrize("block_h", [16, 32])
@pytest.mark.parametrize("chain, lock", [(False, False), (False, True), (True, False), (True, True)])
def test_skeleton_moves_the_rows(chain, lock, block_h):
    import gqa_skeleton

    inp = _poisoned_inputs()
    gqa_skeleton.skeleton(inp, chain=chain, lock=lock, block_h=block_h)
    assert gqa_skeleton.skeleton_moves_the_rows(inp)


def test_the_check_sees_a_row_left_unwritten():
    import gqa_skeleton
    from prepfuse.testing import make_gqa_inputs

    inp = make_gqa_inputs(5, 32, 8, 128, 16, "cpu", skip_fraction=0.0)
    gqa_skeleton.skeleton(inp, chain=False, lock=False)
    blocks, rows = inp.slot_mapping // 16, inp.slot_mapping % 16
    inp.v_cache[blocks[3], rows[3], 2, 7] = torch.nan
    assert not gqa_skeleton.skeleton_moves_the_rows(inp)


@pytest.mark.parametrize("chain, lock", [(False, False), (True, True)])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_persistent_skeleton_moves_the_rows(chain, lock, programs):
    """Fewer programs than work items, each walking the items ``programs`` apart, still move
    every row (3 and 7 do not divide the 5 tokens' 15 items evenly)."""
    import gqa_skeleton

    inp = _poisoned_inputs()
    gqa_skeleton.skeleton(inp, chain=chain, lock=lock, programs=programs)
    assert gqa_skeleton.skeleton_moves_the_rows(inp)


@pytest.mark.parametrize("programs", [0, 1, 3])
def test_triton_copy_copies(programs):
    import gqa_skeleton

    src = torch.randn(7 * 64, dtype=torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    gqa_skeleton.triton_copy((src, dst), 64, 1, programs)
    assert torch.equal(src, dst)


@pytest.mark.parametrize("chain, lock", [(False, False), (False, True), (True, False), (True, True)])
def test_merged_skeleton_moves_the_rows(chain, lock):
    import gqa_skeleton

    inp = _poisoned_inputs()
    gqa_skeleton.merged_skeleton(inp, chain=chain, lock=lock)
    assert gqa_skeleton.skeleton_moves_the_rows(inp)


def test_flat_skeleton_copies_qkv():
    import gqa_skeleton
    from prepfuse.testing import make_gqa_inputs

    inp = make_gqa_inputs(5, 32, 8, 128, 16, "cpu", skip_fraction=0.0)
    flat = torch.empty_strided(inp.qkv.shape, inp.qkv.stride(), dtype=inp.qkv.dtype).fill_(float("nan"))
    gqa_skeleton.skeleton(inp, chain=False, lock=False, flat_out=flat)
    assert torch.equal(flat, inp.qkv)
