"""Recognisers: read one step of preparation math back out of a post-grad FX graph.

Each recogniser takes the node that holds a step's *result* and returns the step's
inputs and constants, or raises :class:`NoMatch` saying what it found instead. They
accept the forms one piece of math takes after Dynamo, AOT autograd, decomposition and
functionalization, which differ from the source (docs/design.md, lesson 6):

- ``x.view(..)`` / ``x.reshape(..)`` / ``flatten`` / ``unflatten`` -> ``aten.view`` or
  ``aten.reshape`` (either, depending on the torch version and on contiguity);
- ``x[..., a:b]``, ``x.split([..])``, ``x.chunk(..)`` -> ``aten.slice`` or ``getitem`` of
  ``split_with_sizes`` / ``split``;
- ``torch.stack((a, b), -1)`` -> ``aten.cat`` of ``unsqueeze``-d operands (or ``aten.stack``);
- ``F.rms_norm`` -> ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, with eps as an fp32-rounded
  Python float; ``x * x`` and ``x.pow(2)`` both appear;
- ``.float()`` / ``.to(dtype)`` -> ``prims.convert_element_type`` (no-op casts vanish);
- ``t.clamp(lo, hi)`` -> ``clamp_min`` + ``clamp_max`` or one ``clamp``.

Operand order of commutative ops is never assumed. Recognisers compose: the RoPE
recogniser does not care how its input was sliced, the norm recogniser does not care what
is done with its output, so a new spelling of one step is one new branch in one function.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
CONVERTS = (prims.convert_element_type.default, aten._to_copy.default)
VIEW_STEPS = (*RESHAPES, aten.slice.Tensor, aten.as_strided.default)
INT_MAX = 2**63 - 1


class NoMatch(Exception):
    """The graph does not hold the expected math here; the message says what it holds."""


def expect(cond, why: str) -> None:
    if not cond:
        raise NoMatch(why)


def is_op(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def val(node):
    """The fake tensor (or SymInt) a node holds, from its ``meta``."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def shape(node) -> tuple:
    return tuple(val(node).shape)


def same_size(a, b) -> bool:
    """Sizes certainly equal, without adding a guard (``T`` may be symbolic)."""
    return statically_known_true(a == b) if not (isinstance(a, int) and isinstance(b, int)) else a == b


def same_shape(a, b) -> bool:
    """Shapes of two nodes certainly equal (symbolic sizes compared without guards)."""
    sa, sb = shape(a), shape(b)
    return len(sa) == len(sb) and all(same_size(x, y) for x, y in zip(sa, sb))


# steps whose value is a function of their arguments alone (no randomness, no mutation)
PURE_STEPS = (
    *VIEW_STEPS, *CONVERTS, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
    aten.permute.default, aten.transpose.int, aten.split.Tensor, aten.split_with_sizes.default, aten.index.Tensor,
    aten.index_select.default, aten.cat.default, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor,
    aten.sub.Tensor, aten.neg.default, aten.cos.default, aten.sin.default, aten.remainder.Scalar,
    aten.remainder.Tensor, aten.div.Tensor_mode, operator.getitem,
)


def same_value(a, b, depth: int = 12) -> bool:
    """``a`` and ``b`` certainly hold the same value: one node, or the same pure step on the
    same values, up to ``depth`` steps back. Functionalization regenerates a view chain
    instead of reusing it, and code that casts cos/sin once per rotated tensor (vLLM's
    ``cos.unsqueeze(-2).to(x.dtype)`` for q and again for k) computes one value twice."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return not isinstance(a, torch.fx.Node) and not isinstance(b, torch.fx.Node) and a == b
    if depth == 0 or a.op != "call_function" or a.target is not b.target or a.target not in PURE_STEPS:
        return False
    return a.kwargs == b.kwargs and same_value(list(a.args), list(b.args), depth - 1)


def describe(node) -> str:
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    target = getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def convert_source(node, dtype: torch.dtype):
    """``x`` if ``node`` is ``x`` cast to ``dtype``, else None."""
    if is_op(node, prims.convert_element_type.default) and node.args[1] == dtype:
        return node.args[0]
    if is_op(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"} and node.kwargs.get("dtype") == dtype:
        return node.args[0]
    return None


def strip(node, *targets):
    """Follow ``node`` up through ops of ``targets`` (their first argument)."""
    while is_op(node, *targets):
        node = node.args[0]
    return node


def scalar(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def split_operands(node, pred):
    """For a binary ``node``, the (operand matching ``pred``, the other operand), either order."""
    a, b = node.args[0], node.args[1]
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None, None


# --------------------------------------------------------------------------------------
# Slices of the last dimension
# --------------------------------------------------------------------------------------
def last_dim_slice(node) -> tuple[torch.fx.Node, int, int, int] | None:
    """(source, start, end, step) if ``node`` selects a range of the source's last dim."""
    if is_op(node, aten.slice.Tensor):
        src = node.args[0]
        ndim = len(shape(src))
        dim = node.args[1] if len(node.args) > 1 else 0
        if _dim(dim, ndim) != ndim - 1:
            return None
        width = shape(src)[-1]
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else INT_MAX
        step = node.args[4] if len(node.args) > 4 else 1
        if not all(isinstance(v, int) for v in (start, end, step)) or not isinstance(width, int):
            return None
        start = start + width if start < 0 else start
        end = min(end + width if end < 0 else end, width)
        return src, start, end, step
    if node.op == "call_function" and node.target is operator.getitem and is_op(
        node.args[0], aten.split_with_sizes.default, aten.split.Tensor
    ):
        split, index = node.args[0], node.args[1]
        src = split.args[0]
        ndim = len(shape(src))
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if _dim(dim, ndim) != ndim - 1:
            return None
        width = shape(src)[-1]
        if split.target is aten.split_with_sizes.default:
            sizes = list(split.args[1])
        else:
            sizes = [min(split.args[1], width - s) for s in range(0, width, split.args[1])]
        return src, sum(sizes[:index]), sum(sizes[: index + 1]), 1
    return None


def columns(node, start: int, end: int, what: str):
    """The source whose last-dim columns ``[start, end)`` ``node`` holds."""
    found = last_dim_slice(node)
    expect(found is not None, f"{what}: expected a slice of the last dim, got {describe(node)}")
    src, s, e, step = found
    expect((s, e, step) == (start, end, 1), f"{what}: expected columns [{start}, {end}), got [{s}, {e}) step {step}")
    return src


def bf16_columns(node, start: int, end: int, what: str):
    """The bf16 tensor whose columns ``[start, end)``, cast to fp32, ``node`` holds.

    Accepts slicing after the cast (``x.float()[:, a:b]``) and before it (``x[:, a:b].float()``).
    """
    inner = convert_source(node, torch.float32)
    if inner is not None:  # cast after slicing
        src = columns(inner, start, end, what)
    else:
        src = convert_source(columns(node, start, end, what), torch.float32)
        expect(src is not None, f"{what}: expected an fp32 cast of the input, got {describe(node)}")
    dtype = val(src).dtype
    expect(dtype == torch.bfloat16, f"{what}: dtype {dtype}, the op reads bfloat16")
    return src


# --------------------------------------------------------------------------------------
# Elementwise building blocks
# --------------------------------------------------------------------------------------
def clamp_bounds(node) -> tuple[torch.fx.Node, float | None, float | None]:
    """(x, lo, hi) for ``clamp(x, lo, hi)`` in its decomposed or one-op forms."""
    lo = hi = None
    while True:
        if is_op(node, aten.clamp_min.default) and lo is None:
            lo, node = scalar(node.args[1]), node.args[0]
        elif is_op(node, aten.clamp_max.default) and hi is None:
            hi, node = scalar(node.args[1]), node.args[0]
        elif is_op(node, aten.clamp.default) and lo is None and hi is None:
            args = list(node.args) + [None] * (3 - len(node.args))
            lo, hi = scalar(node.kwargs.get("min", args[1])), scalar(node.kwargs.get("max", args[2]))
            node = node.args[0]
        else:
            return node, lo, hi


def add_scalar(node) -> tuple[torch.fx.Node, float] | None:
    """(x, c) for ``x + c`` with a constant ``c`` (either order)."""
    if not is_op(node, aten.add.Tensor, aten.add.Scalar) or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args[0], node.args[1]
    if scalar(b) is not None and isinstance(a, torch.fx.Node):
        return a, scalar(b)
    if scalar(a) is not None and isinstance(b, torch.fx.Node):
        return b, scalar(a)
    return None


def is_square_of(node, x) -> bool:
    if is_op(node, aten.pow.Tensor_Scalar) and node.args[0] is x and scalar(node.args[1]) == 2.0:
        return True
    if is_op(node, aten.mul.Tensor) and node.args[0] is x and node.args[1] is x:
        return True
    return is_op(node, aten.square.default) and node.args[0] is x


def mean_last_dim(node) -> torch.fx.Node | None:
    """y for ``y.mean(-1, keepdim=True)`` (or ``y.sum(-1, keepdim=True) / n``)."""
    if is_op(node, aten.mean.dim):
        src = node.args[0]
        dims = list(node.args[1]) if len(node.args) > 1 else []
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        ndim = len(shape(src))
        if len(dims) == 1 and _dim(dims[0], ndim) == ndim - 1 and keep:
            return src
    if is_op(node, aten.div.Tensor) and is_op(node.args[0], aten.sum.dim_IntList):
        total = node.args[0]
        src, dims = total.args[0], list(total.args[1])
        keep = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
        ndim = len(shape(src))
        if len(dims) == 1 and _dim(dims[0], ndim) == ndim - 1 and keep and scalar(node.args[1]) == shape(src)[-1]:
            return src
    return None


# --------------------------------------------------------------------------------------
# RMSNorm without weight
# --------------------------------------------------------------------------------------
def rms_norm(y) -> tuple[torch.fx.Node, float]:
    """(x, eps) for ``y = x * rsqrt(mean(x^2, -1, keepdim) + eps)``.

    ``rsqrt(a)`` may be spelled ``reciprocal(sqrt(a))``, with the sqrt in fp32 or taken in
    fp64 and rounded back (the op computes the correctly rounded ``1 / sqrt``; torch's CPU
    ``rsqrt`` and vectorised fp32 ``sqrt`` are within an ULP of it). Not accepted, because
    they round differently or compute something else: ``x / sqrt(..)``,
    ``x / (sqrt(mean) + eps)``, a missing rsqrt.
    """
    if is_op(y, aten.div.Tensor):
        denom = y.args[1]
        if is_op(denom, aten.add.Tensor, aten.add.Scalar) and any(is_op(a, aten.sqrt.default) for a in denom.args):
            raise NoMatch("norm: eps is added after the sqrt (x / (sqrt(mean(x^2)) + eps))")
        raise NoMatch(f"norm: x is divided by {describe(denom)}, not multiplied by rsqrt(mean(x^2) + eps)")
    expect(is_op(y, aten.mul.Tensor), f"norm: expected x * rsqrt(..), got {describe(y)}")
    x, r = split_operands(y, lambda n: isinstance(n, torch.fx.Node) and same_shape(n, y))
    expect(x is not None and isinstance(r, torch.fx.Node), f"norm: no full-size operand in {describe(y)}")
    if is_op(r, aten.rsqrt.default):
        a = r.args[0]
    elif is_op(r, aten.reciprocal.default) and _sqrt_of(r.args[0]) is not None:
        a = _sqrt_of(r.args[0])
    else:
        raise NoMatch(f"norm: x is scaled by {describe(r)}, not by rsqrt(mean(x^2) + eps)")
    m_eps = add_scalar(a)
    if m_eps is None and is_op(a, aten.add.Tensor) and any(
            isinstance(t, torch.fx.Node) and val(t).dim() == 0 and mean_last_dim(o) is not None
            for t, o in ((a.args[1], a.args[0]), (a.args[0], a.args[1]))):
        raise NoMatch("norm: eps is a 0-d tensor the graph reads at run time (torch.compile(dynamic=True) makes a "
                      "model's float eps a graph input unless torch._dynamo.config.specialize_float is set); "
                      "the op takes eps as a constant")
    expect(m_eps is not None, f"norm: expected mean(x^2) + constant eps under the rsqrt, got {describe(a)}")
    m, eps = m_eps
    sq = mean_last_dim(m)
    expect(sq is not None, f"norm: expected mean over the last dim, keepdim, got {describe(m)}")
    expect(is_square_of(sq, x), f"norm: mean of {describe(sq)}, not of the normalised tensor squared")
    return x, eps


def _sqrt_of(node):
    """``a`` for ``sqrt(a)``, also taken in fp64 and rounded back (``a.double().sqrt().float()``,
    the correctly rounded fp32 sqrt the op's reference uses)."""
    if is_op(node, aten.sqrt.default):
        return node.args[0]
    inner = convert_source(node, torch.float32)
    if is_op(inner, aten.sqrt.default) and val(inner).dtype == torch.float64:
        wide = convert_source(inner.args[0], torch.float64)
        if wide is not None and val(wide).dtype == torch.float32:
            return wide
    return None


# --------------------------------------------------------------------------------------
# GPT-J (interleaved) RoPE and its cos/sin
# --------------------------------------------------------------------------------------
def _pair_slice(node, parity: int):
    """``x`` where ``node`` is ``x``'s even (``parity`` 0) or odd values: ``x[..., parity::2]``,
    or ``x.reshape(..., n, 2)[..., parity]`` (gpt-fast's ``xshaped[..., 0]``)."""
    if is_op(node, aten.select.int) and node.args[2] == parity and \
            _dim(node.args[1], len(shape(node.args[0]))) == len(shape(node.args[0])) - 1:
        pairs = node.args[0]
        if is_op(pairs, *RESHAPES) and shape(pairs)[-1] == 2 and len(shape(pairs)) == len(shape(pairs.args[0])) + 1 \
                and all(same_size(a, b) for a, b in zip(shape(pairs)[:-2], shape(pairs.args[0])[:-1])):
            return pairs.args[0]
        return None
    found = last_dim_slice(node)
    if found is None:
        return None
    src, start, end, step = found
    return src if (start, step) == (parity, 2) and end >= shape(src)[-1] - 1 + parity else None


def rope_gptj(out) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """(x, cos, sin) for interleaved RoPE ``out`` of ``x [..., 2n]`` with ``cos, sin [..., n]``.

    Strided form: ``stack((e*cos - o*sin, e*sin + o*cos), -1).flatten(-2)`` with
    ``e, o = x[..., ::2], x[..., 1::2]``. Complex form: ``view_as_real(view_as_complex(
    x.unflatten(-1, (-1, 2))) * complex(cos, sin)).flatten(-2)`` (the same products and
    sums, so the same bits). NeoX rotate-half pairs ``(i, i + n)`` are not this.
    """
    expect(not is_op(out, aten.cat.default), "rope: rotated halves are concatenated (NeoX rotate-half), not interleaved GPT-J pairs")
    expect(is_op(out, *RESHAPES), f"rope: expected a flatten of (.., n, 2) pairs, got {describe(out)}")
    pairs = out.args[0]
    expect(len(shape(pairs)) == len(shape(out)) + 1 and shape(pairs)[-1] == 2,
           f"rope: {describe(pairs)} does not hold (even, odd) pairs")
    if is_op(pairs, aten.view_as_real.default):
        prod = pairs.args[0]
        expect(is_op(prod, aten.mul.Tensor), f"rope: complex rotation is {describe(prod)}, not a product")
        xc, freqs = split_operands(prod, lambda n: is_op(n, aten.view_as_complex.default))
        expect(xc is not None and is_op(freqs, aten.complex.default), "rope: expected view_as_complex(x) * complex(cos, sin)")
        x = xc.args[0]
        expect(is_op(x, *RESHAPES) and shape(x)[-1] == 2, f"rope: {describe(x)} is not x.unflatten(-1, (-1, 2))")
        return x.args[0], freqs.args[0], freqs.args[1]

    if is_op(pairs, aten.stack.default):
        halves = list(pairs.args[0])
    else:
        expect(is_op(pairs, aten.cat.default) and len(pairs.args[0]) == 2,
               f"rope: expected stack((re, im), -1), got {describe(pairs)}")
        halves = []
        for h in pairs.args[0]:
            expect(is_op(h, aten.unsqueeze.default) and _dim(h.args[1], len(shape(h))) == len(shape(h)) - 1,
                   f"rope: {describe(h)} is not unsqueeze(.., -1)")
            halves.append(h.args[0])
    re, im = halves
    expect(is_op(re, aten.sub.Tensor) and is_op(im, aten.add.Tensor),
           f"rope: expected (e*cos - o*sin, e*sin + o*cos), got ({describe(re)}, {describe(im)})")
    products = []
    for m in (re.args[0], re.args[1], *im.args):
        expect(is_op(m, aten.mul.Tensor), f"rope: {describe(m)} is not a product")
        products.append(m)
    e_cos, o_sin = products[0], products[1]
    e, cos = split_operands(e_cos, lambda n: _pair_slice(n, 0) is not None)
    o, sin = split_operands(o_sin, lambda n: _pair_slice(n, 1) is not None)
    expect(e is not None and o is not None, "rope: not GPT-J interleaved pairs (x[..., ::2], x[..., 1::2])")
    x = _pair_slice(e, 0)
    expect(_pair_slice(o, 1) is x, "rope: even and odd halves come from different tensors")
    # the imaginary part's operands may be nodes of their own computing the same values
    # (gpt-fast writes xshaped[..., 0] and freqs_cis[..., 1] again): compared by value
    def is_product_of(m, a, b) -> bool:
        p, q = m.args[:2]
        return (same_value(p, a) and same_value(q, b)) or (same_value(p, b) and same_value(q, a))

    m1, m2 = products[2:]
    expect((is_product_of(m1, e, sin) and is_product_of(m2, o, cos)) or (is_product_of(m1, o, cos) and
                                                                          is_product_of(m2, e, sin)),
           "rope: imaginary part is not e*sin + o*cos")
    return x, cos, sin


def cos_sin_rows(cos, sin, rows, rank: int, dtypes=(torch.float32,)) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(cos_sin_cache, positions) for ``cos, sin = cache[positions][:, :n], [:, n:]``.

    ``cos`` and ``sin`` must broadcast per token: shape ``[rows, n]`` (kv) or
    ``[rows, 1, n]`` (q, every head); the gather may come before or after the column slice.
    The table is one of ``dtypes`` (the op's: fp32 for the DeepSeek-V4 ops, fp32 or bf16
    for the GQA ones, which read a bf16 table as two column views).
    """
    half = shape(cos)[-1]
    want = (rows, half) if rank == 2 else (rows, 1, half)
    for t, name in ((cos, "cos"), (sin, "sin")):
        got = shape(t)
        expect(len(got) == len(want) and all(same_size(a, b) for a, b in zip(got, want)),
               f"rope: {name} has shape {got}, expected one row per token {want}")

    def gather(node, start, name):
        node = strip(node, aten.unsqueeze.default, *RESHAPES)
        found = last_dim_slice(node)
        if found is not None:  # columns of the gathered rows (maybe unsqueezed first)
            src = strip(found[0], aten.unsqueeze.default, *RESHAPES)
            if is_op(src, aten.index.Tensor, aten.index_select.default):
                expect(found[1:] == (start, start + half, 1), f"rope: {name} is columns [{found[1]}, {found[2]}) of the table")
                return _gather_args(src, name)
        table, positions = _gather_args(node, name)
        expect(last_dim_slice(table) is not None and last_dim_slice(table)[1:] == (start, start + half, 1),
               f"rope: {name} is not columns [{start}, {start + half}) of the table")
        return last_dim_slice(table)[0], positions

    table, positions = gather(cos, 0, "cos")
    table2, positions2 = gather(sin, half, "sin")
    expect(table is table2 and positions is positions2, "rope: cos and sin come from different gathers")
    tv, pv = val(table), val(positions)
    expect(tv.dtype in dtypes and tv.dim() == 2 and tv.shape[1] == 2 * half and tv.stride(1) == 1,
           f"rope: cos_sin_cache is {tv.dtype} {tuple(tv.shape)} strides {tuple(tv.stride())}, "
           f"the op reads {' or '.join(str(d).removeprefix('torch.') for d in dtypes)} [P, {2 * half}] with dense rows")
    expect(pv.dtype == torch.int64 and pv.dim() == 1, f"rope: positions are {pv.dtype} {tuple(pv.shape)}, not int64 [T]")
    return table, positions


def _gather_args(node, name):
    if is_op(node, aten.index.Tensor) and len(node.args[1]) == 1 and node.args[1][0] is not None:
        return node.args[0], node.args[1][0]
    if is_op(node, aten.index_select.default) and node.args[1] == 0:
        return node.args[0], node.args[2]
    raise NoMatch(f"rope: {name} is not gathered from a table by positions ({describe(node)})")


# --------------------------------------------------------------------------------------
# Writes into views of a buffer (functionalized)
# --------------------------------------------------------------------------------------
def view_chain(node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(root, [view ops from the root down to ``node``])."""
    chain = []
    while is_op(node, *VIEW_STEPS):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def scatter_back(written, chain: list[torch.fx.Node]) -> torch.fx.Node:
    """The new value of the root after ``written`` replaced the view ``chain[-1]``.

    Functionalization undoes each view step: a reshape by a reshape back, ``slice`` by
    ``slice_scatter`` into the slice's input with the same arguments, ``as_strided`` by
    ``as_strided_scatter``. Anything else (or a step with other users) raises.
    """
    node = written
    for step in reversed(chain):
        users = list(node.users)
        expect(len(users) == 1, f"write: {describe(node)} has {len(users)} users, expected one scatter back")
        (user,) = users
        if step.target in RESHAPES:
            expect(is_op(user, *RESHAPES) and user.args[0] is node and same_shape(user, step.args[0]),
                   f"write: {describe(user)} does not undo {describe(step)}")
        elif step.target is aten.slice.Tensor:
            expect(is_op(user, aten.slice_scatter.default) and same_value(user.args[0], step.args[0]) and user.args[1] is node
                   and slice_params(user.args[2:], user.kwargs) == slice_params(step.args[1:], step.kwargs),
                   f"write: {describe(user)} does not scatter back into {describe(step)}")
        else:
            expect(is_op(user, aten.as_strided_scatter.default) and same_value(user.args[0], step.args[0])
                   and user.args[1] is node and tuple(user.args[2:]) == tuple(step.args[1:]),
                   f"write: {describe(user)} does not scatter back into {describe(step)}")
        node = user
    return node


def slice_params(args, kwargs) -> tuple:
    """(dim, start, end, step) of a slice or slice_scatter, defaults filled in."""
    names = ("dim", "start", "end", "step")
    defaults = (0, None, None, 1)
    return tuple(args[i] if i < len(args) else kwargs.get(k, d) for i, (k, d) in enumerate(zip(names, defaults)))


def row_layout(view_node, root) -> tuple[int, int, int]:
    """(first column, row pitch, row width) of a ``[NB, rows, width]`` view of a 2-D ``root``.

    Element ``[b, i, j]`` of the view is element ``[b, first + i * pitch + j]`` of the root;
    read off the fake tensors' strides, so the view steps' spelling does not matter.
    """
    v, r = val(view_node), val(root)
    expect(r.dim() == 2 and r.stride(1) == 1, f"write: the written buffer has strides {tuple(r.stride())}")
    expect(v.dim() == 3 and v.stride(2) == 1 and v.stride(0) == r.stride(0),
           f"write: the view has shape {tuple(v.shape)} strides {tuple(v.stride())}, not [blocks, rows, bytes] of a block row")
    return v.storage_offset() - r.storage_offset(), v.stride(1), v.shape[2]


# --------------------------------------------------------------------------------------
# NeoX (rotate-half) RoPE, weighted RMSNorm, paged slot indices
# --------------------------------------------------------------------------------------
def repeated_halves(node) -> tuple[torch.fx.Node, torch.dtype | None]:
    """(c, cast) for ``cat((c, c), -1)`` optionally cast to ``cast`` (Hugging Face's
    ``emb = cat((freqs, freqs), -1)`` then ``.to(x.dtype)``). Decomposition turns a cat of
    one tensor with itself into ``reshape(expand(c.unsqueeze(-2), [.., 2, n]))``."""
    cast = None
    if is_op(node, *CONVERTS):
        cast, node = val(node).dtype, node.args[0]
    if is_op(node, aten.cat.default) and len(node.args[0]) == 2 and node.args[0][0] is node.args[0][1]:
        return node.args[0][0], cast
    expect(is_op(node, *RESHAPES), f"rope: cos/sin {describe(node)} is not the half table repeated, cat((c, c), -1)")
    expanded = strip(node.args[0], aten.clone.default)
    expect(is_op(expanded, aten.expand.default) and is_op(expanded.args[0], aten.unsqueeze.default),
           f"rope: cos/sin {describe(node)} is not the half table repeated, cat((c, c), -1)")
    half = expanded.args[0]
    ndim = len(shape(half))
    expect(_dim(half.args[1], ndim) == ndim - 2 and shape(expanded)[-2] == 2,
           f"rope: cos/sin {describe(node)} repeats its table {shape(expanded)[-2]} times along another dim")
    return half.args[0], cast


def _half(node, first: bool):
    """x for ``x[..., :n]`` (first) or ``x[..., n:]`` of a ``2n``-wide ``x``, else None."""
    found = last_dim_slice(node)
    if found is None:
        return None
    src, start, end, step = found
    width = shape(src)[-1]
    want = (0, width // 2) if first else (width // 2, width)
    return src if (start, end, step) == (*want, 1) and width % 2 == 0 else None


def rope_neox(out) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, torch.dtype | None, bool]:
    """(x, cos, sin, cast, full) for NeoX (rotate-half) RoPE ``out`` of ``x [..., 2n]``; ``cos``,
    ``sin`` are the ``[..., n]`` halves, ``cast`` the dtype they were cast to (or None); or,
    ``full``, the ``[..., 2n]`` values the Hugging Face form multiplies by, where they are not
    spelled ``cat((c, c), -1)`` in reach (``matching/cos_sin.py`` proves their halves equal).

    Hugging Face form: ``x * cat((c, c)) + rotate_half(x) * cat((s, s))`` with
    ``rotate_half(x) = cat((-x[..., n:], x[..., :n]), -1)``. vLLM's ``forward_native`` form:
    ``cat((x1*c - x2*s, x2*c + x1*s), -1)`` with ``x1, x2 = x.chunk(2, -1)``. GPT-J
    interleaved pairs are not this (``rope_gptj``).
    """
    if is_op(out, aten.cat.default):
        parts = out.args[0]
        expect(len(parts) == 2 and is_op(parts[0], aten.sub.Tensor) and is_op(parts[1], aten.add.Tensor),
               f"rope: {describe(out)} is not cat((x1*cos - x2*sin, x2*cos + x1*sin))")
        re, im = parts
        prods = [re.args[0], re.args[1], *im.args]
        expect(all(is_op(m, aten.mul.Tensor) for m in prods), "rope: rotated halves are not sums of products")
        x1, cos = split_operands(prods[0], lambda n: _half(n, True) is not None)
        x2, sin = split_operands(prods[1], lambda n: _half(n, False) is not None)
        expect(x1 is not None and x2 is not None and _half(x1, True) is _half(x2, False),
               "rope: not the two halves (x[..., :n], x[..., n:]) of one tensor")
        expect({frozenset(m.args[:2]) for m in prods[2:]} == {frozenset((x2, cos)), frozenset((x1, sin))},
               "rope: second half is not x2*cos + x1*sin")
        return _half(x1, True), cos, sin, None, False
    expect(is_op(out, aten.add.Tensor) and all(is_op(a, aten.mul.Tensor) for a in out.args[:2]),
           f"rope: {describe(out)} is not x * cos + rotate_half(x) * sin")
    a, b = out.args[:2]

    def rotated_of(m):
        rh, other = split_operands(m, lambda n: is_op(n, aten.cat.default))
        return (rh, other) if rh is not None else (None, None)

    rh, sin_full = rotated_of(b)
    plain = a
    if rh is None:
        rh, sin_full = rotated_of(a)
        plain = b
    expect(rh is not None and len(rh.args[0]) == 2, "rope: no rotate_half(x) * sin term")
    neg, x1 = rh.args[0]
    expect(is_op(neg, aten.neg.default), f"rope: rotate_half is cat({describe(neg)}, ..), not cat((-x2, x1), -1)")
    x = _half(neg.args[0], False)
    expect(x is not None and _half(x1, True) is x, "rope: rotate_half is not cat((-x[..., n:], x[..., :n]), -1)")
    x_again, cos_full = split_operands(plain, lambda n: n is x)
    expect(x_again is x, "rope: the cos term does not multiply the rotated tensor itself")
    try:
        cos, cast = repeated_halves(strip(cos_full, aten.unsqueeze.default))
        sin, sin_cast = repeated_halves(strip(sin_full, aten.unsqueeze.default))
    except NoMatch:
        # full-width values not spelled cat((c, c), -1) here (computed upstream, Hugging Face's
        # rotary module): the caller takes them as they are, proving their halves equal
        return x, cos_full, sin_full, None, True
    expect(cast == sin_cast, f"rope: cos is cast to {cast}, sin to {sin_cast}")
    return x, cos, sin, cast, False


def weighted_rms_norm(out) -> tuple[torch.fx.Node, torch.fx.Node, float]:
    """(x, weight, eps) for a weighted RMSNorm of bf16 ``x``, in either of its two roundings:

    - Hugging Face's ``Qwen3RMSNorm`` / ``LlamaRMSNorm``: ``weight * (x.float() * rsqrt(
      x.float().pow(2).mean(-1, keepdim=True) + eps)).to(bf16)``, the normalised value
      rounded *before* the bf16 weight multiplies it;
    - a weight applied in fp32 before one rounding, ``(normed * w).to(bf16)`` with ``w`` an
      fp32 ``[D]`` the graph computes (``Gemma3RMSNorm``'s ``1.0 + weight.float()``, a
      ``weight.float() *`` port): ``weight`` is then that fp32 node, whatever made it, and
      the op applies it in fp32 (its fp32-weight form)."""
    def weight_and_normed(mul):
        return split_operands(mul, lambda n: isinstance(n, torch.fx.Node) and len(shape(n)) == 1)

    w = None
    if is_op(out, *CONVERTS) and is_op(out.args[0], aten.mul.Tensor):  # weight in fp32, then one rounding
        w, y = weight_and_normed(out.args[0])
        if w is not None:
            expect(val(w).dtype == torch.float32,
                   f"norm: a {val(w).dtype} weight multiplies the fp32 normalised value (type promotion); the op "
                   "applies a bf16 weight after the rounding to bf16, an fp32 one before it")
    if w is None:  # the normalised value rounded, then the weight
        expect(is_op(out, aten.mul.Tensor), f"norm: {describe(out)} is not weight * normed")
        w, normed = weight_and_normed(out)
        expect(w is not None, f"norm: {describe(out)} has no 1-d weight operand")
        y = convert_source(normed, val(out).dtype)
        expect(y is not None,
               f"norm: weight multiplies {describe(normed)}, not the normalised value rounded to {val(out).dtype}")
    xf, eps = rms_norm(y)
    x = convert_source(xf, torch.float32)
    expect(x is not None, f"norm: the normalised {describe(xf)} is not an fp32 cast of the input")
    return x, w, eps


def paged_slots(indices, block_size: int) -> torch.fx.Node:
    """``slots`` for the index pair ``(slots // block_size, slots % block_size)`` (either index
    may be recomputed from the same slots: functionalization does not share them)."""
    expect(len(indices) == 2 and all(isinstance(i, torch.fx.Node) for i in indices),
           f"write: indices {[describe(i) for i in indices]}, expected [slot // block_size, slot % block_size]")
    blk, row = indices
    expect(is_op(blk, aten.div.Tensor_mode) and blk.kwargs.get("rounding_mode") == "floor" and blk.args[1] == block_size,
           f"write: block index {describe(blk)} is not slot // {block_size}")
    expect(is_op(row, aten.remainder.Scalar, aten.remainder.Tensor) and row.args[1] == block_size
           and row.args[0] is blk.args[0], f"write: row index {describe(row)} is not slot % {block_size} of the same slots")
    sv = val(blk.args[0])
    expect(sv.dtype == torch.int64 and sv.dim() == 1, f"write: slots are {sv.dtype} {tuple(sv.shape)}, not int64 [n]")
    return blk.args[0]


@dataclass(frozen=True)
class BlockRows:
    """A paged write's ``(block [n], row [n])`` indices where the row is ``x % block_size``
    and the block is not ``x // block_size``: a page table maps a sequence's logical page to
    a block (FlashInfer's ``append_paged_kv_cache``: ``cache[page_table[pos // bs], pos % bs]``).
    The slot is ``block * block_size + row``, and since ``0 <= row < block_size`` the op's
    ``slot // bs``, ``slot % bs`` are the block and row again."""

    block: torch.fx.Node
    row: torch.fx.Node

    def nodes(self) -> tuple[torch.fx.Node, torch.fx.Node]:
        return self.block, self.row


def block_rows(indices, block_size: int) -> BlockRows:
    """``BlockRows`` for ``[block, x % block_size]`` with any int64 ``[n]`` block index, for a
    caller that found no ``paged_slots`` (the row must be a remainder by the block size: that
    is what keeps it in ``[0, block_size)``)."""
    expect(len(indices) == 2 and all(isinstance(i, torch.fx.Node) for i in indices),
           f"write: indices {[describe(i) for i in indices]}, expected [block, row]")
    blk, row = indices
    expect(is_op(row, aten.remainder.Scalar, aten.remainder.Tensor) and row.args[1] == block_size,
           f"write: row index {describe(row)} is not x % {block_size}")
    for node, name in ((blk, "block"), (row, "row")):
        v = val(node)
        expect(v.dtype == torch.int64 and v.dim() == 1, f"write: {name} indices are {v.dtype} {tuple(v.shape)}, not int64 [n]")
    expect(same_size(shape(blk)[0], shape(row)[0]), "write: block and row indices differ in number")
    return BlockRows(blk, row)


def put_rows(put) -> torch.fx.Node:
    """The rows an ``index_put`` writes, one per index: ``[n, ...]``.

    With a single index (one token, or one slot, under static shapes) torch's index_put
    decomposition reshapes the ``[1, ...]`` rows to ``[...]``, which broadcast over the
    single index: look through that reshape (seen for every pattern at T=1). Only where the
    index is known to select one row and the values lack a dim of the rows (the indices'
    dims, then the cache's dims no index takes): rows of a batch of one, ``[1, T, H, D]``
    reshaped to ``[T, H, D]`` for T slots, are the reshaped rows themselves, at T=1 too
    (Hugging Face's paged cache squeezes its batch of one before ``index_copy_``).
    """
    values = put.args[2]
    indices = [i for i in put.args[1] if isinstance(i, torch.fx.Node)]
    count = shape(indices[0])[0] if indices and shape(indices[0]) else 1  # rows the index selects
    # the rows' dims: the indices' (broadcast) dims, then the cache's dims no index takes
    row_dims = max((len(shape(i)) for i in indices), default=0) + len(shape(put.args[0])) - len(indices)
    if same_size(count, 1) and len(shape(values)) == row_dims - 1 and is_op(
            values, aten.reshape.default, aten.view.default, aten.squeeze.dim, aten.squeeze.default):
        rows = values.args[0]
        if tuple(shape(rows)) == (1, *shape(values)):
            return rows
    return values


# --------------------------------------------------------------------------------------
# Power-of-two scaled quantisation: v = y * 2^-e, e = ceil(log2(max(amax(|y|), floor) / qmax))
# --------------------------------------------------------------------------------------
def pow2_scaled(v, qmax: float, floor: float, what: str, *, values: str = "y", floor_text: str = "",
                exponent_clamp: tuple[float, float] | None = None) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(y, e) for ``v = y * exp2(-e)`` (or ``2 ** -e``), the scale broadcast over the last
    dim, ``e = ceil(log2(max(y.abs().amax(-1), floor) / qmax))``, maybe clamped to
    ``exponent_clamp``: the scaling every block-scaled format here shares (DeepSeek-V4's
    UE8M0 blocks, the indexer's FP8 rows and MXFP4 blocks). ``what`` starts each reason;
    ``values`` names ``y`` in them."""
    expect(is_op(v, aten.mul.Tensor), f"{what}: {describe(v)} is not {values} * 2^-e")
    y, inv = split_operands(v, lambda n: isinstance(n, torch.fx.Node) and same_shape(n, v))
    expect(y is not None, f"{what}: no full-size operand in {values} * 2^-e")
    inv = strip(inv, aten.unsqueeze.default, *RESHAPES)
    if is_op(inv, aten.exp2.default):
        neg = inv.args[0]
    else:
        expect(is_op(inv, aten.pow.Scalar) and inv.args[0] == 2, f"{what}: scale is {describe(inv)}, not exp2(-e)")
        neg = inv.args[1]
    expect(is_op(neg, aten.neg.default), f"{what}: exponent is {describe(neg)}, not -e")
    e = neg.args[0]
    raw = e
    if exponent_clamp is not None:
        raw, lo, hi = clamp_bounds(e)
        expect((lo, hi) in ((None, None), exponent_clamp),
               f"{what}: exponent clamped to [{lo}, {hi}], expected [{exponent_clamp[0]:g}, {exponent_clamp[1]:g}]")
    expect(is_op(raw, aten.ceil.default) and is_op(raw.args[0], aten.log2.default), f"{what}: e is not ceil(log2(..))")
    ratio = raw.args[0].args[0]
    expect(is_op(ratio, aten.div.Tensor) and ratio.args[1] == qmax, f"{what}: log2 of {describe(ratio)}, not amax / {qmax:g}")
    amax, got_floor, none = clamp_bounds(ratio.args[0])
    expect(got_floor == floor and none is None, f"{what}: amax floor {got_floor}, expected {floor_text or floor}")
    expect(is_op(amax, aten.amax.default) and list(amax.args[1]) in ([-1], [len(shape(y)) - 1])
           and is_op(amax.args[0], aten.abs.default), f"{what}: {describe(amax)} is not abs({values}).amax(-1)")
    expect(same_value(amax.args[0].args[0], y), f"{what}: amax is not of the scaled {'rows' if values == 'y' else values}")
    return y, e
