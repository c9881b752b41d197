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

``PostGradPassManager.add(prepfuse_pass)`` takes it as well. Any other callable vLLM wraps in
a ``CallableInductorPass`` hashing its class source only, so prepfuse's options would not reach
Inductor's cache key: hence this class.

It runs after vLLM's own passes and before its cleanup, IR lowering and
``fix_functionalization`` (vLLM 0.33), so prepfuse reads the functional graph, with vLLM's IR
ops not lowered yet: an IR op is read through its native implementation (below) and, where
nothing fuses, left for vLLM to lower. Each op is
defunctionalized once: prepfuse's ``defunctionalize`` takes the ``namespaces`` option's ops,
vLLM's pass the rest. Under vLLM's ``auto_functionalized`` v1 a prepfuse call whose written
arguments share storage is declined (left to Inductor; a ``strict`` compile fails).

Options are ``PrepfuseOptions`` less those that patch Inductor's config, which is vLLM's here
(``inductor_config``, ``auto_functionalized_v2``, ``splitting_ops``, ``cudagraphs``). A graph
served from vLLM's FX graph cache ran no pass and gets no report; reports stay in the process
that compiles (vLLM's engine process): the pass crosses processes as its options alone.

Importing this module also reads vLLM's IR ops (``vllm_ir::rms_norm`` ...) through their
native PyTorch implementation (``prepfuse/integrations/vllm_ir.py``), so the q/k norms of
vLLM's own ``RMSNorm`` fuse, and declares vLLM's cache write, ``vllm::unified_kv_cache_update(key,
value, layer_name)``, an engine write (``prepfuse.fx_passes.matching.engine_writes``): a
GQA preparation whose k and v go to it fuses into the by-layer op, which finds the layer's
cache and slots in vLLM's forward context when it runs (``vllm_engine_write``).
"""

from __future__ import annotations

import dataclasses
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

from prepfuse.integrations import vllm_ir  # noqa: E402,F401 - needs vLLM; reads vLLM's IR ops through their native form
from prepfuse.integrations.vllm_cache import BY_LAYER_OP, vllm_engine_write  # noqa: E402 - needs vLLM, checked above

# the namespace of the by-layer op the integration emits, defunctionalized with prepfuse's own
BY_LAYER_NAMESPACE = BY_LAYER_OP.namespace

__all__ = ["PrepfuseVllmPass", "vllm_engine_write"]

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
        if BY_LAYER_NAMESPACE not in self.options.namespaces:  # the by-layer op on vLLM's key is prepfuse's
            self.options = dataclasses.replace(self.options, namespaces=(*self.options.namespaces, BY_LAYER_NAMESPACE))
        self.manager = post_grad_pass(self.options, on_report)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager(graph)

    def uuid(self) -> str:
        return InductorPass.hash_dict({
            "integration": InductorPass.hash_source(inspect.getsource(sys.modules[__name__]),
                                                    inspect.getsource(sys.modules[vllm_engine_write.__module__]),
                                                    inspect.getsource(vllm_ir)),
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
