"""Aliasing, every op: an argument the op writes overlaps no other argument and none of its
own elements (``prepfuse.ops._checks.check_written_apart``, run by every impl and the fake
one). Each case is a ValueError naming the written argument (and the other one), eagerly and
through the fake impl, with nothing written; views that interleave without overlapping (the
k and v halves of one FlashInfer ``[NB, 2, BS, Hkv, D]`` buffer) are accepted.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prepfuse.ops import (
    DSV4_INDEXER_ROPE_FP8_INSERT, DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, DSV4_QNORM_ROPE_KV_INSERT, GQA_QKNORM_ROPE_KV_INSERT,
)
from prepfuse.testing import (
    call_with_fake_tensors, make_dsv4_full_row_inputs, make_dsv4_indexer_inputs, make_dsv4_inputs, make_gqa_inputs,
)


def one_buffer(out, v_offset_elements: int):
    """``out`` with k and v caches as views of one ``[NB, 2, BS, Hkv, D]`` buffer (FlashInfer's
    layout): k its first half, v the second moved by ``v_offset_elements`` (0: the halves)."""
    nb, bs, hkv, d = out.k_cache.shape
    buffer = torch.zeros(nb, 2, bs, hkv, d, dtype=out.k_cache.dtype)
    k, v = buffer[:, 0], buffer[:, 1]
    return dataclasses.replace(out, k_cache=k, v_cache=v.as_strided(v.shape, v.stride(), v.storage_offset() + v_offset_elements))


def gqa():
    return GQA_QKNORM_ROPE_KV_INSERT, make_gqa_inputs(5, 4, 2, 64, 16, "cpu").fresh_outputs()


def dsv4():
    return DSV4_QNORM_ROPE_KV_INSERT, make_dsv4_inputs(5, 3, 8, 16, "cpu").fresh_outputs()


def dsv4_full_row():
    return DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, make_dsv4_full_row_inputs(5, 3, 3, 16, "cpu").fresh_outputs()


def indexer():
    return DSV4_INDEXER_ROPE_FP8_INSERT, make_dsv4_indexer_inputs("fp8", 5, 3, 16, "cpu", num_k=4).fresh_outputs()


CASES = {
    # case: (op and outputs, change, the argument named first, the other one or None)
    "gqa-k_cache-is-v_cache": (gqa, lambda o: dict(v_cache=o.k_cache), "k_cache", "v_cache"),
    # the second half moved back by one block: v's first block is k's second
    "gqa-v_cache-one-block-into-k_cache": (gqa, lambda o: vars(one_buffer(o, -16 * 2 * 64)), "k_cache", "v_cache"),
    "gqa-overlapping-cache-blocks": (gqa, lambda o: dict(k_cache=o.k_cache.as_strided(
        o.k_cache.shape, (o.k_cache[0].numel() // 2, *o.k_cache.stride()[1:]))), "k_cache", None),
    "gqa-expanded-k_cache": (gqa, lambda o: dict(k_cache=o.k_cache[:1].expand(o.k_cache.shape)), "k_cache", None),
    "gqa-q_out-over-qkv": (gqa, lambda o: dict(q_out=o.qkv.as_strided(
        o.q_out.shape, (o.qkv.stride(0), 64, 1), o.qkv.storage_offset())), "q_out", "qkv"),
    "dsv4-kv-in-q_out-padding": (dsv4, lambda o: dict(kv=o.q_out[:, 7]), "q_out", "kv"),
    "dsv4-expanded-q_out": (dsv4, lambda o: dict(q_out=o.q_out[:1].expand(o.q_out.shape)), "q_out", None),
    "dsv4-k_cache-over-q_out": (dsv4, lambda o: dict(
        q_out=o.k_cache.view(torch.bfloat16).as_strided(o.q_out.shape, o.q_out.stride())), "q_out", "k_cache"),
    # vLLM rewrites q in place; here q_out is the caller's buffer, apart from q
    "dsv4-full-row-q_out-is-q": (dsv4_full_row, lambda o: dict(q_out=o.q), "q_out", "q"),
    "dsv4-full-row-q_out-in-k_cache": (dsv4_full_row, lambda o: dict(q_out=o.k_cache[:5, :3]), "q_out", "k_cache"),
    "indexer-k_cache-holds-q_out": (indexer, lambda o: dict(
        q_out=o.k_cache.view(torch.float8_e4m3fn).as_strided(o.q_out.shape, o.q_out.stride())), "q_out", "k_cache"),
}


def apply(case):
    make, change, first, other = CASES[case]
    op, out = make()
    changes = change(out)
    return op, dataclasses.replace(out, **changes), first, other


def message(first: str, other: str | None) -> str:
    if other is None:
        return rf"^{first}: its elements overlap each other"
    return rf"^({first}: shares memory with {other}|{other}: shares memory with {first})"


@pytest.mark.parametrize("case", list(CASES))
def test_rejected_eagerly_with_nothing_written(case):
    op, out, first, other = apply(case)
    outputs = [t for t in (getattr(out, n, None) for n in ("q_out", "weights_out", "k_cache", "v_cache"))
               if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in outputs]
    with pytest.raises(ValueError, match=message(first, other)):
        op(*out.args())
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, outputs))


@pytest.mark.parametrize("case", list(CASES))
def test_rejected_by_the_fake_impl(case):
    op, out, first, other = apply(case)
    names = [a.name for a in op._schema.arguments]
    with pytest.raises(ValueError, match=message(first, other)):
        call_with_fake_tensors(op, dict(zip(names, out.args())))


def test_interleaved_views_of_one_buffer_are_accepted():
    op, out = gqa()
    out = one_buffer(out, 0)
    op(*out.args())
    names = [a.name for a in op._schema.arguments]
    call_with_fake_tensors(op, dict(zip(names, out.args())))


def test_two_storages_over_the_same_memory_are_compared_by_address():
    """A DLPack round trip, or ``torch.from_numpy`` of one array twice, gives two storage
    objects over the same bytes; the check compares address ranges, not storages."""
    op, out = gqa()
    array = np.zeros(out.k_cache.numel(), dtype=np.uint16)
    k = torch.from_numpy(array).view(torch.bfloat16).view(out.k_cache.shape)
    v = torch.from_numpy(array).view(torch.bfloat16).view(out.k_cache.shape)
    assert k.untyped_storage() is not v.untyped_storage()
    before = k.clone()
    with pytest.raises(ValueError, match=message("k_cache", "v_cache")):
        op(*dataclasses.replace(out, k_cache=k, v_cache=v).args())
    assert torch.equal(k, before)
    same = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(out.k_cache))
    with pytest.raises(ValueError, match=message("k_cache", "v_cache")):
        op(*dataclasses.replace(out, v_cache=same).args())


def test_two_storages_over_disjoint_halves_of_one_array_are_accepted():
    op, out = gqa()
    n = out.k_cache.numel()
    array = np.zeros(2 * n, dtype=np.uint16)
    k = torch.from_numpy(array[:n]).view(torch.bfloat16).view(out.k_cache.shape)
    v = torch.from_numpy(array[n:]).view(torch.bfloat16).view(out.k_cache.shape)
    op(*dataclasses.replace(out, k_cache=k, v_cache=v).args())
