"""Translation validation: a rewrite replaces model code only after probes show that the
fused call computes what the code did.

A recogniser matches structure. A structure it accepts can still compute something else:
an eps carried in a buffer, rotated halves swapped where the recogniser does not look, a
cache row offset by one. So after a pass has emitted its call, and before any reader is
moved to it, ``validate_rewrite`` runs both on the same probe inputs, eagerly:

- the **region**: the matched post-grad nodes as they stand, from the call's inputs (the
  nodes the emitted call reads, the *boundary*) to the values the call replaces; a region
  that reads more than the boundary (a placeholder or constant the call ignores) reads
  its own probe or the constant's real value;
- the **call**: the emitted nodes (the ``auto_functionalized`` call of the fused op, its
  views and casts), with scratch buffers as fresh poisoned memory (the arena is not
  touched).

Probe values follow the roles the call gives each input (``ROLES``): unique valid slots
within the cache, positions within the cos/sin rows, a positive scale, caches filled with
random valid values (so rows the call must not write are compared too), activations and
weights random. Two probes: one at unit scale, and one of edge values (token rows that are
zero, all-equal, of magnitude 1e-3, where an eps decides the result, and the rest large).
Sizes are the graph's own, each dynamic size at its traced value (its hint); probes use a
fixed seed, so a compile's outcome does not change from one run to the next.

Bounds, per output: floating values within ``2^-6`` of the largest magnitude of their row
(last dim) of the region's result (the op's one fp32 rounding against the code's bf16 steps
stays within ``2^-7 (|a| + |b|)``; one bf16 ULP is at most ``2^-8`` relative) and NaN where
the region has NaN; fp8 values the same plus one e4m3 step of the value (a rotation that
cancels leaves a small result that the bf16 difference moves by several of its steps), a
NaN in the row counting as 448 for its largest magnitude (what a non-saturating cast makes
of a value past 464);
NaN against 448 of the same sign counts as that one step where both sides make NaN of
values past 464 (``_nan_past_448_step``: a non-saturating cast, whose step past 448 is NaN,
and a bf16 ULP apart at 464; a saturating cast against a non-saturating one still differs);
byte outputs (codes, scale bytes, packed nibbles, byte caches) each within one step of the
region's, read as an unsigned byte or as a sign-magnitude e4m3 code; a byte cache that holds
e4m3fn values (``Checked.codes``) is compared as fp8 values.
A structural mistake moves whole rows or heads by far more.

A mismatch raises ``NoMatch("validation: <output> differs at <index>: got <a>, region
gives <b> ...")``; the pass erases what it emitted and logs the decline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from prepfuse.fx_passes.matching.recognizers import NoMatch
from prepfuse.ops import SCRATCH

__all__ = ["VALIDATE_MODES", "ROLES", "Checked", "validate_rewrite", "read_as_rounded", "NUM_PROBES"]

VALIDATE_MODES = ("probe", "off")
NUM_PROBES = 2
FLOAT_BOUND = 2.0**-6
# the region may read this many nodes at most: a region that reaches far past the call's
# inputs is not what the recogniser matched
MAX_REGION_NODES = 4000
_SEED = 20261201
READ_AS_ROUNDED = "prepfuse_read_as_rounded"  # node.meta key: see ``read_as_rounded``
_POISON = -123.0

# the fused ops' argument names, by what a probe of each must hold
ROLES = {
    "slot_mapping": "slots",
    "positions": "positions",
    "k_positions": "positions",
    "cos_sin_cache": "table",
    "k_cache": "cache",
    "v_cache": "cache",
    "kv_scale": "scale",
    "q_norm_weight": "weight",
    "k_norm_weight": "weight",
}


def read_as_rounded(node: torch.fx.Node) -> None:
    """Mark fp32 ``node`` as read by a pattern as the bf16 values the code rounded it to,
    where Inductor dropped that round trip (torch 2.11, ``_compat.inductor_drops_narrowing_round_trips``):
    the fused op rounds as the code says, so the region is run with the rounding put back
    at this node, and validation checks the rest of the math against the model's meaning."""
    node.meta[READ_AS_ROUNDED] = True


@dataclass(frozen=True)
class Checked:
    """One output both sides produce: the region's value and the call's."""

    name: str  # the op output's name, for the decline message ("q_out", "k_cache")
    region: torch.fx.Node
    call: torch.fx.Node
    # what a byte output's bytes encode, where they are values (a uint8 cache of e4m3fn
    # codes, vLLM's "fp8" cache): compared as those values, not as codes one step apart
    codes: torch.dtype | None = None
    # an fp8 output's values before the cast: (rows, scale) pairs of the region, the values
    # rows / scale. A row the cast saturated (448, or NaN) no longer shows its magnitude,
    # and the rounding two correct evaluations differ by scales with it: such a row is held
    # to 2^-6 of the largest |rows / scale| instead (the rows of an edge probe at a
    # 4096-wide projection reach ~2300 and saturate, and bf16 RoPE against fp32 then moves
    # a small, cancelled value by ~2^-7 of that: 22 against 36 in a row of 448s)
    before_cast: tuple[tuple[torch.fx.Node, torch.fx.Node], ...] = ()


def validate_rewrite(emitted: Iterable[torch.fx.Node], args: dict, checked: list[Checked],
                     extra_roles: dict[torch.fx.Node, str] | None = None, *, slot_capacity=None,
                     block_size=None) -> int:
    """Run the region and the emitted call on ``NUM_PROBES`` probes and compare each output
    of ``checked``; returns the number of probes, or raises ``NoMatch("validation: ...")``.

    ``args`` are the call's arguments by name (their roles come from ``ROLES``);
    ``extra_roles`` names inputs the arguments do not show (a cache's base buffer:
    ``"cache"``; per-token cos/sin values whose halves the recogniser proved equal:
    ``"duplicated_halves"``; fp32 values the code had rounded to bf16 where the graph lost
    the rounding: ``"bf16_values"``; a page table's block and row indices: ``"slot_block"``,
    ``"slot_row"``, drawn as one distinct slot each, split by ``block_size``; the ``[B, T]``
    positions of B sequences each written at its own: ``"sequence_slots"``, distinct in each
    row, below ``slot_capacity``).
    ``slot_capacity`` overrides the slots read off ``k_cache`` (a cache the op writes
    through a view of another layout).
    """
    emitted = list(emitted)
    emitted_set = set(emitted)
    boundary = _boundary(emitted)
    roles = _roles(args, extra_roles or {})
    call_nodes = _ancestors([c.call for c in checked], stop=lambda n: n not in emitted_set)
    region_nodes = _ancestors([c.region for c in checked], stop=lambda n: n in boundary or n.op != "call_function")
    if len(region_nodes) > MAX_REGION_NODES:
        raise NoMatch(f"validation: the region reads {len(region_nodes)} nodes back from its outputs, "
                      f"more than the {MAX_REGION_NODES} a probe runs")
    leaves = _leaves(call_nodes) | _leaves(region_nodes)
    limits = _limits(args)
    if slot_capacity is not None:
        limits["slots"] = concrete(slot_capacity)
    if block_size is not None:
        limits["block_size"] = concrete(block_size)
    with unset_fake_temporarily(), torch.no_grad():
        for probe in range(NUM_PROBES):
            gen = torch.Generator().manual_seed(_SEED + probe)
            values = {leaf: _probe_value(leaf, roles.get(leaf), limits, probe, gen) for leaf in _ordered(leaves)}
            region = _run(region_nodes, values, "the region")
            call = _run(call_nodes, values, "the fused call")
            for c in checked:
                _compare(c.name, call[c.call], region[c.region], probe, c.codes,
                         _largest_before_cast(c.before_cast, {**values, **region}))
    return NUM_PROBES


def _largest_before_cast(pairs, values: dict) -> float | None:
    """The largest finite |rows / scale| of ``Checked.before_cast`` in one probe (None: none)."""
    if not pairs:
        return None
    largest = 0.0
    for rows, scale in pairs:
        if rows not in values or scale not in values:
            raise NoMatch(f"validation: the values before the fp8 cast ({rows.name} / {scale.name}) are not "
                          "computed by the region")
        magnitude = (values[rows].float().cpu() / values[scale].float().cpu().reshape(())).abs()
        largest = max(largest, float(magnitude.nan_to_num(0.0, 0.0, 0.0).amax()) if magnitude.numel() else 0.0)
    return largest


# --------------------------------------------------------------------------------------
# Which nodes
# --------------------------------------------------------------------------------------
def _inputs_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    found = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _boundary(emitted: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes the emitted ones read that they did not make: the call's inputs."""
    emitted_set = set(emitted)
    return {i for n in emitted for i in _inputs_of(n) if i not in emitted_set}


def _ancestors(outputs: list[torch.fx.Node], stop) -> list[torch.fx.Node]:
    """``outputs`` and every node they read, transitively, not going past nodes for which
    ``stop`` holds (those are leaves); in graph order."""
    seen, stack = set(), list(outputs)
    while stack:
        node = stack.pop()
        if node in seen or stop(node):
            continue
        seen.add(node)
        stack += _inputs_of(node)
    return _ordered(seen)


def _leaves(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes ``nodes`` read that are not among them: their inputs."""
    members = set(nodes)
    return {i for n in nodes for i in _inputs_of(n) if i not in members}


def _ordered(nodes) -> list[torch.fx.Node]:
    nodes = list(nodes)
    if not nodes:
        return nodes
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def _roles(args: dict, extra: dict) -> dict[torch.fx.Node, str]:
    roles = {node: ROLES[name] for name, node in args.items() if isinstance(node, torch.fx.Node) and name in ROLES}
    roles.update(extra)
    return roles


# --------------------------------------------------------------------------------------
# Probe values
# --------------------------------------------------------------------------------------
def concrete(size) -> int:
    """An int for a size: itself, or a dynamic size's traced value (its hint)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else int(size.node.shape_env.size_hint(size.node.expr))
    return int(size)


def _limits(args: dict) -> dict[str, int]:
    """Slot capacity of the cache and rows of the cos/sin table, from the call's arguments."""
    limits = {}
    cache = args.get("k_cache")
    if isinstance(cache, torch.fx.Node):
        sizes = [concrete(s) for s in cache.meta["val"].shape]
        block = args.get("block_size")
        limits["slots"] = sizes[0] * (concrete(block) if block is not None else sizes[1])
    table = args.get("cos_sin_cache")
    if not isinstance(table, torch.fx.Node):
        table = args.get("cos")  # the two-table form: its rows
    if isinstance(table, torch.fx.Node):
        limits["positions"] = concrete(table.meta["val"].shape[0])
    return limits


def _probe_value(node: torch.fx.Node, role: str | None, limits: dict, probe: int, gen: torch.Generator):
    if node.op == "get_attr":  # a constant of the graph: its real value
        return _attr(node)
    fake = node.meta.get("val")
    if isinstance(fake, (int, torch.SymInt)):
        return concrete(fake)
    if isinstance(fake, (float, bool)) or fake is None:
        return fake
    if not isinstance(fake, torch.Tensor):
        raise NoMatch(f"validation: no probe for input {node.name} ({type(fake).__name__})")
    sizes, strides = [concrete(s) for s in fake.shape], [concrete(s) for s in fake.stride()]
    dense = _values(node, role, sizes, fake.dtype, limits, probe, gen)
    out = torch.empty_strided(sizes, strides, dtype=fake.dtype, device=fake.device)
    out.copy_(dense.to(out.device))
    return out


def _values(node, role, sizes, dtype, limits, probe, gen) -> torch.Tensor:
    """Dense CPU values for one input, by role."""
    n = 1
    for s in sizes:
        n *= s
    if role == "slots":
        capacity = limits.get("slots")
        if capacity is None or n > capacity:
            raise NoMatch(f"validation: {n} slots do not fit the cache ({capacity} slots)")
        return torch.randperm(capacity, generator=gen)[:n].reshape(sizes).to(dtype)
    if role == "sequence_slots":  # [B, T] positions of B sequences: each row distinct, rows drawn apart
        capacity = limits.get("slots")
        if capacity is None or len(sizes) != 2 or sizes[1] > capacity:
            raise NoMatch(f"validation: {sizes} positions do not fit the sequences ({capacity} positions each)")
        return torch.stack([torch.randperm(capacity, generator=gen)[:sizes[1]] for _ in range(sizes[0])]).to(dtype)
    if role in ("slot_block", "slot_row"):
        # both from one permutation of the slots (the same seed for either): distinct pairs
        capacity, block = limits.get("slots"), limits.get("block_size")
        if capacity is None or block is None or n > capacity:
            raise NoMatch(f"validation: {n} block/row pairs do not fit the cache ({capacity} slots)")
        slots = torch.randperm(capacity, generator=torch.Generator().manual_seed(_SEED + 97 * probe))[:n]
        return (slots // block if role == "slot_block" else slots % block).reshape(sizes).to(dtype)
    if role == "positions":
        rows = limits.get("positions")
        if rows is None or rows == 0:
            raise NoMatch("validation: no cos/sin rows to draw positions from")
        return torch.randint(0, rows, sizes, generator=gen).to(dtype)
    if not (dtype.is_floating_point or dtype == torch.uint8):
        raise NoMatch(f"validation: no probe values for input {node.name} ({dtype}, {role or 'no role'})")
    if dtype == torch.uint8:
        return torch.randint(0, 256, sizes, generator=gen, dtype=torch.uint8)
    if role == "scale":
        return (0.5 + 1.5 * torch.rand(sizes, generator=gen)).to(dtype)
    if role == "table":
        return (2 * torch.rand(sizes, generator=gen) - 1).to(dtype)
    if role == "duplicated_halves":
        half = list(sizes[:-1]) + [sizes[-1] // 2]
        h = 2 * torch.rand(half, generator=gen) - 1
        return torch.cat([h, h], -1).to(dtype)
    if role == "weight":
        return (1 + 0.5 * torch.randn(sizes, generator=gen)).to(dtype)
    x = torch.randn(sizes, generator=gen)
    if role == "cache":
        return x.to(dtype)
    if probe == 1 and n:  # edge values, by row (the last dim): zero, all equal, tiny; the rest large
        rows = x.reshape(-1, sizes[-1] if sizes else 1) * 32.0
        rows[0] = 0.0
        if rows.shape[0] > 1:
            rows[1] = 0.75
        if rows.shape[0] > 2:
            rows[2] *= 1e-3 / 32.0
        x = rows.reshape(sizes)
    if role == "bf16_values":  # fp32 the code had rounded to bf16 (``Emitter.as_bf16``)
        x = x.to(torch.bfloat16)
    return x.to(dtype)


def _attr(node: torch.fx.Node):
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


# --------------------------------------------------------------------------------------
# Running and comparing
# --------------------------------------------------------------------------------------
def _run(nodes: list[torch.fx.Node], leaves: dict, what: str) -> dict:
    env = {leaf: value.clone() if isinstance(value, torch.Tensor) else value for leaf, value in leaves.items()}
    for node in nodes:
        if node in env:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        try:
            if node.target is SCRATCH:  # fresh poisoned memory, not an arena handout
                _, sizes, dtype, device = args
                env[node] = _poisoned(sizes, dtype, device)
            else:
                env[node] = node.target(*args, **kwargs)
            if node.meta.get(READ_AS_ROUNDED) and isinstance(env[node], torch.Tensor):
                env[node] = env[node].to(torch.bfloat16).to(env[node].dtype)
        except NoMatch:
            raise
        except Exception as err:  # the probes are outside what this node accepts
            raise NoMatch(f"validation: {what} did not run on a probe: {node.name}: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}") from None
    return env


def _poisoned(sizes, dtype, device) -> torch.Tensor:
    out = torch.empty([concrete(s) for s in sizes], dtype=dtype, device=device)
    if dtype.is_floating_point and dtype.itemsize > 1:
        out.fill_(_POISON)
    else:
        out.view(torch.uint8).fill_(0xA5)
    return out


def _compare(name: str, got, want, probe: int, codes: torch.dtype | None = None,
             before_cast: float | None = None) -> None:
    if isinstance(want, (tuple, list)) or isinstance(got, (tuple, list)):
        raise NoMatch(f"validation: {name} is not one tensor on both sides")
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        raise NoMatch(f"validation: {name} is not a tensor on both sides")
    if got.shape != want.shape:
        raise NoMatch(f"validation: {name} has shape {tuple(got.shape)}, the region gives {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise NoMatch(f"validation: {name} is {got.dtype}, the region gives {want.dtype}")
    if got.numel() == 0:
        return
    got, want = got.cpu(), want.cpu()
    if codes is not None:
        got, want = got.view(codes), want.view(codes)
    what = "unit-scale probe" if probe == 0 else "edge-value probe"
    if got.dtype.is_floating_point:
        a, b = got.float(), want.float()
        # a NaN of an fp8 row stands for a value past 448 (a non-saturating cast's overflow)
        nan_as = 448.0 if got.dtype.itemsize == 1 else 0.0
        scale = b.abs().nan_to_num(nan_as, 0.0, 0.0).amax(dim=-1, keepdim=True) if b.dim() else b.abs()
        if before_cast is not None and got.dtype.itemsize == 1:  # a saturated row: its size before the cast
            scale = torch.where(scale >= 448.0, torch.clamp(scale, min=before_cast), scale)
        allowed = FLOAT_BOUND * scale
        bound = f"bound 2^-6 of the row's largest |value|, on the {what}"
        if got.dtype.itemsize == 1:  # fp8 values: plus one step of the value (e4m3: 2^-3 relative)
            allowed = allowed + torch.maximum(b.abs() * 2**-3, torch.full_like(b, 2**-9))
            bound = f"bound 2^-6 of the row's largest |value| plus one e4m3 step, on the {what}"
        bad = ((a - b).abs() > allowed) | (a.isnan() != b.isnan())
        bad &= ~(a.isnan() & b.isnan())
        if got.dtype.itemsize == 1:
            bad &= ~_nan_past_448_step(got, want, a, b)
    else:
        a, b = got.view(torch.uint8).to(torch.int32), want.view(torch.uint8).to(torch.int32)
        plain = (a - b).abs()
        sign_magnitude = (_signed_code(a) - _signed_code(b)).abs()
        bad = (plain > 1) & (sign_magnitude > 1)
        bound = f"bound one code step, on the {what}"
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        count = int(bad.sum())
        raise NoMatch(f"validation: {name} differs at {list(index)}: got {_item(got, index)}, region gives "
                      f"{_item(want, index)} ({count} of {bad.numel()} values outside the {bound})")


def _nan_past_448_step(got, want, a, b) -> torch.Tensor:
    """Where fp8 values differ by the one step past +-448 of a non-saturating cast (c10's:
    ``|x| > 464`` is the NaN code): NaN on one side, 448 of the same sign on the other, in
    an output where both sides give NaN codes elsewhere, at least eight times as often, so
    that both casts are the non-saturating one and only values within a bf16 ULP of 464
    land apart. A saturating cast against a non-saturating one differs at every value past
    464 (no NaN on one side at all): that stays a mismatch."""
    nan_a, nan_b = a.isnan(), b.isnan()
    same_sign = (got.view(torch.uint8) >> 7) == (want.view(torch.uint8) >> 7)
    step = same_sign & ((nan_a & (b.abs() == 448)) | (nan_b & (a.abs() == 448)))
    agreeing = int((nan_a & nan_b).sum())
    return step if agreeing and 8 * int(step.sum()) <= agreeing else torch.zeros_like(step)


def _signed_code(byte: torch.Tensor) -> torch.Tensor:
    """A byte read as a sign-magnitude code (fp8 e4m3): adjacent values differ by one."""
    magnitude = byte & 0x7F
    return torch.where(byte >= 0x80, -magnitude, magnitude)


def _item(t: torch.Tensor, index: tuple) -> str:
    value = t[index]
    if t.dtype.is_floating_point and t.dtype.itemsize > 1:
        return f"{float(value):.6g}"
    return f"0x{int(value.view(torch.uint8)):02x}" if t.dtype.itemsize == 1 else str(value.item())

