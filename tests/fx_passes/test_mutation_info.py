"""The schema-derived mutation metadata against what functionalization really produces.

Each op is traced through aot_autograd with auto_functionalized v1 and v2. In the
traced graph, the metadata of ``prepfuse.fx_passes.mutation_info`` must name, for every
mutated argument, the ``auto_functionalized`` output that holds its new value (v1) or its
base's new value (v2), and the graph input it writes. That is checked two ways: in the
graph (the named getitem feeds the graph output of that input) and by value (running
the graph, the named output equals what the eager op wrote).

Besides every registered prepfuse op, synthetic ops in a throwaway namespace cover the
corners: a return value, mutated args out of alias-letter order, two mutated views of
one base, and an optional mutable arg passed ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.fx

from prepfuse.fx_passes.mutation_info import (
    MutatedArg,
    functionalized_op,
    mutated_args,
    mutated_inputs,
    output_indices,
    v1_output_indices,
    v2_output_indices,
)
from prepfuse.ops import (
    DSV4_INDEXER_ROPE_FP8_INSERT,
    DSV4_INDEXER_ROPE_MXFP4_INSERT,
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT,
    DSV4_QNORM_ROPE_KV_INSERT,
    GQA_QKNORM_ROPE_KV_INSERT,
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT,
    GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER,
    SCRATCH,
    floats_as_tensors,
    registered_ops,
    tensor_floats_overload,
)
from prepfuse.ops.engine_caches import EngineCaches, register_resolver
from prepfuse.testing import make_dsv4_full_row_inputs, make_dsv4_indexer_inputs, make_dsv4_inputs, make_gqa_inputs
from prepfuse.testing.functionalization import check_functionalization

VERSIONS = ["v1", "v2"]


# --------------------------------------------------------------------------------------
# Every registered prepfuse op
# --------------------------------------------------------------------------------------
REGISTERED_OP_INPUTS: dict[torch._ops.OpOverload, Callable[[], tuple]] = {
    DSV4_QNORM_ROPE_KV_INSERT: lambda: make_dsv4_inputs(7, 3, 8, 16, "cpu", num_inserted=5).args(),
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT: lambda: make_dsv4_full_row_inputs(7, 3, 8, 16, "cpu", num_inserted=5).args(),
    # k_cache and v_cache are two views of one [NB, 2, BS, Hkv, D] buffer: one shared base
    GQA_QKNORM_ROPE_KV_INSERT: lambda: make_gqa_inputs(7, 3, 1, 64, 16, "cpu", num_inserted=5).args(),
    GQA_SEPARATE_QKNORM_ROPE_KV_INSERT: lambda: make_gqa_inputs(7, 3, 1, 64, 16, "cpu", num_inserted=5).separate_args(),
    GQA_QKNORM_ROPE_KV_INSERT_BY_LAYER: lambda: _by_layer_sample(),
    DSV4_INDEXER_ROPE_FP8_INSERT: lambda: make_dsv4_indexer_inputs("fp8", 7, 3, 16, "cpu", num_k=5).args(),
    DSV4_INDEXER_ROPE_MXFP4_INSERT: lambda: make_dsv4_indexer_inputs("mxfp4", 7, 3, 16, "cpu", num_k=5).args(),
}

# each op's tensor_floats overload, sampled from its default's inputs
REGISTERED_OP_INPUTS.update({
    tensor_floats_overload(op): lambda op=op, sample=sample: floats_as_tensors(op, sample())
    for op, sample in REGISTERED_OP_INPUTS.items() if tensor_floats_overload(op) is not None
})


def _by_layer_sample() -> tuple:
    """The by-layer op's arguments, its caches and slots found by a resolver registered here."""
    inputs = make_gqa_inputs(7, 3, 1, 64, 16, "cpu", num_inserted=5)
    register_resolver("prepfuse_mutation_info_test::kv", lambda key: EngineCaches(
        inputs.k_cache, inputs.v_cache, inputs.slot_mapping))
    return inputs.by_layer_args("layers.0", "prepfuse_mutation_info_test::kv")


def test_dsv4_indexer_mutated_args_follow_the_schema():
    assert mutated_args(DSV4_INDEXER_ROPE_FP8_INSERT) == (
        MutatedArg(3, "q_out", "a"), MutatedArg(4, "weights_out", "b"), MutatedArg(5, "k_cache", "c"),
    )
    assert mutated_args(DSV4_INDEXER_ROPE_MXFP4_INSERT) == (
        MutatedArg(3, "q_out", "a"), MutatedArg(4, "q_scale", "b"), MutatedArg(5, "weights_out", "c"),
        MutatedArg(6, "k_cache", "d"),
    )


# ops that write no argument (functionalization calls them as they are): no metadata
WRITES_NOTHING = (SCRATCH,)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("op", registered_ops(), ids=str)
def test_registered_op_metadata_matches_functionalization(op, version):
    if op in WRITES_NOTHING:
        assert mutated_args(op) == () and v1_output_indices(op) == {}
        return
    if op not in REGISTERED_OP_INPUTS:
        pytest.fail(f"add sample inputs for {op} to REGISTERED_OP_INPUTS in {__file__}")
    node = check_functionalization(lambda *args: op(*args), REGISTERED_OP_INPUTS[op](), version)
    if version == "v1":
        assert output_indices(node) == v1_output_indices(op)


def test_dsv4_mutated_args_are_q_out_then_k_cache():
    op = DSV4_QNORM_ROPE_KV_INSERT
    assert mutated_args(op) == (MutatedArg(2, "q_out", "a"), MutatedArg(3, "k_cache", "b"))
    # the production mapping of v1 outputs: {1: q_out, 2: k_cache}
    assert {i: name for name, i in v1_output_indices(op).items()} == {1: "q_out", 2: "k_cache"}
    node = check_functionalization(lambda *a: op(*a), make_dsv4_inputs(7, 3, 8, 16, "cpu").args(), "v1")
    assert output_indices(node) == {"q_out": 1, "k_cache": 2}


def test_gqa_mutated_args_are_q_out_k_cache_v_cache():
    op = GQA_QKNORM_ROPE_KV_INSERT
    assert mutated_args(op) == (
        MutatedArg(3, "q_out", "a"), MutatedArg(4, "k_cache", "b"), MutatedArg(5, "v_cache", "c"),
    )
    assert {i: name for name, i in v1_output_indices(op).items()} == {1: "q_out", 2: "k_cache", 3: "v_cache"}


# --------------------------------------------------------------------------------------
# Synthetic ops for the corners
# --------------------------------------------------------------------------------------
NAMESPACE = "prepfuse_mutation_info_test"


def _with_return(x, y):
    y.add_(1)
    return x * 2


def _unordered(x, w, z):
    x.add_(1)
    z.add_(2)
    return w + 1, w * 2


def _shared_base(x, y, w):
    x.add_(1)
    y.add_(2)
    w.add_(3)


def _optional(x, y):
    x.add_(1)
    if y is not None:
        y.add_(2)


@dataclass(frozen=True)
class SyntheticCase:
    schema: str
    impl: Callable
    fake: Callable
    make_inputs: Callable[[], tuple]
    call: Callable  # call(op, *inputs): the traced function
    expected_v1: dict
    expected_v2: dict

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


SYNTHETIC = {
    c.name: c
    for c in [
        SyntheticCase(
            "with_return(Tensor x, Tensor(a!) y) -> Tensor",
            _with_return,
            lambda x, y: torch.empty_like(x),
            lambda: (torch.randn(4), torch.randn(4)),
            lambda op, x, y: op(x, y) + 1,
            expected_v1={"y": 1},
            expected_v2={"y": 1},
        ),
        # alias sets b before a, two returns, and the graph takes z before x
        SyntheticCase(
            "unordered(Tensor(b!) x, Tensor w, Tensor(a!) z) -> (Tensor, Tensor)",
            _unordered,
            lambda x, w, z: (torch.empty_like(w), torch.empty_like(w)),
            lambda: (torch.randn(3), torch.randn(3), torch.randn(3)),
            lambda op, z, w, x: op(x, w, z),
            expected_v1={"x": 2, "z": 3},
            expected_v2={"x": 2, "z": 3},
        ),
        # x and y are views of one base (passed in reverse row order), w its own tensor
        SyntheticCase(
            "shared_base(Tensor(a!) x, Tensor(b!) y, Tensor(c!) w) -> ()",
            _shared_base,
            lambda x, y, w: None,
            lambda: (torch.randn(2, 3), torch.randn(3)),
            lambda op, b, w: op(b[1], b[0], w),
            expected_v1={"x": 1, "y": 2, "w": 3},
            expected_v2={"x": 1, "y": 1, "w": 2},
        ),
        SyntheticCase(
            "optional(Tensor(a!) x, Tensor(b!)? y) -> ()",
            _optional,
            lambda x, y: None,
            lambda: (torch.randn(3),),
            lambda op, x: op(x, None),
            expected_v1={"x": 1, "y": 2},
            expected_v2={"x": 1, "y": None},
        ),
    ]
}


@pytest.fixture(scope="module")
def synthetic_ops():
    lib = torch.library.Library(NAMESPACE, "DEF")
    try:
        for case in SYNTHETIC.values():
            lib.define(case.schema)
            lib.impl(case.name, case.impl, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{case.name}", case.fake, lib=lib)
        yield {name: getattr(getattr(torch.ops, NAMESPACE), name).default for name in SYNTHETIC}
    finally:
        lib._destroy()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_op_metadata_matches_functionalization(synthetic_ops, name, version):
    case, op = SYNTHETIC[name], synthetic_ops[name]
    node = check_functionalization(lambda *inputs: case.call(op, *inputs), case.make_inputs(), version)
    assert output_indices(node) == (case.expected_v1 if version == "v1" else case.expected_v2)


def test_unordered_alias_sets_follow_schema_order(synthetic_ops):
    assert mutated_args(synthetic_ops["unordered"]) == (MutatedArg(0, "x", "b"), MutatedArg(2, "z", "a"))
    assert v1_output_indices(synthetic_ops["unordered"]) == {"x": 2, "z": 3}


def test_shared_base_views_share_one_v2_output(synthetic_ops):
    case, op = SYNTHETIC["shared_base"], synthetic_ops["shared_base"]
    node = check_functionalization(lambda *inputs: case.call(op, *inputs), case.make_inputs(), "v2")
    targets = mutated_inputs(node)
    assert targets["x"] is targets["y"] is not targets["w"]
    assert [n.op for n in (targets["x"], targets["w"])] == ["placeholder", "placeholder"]
    indices = v2_output_indices(op, node.kwargs)
    assert indices["x"] == indices["y"] != indices["w"]
    assert len(node.kwargs["_all_bases"]) == 2


def test_optional_none_has_no_v2_base(synthetic_ops):
    case, op = SYNTHETIC["optional"], synthetic_ops["optional"]
    node = check_functionalization(lambda *inputs: case.call(op, *inputs), case.make_inputs(), "v2")
    assert mutated_inputs(node)["y"] is None
    assert node.kwargs["_y_base_index"] is None


def test_non_functionalized_node_is_rejected():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.relu.default, (x,))
    assert functionalized_op(node) is None
    with pytest.raises(ValueError, match="not an auto_functionalized call"):
        output_indices(node)
    with pytest.raises(ValueError, match="not an auto_functionalized call"):
        mutated_inputs(node)


@pytest.mark.skipif(not hasattr(torch.Tag, "out"), reason="this torch has no out/inplace op tags")
def test_ops_tagged_out_or_inplace_are_refused():
    # functionalization treats these tags specially (always v2; no bases after an out
    # op's returns), so deriving v1-style indices for them would be wrong
    with pytest.raises(NotImplementedError, match="out/inplace"):
        mutated_args(torch.ops.aten.add_.Tensor)
    with pytest.raises(NotImplementedError, match="out/inplace"):
        mutated_args(torch.ops.aten.add.out)
