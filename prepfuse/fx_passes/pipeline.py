"""prepfuse's passes inside someone else's compile pipeline.

An engine that owns Inductor's ``post_grad_custom_post_pass`` hook (vLLM sets it from
``CompilationConfig.inductor_compile_config`` and runs its own pass manager there) cannot
also use ``backend="prepfuse"``. It takes the passes as one object instead:

    from prepfuse.backend import post_grad_pass
    from prepfuse.fx_passes.pipeline import post_grad_hook

    prepfuse_passes = post_grad_pass({"strict": True})        # a CustomGraphPass, with uuid()
    inductor_config["post_grad_custom_post_pass"] = post_grad_hook(prepfuse_passes, my_pass)

``post_grad_hook`` hands Inductor a list where its hook takes one (torch 2.13 and later)
and a ``ComposedPass`` where it takes a single pass (torch 2.11, 2.12); either way the passes
run in the order given and Inductor's FX graph cache keys on every pass's uuid, so a
change to any of them (prepfuse's options or sources, the engine's pass) misses the cache.
An engine with a pass manager of its own adds ``prepfuse_passes`` to it like any pass
and puts its uuid into its own; for vLLM's, whose passes must be its ``InductorPass``, that
is ``prepfuse.integrations.vllm.PrepfuseVllmPass``.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from prepfuse._compat import post_grad_hook_takes_list

__all__ = ["ComposedPass", "post_grad_hook"]


class ComposedPass(CustomGraphPass):
    """Several post-grad passes as one: run in order; uuid from each pass's uuid."""

    def __init__(self, *passes: CustomGraphPass) -> None:
        if not passes:
            raise ValueError("passes: expected at least one pass")
        for p in passes:
            _check_pass(p)
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for p in self.passes:
            digest.update(f"{type(p).__qualname__}:{p.uuid()};".encode())
        return digest.hexdigest()


def post_grad_hook(*passes: CustomGraphPass):
    """What to set ``post_grad_custom_post_pass`` to so that ``passes`` all run, in order:
    a list (torch >= 2.13) or one ``ComposedPass`` (older torch)."""
    if not passes:
        raise ValueError("passes: expected at least one pass")
    for p in passes:
        _check_pass(p)
    return list(passes) if post_grad_hook_takes_list() else ComposedPass(*passes)


def _check_pass(p: Callable) -> None:
    """A ``CustomGraphPass`` (with a uuid): a plain callable would make Inductor bypass its
    FX graph cache for every graph, and a pass without a uuid cannot be cached correctly."""
    if not isinstance(p, CustomGraphPass):
        raise ValueError(f"passes: {p!r} is not a torch._inductor.custom_graph_pass.CustomGraphPass "
                         "(a plain callable has no uuid, so Inductor could not cache what it compiles)")
