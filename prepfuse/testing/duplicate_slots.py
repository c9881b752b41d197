"""Slots that several tokens name: which rows an op's call left whole (every family alike).

With the index checks off (CUDA-graph capture, ``PREPFUSE_CHECK_INDEX_VALUES=0``) a slot
that two tokens name must end up holding one of those tokens' whole rows: data and scale
bytes, or k and v of every kv head, of one token (docs/ops.md, "Index values"). Which bytes
make up a slot's row differs by family and layout, so it is found from the implementation
itself: the bytes that change when one of the slot's writers alone is inserted. The
tests (``tests/ops/test_index_values.py``) and the benchmark of torn rows
(``bench/duplicate_slots.py``) both use ``torn_slots``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

__all__ = ["written_outputs", "call_on_fresh_outputs", "slot_writers", "sharing_slots", "torn_slots",
           "CONTENDED_OPS", "CONTENDED_RUNS", "contended_inputs"]

# the ops by ``contended_inputs``' names (``prepfuse.testing.impls.IMPLS`` keys, fp8 GQA beside bf16)
CONTENDED_OPS = ("dsv4", "dsv4-full-row", "dsv4-full-row-fp8", "gqa", "gqa-fp8", "indexer-fp8", "indexer-mxfp4")

# token runs [a, b) given token a's slot in a contended call of 1024 tokens: 96 programs
# in a row write one slot, at the same time on a GPU
CONTENDED_RUNS = [(0, 96), (300, 396), (900, 996)]

# every tensor a call may write, by its name on the families' Inputs
_WRITTEN = ("q_out", "q_scale", "weights_out", "k_cache", "v_cache")


def written_outputs(inputs) -> list[torch.Tensor]:
    """Every tensor the call may write, as bytes."""
    return [getattr(inputs, n).view(torch.uint8) for n in _WRITTEN if getattr(inputs, n, None) is not None]


def call_on_fresh_outputs(impl: Callable, inputs, **changes):
    """``impl`` on newly poisoned outputs of ``inputs`` with ``changes`` (index tensors);
    returns the inputs it ran on."""
    out = dataclasses.replace(inputs.fresh_outputs(), **changes)
    impl(*out.args())
    return out


def slot_writers(slots: torch.Tensor) -> dict[int, list[int]]:
    """{slot: the tokens that name it} for every slot (>= 0) named by more than one token."""
    writers: dict[int, list[int]] = {}
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            writers.setdefault(slot, []).append(token)
    return {slot: tokens for slot, tokens in writers.items() if len(tokens) > 1}


def sharing_slots(slots: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``slots`` with every token of each run ``[a, b)`` given token a's slot."""
    slots = slots.clone()
    for first, end in runs:
        slots[first:end] = slots[first]
    return slots


def contended_inputs(op: str, device) -> tuple:
    """(fresh inputs of 1024 tokens, every row inserted at a distinct slot, and those slots
    with ``CONTENDED_RUNS`` sharing three of them) for ``op`` in ``CONTENDED_OPS``: few q heads, as
    only the cache rows are in question."""
    from prepfuse.testing.dsv4 import make_dsv4_inputs
    from prepfuse.testing.dsv4_full_row import make_dsv4_full_row_inputs
    from prepfuse.testing.dsv4_indexer import make_dsv4_indexer_inputs
    from prepfuse.testing.gqa import make_gqa_inputs

    if op == "dsv4":
        inputs = make_dsv4_inputs(1024, 4, 8, 64, device, skip_fraction=0.0)
    elif op.startswith("dsv4-full-row"):
        inputs = make_dsv4_full_row_inputs(1024, 4, 4, 64, device, skip_fraction=0.0,
                                           fmt="fp8" if op.endswith("-fp8") else "bf16")
    elif op in ("gqa", "gqa-fp8"):
        inputs = make_gqa_inputs(1024, 8, 2, 128, 16, device, skip_fraction=0.0,
                                 cache_dtype=torch.float8_e4m3fn if op == "gqa-fp8" else torch.bfloat16)
    else:
        inputs = make_dsv4_indexer_inputs(op.removeprefix("indexer-"), 1024, 4, 64, device, num_k=1024,
                                          skip_fraction=0.0)
    return inputs, sharing_slots(inputs.slot_mapping, CONTENDED_RUNS)


def torn_slots(got, impl: Callable, inputs, slots: torch.Tensor) -> list[int]:
    """The duplicated slots of ``slots`` whose row in ``got`` (what ``impl`` wrote on
    ``inputs`` with ``slot_mapping=slots``) is no single writer's whole row; an
    AssertionError if any byte outside those rows differs from ``impl``'s own call without
    the duplicated slots (the rest of the call is unchanged by them).

    ``impl`` is run again with distinct slots only, so a checked implementation serves too;
    it is the same implementation, so the comparison is exact (each token's bytes do not
    depend on the others'). For each duplicated slot, a candidate per writer is the output
    with only that writer inserting the slot; the slot's row is every byte where some
    candidate differs from the output with none of them inserting it.
    """
    writers = slot_writers(slots)
    none = slots.clone()
    for tokens in writers.values():
        none[tokens] = -1
    base = written_outputs(call_on_fresh_outputs(impl, inputs, slot_mapping=none))
    got = written_outputs(got)
    outside = [torch.ones_like(b, dtype=torch.bool) for b in base]
    torn = []
    for slot, tokens in writers.items():
        candidates = []
        for token in tokens:
            only = none.clone()
            only[token] = slot
            candidates.append(written_outputs(call_on_fresh_outputs(impl, inputs, slot_mapping=only)))
        row = [torch.stack([c[i] != b for c in candidates]).any(0) for i, b in enumerate(base)]
        if not any(all(torch.equal(g[r], c[r]) for g, c, r in zip(got, cand, row)) for cand in candidates):
            torn.append(slot)
        for keep, r in zip(outside, row):
            keep &= ~r
    for i, (g, b, keep) in enumerate(zip(got, base, outside)):
        if not torch.equal(g[keep], b[keep]):
            raise AssertionError(f"written output {i}: bytes outside the duplicated slots' rows differ from "
                                 "the call without them")
    return torn
