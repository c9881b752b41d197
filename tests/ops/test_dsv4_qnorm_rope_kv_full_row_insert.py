"""Numerics and input checks of ``prepfuse::dsv4_qnorm_rope_kv_full_row_insert``.

Three implementations are held against each other:

- ``vllm_full_cache_math`` written here: the production kernel for full-row caches
  (``fusedDeepseekV4FullCacheKernel``, docs/ops.md) spelled out one token and head at a time in
  plain torch fp32, its clamp included (``fminf``/``fmaxf``, which drop a NaN); it shares no code
  with the op;
- the plain-PyTorch reference, ``dsv4_qnorm_rope_kv_full_row_insert_reference``;
- the Triton kernel, ``dsv4_qnorm_rope_kv_full_row_insert_triton``: under the CPU interpreter here,
  compiled on CUDA (through the dispatcher) in the ``gpu`` tests.

Every format is run (``FULL_ROW_FORMATS``: bf16 or e4m3 q_out, bf16 or e4m3 cache). Fresh random data
from a newly seeded generator, the seed in every message; outputs poisoned before each call. Bit-for-bit
comparisons of q use inputs whose RMS is exact in fp32 (``exact_rms_q``); the cache rows hold no sums,
so they are compared byte for byte everywhere, the GPU included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode
from prepfuse.ops import (
    DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT,
    dsv4_qnorm_rope_kv_full_row_insert_reference,
    dsv4_qnorm_rope_kv_full_row_insert_triton,
)
from prepfuse.testing import (
    CACHE_POISON, FULL_ROW_FORMATS, Dsv4FullRowInputs, call_with_fake_tensors, compare_dsv4_full_row,
    make_dsv4_full_row_inputs, seeded_dsv4_full_row_inputs, seeded_generator, to_device,
)
from tests.ops.bad_inputs import assert_rejected, changed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
FORMATS = list(FULL_ROW_FORMATS)

needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not triton_interpret_mode(),
    reason="CPU-interpreter parity; on CUDA, test_cuda_kernel_matches_reference covers the kernel",
)
IMPLS = [
    pytest.param(dsv4_qnorm_rope_kv_full_row_insert_reference, id="reference"),
    pytest.param(dsv4_qnorm_rope_kv_full_row_insert_triton, id="triton", marks=needs_triton),
]


def run(impl, inputs: Dsv4FullRowInputs) -> Dsv4FullRowInputs:
    """Call ``impl`` on fresh poisoned outputs and return them."""
    out = inputs.fresh_outputs()
    impl(*out.args())
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (bf16 and e4m3 alike; equality tells -0.0 from +0.0)."""
    return t.contiguous().view(torch.uint8)


def inserted_rows(inputs: Dsv4FullRowInputs) -> torch.Tensor:
    """True for the cache rows [NB, block_size] the op must write."""
    mask = torch.zeros(inputs.k_cache.shape[:2], dtype=torch.bool)
    for slot in inputs.slot_mapping.tolist():
        if slot >= 0:
            mask[divmod(slot, inputs.block_size)] = True
    return mask.to(inputs.k_cache.device)


def assert_untouched(out: Dsv4FullRowInputs, seed: int) -> None:
    """Padded heads are +0.0 (every byte 0); every byte of the cache's storage outside the
    inserted rows (rows not inserted, bytes between blocks) is still poison."""
    padded = raw(out.q_out[:, out.q.shape[1]:])
    assert bool((padded == 0).all()), f"seed={seed}: padded heads are not +0.0"
    cache = out.k_cache
    storage = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())
    written = torch.zeros_like(storage, dtype=torch.bool)
    size = cache.element_size()
    for slot in out.slot_mapping.tolist():
        if slot >= 0:
            block, row = divmod(slot, out.block_size)
            start = (cache.storage_offset() + block * cache.stride(0) + row * cache.stride(1)) * size
            written[start : start + 512 * size] = True
    assert bool((storage[~written] == CACHE_POISON).all()), f"seed={seed}: a cache byte outside the inserted rows was written"


# --------------------------------------------------------------------------------------
# The production kernel's math, spelled out
# --------------------------------------------------------------------------------------
def e4m3_as_written(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packFp8E4M3x16``: v * scale, then fminf(fmaxf(., -448), 448) (a NaN becomes -448),
    then the round-to-nearest-even convert."""
    scaled = v * scale
    return torch.fmin(torch.fmax(scaled, torch.tensor(-448.0)), torch.tensor(448.0)).to(FP8)


def vllm_full_cache_math(inputs: Dsv4FullRowInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_cache) as ``fusedDeepseekV4FullCacheKernel`` computes them, starting from the
    poisoned cache; padded heads (which that kernel has none of) zero."""
    q, kv, table = inputs.q.float(), inputs.kv.float(), inputs.cos_sin_cache
    num_tokens, num_heads, _ = q.shape
    q_out = torch.zeros(inputs.q_out.shape, dtype=inputs.q_out.dtype)
    cache = inputs.k_cache.clone()
    for t in range(num_tokens):
        pos = int(inputs.positions[t])
        cos, sin = table[pos, :32], table[pos, 32:]
        for slot in range(num_heads + 1):
            is_kv = slot == num_heads
            if is_kv and t >= inputs.slot_mapping.shape[0]:
                continue
            x = (kv[t] if is_kv else q[t, slot]).clone()
            if not is_kv:  # RMSNorm without weight, fp32, no rounding before the store
                rms_rcp = 1.0 / torch.sqrt((x * x).sum() / 512.0 + torch.tensor(inputs.eps, dtype=torch.float32))
                x = x * rms_rcp
            even, odd = x[448::2].clone(), x[449::2].clone()  # GPT-J pairs of the last 64 dims
            x[448::2] = even * cos - odd * sin
            x[449::2] = even * sin + odd * cos
            if not is_kv:
                q_out[t, slot] = x.to(torch.bfloat16) if q_out.dtype == torch.bfloat16 else \
                    e4m3_as_written(x, inputs.q_scale_inv.float().reshape(()))
                continue
            slot_id = int(inputs.slot_mapping[t])
            if slot_id < 0:
                continue
            block, row = divmod(slot_id, inputs.block_size)
            if cache.dtype == torch.bfloat16:
                cache[block, row] = x.to(torch.bfloat16)
            else:  # inv_scale = 1.0f / fp8_scale, then products
                cache[block, row] = e4m3_as_written(x, 1.0 / inputs.kv_scale.float().reshape(()))
    return q_out, cache


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens, num_heads, padded_heads, block_size, num_inserted",
                         [(7, 3, 3, 16, None), (5, 1, 8, 64, None), (6, 2, 16, 256, 3)])
def test_vllm_math_matches_reference_bytes(fmt, num_tokens, num_heads, padded_heads, block_size, num_inserted):
    inputs, seed = seeded_dsv4_full_row_inputs(num_tokens, num_heads, padded_heads, block_size, "cpu", fmt=fmt,
                                               num_inserted=num_inserted)
    expected_q, expected_cache = vllm_full_cache_math(inputs)
    out = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    assert torch.equal(raw(out.q_out), raw(expected_q)), f"seed={seed}: q_out differs from the production math"
    assert torch.equal(raw(out.k_cache), raw(expected_cache)), f"seed={seed}: k_cache differs from the production math"


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_math_matches_reference_on_random_q(fmt):
    """Unconstrained q: sums of squares depend on order, so q is compared to the DeepSeek-V4
    bound (one bf16 ULP or one e4m3 code, on few values); the cache byte for byte."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_full_row_inputs(7, 3, 8, 16, "cpu", fmt=fmt, generator=generator)
    expected_q, expected_cache = vllm_full_cache_math(inputs)
    out = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    comparison = compare_dsv4_full_row(dataclasses.replace(out, q_out=expected_q, k_cache=expected_cache), out)
    assert comparison.within_spec(), f"seed={seed}: {comparison}"


# --------------------------------------------------------------------------------------
# Hand-made cases: every implementation, on the kernel's device
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_cache_is_a_product_with_the_rounded_reciprocal(impl):
    """kv * fp32(1 / kv_scale), not kv / kv_scale: at kv_scale = 0.3 the bf16 value
    0.00439453125 gets another e4m3 code from each, and the op writes the product's."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_full_row_inputs(2, 1, 1, 16, "cpu", fmt="fp8", generator=generator, skip_fraction=0.0)
    kv_scale = torch.tensor([0.3])
    value = torch.tensor(0.00439453125)
    product, quotient = (v.clamp(-448, 448).to(FP8) for v in (value * torch.reciprocal(kv_scale), value / kv_scale))
    assert raw(product) != raw(quotient)
    kv = inputs.kv.clone()
    kv[0, 17] = value
    out = run(impl, to_device(dataclasses.replace(inputs, kv=kv, kv_scale=kv_scale), DEVICE))
    block, row = divmod(int(inputs.slot_mapping[0]), inputs.block_size)
    assert raw(out.k_cache[block, row, 17:18].cpu()) == raw(product), f"seed={seed}"


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_saturates_and_keeps_nan(impl):
    """Past +-448 (after the scale) an e4m3 code saturates, an infinity too; a NaN stays NaN
    (0x7F). The production kernel's clamp turns a NaN into -448 (docs/ops.md)."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_full_row_inputs(1, 1, 1, 16, "cpu", fmt="fp8", generator=generator, skip_fraction=0.0)
    kv = inputs.kv.clone()
    kv[0, :4] = torch.tensor([1e4, -1e4, float("-inf"), float("nan")])
    inputs = dataclasses.replace(inputs, kv=kv, kv_scale=torch.tensor([1.0]))
    out = run(impl, to_device(inputs, DEVICE))
    block, row = divmod(int(inputs.slot_mapping[0]), inputs.block_size)
    codes = raw(out.k_cache[block, row, :4].cpu())
    assert codes[:3].tolist() == [0x7E, 0xFE, 0xFE], f"seed={seed}"
    assert codes[3] & 0x7F == 0x7F, f"seed={seed}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_padded_heads_are_positive_zero_even_with_eps_zero(impl, fmt):
    inputs, seed = seeded_dsv4_full_row_inputs(3, 2, 8, 16, DEVICE, fmt=fmt, exact_q=False, eps=0.0)
    out = run(impl, inputs)
    assert bool((raw(out.q_out[:, 2:]) == 0).all()), f"seed={seed}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_writes_every_byte_of_inserted_rows_and_nothing_else(impl, fmt):
    """Two runs on different poisons agree on q_out and the inserted rows; every other cache
    byte (rows not inserted, skipped and DP-padded tokens, bytes between blocks) is its poison."""
    inputs, seed = seeded_dsv4_full_row_inputs(7, 3, 8, 16, DEVICE, fmt=fmt, num_inserted=5, skip_fraction=0.3,
                                               block_padding=24)
    first = run(impl, inputs)
    second = dataclasses.replace(inputs.fresh_outputs())
    raw_q, raw_cache = second.q_out.view(torch.uint8), second.k_cache.view(torch.uint8)
    raw_q.fill_(0x3C)
    raw_cache.fill_(0x5A)
    impl(*second.args())
    rows = inserted_rows(inputs)
    assert torch.equal(raw(first.q_out), raw(second.q_out)), f"seed={seed}: some of q_out was not written"
    assert torch.equal(raw(first.k_cache[rows]), raw(second.k_cache[rows])), f"seed={seed}: a row byte was not written"
    assert_untouched(first, seed)


# --------------------------------------------------------------------------------------
# The Triton kernel under the CPU interpreter vs the reference
# --------------------------------------------------------------------------------------
INTERPRETER_CASES = [
    # num_tokens, num_heads, padded_heads, block_size, make_dsv4_full_row_inputs options
    pytest.param(1, 1, 1, 16, {}, id="T1-H1-unpadded-bs16"),
    pytest.param(7, 3, 3, 16, {}, id="T7-H3-unpadded-bs16"),
    pytest.param(7, 3, 8, 64, {"block_padding": 40}, id="T7-H3-HP8-bs64-padded-blocks"),
    pytest.param(33, 2, 2, 256, {}, id="T33-H2-bs256"),
    pytest.param(1, 16, 64, 64, {}, id="T1-H16-HP64"),
    pytest.param(129, 3, 5, 16, {}, id="T129-H3-HP5"),
    pytest.param(7, 3, 3, 16, {"num_inserted": 4}, id="short-slot-mapping"),
    pytest.param(7, 3, 3, 16, {"skip_fraction": 1.0}, id="all-slots-negative"),
    pytest.param(0, 3, 3, 16, {}, id="T0"),
]


@needs_triton
@needs_interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens, num_heads, padded_heads, block_size, options", INTERPRETER_CASES)
def test_triton_interpreter_matches_reference(num_tokens, num_heads, padded_heads, block_size, options, fmt):
    inputs, seed = seeded_dsv4_full_row_inputs(num_tokens, num_heads, padded_heads, block_size, "cpu", fmt=fmt,
                                               **options)
    expected = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    actual = run(dsv4_qnorm_rope_kv_full_row_insert_triton, inputs)
    comparison = compare_dsv4_full_row(expected, actual)
    assert comparison.exact(), f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)


@pytest.mark.parametrize("launch_config", [(2, 1), (4, 2), (1, 2)], ids=lambda c: "/".join(map(str, c)))
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=[needs_triton, needs_interpreter]),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def test_kernel_at_other_launch_configs(device, launch_config):
    """Columns holding real and padded heads together, only padded ones, heads past HP."""
    inputs, seed = seeded_dsv4_full_row_inputs(5, 3, 6, 16, device, fmt="fp8")
    expected = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    actual = inputs.fresh_outputs()
    dsv4_qnorm_rope_kv_full_row_insert_triton(*actual.args(), launch_config=launch_config)
    assert compare_dsv4_full_row(expected, actual).exact(), f"seed={seed}"
    assert_untouched(actual, seed)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("impl", IMPLS)
def test_kv_only_call_with_no_q_heads(impl, fmt):
    """q and q_out ``[T, 0, 512]``: the cache rows alone, the reference's bytes."""
    generator, seed = seeded_generator()
    inputs = make_dsv4_full_row_inputs(5, 3, 3, 16, "cpu", fmt=fmt, generator=generator)
    inputs = dataclasses.replace(inputs, q=inputs.q[:, :0].contiguous(), q_out=inputs.q_out[:, :0].contiguous())
    got = run(impl, to_device(inputs, DEVICE))
    want = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    assert torch.equal(raw(got.k_cache.cpu()), raw(want.k_cache)), f"seed={seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatcher_on_cpu_is_the_reference(fmt):
    inputs, seed = seeded_dsv4_full_row_inputs(9, 4, 8, 16, "cpu", fmt=fmt, exact_q=False, num_inserted=6)
    expected = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    actual = run(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, inputs)
    assert compare_dsv4_full_row(expected, actual).exact(), f"seed={seed}"


# --------------------------------------------------------------------------------------
# The CUDA kernel vs the reference on the same GPU
# --------------------------------------------------------------------------------------
def gpu_cases():
    """vLLM's formats at DeepSeek-V4's shapes: unpadded q (vLLM's call) and padded to
    FlashInfer's 64 or 128 heads (what its sparse-MLA backend pads q to)."""
    for fmt in ("bf16", "fp8"):
        for num_tokens in (1, 7, 64, 1000, 4096):
            for num_heads in (1, 16, 64, 128):
                for padded_heads in sorted({num_heads, 64 if num_heads <= 64 else 128}):
                    for block_size in (16, 64, 256):
                        yield pytest.param(fmt, num_tokens, num_heads, padded_heads, block_size,
                                           id=f"{fmt}-T{num_tokens}-H{num_heads}-HP{padded_heads}-bs{block_size}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, num_tokens, num_heads, padded_heads, block_size", list(gpu_cases()))
def test_cuda_kernel_matches_reference(fmt, num_tokens, num_heads, padded_heads, block_size):
    generator, seed = seeded_generator()
    inputs = make_dsv4_full_row_inputs(num_tokens, num_heads, padded_heads, block_size, "cuda", fmt=fmt,
                                       generator=generator)
    expected = run(dsv4_qnorm_rope_kv_full_row_insert_reference, inputs)
    actual = run(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, inputs)
    comparison = compare_dsv4_full_row(expected, actual)
    assert comparison.within_spec(), f"seed={seed}: {comparison}"
    assert_untouched(actual, seed)


# --------------------------------------------------------------------------------------
# Input checks: ValueError naming the argument, in eager and in the fake impl
# --------------------------------------------------------------------------------------
ARG_NAMES = ("q", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "kv_scale", "q_scale_inv",
             "eps", "block_size")


def other_device(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


def as_bf16_cache(a: dict) -> torch.Tensor:
    return torch.empty(a["k_cache"].shape, dtype=torch.bfloat16, device=a["k_cache"].device)


# (id, the argument the message must name, the arguments to change); good args are fp8 (both scales given)
BAD_INPUTS = [
    ("q-dtype", "q", lambda a: {"q": a["q"].float()}),
    ("kv-dtype", "kv", lambda a: {"kv": a["kv"].half()}),
    ("q_out-dtype", "q_out", lambda a: {"q_out": a["q_out"].float()}),
    ("k_cache-dtype", "k_cache", lambda a: {"k_cache": a["k_cache"].view(torch.uint8)}),
    ("k_cache-ndim", "k_cache", lambda a: {"k_cache": a["k_cache"].flatten(1)}),
    ("k_cache-block-rows", "k_cache", lambda a: {"block_size": a["block_size"] * 2}),
    ("k_cache-head-dim", "k_cache", lambda a: {"k_cache": a["k_cache"][..., :256]}),
    ("k_cache-stride", "k_cache", lambda a: {"k_cache": a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)}),
    ("k_cache-rows-overlap", "k_cache", lambda a: {"k_cache": a["k_cache"].as_strided(
        a["k_cache"].shape, (a["k_cache"].stride(0), 256, 1))}),
    ("k_cache-device", "k_cache", lambda a: {"k_cache": a["k_cache"].to(other_device(a["q"].device.type))}),
    ("q-head-dim", "q", lambda a: {"q": a["q"][..., :256].contiguous()}),
    ("kv-tokens", "kv", lambda a: {"kv": a["kv"][:-1]}),
    ("q_out-fewer-heads", "q_out", lambda a: {"q_out": a["q_out"][:, : a["q"].shape[1] - 1]}),
    ("positions-tokens", "positions", lambda a: {"positions": a["positions"][:-1]}),
    ("slot_mapping-dtype", "slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].short()}),
    ("slot_mapping-longer-than-T", "slot_mapping",
     lambda a: {"slot_mapping": torch.cat((a["slot_mapping"], a["slot_mapping"].new_full((1,), -1)))}),
    ("cos_sin_cache-narrow", "cos_sin_cache", lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :32].contiguous()}),
    ("kv_scale-missing", "kv_scale", lambda a: {"kv_scale": None}),
    ("kv_scale-for-a-bf16-cache", "kv_scale", lambda a: {"k_cache": as_bf16_cache(a)}),
    ("kv_scale-dtype", "kv_scale", lambda a: {"kv_scale": a["kv_scale"].double()}),
    ("kv_scale-shape", "kv_scale", lambda a: {"kv_scale": a["kv_scale"].repeat(2)}),
    ("kv_scale-device", "kv_scale", lambda a: {"kv_scale": a["kv_scale"].to(other_device(a["q"].device.type))}),
    ("q_scale_inv-missing", "q_scale_inv", lambda a: {"q_scale_inv": None}),
    ("q_scale_inv-for-a-bf16-q_out", "q_scale_inv", lambda a: {"q_out": a["q_out"].bfloat16()}),
    ("q_scale_inv-2d", "q_scale_inv", lambda a: {"q_scale_inv": a["q_scale_inv"][None]}),
    ("block_size-zero", "block_size", lambda a: {"block_size": 0}),
    ("eps-negative", "eps", lambda a: {"eps": -1e-6}),
    ("kv-device", "kv", lambda a: {"kv": a["kv"].to(other_device(a["kv"].device.type))}),
]

BAD_INDEX_VALUES = [
    ("slot-past-the-cache", "slot_mapping",
     lambda a: {"slot_mapping": a["slot_mapping"].clone().fill_(a["k_cache"].shape[0] * a["block_size"])}),
    ("position-past-the-table", "positions",
     lambda a: {"positions": a["positions"].clone().fill_(a["cos_sin_cache"].shape[0])}),
]


def good_args(device) -> dict:
    return dict(zip(ARG_NAMES, make_dsv4_full_row_inputs(5, 3, 8, 16, device, fmt="fp8").args()))


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS + BAD_INDEX_VALUES])
def test_bad_input_raises_in_eager_with_nothing_written(name, change):
    args = changed(good_args(DEVICE), change)
    outputs = [t for t in (args["q_out"], args["k_cache"]) if t.device.type != "meta"]
    before = [raw(t).clone() for t in outputs]
    assert_rejected(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, args, name, fake=False)
    assert all(torch.equal(raw(t), b) for t, b in zip(outputs, before))


@pytest.mark.parametrize("name, change", [pytest.param(n, c, id=i) for i, n, c in BAD_INPUTS])
def test_bad_input_raises_in_fake_impl(name, change):
    assert_rejected(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, changed(good_args("cpu"), change), name, fake=True)


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, _, c in BAD_INDEX_VALUES])
def test_fake_impl_does_not_read_index_values(change):
    call_with_fake_tensors(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, changed(good_args("cpu"), change))


@pytest.mark.parametrize("fmt", FORMATS)
def test_good_input_passes_fake_impl(fmt):
    inputs = make_dsv4_full_row_inputs(5, 3, 8, 16, "cpu", fmt=fmt)
    call_with_fake_tensors(DSV4_QNORM_ROPE_KV_FULL_ROW_INSERT, dict(zip(ARG_NAMES, inputs.args())))
