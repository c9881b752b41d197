"""The ``prepfuse`` torch.compile backend: registration, options, uuid, reports, dumps.

Compiles run on the CPU on a module that calls the fused op directly (no kernels for
Inductor to build, so each compile takes well under a second), with the FX graph cache
off unless a test is about the cache.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch._inductor.utils import fresh_inductor_cache

import prepfuse
from prepfuse.backend import (
    PrepfuseBackend,
    PrepfuseOptions,
    clear_reports,
    last_reports,
    prepfuse_backend,
    reports,
)
from prepfuse.fx_passes import registry
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.defunctionalize import DefunctionalizePass
from prepfuse.fx_passes.pass_manager import PrepfusePassManager
from prepfuse.fx_passes.placement import PlacementPass
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT
from prepfuse.testing import make_dsv4_inputs

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")


@pytest.fixture(autouse=True)
def fresh_reports(fresh_dynamo):
    """fresh_dynamo (tests/conftest.py), and no report left from an earlier test."""
    clear_reports()
    yield


class DirectCall(torch.nn.Module):
    def forward(self, q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache):
        DSV4_QNORM_ROPE_KV_INSERT(q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, 1e-6, 16)


def run_compiled(backend="prepfuse", **compile_kwargs):
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu")
    torch.compile(DirectCall(), backend=backend, fullgraph=True, **compile_kwargs)(*inputs.args()[:7])


# --------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------
def test_registered_by_name():
    assert "prepfuse" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("prepfuse") is prepfuse_backend
    assert prepfuse.backend.prepfuse_backend is prepfuse_backend


def test_entry_point_declared_and_installed():
    tomllib = pytest.importorskip("tomllib")
    with open(PYPROJECT, "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["torch_dynamo_backends"]
    assert declared == {"prepfuse": "prepfuse.backend:prepfuse_backend"}
    try:
        importlib.metadata.distribution("prepfuse")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("prepfuse runs from a source tree, not installed: no entry points to read")
    installed = {ep.name: ep for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert "prepfuse" in installed, "installed metadata predates the entry point: pip install -e ."
    assert installed["prepfuse"].value == declared["prepfuse"]
    assert installed["prepfuse"].load() is prepfuse_backend


def test_entry_point_works_without_importing_prepfuse():
    try:
        importlib.metadata.distribution("prepfuse")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("prepfuse runs from a source tree, not installed: no entry points to read")
    script = (
        "import sys, torch\n"
        "assert 'prepfuse' not in sys.modules\n"
        "backend = torch._dynamo.lookup_backend('prepfuse')\n"
        "assert 'prepfuse' in sys.modules and backend.__module__ == 'prepfuse.backend', backend\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(PYPROJECT), timeout=120)


def test_reregistering_is_harmless():
    from prepfuse._compat import register_dynamo_backend

    register_dynamo_backend("prepfuse", prepfuse_backend)
    assert torch._dynamo.lookup_backend("prepfuse") is prepfuse_backend


# --------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------
def test_default_options_run_prepfuses_own_passes_defunctionalize_last():
    opts = PrepfuseOptions()
    assert opts.passes == registry.default_passes() == tuple(p.name for p in registry.BUILTIN_PASSES)
    assert opts.passes[-1] == "defunctionalize" and opts.passes[0] == "fuse_dsv4_prep"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bogus": 1}, r"unknown prepfuse option\(s\) 'bogus'; valid options: passes, debug_dir, auto_functionalized_v2"),
        ({"passes": ("no_such_pass",)}, r"unknown prepfuse pass 'no_such_pass'; available: .*defunctionalize"),
        ({"passes": "defunctionalize"}, r"passes: expected a sequence of pass names, classes or instances"),
        ({"passes": (42,)}, r"passes: expected pass names, PrepfusePass subclasses or PrepfusePass instances, got 42"),
        ({"passes": (PlacementPass,)}, r"'placement' is the backend's own pass"),
        ({"passes": (DefunctionalizePass(), "fuse_gqa_prep")}, r"'defunctionalize' must come last"),
        ({"passes": ("defunctionalize", "defunctionalize")}, r"named twice"),
        ({"auto_functionalized_v2": "yes"}, r"auto_functionalized_v2: expected None, True or False"),
        ({"strict": 1}, r"strict: expected True or False"),
        ({"inductor_config": {"no_such_knob": 1}}, r"'no_such_knob' is not an Inductor config name"),
        ({"inductor_config": {"post_grad_custom_post_pass": None}}, r"is set by the backend"),
        ({"inductor_config": {"enable_auto_functionalized_v2": False}}, r"use the auto_functionalized_v2 option"),
        ({"debug_dir": 3}, r"debug_dir: expected a path"),
        ({"cudagraphs": "partial"}, r"cudagraphs: expected one of 'none', 'piecewise', 'full', got 'partial'"),
        ({"cudagraphs": True}, r"cudagraphs: expected one of"),
        ({"output_buffers": "heap"}, r"output_buffers: expected one of 'arena', 'graph', got 'heap'"),
        ({"splitting_ops": "prepfuse_test::attention"}, r"splitting_ops: expected a list of ops"),
        ({"splitting_ops": ["attention"]}, r"splitting_ops: expected ops or 'namespace::name\[.overload\]' strings"),
        ({"splitting_ops": ["nowhere::attention"]}, r"splitting_ops: no op 'nowhere::attention' is registered"),
        ({"splitting_ops": ["aten::mm.no_such_overload"]}, r"splitting_ops: no op 'aten::mm.no_such_overload'"),
        ({"splitting_ops": ["aten::mm", "aten::mm"]}, r"splitting_ops: an op is named twice"),
        ({"splitting_ops": ["aten::mm"], "cudagraphs": "full"}, r"splitting_ops: cudagraphs='full' captures the whole forward"),
        ({"cudagraphs": "piecewise", "inductor_config": {"graph_partition": False}},
         r"inductor_config: 'graph_partition' is set by cudagraphs='piecewise'"),
    ],
)
def test_options_validated(options, message):
    with pytest.raises(ValueError, match=message):
        PrepfuseOptions.from_mapping(options)


def test_options_are_frozen_and_normalized(tmp_path):
    opts = PrepfuseOptions.from_mapping(
        {"passes": ["defunctionalize"], "debug_dir": tmp_path, "inductor_config": {"triton.cudagraphs": False}}
    )
    assert opts.passes == ("defunctionalize",) and opts.debug_dir == str(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.strict = True
    with pytest.raises(TypeError):
        opts.inductor_config["max_autotune"] = True
    assert opts.config_patches() == {"triton.cudagraphs": False, "fx_graph_cache": False}


def test_bad_options_fail_the_compile():
    with pytest.raises(Exception, match="unknown prepfuse option"):
        run_compiled(options={"bogus": 1})


def test_builtin_passes_run_fusion_first_and_defunctionalize_last():
    assert list(registry.registered_passes()) == [
        "fuse_dsv4_prep", "fuse_dsv4_indexer_prep", "fuse_dsv4_indexer_mxfp4_prep", "fuse_gqa_prep", "defunctionalize",
    ]
    with pytest.raises(ValueError, match="built-in pass"):
        registry.unregister_pass("fuse_gqa_prep")


class CountingPass(PrepfusePass):
    """An engine's own pass: counts the graphs it ran on, across its copies."""

    name = "counting_for_test"
    seen: list = []

    def __init__(self, tag: str = "a") -> None:
        super().__init__()
        self.tag = tag

    def settings(self) -> tuple:
        return (self.tag,)

    def run(self, graph):
        CountingPass.seen.append(self.tag)
        return 0


@pytest.fixture
def counting():
    CountingPass.seen = []
    yield CountingPass.seen
    registry.unregister_pass(CountingPass.name)


def test_a_registered_pass_runs_only_where_named(counting):
    registry.register_pass(CountingPass)
    assert "counting_for_test" in registry.registered_passes()
    assert "counting_for_test" not in PrepfuseOptions().passes  # not a default: other compiles never run it
    run_compiled()
    assert counting == [] and "counting_for_test" not in last_reports()[0].passes
    run_compiled(options={"passes": registry.default_passes("counting_for_test")})
    assert counting == ["a"]
    assert last_reports()[0].passes == (*registry.default_passes()[:-1], "counting_for_test", "defunctionalize")


@pytest.mark.parametrize("entry", [CountingPass, CountingPass("b")], ids=["class", "instance"])
def test_passes_take_a_class_or_an_instance_without_registering(counting, entry):
    backend = PrepfuseBackend({"passes": registry.default_passes(entry)})
    run_compiled(backend=backend)
    torch._dynamo.reset()
    run_compiled(backend=backend)  # a second compile by the same backend
    tag = "a" if isinstance(entry, type) else "b"
    assert counting == [tag, tag] and "counting_for_test" not in registry.registered_passes()
    (first, second) = backend.reports
    assert first.passes == second.passes == backend.options.pass_names
    assert backend.options.pass_names[-2:] == ("counting_for_test", "defunctionalize")
    if not isinstance(entry, type):
        assert entry.matched_count == 0 and entry.log.events == []  # each compile ran a copy
    # the uuid comes from the pass's source and settings, never from the object's identity
    same = PrepfuseBackend({"passes": registry.default_passes(CountingPass if tag == "a" else CountingPass("b"))})
    assert same.pass_manager().uuid() == backend.pass_manager().uuid()
    other = PrepfuseBackend({"passes": registry.default_passes(CountingPass("c"))})
    assert other.pass_manager().uuid() != backend.pass_manager().uuid()


def test_the_defunctionalize_class_takes_the_namespaces_option():
    backend = PrepfuseBackend({"passes": (DefunctionalizePass,), "namespaces": ("prepfuse", "myns")})
    (p,) = backend.pass_manager().passes
    assert p.namespaces == ("prepfuse", "myns")
    assert backend.pass_manager().uuid() == PrepfuseBackend(
        {"passes": ("defunctionalize",), "namespaces": ("prepfuse", "myns")}).pass_manager().uuid()


# --------------------------------------------------------------------------------------
# Config stays local; options take effect
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("v2", [pytest.param(False, id="v1"), pytest.param(True, id="v2")])
def test_options_apply_to_this_compile_only(v2):
    default_v2 = torch._inductor.config.enable_auto_functionalized_v2
    run_compiled(options={"auto_functionalized_v2": v2})
    (report,) = last_reports()
    assert report.pattern_counts() == {f"{DSV4_QNORM_ROPE_KV_INSERT}/{'v2' if v2 else 'v1'}": 1}
    assert torch._inductor.config.post_grad_custom_post_pass is None
    assert torch._inductor.config.enable_auto_functionalized_v2 == default_v2


def test_strict_fails_when_auto_functionalized_survives():
    manager = PrepfusePassManager([], strict=True)  # a manager without defunctionalize: the op stays functional
    with pytest.raises(Exception, match=r"prepfuse \(strict\): auto_functionalized calls of prepfuse ops survived"):
        run_compiled(backend="inductor", options={"post_grad_custom_post_pass": manager})


# --------------------------------------------------------------------------------------
# uuid
# --------------------------------------------------------------------------------------
def manager_uuid(**options) -> str:
    return PrepfuseBackend(options).pass_manager().uuid()


def test_uuid_is_stable():
    assert manager_uuid() == manager_uuid()
    assert manager_uuid(debug_dir="/tmp/x", record_graphs=True) == manager_uuid()  # dumps change no code


@pytest.mark.parametrize(
    "options",
    [
        {"passes": ()},
        {"auto_functionalized_v2": True},
        {"auto_functionalized_v2": False},
        {"inductor_config": {"max_autotune": True}},
        {"strict": True},
        {"splitting_ops": ["aten::mm"]},
        {"cudagraphs": "piecewise", "splitting_ops": ["aten::mm"]},
        {"cudagraphs": "full"},
        {"output_buffers": "graph"},
    ],
)
def test_uuid_changes_with_options(options):
    assert manager_uuid(**options) != manager_uuid()


def test_uuid_tells_piecewise_from_the_same_splitting_ops_uncaptured():
    assert manager_uuid(cudagraphs="piecewise", splitting_ops=["aten::mm"]) != manager_uuid(splitting_ops=["aten::mm"])


def test_uuid_changes_with_pass_settings_and_source():
    base = PrepfusePassManager([DefunctionalizePass()]).uuid()
    assert PrepfusePassManager([DefunctionalizePass()]).uuid() == base
    assert PrepfusePassManager([DefunctionalizePass(namespaces=("prepfuse", "mine"))]).uuid() != base

    class PatternA(PrepfusePass):
        name = "pattern"

        def run(self, graph):
            return 0

    class PatternB(PrepfusePass):  # same name, different code: a changed pattern
        name = "pattern"

        def run(self, graph):
            return len(graph.nodes) * 0

    a = PrepfusePassManager([PatternA(), DefunctionalizePass()]).uuid()
    b = PrepfusePassManager([PatternB(), DefunctionalizePass()]).uuid()
    assert len({a, b, base}) == 3
    assert PrepfusePassManager([DefunctionalizePass(), PatternA()]).uuid() != a  # order matters


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------
def test_report_says_what_matched_and_where():
    run_compiled(options={"passes": ("defunctionalize",)})
    (report,) = last_reports()
    assert list(reports()) == [report]
    assert report.passes == ("defunctionalize",) and not report.cached
    assert report.matched_counts == {"defunctionalize": 1} and report.count("defunctionalize") == 1
    (match,) = report.matches()
    assert match.anchor.startswith("auto_functionalized")
    assert match.source.startswith("test_backend.py:") and "DSV4_QNORM_ROPE_KV_INSERT(q, kv, q_out" in match.source
    assert report.ops_after == {str(DSV4_QNORM_ROPE_KV_INSERT): 1}
    assert report.functionalized_left == []
    text = report.format()
    assert text.splitlines()[0].endswith("passes defunctionalize")
    assert "pass             pattern" in text and match.anchor in text and match.source in text
    assert report.namespaces == ("prepfuse",) and "auto_functionalized prepfuse calls left: none" in text
    assert last_reports().pattern_counts() == report.pattern_counts()
    clear_reports()
    assert len(reports()) == 0 and last_reports().format() == "prepfuse: no graph compiled"


class DecliningPass(PrepfusePass):
    """Declines every placeholder, to put near misses in a report."""

    name = "declining_for_test"

    def run(self, graph):
        for node in graph.find_nodes(op="placeholder")[:2]:
            self.log.declined(self.name, "toy_pattern", node, "eps is 1e-5, the pattern wants 1e-6")
        return 0


def test_near_misses_at_debug():
    backend = PrepfuseBackend({"passes": (DecliningPass, "defunctionalize")})
    run_compiled(backend=backend)
    (report,) = backend.reports
    assert [r.why for r in report.near_misses()] == ["eps is 1e-5, the pattern wants 1e-6"] * 2
    assert "near misses: 2 (format(verbose=True)" in report.format(verbose=False)
    assert "eps is 1e-5" in report.format(verbose=True)
    logger = logging.getLogger("prepfuse")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        assert "eps is 1e-5" in report.format()
    finally:
        logger.setLevel(level)
    assert list(reports()) == [report]  # a backend object's graphs also reach the module log


def test_debug_dir_dumps_every_pass(tmp_path):
    run_compiled(options={"passes": ("defunctionalize",), "debug_dir": str(tmp_path)})
    (folder,) = tmp_path.iterdir()
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["00_defunctionalize.after.py", "00_defunctionalize.before.py", "report.txt"]
    before = (folder / "00_defunctionalize.before.py").read_text()
    after = (folder / "00_defunctionalize.after.py").read_text()
    assert "auto_functionalized" in before and "copy_" in before
    assert "auto_functionalized" not in after and "torch.ops.prepfuse.dsv4_qnorm_rope_kv_insert.default(" in after
    assert "defunctionalize" in (folder / "report.txt").read_text()


def test_cache_hit_is_reported():
    with torch._inductor.config.patch(fx_graph_cache=True), fresh_inductor_cache():
        run_compiled(options={"passes": ("defunctionalize",)})
        torch._dynamo.reset()
        run_compiled(options={"passes": ("defunctionalize",)})
    first, second = reports()
    assert not first.cached and first.count("defunctionalize") == 1
    # the warm compile ran no pass, and reports what the compile that wrote the cached code did
    assert second.cached and second.count("defunctionalize") == 1
    assert "served from Inductor's cache: the report of the compile that wrote it" in second.format()


def test_a_cache_hit_without_a_kept_report_says_how_to_see_one(monkeypatch):
    from prepfuse import backend as backend_module

    with torch._inductor.config.patch(fx_graph_cache=True), fresh_inductor_cache():
        run_compiled(options={"passes": ("defunctionalize",)})
        torch._dynamo.reset()
        monkeypatch.setattr(backend_module, "load_reports", lambda key: None)  # written by another prepfuse
        run_compiled(options={"passes": ("defunctionalize",)})
    second = reports()[1]
    assert second.cached and second.count("defunctionalize") == 0
    hint = "options={'inductor_config': {'fx_graph_cache': False}}"
    assert hint in second.format()
    PrepfuseOptions.from_mapping({"inductor_config": {"fx_graph_cache": False}})  # the hint is an accepted spelling


# --------------------------------------------------------------------------------------
# Options that were accepted and meant something else (issue: reliability, item 9)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, why", [
    ({"passes": (p for p in ["fuse_gqa_prep"])},
     r"passes: expected a sequence of pass names, classes or instances \(a list or tuple\)"),
    ({"passes": ("defunctionalize", "fuse_gqa_prep")}, "'defunctionalize' must come last"),
    ({"inductor_config": {"fx_graph_cache": "no"}}, "'fx_graph_cache' takes True or False"),  # "no" is true
    ({"cudagraphs": "piecewise"}, "'piecewise' cuts the graph at splitting_ops, and none are given"),
    ({"splitting_ops": ("aten::mm", "aten::mm.default"), "cudagraphs": "piecewise"},
     "'aten::mm.default' is already covered by 'aten::mm'"),
    # strict fails every compile that fuses when nothing defunctionalizes the fused calls
    ({"passes": ("fuse_gqa_prep",), "strict": True}, "^strict: .* without the 'defunctionalize' pass every fused op"),
    ({1: True, "strict": True}, r"^prepfuse options: keys must be option names \(str\), got \[1\]"),  # was TypeError '<'
    # a hook Inductor would call only once the compile reached it
    ({"inductor_config": {"post_grad_custom_pre_pass": "x"}}, "'post_grad_custom_pre_pass' takes a graph pass"),
    ({"inductor_config": {"joint_custom_post_pass": 3}}, "'joint_custom_post_pass' takes a graph pass"),
])
def test_options_that_meant_something_else_are_refused(options, why):
    with pytest.raises(ValueError, match=why):
        PrepfuseOptions.from_mapping(options)


def test_an_unwritable_debug_dir_is_refused_up_front(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="debug_dir: cannot create"):
        PrepfuseOptions(debug_dir=str(blocker / "dumps"))


def test_options_hash_and_backends_pickle_and_copy():
    import copy
    import pickle

    opts = PrepfuseOptions(inductor_config={"max_autotune": False}, strict=True)
    assert hash(opts) == hash(PrepfuseOptions(inductor_config={"max_autotune": False}, strict=True))
    assert pickle.loads(pickle.dumps(opts)) == opts and copy.deepcopy(opts) == opts
    backend = PrepfuseBackend(opts)
    assert copy.deepcopy(backend).options == opts and pickle.loads(pickle.dumps(backend)).options == opts


# --------------------------------------------------------------------------------------
# A returned arena view
# --------------------------------------------------------------------------------------
def prep_returning_q(q, kv, k_cache, slot_mapping, positions, cos_sin_cache):
    from prepfuse.models import dsv4

    q_out = dsv4.dsv4_q_prep(q, positions, cos_sin_cache, 1e-6, 8, dsv4.DSV4_SPELLINGS[0])
    dsv4.dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, 16, dsv4.DSV4_SPELLINGS[0])
    return q_out


@pytest.mark.parametrize("output_buffers, warned", [("arena", True), ("graph", False)])
def test_a_graph_returning_the_fused_q_warns_once_naming_the_option(output_buffers, warned, caplog, monkeypatch):
    """The returned padded q is an arena view that the next run of any graph fusing the same
    op overwrites: said once per process at compile time, with the option that avoids it."""
    from prepfuse.fx_passes import pass_manager

    monkeypatch.setattr(pass_manager, "_warned_returned", False)
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu", skip_fraction=0.0)
    args = (inputs.q, inputs.kv, inputs.k_cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)
    with caplog.at_level(logging.WARNING, logger="prepfuse.passes"):
        for _ in range(2):
            torch._dynamo.reset()
            backend = PrepfuseBackend({"output_buffers": output_buffers})
            torch.compile(prep_returning_q, backend=backend, fullgraph=True)(*args)
            assert backend.reports.pattern_counts().get("dsv4_q+kv") == 1
    said = [r.getMessage() for r in caplog.records if "returns views of the scratch arena" in r.getMessage()]
    assert len(said) == (1 if warned else 0)
    if warned:
        assert "dsv4_qnorm_rope_kv_insert.q_out.0" in said[0] and "'output_buffers': 'graph'" in said[0]


def test_a_script_run_twice_reports_its_fused_calls_both_times(tmp_path):
    """The second run of a script is served from Inductor's on-disk cache and runs no pass;
    its report is the one the first run kept, so it does not read "0 fused"."""
    script = tmp_path / "compile_twice.py"
    script.write_text(
        "import torch\n"
        "from prepfuse.backend import last_reports\n"
        "from prepfuse.testing import make_dsv4_inputs\n"
        "from tests.test_backend import prep_returning_q\n"
        "inputs = make_dsv4_inputs(7, 3, 8, 16, 'cpu', skip_fraction=0.0)\n"
        "args = (inputs.q, inputs.kv, inputs.k_cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache)\n"
        "torch.compile(prep_returning_q, backend='prepfuse', fullgraph=True)(*args)\n"
        "(report,) = last_reports()\n"
        "print('RESULT', report.cached, report.count('dsv4_q+kv'))\n")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(PYPROJECT), os.environ.get("PYTHONPATH", "")]))
    results = []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                             cwd=os.path.dirname(PYPROJECT))
        assert run.returncode == 0, run.stderr[-3000:]
        results.append(next(line for line in run.stdout.splitlines() if line.startswith("RESULT")))
    assert results == ["RESULT False 1", "RESULT True 1"]
