"""Probes: run a region and candidate calls on the same inputs, and compare what they write.

A family finds a region by what it writes and decides which op call computes it by
running candidates against it (``search.py``). ``Probes`` holds, per probe, one value for
every leaf of the region (``regions.backward``) and the region's values computed from
them, once; ``check`` runs a candidate's emitted nodes (the call, with whatever graph
nodes it reads: a norm upstream, cos/sin however the model makes them, computed from the
same leaves) and compares each of its outputs with the region's (``compare.py``).

Probe values follow the leaf's role. A family names the roles it knows (``slots``: the
cache's slots; ``positions``: rows of a table; ``slot_block``/``slot_row``: a page table's
indices, drawn as distinct (block, row) pairs; ``sequence_blocks``/``sequence_rows``: one
block per row of positions, distinct blocks and distinct positions within each;
``sequence_slots``: each sequence's own positions; ``bf16_values``: fp32 values the code
had rounded to bf16 where the graph lost the rounding), and may give a role to a node inside
the region, which then counts as a leaf of both sides. The rest is read off the leaf: a
written graph input is a cache (random valid values, so rows the call must not write are
compared too); an int input used as an index draws below the indexed size; a one-value float
is a positive scale; a 1-d float is a weight around 1; a float gathered by index a cos/sin
table in [-1, 1]; anything else an activation. Two probes, fixed seed (a
compile's outcome does not change between runs): one at unit scale with distinct valid
slots; one of edge values by row (a zero row, an all-equal row, a row of magnitude 1e-3
where an eps decides, one of 1e-6 below every amax floor, the rest x32; a scale 16 times
smaller, so that rows divided by it overflow an fp8 cast and saturation and NaN tell apart)
whose slots include the values eager indexing accepts beyond that: negative ones (a slot
counts from the cache's end) and, on the CPU, one repeated (the last writer's row stays).
Sizes are the graph's own, a dynamic size at its traced value.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from prepfuse.fx_passes.rewrite.compare import Checked, Mismatch, compare
from prepfuse.fx_passes.matching.nodes import CONVERTS, NoMatch, aten, concrete, is_op, shape, val, where
from prepfuse.fx_passes.matching.regions import backward, is_eps_input, leaves
from prepfuse.ops import SCRATCH

__all__ = ["Probes", "Mismatch", "NUM_PROBES", "further"]

NUM_PROBES = 2
# a region that reaches this far back from its outputs is not one layer's preparation
MAX_REGION_NODES = 4000
_SEED = 20261201
_POISON = -123.0


@dataclass
class _Limits:
    slots: int | None = None  # slots of the cache the op writes
    positions: int | None = None  # rows of the cos/sin table
    block_size: int | None = None  # for slot_block / slot_row
    repeats: bool = True  # the CPU: the edge probe repeats a slot (eager's last writer is defined) and counts
    # index_copy_'s positions from the end (CUDA's kernel does not wrap them)


class Probes:
    """A region's probe values and results (``outputs`` and everything they read, back to
    the leaves and the nodes ``roles`` names)."""

    def __init__(self, outputs: list[torch.fx.Node], roles: dict[torch.fx.Node, str] | None = None, *,
                 slots: int | None = None, positions: int | None = None, block_size: int | None = None,
                 mode: str = "probe", memo: dict | None = None) -> None:
        self.roles = dict(roles or {})
        self.outputs = list(outputs)
        self.memo = memo if memo is not None else {}  # per graph: what regions of the same form showed
        self.count = 1 if mode == "quick" else NUM_PROBES
        self.nodes = backward(outputs, cut=set(self.roles), limit=MAX_REGION_NODES)
        if len(self.nodes) > MAX_REGION_NODES:
            raise NoMatch(f"the region reads more than {MAX_REGION_NODES} steps back from what it writes: not one "
                          "layer's preparation")
        device = next((val(o).device for o in outputs if isinstance(val(o), torch.Tensor)), torch.device("cpu"))
        # a dynamic size counts at its traced value: comparing the symbol would add a guard
        slots, positions, block_size = (None if n is None else concrete(n) for n in (slots, positions, block_size))
        self.limits = _Limits(slots, positions, block_size, repeats=device.type == "cpu")
        self._leaf_values: list[dict] = [{} for _ in range(NUM_PROBES)]
        self._region: list[dict | None] = [None] * NUM_PROBES

    def region(self, probe: int) -> dict:
        if self._region[probe] is None:
            values = self._values(leaves(self.nodes), probe)
            self._region[probe] = _run(self.nodes, values, "the code")
        return self._region[probe]

    def form(self) -> tuple:
        """The region's form: every step's op, constants and where its inputs come from (by
        position in the region), the leaves' roles, dtypes and sizes, and the probe limits.
        Two regions of one form (a model's layers) run the same on the probes: a family may
        take one's outcome for the other (``search.first_agreeing``) instead of running it."""
        if getattr(self, "_form", None) is None:
            index, outer = self._structural_order()

            def ref(x):
                if isinstance(x, torch.fx.Node):
                    return ("n", index[x]) if x in index else ("l", outer[x]) if x in outer else ("?", x.name)
                if isinstance(x, (list, tuple)):
                    return tuple(ref(i) for i in x)
                if isinstance(x, dict):
                    return tuple((k, ref(v)) for k, v in x.items())
                return repr(x)

            def meta(n):
                v = val(n)
                return (str(v.dtype), repr(tuple(v.shape))) if isinstance(v, torch.Tensor) else repr(v)

            steps = tuple((str(n.target), ref(n.args), ref(n.kwargs), meta(n)) for n in sorted(index, key=index.get))
            inputs = tuple((self.roles.get(n) or _role(n), meta(n)) for n in outer)
            self._form = (steps, inputs, ref(self.outputs), repr(self.limits), self.count)
        return self._form

    def position(self, node: torch.fx.Node):
        """Where ``node`` stands in the region's form (``form``)."""
        return self._structural_order()[0].get(node, node.name)

    def _structural_order(self) -> tuple[dict, dict]:
        """The region's steps and leaves numbered as a walk from the outputs through each
        step's inputs in argument order meets them: the numbering follows the code's
        structure, not where the graph happens to place each node (layers interleave)."""
        if getattr(self, "_order", None) is None:
            members, index, outer = set(self.nodes), {}, {}
            stack = [(n, False) for n in reversed(self.outputs)]
            while stack:
                node, done = stack.pop()
                if node in index:
                    continue
                if done:
                    index[node] = len(index)
                    continue
                stack.append((node, True))
                for x in reversed(node.all_input_nodes):
                    if x in members:
                        stack.append((x, False))
                for x in node.all_input_nodes:
                    if x not in members:
                        outer.setdefault(x, len(outer))
            self._order = (index, outer)
        return self._order

    def equal_parts(self, node: torch.fx.Node, pairs: bool = False) -> bool:
        """Whether ``node``'s last dim holds its values twice on every probe: two equal halves
        (Hugging Face's ``cat((f, f))``), or with ``pairs`` equal adjacent entries
        (``repeat_interleave(2)``)."""
        key = ("equal parts", self.form(), self.position(node), pairs)
        if key not in self.memo:
            self.memo[key] = self._equal_parts(node, pairs)
        return self.memo[key]

    def _equal_parts(self, node: torch.fx.Node, pairs: bool) -> bool:
        for probe in range(self.count):
            value = self.region(probe).get(node)
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[-1] % 2:
                return False
            a, b = (value[..., 0::2], value[..., 1::2]) if pairs else value.chunk(2, dim=-1)
            if not torch.equal(a, b):
                return False
        return True

    def check(self, emitted: list[torch.fx.Node], checked: list[Checked],
              beat: tuple[int, ...] | None = None) -> tuple[int, tuple[int, ...]]:
        """Run the candidate (``emitted`` and the graph nodes it reads) on every probe and
        compare its outputs with the region's; returns the probes run and, per probe, how
        many values differ within the bounds (0: bit for bit), or raises Mismatch. With
        ``beat`` (another candidate's counts) it stops after the first probe where it is
        further from the code than that one (``further``): it cannot be the closer."""
        emitted_set, inexact = set(emitted), ()
        for probe in range(self.count):
            if further(inexact, beat):
                return probe, inexact
            region = self.region(probe)
            call_nodes = backward([c.call for c in checked], cut=set(self.roles) | {
                n for n in region if n not in emitted_set}, keep=emitted_set)
            known = {n: v for n, v in region.items() if n not in emitted_set}
            extra = [leaf for leaf in leaves(call_nodes) if leaf not in known]
            known.update(self._values(extra, probe))
            call = _run(call_nodes, known, "the fused call")
            inexact += (sum(compare(c, call[c.call], region[c.region], probe, {**known, **region}, call)
                            for c in checked),)
        return self.count, inexact

    # ----------------------------------------------------------------------------------
    def _values(self, nodes, probe: int) -> dict:
        cache = self._leaf_values[probe]
        with unset_fake_temporarily(), torch.no_grad():
            for node in nodes:
                if node not in cache:
                    gen = torch.Generator().manual_seed(_SEED + 7919 * probe + _stable_id(node))
                    role = self.roles.get(node) or _role(node)
                    cache[node] = _probe_value(node, role, self.limits, probe, gen)
                    drawn_as_indices = (role or "").startswith(("slot", "sequence"))
                    if probe == 1 and self.limits.repeats and not drawn_as_indices \
                            and role not in ("cache", "slots", "weight", "scale", "eps", "table"):
                        cache[node] = _same_last_token(cache[node], self._inserted())
        return {n: cache[n] for n in nodes}

    def _inserted(self) -> int | None:
        """How many rows the slots insert (the repeated slot's writers are rows 1 and n - 1)."""
        for node, role in self.roles.items():
            if role == "slots":
                return concrete(shape(node)[0]) if shape(node) else None
        return None


def further(counts: tuple[int, ...], beat: tuple[int, ...] | None) -> bool:
    """Whether a candidate whose first probes gave ``counts`` (values that differ from the
    code's, per probe) is already further from the code than one that gave ``beat``: the
    unit-scale probe decides, the edge probe breaks a tie."""
    return beat is not None and counts > beat[:len(counts)]


def _same_last_token(value, n: int | None):
    """``value`` with token ``n - 1``'s row a copy of token 1's, along its token dim (the
    first, or the second under a batch of one): the edge probe gives those two tokens one
    slot, and eager index assignment leaves a slot written twice undefined unless both
    rows are the same; the call must still write it whole and not fail."""
    if not isinstance(value, torch.Tensor) or n is None or n < 3 or value.dim() == 0:
        return value
    dim = 0 if value.shape[0] == n else (1 if value.dim() > 1 and value.shape[0] == 1 and value.shape[1] == n else None)
    if dim is None or value.stride(dim) == 0:
        return value
    value = value.clone()
    value.select(dim, n - 1).copy_(value.select(dim, 1))
    return value


def _stable_id(node: torch.fx.Node) -> int:
    """A per-node seed offset that does not change between compiles of one graph."""
    order = 0
    for order, n in enumerate(node.graph.nodes):
        if n is node:
            break
    return order * 131


# --------------------------------------------------------------------------------------
# Roles read off a leaf
# --------------------------------------------------------------------------------------
def _role(node: torch.fx.Node) -> str | None:
    fake = val(node)
    if not isinstance(fake, torch.Tensor):
        return None
    for user in node.users:  # written: a cache
        if is_op(user, aten.index_put.default, aten.slice_scatter.default, aten.copy_.default) and user.args[0] is node:
            return "cache"
        if is_op(user, aten.view.default, aten.reshape.default, aten.slice.Tensor, aten.select.int,
                 aten.as_strided.default, aten.view.dtype) and _role(user) == "cache":
            return "cache"
    if fake.dtype in (torch.int64, torch.int32, torch.int16):
        size = _indexed_size(node)
        return f"index:{size}" if size is not None else "index:1024"
    if fake.dtype.is_floating_point:
        if is_eps_input(node):
            return "eps"
        if fake.numel() == 1:
            return "scale"
        if any(is_op(u, aten.index.Tensor, aten.index_select.default) and u.args[0] is node for u in node.users) \
                or any(is_op(u, aten.embedding.default) and u.args[0] is node for u in node.users):
            return "table"  # rows gathered by position: cos/sin, values in [-1, 1]
        if fake.dim() == 1:
            return "weight"
    return None


def _indexed_size(node: torch.fx.Node) -> int | None:
    """The size of the dim ``node`` (through views) indexes, where it is used as an index."""
    sizes = []
    for user in node.users:
        if is_op(user, aten.index.Tensor) and node in list(user.args[1]):
            dim = list(user.args[1]).index(node)
            sizes.append(concrete(shape(user.args[0])[dim]))
        elif is_op(user, aten.index_select.default) and user.args[2] is node:
            sizes.append(concrete(shape(user.args[0])[user.args[1]]))
        elif is_op(user, aten.embedding.default) and user.args[1] is node:
            sizes.append(concrete(shape(user.args[0])[0]))
        elif is_op(user, aten.index_put.default) and node in list(user.args[1]):
            dim = list(user.args[1]).index(node)
            sizes.append(concrete(shape(user.args[0])[dim]))
        elif is_op(user, aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.expand.default,
                   aten.slice.Tensor, aten.select.int, aten.squeeze.dim, aten.squeeze.default, aten.permute.default,
                   aten.clone.default, aten.alias.default, *CONVERTS):  # a column of a metadata tensor too
            inner = _indexed_size(user)
            if inner is not None:
                sizes.append(inner)
    return min(sizes) if sizes else None


def _probe_value(node: torch.fx.Node, role: str | None, limits: _Limits, probe: int, gen: torch.Generator):
    if node.op == "get_attr":  # a constant of the graph: its real value
        return _attr(node)
    fake = val(node)
    if isinstance(fake, (int, torch.SymInt)):
        return concrete(fake)
    if isinstance(fake, (float, bool)) or fake is None:
        return fake
    if not isinstance(fake, torch.Tensor):
        raise NoMatch(f"no probe value for an input of type {type(fake).__name__}")
    sizes, strides = [concrete(s) for s in fake.shape], [concrete(s) for s in fake.stride()]
    if any(st == 0 and sz > 1 for sz, st in zip(sizes, strides)):  # an expanded input: values repeat along it
        base = [1 if st == 0 else sz for sz, st in zip(sizes, strides)]
        return _values(role, base, fake.dtype, limits, probe, gen).to(fake.device).expand(sizes)
    dense = _values(role, sizes, fake.dtype, limits, probe, gen)
    out = torch.empty_strided(sizes, strides, dtype=fake.dtype, device=fake.device)
    out.copy_(dense.to(out.device))
    return out


def _slots(n: int, capacity: int, probe: int, gen, repeats: bool, from_end: bool = True) -> torch.Tensor:
    if capacity is None or n > capacity:
        raise NoMatch(f"{n} rows do not fit the cache ({capacity} slots)")
    slots = torch.randperm(capacity, generator=gen)[:n]
    if probe == 1 and n >= 2 and from_end:  # what eager indexing accepts too: slots counted from the end, a repeat
        slots[0] = slots[0] - capacity
        if n >= 3 and repeats:
            slots[-1] = slots[1]
    return slots


def _values(role, sizes, dtype, limits: _Limits, probe: int, gen) -> torch.Tensor:
    """Dense CPU values for one input, by role."""
    n = 1
    for s in sizes:
        n *= s
    if role == "slots":
        return _slots(n, limits.slots, probe, gen, limits.repeats).reshape(sizes).to(dtype)
    if role == "sequence_slots":  # [B, T] positions of B sequences, each row's own
        if limits.slots is None or len(sizes) != 2 or sizes[1] > limits.slots:
            raise NoMatch(f"{sizes} positions do not fit the sequences ({limits.slots} positions each)")
        # index_copy_ takes a negative index only on the CPU (CUDA's kernel does not wrap it)
        return torch.stack([_slots(sizes[1], limits.slots, probe, gen, False, from_end=limits.repeats)
                            for _ in range(sizes[0])]).to(dtype)
    if role in ("sequence_blocks", "sequence_rows"):  # [B, 1] blocks, [B, T] rows: distinct pairs
        if limits.slots is None or limits.block_size is None or sizes[-1] > limits.block_size:
            raise NoMatch(f"{sizes} positions do not fit a block ({limits.block_size} positions)")
        blocks = limits.slots // limits.block_size
        if role == "sequence_blocks":
            if n > blocks:
                raise NoMatch(f"{n} sequences do not fit the cache ({blocks})")
            drawn = torch.randperm(blocks, generator=torch.Generator().manual_seed(_SEED + 97 * probe))[:n]
            if probe == 1 and n >= 2 and limits.repeats:  # a block counted from the end
                drawn[0] -= blocks
            return drawn.reshape(sizes).to(dtype)
        lead = n // max(sizes[-1], 1)
        rows = torch.stack([torch.randperm(limits.block_size, generator=gen)[:sizes[-1]] for _ in range(lead)])
        if probe == 1 and rows.numel() and limits.repeats:  # a position counted from its sequence's end
            rows[0, 0] -= limits.block_size
        return rows.reshape(sizes).to(dtype)
    if role in ("slot_block", "slot_row"):  # one permutation of the slots for both: distinct pairs
        if limits.slots is None or limits.block_size is None or n > limits.slots:
            raise NoMatch(f"{n} block/row pairs do not fit the cache ({limits.slots} slots)")
        slots = torch.randperm(limits.slots, generator=torch.Generator().manual_seed(_SEED + 97 * probe))[:n]
        if role == "slot_block":
            blocks = slots // limits.block_size
            if probe == 1 and n >= 2:  # a block counted from the end
                blocks[0] -= limits.slots // limits.block_size
            return blocks.reshape(sizes).to(dtype)
        return (slots % limits.block_size).reshape(sizes).to(dtype)
    if role == "positions" or (role or "").startswith("index:"):
        rows = limits.positions if role == "positions" else int(role.split(":")[1])
        if not rows:
            raise NoMatch("no rows to draw positions from")
        if not limits.repeats and sizes and sizes[-1] <= rows:  # distinct along the tokens: positions may
            # make slots (b * S + pos), and a slot written twice is undefined off the CPU
            lead = 1
            for size in sizes[:-1]:
                lead *= size
            return torch.stack([torch.randperm(rows, generator=gen)[:sizes[-1]] for _ in range(lead)]) \
                .reshape(sizes).to(dtype)
        return torch.randint(0, rows, sizes, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.rand(sizes, generator=gen) < 0.5
    if dtype.is_complex:
        angle = 6.28 * torch.rand(sizes, generator=gen)
        return torch.polar(torch.ones(sizes), angle).to(dtype)
    if not (dtype.is_floating_point or dtype == torch.uint8):
        return torch.randint(0, 16, sizes, generator=gen).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, sizes, generator=gen, dtype=torch.uint8)
    if role == "eps":  # an eps the graph reads at run time: one the edge probe's 1e-3 rows feel, its own
        # per input, so that a call reading another input's eps differs
        return torch.full(sizes, 1e-6 * (1 + 9 * torch.rand((), generator=gen).item()), dtype=dtype)
    if role == "scale":  # the edge probe's small: rows divided by it overflow an fp8 cast (saturation vs NaN)
        return ((0.5 + 1.5 * torch.rand(sizes, generator=gen)) * (2.0**-4 if probe == 1 else 1.0)).to(dtype)
    if role == "table":
        return (2 * torch.rand(sizes, generator=gen) - 1).to(dtype)
    if role == "weight":
        return (1 + 0.5 * torch.randn(sizes, generator=gen)).to(dtype)
    x = torch.randn(sizes, generator=gen)
    if role == "cache":
        return x.to(dtype)
    if probe == 1 and n:  # edge values, by row (the last dim): zero, all equal, small, tiny; the rest large
        rows = x.reshape(-1, sizes[-1] if sizes else 1) * 32.0
        rows[0] = 0.0
        if rows.shape[0] > 1:
            rows[1] = 0.75
        if rows.shape[0] > 2:
            rows[2] *= 1e-3 / 32.0  # where an eps decides
        if rows.shape[0] > 3:
            rows[3] *= 1e-6 / 32.0  # below the amax floors block-scaled formats keep
        x = rows.reshape(sizes)
    if role == "bf16_values":
        x = x.to(torch.bfloat16)
    return x.to(dtype)


def _attr(node: torch.fx.Node):
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


# --------------------------------------------------------------------------------------
def _run(nodes: list[torch.fx.Node], known: dict, what: str) -> dict:
    env = {leaf: value.clone() if isinstance(value, torch.Tensor) else value for leaf, value in known.items()}
    with unset_fake_temporarily(), torch.no_grad(), _one_thread():
        for node in nodes:
            if node in env:
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            # a size the graph holds symbolically runs at its traced value: a probe never
            # reasons about a symbol (which would add a guard)
            args, kwargs = _numbers(args), {k: _numbers(v) for k, v in kwargs.items()}
            try:
                if node.target is SCRATCH:  # fresh poisoned memory, not an arena handout
                    _, sizes, dtype, device = args
                    env[node] = _poisoned(sizes, dtype, device)
                elif node.target is operator.getitem:
                    env[node] = args[0][args[1]]
                else:
                    env[node] = node.target(*args, **kwargs)
            except NoMatch:
                raise
            except Exception as err:  # the probes are outside what this step accepts
                first = str(err).splitlines()[0] if str(err) else ""
                # said as the step of the code that refused the probe inputs, not as the error's type
                raise NoMatch(f"{what} did not run on the probe inputs at {where(node)}"
                              + (f" ({first})" if first else "")) from None
    return env


@contextlib.contextmanager
def _one_thread():
    """One CPU thread while a probe runs: an index assignment naming one slot twice (the edge
    probe's repeat) leaves that slot's row to whichever thread writes last, torn between
    tokens where the row's bytes are split over threads; on one thread it is the last
    token's row, always, so a compile's outcome does not depend on the schedule."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _numbers(x):
    """``x`` with every SymInt at its traced value (lists and tuples walked, nothing else)."""
    if isinstance(x, torch.SymInt):
        return concrete(x)
    if isinstance(x, (list, tuple)) and any(isinstance(i, (torch.SymInt, list, tuple)) for i in x):
        return type(x)(_numbers(i) for i in x) if isinstance(x, list) or type(x) is tuple else x
    return x


def _poisoned(sizes, dtype, device) -> torch.Tensor:
    out = torch.empty([concrete(s) for s in sizes], dtype=dtype, device=device)
    if dtype.is_floating_point and dtype.itemsize > 1:
        out.fill_(_POISON)
    else:
        out.view(torch.uint8).fill_(0xA5)
    return out
