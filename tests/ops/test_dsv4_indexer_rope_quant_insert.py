"""Numerics and input checks of the DeepSeek-V4 indexer ops (both formats, one parametrize axis):
``prepfuse::dsv4_indexer_rope_fp8_insert`` and ``prepfuse::dsv4_indexer_rope_mxfp4_insert``.

Three implementations are held against each other:

- an oracle written here in numpy float64, one scalar at a time, sharing no code with
  the ops: its own e4m3 table with midpoints (round to nearest even), its own e2m1 table
  (nearest value by float64 distance, ties to the even code, saturation at 6), its own
  UE8M0 exponent (the least e with amax <= max * 2^e, by search), its own bf16 rounding,
  and its own byte layout (nibble order, little-endian fp32 scales, block offsets);
- the plain-PyTorch reference;
- the Triton kernel: under the CPU interpreter here, compiled on CUDA in the ``gpu`` tests.

Every run draws fresh random data from a newly seeded generator (seed in every message);
outputs are poisoned (every byte 0xA5) so bytes written that should not be, or not
written that should be, show up. There are no sums in these ops (RoPE is two rounded
products and one add; quantisation is exact scaling and one rounding), so every
comparison is byte for byte, on the GPU as well.
"""

from __future__ import annotations

import functools
import math

from dataclasses import replace

import numpy as np
import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import (
    DSV4_INDEXER_ROPE_FP8_INSERT,
    DSV4_INDEXER_ROPE_MXFP4_INSERT,
    dsv4_indexer_rope_fp8_insert_reference,
    dsv4_indexer_rope_fp8_insert_triton,
    dsv4_indexer_rope_mxfp4_insert_reference,
    dsv4_indexer_rope_mxfp4_insert_triton,
)
from tests.ops.bad_inputs import assert_rejected, changed
from prepfuse.testing import (
    CACHE_POISON,
    Dsv4IndexerInputs,
    call_with_fake_tensors,
    compare_dsv4_indexer,
    indexer_written_bytes,
    make_dsv4_indexer_inputs,
    seeded_generator,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not triton_interpret_mode(),
    reason="CPU-interpreter parity; on CUDA, test_cuda_kernel_matches_reference covers the kernel",
)

OPS = {"fp8": DSV4_INDEXER_ROPE_FP8_INSERT, "mxfp4": DSV4_INDEXER_ROPE_MXFP4_INSERT}
REFERENCES = {"fp8": dsv4_indexer_rope_fp8_insert_reference, "mxfp4": dsv4_indexer_rope_mxfp4_insert_reference}
KERNELS = {"fp8": dsv4_indexer_rope_fp8_insert_triton, "mxfp4": dsv4_indexer_rope_mxfp4_insert_triton}
FORMATS = ["fp8", "mxfp4"]
# (format, implementation) pairs: one parametrize axis instead of cloned tests
IMPLS = [pytest.param(f, "reference", id=f"{f}-reference") for f in FORMATS] + [
    pytest.param(f, "triton", id=f"{f}-triton", marks=needs_triton) for f in FORMATS
]


def impl_of(fmt: str, which: str):
    return REFERENCES[fmt] if which == "reference" else KERNELS[fmt]


def indexer_inputs(fmt, num_tokens, num_heads, block_size, device, **options) -> tuple[Dsv4IndexerInputs, int]:
    generator, seed = seeded_generator()
    return make_dsv4_indexer_inputs(fmt, num_tokens, num_heads, block_size, device, generator=generator, **options), seed


def run(impl, inputs: Dsv4IndexerInputs) -> Dsv4IndexerInputs:
    out = inputs.fresh_outputs()
    impl(*out.args())
    return out


def assert_same(expected: Dsv4IndexerInputs, actual: Dsv4IndexerInputs, seed: int) -> None:
    diffs = compare_dsv4_indexer(expected, actual)
    assert not any(diffs.values()), f"seed={seed}: differing elements {diffs}"


def assert_untouched(out: Dsv4IndexerInputs, seed: int) -> None:
    """Every cache byte outside the inserted slots is still poison."""
    untouched = out.k_cache[~indexer_written_bytes(out)]
    assert bool((untouched == CACHE_POISON).all()), (
        f"seed={seed}: {int((untouched != CACHE_POISON).sum())} cache bytes outside the inserted slots were written"
    )


def assert_matches_reference(impl, fmt, inputs, seed) -> None:
    """``impl`` on poisoned outputs writes what the reference writes, and nothing else."""
    actual = run(impl, inputs)
    assert_same(run(REFERENCES[fmt], inputs), actual, seed)
    assert_untouched(actual, seed)


# --------------------------------------------------------------------------------------
# The oracle: numpy float64, scalar by scalar
# --------------------------------------------------------------------------------------
# e4m3fn: bias 7, 3 mantissa bits, codes 0..126 the non-negative values (0x7E = 448)
E4M3_VALUES = np.array(
    [(c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]
)
E4M3_MIDPOINTS = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2
# e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; codes 0..7 the magnitudes
E2M1_VALUES = np.array([(c & 1) / 2 if c >> 1 == 0 else (1 + (c & 1) / 2) * 2.0 ** ((c >> 1) - 1) for c in range(8)])


def e4m3_code(v: float) -> int:
    """The e4m3fn byte nearest to ``v`` (|v| <= 448), ties to the even code, sign kept."""
    mag = abs(v)
    code = int(np.searchsorted(E4M3_MIDPOINTS, mag))
    if code < 126 and mag == E4M3_MIDPOINTS[code] and code % 2 == 1:
        code += 1
    return code | (0x80 if math.copysign(1.0, v) < 0 else 0)


def e2m1_code(v: float) -> int:
    """The e2m1 nibble nearest to ``v`` by float64 distance, ties to the even code,
    saturating at 6; bit 3 is the sign of v (negative zero included)."""
    mag = abs(v)
    dist = np.abs(E2M1_VALUES - mag)
    best = [c for c in range(8) if dist[c] == dist.min()]
    code = best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def least_exponent(amax: float, fmt_max: float) -> int:
    """The least integer e with amax <= fmt_max * 2^e: ceil(log2(amax / fmt_max)) exactly."""
    e = -200
    while fmt_max * 2.0**e < amax:
        e += 1
    return e


def bf16_round(x: float) -> float:
    """fp32 value -> nearest bf16 (ties to even), by the bits, as a float."""
    u = int(np.float32(x).view(np.uint32))
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return float(np.uint32(u & 0xFFFFFFFF).view(np.float32))


def rope_row(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> list[float]:
    """128 values: dims 64..127 rotated by pairs in fp32 (each product rounded), then bf16."""
    f32 = np.float32
    out = [float(v) for v in x]
    for p in range(32):
        e, o = f32(x[64 + 2 * p]), f32(x[65 + 2 * p])
        out[64 + 2 * p] = bf16_round(f32(f32(e * cos[p]) - f32(o * sin[p])))
        out[65 + 2 * p] = bf16_round(f32(f32(e * sin[p]) + f32(o * cos[p])))
    return out


def oracle_fp8_row(x: list[float]) -> tuple[list[int], int]:
    e = least_exponent(max(max(abs(v) for v in x), float(np.float32(1e-4))), 448.0)
    return [e4m3_code(min(max(v * 2.0**-e, -448.0), 448.0)) for v in x], e


def oracle_mxfp4_row(x: list[float]) -> tuple[list[int], list[int]]:
    packed, scale_bytes = [], []
    for b in range(4):
        block = x[32 * b : 32 * (b + 1)]
        e = min(max(least_exponent(max(max(abs(v) for v in block), 6.0 * 2.0**-126), 6.0), -127), 127)
        nibbles = [e2m1_code(v * 2.0**-e) for v in block]
        packed += [nibbles[2 * j] | (nibbles[2 * j + 1] << 4) for j in range(16)]
        scale_bytes.append(e + 127)
    return packed, scale_bytes


def oracle(inputs: Dsv4IndexerInputs) -> dict[str, np.ndarray]:
    """The expected output bytes (q_out, q_scale, weights_out, k_cache) from the text of
    the ops' docstrings, starting from inputs' poisoned cache."""
    f32 = np.float32
    q, k = inputs.q.float().numpy(), inputs.k.float().numpy()
    w = inputs.weights.float().numpy()
    cs = inputs.cos_sin_cache.numpy()
    num_tokens, num_heads, _ = q.shape
    fp8 = inputs.fmt == "fp8"
    q_out = np.zeros((num_tokens, num_heads, 128 if fp8 else 64), dtype=np.uint8)
    q_scale = np.zeros((num_tokens, num_heads, 4), dtype=np.uint8)
    w_out = np.zeros((num_tokens, num_heads), dtype=np.float32)
    ws = f32(inputs.weights_scale)
    for t, pos in enumerate(inputs.positions.tolist()):
        for h in range(num_heads):
            x = rope_row(q[t, h], cs[pos, :32], cs[pos, 32:])
            if fp8:
                codes, e = oracle_fp8_row(x)
                q_out[t, h] = codes
                w_out[t, h] = f32(f32(w[t, h] * f32(2.0**e)) * ws)
            else:
                q_out[t, h], q_scale[t, h] = oracle_mxfp4_row(x)
                w_out[t, h] = f32(w[t, h] * ws)

    cache = inputs.k_cache.numpy().copy()
    bs = inputs.block_size
    width = 128 if fp8 else 64
    for r, slot in enumerate(inputs.slot_mapping.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, bs)
        pos = int(inputs.k_positions[r])
        x = rope_row(k[r], cs[pos, :32], cs[pos, 32:])
        if fp8:
            data, e = oracle_fp8_row(x)
            scale = list(np.array([2.0**e], dtype="<f4").view(np.uint8))  # little-endian fp32
        else:
            data, scale = oracle_mxfp4_row(x)
        cache[block, row * width : (row + 1) * width] = data
        cache[block, bs * width + row * 4 : bs * width + row * 4 + 4] = scale
    out = {"q_out": q_out, "weights_out": w_out.view(np.int32), "k_cache": cache}
    if not fp8:
        out["q_scale"] = q_scale
    return out


def assert_matches_oracle(inputs: Dsv4IndexerInputs, out: Dsv4IndexerInputs, seed: int) -> None:
    expected = oracle(inputs)
    actual = {
        "q_out": out.q_out.view(torch.uint8).cpu().numpy(),
        "weights_out": out.weights_out.cpu().view(torch.int32).numpy(),
        "k_cache": out.k_cache.cpu().numpy(),
    }
    if out.q_scale is not None:
        actual["q_scale"] = out.q_scale.cpu().numpy()
    for name, want in expected.items():
        diff = int((actual[name] != want).sum())
        assert diff == 0, f"seed={seed}: {diff} elements of {name} differ from the oracle"


def test_oracle_tables_are_the_formats():
    """The oracle's tables against torch's own decoders (e4m3fn) and the OCP MX spec (e2m1)."""
    decoded = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(E4M3_VALUES, decoded)
    np.testing.assert_array_equal(E2M1_VALUES, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    # ties to even code, saturation, sign
    assert [e2m1_code(v) for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0)] == [0, 2, 2, 4, 4, 6, 6, 7, 7]
    assert (e2m1_code(-0.0), e2m1_code(-0.1), e2m1_code(-6.0)) == (8, 8, 15)
    assert (e4m3_code(-0.0), e4m3_code(448.0), e4m3_code(2.0**-10)) == (0x80, 0x7E, 0)  # 2^-10: a tie, to 0
    assert least_exponent(448.0 * 2.0**-3, 448.0) == -3 and least_exponent(6.0 * 2.0**-3 * 1.01, 6.0) == -2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "num_tokens, num_heads, block_size, options",
    [(5, 3, 16, {}), (3, 2, 64, {"num_k": 6, "num_inserted": 4}), (2, 4, 256, {"weights_dtype": torch.float32})],
)
def test_oracle_matches_reference_bytes(fmt, num_tokens, num_heads, block_size, options):
    inputs, seed = indexer_inputs(fmt, num_tokens, num_heads, block_size, "cpu", **options)
    assert_matches_oracle(inputs, run(REFERENCES[fmt], inputs), seed)


# --------------------------------------------------------------------------------------
# Hand-made cases: every implementation, on the kernel's device
# --------------------------------------------------------------------------------------
def single_row_inputs(fmt: str, q_row: torch.Tensor, k_row: torch.Tensor, generator) -> Dsv4IndexerInputs:
    """One token, one head, one key row, identity RoPE (cos 1, sin 0): quantisation only."""
    inputs = make_dsv4_indexer_inputs(fmt, 1, 1, 16, "cpu", generator=generator, skip_fraction=0.0)
    identity = torch.cat((torch.ones(16, 32), torch.zeros(16, 32)), dim=1)
    inputs.q = q_row.reshape(1, 1, 128).to(torch.bfloat16)
    inputs.k = k_row.reshape(1, 128).to(torch.bfloat16)
    inputs.weights = torch.full((1, 1), 3.0, dtype=torch.bfloat16)
    inputs.positions.fill_(5)
    inputs.k_positions.fill_(5)
    inputs.cos_sin_cache = identity
    return inputs


def to_device(inputs: Dsv4IndexerInputs, device) -> Dsv4IndexerInputs:
    for name, value in vars(inputs).items():
        if isinstance(value, torch.Tensor):
            setattr(inputs, name, value.to(device))
    return inputs


def k_slot(out: Dsv4IndexerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(data bytes, 4 scale bytes) of the single inserted key row."""
    slot = int(out.slot_mapping[0])
    block, row = divmod(slot, out.block_size)
    width = out.slot_bytes - 4
    cache = out.k_cache.cpu()
    scales = out.block_size * width + row * 4
    return cache[block, row * width : (row + 1) * width], cache[block, scales : scales + 4]


@pytest.mark.parametrize("which", ["reference", pytest.param("triton", marks=needs_triton)])
def test_fp8_scale_at_power_of_two_floor_and_weights(which):
    generator, seed = seeded_generator()
    q = (torch.rand(128, generator=generator) * 80 - 40)
    q[7], q[100] = 56.0, -56.0  # amax / 448 = 2^-3 exactly
    k = torch.zeros(128)  # all zero: amax floored to 1e-4, scale 2^ceil(log2(1e-4/448)) = 2^-22
    inputs = to_device(single_row_inputs("fp8", q, k, generator), DEVICE)
    out = run(impl_of("fp8", which), inputs)
    msg = f"seed={seed}"
    codes = out.q_out.view(torch.uint8).cpu()[0, 0]
    assert (codes[7].item(), codes[100].item()) == (0x7E, 0xFE), msg  # +-448
    assert out.weights_out.cpu()[0, 0].item() == np.float32(np.float32(3.0 * 2.0**-3) * np.float32(inputs.weights_scale)), msg
    data, scale = k_slot(out)
    assert bool((data == 0).all()), msg
    assert scale.view(torch.float32).item() == 2.0**-22 == 2.0 ** math.ceil(math.log2(1e-4 / 448)), msg


@pytest.mark.parametrize("which", ["reference", pytest.param("triton", marks=needs_triton)])
def test_mxfp4_ties_saturation_sign_and_nibble_order(which):
    """Identity RoPE. Block 0 has amax 6 (scale byte 127), so values map to codes
    unscaled: the ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the even code, -5.5
    saturates, small negatives keep their sign. Block 1 is all -0.0 (floor scale, sign
    nibbles); block 2 (rotated dims) has amax 6.25, so e = 1; block 3 is tiny values."""
    generator, seed = seeded_generator()
    x = torch.zeros(128)
    x[:16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.5, 0.5, -1.0, 3.0, 4.0, 0.1, -0.1])
    x[32:64] = -0.0
    x[64], x[65] = 6.25, -3.0
    x[96:128] = 2.0**-100
    x[97] = -(2.0**-98)
    inputs = to_device(single_row_inputs("mxfp4", x, x, generator), DEVICE)
    out = run(impl_of("mxfp4", which), inputs)
    msg = f"seed={seed}"
    want_nibbles = [0, 2, 2, 4, 4, 6, 6, 7, 8, 15, 1, 10, 5, 6, 0, 8]
    want_bytes = [want_nibbles[2 * j] | (want_nibbles[2 * j + 1] << 4) for j in range(8)]
    floor_byte = 127 + math.ceil(math.log2(6.0 * 2.0**-126 / 6.0))  # amax floored to 6 * 2^-126
    for packed, scales in ((out.q_out.cpu()[0, 0], out.q_scale.cpu()[0, 0]), k_slot(out)):
        assert packed[:8].tolist() == want_bytes and bool((packed[8:16] == 0).all()), msg
        assert scales[0].item() == 127, msg
        assert scales[1].item() == floor_byte == 1 and bool((packed[16:32] == 0x88).all()), msg
        # 6.25 / 2 = 3.125 -> 3 (code 5); -3 / 2 = -1.5 (code 11): byte 0xB5, even element low
        assert scales[2].item() == 128 and packed[32].item() == 0xB5, msg
        # amax 2^-98: e = ceil(log2(2^-98 / 6)) = -100; 2^-100 -> 1 (code 2), -2^-98 -> -4 (code 14)
        assert scales[3].item() == 27 and packed[48].item() == (2 | 14 << 4), msg
    assert out.weights_out.cpu()[0, 0].item() == np.float32(3.0 * np.float32(inputs.weights_scale)), msg


@pytest.mark.parametrize("table", ["identity", "quarter_turn"])
@pytest.mark.parametrize("fmt, which", IMPLS)
def test_rope_is_gptj_on_the_last_64_dims(fmt, which, table):
    """With cos 0, sin 1 each pair (e, o) of dims 64..127 becomes (-o, e), dims 0..63 stay:
    the op's output equals the unrotated op's on a q with that permutation applied."""
    inputs, seed = indexer_inputs(fmt, 3, 2, 16, "cpu", skip_fraction=0.0)
    cos, sin = (1.0, 0.0) if table == "identity" else (0.0, 1.0)
    turned = inputs.fresh_outputs()
    turned.cos_sin_cache = torch.cat((torch.full((8192, 32), cos), torch.full((8192, 32), sin)), dim=1)

    def rotate(x):
        if table == "identity":
            return x.clone()
        y = x.clone()
        y[..., 64::2], y[..., 65::2] = -x[..., 65::2], x[..., 64::2]
        return y

    plain = turned.fresh_outputs()
    plain.cos_sin_cache = torch.cat((torch.ones(8192, 32), torch.zeros(8192, 32)), dim=1)
    plain.q, plain.k = rotate(inputs.q), rotate(inputs.k)
    impl = impl_of(fmt, which)
    assert_same(run(impl, to_device(plain, DEVICE)), run(impl, to_device(turned, DEVICE)), seed)


@pytest.mark.parametrize("fmt, which", IMPLS)
def test_writes_every_byte_of_inserted_slots_and_nothing_else(fmt, which):
    """Two runs on different poisons: outputs and inserted slots agree, other bytes keep
    their poison (skipped rows, rows past Tk', slots never named, block padding)."""
    inputs, seed = indexer_inputs(fmt, 4, 3, 16, DEVICE, num_k=7, num_inserted=5, skip_fraction=0.3)
    impl = impl_of(fmt, which)
    first = run(impl, inputs)
    second = inputs.fresh_outputs()
    for t in (second.q_out, second.q_scale, second.weights_out, second.k_cache):
        if t is not None:
            t.view(torch.uint8).fill_(0x5A)
    impl(*second.args())
    written = indexer_written_bytes(inputs)
    diffs = compare_dsv4_indexer(first, second)
    diffs.pop("k_cache")
    assert not any(diffs.values()), f"seed={seed}: some q output was not written: {diffs}"
    assert torch.equal(first.k_cache[written], second.k_cache[written]), f"seed={seed}: a slot byte was not written"
    assert_untouched(first, seed)
    assert bool((second.k_cache[~written] == 0x5A).all()), f"seed={seed}"


# --------------------------------------------------------------------------------------
# The Triton kernel under the CPU interpreter vs the reference (bit for bit)
# --------------------------------------------------------------------------------------
INTERPRETER_CASES = [
    # num_tokens, num_heads, block_size, make_dsv4_indexer_inputs options
    pytest.param(1, 1, 16, {}, id="T1-H1-bs16"),
    pytest.param(7, 3, 16, {}, id="T7-H3-bs16"),
    pytest.param(5, 3, 64, {"num_k": 9, "num_inserted": 6}, id="more-k-rows-than-tokens"),
    pytest.param(6, 5, 256, {"num_k": 2}, id="fewer-k-rows-than-tokens"),
    pytest.param(3, 64, 64, {"num_k": 1}, id="production-heads-decode"),
    pytest.param(9, 64, 64, {"num_k": 3, "weights_dtype": torch.float32}, id="production-heads-fp32-weights"),
    pytest.param(130, 2, 16, {"num_k": 33}, id="large-T-launch-config"),
    pytest.param(4, 3, 16, {"skip_fraction": 1.0}, id="all-slots-negative"),
    pytest.param(0, 3, 16, {"num_k": 3}, id="T0"),
    pytest.param(3, 3, 16, {"num_k": 0}, id="no-k-rows"),
]


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens, num_heads, block_size, options", INTERPRETER_CASES)
def test_triton_interpreter_matches_reference(fmt, num_tokens, num_heads, block_size, options):
    inputs, seed = indexer_inputs(fmt, num_tokens, num_heads, block_size, "cpu", **options)
    assert_matches_reference(KERNELS[fmt], fmt, inputs, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens, num_k, dedupe", [(1, 1, None), (5, 9, "scan"), (5, 3, "lock"), (0, 3, None),
                                                      (3, 0, None)])
def test_triton_interpreter_k_first_order(fmt, num_tokens, num_k, dedupe):
    """``k_first`` (the decode floor's rows) only reorders the grid: bit for bit the reference
    with more k rows than tokens and fewer, under the scan and the row locks, and with one
    side empty; every lock released."""
    from prepfuse.ops import _duplicate_slots

    inputs, seed = indexer_inputs(fmt, num_tokens, 3, 16, "cpu", num_k=num_k)
    assert_matches_reference(functools.partial(KERNELS[fmt], k_first=True, dedupe=dedupe), fmt, inputs, seed)
    assert not _duplicate_slots.row_locks(inputs.k_cache.device).any()


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_interpreter_matches_oracle(fmt):
    inputs, seed = indexer_inputs(fmt, 3, 4, 16, "cpu", num_k=4, num_inserted=3)
    assert_matches_oracle(inputs, run(KERNELS[fmt], inputs), seed)


def rows_two_bytes_off(t: torch.Tensor) -> torch.Tensor:
    """The same bf16 values as a view whose rows start 2 bytes past a 4-byte boundary (odd
    row strides, odd offset): rows the mxfp4 kernel cannot read two values to a word."""
    shape = list(t.shape)
    base = torch.empty(shape[:-1] + [shape[-1] + 1], dtype=t.dtype, device=t.device).fill_(float("nan"))
    view = base[..., 1:]
    view.copy_(t)
    return view


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=[needs_triton, needs_interpreter]),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def test_kernel_reads_rows_at_any_two_byte_offset(fmt, device):
    """q and k rows off the 4-byte grid: the kernel's value-by-value loads (mxfp4 reads
    aligned rows as bf16x2 words, ``_rows_hold_words``), the same bytes as the reference."""
    inputs, seed = indexer_inputs(fmt, 5, 3, 16, device, num_k=4, num_inserted=3)
    odd = replace(inputs, q=rows_two_bytes_off(inputs.q), k=rows_two_bytes_off(inputs.k))
    assert odd.q.stride(1) % 2 == 1 and odd.q.data_ptr() % 4 == 2
    assert_matches_reference(KERNELS[fmt], fmt, odd, seed)


# --------------------------------------------------------------------------------------
# The dispatcher
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatcher_on_cpu_is_the_reference(fmt):
    inputs, seed = indexer_inputs(fmt, 6, 4, 16, "cpu", num_k=5, num_inserted=4)
    assert_same(run(REFERENCES[fmt], inputs), run(OPS[fmt], inputs), seed)


# --------------------------------------------------------------------------------------
# The CUDA kernel vs the reference on the same GPU: byte for byte (no sums anywhere)
# --------------------------------------------------------------------------------------
def gpu_cases():
    for fmt in FORMATS:
        for num_tokens in (1, 7, 64, 1000, 8192):
            for num_heads in (1, 3, 64):
                for block_size in (16, 64):
                    yield pytest.param(fmt, num_tokens, num_heads, block_size,
                                       id=f"{fmt}-T{num_tokens}-H{num_heads}-bs{block_size}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, num_tokens, num_heads, block_size", list(gpu_cases()))
def test_cuda_kernel_matches_reference(fmt, num_tokens, num_heads, block_size):
    inputs, seed = indexer_inputs(
        fmt, num_tokens, num_heads, block_size, "cuda", num_k=max(1, num_tokens // 4), skip_fraction=0.1
    )
    assert_matches_reference(OPS[fmt], fmt, inputs, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens, num_k", [(0, 5), (6, 0), (0, 0)], ids=["no-q", "no-k", "empty"])
def test_cuda_kernel_with_an_empty_side(fmt, num_tokens, num_k):
    """The pass emits calls with no tokens or no key rows (empty tensors, null pointers)."""
    inputs, seed = indexer_inputs(fmt, num_tokens, 3, 16, "cuda", num_k=num_k)
    assert_matches_reference(OPS[fmt], fmt, inputs, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_replay_matches_reference(fmt):
    """Captured once, replayed on new inputs copied into the captured buffers: the replay
    writes what the reference computes for the new inputs (no host sync during capture)."""
    first, seed = indexer_inputs(fmt, 9, 64, 64, "cuda", num_k=3)
    out = first.fresh_outputs()
    OPS[fmt](*out.args())  # warm-up: compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        OPS[fmt](*out.args())
    second = make_dsv4_indexer_inputs(fmt, 9, 64, 64, "cuda", num_k=3)
    assert second.k_cache.shape == out.k_cache.shape  # same slot count: every new slot fits
    for name in ("q", "weights", "k", "slot_mapping", "positions", "k_positions"):
        getattr(out, name).copy_(getattr(second, name))
    fresh = out.fresh_outputs()
    for name in ("q_out", "q_scale", "weights_out", "k_cache"):
        if getattr(out, name) is not None:
            getattr(out, name).copy_(getattr(fresh, name))
    graph.replay()
    torch.cuda.synchronize()
    assert_same(run(REFERENCES[fmt], out), out, seed)


# --------------------------------------------------------------------------------------
# Input checks: ValueError naming the argument, in eager and in the fake impl
# --------------------------------------------------------------------------------------
def arg_names(fmt: str) -> tuple[str, ...]:
    outs = ("q_out",) if fmt == "fp8" else ("q_out", "q_scale")
    return ("q", "weights", "k", *outs, "weights_out", "k_cache", "slot_mapping", "positions", "k_positions",
            "cos_sin_cache", "weights_scale", "block_size")


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def other_device(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


def widen(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t, t), dim=-1)


# (id, formats it applies to, the argument the message must name, the arguments to change)
BAD_INPUTS = [
    ("q-dtype", FORMATS, "q", lambda a: {"q": a["q"].float()}),
    ("weights-dtype", FORMATS, "weights", lambda a: {"weights": a["weights"].half()}),
    ("k-dtype", FORMATS, "k", lambda a: {"k": a["k"].float()}),
    ("q_out-dtype-fp8", ["fp8"], "q_out", lambda a: {"q_out": a["q_out"].view(torch.uint8)}),
    ("q_out-dtype-mxfp4", ["mxfp4"], "q_out", lambda a: {"q_out": a["q_out"].view(torch.int8)}),
    ("q_scale-dtype", ["mxfp4"], "q_scale", lambda a: {"q_scale": a["q_scale"].view(torch.float8_e4m3fn)}),
    ("weights_out-dtype", FORMATS, "weights_out", lambda a: {"weights_out": a["weights_out"].bfloat16()}),
    ("k_cache-dtype", FORMATS, "k_cache", lambda a: {"k_cache": a["k_cache"].view(torch.int8)}),
    ("slot_mapping-dtype", FORMATS, "slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].short()}),
    ("positions-dtype", FORMATS, "positions", lambda a: {"positions": a["positions"].short()}),
    ("k_positions-dtype", FORMATS, "k_positions", lambda a: {"k_positions": a["k_positions"].short()}),
    ("cos_sin_cache-dtype", FORMATS, "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"].double()}),
    ("q-ndim", FORMATS, "q", lambda a: {"q": a["q"][0]}),
    ("weights-ndim", FORMATS, "weights", lambda a: {"weights": a["weights"][..., None]}),
    ("k-ndim", FORMATS, "k", lambda a: {"k": a["k"][None]}),
    ("q_out-ndim", FORMATS, "q_out", lambda a: {"q_out": a["q_out"][:, 0]}),
    ("q_scale-ndim", ["mxfp4"], "q_scale", lambda a: {"q_scale": a["q_scale"].flatten(1)}),
    ("weights_out-ndim", FORMATS, "weights_out", lambda a: {"weights_out": a["weights_out"].flatten()}),
    ("k_cache-ndim", FORMATS, "k_cache", lambda a: {"k_cache": a["k_cache"].flatten()}),
    ("k_positions-ndim", FORMATS, "k_positions", lambda a: {"k_positions": a["k_positions"][None]}),
    ("q-head-dim", FORMATS, "q", lambda a: {"q": a["q"][..., :64].contiguous()}),
    ("k-head-dim", FORMATS, "k", lambda a: {"k": widen(a["k"])}),
    ("q_out-width", FORMATS, "q_out", lambda a: {"q_out": widen(a["q_out"].view(torch.uint8)).view(a["q_out"].dtype)}),
    ("q_scale-width", ["mxfp4"], "q_scale", lambda a: {"q_scale": widen(a["q_scale"])}),
    ("weights-heads", FORMATS, "weights", lambda a: {"weights": a["weights"][:, :-1]}),
    ("weights-tokens", FORMATS, "weights", lambda a: {"weights": a["weights"][:-1]}),
    ("q_out-tokens", FORMATS, "q_out", lambda a: {"q_out": a["q_out"][:-1]}),
    ("q_out-heads", FORMATS, "q_out", lambda a: {"q_out": a["q_out"][:, :-1]}),
    ("q_scale-heads", ["mxfp4"], "q_scale", lambda a: {"q_scale": a["q_scale"][:, :-1]}),
    ("weights_out-tokens", FORMATS, "weights_out", lambda a: {"weights_out": a["weights_out"][:-1]}),
    ("positions-tokens", FORMATS, "positions", lambda a: {"positions": a["positions"][:-1]}),
    ("k_positions-rows", FORMATS, "k_positions", lambda a: {"k_positions": a["k_positions"][:-1]}),
    ("slot_mapping-longer-than-k", FORMATS, "slot_mapping",
     lambda a: {"slot_mapping": torch.cat((a["slot_mapping"], a["slot_mapping"].new_full((1,), -1)))}),
    ("cos_sin_cache-narrow", FORMATS, "cos_sin_cache",
     lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :32].contiguous()}),
    ("q-stride", FORMATS, "q", lambda a: {"q": strided_last_dim(a["q"])}),
    ("weights-stride", FORMATS, "weights", lambda a: {"weights": strided_last_dim(a["weights"])}),
    ("k-stride", FORMATS, "k", lambda a: {"k": strided_last_dim(a["k"])}),
    ("q_out-stride", FORMATS, "q_out", lambda a: {"q_out": strided_last_dim(a["q_out"].view(torch.uint8)).view(a["q_out"].dtype)}),
    ("q_scale-stride", ["mxfp4"], "q_scale", lambda a: {"q_scale": strided_last_dim(a["q_scale"])}),
    ("weights_out-stride", FORMATS, "weights_out", lambda a: {"weights_out": strided_last_dim(a["weights_out"])}),
    ("k_cache-stride", FORMATS, "k_cache", lambda a: {"k_cache": strided_last_dim(a["k_cache"])}),
    ("slot_mapping-stride", FORMATS, "slot_mapping", lambda a: {"slot_mapping": strided_last_dim(a["slot_mapping"])}),
    ("k_positions-stride", FORMATS, "k_positions", lambda a: {"k_positions": strided_last_dim(a["k_positions"])}),
    ("k_cache-block-too-short", FORMATS, "k_cache",
     lambda a: {"k_cache": a["k_cache"][:, : a["block_size"] * (132 if a["q_out"].dtype != torch.uint8 else 68) - 1]}),
    ("k_cache-block_size-too-big", FORMATS, "k_cache", lambda a: {"block_size": 4 * a["block_size"]}),
    ("block_size-zero", FORMATS, "block_size", lambda a: {"block_size": 0}),
    ("weights_scale-inf", FORMATS, "weights_scale", lambda a: {"weights_scale": float("inf")}),
    ("weights_scale-past-fp32", FORMATS, "weights_scale", lambda a: {"weights_scale": 1e300}),  # inf in fp32
    ("k-device", FORMATS, "k", lambda a: {"k": a["k"].to(other_device(a["k"].device.type))}),
    ("weights_out-device", FORMATS, "weights_out",
     lambda a: {"weights_out": a["weights_out"].to(other_device(a["q"].device.type))}),
]

BAD_INDEX_VALUES = [
    ("slot-past-the-cache", "slot_mapping",
     lambda a: {"slot_mapping": a["slot_mapping"].clone().fill_(a["k_cache"].shape[0] * a["block_size"])}),
    ("position-past-the-table", "positions",
     lambda a: {"positions": a["positions"].clone().fill_(a["cos_sin_cache"].shape[0])}),
    ("k_position-negative", "k_positions", lambda a: {"k_positions": a["k_positions"].clone().fill_(-1)}),
    ("k_position-past-the-table", "k_positions",
     lambda a: {"k_positions": a["k_positions"].clone().fill_(a["cos_sin_cache"].shape[0])}),
]


def bad_args(fmt: str, change, device) -> dict:
    inputs = make_dsv4_indexer_inputs(fmt, 5, 3, 16, device, num_k=4)
    return changed(dict(zip(arg_names(fmt), inputs.args())), change)


def bad_input_params(cases):
    return [pytest.param(fmt, name, change, id=f"{fmt}-{case}") for case, fmts, name, change in cases for fmt in fmts]


@pytest.mark.parametrize(
    "fmt, name, change",
    bad_input_params(BAD_INPUTS) + bad_input_params([(i, FORMATS, n, c) for i, n, c in BAD_INDEX_VALUES]),
)
def test_bad_input_raises_in_eager(fmt, name, change):
    assert_rejected(OPS[fmt], bad_args(fmt, change, DEVICE), name, fake=False)


@pytest.mark.parametrize("fmt, name, change", bad_input_params(BAD_INPUTS))
def test_bad_input_raises_in_fake_impl(fmt, name, change):
    assert_rejected(OPS[fmt], bad_args(fmt, change, "cpu"), name, fake=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, _, c in BAD_INDEX_VALUES])
def test_fake_impl_does_not_read_index_values(fmt, change):
    call_with_fake_tensors(OPS[fmt], bad_args(fmt, change, "cpu"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_good_input_passes_fake_impl(fmt):
    call_with_fake_tensors(OPS[fmt], bad_args(fmt, lambda a: {}, "cpu"))
