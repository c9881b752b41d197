"""When a candidate call's output counts as what the region computes.

The fused ops round once in fp32 where model code may round in bf16 several times, so
outputs are compared within a bound, per output:

- floating values within ``2^-6`` of the largest magnitude of their row (last dim) of the
  region's value (the op's one fp32 rounding against the code's bf16 steps stays within
  ``2^-7 (|a| + |b|)`` per rotated pair; one bf16 ULP is at most ``2^-8`` relative), NaN
  where the region has NaN;
- fp8 values the same plus one e4m3 step of the value (a rotation that cancels leaves a
  small result that the bf16 difference moves by several of its steps), a NaN in the row
  counting as 448 for its magnitude; NaN against 448 of the same sign counts as that step
  where both sides make NaN of values past 464 elsewhere (two non-saturating casts a bf16
  ULP apart at 464); a row the cast saturated is held to ``2^-6`` of its largest
  ``|rows / scale|`` before the cast (``Checked.before_cast``);
- bytes (codes, scale bytes, packed nibbles) each within one step, read as an unsigned byte
  or as a sign-magnitude e4m3 code; a byte buffer of known content (``Checked.decode``:
  e4m3 codes, a DeepSeek-V4 cache row) is compared as the values it decodes to;
- a decoded part marked ``Exact`` bit for bit: values no spelling of the math rounds
  differently before they are encoded (an MXFP4 block of unrotated dims is its bf16 input,
  scaled by a power of two), where a tie rule or a sign rule is all that can differ;
- a decoded part marked ``Quantized`` (block-scaled codes as the values they stand for, each
  with its grid step) within the coarser side's step plus ``2^-6`` of its block's largest
  magnitude: a bf16 rounding the code has and the graph lost (Inductor drops
  ``.to(bf16).float()`` on CUDA) moves a value by at most half a step on each side, and where it
  moves a block's amax across a power of two, the block's scale moves with all its codes. The
  sign of a zero counts: a rounding never moves it, so it is the code's sign rule.

A structural mistake (a head or a row in the wrong place, the wrong pairs rotated) moves
whole rows by far more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import NoMatch

__all__ = ["Checked", "Exact", "Mismatch", "Quantized", "compare", "e4m3_scaled", "ue8m0", "FLOAT_BOUND"]

FLOAT_BOUND = 2.0**-6


class Mismatch(NoMatch):
    """A candidate call differs from the region: on which probe, and in how many values."""

    def __init__(self, message: str, probe: int, bad: int, total: int, output: str = ""):
        super().__init__(message)
        self.probe, self.bad, self.total = probe, bad, total
        self.output = output  # the checked output that differed (``Checked.name``)

    def closeness(self) -> tuple:
        """Larger is closer: passed more probes, then fewer values outside the bound."""
        return (self.probe, -self.bad / max(self.total, 1))


@dataclass(frozen=True)
class Exact:
    """A decoded part compared bit for bit (see the module docstring)."""

    value: torch.Tensor


@dataclass(frozen=True)
class Quantized:
    """A decoded part of block-scaled codes compared as values (see the module docstring):
    ``value`` [..., block] what each code stands for, its block's scale applied; ``step`` the
    distance from that value to the next one its grid holds, at the same scale."""

    value: torch.Tensor
    step: torch.Tensor


def e4m3_scaled(codes: torch.Tensor, scale: torch.Tensor) -> Quantized:
    """e4m3 ``codes`` times their ``scale`` (broadcast against them: a row's, a block's), as
    ``Quantized`` values, each with one e4m3 step at that scale (the fp8 bound's: an eighth of
    the value, at least 2^-9). A bf16 rounding the graph lost can carry a row's or a block's
    amax across a power of two: its power-of-two scale then moves and every code with it, and
    compared this way the two agree."""
    v = codes.float()
    s = scale.float()
    step = torch.maximum(v.abs() * 2**-3, torch.full_like(v, 2**-9))
    return Quantized(v * s, step * s.abs())


def ue8m0(scale_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes as the powers of two they stand for (0xFF, a non-finite block's, NaN)."""
    scale = torch.exp2(scale_bytes.float() - 127.0)
    return torch.where(scale_bytes == 0xFF, torch.full_like(scale, float("nan")), scale)


@dataclass(frozen=True)
class Checked:
    """One output both sides produce: the region's node and the call's."""

    name: str  # the op output's name, for a decline ("q_out", "k_cache")
    region: torch.fx.Node
    call: torch.fx.Node
    # what a byte output's bytes encode, compared as those values: a dtype to view them as
    # (a uint8 cache of e4m3fn codes), or a function turning the bytes into float values
    decode: torch.dtype | Callable | None = None
    # fp8 values before their cast: (rows, scale) node pairs of the region, the values
    # rows / scale (scale None: rows as they are), for the bound of a row the cast saturated
    before_cast: tuple[tuple[torch.fx.Node, torch.fx.Node], ...] = ()
    # (region, call) nodes of the scale bytes the output's codes are read with: ``decode`` then
    # takes (bytes, scale bytes), each side its own
    scales: tuple[torch.fx.Node, torch.fx.Node] | None = None


def _largest_before_cast(pairs, values: dict) -> float | None:
    if not pairs:
        return None
    largest = 0.0
    for rows, scale in pairs:
        if rows not in values or (scale is not None and scale not in values):
            return None
        magnitude = values[rows].float().cpu().abs()
        if scale is not None:
            magnitude = magnitude / values[scale].float().cpu().reshape(-1)[:1].reshape(()).abs()
        largest = max(largest, float(magnitude.nan_to_num(0.0, 0.0, 0.0).amax()) if magnitude.numel() else 0.0)
    return largest


def compare(c: Checked, got, want, probe: int, values: dict, call_values: dict | None = None) -> int:
    """Raise ``probes.Mismatch`` where ``got`` (the call's) is not ``want`` (the region's);
    ``values`` holds the region's values, ``call_values`` the call's (for ``Checked.scales``).
    Returns how many values differ within the bound (0: bit for bit), which tells apart
    candidates that all agree (``search``)."""
    def fail(message: str, bad: int = 1, total: int = 1):
        raise Mismatch(message, probe, bad, total, c.name)

    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        fail(f"{c.name} is not one tensor on both sides")
    if c.decode is not None and not isinstance(c.decode, torch.dtype):
        if c.scales is not None:
            region_scales, call_scales = values[c.scales[0]].cpu(), (call_values or {})[c.scales[1]].cpu()
            got_parts, want_parts = c.decode(got.cpu(), call_scales), c.decode(want.cpu(), region_scales)
        else:
            got_parts, want_parts = c.decode(got.cpu()), c.decode(want.cpu())
        if isinstance(got_parts, dict):  # a buffer of several encodings: each part by its own rule
            inexact = 0
            for part in got_parts:
                got_part, want_part = got_parts[part], want_parts[part]
                if isinstance(got_part, Exact):
                    _compare_exact(f"{c.name} ({part})", got_part.value, want_part.value, probe)
                elif isinstance(got_part, Quantized):
                    inexact += _compare_quantized(f"{c.name} ({part})", got_part, want_part, probe)
                else:
                    inexact += compare(Checked(f"{c.name} ({part})", c.region, c.call), got_part, want_part, probe,
                                       values)
            return inexact
        got, want = got_parts, want_parts
    if got.shape != want.shape:
        fail(f"{c.name} has shape {tuple(got.shape)}, the code's {tuple(want.shape)}")
    if got.dtype != want.dtype:
        fail(f"{c.name} is {got.dtype}, the code's {want.dtype}")
    if got.numel() == 0:
        return 0
    got, want = got.cpu(), want.cpu()
    if isinstance(c.decode, torch.dtype):
        got, want = got.view(c.decode), want.view(c.decode)
    what = _probe_name(probe)
    if got.dtype.is_floating_point:
        a, b = got.float(), want.float()
        nan_as = 448.0 if got.dtype.itemsize == 1 else 0.0
        scale = b.abs().nan_to_num(nan_as, 0.0, 0.0).amax(dim=-1, keepdim=True) if b.dim() else b.abs()
        before = _largest_before_cast(c.before_cast, values)
        if before is not None and got.dtype.itemsize == 1:
            scale = torch.where(scale >= 448.0, torch.clamp(scale, min=before), scale)
        allowed = FLOAT_BOUND * scale
        bound = f"bound 2^-6 of the row's largest |value|, on the {what}"
        if got.dtype.itemsize == 1:
            allowed = allowed + torch.maximum(b.abs() * 2**-3, torch.full_like(b, 2**-9))
            bound = f"bound 2^-6 of the row's largest |value| plus one e4m3 step, on the {what}"
        bad = _outside(a, b, allowed)
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
        fail(f"{c.name} differs at {list(index)}: got {_item(got, index)}, the code gives {_item(want, index)} "
             f"({count} of {bad.numel()} values outside the {bound})", count, bad.numel())
    return _differing(got, want)


def _compare_exact(name: str, got: torch.Tensor, want: torch.Tensor, probe: int) -> None:
    a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    if a.shape != b.shape:
        raise Mismatch(f"{name} has shape {tuple(a.shape)}, the code's {tuple(b.shape)}", probe, 1, 1, name)
    bad = a != b
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        what = _probe_name(probe)
        raise Mismatch(f"{name} differs at {list(index)}: got 0x{int(a[index]):02x}, the code gives "
                       f"0x{int(b[index]):02x} ({int(bad.sum())} of {bad.numel()} bytes differ where every spelling "
                       f"of the math gives the same bytes, on the {what})", probe, int(bad.sum()), bad.numel(), name)


def _compare_quantized(name: str, got: Quantized, want: Quantized, probe: int) -> int:
    a, b = got.value.float(), want.value.float()
    if a.shape != b.shape:
        raise Mismatch(f"{name} has shape {tuple(a.shape)}, the code's {tuple(b.shape)}", probe, 1, 1, name)
    largest = b.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1, keepdim=True) if b.dim() else b.abs()
    allowed = torch.maximum(got.step, want.step) + FLOAT_BOUND * largest
    bad = _outside(a, b, allowed) | ((a == 0) & (b == 0) & (a.signbit() != b.signbit()))
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        what = _probe_name(probe)
        raise Mismatch(f"{name} differs at {list(index)}: got {_item(a, index)}, the code gives {_item(b, index)} "
                       f"({int(bad.sum())} of {bad.numel()} values outside the bound one step of the coarser grid "
                       f"plus 2^-6 of the block's largest |value|, a zero's sign exact, on the {what})", probe,
                       int(bad.sum()), bad.numel(), name)
    return _differing(a, b)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many of ``a``'s values are not ``b``'s bit for bit (a zero's sign counts; two NaNs
    of a float wider than a byte count as equal: their payloads are no part of the math)."""
    bits = _SAME_WIDTH_INT[a.dtype.itemsize]
    differ = a.contiguous().view(bits) != b.contiguous().view(bits)
    if a.dtype.is_floating_point and a.dtype.itemsize > 1:
        differ &= ~(a.isnan() & b.isnan())
    return int(differ.sum())


def _outside(a: torch.Tensor, b: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Where ``a`` and ``b`` lie more than ``allowed`` apart, or one is NaN and the other not."""
    return (((a - b).abs() > allowed) | (a.isnan() != b.isnan())) & ~(a.isnan() & b.isnan())


def _probe_name(probe: int) -> str:
    return "unit-scale probe" if probe == 0 else "edge-value probe"


def _nan_past_448_step(got, want, a, b) -> torch.Tensor:
    """NaN on one side and 448 of the same sign on the other, in an output where both sides
    give NaN elsewhere at least eight times as often: two non-saturating casts."""
    nan_a, nan_b = a.isnan(), b.isnan()
    same_sign = (got.view(torch.uint8) >> 7) == (want.view(torch.uint8) >> 7)
    step = same_sign & ((nan_a & (b.abs() == 448)) | (nan_b & (a.abs() == 448)))
    agreeing = int((nan_a & nan_b).sum())
    return step if agreeing and 8 * int(step.sum()) <= agreeing else torch.zeros_like(step)


def _signed_code(byte: torch.Tensor) -> torch.Tensor:
    magnitude = byte & 0x7F
    return torch.where(byte >= 0x80, -magnitude, magnitude)


def _item(t: torch.Tensor, index: tuple) -> str:
    value = t[index]
    if t.dtype.is_floating_point and t.dtype.itemsize > 1:
        return f"{float(value):.6g}"
    return f"0x{int(value.view(torch.uint8)):02x}" if t.dtype.itemsize == 1 else str(value.item())
