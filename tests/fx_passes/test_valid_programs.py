"""A valid program never fails to compile, and a rewrite keeps eager's meaning.

Model code hands the prep index tensors the ops would refuse as operands (a column of a
``[T, 2]`` metadata tensor, every other slot of a longer list: a strided last dim) and
index values the ops' own direct-call contract refuses (a padding slot that several tokens
name, a slot given twice, a slot counted from the cache's end). Eager and
``backend="inductor"`` run all of them; so must the prepfuse backend, fused, with every byte
of the caches and q as eager leaves them. Where no fused call can keep the meaning (k and v
caches that overlap), the rewrite declines and says so, and the model compiles as written.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models import dsv4 as dsv4_model
from prepfuse.models import gqa as gqa_model
from prepfuse.models.dsv4 import DSV4_SPELLINGS
from prepfuse.models.gqa import GqaSpelling
from prepfuse.testing import make_dsv4_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, HQ, HKV, D, BLOCK, BLOCKS, EPS = 6, 4, 2, 64, 8, 4, 1e-6
GQA = GqaSpelling("qwen3-fp32-rope", rope="hf_fp32")  # the op's math rounding for rounding: bytes compare equal
SLOTS = {
    "distinct": [5, 9, 17, 2, 30, 11],
    "padding-to-one-slot": [0, 9, 17, 2, 0, 0],  # padding tokens all write a dummy slot 0
    "repeated": [5, 9, 17, 5, 30, 11],  # the last writer's row stays
    "negative": [5, -1, 17, 2, -3, 11],  # counted from the cache's end
}
# how the slot list reaches the prep: as given, a column of [T, 2] metadata, every other entry
SPELLINGS = {
    "plain": lambda slots: (slots, lambda s: s),
    "metadata-column": lambda slots: (torch.stack([slots, torch.arange(T)], 1), lambda s: s[:, 0]),
    "every-other": lambda slots: (torch.stack([slots, torch.full_like(slots, 7)], 1).flatten(), lambda s: s[::2]),
}


def gqa_inputs(slots: list[int]):
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    q_norm, k_norm = gqa_model.make_norms(D, EPS, GQA, gen)
    table = torch.rand(64, D, generator=gen) * 2 - 1
    positions = torch.arange(T) + 3
    caches = [torch.randn(BLOCKS, BLOCK, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    return qkv, q_norm, k_norm, caches, torch.tensor(slots), positions, table


def run_both(fn, args):
    """(eager's outputs and written args, the compiled ones, the backend). Eager runs on one
    CPU thread: PyTorch leaves a slot that an index assignment names twice to whichever
    thread writes last (a DeepSeek-V4 row, split over threads, came out torn between tokens
    about one run in eight), and one thread leaves the last token's row, as the op does."""
    eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    compiled_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a slot named twice keeps the last token's row only when one thread writes
    try:
        eager = fn(*eager_args)
    finally:
        torch.set_num_threads(threads)
    backend = PrepfuseBackend({})
    compiled = torch.compile(fn, backend=backend, fullgraph=True)(*compiled_args)
    return (eager, eager_args), (compiled, compiled_args), backend


def assert_same_bytes(eager, compiled):
    (out_e, args_e), (out_c, args_c) = eager, compiled
    assert torch.equal(out_e, out_c)
    for a, b in zip(args_e, args_c):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("slots", list(SLOTS))
def test_gqa_index_operands_and_values_eager_accepts_fuse_with_eagers_bytes(slots, spelling):
    qkv, q_norm, k_norm, (k_cache, v_cache), slot_list, positions, table = gqa_inputs(SLOTS[slots])
    slot_source, read_slots = SPELLINGS[spelling](slot_list)
    position_source, read_positions = SPELLINGS[spelling](positions)

    def prep(qkv, slot_source, position_source, table, k_cache, v_cache):
        return gqa_model.gqa_prep(qkv, q_norm, k_norm, k_cache, v_cache, read_slots(slot_source),
                                  read_positions(position_source), table, None, HQ, HKV, GQA)

    eager, compiled, backend = run_both(prep, [qkv, slot_source, position_source, table, k_cache, v_cache])
    assert backend.reports.pattern_counts().get("gqa_qknorm_rope_kv") == 1, backend.reports.format(verbose=True)
    assert_same_bytes(eager, compiled)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("slots", ["padding-to-one-slot", "negative"])
def test_dsv4_index_operands_and_values_eager_accepts_fuse_with_eagers_bytes(slots, spelling):
    inputs = make_dsv4_inputs(T, 3, 8, 16, "cpu", generator=torch.Generator().manual_seed(3), skip_fraction=0.0)
    slot_source, read_slots = SPELLINGS[spelling](torch.tensor(SLOTS[slots]))
    position_source, read_positions = SPELLINGS[spelling](inputs.positions)
    spelling_ = DSV4_SPELLINGS[0]

    def prep(q, kv, k_cache, slot_source, position_source, table):
        positions = read_positions(position_source)
        q_out = dsv4_model.dsv4_q_prep(q, positions, table, EPS, 8, spelling_)
        dsv4_model.dsv4_kv_insert(kv, k_cache, read_slots(slot_source), positions, table, 16, spelling_)
        return q_out

    eager, compiled, backend = run_both(
        prep, [inputs.q, inputs.kv, inputs.k_cache, slot_source, position_source, inputs.cos_sin_cache])
    assert backend.reports.pattern_counts().get("dsv4_q+kv") == 1, backend.reports.format(verbose=True)
    (_, args_e), (_, args_c) = eager, compiled
    assert torch.equal(args_e[2], args_c[2])  # every cache byte eager's


def test_overlapping_k_and_v_caches_decline_and_compile_as_written():
    qkv, q_norm, k_norm, _, slots, positions, table = gqa_inputs(SLOTS["distinct"])
    buffer = torch.zeros(BLOCKS, BLOCK, HKV + 1, D, dtype=torch.bfloat16)

    def prep(qkv, slots, positions, table, buffer):  # k heads 0-1 and v heads 1-2 of one buffer: head 1 shared
        return gqa_model.gqa_prep(qkv, q_norm, k_norm, buffer[:, :, :HKV], buffer[:, :, 1:], slots, positions,
                                  table, None, HQ, HKV, GQA)

    _, (out, args), backend = run_both(prep, [qkv, slots, positions, table, buffer])
    assert backend.reports.matches() == []
    assert any("k_cache: shares memory with v_cache" in r.why for r in backend.reports.near_misses())
    torch._dynamo.reset()
    inductor_args = [qkv, slots, positions, table, buffer.clone()]
    inductor_out = torch.compile(prep, backend="inductor", fullgraph=True)(*inductor_args)
    assert torch.equal(out, inductor_out) and torch.equal(args[4], inductor_args[4])  # compiled as written


def test_a_projection_produced_transposed_declines_and_compiles_as_written():
    """``matmul(W, x.T).T``: its q, k and v are not columns of a token-major projection the
    op reads, so nothing fuses, and the reason is given; the model compiles as written."""
    qkv, q_norm, k_norm, (k_cache, v_cache), slots, positions, table = gqa_inputs(SLOTS["distinct"])
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(qkv.shape[1], 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(T, 32, generator=gen).to(torch.bfloat16)

    def prep(x, weight, slots, positions, table, k_cache, v_cache):
        qkv = torch.matmul(weight, x.T).T
        return gqa_model.gqa_prep(qkv, q_norm, k_norm, k_cache, v_cache, slots, positions, table, None, HQ, HKV, GQA)

    args = [x, weight, slots, positions, table, k_cache, v_cache]
    _, (out, compiled_args), backend = run_both(prep, args)
    assert backend.reports.matches() == [] and backend.reports.near_misses()
    torch._dynamo.reset()
    inductor_args = [a.clone() for a in args]
    inductor_out = torch.compile(prep, backend="inductor", fullgraph=True)(*inductor_args)
    assert torch.equal(out, inductor_out)
    assert all(torch.equal(a, b) for a, b in zip(compiled_args, inductor_args))


def test_a_write_through_a_view_the_reader_does_not_follow_is_said():
    """A cache written through its transposed view is no write the families take; it
    declines by name instead of in silence."""
    def write(k, cache, slots):
        cache.transpose(1, 2)[slots] = k
        return k * 2

    backend = PrepfuseBackend({})
    args = (torch.randn(5, 2, 64).to(torch.bfloat16), torch.zeros(16, 64, 2, dtype=torch.bfloat16),
            torch.tensor([1, 2, 3, 4, 5]))
    torch.compile(write, backend=backend, fullgraph=True)(*args)
    whys = [r.why for r in backend.reports.near_misses()]
    assert whys and all("`cache.transpose(1, 2)[slots] = k` writes into a view of the graph input" in w
                        and "taken by permute" in w for w in whys), whys
