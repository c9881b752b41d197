"""``torch.compile(model, backend="prepfuse", options={...})``: Inductor plus prepfuse's passes.

The backend is Inductor's ``compile_fx`` with a ``PrepfusePassManager`` installed as
``post_grad_custom_post_pass`` through ``config_patches``, i.e. for this compile only; no global
compiler setting is touched. It is registered under the name ``prepfuse`` when prepfuse is
imported, and declared as a ``torch_dynamo_backends`` entry point so that ``backend="prepfuse"``
works in a process that never imported prepfuse.

Options (``PrepfuseOptions``, validated when made; an unknown key is an error; each one's full
contract is docs/passes.md's options table)::

    passes                  the passes to run, in order: names, or PrepfusePass classes or
                            instances (default: prepfuse's own fusion passes, then
                            "defunctionalize"; another pass runs only where named:
                            registry.default_passes(MyPass)); () runs none
    debug_dir               write each graph before/after every pass and its report there
    auto_functionalized_v2  None: torch's default; True/False: force v2 / v1
    inductor_config         more Inductor config patches for this compile
    strict                  fail the compile if a prepfuse op is still auto_functionalized
    record_graphs           keep the normalized post-pass graph in each report
    splitting_ops           ops run eagerly between CUDA graphs; given, the "placement" pass moves
                            prepfuse ops that do not depend on one ahead of it
    output_buffers          "arena" (default): output buffers are views of the scratch arena, a
                            returned one valid until the next run of any graph fusing the same op;
                            "graph": fresh graph buffers, for callers that keep outputs
    cudagraphs              "none", "piecewise" (cut at splitting_ops, cudagraph trees) or "full"
                            (the engine captures the forward); the last two fail the compile where
                            capture would be defeated
    namespaces              op namespaces "defunctionalize" reinplaces (default ("prepfuse",))
    validate                "probe" (default): each rewrite runs on two probes beside the code it
                            replaces and is declined with the first differing value (docs/passes.md,
                            "How a rewrite is found and decided"); "quick": the unit-scale probe alone

What was fused, and where: ``last_reports()`` (the latest compile's graphs), ``reports()`` (every
graph since ``clear_reports()``), both ``Reports`` with ``format()``; or build a
``PrepfuseBackend(options)`` and read its own ``.reports``.
"""

from __future__ import annotations

import collections
import copy
import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

import torch

from prepfuse._compat import inductor_config_keys, inductor_mode_options, register_dynamo_backend
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.defunctionalize import DefunctionalizePass
from prepfuse.fx_passes.pass_manager import PrepfusePassManager
from prepfuse.fx_passes.placement import PlacementPass, PlacementPolicy
from prepfuse.fx_passes.rewrite.search import VALIDATE_MODES
from prepfuse.fx_passes.registry import LAST_PASS, PassEntry, default_passes, get_pass, pass_name, placement_position
from prepfuse.fx_passes.report import GraphReport, Reports
from prepfuse.fx_passes.report_store import load_reports, report_key, store_reports
from prepfuse.ops import NAMESPACE

__all__ = [
    "PrepfuseOptions",
    "PrepfuseBackend",
    "post_grad_pass",
    "prepfuse_backend",
    "reports",
    "last_reports",
    "clear_reports",
]

BACKEND_NAME = "prepfuse"
# Inductor settings the backend owns; each has its own option instead.
_RESERVED_CONFIG = {
    "post_grad_custom_post_pass": "prepfuse installs its pass manager there; give your passes in the passes option",
    "enable_auto_functionalized_v2": "use the auto_functionalized_v2 option",
}
_MAX_KEPT_REPORTS = 4096


@dataclass(frozen=True)
class PrepfuseOptions:
    """Validated backend options; see the module docstring for what each one does."""

    passes: tuple[PassEntry, ...] | None = None
    debug_dir: str | None = None
    auto_functionalized_v2: bool | None = None
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    strict: bool = False
    record_graphs: bool = False
    splitting_ops: tuple[str, ...] = ()
    cudagraphs: str = "none"
    output_buffers: str = "arena"
    validate: str = "probe"
    namespaces: tuple[str, ...] = (NAMESPACE,)

    def __post_init__(self) -> None:
        passes = default_passes() if self.passes is None else self.passes
        if not isinstance(passes, (list, tuple)):
            # a list or tuple: a generator would be used up by this check and leave no passes
            raise ValueError(f"passes: expected a sequence of pass names, classes or instances (a list or tuple), "
                             f"got {self.passes!r}")
        passes = tuple(passes)
        names = tuple(pass_name(p) for p in passes)  # ValueError naming the available passes
        if len(set(names)) != len(names):
            raise ValueError(f"passes: a pass is named twice in {names}")
        if LAST_PASS in names and names[-1] != LAST_PASS:
            raise ValueError(f"passes: {LAST_PASS!r} must come last (it removes the auto_functionalized calls the "
                             f"fusion passes make), got {names}")
        object.__setattr__(self, "passes", passes)
        if self.strict is True and LAST_PASS not in names:
            raise ValueError(f"strict: fails a compile where a prepfuse op is still auto_functionalized after the "
                             f"passes, and without the {LAST_PASS!r} pass every fused op is: add it to passes, or "
                             f"leave strict off")

        if self.debug_dir is not None:
            if not isinstance(self.debug_dir, (str, os.PathLike)):
                raise ValueError(f"debug_dir: expected a path, got {self.debug_dir!r}")
            object.__setattr__(self, "debug_dir", os.fspath(self.debug_dir))
            _check_writable(self.debug_dir)
        if isinstance(self.namespaces, str) or not isinstance(self.namespaces, (list, tuple)) or not all(
                isinstance(n, str) and n and "::" not in n for n in self.namespaces) or not self.namespaces:
            raise ValueError(f"namespaces: expected a list or tuple of op namespaces such as 'prepfuse', "
                             f"got {self.namespaces!r}")
        object.__setattr__(self, "namespaces", tuple(self.namespaces))
        if self.validate not in VALIDATE_MODES:
            raise ValueError(f"validate: expected one of {', '.join(map(repr, VALIDATE_MODES))}, got {self.validate!r}")
        for name in ("strict", "record_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.auto_functionalized_v2 is not None and not isinstance(self.auto_functionalized_v2, bool):
            raise ValueError(f"auto_functionalized_v2: expected None, True or False, got {self.auto_functionalized_v2!r}")

        if not isinstance(self.inductor_config, Mapping):
            raise ValueError(f"inductor_config: expected a mapping of Inductor config names, got {self.inductor_config!r}")
        known = inductor_config_keys()
        for key in self.inductor_config:
            if key in _RESERVED_CONFIG:
                raise ValueError(f"inductor_config: {key!r} is set by the backend: {_RESERVED_CONFIG[key]}")
            if key not in known:
                raise ValueError(f"inductor_config: {key!r} is not an Inductor config name (torch._inductor.config)")
            _check_config_type(key, self.inductor_config[key])
        object.__setattr__(self, "inductor_config", MappingProxyType(dict(self.inductor_config)))
        # splitting_ops, cudagraphs and output_buffers: PlacementPolicy validates and decides
        placement = PlacementPolicy(self.splitting_ops, self.cudagraphs)
        object.__setattr__(self, "splitting_ops", placement.splitting_ops)
        placement.graph_buffers(self.output_buffers)  # ValueError naming output_buffers
        for key in placement.owned_config():
            if key in self.inductor_config:
                raise ValueError(f"inductor_config: {key!r} is set by cudagraphs={self.cudagraphs!r}")
        if self.cudagraphs == "piecewise" and not placement.splitting_ops:
            raise ValueError("cudagraphs: 'piecewise' cuts the graph at splitting_ops, and none are given; "
                             "use 'full' to capture the whole forward")

    @property
    def pass_names(self) -> tuple[str, ...]:
        """The names of ``passes``, in running order (a class or instance by its ``name``)."""
        return tuple(pass_name(p) for p in self.passes)

    @property
    def placement(self) -> PlacementPolicy:
        return PlacementPolicy(self.splitting_ops, self.cudagraphs)

    def __hash__(self) -> int:
        # the generated hash would hash the read-only inductor_config mapping, which cannot be
        return hash(repr((self.cache_key(), self.debug_dir, self.record_graphs)))

    def __reduce__(self):
        # pickling and deepcopy: the mapping proxy as a plain dict, validated again on the way back
        return (type(self), tuple(dict(getattr(self, f.name)) if f.name == "inductor_config" else getattr(self, f.name)
                                  for f in fields(self)))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | PrepfuseOptions | None) -> PrepfuseOptions:
        """Options as ``torch.compile(options=...)`` hands them over; unknown keys raise."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"prepfuse options must be a dict, got {type(options).__name__}")
        valid = [f.name for f in fields(cls)]
        odd = [k for k in options if not isinstance(k, str)]
        if odd:
            raise ValueError(f"prepfuse options: keys must be option names (str), got {odd!r}; valid options: "
                             f"{', '.join(valid)}")
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown prepfuse option(s) {', '.join(map(repr, unknown))}; valid options: {', '.join(valid)}")
        return cls(**options)

    @property
    def needs_passes_to_run(self) -> bool:
        """Dumps and recorded graphs only exist when the passes run, i.e. on a cache miss."""
        return self.debug_dir is not None or self.record_graphs

    def config_patches(self) -> dict[str, Any]:
        """Inductor config for this compile, the pass manager aside."""
        patches = dict(self.inductor_config)
        if self.auto_functionalized_v2 is not None:
            patches["enable_auto_functionalized_v2"] = self.auto_functionalized_v2
        patches.update(self.placement.config_patches())
        if self.needs_passes_to_run:
            patches["fx_graph_cache"] = False  # also bypasses the AOTAutograd cache
        return patches

    def cache_key(self) -> tuple:
        """What, besides the passes, makes compiled code differ (enters the uuid)."""
        return (
            self.pass_names, self.auto_functionalized_v2, tuple(sorted(self.inductor_config.items())), self.strict,
            self.splitting_ops, self.cudagraphs, self.output_buffers, self.validate, self.namespaces,
        )


def _check_writable(path: str) -> None:
    """``debug_dir`` can take the dumps: made if missing, writable (else the compile would fail
    late, inside Inductor, on the first graph)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"debug_dir: cannot create {path!r}: {err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"debug_dir: {path!r} is not writable")


def _check_config_type(key: str, value) -> None:
    """An Inductor config value of the type the setting holds (``{"fx_graph_cache": "no"}``
    would leave the cache on: a non-empty string is true)."""
    current = torch._inductor.config.get_config_copy().get(key)
    if "custom" in key and key.endswith("pass") and value is not None and not callable(value):
        raise ValueError(f"inductor_config: {key!r} takes a graph pass (a callable, e.g. a CustomGraphPass) "
                         f"or None, got {value!r}")
    if isinstance(current, bool) and not isinstance(value, bool):
        raise ValueError(f"inductor_config: {key!r} takes True or False, got {value!r}")
    if isinstance(current, int) and not isinstance(current, bool) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"inductor_config: {key!r} takes an int, got {value!r}")


class _ReportLog:
    """Reports of every graph compiled, grouped by backend call."""

    def __init__(self) -> None:
        self.calls: collections.deque[list[GraphReport]] = collections.deque(maxlen=_MAX_KEPT_REPORTS)

    def new_call(self) -> list[GraphReport]:
        call: list[GraphReport] = []
        self.calls.append(call)
        return call

    def all(self) -> Reports:
        return Reports([rep for call in self.calls for rep in call])

    def last(self) -> Reports:
        return Reports(self.calls[-1] if self.calls else [])

    def clear(self) -> None:
        self.calls.clear()


_LOG = _ReportLog()


class PrepfuseBackend:
    """A ``torch.compile`` backend with fixed options and its own report log.

    ``torch.compile(model, backend=PrepfuseBackend({"strict": True}))``; afterwards
    ``backend.reports`` holds the reports of exactly the graphs it compiled (they also go
    to the module-wide log read by ``reports()``).
    """

    def __init__(self, options: Mapping[str, Any] | PrepfuseOptions | None = None) -> None:
        self.options = PrepfuseOptions.from_mapping(options)
        self._log = _ReportLog()

    @property
    def reports(self) -> Reports:
        return self._log.all()

    def pass_manager(self, on_report=None) -> PrepfusePassManager:
        """A fresh manager with fresh pass instances, as one compile uses."""
        opts = self.options
        passes = [_pass_instance(entry, opts.namespaces) for entry in opts.passes]
        for p in passes:
            p.validate = opts.validate
        if opts.placement.moves_prep:
            passes.insert(placement_position(list(opts.pass_names)), PlacementPass(opts.placement))
        return PrepfusePassManager(
            passes,
            debug_dir=opts.debug_dir,
            record_graphs=opts.record_graphs,
            strict=opts.strict,
            settings=opts.cache_key(),
            on_report=on_report,
            placement=opts.placement,
            output_buffers=opts.output_buffers,
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options=None):
        from torch._inductor.compile_fx import compile_fx

        if options:
            raise ValueError("this PrepfuseBackend holds its options already; give them to its constructor")

        mine, everyone = self._log.new_call(), _LOG.new_call()

        def on_report(report: GraphReport) -> None:
            mine.append(report)
            everyone.append(report)

        manager = self.pass_manager(on_report)
        patches = inductor_mode_options(mode)
        patches.update(self.options.config_patches())
        patches["post_grad_custom_post_pass"] = manager
        key = report_key(gm, example_inputs, manager.uuid(), mode)
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        if manager.reports:
            store_reports(key, manager.reports)
        else:  # served from the FX graph / AOTAutograd cache: no pass ran; the compile that wrote it reported
            for report in load_reports(key) or [GraphReport(graph_id="cached", passes=manager.pass_names)]:
                report.cached = True
                on_report(report)
        return compiled


def _pass_instance(entry: PassEntry, namespaces: tuple[str, ...]) -> PrepfusePass:
    """A fresh pass object for one manager: ``defunctionalize`` takes the ``namespaces``
    option; an instance given in ``passes`` is copied, so managers never share a log."""
    if isinstance(entry, PrepfusePass):
        return copy.copy(entry)
    cls = get_pass(entry) if isinstance(entry, str) else entry
    return DefunctionalizePass(namespaces) if cls is DefunctionalizePass else cls()


def post_grad_pass(options: Mapping[str, Any] | PrepfuseOptions | None = None, on_report=None) -> PrepfusePassManager:
    """prepfuse's passes for someone else's compile pipeline: one ``CustomGraphPass`` (with
    ``uuid()``) to put on Inductor's ``post_grad_custom_post_pass`` hook, alone or beside the
    engine's own passes (``prepfuse.fx_passes.pipeline.post_grad_hook``). ``options`` as the
    backend takes them; what the backend would patch into Inductor's config besides (the
    auto_functionalized version, the placement settings) is ``PrepfuseOptions.config_patches()``,
    the engine's to apply. Its reports: the returned manager's ``reports`` (and ``on_report``)."""
    return PrepfuseBackend(options).pass_manager(on_report)


def prepfuse_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode: str | None = None):
    """The registered ``prepfuse`` backend: ``torch.compile`` passes ``options`` / ``mode``."""
    return PrepfuseBackend(options)(gm, example_inputs, mode=mode)


def reports() -> Reports:
    """Reports of every graph the prepfuse backend compiled since ``clear_reports()``."""
    return _LOG.all()


def last_reports() -> Reports:
    """Reports of the graphs of the latest backend call (one Dynamo graph: its inference
    graph, or its forward and, once backward ran, backward graph)."""
    return _LOG.last()


def clear_reports() -> None:
    _LOG.clear()


register_dynamo_backend(BACKEND_NAME, prepfuse_backend)
