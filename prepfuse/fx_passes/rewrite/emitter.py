"""Node emission for the fusion passes: what each rewrite inserts, with fake values.

Every fused-op pass builds its replacement the same way: nodes inserted before one
point (the first reader of the outputs), each given its fake value (later passes and
Inductor read ``meta['val']``) and the matched code's source line (for the report),
output buffers from the scratch arena, and the call as ``auto_functionalized[_v2]``
with a getitem per written argument, derived from the op's schema.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from prepfuse._compat import auto_functionalized_ops
from prepfuse.fx_passes.mutation_info import mutated_args, output_indices
from prepfuse.fx_passes.matching.layouts import Layout, canonical_order
from prepfuse.fx_passes.matching.nodes import NoMatch, aten, graph_order, prims, same_size, shape, val
from prepfuse.fx_passes.rewrite.scratch_buffers import emit_scratch, scratch_buffer
from prepfuse.ops import SCRATCH
from prepfuse.ops._library import float_args, tensor_floats_overload

__all__ = ["Emitter", "as_layout"]


class Emitter:
    """Inserts nodes before ``point``, each with its fake value (later passes read ``meta['val']``)."""

    def __init__(self, graph: torch.fx.Graph, point: torch.fx.Node, source: torch.fx.Node, readers=()) -> None:
        self.graph, self.point = graph, point
        self.readers = set(readers)  # readers of what the call replaces: never moved (``inputs_in_order``)
        # the matched code's source line, for the report's rows about emitted nodes
        self.stack_trace = source.meta.get("stack_trace")
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
        self.emitted: list[torch.fx.Node] = []  # every node this emitter inserted, in order
        self.fresh_scratch = False  # ``beside_another``

    def beside_another(self) -> Emitter:
        """This emitter for a call tried while another stays in the graph: its scratch is a new
        view, never the contents the other call writes (it would be ordered after them)."""
        self.fresh_scratch = True
        return self

    def node(self, target, *args, name: str | None = None, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.point):
            node = self.graph.call_function(target, args, kwargs)
        self.emitted.append(node)
        if name is not None:
            node._rename(name)
        if self.stack_trace:
            node.meta["stack_trace"] = self.stack_trace
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = _functional_value(target, fake_args, fake_kwargs) or target(*fake_args, **fake_kwargs)
        return node

    def size(self, tensor: torch.fx.Node, dim: int):
        """``tensor.size(dim)``: an int, or a ``sym_size`` node when it is symbolic."""
        size = shape(tensor)[dim]
        return size if isinstance(size, int) else self.node(aten.sym_size.int, tensor, dim)

    def count(self, tensor: torch.fx.Node, dims) -> int | torch.fx.Node:
        """The product of ``tensor``'s sizes over ``dims``: a number, or ``sym_size`` nodes
        multiplied (one tensor's token count, its heads and head dim left out)."""
        total = 1
        for d in dims:
            size = self.size(tensor, d)
            if isinstance(total, int) and isinstance(size, int):
                total = total * size
            elif isinstance(total, int) and total == 1:
                total = size
            else:
                total = self.node(operator.mul, total, size)
        return total

    def iota(self, count, device) -> torch.fx.Node:
        """``0, 1, .., count - 1`` (int64; ``count`` a number or a size node), post-grad's arange."""
        return self.node(prims.iota.default, count, start=0, step=1, dtype=torch.int64, device=device,
                         requires_grad=False)

    def empty(self, sizes, dtype, like: torch.fx.Node) -> torch.fx.Node:
        return self.node(aten.empty.memory_format, sizes, dtype=dtype, device=val(like).device, pin_memory=False)

    def scratch(self, base: str, sizes, dtype, like: torch.fx.Node, name: str) -> torch.fx.Node:
        """An arena-backed output buffer (``scratch_buffer``): no allocation per call."""
        make = emit_scratch if self.fresh_scratch else scratch_buffer
        node = make(self.graph, self.point, base, sizes, dtype, val(like).device, node_name=name)
        if node.target is SCRATCH and not node.users and node not in self.emitted:  # made now, not reused
            self.emitted.append(node)
        if node.target is SCRATCH and self.stack_trace and "stack_trace" not in node.meta:
            node.meta["stack_trace"] = self.stack_trace
        return node

    def functional_call(self, op, kwargs: dict) -> dict[str, torch.fx.Node]:
        """``auto_functionalized[_v2](op, ..)`` and a getitem per written argument, by name.

        The written arguments come from the schema (``mutation_info``); for v2 each is its
        own base in ``_all_bases``. A float operand given as a node (a run-time float the
        graph reads, ``regions.eps_inputs``) makes the call the op's ``tensor_floats`` overload.
        """
        v1, v2 = auto_functionalized_ops()
        op = _with_floats_of(op, kwargs)
        written = [arg.name for arg in mutated_args(op)]
        kwargs = self.dense_rows(kwargs, written)
        if v2 is not None and torch._inductor.config.enable_auto_functionalized_v2:
            hop = v2
            call = {k: v for k, v in kwargs.items() if k not in written}
            call.update({f"_{name}_base_index": i for i, name in enumerate(written)})
            call["_all_bases"] = [kwargs[name] for name in written]
        else:
            hop, call = v1, kwargs
        af = self.node(hop, op, **call)
        return {name: self.node(operator.getitem, af, index) for name, index in output_indices(af).items()}

    def dense_rows(self, args: dict, written) -> dict:
        """``args`` with every tensor the call only reads made dense along its last dim (a
        contiguous copy) where it may not be: the ops load rows with wide vector loads and
        refuse a strided last dim, and model code hands them such views (``slot_info[:, 0]``
        of a ``[T, 2]`` metadata tensor, ``slots[::2]``). A copy keeps the rewrite valid where
        the op would refuse it; a written argument is the cache itself and is never copied."""
        dense = dict(args)
        for name, arg in args.items():
            fake = val(arg) if isinstance(arg, torch.fx.Node) and name not in written else None
            if isinstance(fake, torch.Tensor) and fake.dim() and not _dense_last_dim(fake):
                dense[name] = self.node(aten.clone.default, arg, memory_format=torch.contiguous_format)
        return dense

    def inputs_in_order(self) -> None:
        """Every graph node the emitted nodes read computed before them: an input the graph
        computes after the insertion point is moved (with what it needs) in front of it
        (``hoist_before``), or NoMatch where it needs a reader of what the call replaces."""
        emitted = set(self.emitted)
        order = graph_order(self.graph)
        first = min(self.emitted, key=order.__getitem__, default=self.point)
        late = [i for n in self.emitted for i in n.all_input_nodes if i not in emitted and order[i] > order[first]]
        if late and not hoist_before(first, late, order, self.readers):
            raise NoMatch("order: an input of the call is computed from what the call replaces")

    def discard(self) -> None:
        """Erase every node this emitter inserted (none may be read by then: nothing was rewired)."""
        for node in reversed(self.emitted):
            if not node.users:
                self.graph.erase_node(node)
        self.emitted = [n for n in self.emitted if n.users]


def _with_floats_of(op, kwargs: dict):
    """``op``, or its ``tensor_floats`` overload where ``kwargs`` gives a float operand as a
    graph node (every float operand then a node or None: the overload takes them as tensors)."""
    floats = float_args(op)
    nodes = [n for n in floats if isinstance(kwargs.get(n), torch.fx.Node)]
    if not nodes:
        return op
    constants = [n for n in floats if n not in nodes and kwargs.get(n) is not None]
    if constants:
        raise NoMatch(f"{', '.join(nodes)} read when the graph runs and {', '.join(constants)} a constant: "
                      "the op takes its floats one way")
    return tensor_floats_overload(op)


def _functional_value(target, args: tuple, kwargs: dict) -> tuple | None:
    """The fake value of ``auto_functionalized[_v2](op, ..)`` as the call the emitter makes
    gives it, without the higher-order op's own fake path, or None where that path is needed.
    The op's fake impl runs on the written arguments (its checks refuse a bad call as before);
    the outputs are ``(None, *new values)``, each new value laid out as the tensor it replaces
    (a base, or a v1 written argument), which is all later passes and Inductor read of them.
    Why: the higher-order op clones every base through fake dispatch, about half of what
    emitting a fused call costs a compile (bench/compile_overhead.py)."""
    v1, v2 = auto_functionalized_ops()
    if target not in (v1, v2) or not args or len(args[0]._schema.returns):
        return None
    op, written = args[0], [a.name for a in mutated_args(args[0])]
    if target is v1:
        new = [kwargs[name] for name in written]
        call = kwargs
    else:
        extra = {k for k in kwargs if k.startswith("_")}
        if extra - {"_all_bases"} - {f"_{n}_{part}" for n in written
                                     for part in ("base_index", "size", "stride", "storage_offset")}:
            return None  # view information the emitter never writes (a slice, an alias): the op's own path
        new = kwargs["_all_bases"]
        call = {k: v for k, v in kwargs.items() if k not in extra}
        for name in written:
            base = new[kwargs[f"_{name}_base_index"]]
            view = tuple(kwargs.get(f"_{name}_{part}") for part in ("size", "stride", "storage_offset"))
            call[name] = base if view == (None, None, None) else base.as_strided(*view)
    if any(not isinstance(t, torch.Tensor) or t.storage_offset() != 0 for t in new):
        return None  # a clone keeps the offset: the op's own path
    op(**call)
    return (None, *(t.new_empty_strided(t.shape, t.stride()) for t in new))


def _dense_last_dim(t: torch.Tensor) -> bool:
    """Whether ``t``'s last dim is certainly unit-strided or at most one element (no guard)."""
    return statically_known_true(t.shape[-1] <= 1) or statically_known_true(t.stride(-1) == 1)


def as_layout(emit: Emitter, tensor: torch.fx.Node, layout: Layout, like: torch.fx.Node) -> torch.fx.Node:
    """``tensor`` (token-major ``[T, H, D]``) laid out as ``like``, whose dims ``layout`` gives
    as factors of the same values (``[B, H, S, D]`` ...): a reshape and a permute, or
    ``tensor`` itself where ``like`` is token-major ``[T, H, D]`` already. Sizes come from the
    layout (one symbolic size, the token count or a batch's dynamic length, is ``-1``), never
    from ``like``, which may be computed after the point the nodes go in."""
    order = canonical_order(layout)
    if order is None:
        raise ValueError(f"as_layout: {like.name}'s layout mixes base dims: {layout}")
    sizes = []
    for group in layout.dims:
        size = 1
        for factor in group:
            size = size * factor.size
        sizes.append(size)
    canonical = [sizes[i] for i in sorted(range(len(order)), key=order.__getitem__)]
    identity = order == list(range(len(order)))
    if identity and len(canonical) == len(shape(tensor)) and all(same_size(a, b) for a, b in zip(canonical, shape(tensor))):
        return tensor
    symbolic = [i for i, s in enumerate(canonical) if not isinstance(s, int)]
    if len(symbolic) > 1:  # a dynamic batch and a dynamic length: -1 stands for one of them only
        emit.discard()
        raise NoMatch(f"q: {like.name} is {list(canonical)} with {len(symbolic)} dynamic sizes; the op's q_out "
                      "is laid out back with at most one")
    canonical = [s if isinstance(s, int) else -1 for s in canonical]  # the tokens, or a dynamic length
    node = emit.node(aten.reshape.default, tensor, canonical)
    return node if identity else emit.node(aten.permute.default, node, order)


def viewed_call(emit: Emitter, op, args: dict, views: dict) -> tuple[dict, dict]:
    """The call writing arguments as views of graph buffers: ``views`` maps an argument to
    ``(root, view)``, ``view`` the fake tensor the op writes (sizes, strides and storage
    offset within ``root``'s storage; several may share a root: k and v caches of one
    ``[NB, 2, bs, Hkv, D]`` buffer). For v2 each root is one base and each view is
    regenerated from it (``_<arg>_size/_stride/_storage_offset``), which defunctionalize turns
    into in-place writes; for v1 the views are ``as_strided`` of their roots and their new
    values are scattered back. Returns ``({other written argument: its new value},
    {root: its new value})``."""
    v1, v2 = auto_functionalized_ops()
    op = _with_floats_of(op, args)
    written = [a.name for a in mutated_args(op)]
    args = emit.dense_rows(args, written)
    roots = list(dict.fromkeys(root for root, _ in views.values()))
    strided = {name: (list(view.shape), list(view.stride()), view.storage_offset()) for name, (_, view) in views.items()}
    plain = [name for name in written if name not in views]
    if v2 is not None and torch._inductor.config.enable_auto_functionalized_v2:
        call = {k: v for k, v in args.items() if k not in written}
        bases = [args[name] for name in plain] + roots
        call["_all_bases"] = bases
        for i, name in enumerate(plain):
            call[f"_{name}_base_index"] = i
        for name, (root, _) in views.items():
            size, stride, offset = strided[name]
            call.update({f"_{name}_base_index": len(plain) + roots.index(root), f"_{name}_size": size,
                         f"_{name}_stride": stride, f"_{name}_storage_offset": offset})
        af = emit.node(v2, op, **call)
        index = output_indices(af)
        new = {root: emit.node(operator.getitem, af, index[next(n for n, (r, _) in views.items() if r is root)])
               for root in roots}
        return {name: emit.node(operator.getitem, af, index[name]) for name in plain}, new
    call = dict(args, **{name: emit.node(aten.as_strided.default, root, *strided[name])
                         for name, (root, _) in views.items()})
    af = emit.node(v1, op, **call)
    index = output_indices(af)
    new = {root: root for root in roots}
    for name, (root, _) in views.items():
        new[root] = emit.node(aten.as_strided_scatter.default, new[root], emit.node(operator.getitem, af, index[name]),
                              *strided[name])
    return {name: emit.node(operator.getitem, af, index[name]) for name in plain}, new


def hoist_before(point: torch.fx.Node, nodes, order: dict, readers: set) -> bool:
    """Move ``nodes``, and every node after ``point`` they need, to just before ``point``,
    keeping their order; nothing moves and False where one of them is ``point``, a reader
    of an output (``readers``), or a node with an effect. Inductor's post-grad
    ``reorder_for_locality`` moves a producer next to its first user, which can put a
    call's input after the first reader of its outputs (transformers' paged cache writes
    k, writes v, then reads k back)."""
    late, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n in late or order[n] < order[point]:
            continue
        if n is point or n in readers or n.op != "call_function" or n.is_impure():
            return False
        late.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        point.prepend(n)
    return True
