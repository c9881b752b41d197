"""Turn ``auto_functionalized`` calls of prepfuse ops back into in-place calls.

Functionalization wraps every call of a mutating op in a higher-order op that, in
principle, clones what the op writes and returns the new values; writes into graph
inputs are then copied back in an epilogue. This pass undoes that for every op of the
``prepfuse`` namespace, generically (what the op writes comes from its schema through
``mutation_info``, never from a table)::

    functional (v1)                                   after this pass
    v = slice(scratch, 0, 0, T)                       v = slice(scratch, 0, 0, T)
    af = auto_functionalized(op, q_out=v, k_cache=c)  op(q, kv, v, c, ...)      # in place
    new_q = af[1]; new_c = af[2]                      (users of new_q read v, of new_c read c)
    s = slice_scatter(scratch, new_q, 0, 0, T)        (no-op: v is that region of scratch)
    copy_(scratch, s); copy_(c, new_c)                (self copies: dropped)

For ``auto_functionalized_v2`` the op writes into views regenerated from ``_all_bases``
(``slice`` or ``as_strided`` of the base, from the ``_<arg>_slice_*`` /
``_<arg>_size/_stride/_storage_offset`` kwargs), and ``af[n_ret + i]`` is base ``i``.

A rewrite is only made when it cannot change a value: the pass declines (and logs why)
when anything after the call still reads the old contents of a written buffer, when a
read-only input of the op aliases a written one, or for shapes of call it does not know
(tensor-list arguments, v2 out-operators without bases).

Is the pass needed? Inductor's own ``reinplace_inplaceable_ops`` and
``decompose_auto_functionalized`` run after every custom pass and re-inplace
``auto_functionalized`` nodes themselves. Checked with ``run_and_get_code`` (torch 2.13
CPU, and 2.11 CUDA the same): when the written tensors are graph inputs or buffers
allocated in the graph (what ``fuse_dsv4_prep`` emits today), in v1 and v2, and for
views of graph inputs in v2, Inductor alone already calls the op in place with no clone,
and this pass changes nothing in the generated code. With v1 and a written tensor that
is a *view* of a graph input -- ``scratch[:T]`` as ``q_out``, ``caches[layer]`` as
``k_cache``, the way engines pass them -- Inductor clones the whole base into a
temporary, runs the op there and copies the whole base back (two full copies of the KV
cache per call); this pass removes both. It also makes the post-pass graph (what the
report, the debug dumps, ``strict`` and the golden tests see) free of
``auto_functionalized`` prepfuse calls, for v1 and v2, instead of depending on decisions
Inductor makes later and may change between versions.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq
from torch.multiprocessing.reductions import StorageWeakRef

from prepfuse._compat import auto_functionalized_ops
from prepfuse.fx_passes import mutation_info
from prepfuse.fx_passes.base import PrepfusePass
from prepfuse.fx_passes.mutation_info import functionalized_op, mutated_args, mutated_inputs, output_indices
from prepfuse.ops import NAMESPACE

aten = torch.ops.aten
AUTO_FUNCTIONALIZED, AUTO_FUNCTIONALIZED_V2 = auto_functionalized_ops()
COPY_ = aten.copy_.default
# scatter op -> the view op that selects the region it writes (same trailing arguments)
SCATTER_VIEWS = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
    aten.as_strided_scatter.default: aten.as_strided.default,
}
# meta keys worth keeping on the in-place call (source attribution in Inductor's output)
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr", "custom")


class Declined(Exception):
    """A candidate the pass leaves alone; the message says why."""


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _raw_storage(node) -> StorageWeakRef | None:
    val = _val(node)
    if isinstance(val, torch.Tensor) and torch._C._has_storage(val):
        return StorageWeakRef(val.untyped_storage())
    return None


def _same_region(a, b) -> bool:
    """Whether fake tensors ``a`` and ``b`` are the very same view of one storage."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
        return False
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    return (
        a.dim() == b.dim()
        and statically_known_true(sym_eq(a.shape, b.shape))
        and statically_known_true(sym_eq(a.stride(), b.stride()))
        and statically_known_true(a.storage_offset() == b.storage_offset())
    )


def _scatter_region(node: torch.fx.Node, base_val):
    """The fake view of ``base_val`` that scatter ``node`` overwrites (None if unknown)."""
    if not isinstance(base_val, torch.Tensor):
        return None
    try:
        return SCATTER_VIEWS[node.target](base_val, *node.args[2:], **node.kwargs)
    except Exception:  # noqa: BLE001 - an unknown region only makes the pass decline
        return None


def _is_view(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _is_tensor_type(arg: torch._C.Argument) -> bool:
    t = arg.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


class DefunctionalizePass(PrepfusePass):
    """Replace ``auto_functionalized`` (v1/v2) nodes of ops in ``namespaces`` by in-place calls.

    ``namespaces`` defaults to prepfuse's own; a wider set is for tests and for engines that
    want the same treatment for their own mutating ops.
    """

    name = "defunctionalize"
    uuid_sources = (mutation_info,)

    def __init__(self, namespaces: tuple[str, ...] = (NAMESPACE,)) -> None:
        super().__init__()
        self.namespaces = tuple(namespaces)

    def settings(self) -> tuple:
        return (self.namespaces,)

    def _storage(self, node) -> StorageWeakRef | None:
        """The storage ``node`` aliases, after the rewrites made so far.

        A replaced ``getitem`` had a fresh fake storage; views taken of it before the
        rewrite still carry that one, although they now alias the written buffer. A node's
        own storage is read once a run (the check after each call reads every later node's).
        """
        if node not in self._raw:
            self._raw[node] = _raw_storage(node)
        storage = self._raw[node]
        while storage in self._merged:
            storage = self._merged[storage]
        return storage

    def run(self, graph: torch.fx.Graph) -> int:
        self._merged: dict[StorageWeakRef, StorageWeakRef] = {}
        self._raw: dict[object, StorageWeakRef | None] = {}
        count = 0
        for node in list(graph.nodes):
            op = functionalized_op(node)
            if op is None or op.namespace not in self.namespaces:
                continue
            pattern = f"{op}/{'v1' if node.target is AUTO_FUNCTIONALIZED else 'v2'}"
            try:
                plan = self._plan(node, op)
            except Declined as why:
                self.log.declined(self.name, pattern, node, str(why))
                continue
            self.log.matched(self.name, pattern, node)
            self._rewrite(graph, node, op, *plan)
            count += 1
        return count

    # ----------------------------------------------------------------------------------
    def _plan(self, node: torch.fx.Node, op: torch._ops.OpOverload):
        """Check the rewrite is value-preserving; return (targets, replacements, scatters)."""
        is_v1 = node.target is AUTO_FUNCTIONALIZED
        lead = mutation_info.num_leading_outputs(op)
        try:
            written_args = mutated_args(op)
        except NotImplementedError as exc:  # a kind of op mutation_info refuses to map
            raise Declined(str(exc)) from exc
        for arg in written_args:
            schema_arg = op._schema.arguments[arg.position]
            if not _is_tensor_type(schema_arg):
                raise Declined(f"{arg.name}: mutated argument of type {schema_arg.type} (only Tensor is handled)")
            if not is_v1 and f"_{arg.name}_base_index" not in node.kwargs:
                raise Declined(f"{arg.name}: no base in _all_bases (v2 out-operator form)")
        targets = mutated_inputs(node)  # arg name -> the node written in place (v1 arg, v2 base)
        out_of = output_indices(node)  # arg name -> output index of its new value
        storages = {}
        for name, t in targets.items():
            if t is None:
                continue
            if not isinstance(t, torch.fx.Node) or self._storage(t) is None:
                raise Declined(f"{name}: written tensor has no fake value to check aliasing with")
            if is_v1 and self._storage(t) in storages.values():
                raise Declined(f"{name}: shares storage with another written argument (v1 clones each)")
            storages[name] = self._storage(t)
        written = set(storages.values())
        for key, value in node.kwargs.items():
            if key in targets or key == "_all_bases" or not isinstance(value, torch.fx.Node):
                continue
            if self._storage(value) in written:
                raise Declined(f"read-only input {key} aliases a tensor the op writes")

        replacements: dict[torch.fx.Node, object] = {}
        for user in node.users:
            if user.op != "call_function" or user.target is not operator.getitem:
                raise Declined(f"{user.name} uses the functionalized call directly, not through getitem")
            index = user.args[1]
            if index < lead:
                if not op._schema.returns and user.users:
                    raise Declined(f"{user.name} reads the None output of an op without returns")
                replacements[user] = ("return", index)
            else:
                name = next((n for n, i in out_of.items() if i == index), None)
                if name is None or targets[name] is None:
                    raise Declined(f"{user.name} reads output {index}, which carries no written tensor")
                replacements[user] = targets[name]

        # Everything after the call must read the *new* contents of the written buffers:
        # through a getitem (now the buffer itself), or a scatter that writes a region of
        # the new contents back onto itself (a no-op once the op runs in place).
        scatters = []
        n = node.next
        while n.op != "output":
            if n not in replacements and not _is_view(n):
                resolved = lambda x: replacements.get(x, x)  # noqa: E731
                if n.target in SCATTER_VIEWS and self._storage(resolved(n.args[0])) in written:
                    base, src = resolved(n.args[0]), resolved(n.args[1])
                    if isinstance(src, torch.fx.Node) and _same_region(_val(src), _scatter_region(n, _val(base))):
                        replacements[n] = base
                        scatters.append(n)
                        n = n.next
                        continue
                reads = n.args[1:] if n.target is COPY_ else n.args
                for x in _nodes_in((reads, n.kwargs)):
                    if x not in replacements and self._storage(x) in written:
                        raise Declined(f"{n.name} reads {x.name} after the op, and the op would overwrite it in place")
            n = n.next
        for x in _nodes_in(n.args):  # the output node: returning an old buffer
            if x not in replacements and self._storage(x) in written:
                raise Declined(f"the graph returns {x.name}, whose old contents the op would overwrite")
        return targets, replacements, scatters

    # ----------------------------------------------------------------------------------
    def _rewrite(self, graph, node, op, targets, replacements, scatters) -> None:
        is_v1 = node.target is AUTO_FUNCTIONALIZED
        kwargs = node.kwargs
        args, call_kwargs = [], {}
        with graph.inserting_before(node):
            for arg in op._schema.arguments:
                if arg.name in targets:
                    value = targets[arg.name] if is_v1 else self._view_of_base(graph, kwargs, arg.name, targets[arg.name])
                elif arg.name in kwargs:
                    value = kwargs[arg.name]
                else:
                    value = arg.default_value
                if arg.kwarg_only:
                    call_kwargs[arg.name] = value
                else:
                    args.append(value)
            call = graph.call_function(op, tuple(args), call_kwargs)
        call.meta.update({k: node.meta[k] for k in _KEPT_META if k in node.meta})
        call.meta["original_aten"] = op
        _pin_input_strides(call)
        returns = _val(node)[: len(op._schema.returns)] if isinstance(_val(node), (tuple, list)) else ()
        call.meta["val"] = None if not returns else (returns[0] if len(returns) == 1 else tuple(returns))

        for user, value in replacements.items():
            if user in scatters:
                continue
            if isinstance(value, tuple) and not op._schema.returns:  # the unused None of an op without returns
                graph.erase_node(user)
                continue
            if isinstance(value, tuple):  # ("return", i)
                if len(op._schema.returns) == 1:
                    value = call
                else:
                    with graph.inserting_after(call):
                        value = graph.call_function(operator.getitem, (call, value[1]))
                    if len(returns) > user.args[1]:
                        value.meta["val"] = returns[user.args[1]]
            elif _raw_storage(user) is not None and self._storage(value) is not None:
                self._merged[_raw_storage(user)] = self._storage(value)
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)

        # The write-back epilogue is now a no-op: scatters of a region onto itself, then
        # copy_(buffer, buffer). A scatter the graph returns stays (outputs must not alias).
        for scatter in scatters:
            if all(u.op != "output" for u in scatter.users):
                self._merged[_raw_storage(scatter)] = self._storage(scatter.args[0])
                scatter.replace_all_uses_with(scatter.args[0])
                graph.erase_node(scatter)
        n = call.next
        while n.op != "output":
            nxt = n.next
            if n.target is COPY_ and (n.args[0] is n.args[1] or _same_region(_val(n.args[0]), _val(n.args[1]))):
                n.replace_all_uses_with(n.args[0])
                graph.erase_node(n)
            n = nxt

    @staticmethod
    def _view_of_base(graph, kwargs, name, base):
        """The v2 argument ``name``: its base, or the view of it that v2 recorded."""
        if base is None:
            return None
        prefix = f"_{name}"
        if f"{prefix}_alias" in kwargs:
            view = graph.call_function(aten.alias.default, (base,))
        elif f"{prefix}_storage_offset" in kwargs:
            view = graph.call_function(
                aten.as_strided.default,
                (base, kwargs[f"{prefix}_size"], kwargs[f"{prefix}_stride"], kwargs[f"{prefix}_storage_offset"]),
            )
        elif f"{prefix}_slice_dim" in kwargs:
            view = graph.call_function(
                aten.slice.Tensor,
                (base, kwargs[f"{prefix}_slice_dim"], kwargs[f"{prefix}_slice_start"], kwargs[f"{prefix}_slice_end"]),
            )
        else:
            return base
        view.meta["val"] = view.target(_val(base), *view.args[1:])
        return view


def _nodes_in(args) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


def _pin_input_strides(call: torch.fx.Node) -> None:
    """Have Inductor lay the call's inputs out with the strides the graph's values have
    (``eager_input_vals``: the default ``needs_exact_strides`` constraint of a custom op
    reads them; a call a pass inserts without them gets any layout). Why: the op's checks
    passed on those strides when the call was made, and a layout Inductor picks instead
    (a transposed cos, say) fails them while lowering. Left out where an input has no value."""
    def fake(x):
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x

    if all(isinstance(n.meta.get("val"), (torch.Tensor, list, tuple, int, float, bool, torch.SymInt))
           for n in call.all_input_nodes):
        call.meta["eager_input_vals"] = (tuple(torch.fx.node.map_aggregate(a, fake) for a in call.args),
                                         {k: torch.fx.node.map_aggregate(v, fake) for k, v in call.kwargs.items()})
