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

log = logging.getLogger("prepfuse.passes")


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
    # fusion passes prove each rewrite on probes before making it ("probe") or not ("off");
    # the backend's ``validate`` option sets it, and it enters the uuid
    validate: str = "probe"

    def __init__(self) -> None:
        self.matched_count = 0
        self.log = PassLog()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.log = PassLog()
        self.matched_count = self.run(graph)
        if self.matched_count:
            graph.eliminate_dead_code()
            graph.lint()

    def run(self, graph: torch.fx.Graph) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def settings(self) -> tuple:
        """Anything besides source code that changes what the pass does."""
        return ()

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for obj in (type(self), inspect.getmodule(type(self)), *self.uuid_sources):
            digest.update(inspect.getsource(obj).encode())
        digest.update(repr((self.settings(), self.validate)).encode())
        return digest.hexdigest()
