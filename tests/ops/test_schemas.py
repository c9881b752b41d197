"""The schema contract of every ``prepfuse`` op.

- Drift: ``str(op._schema)`` of every registered op against the committed snapshot
  ``tests/golden/schemas.txt``; a difference fails with a unified diff. A stale schema
  went untested in production (docs/design.md, lesson 3), so a test shows the check
  catches the forms seen there.
- ``torch.library.opcheck`` on every op, with samples kept per op: a new op without
  samples fails here instead of going unchecked.
- Every op's fake impl rejects bad shapes (it runs under torch.compile, where the eager
  checks never do).

Regenerate the snapshot after an intended schema change with::

    PREPFUSE_ACCEPT=1 python -m pytest tests/ops/test_schemas.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from prepfuse.ops import (
    DSV4_INDEXER_ROPE_FP8_INSERT,
    DSV4_INDEXER_ROPE_MXFP4_INSERT,
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT,
    DSV4_QNORM_ROPE_KV_INSERT,
    GQA_QKNORM_ROPE_KV_INSERT,
    GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER,
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT,
    NAMESPACE,
    SCRATCH,
    floats_as_tensors,
    tensor_floats_overload,
    registered_ops,
)
from prepfuse.ops.engine_caches import EngineCaches, register_resolver
from prepfuse.scratch import ScratchArena, use_arena
from prepfuse.testing import (
    make_dsv4_full_row_inputs, make_dsv4_indexer_inputs, make_dsv4_inputs, make_gqa_inputs, with_cos_sin_operands,
)
from prepfuse.testing.drift import check_schemas, ops_of, read_snapshot, schema_drift, schemas_of

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "schemas.txt"
GOLDEN_HEADER = (
    "# str(op._schema) of every prepfuse op, sorted; "
    "regenerate: PREPFUSE_ACCEPT=1 python -m pytest tests/ops/test_schemas.py\n"
)


def registered_schemas() -> list[str]:
    return schemas_of(NAMESPACE)


# --------------------------------------------------------------------------------------
# Drift against the snapshot
# --------------------------------------------------------------------------------------
def test_registered_schemas_match_golden():
    """The public drift kit on prepfuse's own namespace (``prepfuse.testing.drift``)."""
    check_schemas(GOLDEN, namespace=NAMESPACE, header=GOLDEN_HEADER)
    assert [op._schema for op in registered_ops()] == [op._schema for op in ops_of(NAMESPACE)]


def test_golden_is_sorted_and_has_its_header():
    text = GOLDEN.read_text()
    assert text.startswith(GOLDEN_HEADER)
    golden = read_snapshot(GOLDEN)
    assert golden == sorted(golden)
    assert len(golden) == len(set(golden))


def test_schema_drift_is_empty_only_when_equal():
    a = "prepfuse::a(Tensor x) -> Tensor"
    b = "prepfuse::b(Tensor(a!) x) -> ()"
    assert schema_drift([a, b], [b, a]) == ""
    added = schema_drift([a, b], [a])
    assert f"\n+{b}" in added and "\n-" not in added.split("@@", 1)[1]
    removed = schema_drift([a], [a, b])
    assert f"\n-{b}" in removed and "\n+" not in removed.split("@@", 1)[1]


# Schema forms of the same op seen in production (docs/design.md). Each is registered in
# a throwaway namespace, rendered as if it were prepfuse's, and must fail the check.
STALE_DSV4_FORMS = {
    "in_place": (
        "dsv4_qnorm_rope_kv_insert(Tensor(a!) q, Tensor kv, Tensor(b!) k_cache, Tensor slot_mapping, "
        "Tensor positions, Tensor cos_sin_cache, float eps, int block_size) -> ()"
    ),
    "allocating": (
        "dsv4_qnorm_rope_kv_insert(Tensor q_in, Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, "
        "Tensor position_ids, Tensor cos_sin_cache, int q_head_padded, float eps, int cache_block_size) -> Tensor"
    ),
    # the out variant itself, with the argument names of another engine
    "out_renamed": (
        "dsv4_qnorm_rope_kv_insert(Tensor q_in, Tensor kv, Tensor(a!) q_out, Tensor(b!) k_cache, "
        "Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, float eps, int cache_block_size) -> ()"
    ),
}


@pytest.fixture(params=sorted(STALE_DSV4_FORMS))
def stale_dsv4_op(request):
    """A stale form of the op, defined in its own namespace for the test's duration."""
    namespace = f"prepfuse_stale_test_{request.param}"
    lib = torch.library.Library(namespace, "DEF")
    try:
        lib.define(STALE_DSV4_FORMS[request.param])
        yield namespace, getattr(torch.ops, namespace).dsv4_qnorm_rope_kv_insert.default
    finally:
        lib._destroy()


def test_stale_schema_fails_the_drift_check(stale_dsv4_op):
    namespace, op = stale_dsv4_op
    stale = str(op._schema).replace(f"{namespace}::", f"{NAMESPACE}::", 1)
    current = str(DSV4_QNORM_ROPE_KV_INSERT._schema)
    assert stale != current
    # the process as it would look had the stale form been registered instead
    registered = [stale if s == current else s for s in registered_schemas()]

    drift = schema_drift(registered, read_snapshot(GOLDEN))

    assert drift
    assert f"\n-{current}" in drift
    assert f"\n+{stale}" in drift
    assert f"{NAMESPACE}::dsv4_qnorm_rope_kv_insert(" in drift
    # the throwaway namespace never leaks into the real check
    assert all(str(op._schema).startswith(f"{NAMESPACE}::") for op in registered_ops())
    assert schema_drift(registered_schemas(), read_snapshot(GOLDEN)) == ""
    assert "changed: prepfuse::dsv4_qnorm_rope_kv_insert" in drift


# --------------------------------------------------------------------------------------
# opcheck, with samples per op
# --------------------------------------------------------------------------------------
def _dsv4_opcheck_samples() -> list[tuple]:
    # irregular shapes: 7 tokens, 3 heads padded to 8, block size 16
    full = make_dsv4_inputs(7, 3, 8, 16, "cpu")
    # data-parallel padding: only T' = 5 of 7 rows inserted, two of them skipped
    partial = make_dsv4_inputs(7, 3, 8, 16, "cpu", num_inserted=5)
    partial.slot_mapping[[0, 3]] = -1
    # one token, no padded heads, a larger block
    single = make_dsv4_inputs(1, 3, 3, 64, "cpu", skip_fraction=0.0)
    return [full.args(), partial.args(), single.args()]


def _dsv4_full_row_opcheck_samples() -> list[tuple]:
    # vLLM's bf16 format: 7 tokens, 3 heads unpadded, block size 16
    bf16 = make_dsv4_full_row_inputs(7, 3, 3, 16, "cpu")
    # its fp8 format, q padded to 8 heads, T' = 5 of 7 rows inserted, two skipped, blocks apart
    fp8 = make_dsv4_full_row_inputs(7, 3, 8, 16, "cpu", fmt="fp8", num_inserted=5, block_padding=32)
    fp8.slot_mapping[[0, 3]] = -1
    # a mixed format, one token
    mixed = make_dsv4_full_row_inputs(1, 2, 2, 64, "cpu", fmt="bf16-q-fp8-cache", skip_fraction=0.0)
    return [bf16.args(), fp8.args(), mixed.args()]


def _gqa_samples() -> tuple:
    """(qwen3, llama, single): the GQA ops' sample inputs."""
    # Qwen3 style: norm weights, NeoX RoPE, bf16 caches, 7 tokens, 3 q heads on 1 kv head
    qwen3 = make_gqa_inputs(7, 3, 1, 64, 16, "cpu")
    # Llama style: no norm (the None optionals), GPT-J RoPE, partial rotary, fp8 caches
    # with a device scale, only T' = 5 of 7 rows inserted
    llama = make_gqa_inputs(
        7, 4, 2, 128, 16, "cpu", rotary_dim=64, is_neox=False, norm=False,
        cache_dtype=torch.float8_e4m3fn, num_inserted=5,
    )
    single = make_gqa_inputs(1, 2, 1, 64, 64, "cpu", skip_fraction=0.0)
    return qwen3, llama, single


def _gqa_opcheck_samples() -> list[tuple]:
    qwen3, llama, single = _gqa_samples()
    # the two-table operand: per-token bf16 cos and sin, positions None (a model's own values)
    operands, _ = with_cos_sin_operands(qwen3, dtype=torch.bfloat16, per_token=True)
    return [qwen3.args(), llama.args(), single.args(), operands.args()]


def _gqa_separate_opcheck_samples() -> list[tuple]:
    # the fused op's samples with q, k and v as three tensors (one with a padded token stride)
    qwen3 = make_gqa_inputs(7, 3, 1, 64, 16, "cpu")
    llama = make_gqa_inputs(
        7, 4, 2, 128, 16, "cpu", rotary_dim=64, is_neox=False, norm=False,
        cache_dtype=torch.float8_e4m3fn, num_inserted=5,
    )
    single = make_gqa_inputs(1, 2, 1, 64, 64, "cpu", skip_fraction=0.0)
    operands, _ = with_cos_sin_operands(llama, row_padding=3)  # fp32 views of a table, row stride wider
    return [qwen3.separate_args(), llama.separate_args(token_padding=64), single.separate_args(),
            operands.separate_args()]


def _by_layer(inputs, name: str) -> tuple:
    """``inputs`` as the by-layer op's arguments, its caches and slots found by a resolver
    registered under ``name``."""
    register_resolver(name, lambda key: EngineCaches(inputs.k_cache, inputs.v_cache, inputs.slot_mapping))
    return inputs.by_layer_args("layers.0", name)


def _gqa_by_layer_opcheck_samples() -> list[tuple]:
    # the fused op's samples, the caches and slots found at run time by the engine's resolver
    qwen3, llama, single = _gqa_samples()
    return [_by_layer(qwen3, "prepfuse_opcheck::qwen3"), _by_layer(llama, "prepfuse_opcheck::llama"),
            _by_layer(single, "prepfuse_opcheck::single")]


def _dsv4_indexer_opcheck_samples(fmt: str) -> list[tuple]:
    # irregular: 7 tokens, 3 heads, 5 key rows of which 4 inserted, one skipped
    partial = make_dsv4_indexer_inputs(fmt, 7, 3, 16, "cpu", num_k=5, num_inserted=4)
    partial.slot_mapping[1] = -1
    # decode-like: one token, 64 heads, fp32 weights, one key row
    decode = make_dsv4_indexer_inputs(fmt, 1, 64, 64, "cpu", num_k=1, skip_fraction=0.0, weights_dtype=torch.float32)
    return [partial.args(), decode.args()]


def _scratch_opcheck_samples() -> list[tuple]:
    # a padded q as the DeepSeek-V4 pass takes it, another dtype and rank, zero tokens
    return [
        ("dsv4_qnorm_rope_kv_insert.q_out.0", [7, 8, 512], torch.bfloat16, torch.device("cpu")),
        ("opcheck.other", [5, 3], torch.float32, torch.device("cpu")),
        ("opcheck.empty", [0, 8, 512], torch.bfloat16, torch.device("cpu")),
    ]


OPCHECK_SAMPLES: dict[torch._ops.OpOverload, Callable[[], list[tuple]]] = {
    DSV4_QNORM_ROPE_KV_INSERT: _dsv4_opcheck_samples,
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT: _dsv4_full_row_opcheck_samples,
    DSV4_INDEXER_ROPE_FP8_INSERT: lambda: _dsv4_indexer_opcheck_samples("fp8"),
    DSV4_INDEXER_ROPE_MXFP4_INSERT: lambda: _dsv4_indexer_opcheck_samples("mxfp4"),
    GQA_QKNORM_ROPE_KV_INSERT: _gqa_opcheck_samples,
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT: _gqa_separate_opcheck_samples,
    GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER: _gqa_by_layer_opcheck_samples,
    SCRATCH: _scratch_opcheck_samples,
}


def _with_tensor_floats(samples: dict) -> dict:
    """``samples`` and, for every op with a ``tensor_floats`` overload, the same samples for it."""
    extended = dict(samples)
    for op, sample in samples.items():
        overload = tensor_floats_overload(op)
        if overload is not None:
            extended[overload] = lambda op=op, sample=sample: _converted(op, sample())
    return extended


def _converted(op, sample):
    if isinstance(sample, list):  # opcheck's sample sets
        return [floats_as_tensors(op, args) for args in sample]
    good, bad, message = sample  # a bad-shape check
    return floats_as_tensors(op, good), floats_as_tensors(op, bad), message


OPCHECK_SAMPLES = _with_tensor_floats(OPCHECK_SAMPLES)


@pytest.mark.parametrize("op", registered_ops(), ids=str)
def test_opcheck(op):
    if op not in OPCHECK_SAMPLES:
        pytest.fail(f"add opcheck samples for {op} to OPCHECK_SAMPLES in {__file__}")
    samples = OPCHECK_SAMPLES[op]()
    assert len(samples) >= 2, f"{op}: give opcheck at least two sample sets"
    with use_arena(ScratchArena()):  # scratch's views come from a throwaway arena
        for args in samples:
            torch.library.opcheck(op, args, test_utils=opcheck_utils(args))


def opcheck_utils(args: tuple) -> tuple[str, ...]:
    """opcheck's checks for one sample: all of them, except test_schema when a tensor is
    float8 (torch's SchemaCheckMode compares before/after with allclose, which has no
    float8 kernel); the fake, faketensor and AOT-dispatch checks still run on it."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for a in args):
        utils = tuple(u for u in utils if u != "test_schema")
    return utils


# --------------------------------------------------------------------------------------
# Fake impls check shapes
# --------------------------------------------------------------------------------------
def _dsv4_bad_shapes() -> tuple[tuple, tuple, str]:
    """(valid args, args with q_out narrower than q, expected message)."""
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu")
    good = inputs.args()
    inputs.q_out = torch.empty(7, 2, 512, dtype=torch.bfloat16)
    return good, inputs.args(), r"q_out: needs at least as many \(padded\) heads as q"


def _dsv4_full_row_bad_shapes() -> tuple[tuple, tuple, str]:
    """(valid args, args whose cache blocks hold fewer rows than block_size, expected message)."""
    inputs = make_dsv4_full_row_inputs(7, 3, 3, 16, "cpu", fmt="fp8")
    good = inputs.args()
    inputs.k_cache = inputs.k_cache[:, :8]
    return good, inputs.args(), r"k_cache: dimension 1 must be block_size"


def _gqa_bad_shapes() -> tuple[tuple, tuple, str]:
    """(valid args, args whose v_cache has one block fewer than k_cache, expected message)."""
    inputs = make_gqa_inputs(7, 3, 1, 64, 16, "cpu")
    good = inputs.args()
    inputs.v_cache = inputs.v_cache[:-1]
    return good, inputs.args(), r"v_cache: dimension 0 must be k_cache's size 0"


def _gqa_separate_bad_shapes() -> tuple[tuple, tuple, str]:
    """(valid args, args whose k has one head fewer than k_cache, expected message)."""
    inputs = make_gqa_inputs(7, 3, 2, 64, 16, "cpu")
    good = inputs.separate_args()
    bad = list(good)
    bad[1] = good[1][:, :64]
    return good, tuple(bad), r"k: dimension 1 must be Hkv \* D, from k_cache's heads"


def _gqa_by_layer_bad_shapes() -> tuple[tuple, tuple, str]:
    """(valid args, args whose q_out has one head fewer than qkv's q, expected message)."""
    inputs = make_gqa_inputs(7, 3, 1, 64, 16, "cpu")
    good = _by_layer(inputs, "prepfuse_opcheck::shapes")
    bad = list(good)
    bad[3] = good[3][:, :2]
    return good, tuple(bad), r"q_out: dimension 1 must be num_q_heads"


def _dsv4_indexer_bad_shapes(fmt: str) -> tuple[tuple, tuple, str]:
    """(valid args, args whose weights_out has one head fewer than q, expected message)."""
    inputs = make_dsv4_indexer_inputs(fmt, 7, 3, 16, "cpu", num_k=5)
    good = inputs.args()
    inputs.weights_out = inputs.weights_out[:, :2]
    return good, inputs.args(), r"weights_out: dimension 1 must be H, q's head count"


def _scratch_bad_shapes() -> tuple[tuple, tuple, str]:
    """(valid args, args with a negative size, expected message)."""
    cpu = torch.device("cpu")
    good, bad = ("x", [7, 8, 512], torch.bfloat16, cpu), ("x", [7, -8, 512], torch.bfloat16, cpu)
    return good, bad, r"shape: sizes must be >= 0"


FAKE_SHAPE_CHECKS: dict[torch._ops.OpOverload, Callable[[], tuple[tuple, tuple, str]]] = {
    DSV4_QNORM_ROPE_KV_INSERT: _dsv4_bad_shapes,
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT: _dsv4_full_row_bad_shapes,
    DSV4_INDEXER_ROPE_FP8_INSERT: lambda: _dsv4_indexer_bad_shapes("fp8"),
    DSV4_INDEXER_ROPE_MXFP4_INSERT: lambda: _dsv4_indexer_bad_shapes("mxfp4"),
    GQA_QKNORM_ROPE_KV_INSERT: _gqa_bad_shapes,
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT: _gqa_separate_bad_shapes,
    GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER: _gqa_by_layer_bad_shapes,
    SCRATCH: _scratch_bad_shapes,
}


FAKE_SHAPE_CHECKS = _with_tensor_floats(FAKE_SHAPE_CHECKS)


@pytest.mark.parametrize("op", registered_ops(), ids=str)
def test_fake_impl_rejects_bad_shapes(op):
    if op not in FAKE_SHAPE_CHECKS:
        pytest.fail(f"add a bad-shape sample for {op} to FAKE_SHAPE_CHECKS in {__file__}")
    good, bad, message = FAKE_SHAPE_CHECKS[op]()
    mode = FakeTensorMode()
    good, bad = tree_map_only(torch.Tensor, mode.from_tensor, (good, bad))
    with mode:
        op(*good)  # the valid call passes, so the error below is the shape check's
        with pytest.raises(ValueError, match=message):
            op(*bad)
