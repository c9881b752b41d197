"""NaN and infinity in, every op and every implementation: one behaviour (``docs/ops.md``,
"Non-finite inputs"), the same on the reference and the kernel.

NaN in gives NaN out wherever the output format has a NaN. bf16 outputs follow IEEE
arithmetic as the math is written (a NaN in a head normalises the whole head to NaN). A
per-tensor-scaled e4m3 value (the GQA fp8 cache) is ``clamp(x / scale, -448, 448)`` as the
models write it: NaN stays NaN, an infinity saturates to +-448. A power-of-two-scaled block
(DeepSeek-V4's UE8M0 blocks of 64, the indexer's fp8 rows of 128 and MXFP4 blocks of 32)
has no scale for a NaN or an infinity: a block holding one is NaN, its scale NaN (UE8M0
byte 0xFF, fp32 NaN) and every code NaN (e4m3 0x7F); e2m1 has no NaN, so its nibbles are 0
(read as NaN through the 0xFF scale, and 0 * 2^128 is NaN too for a reader that does not
test the scale). NaN payloads and the sign of an e4m3 NaN are not specified: outputs are
compared with every NaN made one pattern. The normalised inputs have sums of squares
that are exact in fp32 (``seeded_dsv4_inputs``, ``seeded_gqa_inputs``), so that a summation order
cannot move a finite value and the comparison is exact.

The kernels run here under the CPU interpreter (on CUDA: the kernel itself).
"""

from __future__ import annotations

import pytest
import torch

from prepfuse._compat import has_triton
from prepfuse.ops.dsv4_qnorm_rope_kv_insert import CACHE_ROW_BYTES, NOPE_DIM, SCALE_BYTES
from prepfuse.testing import (
    FULL_ROW_FORMATS, make_dsv4_indexer_inputs, seeded_dsv4_full_row_inputs, seeded_dsv4_inputs, seeded_generator,
    seeded_gqa_inputs,
)
from prepfuse.testing.impls import IMPLS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
FP8 = torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------
# NaN-blind views of the outputs: every NaN one bit pattern, everything else as is
# --------------------------------------------------------------------------------------
def float_bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits (int), every NaN as one pattern (-1)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype]
    return torch.where(t.isnan(), -1, t.contiguous().view(ints).to(torch.int32))


def e4m3_bytes(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn code bytes (uint8), both NaN codes (0x7F, 0xFF) as 0x7F."""
    return torch.where((b & 0x7F) == 0x7F, 0x7F, b.to(torch.int32))


def is_e4m3_nan(b: torch.Tensor) -> torch.Tensor:
    return (b & 0x7F) == 0x7F


def dsv4_views(inputs) -> dict[str, torch.Tensor]:
    bs = inputs.block_size
    blocks = inputs.k_cache[:, : bs * CACHE_ROW_BYTES].unflatten(1, (bs, CACHE_ROW_BYTES))
    return {
        "q_out": float_bits(inputs.q_out),
        "codes": e4m3_bytes(blocks[..., :NOPE_DIM]),
        "rope": float_bits(blocks[..., NOPE_DIM:].contiguous().view(torch.bfloat16)),
        "scales and padding": inputs.k_cache[:, bs * CACHE_ROW_BYTES :],
    }


def row_values(t: torch.Tensor) -> torch.Tensor:
    """bf16 bits or e4m3 bytes, NaN-blind."""
    return e4m3_bytes(t.view(torch.uint8)) if t.dtype == FP8 else float_bits(t)


def dsv4_full_row_views(inputs) -> dict[str, torch.Tensor]:
    return {"q_out": row_values(inputs.q_out), "k_cache": row_values(inputs.k_cache)}


def gqa_views(inputs) -> dict[str, torch.Tensor]:
    views = {"q_out": float_bits(inputs.q_out)}
    for name in ("k_cache", "v_cache"):
        cache = getattr(inputs, name)
        views[name] = e4m3_bytes(cache.view(torch.uint8)) if cache.dtype == FP8 else float_bits(cache)
    return views


def indexer_views(inputs) -> dict[str, torch.Tensor]:
    bs, width = inputs.block_size, inputs.slot_bytes - 4
    cache = inputs.k_cache
    views = {"weights_out": float_bits(inputs.weights_out), "padding": cache[:, bs * (width + 4) :]}
    if inputs.fmt == "fp8":
        views["q_out"] = e4m3_bytes(inputs.q_out.view(torch.uint8))
        views["codes"] = e4m3_bytes(cache[:, : bs * width])
        views["scales"] = float_bits(cache[:, bs * width : bs * (width + 4)].contiguous().view(torch.float32))
    else:  # no NaN codes: every byte as it is
        views["q_out"], views["q_scale"] = inputs.q_out, inputs.q_scale
        views["cache"] = cache[:, : bs * (width + 4)]
    return views


def run_both(op: str, inputs):
    reference, kernel = IMPLS[op]
    expected, actual = inputs.fresh_outputs(), inputs.fresh_outputs()
    reference(*expected.args())
    kernel(*actual.args())
    return expected, actual


def assert_same(views, expected, actual, seed):
    a, b = views(expected), views(actual)
    for name in a:
        differ = (a[name] != b[name]).nonzero()
        assert differ.numel() == 0, f"seed={seed}: {name}: reference and kernel differ at {differ[:8].tolist()}"


def slot_of(inputs, token: int) -> tuple[int, int]:
    """(block, row) that token's slot names."""
    slot = int(inputs.slot_mapping[token])
    assert slot >= 0
    bs = inputs.block_size if hasattr(inputs, "block_size") else inputs.k_cache.shape[1]
    return divmod(slot, bs)


# --------------------------------------------------------------------------------------
# DeepSeek-V4 MLA prep: q heads in bf16, kv as UE8M0 e4m3 blocks of 64 and bf16 RoPE dims
# --------------------------------------------------------------------------------------
def test_dsv4():
    inputs, seed = seeded_dsv4_inputs(6, 3, 4, 16, DEVICE, skip_fraction=0.0)
    kv, q = inputs.kv, inputs.q
    kv[0, 5] = NAN  # NoPE block 0
    kv[1, 64 + 9] = INF  # NoPE block 1
    kv[2, 6 * 64 + 1] = -INF  # NoPE block 6
    kv[3, NOPE_DIM + 10] = NAN  # a RoPE dim: bf16 keeps it
    q[0, 1, 7] = NAN
    q[1, 2, 500] = INF
    expected, actual = run_both("dsv4", inputs)
    assert_same(dsv4_views, expected, actual, seed)

    bs = inputs.block_size
    for token, block in ((0, 0), (1, 1), (2, 6)):
        blk, row = slot_of(inputs, token)
        data = expected.k_cache[blk, row * CACHE_ROW_BYTES : row * CACHE_ROW_BYTES + NOPE_DIM].unflatten(0, (7, 64))
        scales = expected.k_cache[blk, bs * CACHE_ROW_BYTES + row * SCALE_BYTES :][:7]
        assert scales[block] == 0xFF, f"token {token}: scale byte of block {block} is {int(scales[block])}, not 0xFF"
        assert is_e4m3_nan(data[block]).all(), f"token {token}: block {block} holds codes that are not NaN"
        others = [b for b in range(7) if b != block]
        assert (scales[others] != 0xFF).all() and not is_e4m3_nan(data[others]).any(), f"token {token}: NaN spread"
    blk, row = slot_of(inputs, 3)
    rope = expected.k_cache[blk, row * CACHE_ROW_BYTES + NOPE_DIM : (row + 1) * CACHE_ROW_BYTES].view(torch.bfloat16)
    assert rope[10].isnan() and rope.isnan().sum() == 2, "RoPE dims: a NaN is in its rotated pair, nowhere else"
    assert expected.q_out[0, 1].isnan().all() and not expected.q_out[0, 0].isnan().any()
    assert expected.q_out[1, 2].isnan().any() and not expected.q_out[1, 2].isinf().any()


# --------------------------------------------------------------------------------------
# DeepSeek-V4 full-row caches: bf16 follows IEEE; e4m3 with a per-tensor scale clamps
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(FULL_ROW_FORMATS))
def test_dsv4_full_row(fmt):
    inputs, seed = seeded_dsv4_full_row_inputs(6, 3, 4, 16, DEVICE, fmt=fmt, skip_fraction=0.0)
    kv, q = inputs.kv, inputs.q
    kv[0, 5] = NAN
    kv[1, 9] = INF
    kv[2, 100] = -INF
    kv[3, NOPE_DIM + 10] = NAN  # a RoPE dim: NaN in its rotated pair
    q[0, 1, 7] = NAN
    expected, actual = run_both("dsv4-full-row", inputs)
    assert_same(dsv4_full_row_views, expected, actual, seed)

    def at(token, dim):
        blk, row = slot_of(inputs, token)
        value = expected.k_cache[blk, row, dim]
        return int(value.view(torch.uint8)) if value.dtype == FP8 else float(value)

    if expected.k_cache.dtype == FP8:  # NaN stays NaN (vLLM's clamp would store -448), infinities saturate
        assert at(0, 5) & 0x7F == 0x7F and (at(1, 9), at(2, 100)) == (0x7E, 0xFE)
        rope = row_values(expected.k_cache[slot_of(inputs, 3)][NOPE_DIM:]) == 0x7F
    else:
        assert at(0, 5) != at(0, 5) and (at(1, 9), at(2, 100)) == (INF, -INF)
        rope = expected.k_cache[slot_of(inputs, 3)][NOPE_DIM:].isnan()
    assert rope[10] and rope.sum() == 2, "RoPE dims: a NaN is in its rotated pair, nowhere else"
    head_nan = row_values(expected.q_out[0, 1]) == (0x7F if expected.q_out.dtype == FP8 else -1)
    assert head_nan.all() and not (row_values(expected.q_out[0, 0]) == row_values(expected.q_out[0, 1])).all()


# --------------------------------------------------------------------------------------
# GQA: bf16 q and caches follow IEEE; an fp8 cache clamps as the models write it
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_gqa(cache_dtype):
    inputs, seed = seeded_gqa_inputs(6, 4, 2, 64, 16, DEVICE, cache_dtype=cache_dtype, skip_fraction=0.0)
    heads = inputs.qkv.unflatten(1, (8, 64))  # q heads 0..3, k heads 4..5, v heads 6..7
    heads[0, 6, 3] = NAN
    heads[1, 7, 4] = INF
    heads[2, 6, 5] = -INF
    heads[3, 4, 6] = NAN  # a k head
    heads[4, 0, 7] = INF  # a q head
    expected, actual = run_both("gqa", inputs)
    assert_same(gqa_views, expected, actual, seed)

    def v_at(token, head, dim):
        blk, row = slot_of(inputs, token)
        return expected.v_cache[blk, row, head, dim]

    if cache_dtype == FP8:
        codes = [int(v_at(t, h, d).view(torch.uint8)) for t, h, d in ((0, 0, 3), (1, 1, 4), (2, 0, 5))]
        assert (codes[0] & 0x7F) == 0x7F, f"v NaN stored as code {codes[0]:#x}, not NaN"
        assert codes[1:] == [0x7E, 0xFE], f"v +-inf stored as codes {codes[1:]}, not +-448 (0x7e, 0xfe)"
    else:
        assert v_at(0, 0, 3).isnan() and v_at(1, 1, 4) == INF and v_at(2, 0, 5) == -INF
    blk, row = slot_of(inputs, 3)
    k_head = expected.k_cache[blk, row, 0].float()
    assert k_head.isnan().all(), "a NaN in a k head normalises the whole head to NaN"
    assert expected.q_out[4, 0].isnan().any() and not expected.q_out[4, 1].isnan().any()


# --------------------------------------------------------------------------------------
# DeepSeek-V4 indexer: fp8 rows of 128 (scale 2^e, fp32) and MXFP4 blocks of 32 (UE8M0)
# --------------------------------------------------------------------------------------
def test_indexer_fp8():
    generator, seed = seeded_generator()
    inputs = make_dsv4_indexer_inputs("fp8", 6, 3, 16, DEVICE, num_k=6, skip_fraction=0.0, generator=generator)
    inputs.q[0, 1, 3] = NAN
    inputs.q[1, 2, 100] = INF
    inputs.k[0, 5] = NAN
    inputs.k[1, 70] = -INF
    expected, actual = run_both("indexer-fp8", inputs)
    assert_same(indexer_views, expected, actual, seed)

    q_codes = expected.q_out.view(torch.uint8)
    for token, head in ((0, 1), (1, 2)):
        assert is_e4m3_nan(q_codes[token, head]).all(), f"q token {token} head {head}: codes not all NaN"
        assert expected.weights_out[token, head].isnan(), "the head's NaN scale is folded into its weight"
        assert not is_e4m3_nan(q_codes[token, 0]).any() and not expected.weights_out[token, 0].isnan()
    bs = inputs.block_size
    for token in (0, 1):
        blk, row = slot_of(inputs, token)
        assert is_e4m3_nan(expected.k_cache[blk, row * 128 : (row + 1) * 128]).all()
        scale = expected.k_cache[blk, bs * 128 + row * 4 : bs * 128 + (row + 1) * 4].view(torch.float32)
        assert scale.isnan().all(), f"k row {token}: scale {float(scale)} is not NaN"


def test_indexer_mxfp4():
    generator, seed = seeded_generator()
    inputs = make_dsv4_indexer_inputs("mxfp4", 6, 3, 16, DEVICE, num_k=6, skip_fraction=0.0, generator=generator)
    inputs.q[0, 1, 3] = NAN  # block 0
    inputs.q[1, 2, 100] = INF  # block 3 (a RoPE dim)
    inputs.k[0, 40] = NAN  # block 1
    inputs.k[1, 70] = -INF  # block 2
    expected, actual = run_both("indexer-mxfp4", inputs)
    assert_same(indexer_views, expected, actual, seed)

    def check_block(packed, scales, block, where):
        assert scales[block] == 0xFF, f"{where}: scale byte of block {block} is {int(scales[block])}, not 0xFF"
        assert (packed[16 * block : 16 * (block + 1)] == 0).all(), f"{where}: block {block}'s nibbles are not 0"
        others = [b for b in range(4) if b != block]
        assert (scales[others] != 0xFF).all(), f"{where}: NaN spread to other blocks"

    check_block(expected.q_out[0, 1], expected.q_scale[0, 1], 0, "q token 0 head 1")
    check_block(expected.q_out[1, 2], expected.q_scale[1, 2], 3, "q token 1 head 2")
    assert not expected.weights_out.isnan().any(), "MXFP4 scales travel with q, not in the weights"
    bs = inputs.block_size
    for token, block in ((0, 1), (1, 2)):
        blk, row = slot_of(inputs, token)
        packed = expected.k_cache[blk, row * 64 : (row + 1) * 64]
        scales = expected.k_cache[blk, bs * 64 + row * 4 : bs * 64 + (row + 1) * 4]
        check_block(packed, scales, block, f"k row {token}")
