"""Node emission for the pattern passes: what each rewrite inserts, with fake values.

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

from prepfuse._compat import auto_functionalized_ops
from prepfuse.fx_passes.mutation_info import mutated_args, output_indices
from prepfuse.fx_passes.matching.cos_sin import CosSin
from prepfuse.fx_passes.matching.layouts import Layout, canonical_order
from prepfuse.fx_passes.matching.recognizers import NoMatch, aten, prims, same_size, shape, val
from prepfuse.fx_passes.matching.scratch_buffers import scratch_buffer
from prepfuse.fx_passes.matching.validation import Checked, validate_rewrite
from prepfuse.ops import SCRATCH
from prepfuse.ops.gqa_qknorm_rope_kv_insert import COS_SIN_DTYPES

__all__ = ["Emitter", "as_layout", "cos_sin_args"]


class Emitter:
    """Inserts nodes before ``point``, each with its fake value (later passes read ``meta['val']``)."""

    def __init__(self, graph: torch.fx.Graph, point: torch.fx.Node, source: torch.fx.Node) -> None:
        self.graph, self.point = graph, point
        # the matched code's source line, for the report's rows about emitted nodes
        self.stack_trace = source.meta.get("stack_trace")
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
        self.emitted: list[torch.fx.Node] = []  # every node this emitter inserted, in order
        self.rounded_inputs: set[torch.fx.Node] = set()  # fp32 inputs the call rounds to bf16 (``as_bf16``)

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
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def size(self, tensor: torch.fx.Node, dim: int):
        """``tensor.size(dim)``: an int, or a ``sym_size`` node when it is symbolic."""
        size = shape(tensor)[dim]
        return size if isinstance(size, int) else self.node(aten.sym_size.int, tensor, dim)

    def iota(self, count, device) -> torch.fx.Node:
        """``0, 1, .., count - 1`` (int64; ``count`` a number or a size node), post-grad's arange."""
        return self.node(prims.iota.default, count, start=0, step=1, dtype=torch.int64, device=device,
                         requires_grad=False)

    def empty(self, sizes, dtype, like: torch.fx.Node) -> torch.fx.Node:
        return self.node(aten.empty.memory_format, sizes, dtype=dtype, device=val(like).device, pin_memory=False)

    def scratch(self, base: str, sizes, dtype, like: torch.fx.Node, name: str) -> torch.fx.Node:
        """An arena-backed output buffer (``scratch_buffer``): no allocation per call."""
        node = scratch_buffer(self.graph, self.point, base, sizes, dtype, val(like).device, node_name=name)
        if node.target is SCRATCH and not node.users and node not in self.emitted:  # made now, not reused
            self.emitted.append(node)
        if node.target is SCRATCH and self.stack_trace and "stack_trace" not in node.meta:
            node.meta["stack_trace"] = self.stack_trace
        return node

    def functional_call(self, op, kwargs: dict) -> dict[str, torch.fx.Node]:
        """``auto_functionalized[_v2](op, ..)`` and a getitem per written argument, by name.

        The written arguments come from the schema (``mutation_info``); for v2 each is its
        own base in ``_all_bases``.
        """
        v1, v2 = auto_functionalized_ops()
        written = [arg.name for arg in mutated_args(op)]
        if v2 is not None and torch._inductor.config.enable_auto_functionalized_v2:
            hop = v2
            call = {k: v for k, v in kwargs.items() if k not in written}
            call.update({f"_{name}_base_index": i for i, name in enumerate(written)})
            call["_all_bases"] = [kwargs[name] for name in written]
        else:
            hop, call = v1, kwargs
        af = self.node(hop, op, **call)
        return {name: self.node(operator.getitem, af, index) for name, index in output_indices(af).items()}

    def validate(self, args: dict, checked: list[Checked], extra_roles: dict | None = None, *,
                 slot_capacity: int | None = None, block_size: int | None = None) -> str:
        """Prove the emitted call on probes against the region it replaces
        (``validation.validate_rewrite``) before any reader moves to it: the report's note
        on success; on a mismatch the emitted nodes are erased and ``NoMatch`` says why."""
        roles = dict.fromkeys(self.rounded_inputs, "bf16_values")
        roles.update(extra_roles or {})
        try:
            probes = validate_rewrite(self.emitted, args, checked, roles, slot_capacity=slot_capacity,
                                      block_size=block_size)
        except NoMatch:
            self.discard()
            raise
        return f"validated on {probes} probes"

    def discard(self) -> None:
        """Erase every node this emitter inserted (none may be read by then: nothing was rewired)."""
        for node in reversed(self.emitted):
            if not node.users:
                self.graph.erase_node(node)
        self.emitted = [n for n in self.emitted if n.users]

    def as_bf16(self, node: torch.fx.Node) -> torch.fx.Node:
        """``node`` as the ops read it, bf16. A pattern that found the fp32 value whose
        ``.to(bf16)`` torch 2.11's Inductor dropped (``_compat.inductor_drops_narrowing_round_trips``)
        hands it over as fp32: the cast goes back in front of the call, so the call
        rounds as the code does."""
        if val(node).dtype == torch.float32:
            # the region as it stands reads these fp32 values unrounded: its probes hold
            # bf16 values, so validation checks the rest of the math, not the rounding the
            # code had and the graph lost
            self.rounded_inputs.add(node)
            return self.node(prims.convert_element_type.default, node, torch.bfloat16)
        return node


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


def cos_sin_args(emit: Emitter, cos_sin: CosSin, source: torch.fx.Node, rotary_dim: int) -> dict[str, torch.fx.Node]:
    """The op's ``positions`` and cos/sin operand for ``cos_sin``: the gathered table as it
    is (``cos_sin_cache``; a bf16 one as its two column views ``cos`` and ``sin``), or, for
    values the graph computes per token, ``cos`` and ``sin`` themselves as ``[T, R/2]``
    views with ``positions=None`` (token t reads row t; values shared by the sequences of a
    batch, ``[S, R/2]``, with positions ``i % S`` computed in front of the call):
    the op reads the values Inductor computes, where they lie, in their dtype (fp32 or
    bf16; any other is widened to fp32), with no table built in front of the call.
    Full-width values are read by their first half where the graph proves the halves
    equal, all ``R`` entries otherwise (``full_cos_sin=True``)."""
    if not cos_sin.per_token:
        if val(cos_sin.table).dtype == torch.float32:
            return {"positions": cos_sin.positions, "cos_sin_cache": cos_sin.table}
        # a bf16 table (vLLM's default: the model's dtype): its two column ranges, as they lie
        half = val(cos_sin.table).shape[1] // 2
        return {"positions": cos_sin.positions, "cos_sin_cache": None,
                "cos": emit.node(aten.slice.Tensor, cos_sin.table, 1, 0, half),
                "sin": emit.node(aten.slice.Tensor, cos_sin.table, 1, half, 2 * half)}
    tokens, half = emit.size(source, 0), rotary_dim // 2
    width = rotary_dim if cos_sin.full else half
    operands, positions = {}, None
    for name, values in (("cos", cos_sin.cos), ("sin", cos_sin.sin)):
        rows = emit.node(aten.reshape.default, values, [-1 if cos_sin.shared_by_sequences else tokens, width])
        if cos_sin.full and cos_sin.equal_halves:  # the same R/2 values twice: the first
            rows = emit.node(aten.slice.Tensor, rows, 1, 0, half)
        if val(rows).dtype not in COS_SIN_DTYPES:
            rows = emit.node(prims.convert_element_type.default, rows, torch.float32)
        operands[name] = rows
    if any(val(rows).stride(-1) != 1 for rows in operands.values()):
        # the kernel reads rows with unit stride: strided values (gpt-fast's interleaved
        # (cos, sin) pairs) are written once into one [N, 2, R/2] buffer, one kernel for both,
        # and read as its two row views; rows shared by the B sequences of a batch are
        # written once per token of every sequence by that same kernel ([B * S, 2, R/2]),
        # so that no positions need computing in front of the call
        columns = [emit.node(aten.unsqueeze.default, operands[n], 1) for n in ("cos", "sin")]
        if cos_sin.shared_by_sequences:
            rows = emit.size(operands["cos"], 0)
            both_ints = isinstance(tokens, int) and isinstance(rows, int)
            sequences = tokens // rows if both_ints else emit.node(operator.floordiv, tokens, rows)
            columns = [emit.node(aten.expand.default, emit.node(aten.unsqueeze.default, c, 0), [sequences, -1, -1, -1])
                       for c in columns]
        both = emit.node(aten.cat.default, columns, len(shape(columns[0])) - 2)
        if cos_sin.shared_by_sequences:
            both = emit.node(aten.reshape.default, both, [tokens, 2, -1])
        operands = {name: emit.node(aten.select.int, both, 1, i) for i, name in enumerate(("cos", "sin"))}
    elif cos_sin.shared_by_sequences:  # one row per position, shared by the sequences: token i reads row i % rows
        positions = emit.node(aten.remainder.Scalar, emit.iota(tokens, val(source).device), emit.size(operands["cos"], 0))
    extra = {"full_cos_sin": True} if cos_sin.full_operand else {}
    return {"positions": positions, "cos_sin_cache": None, **operands, **extra}
