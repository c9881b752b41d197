"""prepfuse's passes as one vLLM ``InductorPass``, for vLLM's own post-grad pass manager.

vLLM owns Inductor's ``post_grad_custom_post_pass`` hook: it installs its
``PostGradPassManager`` there and adds to it the pass found under that key of
``CompilationConfig.inductor_compile_config``, which must be a vLLM ``InductorPass``::

    from vllm.config import CompilationConfig, VllmConfig
    from prepfuse.integrations.vllm import PrepfuseVllmPass

    prepfuse_pass = PrepfuseVllmPass({"strict": True})
    config = VllmConfig(compilation_config=CompilationConfig(
        inductor_compile_config={"post_grad_custom_post_pass": prepfuse_pass}))
    ...
    print(prepfuse_pass.reports.format())

``PostGradPassManager.add(prepfuse_pass)`` takes it as well. vLLM wraps any other callable
in a ``CallableInductorPass`` whose uuid hashes the callable's class source only, so that
prepfuse's options would not reach Inductor's cache key: hence this class.

Where it runs (vLLM 0.33 ``PostGradPassManager.__call__``): after vLLM's own passes
(no-op elimination, its fusions), before vLLM's cleanup (topological sort, dead-code
elimination), IR lowering, clone elimination and ``fix_functionalization``. prepfuse's
passes therefore read the functional graph, as under ``backend="prepfuse"``, with vLLM's
IR ops (its RMSNorm's ``vllm.ir`` calls) not lowered yet: what prepfuse fuses is plain
PyTorch math, not vLLM's own layers.

Each op is defunctionalized once. prepfuse's ``defunctionalize`` takes the ops of the
``namespaces`` option (default prepfuse's own); vLLM's ``fix_functionalization`` then finds
its ops (``_C``, ``vllm``) still ``auto_functionalized`` and rewrites them. Naming ``_C`` or
``vllm`` in ``namespaces`` hands their calls to prepfuse's pass first; a call it declines
stays for vLLM's. vLLM compiles with ``auto_functionalized`` v1, where prepfuse's pass
declines a call whose written arguments share storage (k and v caches taken from one
buffer, q and k split from one qkv): vLLM's pass rewrites its own such calls by pattern,
and a prepfuse op's is left to Inductor (and fails a ``strict`` compile).

Options are ``PrepfuseOptions``, less those that patch Inductor's config, which here is
vLLM's (``CompilationConfig.inductor_compile_config``): ``inductor_config`` and
``auto_functionalized_v2``, and ``splitting_ops`` / ``cudagraphs`` (vLLM splits the graph
and captures CUDA graphs itself). ``debug_dir`` and ``record_graphs`` cover the graphs the
passes run on: vLLM keeps Inductor's FX graph cache on, and a graph served from it ran no
pass and gets no report. Reports stay in the process that compiles, which in vLLM is its
engine's (a process of its own unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one GPU):
the pass crosses processes as its options, without reports or ``on_report``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Mapping

import torch.fx

from prepfuse.backend import PrepfuseOptions, post_grad_pass
from prepfuse.fx_passes.report import GraphReport, Reports

try:
    from vllm.compilation.passes.inductor_pass import InductorPass
except ModuleNotFoundError as err:
    if err.name is None or not err.name.startswith("vllm"):
        raise
    raise ImportError("prepfuse.integrations.vllm needs vLLM (pip install vllm); prepfuse itself does not: "
                      "without vLLM use backend='prepfuse' or prepfuse.backend.post_grad_pass") from err

__all__ = ["PrepfuseVllmPass"]

# options whose effect is an Inductor config patch: vLLM's config holds those
_SET_IN_VLLM = {
    "inductor_config": "put Inductor settings in CompilationConfig.inductor_compile_config",
    "auto_functionalized_v2": "vLLM sets enable_auto_functionalized_v2 (False: its passes read v1) in "
                              "CompilationConfig.inductor_compile_config; prepfuse's passes read either",
    "splitting_ops": "vLLM splits the graph at CompilationConfig.splitting_ops before Inductor sees it",
    "cudagraphs": "vLLM captures CUDA graphs itself (CompilationConfig.cudagraph_mode)",
}


class PrepfuseVllmPass(InductorPass):
    """prepfuse's post-grad passes (``prepfuse.backend.post_grad_pass(options)``) as a vLLM
    ``InductorPass``. ``uuid()`` hashes this module and the pass manager's uuid (prepfuse's
    sources and options), so vLLM's manager uuid, and with it Inductor's cache key, changes
    with either. ``reports``: one ``GraphReport`` per graph the passes ran on."""

    def __init__(self, options: Mapping[str, Any] | PrepfuseOptions | None = None,
                 on_report: Callable[[GraphReport], None] | None = None) -> None:
        self.options = PrepfuseOptions.from_mapping(options)
        default = PrepfuseOptions()
        for name, why in _SET_IN_VLLM.items():
            if getattr(self.options, name) != getattr(default, name):
                raise ValueError(f"{name}: not a prepfuse option inside vLLM: {why}")
        self.manager = post_grad_pass(self.options, on_report)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager(graph)

    def uuid(self) -> str:
        return InductorPass.hash_dict({
            "integration": InductorPass.hash_source(inspect.getsource(sys.modules[__name__])),
            "prepfuse": self.manager.uuid(),
        })

    @property
    def reports(self) -> Reports:
        return Reports(self.manager.reports)

    def __reduce__(self):
        # to vLLM's engine process: the options; reports belong to the process that compiled
        return (type(self), (self.options,))

    def __deepcopy__(self, memo) -> PrepfuseVllmPass:
        # VllmBackend deep-copies inductor_compile_config: the copy is this object, so the
        # reports of the graphs vLLM compiles land where the caller can read them
        return self
