"""What every prepfuse graph pass has: a name, a match count, a report, and a uuid.

Inductor caches compiled graphs keyed on, among other things, the ``uuid()`` of each
custom pass. A pass whose code or patterns changed but whose uuid did not would be
served stale code from the FX graph cache, so the uuid hashes the source files that
define the pass (its module, and any pattern modules it names) plus its settings.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from dataclasses import dataclass, field

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from prepfuse.fx_passes.matching.nodes import remove_dead

log = logging.getLogger("prepfuse.passes")
_WARNED: set = set()


def failure_anchor(err: Exception, graph: torch.fx.Graph, default: torch.fx.Node | None = None):
    """The node of ``graph`` the pass was reading when ``err`` was raised: the innermost
    frame's graph node among its locals (``default`` where no frame holds one)."""
    tb, frames = err.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for name in ("node", "user", "n", "start", "source", "w", "write", "p", "point", "anchor", "q", "k", "kv"):
            value = frame.f_locals.get(name)
            for attr in ("node", "anchor", "start", "node"):  # a side or match holding its node
                if not isinstance(value, torch.fx.Node):
                    value = getattr(value, attr, value)
            if isinstance(value, torch.fx.Node) and value.graph is graph:
                return value
    return default


def unreadable_step(node: torch.fx.Node | None) -> str:
    """A decline for a step the pass could not read, in the user's terms: where the code
    made it and what about its value stops the reading (no tokens, symbolic sizes)."""
    from prepfuse.fx_passes.matching.nodes import where

    if node is None or node.op == "output":  # no step of the code to name
        return "prepfuse could not read this graph's preparation; the code is compiled as written"
    v = node.meta.get("val")
    what = ""
    if isinstance(v, torch.Tensor):
        sizes = [s for s in v.shape if not isinstance(s, int)]
        if any(isinstance(s, int) and s == 0 for s in v.shape):
            what = f": its value {list(v.shape)} holds no elements (no tokens)"
        elif sizes:
            what = (f": its sizes {list(v.shape)} are symbolic where the op needs numbers (mark that dim static, "
                    "or compile with dynamic=False)")
    return f"prepfuse could not read the step at {where(node)}{what}; the code is compiled as written"


def _warn_once(pass_name: str, err: Exception) -> None:
    """Warn once per pass and error type; every time, the traceback at DEBUG (for a report)."""
    key = (pass_name, type(err).__name__)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s: an unexpected %s while reading a region (declined, compiled as written): %s",
                    pass_name, type(err).__name__, err)
    log.debug("%s: the unexpected error's traceback", pass_name, exc_info=err)


@dataclass
class PassEvent:
    """One rewrite (``matched``) or one declined candidate (``declined``, with why)."""

    pass_name: str
    kind: str  # "matched" | "declined"
    pattern: str  # which pattern / spelling
    where: str  # the anchor node, as printed by FX
    why: str = ""  # declined: eps mismatch, extra user, dtype ...; matched: how it was checked


@dataclass
class PassLog:
    """Events of one pass over one graph; the backend gathers these into its report."""

    events: list[PassEvent] = field(default_factory=list)

    def matched(self, pass_name: str, pattern: str, node: torch.fx.Node, note: str = "") -> None:
        self.events.append(PassEvent(pass_name, "matched", pattern, node.format_node() or node.name, note))

    def declined(self, pass_name: str, pattern: str, node: torch.fx.Node, why: str) -> None:
        log.debug("%s: %s declined at %s: %s", pass_name, pattern, node.name, why)
        self.events.append(PassEvent(pass_name, "declined", pattern, node.format_node() or node.name, why))


class PrepfusePass(CustomGraphPass):
    """Base class: subclasses implement ``run(graph)`` and return how many rewrites they made.

    ``matched_count`` is the number of rewrites in the most recent call; ``log`` holds
    that call's matched and declined events. ``uuid_sources`` lists extra objects
    (modules, classes, functions) whose source defines the pass's behaviour.
    """

    name: str = "prepfuse_pass"
    uuid_sources: tuple = ()
    # fusion passes prove each rewrite on both probes ("probe") or on the unit-scale one
    # alone ("quick"); the backend's ``validate`` option sets it, and it enters the uuid
    validate: str = "probe"
    # a fusion pass reads the canonical graph (``matching/canonical.py``): the pass manager
    # canonicalizes once before the first such pass
    canonical_graph: bool = False

    def __init__(self) -> None:
        self.matched_count = 0
        self.log = PassLog()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.log = PassLog()
        self.replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        self.memo: dict = {}  # what the probes showed for each region form in this graph (``Probes.form``)
        try:
            self.matched_count = self.run(graph)
        except Exception as err:  # noqa: BLE001 - a pass's own failure must not fail the compile
            # every rewrite is made whole or not at all (``attempt``), so the graph is valid here;
            # the failure is a near miss at the step being read, in the user's terms
            self._unreadable(err, self.name, graph, next(iter(graph.find_nodes(op="output")), None))
            self.matched_count = sum(e.kind == "matched" for e in self.log.events)
        if self.matched_count:
            remove_dead([*self.replaced, *(n for n in graph.nodes if n.op in ("call_function", "get_attr") and not n.users)])
            graph.lint()

    def replace(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        """Rewire ``old``'s readers to ``new``; ``old`` and what only it read go once the pass is done."""
        old.replace_all_uses_with(new)
        self.replaced[old] = new

    def run(self, graph: torch.fx.Graph) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def attempt(self, fn, pattern: str, anchor: torch.fx.Node) -> bool:
        """Run one rewrite attempt ``fn()``; a decline (``NoMatch``) or an unexpected error is
        logged as a near miss and the graph left as the code wrote it: a valid program never
        becomes a compile error because a pass could not read it (an unexpected error also
        warns once, as it is the pass's fault)."""
        from prepfuse.fx_passes.matching.nodes import NoMatch

        try:
            fn()
            return True
        except NoMatch as err:
            self.declined_at(pattern, anchor, str(err))
        except Exception as err:  # noqa: BLE001 - the pass's own failure must not fail the compile
            self._unreadable(err, pattern, anchor.graph, anchor)
        return False

    def scan(self, fn, pattern: str, graph: torch.fx.Graph, default):
        """``fn()``, a search for one kind of side; where it fails unexpectedly, a near miss
        at the step it was reading (``unreadable_step``) and ``default``, so the pass goes on
        with its other sides instead of stopping."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - the pass's own failure must not fail the compile
            self._unreadable(err, pattern, graph)
            return default

    def _unreadable(self, err: Exception, pattern: str, graph: torch.fx.Graph, fallback=None) -> None:
        """An unexpected ``err``: warned once, and a near miss at the step being read (where no
        step is found, at ``fallback``, if given)."""
        _warn_once(self.name, err)
        step = failure_anchor(err, graph, fallback)
        if step is not None:
            self.declined_at(pattern, step, unreadable_step(step))

    def declined_at(self, pattern: str, anchor: torch.fx.Node, why: str) -> None:
        self.log.declined(self.name, pattern, anchor, why)

    def settings(self) -> tuple:
        """Anything besides source code that changes what the pass does."""
        return ()

    def compile_state(self) -> tuple:
        """What the pass reads from outside the graph and may differ between compiles of one
        process (an engine's config), read each time a compile is keyed: the pass manager's
        uuid, and with it Inductor's FX graph cache key, holds it."""
        return ()

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for obj in (type(self), inspect.getmodule(type(self)), *self.uuid_sources):
            digest.update(inspect.getsource(obj).encode())
        digest.update(repr((self.settings(), self.validate)).encode())
        return digest.hexdigest()
