"""The kit on an engine team's own ops, through its public API only.

A separate namespace (``prepfuse_kit_demo``) holds three mutating ops of the forms engine
ops take: a labelled alias annotation (``Tensor(a!) cache``), an unlabelled one
(``Tensor! out``), an optional mutable argument (``Tensor(b!)? stats``) and a return value.
The tests use ``prepfuse.testing.drift``, ``prepfuse.testing.functionalization``, the
``defunctionalize`` pass through the backend's ``namespaces`` option,
``prepfuse.testing.golden`` and ``prepfuse.testing.passes``, and prepfuse's pass object
composed with another custom pass through torch's own hook
(``prepfuse.fx_passes.pipeline``).
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from prepfuse.backend import PrepfuseBackend, post_grad_pass
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.registry import register_pass, unregister_pass
from prepfuse.fx_passes.pipeline import ComposedPass, post_grad_hook
from prepfuse.testing.drift import check_schemas, schemas_of
from prepfuse.testing.functionalization import check_functionalization
from prepfuse.testing.golden import GoldenFiles
from prepfuse.testing.passes import compile_beside_eager

NS = "prepfuse_kit_demo"
GOLDEN = GoldenFiles.beside(__file__)
SCHEMAS = {
    "write_rows": "write_rows(Tensor rows, Tensor(a!) cache, Tensor slots) -> ()",
    "scale_into": "scale_into(Tensor x, Tensor! out, float s) -> ()",
    "norm_into": "norm_into(Tensor x, Tensor(a!) out, Tensor(b!)? stats) -> Tensor",
}

_LIB = torch.library.Library(NS, "DEF")  # lives as long as the test module
for _schema in SCHEMAS.values():
    _LIB.define(_schema)


def _write_rows(rows, cache, slots):
    cache.index_copy_(0, slots, rows)


def _scale_into(x, out, s):
    out.copy_(x * s)


def _norm_into(x, out, stats):
    peak = x.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    out.copy_(x / peak)
    if stats is not None:
        stats.copy_(peak.squeeze(-1))
    return x.sum(-1)


for _name, _impl in (("write_rows", _write_rows), ("scale_into", _scale_into), ("norm_into", _norm_into)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::write_rows", lambda rows, cache, slots: None, lib=_LIB)
torch.library.register_fake(f"{NS}::scale_into", lambda x, out, s: None, lib=_LIB)
torch.library.register_fake(f"{NS}::norm_into", lambda x, out, stats: x.sum(-1), lib=_LIB)
OPS = getattr(torch.ops, NS)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def samples(with_stats: bool = True):
    x = torch.randn(4, 8)
    return {
        "write_rows": (torch.randn(2, 8), torch.zeros(6, 8), torch.tensor([4, 1])),
        "scale_into": (x, torch.zeros(4, 8), 3.0),
        "norm_into": (x, torch.zeros(4, 8), torch.zeros(4) if with_stats else None),
    }


def model(x, cache, slots, scaled, normed, stats):
    """Engine code calling its three ops into its own buffers."""
    OPS.scale_into(x, scaled, 0.5)
    total = OPS.norm_into(scaled, normed, stats)
    OPS.write_rows(normed[:2], cache, slots)
    return total * 2


def model_args():
    return (torch.randn(4, 8), torch.zeros(6, 8), torch.tensor([5, 0]), torch.zeros(4, 8), torch.zeros(4, 8),
            torch.zeros(4))


def clone(args):
    return tuple(a.clone() for a in args)


# --------------------------------------------------------------------------------------
# Schema drift
# --------------------------------------------------------------------------------------
def test_drift_snapshot_passes_then_fails_with_the_diff_when_one_schema_changes(tmp_path, monkeypatch):
    for var in ("PREPFUSE_ACCEPT", "EXPECTTEST_ACCEPT"):
        monkeypatch.delenv(var, raising=False)
    snapshot = tmp_path / "kit_schemas.txt"
    with pytest.raises(AssertionError, match="does not exist"):
        check_schemas(snapshot, namespace=NS)
    monkeypatch.setenv("PREPFUSE_ACCEPT", "1")
    check_schemas(snapshot, namespace=NS)  # writes it
    monkeypatch.delenv("PREPFUSE_ACCEPT")
    check_schemas(snapshot, namespace=NS)
    registered = {name: str(getattr(OPS, name).default._schema) for name in SCHEMAS}
    assert schemas_of(namespace=NS) == sorted(registered.values())
    assert schemas_of(ops=[OPS.write_rows]) == [registered["write_rows"]]
    assert registered["scale_into"].startswith(f"{NS}::scale_into(Tensor x, Tensor(") and "!" in registered["scale_into"]

    # the snapshot as it was before someone renamed an argument of write_rows
    old = snapshot.read_text().replace("Tensor slots)", "Tensor slot_mapping)")
    snapshot.write_text(old)
    with pytest.raises(AssertionError) as err:
        check_schemas(snapshot, namespace=NS)
    message = str(err.value)
    assert f"-{NS}::write_rows(Tensor rows, Tensor(a!) cache, Tensor slot_mapping) -> ()" in message
    assert f"+{registered['write_rows']}" in message
    assert f"changed: {NS}::write_rows" in message and "scale_into" not in message.split("changed:")[1]


# --------------------------------------------------------------------------------------
# Functionalization metadata against what torch traces
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_functionalization_metadata_matches_torch(name, version):
    check_functionalization(getattr(OPS, name).default, samples()[name], version)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_functionalization_with_the_optional_mutable_argument_absent(version):
    check_functionalization(OPS.norm_into.default, samples(with_stats=False)["norm_into"], version)


# --------------------------------------------------------------------------------------
# Defunctionalization for the namespace, zero copies, golden graph
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_defunctionalize_handles_the_namespace_with_no_copy(v2):
    backend = PrepfuseBackend({"passes": ("defunctionalize",), "namespaces": ("prepfuse", NS), "strict": True,
                               "auto_functionalized_v2": v2, "record_graphs": True})
    args = model_args()
    ref_args = clone(args)
    out, (code,) = run_and_get_code(torch.compile(model, backend=backend, fullgraph=True), *args)
    ref = model(*ref_args)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(args, ref_args))
    (report,) = backend.reports
    assert report.matched_counts == {"defunctionalize": 3}
    assert report.functionalized_left == [] and report.namespaces == ("prepfuse", NS)
    assert f"auto_functionalized prepfuse and {NS} calls left: none" in report.format()
    FileCheck().check_not("auto_functionalized").run(code)
    FileCheck().check_not("clone").check_not("copy_").check_not("empty_strided_cpu((6, 8)").run(code)
    for name in SCHEMAS:
        FileCheck().check_count(f"torch.ops.{NS}.{name}.default(", 1, exactly=True).run(code)
    GOLDEN.check(report.graph, "defunctionalized_v2" if v2 else "defunctionalized_v1")


def test_without_the_namespace_the_calls_stay_functional():
    """Left to prepfuse's default namespaces, the pass leaves the engine's calls alone (the
    backend's compile_beside_eager harness, as prepfuse's pass tests use it)."""
    args = model_args()
    out, ref, report = compile_beside_eager(model, args, clone(args), passes=("defunctionalize",), v2=True)
    assert torch.equal(out, ref)
    assert report.matched_counts == {"defunctionalize": 0}


# --------------------------------------------------------------------------------------
# prepfuse's passes inside someone else's pipeline
# --------------------------------------------------------------------------------------
class CountingPass(CustomGraphPass):
    """An engine's own post-grad pass: counts the graphs it saw and the kit calls left
    functional in them (0 after prepfuse's defunctionalize ran first)."""

    def __init__(self, tag: str = "v1") -> None:
        self.tag, self.graphs, self.functional_calls = tag, 0, 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        self.functional_calls += sum(1 for n in graph.nodes if "auto_functionalized" in str(n.target))

    def uuid(self) -> str:
        return f"counting-pass-{self.tag}"


def test_prepfuse_runs_composed_with_another_pass_through_torchs_hook():
    prepfuse_passes = post_grad_pass({"passes": ("defunctionalize",), "namespaces": ("prepfuse", NS)})
    theirs = CountingPass()
    args = model_args()
    ref_args = clone(args)
    compiled = torch.compile(model, backend="inductor", fullgraph=True, options={
        "post_grad_custom_post_pass": post_grad_hook(prepfuse_passes, theirs), "fx_graph_cache": False})
    assert torch.equal(compiled(*args), model(*ref_args))
    (report,) = prepfuse_passes.reports
    assert report.matched_counts == {"defunctionalize": 3}  # prepfuse's passes ran
    assert theirs.graphs == 1 and theirs.functional_calls == 0  # and theirs, after them


def test_the_composed_uuid_changes_when_either_pass_changes():
    ours = post_grad_pass({"passes": ("defunctionalize",), "namespaces": ("prepfuse", NS)})
    base = ComposedPass(ours, CountingPass("v1")).uuid()
    assert base == ComposedPass(post_grad_pass({"passes": ("defunctionalize",), "namespaces": ("prepfuse", NS)}),
                                CountingPass("v1")).uuid()
    assert base != ComposedPass(ours, CountingPass("v2")).uuid()
    assert base != ComposedPass(post_grad_pass({"passes": ("defunctionalize",)}), CountingPass("v1")).uuid()
    with pytest.raises(ValueError, match="not a torch._inductor.custom_graph_pass.CustomGraphPass"):
        post_grad_hook(ours, lambda graph: None)


class MarkPass(PrepfusePass):
    """An engine's own pass written with the kit (a ``PrepfusePass``), counting its runs."""

    name = "kit_mark"
    runs = 0

    def run(self, graph: torch.fx.Graph) -> int:
        MarkPass.runs += 1
        return 0


def test_a_pass_used_in_both_kit_sections_runs_once_per_graph():
    """Registered for the pass tests (by name) and composed beside prepfuse's passes on
    torch's hook: prepfuse's default passes are its own only, so the engine's runs once."""
    register_pass(MarkPass)
    MarkPass.runs = 0
    try:
        prepfuse_passes = post_grad_pass({"namespaces": ("prepfuse", NS)})
        assert "kit_mark" not in prepfuse_passes.pass_names
        args = model_args()
        compiled = torch.compile(model, backend="inductor", fullgraph=True, options={
            "post_grad_custom_post_pass": post_grad_hook(prepfuse_passes, MarkPass()), "fx_graph_cache": False})
        compiled(*args)
        assert MarkPass.runs == 1 and len(prepfuse_passes.reports) == 1
        # named, it runs inside prepfuse's compile: by name once registered, or as the class itself
        for entry in ("kit_mark", MarkPass):
            args = model_args()
            ref = model(*clone(args))
            out, _, report = compile_beside_eager(model, args, clone(args), passes=(entry, "defunctionalize"), v2=True)
            assert torch.equal(out, ref) and report.passes == ("kit_mark", "defunctionalize")
        assert MarkPass.runs == 3
    finally:
        unregister_pass(MarkPass.name)
