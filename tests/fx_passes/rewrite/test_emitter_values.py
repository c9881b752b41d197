"""The fake value ``Emitter`` gives a functional call (``auto_functionalized`` v1 and v2) is laid out
as the higher-order op's own fake path gives it, for every registered prepfuse op; and a call the
op's fake impl refuses is still refused when the call is emitted."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from prepfuse._compat import auto_functionalized_ops
from prepfuse.fx_passes.rewrite.emitter import Emitter
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
from tests.fx_passes.test_mutation_info import REGISTERED_OP_INPUTS


def _call_of(op, args: tuple, v2: bool = True):
    """``op(*args)`` emitted into a graph of placeholders: (the functional call's node, the
    getitems of the written arguments, the fake mode)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    graph = torch.fx.Graph()
    kwargs = {}
    for arg, value in zip(op._schema.arguments, args):
        kwargs[arg.name] = value
        if isinstance(value, torch.Tensor):
            kwargs[arg.name] = graph.placeholder(arg.name)
            kwargs[arg.name].meta["val"] = mode.from_tensor(value)
    emit = Emitter(graph, graph.output(()), source=next(iter(graph.nodes)))
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2):
        written = emit.functional_call(op, kwargs)
    call = next(n for n in graph.nodes if n.target in auto_functionalized_ops())
    return call, written, mode


def _emitted(op, args: tuple, v2: bool):
    """(the emitted call's fake value, the higher-order op's own fake value) for ``op(*args)``."""
    call, _, mode = _call_of(op, args, v2)
    hop_kwargs = torch.fx.node.map_arg(call.kwargs, lambda n: n.meta["val"])
    with mode:
        expected = call.target(op, **hop_kwargs)
    return call.meta["val"], expected


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("op", list(REGISTERED_OP_INPUTS), ids=str)
def test_functional_call_value_is_laid_out_as_the_higher_order_ops(op, v2):
    got, want = _emitted(op, REGISTERED_OP_INPUTS[op](), v2)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if not isinstance(w, torch.Tensor):
            assert g is w is None
            continue
        assert (g.shape, g.stride(), g.storage_offset(), g.dtype, g.device) == \
            (w.shape, w.stride(), w.storage_offset(), w.dtype, w.device)


def test_a_call_the_fake_impl_refuses_is_refused_when_emitted():
    from prepfuse.testing import make_dsv4_inputs

    args = list(make_dsv4_inputs(5, 3, 8, 16, "cpu").args())
    args[0] = args[0].float()  # q must be bf16
    with pytest.raises(ValueError, match="^q: "):
        _emitted(DSV4_QNORM_ROPE_KV_INSERT, tuple(args), True)


def test_getitems_follow_the_value():
    """The getitems of the written arguments carry the value's elements."""
    from prepfuse.testing import make_dsv4_inputs

    args = make_dsv4_inputs(5, 3, 8, 16, "cpu").args()
    _, written, _ = _call_of(DSV4_QNORM_ROPE_KV_INSERT, args)
    names = [a.name for a in DSV4_QNORM_ROPE_KV_INSERT._schema.arguments]
    for name, node in written.items():
        assert node.target is operator.getitem
        assert node.meta["val"].shape == args[names.index(name)].shape
