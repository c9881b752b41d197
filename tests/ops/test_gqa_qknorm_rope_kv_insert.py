"""Numerics and input checks of ``prepfuse::gqa_qknorm_rope_kv_insert``.

Held against each other:

- an oracle written here: the math scalar by scalar in numpy float64 (rounding to bf16
  only where the op's contract rounds, and e4m3 by nearest-value search); it shares no
  code with the op and is compared to a stated tolerance;
- a transcription of the Hugging Face code (``Qwen3RMSNorm`` and ``apply_rotary_pos_emb``
  with an fp32 cos/sin table), which the reference must equal bit for bit;
- the plain-PyTorch reference, ``gqa_qknorm_rope_kv_insert_reference``;
- the Triton kernel, ``gqa_qknorm_rope_kv_insert_triton``: under the CPU interpreter here
  (bit for bit), compiled on CUDA in the ``gpu`` tests.

Every run draws fresh random data from a newly seeded generator; the seed is in every
assertion message. Outputs are poisoned before each call (q_out -123.0, every cache byte
0xA5), so a missed write and a stray write both show.

Bit-for-bit kernel comparisons use qkv whose per-head sums of squares are exact in fp32
(``exact_sum_qkv``): the kernel's and torch's summation orders then agree on the RMS.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prepfuse._compat import e4m3_cast_overflow, has_triton, triton_interpret_mode
from prepfuse.ops import (
    GQA_QKNORM_ROPE_KV_INSERT,
    gqa_qknorm_rope_kv_insert_reference,
    gqa_qknorm_rope_kv_insert_triton,
)
from prepfuse.ops import _duplicate_slots
from prepfuse.ops.gqa_qknorm_rope_kv_insert import split_qkv_columns, stride_unit
from tests.ops.bad_inputs import assert_rejected, changed
from prepfuse.testing import (
    CACHE_POISON, GqaInputs, call_with_fake_tensors, compare_gqa, make_gqa_inputs, normed_pair_sum, seeded_generator,
    seeded_gqa_inputs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn

needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not triton_interpret_mode(),
    reason="CPU-interpreter parity; on CUDA, test_cuda_kernel_matches_reference covers the kernel",
)


# The op's implementations, one parametrize axis (STYLE: no cloned tests per backend).
IMPLS = [
    pytest.param(gqa_qknorm_rope_kv_insert_reference, id="reference"),
    pytest.param(gqa_qknorm_rope_kv_insert_triton, id="triton", marks=needs_triton),
]


def run(impl, inputs: GqaInputs) -> GqaInputs:
    """Call ``impl`` on fresh poisoned outputs and return them."""
    out = inputs.fresh_outputs()
    impl(*out.args())
    return out


def written_slots(inputs: GqaInputs) -> torch.Tensor:
    """True for the cache rows [NB, BS] the op must write: the non-negative slots."""
    mask = torch.zeros(inputs.k_cache.shape[:2], dtype=torch.bool)
    block_size = inputs.k_cache.shape[1]
    for slot in inputs.slot_mapping.tolist():
        if slot >= 0:
            mask[divmod(slot, block_size)] = True
    return mask.to(inputs.k_cache.device)


def assert_untouched(out: GqaInputs, seed: int) -> None:
    """Every cache byte outside the inserted slots is still the poison."""
    untouched = ~written_slots(out)
    for name, cache in (("k_cache", out.k_cache), ("v_cache", out.v_cache)):
        rows = cache.view(torch.uint8)[untouched]
        assert bool((rows == CACHE_POISON).all()), (
            f"seed={seed}: {int((rows != CACHE_POISON).sum())} {name} bytes outside the inserted slots were written"
        )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)


def one_normed_ulp_bound(inputs: GqaInputs, which: str) -> torch.Tensor:
    """Per value of q (``which="q"``, [T, Hq, D]) or k ([T, Hkv, D]): how far a result may
    move when the summation order of mean(x^2) flips the normed input by one bf16 ULP.

    One ULP of a bf16 value is at most 2^-7 of it; RoPE's output for the pair (a, b) is
    a*cos -+ b*sin, so it moves by at most 2^-7 * (|a| + |b|), plus the rounding of the
    output (at most half an ULP of |a| + |b| more): 2^-6 * (|a| + |b|) in all, for the
    normed pair as the reference computes it. Pass-through dims have a = b. A fixed
    atol/rtol is wrong here: where a*cos and b*sin cancel, the result is tiny and the
    move is not (one GPU run failed a fixed 2^-5 atol on 1 of 72 parametrizations).
    """
    return 2**-6 * normed_pair_sum(inputs, which)


def assert_within_normed_ulp(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``actual`` (bf16 values, or fp8 values already scaled back) within ``bound`` of
    ``expected``; an fp8 store adds one e4m3 step of the value (2^-3 relative) and the
    subnormal quantum (2^-9, times the scale, passed in ``bound`` by the caller)."""
    diff = (actual.float() - expected.float()).abs()
    bad = diff > bound
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {bad.numel()} values beyond one normed ULP carried through RoPE; "
        f"worst {float((diff - bound).max()):.3g} over the bound"
    )


def inserted_rows(cache: torch.Tensor, inputs: GqaInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [n, Hkv, D] of ``cache`` at the non-negative slots, their token indices)."""
    slots = inputs.slot_mapping
    tokens = torch.nonzero(slots >= 0).flatten()
    block_size = cache.shape[1]
    keep = slots[tokens]
    rows = cache.view(torch.uint8)[keep // block_size, keep % block_size].view(cache.dtype)
    return rows, tokens


def assert_k_cache_within_normed_ulp(actual: GqaInputs, expected: GqaInputs, inputs: GqaInputs, report: str) -> None:
    bound = one_normed_ulp_bound(inputs, "k")
    (a, tokens), (e, _) = inserted_rows(actual.k_cache, inputs), inserted_rows(expected.k_cache, inputs)
    bound = bound[tokens]
    if a.dtype == FP8:
        scale = float(inputs.kv_scale.reshape(()))
        a, e = a.float() * scale, e.float() * scale
        # saturated values (|k / scale| >= 448) are 448 * scale on both sides
        bound = bound + 2**-3 * torch.maximum(a.abs(), e.abs()) + 2**-9 * scale
    assert_within_normed_ulp(a, e, bound, f"{report} k_cache")


# --------------------------------------------------------------------------------------
# The oracle: numpy float64, one head at a time
# --------------------------------------------------------------------------------------
E4M3_VALUES = np.array(
    [(c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]
)


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float64 values to bf16 (to nearest even, through fp32), returned as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def e4m3_nearest(x: np.ndarray) -> np.ndarray:
    """The e4m3fn value nearest to each of x (|x| <= 448), as float64 (ties unresolved:
    the comparison allows one code)."""
    idx = np.abs(np.abs(x)[..., None] - E4M3_VALUES).argmin(axis=-1)
    return np.sign(x) * E4M3_VALUES[idx]


def oracle(inputs: GqaInputs) -> tuple[np.ndarray, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """(q_out [T, Hq, D], {slot: (k row [Hkv, D], v row [Hkv, D])}) as float64 values."""
    hq, hkv, d = inputs.num_q_heads, inputs.num_kv_heads, inputs.head_dim
    qkv = inputs.qkv.double().numpy().reshape(-1, hq + 2 * hkv, d)
    cs = inputs.cos_sin_cache.double().numpy()
    half = cs.shape[1] // 2
    weights = [None if w is None else w.double().numpy() for w in (inputs.q_norm_weight, inputs.k_norm_weight)]
    pairs = [(i, i + half) for i in range(half)] if inputs.is_neox else [(2 * i, 2 * i + 1) for i in range(half)]

    def prep(x: np.ndarray, w, t: int) -> np.ndarray:
        if w is not None:
            # the contract's fp32 steps: mean(x^2) (exact here, see exact_sum_qkv), + eps,
            # correctly rounded sqrt, IEEE reciprocal, product rounded to fp32 then bf16
            f32 = np.float32
            rstd = f32(1) / np.sqrt(f32(f32(np.mean(x * x)) + f32(inputs.eps)))
            x = bf16(w * bf16(x.astype(f32) * rstd))
        out = x.copy()
        pos = int(inputs.positions[t])
        for i, (a, b) in enumerate(pairs):
            cos, sin = cs[pos, i], cs[pos, half + i]
            out[a] = x[a] * cos - x[b] * sin
            out[b] = x[b] * cos + x[a] * sin
        return bf16(out)

    def stored(x: np.ndarray) -> np.ndarray:
        if inputs.kv_scale is None:
            return x
        return e4m3_nearest(np.clip(x / float(inputs.kv_scale), -448, 448))

    q_out = np.stack([np.stack([prep(qkv[t, h], weights[0], t) for h in range(hq)]) for t in range(len(qkv))])
    rows = {}
    for t, slot in enumerate(inputs.slot_mapping.tolist()):
        if slot >= 0:
            k = np.stack([prep(qkv[t, hq + h], weights[1], t) for h in range(hkv)])
            rows[slot] = (stored(k), stored(qkv[t, hq + hkv :]))
    return q_out, rows


def cache_row(cache: torch.Tensor, slot: int) -> np.ndarray:
    block, row = divmod(slot, cache.shape[1])
    return cache[block, row].double().numpy()


def e4m3_codes_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many e4m3 codes apart two arrays of e4m3 values are."""
    index = {v: i for i, v in enumerate(E4M3_VALUES)}
    code = np.vectorize(lambda v: index[abs(v)] * (-1 if v < 0 else 1))
    return np.abs(code(a) - code(b))


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
def test_reference_matches_oracle(is_neox, cache_dtype, norm):
    """One bf16 ULP on q and k (rtol 2^-7; atol 2^-12 where RoPE cancels to near zero, as
    the oracle's float64 products are not rounded to fp32), v exact, fp8 within one code.
    Partial rotary (32 of 64); qkv from exact_sum_qkv, so mean(x^2) is exact in both."""
    inputs, seed = seeded_gqa_inputs(
        3, 3, 1, 64, 16, "cpu", rotary_dim=32, is_neox=is_neox, norm=norm, cache_dtype=cache_dtype,
        skip_fraction=0.3,
    )
    expected_q, expected_rows = oracle(inputs)
    out = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    msg = lambda m: f"seed={seed}: {m}"  # noqa: E731
    torch.testing.assert_close(out.q_out.double(), torch.from_numpy(expected_q), rtol=2**-7, atol=2**-12, msg=msg)
    for slot, (k, v) in expected_rows.items():
        k_got, v_got = cache_row(out.k_cache, slot), cache_row(out.v_cache, slot)
        if cache_dtype == FP8:
            assert int(e4m3_codes_apart(k_got, k).max()) <= 1, f"seed={seed}: k at slot {slot}"
            assert int(e4m3_codes_apart(v_got, v).max()) <= 1, f"seed={seed}: v at slot {slot}"
        else:
            torch.testing.assert_close(torch.from_numpy(k_got), torch.from_numpy(k), rtol=2**-7, atol=2**-12, msg=msg)
            np.testing.assert_array_equal(v_got, v, err_msg=f"seed={seed}: v at slot {slot}")
    assert_untouched(out, seed)


# --------------------------------------------------------------------------------------
# The Hugging Face code the FX pass will replace
# --------------------------------------------------------------------------------------
def hf_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward, verbatim."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb on [T, H, D] with partial rotary (x_rot, x_pass), cos/sin fp32."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = (x_rot * cos) + (hf_rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)


@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
def test_reference_is_hugging_face_with_fp32_rope(norm, rotary_dim):
    """Bit for bit: HF's RMSNorm as written, and HF's rotate-half RoPE evaluated in fp32
    on the bf16 normed q/k (the fp32 table; HF's bf16 cos/sin would round three times)."""
    inputs, seed = seeded_gqa_inputs(5, 4, 2, 128, 16, "cpu", rotary_dim=rotary_dim, norm=norm, exact_sum=False,
                              skip_fraction=0.0)
    out = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    hq, hkv = inputs.num_q_heads, inputs.num_kv_heads
    q, k, v = inputs.qkv.unflatten(1, (hq + 2 * hkv, 128)).split((hq, hkv, hkv), dim=1)
    if norm:
        q, k = hf_rms_norm(q, inputs.q_norm_weight, inputs.eps), hf_rms_norm(k, inputs.k_norm_weight, inputs.eps)
    cos, sin = inputs.cos_sin_cache[inputs.positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)
    q_hf = hf_apply_rope(q.float(), cos, sin).to(torch.bfloat16)
    k_hf = hf_apply_rope(k.float(), cos, sin).to(torch.bfloat16)
    assert torch.equal(bits(out.q_out), bits(q_hf)), f"seed={seed}"
    slots = inputs.slot_mapping
    block_size = inputs.k_cache.shape[1]
    assert torch.equal(bits(out.k_cache[slots // block_size, slots % block_size]), bits(k_hf)), f"seed={seed}"
    assert torch.equal(bits(out.v_cache[slots // block_size, slots % block_size]), bits(v)), f"seed={seed}"


def test_hugging_face_bf16_rope_differs_within_the_documented_bound():
    """HF in bf16 rounds cos/sin and both products to bf16; the op's fp32 RoPE differs from
    it by about one bf16 ULP of the inputs (documented: ~2^-7 * (|a| + |b|); checked at
    2^-6, as the bound is a measurement, not a proof)."""
    inputs, seed = seeded_gqa_inputs(64, 4, 2, 128, 16, "cpu", norm=False, exact_sum=False, skip_fraction=0.0)
    out = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    q = inputs.qkv.unflatten(1, (8, 128))[:, :4]
    cos, sin = inputs.cos_sin_cache[inputs.positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)
    q_hf = hf_apply_rope(q, cos.bfloat16(), sin.bfloat16())
    magnitude = q.float().abs() + hf_rotate_half(q).float().abs()
    excess = (out.q_out.float() - q_hf.float()).abs() - 2**-6 * magnitude
    assert float(excess.max()) <= 0, f"seed={seed}"
    assert not torch.equal(out.q_out, q_hf), f"seed={seed}: the two roundings were expected to differ"


# --------------------------------------------------------------------------------------
# Hand-made cases: every implementation, on the kernel's device
# --------------------------------------------------------------------------------------
def to_device(inputs: GqaInputs, device) -> GqaInputs:
    tensors = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return dataclasses.replace(inputs, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_store_divides_saturates_and_rounds_to_nearest_even(impl):
    """kv_scale 0.5 (shape []), so the stored value is 2v: +-448 saturation, e4m3
    subnormals and ties (to the even code) at both ends of the range."""
    generator, seed = seeded_generator()
    inputs = make_gqa_inputs(1, 1, 1, 64, 16, "cpu", generator=generator, cache_dtype=FP8, skip_fraction=0.0)
    qkv = inputs.qkv.clone()
    v = torch.zeros(64)
    # 2v:        500 -> 448   -1000 -> -448   2^-9: code 1   2^-10: tie 0|1 -> 0
    #            3*2^-10: tie 1|2 -> 2   17: tie 16|18 -> 16 (0x58|0x59 -> 0x58)
    v[:6] = torch.tensor([250.0, -500.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 8.5])
    qkv[0, 128:] = v.to(torch.bfloat16)
    # a 0-d scale here (make_gqa_inputs gives shape [1]): both shapes are accepted
    inputs = dataclasses.replace(inputs, qkv=qkv, kv_scale=torch.tensor(0.5))
    out = run(impl, to_device(inputs, DEVICE))
    slot = int(inputs.slot_mapping[0])
    block, row = divmod(slot, out.v_cache.shape[1])
    codes = out.v_cache[block, row, 0].view(torch.uint8).cpu()
    assert codes[:7].tolist() == [0x7E, 0xFE, 0x01, 0x00, 0x02, 0x58, 0x00], f"seed={seed}: {codes[:7].tolist()}"


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_store_without_saturation_gives_nan_past_448(impl):
    """``fp8_saturate=False`` (what a bare ``.to(float8_e4m3fn)`` does where torch's cast does
    not saturate: c10's fp8e4m3fn_from_fp32_value, torch 2.11 on CUDA): a value that rounds
    past 448 is the NaN code with its sign; 464, the tie between 448 and 480, goes to the
    even 448. kv_scale 0.5, so the stored value is 2v. Where torch's own cast on this device
    does not saturate, the codes are that cast's, byte for byte."""
    generator, seed = seeded_generator()
    inputs = make_gqa_inputs(1, 1, 1, 64, 16, "cpu", generator=generator, cache_dtype=FP8, skip_fraction=0.0)
    qkv = inputs.qkv.clone()
    two_v = torch.tensor([448.0, 460.0, 464.0, 466.0, 470.0, 480.0, 1e4, -466.0, float("inf"), -float("inf"),
                          -464.0, 2.0**-10, 17.0])
    expected = [0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0x7F, 0xFF, 0xFE, 0x00, 0x58]
    v = torch.zeros(64)
    v[:len(two_v)] = two_v / 2  # each exact in bf16
    qkv[0, 128:] = v.to(torch.bfloat16)
    inputs = dataclasses.replace(inputs, qkv=qkv, kv_scale=torch.tensor(0.5), fp8_saturate=False)
    out = run(impl, to_device(inputs, DEVICE))
    block, row = divmod(int(inputs.slot_mapping[0]), out.v_cache.shape[1])
    codes = out.v_cache[block, row, 0].view(torch.uint8).cpu()
    assert codes[:len(expected)].tolist() == expected, f"seed={seed}: {[hex(c) for c in codes.tolist()]}"
    if e4m3_cast_overflow(DEVICE) == "nan":
        torch_codes = two_v.to(DEVICE).to(FP8).view(torch.uint8).cpu()
        assert codes[:len(expected)].tolist() == torch_codes.tolist(), f"seed={seed}"
    # saturating (the default) on the same values: +-448 where the other gives NaN
    saturated = run(impl, to_device(dataclasses.replace(inputs, fp8_saturate=True), DEVICE))
    sat_codes = saturated.v_cache[block, row, 0].view(torch.uint8).cpu()
    assert sat_codes[:10].tolist() == [0x7E] * 7 + [0xFE, 0x7E, 0xFE], f"seed={seed}"


@pytest.mark.parametrize("impl", IMPLS)
def test_uint8_cache_holds_the_fp8_caches_bytes(impl):
    """vLLM allocates its "fp8" cache as uint8 and writes e4m3fn codes into it: the op takes
    such a cache and writes into it, byte for byte, what it writes into a float8_e4m3fn one
    (other bytes untouched), on each implementation (the kernel on CUDA)."""
    inputs, seed = seeded_gqa_inputs(9, 4, 2, 64, 16, "cpu", cache_dtype=FP8, exact_sum=False)
    inputs = to_device(inputs, DEVICE)
    as_fp8_cache = run(impl, inputs)
    as_bytes = inputs.fresh_outputs()
    as_bytes = dataclasses.replace(as_bytes, k_cache=as_bytes.k_cache.view(torch.uint8),
                                   v_cache=as_bytes.v_cache.view(torch.uint8))
    impl(*as_bytes.args())
    assert as_bytes.k_cache.dtype == torch.uint8
    assert torch.equal(bits(as_bytes.q_out), bits(as_fp8_cache.q_out)), f"seed={seed}"
    for name in ("k_cache", "v_cache"):
        assert torch.equal(getattr(as_bytes, name), getattr(as_fp8_cache, name).view(torch.uint8)), \
            f"seed={seed}: {name}"
    assert_untouched(as_bytes, seed)


@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("impl", IMPLS)
def test_rope_quarter_turn_moves_each_pair(impl, is_neox, rotary_dim):
    """cos=0, sin=1 maps each pair (a, b) to (-b, a), exactly; dims past R pass through."""
    generator, seed = seeded_generator()
    inputs = make_gqa_inputs(3, 2, 1, 64, 16, "cpu", generator=generator, rotary_dim=rotary_dim,
                             is_neox=is_neox, norm=False, skip_fraction=0.0)
    half = rotary_dim // 2
    cos_sin = torch.cat((torch.zeros(4, half), torch.ones(4, half)), dim=1)
    positions = torch.randint(0, 4, (3,), generator=generator)
    inputs = dataclasses.replace(inputs, cos_sin_cache=cos_sin, positions=positions)
    out = run(impl, to_device(inputs, DEVICE))
    x = inputs.qkv.unflatten(1, (4, 64)).cpu()
    if is_neox:
        a, b = slice(0, half), slice(half, rotary_dim)
    else:
        a, b = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    expected = x.clone()
    expected[..., a], expected[..., b] = -x[..., b], x[..., a]
    assert torch.equal(bits(out.q_out.cpu()), bits(expected[:, :2])), f"seed={seed}"
    slots = inputs.slot_mapping
    k = out.k_cache.cpu()[slots // 16, slots % 16]
    assert torch.equal(bits(k), bits(expected[:, 2:3])), f"seed={seed}"


# --------------------------------------------------------------------------------------
# The Triton kernel under the CPU interpreter vs the reference
# --------------------------------------------------------------------------------------
# (head_dim, rotary_dim): full rotary at 64 and 128, partial 64 of 128
HEAD_AND_ROTARY = [pytest.param(64, 64, id="D64"), pytest.param(128, 128, id="D128"),
                   pytest.param(128, 64, id="D128-R64")]


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim, rotary_dim", HEAD_AND_ROTARY)
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (3, 1)], ids=["Hq4-Hkv2", "Hq3-Hkv1"])
@pytest.mark.parametrize("num_tokens", [1, 5], ids=["T1", "T5"])
def test_triton_interpreter_matches_reference(
    num_tokens, num_q_heads, num_kv_heads, head_dim, rotary_dim, is_neox, cache_dtype, norm
):
    """Bit for bit (qkv from exact_sum_qkv); untouched cache bytes stay poisoned."""
    inputs, seed = seeded_gqa_inputs(
        num_tokens, num_q_heads, num_kv_heads, head_dim, 16, "cpu",
        rotary_dim=rotary_dim, is_neox=is_neox, norm=norm, cache_dtype=cache_dtype, skip_fraction=0.3,
    )
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run(gqa_qknorm_rope_kv_insert_triton, inputs)
    comparison = compare_gqa(expected, actual)
    assert comparison.exact(), f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"num_inserted": 3}, id="short-slot-mapping"),
        pytest.param({"skip_fraction": 1.0}, id="all-slots-negative"),
        pytest.param({"cache_dtype": FP8, "num_inserted": 0}, id="empty-slot-mapping"),
        pytest.param({"block_size": 1}, id="block-size-1"),
    ],
)
def test_triton_interpreter_partial_inserts(options):
    """Rows t >= T' and negative slots write nothing; the rest is bit for bit."""
    options = {"block_size": 16, **options}
    inputs, seed = seeded_gqa_inputs(7, 3, 1, 64, options.pop("block_size"), "cpu", **options)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run(gqa_qknorm_rope_kv_insert_triton, inputs)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"
    assert_untouched(actual, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("launch_config", [(1, 1), (2, 2), (4, 4), (2, 1, 2), (1, 2, 4), (4, 1, 8), (2, 2, 1, 48)],
                         ids=str)
@pytest.mark.parametrize("rope", [(64, True), (64, False), (32, True), (48, True)], ids=lambda r: f"R{r[0]}-{'neox' if r[1] else 'gptj'}")
def test_triton_interpreter_launch_configs(launch_config, rope):
    """Every heads-per-program and tokens-per-program choice (blocks with padding heads, a
    last program with tokens past T, more tokens a program than T) is bit for bit, on
    every rotation path (full NeoX, GPT-J pairs, partial, a rotary dim no power of two),
    with some rows' slots skipped and fewer rows inserted than tokens."""
    rotary_dim, is_neox = rope
    inputs, seed = seeded_gqa_inputs(5, 3, 1, 64, 16, "cpu", cache_dtype=FP8, rotary_dim=rotary_dim, is_neox=is_neox,
                                     num_inserted=4, skip_fraction=0.3)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*actual.args(), launch_config=launch_config)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"
    assert_untouched(actual, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("dedupe", ["off", "lock"])
@pytest.mark.parametrize("eviction", ["none", "loads", "stores", "both"])
def test_triton_interpreter_every_eviction_hint(eviction, dedupe):
    """A sweep's eviction override (``EVICTIONS``) reaches every row load and store of the k/v
    columns and of the locked kv program and changes no value: bit for bit, some slots
    skipped (the hints only order L2 evictions on a GPU)."""
    inputs, seed = seeded_gqa_inputs(5, 3, 1, 64, 16, "cpu", cache_dtype=FP8, num_inserted=4, skip_fraction=0.3)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*actual.args(), launch_config=(2, 1), dedupe=dedupe, eviction=eviction)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"
    assert_untouched(actual, seed)


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("tokens, launch_config, dedupe", [
    (1, (1, 1), "off"), (5, (2, 1), "off"), (5, (2, 1, 2), "off"), (5, (2, 1), "scan"), (5, (2, 1), "lock"),
], ids=["T1", "T5", "T5-two-token-tiles", "T5-scan", "T5-lock"])
def test_triton_interpreter_kv_first_order(tokens, launch_config, dedupe):
    """``kv_first`` (the decode floor's rows) only reorders each token's programs: bit for bit
    the reference with one token a program and two (a scan or a lock reads one), on every
    dedupe mode, some slots skipped, every lock released."""
    inputs, seed = seeded_gqa_inputs(tokens, 3, 2, 64, 16, "cpu", cache_dtype=FP8, skip_fraction=0.3)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*actual.args(), launch_config=launch_config, dedupe=dedupe, kv_first=True)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"
    assert_untouched(actual, seed)
    assert not _duplicate_slots.row_locks(actual.k_cache.device).any()


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("dedupe", ["off", "scan", "lock"])
@pytest.mark.parametrize("rope", [(256, True), (256, False), (128, True), (96, True)],
                         ids=lambda r: f"R{r[0]}-{'neox' if r[1] else 'gptj'}")
def test_triton_interpreter_kv_tiles_and_lock_steps(dedupe, rope):
    """k and v tiles hold the kv heads (KV_BLOCK), not the q tile's BLOCK_H rows, and under
    the row locks one program writes a token's slot in steps of KV_BLOCK heads, the first
    step's rows loaded before the branch on the slot and the lock: 6 q and 5 kv heads of
    256 on 4-row tiles (two k and two v columns, or two lock steps of 4, the second with 3
    masked rows), every dedupe mode and rotation path, some slots skipped, bit for bit,
    every lock released."""
    rotary_dim, is_neox = rope
    inputs, seed = seeded_gqa_inputs(3, 6, 5, 256, 16, "cpu", cache_dtype=FP8, rotary_dim=rotary_dim,
                                     is_neox=is_neox, skip_fraction=0.3)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*actual.args(), launch_config=(4, 1), dedupe=dedupe)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"
    assert_untouched(actual, seed)
    assert not _duplicate_slots.row_locks(actual.k_cache.device).any()


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("pad, unit", [(0, 16), (8, 8), (4, 4), (2, 2), (1, 1)], ids=lambda v: str(v))
def test_triton_interpreter_token_strides_in_units(pad, unit):
    """qkv's token stride reaches the kernel divided by ``stride_unit`` (so that rows of a
    16-byte aligned view vectorise) and is multiplied back in the kernel: every unit, down
    to an odd stride, reads the same rows, bit for bit."""
    inputs, seed = seeded_gqa_inputs(5, 4, 2, 64, 16, "cpu", cache_dtype=FP8)
    width = inputs.qkv.shape[1]
    wide = torch.zeros(inputs.qkv.shape[0], width + pad, dtype=inputs.qkv.dtype)
    wide[:, :width] = inputs.qkv
    inputs = dataclasses.replace(inputs, qkv=wide[:, :width])
    q, k, v = split_qkv_columns(inputs.qkv, 4, 2)
    assert stride_unit(q.stride(0), k.stride(0), v.stride(0)) == unit
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run(gqa_qknorm_rope_kv_insert_triton, inputs)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}, unit {unit}: {compare_gqa(expected, actual)}"


@needs_triton
@needs_interpreter
def test_triton_interpreter_random_qkv_within_tolerance():
    """Unconstrained qkv (summation order now matters): q to one bf16 ULP of the normed
    value carried through RoPE; v, which has no sums, byte for byte."""
    inputs, seed = seeded_gqa_inputs(5, 4, 2, 128, 16, "cpu", exact_sum=False)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run(gqa_qknorm_rope_kv_insert_triton, inputs)
    assert_within_normed_ulp(actual.q_out, expected.q_out, one_normed_ulp_bound(inputs, "q"), f"seed={seed}: q_out")
    assert torch.equal(bits(actual.v_cache), bits(expected.v_cache)), f"seed={seed}"


# --------------------------------------------------------------------------------------
# The dispatcher, and the CUDA kernel vs the reference on the same GPU
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_dispatcher_on_cpu_is_the_reference(cache_dtype):
    inputs, seed = seeded_gqa_inputs(7, 4, 2, 64, 16, "cpu", cache_dtype=cache_dtype, exact_sum=False)
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run(GQA_QKNORM_ROPE_KV_INSERT, inputs)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_cuda_kernel_matches_reference(num_tokens, head_dim, is_neox, cache_dtype, norm):
    """Qwen3-8B-like heads (32 q, 8 kv), partial rotary for D=256 (R=64, as in some GQA
    models). Without the norm there is no sum and the kernel must match bit for bit. With
    it, a one-ulp fp32 difference of the RMS (summation order) can move a normed value by
    one bf16 ULP, which RoPE then carries (absolute: up to 2^-6 on values of a few units);
    the caches' fp8 codes then by one."""
    rotary_dim = 64 if head_dim == 256 else head_dim
    inputs, seed = seeded_gqa_inputs(
        num_tokens, 32, 8, head_dim, 16, "cuda", rotary_dim=rotary_dim, is_neox=is_neox, norm=norm,
        cache_dtype=cache_dtype, exact_sum=False,
    )
    expected = run(gqa_qknorm_rope_kv_insert_reference, inputs)
    actual = run(GQA_QKNORM_ROPE_KV_INSERT, inputs)
    comparison = compare_gqa(expected, actual)
    report = f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)
    assert torch.equal(bits(actual.v_cache), bits(expected.v_cache)), report
    if not norm:
        assert comparison.exact(), report
        return
    assert_within_normed_ulp(actual.q_out, expected.q_out, one_normed_ulp_bound(inputs, "q"), f"{report} q_out")
    assert comparison.q_mismatches <= max(8, comparison.q_elements // 1000), report
    assert_k_cache_within_normed_ulp(actual, expected, inputs, report)


# --------------------------------------------------------------------------------------
# Input checks: ValueError naming the argument, in eager and in the fake impl
# --------------------------------------------------------------------------------------
ARG_NAMES = (
    "qkv", "q_norm_weight", "k_norm_weight", "q_out", "k_cache", "v_cache", "slot_mapping", "positions",
    "cos_sin_cache", "kv_scale", "num_q_heads", "num_kv_heads", "is_neox", "eps",
)


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view whose last dimension has stride 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def other_device(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


def as_fp8(a: dict) -> dict:
    """fp8 caches with a scale (the arguments of a valid fp8 call)."""
    shape, device = a["k_cache"].shape, a["qkv"].device
    return {
        "k_cache": torch.empty(shape, dtype=FP8, device=device),
        "v_cache": torch.empty(shape, dtype=FP8, device=device),
        "kv_scale": torch.ones(1, device=a["qkv"].device),
    }


def with_fp8(change):
    return lambda a: {**as_fp8(a), **change({**a, **as_fp8(a)})}


BAD_INPUTS = [
    ("qkv-dtype", "qkv", lambda a: {"qkv": a["qkv"].float()}),
    ("qkv-ndim", "qkv", lambda a: {"qkv": a["qkv"][None]}),
    ("qkv-stride", "qkv", lambda a: {"qkv": strided_last_dim(a["qkv"])}),
    ("qkv-width-not-divisible", "qkv", lambda a: {"qkv": a["qkv"][:, :-1]}),
    # 5 heads (3 + 2 * 1) of 96
    ("qkv-head-size-96", "qkv", lambda a: {"qkv": a["qkv"].new_zeros(a["qkv"].shape[0], 5 * 96)}),
    ("num_q_heads-zero", "num_q_heads", lambda a: {"num_q_heads": 0}),
    ("num_kv_heads-negative", "num_kv_heads", lambda a: {"num_kv_heads": -1}),
    ("q_norm_weight-missing", "q_norm_weight", lambda a: {"q_norm_weight": None}),
    ("k_norm_weight-missing", "k_norm_weight", lambda a: {"k_norm_weight": None}),
    ("q_norm_weight-dtype", "q_norm_weight", lambda a: {"q_norm_weight": a["q_norm_weight"].half()}),
    # fp32 weights are a mode of their own (Gemma-3), for both or neither
    ("k_norm_weight-dtype-differs", "k_norm_weight", lambda a: {"q_norm_weight": a["q_norm_weight"].float()}),
    ("k_norm_weight-shape", "k_norm_weight", lambda a: {"k_norm_weight": a["k_norm_weight"][:32].contiguous()}),
    ("q_out-dtype", "q_out", lambda a: {"q_out": a["q_out"].float()}),
    ("q_out-tokens", "q_out", lambda a: {"q_out": a["q_out"][:-1]}),
    ("q_out-heads", "q_out", lambda a: {"q_out": a["q_out"][:, :-1]}),
    ("q_out-stride", "q_out", lambda a: {"q_out": strided_last_dim(a["q_out"])}),
    ("k_cache-dtype", "k_cache", lambda a: {"k_cache": a["k_cache"].view(torch.int16)}),
    ("k_cache-ndim", "k_cache", lambda a: {"k_cache": a["k_cache"].flatten(0, 1)}),
    ("k_cache-heads", "k_cache", lambda a: {"k_cache": a["k_cache"].repeat(1, 1, 2, 1)}),
    ("k_cache-stride", "k_cache", lambda a: {"k_cache": strided_last_dim(a["k_cache"])}),
    ("v_cache-dtype", "v_cache", with_fp8(lambda a: {"v_cache": a["v_cache"].view(torch.uint8).view(torch.int8)})),
    ("v_cache-bf16-beside-fp8", "v_cache", with_fp8(lambda a: {"v_cache": torch.empty(a["v_cache"].shape,
                                                                                        dtype=torch.bfloat16)})),
    ("v_cache-blocks", "v_cache", lambda a: {"v_cache": a["v_cache"][:-1]}),
    ("slot_mapping-dtype", "slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].short()}),
    ("slot_mapping-longer-than-T", "slot_mapping",
     lambda a: {"slot_mapping": torch.cat((a["slot_mapping"], a["slot_mapping"].new_full((1,), -1)))}),
    ("slot_mapping-stride", "slot_mapping", lambda a: {"slot_mapping": strided_last_dim(a["slot_mapping"])}),
    ("positions-dtype", "positions", lambda a: {"positions": a["positions"].short()}),
    ("positions-tokens", "positions", lambda a: {"positions": a["positions"][:-1]}),
    ("cos_sin_cache-dtype", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"].bfloat16()}),
    ("cos_sin_cache-rotary-odd", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :63].contiguous()}),
    ("cos_sin_cache-rotary-over-D", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"].repeat(1, 2)}),
    ("kv_scale-with-bf16-cache", "kv_scale", lambda a: {"kv_scale": torch.ones(1, device=a["qkv"].device)}),
    ("kv_scale-missing-for-fp8", "kv_scale", with_fp8(lambda a: {"kv_scale": None})),
    ("kv_scale-missing-for-uint8-codes", "kv_scale", with_fp8(lambda a: {
        "k_cache": a["k_cache"].view(torch.uint8), "v_cache": a["v_cache"].view(torch.uint8), "kv_scale": None})),
    ("v_cache-uint8-beside-fp8", "v_cache", with_fp8(lambda a: {"v_cache": a["v_cache"].view(torch.uint8)})),
    ("kv_scale-dtype", "kv_scale", with_fp8(lambda a: {"kv_scale": a["kv_scale"].double()})),
    ("kv_scale-shape", "kv_scale", with_fp8(lambda a: {"kv_scale": torch.ones(2, device=a["qkv"].device)})),
    ("kv_scale-device", "kv_scale",
     with_fp8(lambda a: {"kv_scale": a["kv_scale"].to(other_device(a["qkv"].device.type))})),
    ("positions-device", "positions", lambda a: {"positions": a["positions"].to(other_device(a["qkv"].device.type))}),
    ("eps-negative", "eps", lambda a: {"eps": -1e-6}),
    ("eps-inf", "eps", lambda a: {"eps": float("inf")}),
    ("eps-past-fp32", "eps", lambda a: {"eps": 1e300}),  # a double the fp32 kernel would read as inf
    ("eps-nan", "eps", lambda a: {"eps": float("nan")}),
]

# Bad index values: seen only by reading them, so only in eager use.
BAD_INDEX_VALUES = [
    ("slot-past-the-cache", "slot_mapping",
     lambda a: {"slot_mapping": a["slot_mapping"].clone().fill_(a["k_cache"].shape[0] * a["k_cache"].shape[1])}),
    ("position-past-the-table", "positions",
     lambda a: {"positions": a["positions"].clone().fill_(a["cos_sin_cache"].shape[0])}),
    ("position-negative", "positions", lambda a: {"positions": a["positions"].clone().fill_(-1)}),
]


def good_args(device) -> dict:
    # 3 q heads, 1 kv head (3 + 2 * 1 = 5 heads of 64 = 320 wide), norm on, bf16 caches
    return dict(zip(ARG_NAMES, make_gqa_inputs(5, 3, 1, 64, 16, device).args()))


def bad_args(change, device) -> dict:
    return changed(good_args(device), change)


def call_fake(args: dict) -> None:
    call_with_fake_tensors(GQA_QKNORM_ROPE_KV_INSERT, args)


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS + BAD_INDEX_VALUES])
def test_bad_input_raises_in_eager(name, change):
    assert_rejected(GQA_QKNORM_ROPE_KV_INSERT, bad_args(change, DEVICE), name, fake=False)


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS])
def test_bad_input_raises_in_fake_impl(name, change):
    assert_rejected(GQA_QKNORM_ROPE_KV_INSERT, bad_args(change, "cpu"), name, fake=True)


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, _, c in BAD_INDEX_VALUES])
def test_fake_impl_does_not_read_index_values(change):
    call_fake(bad_args(change, "cpu"))


@pytest.mark.parametrize("cache", ["bf16", "fp8", "uint8"])
def test_good_input_passes_fake_impl(cache):
    args = good_args("cpu")
    if cache != "bf16":
        args.update(as_fp8(args))
    if cache == "uint8":  # vLLM's "fp8" cache: e4m3fn codes held as bytes
        args.update(k_cache=args["k_cache"].view(torch.uint8), v_cache=args["v_cache"].view(torch.uint8))
    call_fake(args)


@needs_triton
def test_launch_table():
    """The H200 sweeps' choices (docs/ops.md): one head a program at decode, else about 2048
    values; without the row locks four warps (k and v programs apart, their tiles sized by
    the kv heads); under them at most 16 heads, a warp per 1024 values with the norm, per
    512 without."""
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import _launch_config

    assert _launch_config(1, 128, 32) == (1, 1, 1)
    assert _launch_config(64, 128, 32, locked=False) == (16, 4, 1)
    assert _launch_config(512, 128, 32, has_norm=True, locked=False) == (16, 4, 1)
    assert _launch_config(512, 64, 32, has_norm=False, locked=False) == (32, 4, 1)
    # a register cap where it measured faster: D 128 with the norm, D 256 with an fp8 cache;
    # not the full-width cos/sin forms (spills), not without the lock's launch
    assert _launch_config(16384, 128, 32, has_norm=True, locked=True) == (16, 2, 1, 56)
    assert _launch_config(16384, 128, 32, has_norm=True, locked=True, full_cos_sin=True) == (16, 2, 1)
    assert _launch_config(16384, 256, 16, has_norm=True, locked=True, cache_fp8=True) == (8, 2, 1, 56)
    assert _launch_config(512, 128, 32, has_norm=True, locked=False, cache_fp8=True) == (16, 4, 1)
    assert _launch_config(16384, 128, 32, has_norm=False, locked=True) == (16, 4, 1)
    assert _launch_config(16384, 64, 32, has_norm=False, locked=True) == (16, 2, 1)
    assert _launch_config(16384, 256, 16, has_norm=True, locked=True) == (8, 2, 1)
    assert _launch_config(16384, 256, 4) == (4, 1, 1)  # capped at the heads there are: 1024 values


@needs_triton
def test_row_eviction_rule():
    """Rows and outputs marked first to leave L2 on the locked launch without the norm only:
    the H200 A/B (2026-12-04) found that faster at T=4096 and 16384 without
    the norm and slower at T=16384 with it; the pages found it slower at T=512 (scanned)."""
    from prepfuse.ops.gqa_qknorm_rope_kv_insert import EVICTIONS, _row_eviction

    assert _row_eviction(has_norm=False, locked=True) == ("evict_first", "evict_first") == EVICTIONS["both"]
    for has_norm, locked in ((True, True), (True, False), (False, False)):
        assert _row_eviction(has_norm=has_norm, locked=locked) == ("", "") == EVICTIONS["none"]
