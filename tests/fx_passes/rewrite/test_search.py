"""``search.first_agreeing``: which candidate is kept, and that the graph holds only its call.

The probes and the emitter are stood in for by recorders (what each candidate's call
would give on the probes is given per candidate; the stopping rule is ``probes.further``,
the one ``Probes.check`` applies), so the rule itself is what is tested: the first
candidate that agrees, or a later one of its ``rounding_of`` key that differs from the code
in fewer values; a rival stops after the first probe where it is further. The counts come
from ``compare``, tested last. The mechanism on real graphs:
``test_bf16_weight_promoted_to_fp32_fuses`` (GQA).
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.fx_passes.matching.nodes import NoMatch
from prepfuse.fx_passes.rewrite.compare import Checked, compare
from prepfuse.fx_passes.rewrite.probes import Mismatch, further
from prepfuse.fx_passes.rewrite.search import Candidate, first_agreeing


class Emitted:
    """An emitter's stand-in: the graph is the set of live calls."""

    def __init__(self, graph: set) -> None:
        self.graph, self.emitted, self.beside = graph, [], False

    def beside_another(self):
        self.beside = True
        return self

    def inputs_in_order(self):
        pass

    def discard(self):
        for call in self.emitted:
            self.graph.discard(call)
        self.emitted = []


class Outcomes:
    """Probes whose ``check`` replays, per candidate name, the values out of bounds (a
    Mismatch) or the per-probe counts of values that differ within them."""

    def __init__(self, outcomes: dict) -> None:
        self.outcomes, self.memo, self.count, self.runs = outcomes, {}, 2, []

    def form(self):
        return ("one form",)

    def check(self, emitted, checked, beat=None):
        (name,) = checked
        counts = ()
        for probe, outcome in enumerate(self.outcomes[name]):
            if further(counts, beat):
                return probe, counts
            self.runs.append((name, probe))
            if outcome is None:
                raise Mismatch(f"{name} differs", probe, 1, 1)
            counts += (outcome,)
        return self.count, counts


def search(outcomes: dict, keys: dict, probes: Outcomes | None = None, beside: dict | None = None,
           graph: set | None = None):
    """``first_agreeing`` over candidates named by ``outcomes``' keys, their calls put into
    ``graph``; ``beside`` collects, per candidate, whether each of its calls was emitted
    beside another."""
    graph, probes = set() if graph is None else graph, probes or Outcomes(outcomes)
    beside = {} if beside is None else beside

    def candidate(name):
        def emit(emitter):
            call = f"call {name} #{len(probes.runs)}"
            graph.add(call)
            emitter.emitted.append(call)
            beside.setdefault(name, []).append(emitter.beside)
            return [name], name
        return Candidate(name, emit, keys.get(name))

    agreed = first_agreeing(probes, [candidate(n) for n in outcomes], lambda: Emitted(graph))
    return agreed, graph, probes


def test_first_agreeing_exact_is_kept_without_rivals():
    agreed, graph, probes = search({"a": [None], "b": [0, 0], "c": [0, 0]}, {"b": 1, "c": 1})
    assert agreed.candidate.name == "b" and agreed.inexact == (0, 0)
    assert [n for n, _ in probes.runs] == ["a", "b", "b"]  # c never runs
    assert len(graph) == 1


def test_closer_rival_of_the_same_rounding_is_kept_in_place_of_the_first():
    outcomes = {"bf16 weight": [40, 9], "other rope": [0, 0], "fp32 weight": [3, 1], "fp32 again": [2, 50]}
    keys = {"bf16 weight": "w", "fp32 weight": "w", "fp32 again": "w", "other rope": "r"}
    beside = {}
    agreed, graph, probes = search(outcomes, keys, beside=beside)
    assert agreed.candidate.name == "fp32 again"  # fewest on the unit-scale probe first
    assert agreed.inexact == (2, 50) and agreed.probes_run == 2
    assert graph == set(agreed.emitter.emitted) and len(graph) == 1  # the losers' calls are gone
    assert ("other rope", 0) not in probes.runs  # another key is no rival
    # rivals run beside the first call (a scratch of their own); the one kept is emitted again plainly
    assert beside == {"bf16 weight": [False], "fp32 weight": [True], "fp32 again": [True, False]}


def test_a_later_layer_of_the_same_form_gets_the_kept_rival_without_probes():
    outcomes = {"bf16 weight": [40, 9], "fp32 weight": [3, 1]}
    keys = {"bf16 weight": "w", "fp32 weight": "w"}
    first, _, probes = search(outcomes, keys)
    runs = len(probes.runs)
    again, graph, _ = search(outcomes, keys, probes=probes)
    assert first.candidate.name == again.candidate.name == "fp32 weight"
    assert again.probes_run == 0 and len(probes.runs) == runs and len(graph) == 1


def test_an_error_in_a_rival_leaves_no_call_in_the_graph():
    class Broken(Outcomes):
        def check(self, emitted, checked, beat=None):
            if checked == ["rival"]:
                raise KeyError("a decode that fails")
            return super().check(emitted, checked, beat)

    graph, outcomes = set(), {"first": [1, 1], "rival": [0, 0]}
    with pytest.raises(KeyError):
        search(outcomes, {"first": "k", "rival": "k"}, probes=Broken(outcomes), graph=graph)
    assert graph == set()


def test_a_rival_stops_after_the_probe_where_it_is_further():
    outcomes = {"first": [3, 5], "worse": [4, 0], "tie then better": [3, 1]}
    agreed, _, probes = search(outcomes, {n: "k" for n in outcomes})
    assert ("worse", 1) not in probes.runs
    assert agreed.candidate.name == "tie then better"


def test_a_rival_that_disagrees_or_has_no_key_changes_nothing():
    agreed, graph, _ = search({"first": [1, 1], "rival": [0, None]}, {"first": "k", "rival": "k"})
    assert agreed.candidate.name == "first" and len(graph) == 1
    agreed, _, probes = search({"first": [1, 1], "later": [0, 0]}, {})
    assert agreed.candidate.name == "first" and [n for n, _ in probes.runs] == ["first", "first"]


def test_none_agreeing_names_the_closest():
    with pytest.raises(NoMatch, match="closest: b: b differs"):
        search({"a": [None], "b": [0, None]}, {})


def test_compare_counts_the_values_that_differ_within_the_bounds():
    checked = Checked("q_out", None, None)
    want = torch.tensor([[1.0, 2.0, -0.0, float("nan")]], dtype=torch.bfloat16)
    assert compare(checked, want.clone(), want, 0, {}) == 0
    near = torch.tensor([[1.0, 2.015625, 0.0, float("nan")]], dtype=torch.bfloat16)  # a ULP, a zero's sign
    assert compare(checked, near, want, 0, {}) == 2
    codes = want.float().to(torch.float8_e4m3fn)
    assert compare(checked, codes.clone(), codes, 0, {}) == 0
    with pytest.raises(Mismatch):
        compare(checked, want * 2, want, 0, {})
