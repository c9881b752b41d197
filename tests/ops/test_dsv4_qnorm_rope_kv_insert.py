"""Numerics and input checks of ``prepfuse::dsv4_qnorm_rope_kv_insert``.

Three implementations are held against each other and against the DeepSeek-V4 bound (docs/design.md):

- an oracle written here: the spec's text transcribed one scalar at a time in numpy
  fp32, with its own e4m3 rounding (a table of the 127 non-negative e4m3fn values and
  their midpoints) and bf16 rounding (on the fp32 bits); it shares no code with the op;
- the plain-PyTorch reference, ``dsv4_qnorm_rope_kv_insert_reference``;
- the Triton kernel, ``dsv4_qnorm_rope_kv_insert_triton``: under the CPU interpreter
  here, compiled on CUDA (through the dispatcher) in the ``gpu`` tests.

Every run draws fresh random data from a newly seeded generator; the seed is in every
assertion message. Outputs are poisoned before each call (q_out -123.0, k_cache 0xA5) so
a byte that should be written and is not, or one that is written and should not be,
shows up.

Bit-for-bit comparisons of q use inputs whose RMS is exact in fp32 (``exact_rms_q``): the
kernel, the reference and the oracle then compute the same RMS, and the spec's "bit for
bit on small inputs" is a deterministic claim rather than a likely one. Fully random q is
compared with a stated tolerance.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_INSERT,
    dsv4_qnorm_rope_kv_insert_reference,
    dsv4_qnorm_rope_kv_insert_triton,
)
from tests.ops.bad_inputs import assert_rejected, changed
from prepfuse.testing import (
    CACHE_POISON, Dsv4Inputs, call_with_fake_tensors, compare_dsv4, make_dsv4_inputs, seeded_dsv4_inputs,
    seeded_generator, to_device,
)

# Where kernels run: compiled on a CUDA device when there is one, else triton's CPU
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not triton_interpret_mode(),
    reason="CPU-interpreter parity; on CUDA, test_cuda_kernel_matches_reference covers the kernel",
)

# The op's implementations, one parametrize axis (STYLE: no cloned tests per backend).
IMPLS = [
    pytest.param(dsv4_qnorm_rope_kv_insert_reference, id="reference"),
    pytest.param(dsv4_qnorm_rope_kv_insert_triton, id="triton", marks=needs_triton),
]


def written_bytes(inputs: Dsv4Inputs) -> torch.Tensor:
    """True for the k_cache bytes the op must write: 576 data + 8 scale bytes per inserted slot,
    or its 528-byte MXFP8 record."""
    mask = torch.zeros(inputs.k_cache.shape, dtype=torch.bool)
    bs = inputs.block_size
    for slot in inputs.slot_mapping.tolist():
        if slot >= 0:
            block, row = divmod(slot, bs)
            if inputs.kv_mxfp8:
                mask[block, row * 528 : (row + 1) * 528] = True
                continue
            mask[block, row * 576 : (row + 1) * 576] = True
            mask[block, bs * 576 + row * 8 : bs * 576 + (row + 1) * 8] = True
    return mask.to(inputs.k_cache.device)


def assert_untouched(out: Dsv4Inputs, seed: int) -> None:
    """Padded heads are zero; every cache byte outside the inserted slots is still poison.

    Outside the inserted slots: slots never named, rows with slot -1, rows t >= T', and the
    padding of each block past block_size * 584 (MXFP8: 528) bytes.
    """
    num_heads = out.q.shape[1]
    padded = out.q_out[:, num_heads:]
    # bit equality: +0.0, never -0.0 (0 * -sin) nor NaN (eps = 0)
    assert bool((padded.view(torch.int16) == 0).all()), f"seed={seed}: padded heads are not +0.0"
    untouched = out.k_cache[~written_bytes(out)]
    assert bool((untouched == CACHE_POISON).all()), (
        f"seed={seed}: {int((untouched != CACHE_POISON).sum())} cache bytes outside the inserted slots were written"
    )


def run(impl, inputs: Dsv4Inputs) -> Dsv4Inputs:
    """Call ``impl`` on fresh poisoned outputs and return them."""
    out = inputs.fresh_outputs()
    impl(*out.args())
    return out


def slot_bytes(k_cache: torch.Tensor, slot: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(576 data bytes, 8 scale bytes) of one slot of an fp8_ds_mla cache."""
    block, row = divmod(slot, block_size)
    scales = block_size * 576 + row * 8
    return k_cache[block, row * 576 : (row + 1) * 576], k_cache[block, scales : scales + 8]


def bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int16), so that equality tells -0.0 from +0.0."""
    return t.view(torch.int16)


# --------------------------------------------------------------------------------------
# The oracle: the op's math (docs/ops.md), scalar by scalar, numpy fp32
# --------------------------------------------------------------------------------------
# e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; 0x7F is NaN, so codes
# 0..126 are the non-negative values, 0x7E = 448 the largest.
E4M3_VALUES = np.array(
    [(c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]
)
E4M3_MIDPOINTS = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2


def e4m3_code(v: np.float32) -> int:
    """The e4m3fn byte nearest to ``v`` (|v| <= 448), ties to the even code."""
    mag = abs(float(v))
    code = int(np.searchsorted(E4M3_MIDPOINTS, mag))  # midpoints[:code] < mag <= midpoints[code]
    if code < 126 and mag == E4M3_MIDPOINTS[code] and code % 2 == 1:
        code += 1  # a tie between codes `code` and `code + 1` goes to the even one
    return code | (0x80 if np.signbit(v) else 0)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even, by the bit trick."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def ceil_log2_ratio(amax: float) -> int:
    """ceil(log2(amax / 448)) without rounding: the least e with amax <= 448 * 2^e."""
    e = -160
    while 448.0 * 2.0**e < amax:
        e += 1
    return e


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """GPT-J RoPE of dims [448, 512) of x [512] fp32, one fp32 operation at a time."""
    out = x.copy()
    for p in range(32):
        e, o = x[448 + 2 * p], x[449 + 2 * p]
        out[448 + 2 * p] = e * cos[p] - o * sin[p]
        out[449 + 2 * p] = e * sin[p] + o * cos[p]
    return out


def ue8m0_block(values: np.ndarray) -> tuple[list[int], int]:
    """(e4m3 codes, UE8M0 scale byte) of one block of fp32 values."""
    amax = max(float(np.abs(values).max()), float(np.float32(1e-4)))
    e = ceil_log2_ratio(amax)
    codes = [e4m3_code(min(max(v * np.float32(2.0**-e), np.float32(-448)), np.float32(448))) for v in values]
    return codes, min(max(e + 127, 0), 255)


def oracle(inputs: Dsv4Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_cache) as the op's math (docs/ops.md) says, starting from inputs' poisoned k_cache."""
    f32 = np.float32
    q = inputs.q.float().numpy()
    kv = inputs.kv.float().numpy()
    cos_sin = inputs.cos_sin_cache.numpy()
    positions = inputs.positions.tolist()
    eps = f32(inputs.eps)
    num_tokens, num_heads, _ = q.shape
    bs = inputs.block_size

    q_out = np.zeros((num_tokens, inputs.q_out.shape[1], 512), dtype=np.uint16)  # heads >= H: +0.0
    for t in range(num_tokens):
        cos, sin = cos_sin[positions[t], :32], cos_sin[positions[t], 32:]
        for h in range(num_heads):
            x = q[t, h]
            sum_sq = f32(0)
            for v in x:
                sum_sq = f32(sum_sq + v * v)
            rstd = f32(1) / np.sqrt(f32(sum_sq / f32(512)) + eps) if inputs.apply_q_norm else f32(1)
            q_out[t, h] = bf16_bits(rope(x * rstd, cos, sin))

    cache = inputs.k_cache.numpy().copy()
    for t, slot in enumerate(inputs.slot_mapping.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, bs)
        x = kv[t]
        roped = bf16_bits(rope(x, cos_sin[positions[t], :32], cos_sin[positions[t], 32:])[448:])
        if inputs.kv_mxfp8:  # the whole row, the RoPE dims as their bf16 values, in 16 blocks of 32
            values = x.copy()
            values[448:] = (roped.astype(np.uint32) << 16).view(np.float32)
            record = np.zeros(528, dtype=np.uint8)
            for j in range(16):
                record[32 * j : 32 * (j + 1)], record[512 + j] = ue8m0_block(values[32 * j : 32 * (j + 1)])
            cache[block, row * 528 : (row + 1) * 528] = record
            continue
        data = np.zeros(576, dtype=np.uint8)
        scales = np.zeros(8, dtype=np.uint8)  # the 8th byte stays 0
        for j in range(7):
            data[64 * j : 64 * (j + 1)], scales[j] = ue8m0_block(x[64 * j : 64 * (j + 1)])
        data[448:576:2] = roped & 0xFF  # little-endian bf16
        data[449:576:2] = roped >> 8
        cache[block, row * 576 : (row + 1) * 576] = data
        cache[block, bs * 576 + row * 8 : bs * 576 + (row + 1) * 8] = scales

    return torch.from_numpy(q_out.view(np.int16)).view(torch.bfloat16), torch.from_numpy(cache)


def test_oracle_e4m3_table_is_e4m3fn():
    codes = torch.arange(127, dtype=torch.uint8)
    decoded = codes.view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(E4M3_VALUES, decoded)
    assert E4M3_VALUES[0x7E] == 448.0 and E4M3_VALUES[1] == 2.0**-9


# DeepSeek-V4.1 as vLLM serves it: q without the op's norm, and (on SM100) the MXFP8 record
V41 = {"apply_q_norm": False, "kv_mxfp8": True}


@pytest.mark.parametrize(
    "num_tokens, num_heads, padded_heads, block_size, options",
    [(7, 3, 8, 16, {}), (5, 1, 8, 64, {}), (6, 2, 16, 256, {"num_inserted": 3}), (7, 3, 8, 16, V41),
     (6, 2, 16, 32, {"num_inserted": 3, "kv_mxfp8": True}), (5, 2, 4, 16, {"apply_q_norm": False})],
    ids=["T7", "T5-H1", "T6-short", "T7-v41", "T6-mxfp8-short", "T5-no-q-norm"],
)
def test_oracle_matches_reference_bytes(num_tokens, num_heads, padded_heads, block_size, options):
    inputs, seed = seeded_dsv4_inputs(num_tokens, num_heads, padded_heads, block_size, "cpu", **options)
    expected_q, expected_cache = oracle(inputs)
    out = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    q_diff = int((bits(out.q_out) != bits(expected_q)).sum())
    cache_diff = int((out.k_cache != expected_cache).sum())
    assert q_diff == 0, f"seed={seed}: {q_diff} q_out elements differ from the oracle"
    assert cache_diff == 0, f"seed={seed}: {cache_diff} k_cache bytes differ from the oracle"


def test_oracle_matches_reference_on_random_q():
    """Unconstrained q: sums of squares now depend on order, so q is compared to a tolerance.

    After the norm every value is O(1) (RMS 1), so the tolerance is one bf16 ULP (rtol
    2^-7) plus 2^-16 absolute for RoPE outputs that cancel to near zero, where a one-ULP
    fp32 difference in the RMS is many bf16 ULPs of the tiny result.
    """
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(7, 3, 8, 16, "cpu", generator=generator)
    expected_q, expected_cache = oracle(inputs)
    out = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    torch.testing.assert_close(
        out.q_out.float(), expected_q.float(), rtol=2**-7, atol=2**-16, msg=lambda m: f"seed={seed}: {m}"
    )
    assert torch.equal(out.k_cache, expected_cache), f"seed={seed}: k_cache differs from the oracle"


# --------------------------------------------------------------------------------------
# Hand-made cases: every implementation, on the kernel's device
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_ue8m0_scales_at_power_of_two_and_floor(impl):
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(2, 1, 8, 16, "cpu", generator=generator, skip_fraction=0.0)
    kv = (torch.rand(2, 512, generator=generator) * 80 - 40).to(torch.bfloat16)  # |x| <= 40
    kv[0, 5], kv[0, 9] = 56.0, -56.0  # block 0: amax / 448 = 2^-3 exactly
    kv[0, 64:128] = 0.0  # block 1: all zero, amax floored to 1e-4
    kv[0, 128] = 56.25  # block 2: amax just above 448 * 2^-3
    kv[1] = 0.0  # a row of zeros: every block at the floor
    inputs = dataclasses.replace(inputs, kv=kv)
    cache = run(impl, to_device(inputs, DEVICE)).k_cache.cpu()
    slots = inputs.slot_mapping.tolist()
    (data0, scales0), (data1, scales1) = (slot_bytes(cache, slot, inputs.block_size) for slot in slots)

    floor_byte = min(max(math.ceil(math.log2(1e-4 / 448)) + 127, 0), 255)
    assert floor_byte == 105
    msg = f"seed={seed}"
    assert scales0[0].item() == 127 - 3, msg
    assert (data0[5].item(), data0[9].item()) == (0x7E, 0xFE), msg  # +-448, the largest e4m3fn codes
    assert scales0[1].item() == floor_byte and bool((data0[64:128] == 0).all()), msg
    assert scales0[2].item() == 127 - 2, msg  # 56.25 needs e = -2
    assert data0[128].item() == 0x76, msg  # 56.25 * 4 = 225 rounds (down) to 224 = 1.75 * 2^7
    assert scales0[7].item() == 0 and scales1[7].item() == 0, msg  # the 8th scale byte
    assert bool((scales1[:7] == floor_byte).all()) and bool((data1[:448] == 0).all()), msg
    assert bool((data1[448:].view(torch.bfloat16) == 0).all()), msg  # rotated zeros (IEEE may give -0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_heads_are_positive_zero_even_with_eps_zero(impl):
    """Padded heads are +0.0 bit for bit: not -0.0 (0 * -sin) and not NaN (0 / sqrt(0 + 0))."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(3, 2, 8, 16, DEVICE, generator=generator, eps=0.0)
    out = run(impl, inputs)
    assert bool((out.q_out[:, 2:].view(torch.int16) == 0).all()), f"seed={seed}"
    assert not bool(out.q_out[:, :2].isnan().any()), f"seed={seed}: real heads must stay finite"


@pytest.mark.parametrize("table", ["identity", "quarter_turn"])
@pytest.mark.parametrize("impl", IMPLS)
def test_rope_special_tables(impl, table):
    """cos=1, sin=0 leaves every dim alone; cos=0, sin=1 maps each pair (e, o) to (-o, e).

    q rows are +-2^k, so after the norm every value of a head has one magnitude and the
    input's sign: the expected output is that exactly, with no rounding to argue about.
    """
    generator, seed = seeded_generator()
    num_tokens, num_heads = 5, 3
    inputs = make_dsv4_inputs(num_tokens, num_heads, 8, 16, "cpu", generator=generator, skip_fraction=0.0)
    signs = torch.randint(0, 2, (num_tokens, num_heads, 512), generator=generator).float() * 2 - 1
    powers = torch.exp2(torch.randint(-10, 11, (num_tokens, num_heads, 1), generator=generator).float())
    q = (signs * powers).to(torch.bfloat16)
    cos, sin = (1.0, 0.0) if table == "identity" else (0.0, 1.0)
    cos_sin = torch.cat((torch.full((16, 32), cos), torch.full((16, 32), sin)), dim=1)
    positions = torch.randint(0, 16, (num_tokens,), generator=generator)
    inputs = dataclasses.replace(inputs, q=q, cos_sin_cache=cos_sin, positions=positions)
    out = run(impl, to_device(inputs, DEVICE))
    q_out, cache = out.q_out[:, :num_heads].float().cpu(), out.k_cache.cpu()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if table == "identity":
            return x
        rot = x.clone()
        rot[..., 448::2], rot[..., 449::2] = -x[..., 449::2], x[..., 448::2]
        return rot

    magnitude = q_out[..., :1].abs()
    assert torch.equal(q_out, rotate(signs * magnitude)), f"seed={seed}"
    for t, slot in enumerate(inputs.slot_mapping.tolist()):
        data, _ = slot_bytes(cache, slot, inputs.block_size)
        assert torch.equal(data[448:].view(torch.bfloat16), rotate(inputs.kv[t])[448:]), f"seed={seed}: row {t}"


@pytest.mark.parametrize("impl", IMPLS)
def test_writes_every_byte_of_inserted_slots_and_nothing_else(impl):
    """Two runs on different poisons: inserted slots' bytes agree, all other bytes are the poison."""
    inputs, seed = seeded_dsv4_inputs(7, 3, 8, 16, DEVICE, num_inserted=5, skip_fraction=0.3)
    first = run(impl, inputs)
    second = inputs.fresh_outputs()
    second.q_out.fill_(77.0)
    second.k_cache.fill_(0x5A)
    impl(*second.args())
    written = written_bytes(inputs)
    assert torch.equal(bits(first.q_out), bits(second.q_out)), f"seed={seed}: some of q_out was not written"
    assert torch.equal(first.k_cache[written], second.k_cache[written]), f"seed={seed}: a slot byte was not written"
    assert bool((first.k_cache[~written] == CACHE_POISON).all()), f"seed={seed}"
    assert bool((second.k_cache[~written] == 0x5A).all()), f"seed={seed}"


# --------------------------------------------------------------------------------------
# The Triton kernel under the CPU interpreter vs the reference
# --------------------------------------------------------------------------------------
# The interpreter takes some 5 ms per program, and a call runs T * (1 + HP / BLOCK_H)
# programs (BLOCK_H heads each, 1 to 4): T * HP is kept small.
INTERPRETER_CASES = [
    # num_tokens, num_heads, padded_heads, block_size, make_dsv4_inputs options
    pytest.param(1, 1, 8, 16, {}, id="T1-H1-HP8-bs16"),
    pytest.param(7, 3, 8, 16, {}, id="T7-H3-HP8-bs16"),
    pytest.param(7, 3, 16, 64, {}, id="T7-H3-HP16-bs64"),
    pytest.param(33, 3, 8, 256, {}, id="T33-H3-HP8-bs256"),
    pytest.param(7, 1, 64, 64, {}, id="T7-H1-HP64-bs64"),
    pytest.param(7, 16, 16, 64, {}, id="T7-H16-HP16-bs64"),
    pytest.param(1, 16, 64, 256, {}, id="T1-H16-HP64-bs256"),
    pytest.param(7, 16, 64, 16, {}, id="T7-H16-HP64-bs16"),
    # q_out.size(1) need not be a power of two, nor a multiple of the heads per program;
    # T > 128 takes the large-T launch configuration
    pytest.param(7, 3, 3, 16, {}, id="T7-H3-HP3-bs16"),
    pytest.param(129, 5, 6, 64, {}, id="T129-H5-HP6-bs64"),
    pytest.param(7, 3, 8, 16, {"num_inserted": 4}, id="short-slot-mapping"),
    pytest.param(7, 3, 8, 64, {"skip_fraction": 1.0}, id="all-slots-negative"),
    pytest.param(0, 3, 8, 16, {}, id="T0"),
    pytest.param(7, 3, 8, 16, V41, id="v41"),
    pytest.param(17, 5, 6, 32, {"kv_mxfp8": True, "num_inserted": 12}, id="T17-mxfp8-short"),
    pytest.param(9, 4, 4, 16, {"apply_q_norm": False}, id="no-q-norm"),
]


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("num_tokens, num_heads, padded_heads, block_size, options", INTERPRETER_CASES)
def test_triton_interpreter_matches_reference(num_tokens, num_heads, padded_heads, block_size, options):
    """Bit for bit (q from exact_rms_q); padded heads zero; only inserted slots written."""
    inputs, seed = seeded_dsv4_inputs(num_tokens, num_heads, padded_heads, block_size, "cpu", **options)
    expected = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    actual = run(dsv4_qnorm_rope_kv_insert_triton, inputs)
    comparison = compare_dsv4(expected, actual)
    assert comparison.within_spec(), f"seed={seed}: {comparison}"
    assert comparison.q_mismatches == 0 and comparison.cache_mismatches == 0, f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)


@pytest.mark.parametrize("launch_config", [(2, 2), (2, 1), (4, 2), (1, 2), (8, 4)], ids=lambda c: "/".join(map(str, c)))
@pytest.mark.parametrize("num_heads, padded_heads", [(3, 16), (5, 6), (1, 8), (16, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=[needs_triton, needs_interpreter]),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def test_kernel_at_other_launch_configs(device, launch_config, num_heads, padded_heads):
    """Launch configurations other than ``_launch_config``'s (the sweep's): columns holding
    real and padded heads together, only padded heads, or heads past HP give the
    reference's bytes."""
    inputs, seed = seeded_dsv4_inputs(7, num_heads, padded_heads, 16, device)
    expected = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    actual = inputs.fresh_outputs()
    dsv4_qnorm_rope_kv_insert_triton(*actual.args(), launch_config=launch_config)
    comparison = compare_dsv4(expected, actual)
    assert comparison.q_mismatches == 0 and comparison.cache_mismatches == 0, f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)


@needs_triton
def test_launch_table():
    """``_launch_config``'s rule as the H200 sweeps chose it (docs/ops.md): one head on one
    warp to T=8, two heads on one warp to T=128, four heads on two warps above; never more
    heads a program than the padded heads there are."""
    from prepfuse.ops.dsv4_qnorm_rope_kv_insert import _launch_config

    assert _launch_config(1, 64) == (1, 1)
    assert _launch_config(8, 128) == (1, 1)
    assert _launch_config(9, 64) == (2, 1)
    assert _launch_config(128, 16) == (2, 1)
    assert _launch_config(129, 64) == (4, 2)
    assert _launch_config(16384, 128) == (4, 2)
    assert _launch_config(4096, 2) == (2, 2)  # capped at the padded heads
    assert _launch_config(64, 0) == (1, 1)  # a kv-only call


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("byte_offset, stride_pad", [(1, 0), (0, 1), (1, 1)], ids=["odd-base", "odd-stride", "both"])
def test_triton_interpreter_odd_cache_layout(byte_offset, stride_pad):
    """A cache view whose base address or row stride is odd: the kernel cannot store the
    RoPE bytes as two-byte words there and stores them byte by byte; same bytes as the
    reference, nothing else written."""
    inputs, seed = seeded_dsv4_inputs(7, 3, 8, 16, "cpu")
    num_blocks, row_bytes = inputs.k_cache.shape
    stride = row_bytes + stride_pad

    def odd_cache() -> torch.Tensor:
        backing = torch.full((byte_offset + num_blocks * stride,), CACHE_POISON, dtype=torch.uint8)
        return backing[byte_offset:].view(num_blocks, stride)[:, :row_bytes]

    expected, actual = (dataclasses.replace(inputs.fresh_outputs(), k_cache=odd_cache()) for _ in range(2))
    assert (actual.k_cache.data_ptr() % 2, actual.k_cache.stride(0) % 2) == (byte_offset, stride_pad)
    dsv4_qnorm_rope_kv_insert_reference(*expected.args())
    dsv4_qnorm_rope_kv_insert_triton(*actual.args())
    comparison = compare_dsv4(expected, actual)
    assert comparison.q_mismatches == 0 and comparison.cache_mismatches == 0, f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)


@needs_triton
@needs_interpreter
def test_triton_interpreter_random_q_within_tolerance():
    """Unconstrained q (summation order now matters): q to the tolerance of
    test_oracle_matches_reference_on_random_q; the cache, with no sums, byte for byte."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(7, 16, 16, 64, "cpu", generator=generator)
    expected = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    actual = run(dsv4_qnorm_rope_kv_insert_triton, inputs)
    torch.testing.assert_close(
        actual.q_out.float(), expected.q_out.float(), rtol=2**-7, atol=2**-16, msg=lambda m: f"seed={seed}: {m}"
    )
    assert torch.equal(actual.k_cache, expected.k_cache), f"seed={seed}: {compare_dsv4(expected, actual)}"


# --------------------------------------------------------------------------------------
# The dispatcher
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens, num_heads, padded_heads, block_size, num_inserted",
    [(7, 3, 8, 16, None), (9, 16, 64, 64, 6), (0, 2, 8, 16, None)],
)
def test_dispatcher_on_cpu_is_the_reference(num_tokens, num_heads, padded_heads, block_size, num_inserted):
    """On CPU the dispatcher runs the reference: the same bytes, random q included."""
    inputs, seed = seeded_dsv4_inputs(
        num_tokens, num_heads, padded_heads, block_size, "cpu", exact_q=False, num_inserted=num_inserted
    )
    expected = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    actual = run(DSV4_QNORM_ROPE_KV_INSERT, inputs)
    assert torch.equal(bits(actual.q_out), bits(expected.q_out)), f"seed={seed}: {compare_dsv4(expected, actual)}"
    assert torch.equal(actual.k_cache, expected.k_cache), f"seed={seed}: {compare_dsv4(expected, actual)}"
    assert_untouched(actual, seed)


# --------------------------------------------------------------------------------------
# The CUDA kernel vs the reference on the same GPU
# --------------------------------------------------------------------------------------
def gpu_cases():
    """All padded head counts for small T; only FlashMLA's (64 if H <= 64 else 128) for T >= 1000;
    DeepSeek-V4.1's options at FlashMLA's padding."""
    for num_tokens in (1, 7, 64, 1000, 4096):
        for num_heads in (16, 128):
            padded = 64 if num_heads <= 64 else 128
            yield pytest.param(num_tokens, num_heads, padded, 64, V41, id=f"T{num_tokens}-H{num_heads}-v41")
    for num_tokens in (1, 7, 64, 1000, 4096):
        for num_heads in (1, 16, 64, 128):
            if num_tokens < 1000:
                padded = [hp for hp in (8, 16, 32, 64, 128) if hp >= num_heads]
            else:
                padded = [64 if num_heads <= 64 else 128]
            for padded_heads in padded:
                for block_size in (16, 64, 256):
                    yield pytest.param(
                        num_tokens, num_heads, padded_heads, block_size, {},
                        id=f"T{num_tokens}-H{num_heads}-HP{padded_heads}-bs{block_size}",
                    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_heads, padded_heads, block_size, options", list(gpu_cases()))
def test_cuda_kernel_matches_reference(num_tokens, num_heads, padded_heads, block_size, options):
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(num_tokens, num_heads, padded_heads, block_size, "cuda", generator=generator,
                              **options)
    expected = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    actual = run(DSV4_QNORM_ROPE_KV_INSERT, inputs)
    comparison = compare_dsv4(expected, actual)
    report = f"seed={seed}: {comparison}"
    # the bound: cache bytes identical except at most one fp8 code, so RoPE bf16 and scale bytes exact
    assert comparison.cache_non_fp8_mismatches == 0, report
    # the tolerance of test_oracle_matches_reference_on_random_q (one bf16 ULP, or 2^-16
    # where RoPE cancels to near zero) on every value ...
    torch.testing.assert_close(
        actual.q_out.float(), expected.q_out.float(), rtol=2**-7, atol=2**-16, msg=lambda m: f"{report}\n{m}"
    )
    assert_untouched(actual, seed)
    # ... and the bound's count: one bf16 ULP on a few q values per million
    assert comparison.within_spec(), report


# --------------------------------------------------------------------------------------
# Input checks: ValueError naming the argument, in eager and in the fake impl
# --------------------------------------------------------------------------------------
ARG_NAMES = ("q", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
             "wrap_indices", "apply_q_norm", "kv_mxfp8")


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view whose last dimension has stride 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def other_device(device: str) -> str:
    # 'meta' beside CPU tensors gives a clean ValueError; beside CUDA ones, a CPU tensor does
    return "meta" if device == "cpu" else "cpu"


# (id, the argument the message must name, the arguments to change)
BAD_INPUTS = [
    ("q-dtype", "q", lambda a: {"q": a["q"].float()}),
    ("kv-dtype", "kv", lambda a: {"kv": a["kv"].half()}),
    ("q_out-dtype", "q_out", lambda a: {"q_out": a["q_out"].float()}),
    ("k_cache-dtype", "k_cache", lambda a: {"k_cache": a["k_cache"].view(torch.int8)}),
    ("slot_mapping-dtype", "slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].short()}),
    ("positions-dtype", "positions", lambda a: {"positions": a["positions"].short()}),
    ("cos_sin_cache-dtype", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"].bfloat16()}),
    ("q-ndim", "q", lambda a: {"q": a["q"][0]}),
    ("kv-ndim", "kv", lambda a: {"kv": a["kv"][None]}),
    ("q_out-ndim", "q_out", lambda a: {"q_out": a["q_out"][:, 0]}),
    ("k_cache-ndim", "k_cache", lambda a: {"k_cache": a["k_cache"].flatten()}),
    ("slot_mapping-ndim", "slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"][:, None]}),
    ("positions-ndim", "positions", lambda a: {"positions": a["positions"][None]}),
    ("cos_sin_cache-ndim", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"].flatten()}),
    ("q-head-dim", "q", lambda a: {"q": a["q"][..., :256].contiguous()}),
    ("kv-head-dim", "kv", lambda a: {"kv": torch.cat((a["kv"], a["kv"]), dim=-1)}),
    ("q_out-head-dim", "q_out", lambda a: {"q_out": a["q_out"][..., :256].contiguous()}),
    ("kv-tokens", "kv", lambda a: {"kv": a["kv"][:-1]}),
    ("q_out-tokens", "q_out", lambda a: {"q_out": a["q_out"][:-1]}),
    ("positions-tokens", "positions", lambda a: {"positions": a["positions"][:-1]}),
    ("slot_mapping-longer-than-T", "slot_mapping",
     lambda a: {"slot_mapping": torch.cat((a["slot_mapping"], a["slot_mapping"].new_full((1,), -1)))}),
    ("q_out-fewer-heads", "q_out", lambda a: {"q_out": a["q_out"][:, : a["q"].shape[1] - 1]}),
    ("cos_sin_cache-narrow", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :32].contiguous()}),
    ("cos_sin_cache-wide", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"].repeat(1, 2)}),
    ("q-stride", "q", lambda a: {"q": strided_last_dim(a["q"])}),
    ("kv-stride", "kv", lambda a: {"kv": strided_last_dim(a["kv"])}),
    ("q_out-stride", "q_out", lambda a: {"q_out": strided_last_dim(a["q_out"])}),
    ("k_cache-stride", "k_cache", lambda a: {"k_cache": strided_last_dim(a["k_cache"])}),
    ("cos_sin_cache-stride", "cos_sin_cache", lambda a: {"cos_sin_cache": strided_last_dim(a["cos_sin_cache"])}),
    # the kernel reads slot t and position t at offset t: a strided view would be misread
    ("slot_mapping-stride", "slot_mapping", lambda a: {"slot_mapping": strided_last_dim(a["slot_mapping"])}),
    ("positions-stride", "positions", lambda a: {"positions": strided_last_dim(a["positions"])}),
    # stride(0) < block_size * 584, and a view whose stride is enough but whose rows are not
    ("k_cache-row-too-short", "k_cache",
     lambda a: {"k_cache": a["k_cache"][:, : a["block_size"] * 584 - 1].contiguous()}),
    ("k_cache-view-too-short", "k_cache", lambda a: {"k_cache": a["k_cache"][:, : a["block_size"] * 584 - 1]}),
    ("k_cache-block_size-too-big", "k_cache", lambda a: {"block_size": 4 * a["block_size"]}),
    # an MXFP8 record takes 528 bytes a slot
    ("k_cache-row-too-short-for-mxfp8", "k_cache",
     lambda a: {"kv_mxfp8": True, "k_cache": a["k_cache"][:, : a["block_size"] * 528 - 1]}),
    ("block_size-zero", "block_size", lambda a: {"block_size": 0}),
    ("block_size-negative", "block_size", lambda a: {"block_size": -16}),
    ("eps-negative", "eps", lambda a: {"eps": -1e-6}),
    ("eps-inf", "eps", lambda a: {"eps": float("inf")}),
    ("eps-past-fp32", "eps", lambda a: {"eps": 1e300}),  # a double the fp32 kernel would read as inf
    ("kv-device", "kv", lambda a: {"kv": a["kv"].to(other_device(a["kv"].device.type))}),
    ("cos_sin_cache-device", "cos_sin_cache",
     lambda a: {"cos_sin_cache": a["cos_sin_cache"].to(other_device(a["q"].device.type))}),
]

# Bad index values: seen only by reading them, so only in eager use.
BAD_INDEX_VALUES = [
    ("slot-past-the-cache", "slot_mapping",
     lambda a: {"slot_mapping": a["slot_mapping"].clone().fill_(a["k_cache"].shape[0] * a["block_size"])}),
    ("position-past-the-table", "positions",
     lambda a: {"positions": a["positions"].clone().fill_(a["cos_sin_cache"].shape[0])}),
    ("position-negative", "positions", lambda a: {"positions": a["positions"].clone().fill_(-1)}),
]


def good_args(device) -> dict:
    inputs = make_dsv4_inputs(5, 3, 8, 16, device)
    return dict(zip(ARG_NAMES, inputs.args()))


def bad_args(change, device) -> dict:
    return changed(good_args(device), change)


def call_fake(args: dict) -> None:
    call_with_fake_tensors(DSV4_QNORM_ROPE_KV_INSERT, args)


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS + BAD_INDEX_VALUES])
def test_bad_input_raises_in_eager(name, change):
    assert_rejected(DSV4_QNORM_ROPE_KV_INSERT, bad_args(change, DEVICE), name, fake=False)


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS])
def test_bad_input_raises_in_fake_impl(name, change):
    assert_rejected(DSV4_QNORM_ROPE_KV_INSERT, bad_args(change, "cpu"), name, fake=True)


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, _, c in BAD_INDEX_VALUES])
def test_fake_impl_does_not_read_index_values(change):
    call_fake(bad_args(change, "cpu"))  # index values are unknown under fake tensors: no error


def test_good_input_passes_fake_impl():
    call_fake(good_args("cpu"))


@pytest.mark.parametrize("name, change", [
    ("q", lambda a: {"q": None}),  # was AttributeError ('NoneType' has no attribute 'device')
    ("block_size", lambda a: {"block_size": True}),  # was taken as 1
])
def test_reference_refuses_a_missing_q_and_a_bool_block_size(name, change):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        dsv4_qnorm_rope_kv_insert_reference(*bad_args(change, "cpu").values())


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_only_call_with_no_q_heads(impl):
    """The call the pass emits for a kv side alone: q and q_out ``[T, 0, 512]``. The checks
    accept it, so every implementation runs it (the launcher had divided by
    next_power_of_2(0) == 0); the cache bytes are the reference's exactly."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_inputs(5, 3, 8, 16, "cpu", generator=generator)
    inputs = dataclasses.replace(inputs, q=inputs.q[:, :0].contiguous(), q_out=inputs.q_out[:, :0].contiguous())
    got = run(impl, to_device(inputs, DEVICE))
    want = run(dsv4_qnorm_rope_kv_insert_reference, inputs)
    assert got.q_out.shape == (5, 0, 512)
    assert torch.equal(got.k_cache.cpu(), want.k_cache), f"seed={seed}"
