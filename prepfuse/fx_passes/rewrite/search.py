"""Deciding the math: candidate calls run against the region on probes, the first that agrees kept.

A family knows its op's parameters (RoPE style, rotary dims, norm form, eps, where the
rounding happens, fp8 scale semantics, how many heads). From a region's leaves it
enumerates those as ``Candidate`` calls, cheapest and likeliest first; ``first_agreeing``
emits each in turn, checks it on the region's probes (``probes.Probes``) and keeps the
first whose every output is within bounds. A candidate that differs is erased before the
next is emitted, so the graph ends up holding only the call kept.

Candidates that differ only in where they round (a norm weight applied after the bf16
rounding or in fp32) can both agree within the bounds. The family marks them with one
``rounding_of`` key; when the first to agree is not bit for bit the code's, the later ones
of its key run too and the one that differs from the code in the fewest values is kept (an
exact one ends the search): code that rounds like one of them gets that one, not whichever
was listed first.

When none agrees, the decline names the closest candidate (the one that passed more
probes, then had fewer values out of bounds) and the first value where it differs: what
a user needs to see whether their code is the op's math written another way (then the
candidate list misses a form) or other math (then nothing should fuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prepfuse._compat import compiling_a_training_graph
from prepfuse.fx_passes.rewrite.emitter import Emitter
from prepfuse.fx_passes.matching.nodes import NoMatch
from prepfuse.fx_passes.rewrite.probes import Mismatch, Probes

__all__ = ["Candidate", "Agreed", "first_agreeing", "VALIDATE_MODES"]

# the backend's ``validate`` option: "probe" runs candidates on both probes (unit scale, then
# edge values with negative and repeated slots); "quick" on the unit-scale probe alone (the
# probes are how a family decides the math, so there is no mode without them)
VALIDATE_MODES = ("probe", "quick")


@dataclass(frozen=True)
class Candidate:
    """One hypothesis: ``name`` says it in the model's terms ("NeoX RoPE over 64 dims, q/k
    RMSNorm with a bf16 weight after rounding, eps 1e-06"); ``emit`` inserts its call
    through an emitter and returns what the call writes (``compare.Checked`` pairs) and any
    result the family needs afterwards."""

    name: str
    emit: Callable
    rounding_of: object = None  # the same call but for where it rounds: candidates with one key are rivals


@dataclass
class Agreed:
    candidate: Candidate
    emitter: Emitter
    checked: list
    result: object
    probes_run: int  # 0: taken from an earlier region of the same form
    inexact: tuple = ()  # per probe run: values within the bounds but not bit for bit the code's

    def note(self, what: str) -> str:
        """How the call was decided, for the report."""
        if self.probes_run:
            return f"validated on {self.probes_run} probes: {what}"
        return f"the same form as a region validated earlier in this graph: {what}"


# why no call goes into a training step's graph (``_compat.compiling_a_training_graph``)
TRAINING = ("the graph is compiled for training (grad mode is on and a parameter or input requires grad, so a "
            "backward is traced); the fused ops are for inference and have no backward: run the model under "
            "torch.no_grad() or torch.inference_mode()")


def first_agreeing(probes: Probes, candidates, make_emitter: Callable[[], Emitter]) -> Agreed:
    """The first of ``candidates`` whose call computes the region (or a closer rounding of
    it: ``_closest_rounding``), its nodes left in the graph; or NoMatch naming the closest
    one and where it differs.

    A region of the same form as one searched before in this graph (``Probes.form``: a
    model's next layer), with the same candidates, has the same outcome on the probes: the
    candidate that agreed there is emitted without running them again (a decline is
    searched again, so that it names this region's code). A training step's graph gets no
    call (``TRAINING``): its forward saves activations for a backward the ops do not have."""
    if compiling_a_training_graph():
        raise NoMatch(TRAINING)
    candidates = list(candidates)
    key = ("agreed", probes.form(), tuple(c.name for c in candidates))
    if key in probes.memo:
        candidate = candidates[probes.memo[key]]
        return _emitted(candidate, make_emitter, None)
    agreed = _search(probes, candidates, make_emitter)
    probes.memo[key] = candidates.index(agreed.candidate)
    return agreed


def _emitted(candidate: Candidate, make_emitter: Callable[[], Emitter], probes: Probes | None,
             beat: tuple | None = None) -> Agreed:
    """``candidate``'s call in a fresh emitter, its inputs in order, checked on ``probes``
    (None: taken as agreed; ``beat``: ``Probes.check``'s); or nothing it emitted left in the
    graph, and NoMatch where the call's fake impl refuses it (a probe's Mismatch passes through)."""
    emit = make_emitter()
    try:
        try:
            checked, result = candidate.emit(emit)
        except (RuntimeError, ValueError, TypeError, IndexError) as err:  # the call's fake impl refuses it
            refused = NoMatch("the call cannot be made" + (f": {str(err).splitlines()[0]}" if str(err) else ""))
            refused.refused_call = True
            raise refused
        emit.inputs_in_order()
        run, inexact = probes.check(emit.emitted, checked, beat) if probes is not None else (0, ())
        return Agreed(candidate, emit, checked, result, run, inexact)
    except BaseException:
        emit.discard()  # nothing a failed candidate emitted stays in the graph
        raise


def _search(probes: Probes, candidates, make_emitter: Callable[[], Emitter]) -> Agreed:
    closest: tuple | None = None
    structural: str | None = None  # the first decline; one about the code beats a refused call
    refused_only = True
    for i, candidate in enumerate(candidates):
        try:
            agreed = _emitted(candidate, make_emitter, probes)
        except Mismatch as m:
            if closest is None or m.closeness() > closest[0]:
                closest = (m.closeness(), candidate, m)
        except NoMatch as err:
            refused = getattr(err, "refused_call", False)
            if structural is None or (refused_only and not refused):
                structural, refused_only = f"{candidate.name}: {err}", refused
        else:
            return _closest_rounding(agreed, candidates[i + 1:], probes, make_emitter)
    if closest is not None:
        _, candidate, m = closest
        err = NoMatch(f"closest: {candidate.name}: {m}")
        err.mismatch = m  # what differed, for a family that has other candidates for that output
        raise err
    raise NoMatch(structural or "no candidate call")


def _closest_rounding(agreed: Agreed, later, probes: Probes, make_emitter: Callable[[], Emitter]) -> Agreed:
    """``agreed``, or the later candidate of its ``rounding_of`` key that also agrees and
    differs from the code in fewer values: on the unit-scale probe (the values a model
    sees), the edge probe's extremes breaking a tie. Each rival runs beside ``agreed``'s
    call with a scratch of its own, stops after the first probe where it is further, and is
    erased whatever it shows; one that wins is emitted again in ``agreed``'s place."""
    key = agreed.candidate.rounding_of
    if key is None or not any(agreed.inexact):
        return agreed
    best = agreed
    try:
        for rival in later:
            if rival.rounding_of != key:
                continue
            try:
                other = _emitted(rival, lambda: make_emitter().beside_another(), probes, beat=best.inexact)
            except NoMatch:  # a Mismatch too: it does not agree, and erased itself
                continue
            other.emitter.discard()
            if other.probes_run == best.probes_run and other.inexact < best.inexact:
                best = other
                if not any(best.inexact):
                    break
    except BaseException:
        agreed.emitter.discard()  # the graph as the code wrote it (``PrepfusePass.attempt``)
        raise
    if best is agreed:
        return agreed
    agreed.emitter.discard()
    kept = _emitted(best.candidate, make_emitter, None)
    kept.probes_run, kept.inexact = best.probes_run, best.inexact
    return kept
