"""DeepSeek-V4 attention-input preparation, unfused, as model authors write it.

The math is the op's (``prepfuse/ops/dsv4_qnorm_rope_kv_insert.py``), written out in plain
PyTorch the way it appears in model files. A spelling is a row of a table
(:class:`Dsv4Spelling`), not a copied class:

==========  ============================================================================
axis        choices
==========  ============================================================================
norm        ``pow_mean``: ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``
            ``mul_mean``: ``x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)``
            ``rms_norm``: ``F.rms_norm(x, (512,), eps=eps)``
            ``sqrt_recip``: ``x * torch.sqrt(x.square().mean(-1, keepdim=True) + eps).reciprocal()``
            ``div_sqrt``: ``x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)``
split       ``slice``: ``x[..., :448]``, ``x[..., 448:]``; ``split``: ``x.split([448, 64], -1)``
rope        ``strided``: ``x[..., ::2]``, ``x[..., 1::2]`` then ``torch.stack(.., -1).flatten(-2)``
            ``complex``: ``view_as_complex(x.float().unflatten(-1, (-1, 2))) * complex(cos, sin)``
pad         ``pad``: ``F.pad(q, (0, 0, 0, HP - H))``; ``new_zeros``: ``q.new_zeros(T, HP, 512)``,
            then ``out[:, :H] = q``
exp2        ``exp2``: ``torch.exp2(-e)``; ``pow``: ``torch.pow(2.0, -e)``
write       ``view``: ``cache[:, :bs*576].view(NB, bs, 576)[s // bs, s % bs] = rows``
            ``columns``: ``cache[(s // bs)[:, None], (s % bs)[:, None] * 576 + arange(576)] = rows``
==========  ============================================================================

Every spelling in :data:`DSV4_SPELLINGS` computes, on valid inputs, the op's reference: the cache
bytes identically, q but for about one value per million one bf16 ULP off (the reference's
``1 / sqrt`` is correctly rounded, ``torch.rsqrt`` and the CPU's fp32 ``torch.sqrt`` sometimes one
fp32 ULP off it: the DeepSeek-V4 bound, docs/design.md). :data:`DSV4_LOOKALIKES` look the same but
compute something else (eps after the sqrt, a missing rsqrt, NeoX RoPE, 128-wide quant blocks, a
row at another pitch, fp16); ``cache_row_offset_by_one`` stays among them as code a reader of slot
indices could misread, though it fuses. A negative slot wraps as in eager indexing (the pass emits
``wrap_indices=True``), so a rewrite equals the code for every slot the code accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prepfuse.ops.dsv4_qnorm_rope_kv_insert import (
    AMAX_FLOOR, CACHE_ROW_BYTES, FP8_MAX, HEAD_DIM, MXFP8_BLOCK, MXFP8_SCALES, MXFP8_SLOT_BYTES, NOPE_DIM, ROPE_DIM,
    SCALE_BYTES, unchecked_reference,
)

_NORMS = ("pow_mean", "mul_mean", "rms_norm", "sqrt_recip", "eps_after_sqrt", "no_rsqrt", "div_sqrt")
_SPLITS = ("slice", "split")
_ROPES = ("strided", "complex", "neox")
_PADS = ("pad", "new_zeros")
_EXP2S = ("exp2", "pow")
_WRITES = ("view", "columns", "columns_next_row")  # the last: a look-alike


@dataclass(frozen=True)
class Dsv4Spelling:
    """One way of writing the DeepSeek-V4 preparation (see the module docstring's table)."""

    name: str
    norm: str = "pow_mean"
    split: str = "slice"
    rope: str = "strided"
    pad: str = "pad"
    exp2: str = "exp2"
    write: str = "view"
    quant_block: int = 64  # look-alike: 128
    cache_row_bytes: int = CACHE_ROW_BYTES  # look-alike: rows padded to another size
    dtype: torch.dtype = torch.bfloat16  # look-alike: float16

    def __post_init__(self) -> None:
        for axis, allowed in (("norm", _NORMS), ("split", _SPLITS), ("rope", _ROPES), ("pad", _PADS), ("exp2", _EXP2S),
                              ("write", _WRITES)):
            if getattr(self, axis) not in allowed:
                raise ValueError(f"{axis}: must be one of {allowed}, got {getattr(self, axis)!r}")
        if self.quant_block not in (64, 128):
            raise ValueError(f"quant_block: must be 64 or 128, got {self.quant_block}")
        if self.cache_row_bytes < CACHE_ROW_BYTES:
            raise ValueError(f"cache_row_bytes: must be >= {CACHE_ROW_BYTES}, got {self.cache_row_bytes}")


# Spellings of the real math; together they use every choice of every axis.
DSV4_SPELLINGS: tuple[Dsv4Spelling, ...] = (
    Dsv4Spelling("pow_mean-slice-strided-pad-exp2"),
    Dsv4Spelling("mul_mean-split-complex-new_zeros-pow-columns", "mul_mean", "split", "complex", "new_zeros", "pow", "columns"),
    Dsv4Spelling("rms_norm-split-strided-new_zeros-exp2", "rms_norm", "split", "strided", "new_zeros", "exp2"),
    Dsv4Spelling("rms_norm-slice-complex-pad-pow-columns", "rms_norm", "slice", "complex", "pad", "pow", "columns"),
    Dsv4Spelling("sqrt_recip-slice-strided-pad-exp2", "sqrt_recip", "slice", "strided", "pad", "exp2"),
    Dsv4Spelling("div_sqrt-split-strided-pad-exp2", "div_sqrt", "split", "strided", "pad", "exp2"),
)

# Code that looks like the above and computes something else: declined (but the last, see the docstring).
DSV4_LOOKALIKES: tuple[Dsv4Spelling, ...] = (
    Dsv4Spelling("eps_after_sqrt", norm="eps_after_sqrt"),
    Dsv4Spelling("no_rsqrt", norm="no_rsqrt"),
    Dsv4Spelling("neox_rope", rope="neox"),
    Dsv4Spelling("quant_block_128", quant_block=128),
    Dsv4Spelling("cache_row_640", cache_row_bytes=640),
    Dsv4Spelling("cache_row_640_columns", write="columns", cache_row_bytes=640),
    Dsv4Spelling("float16", dtype=torch.float16),
    Dsv4Spelling("cache_row_offset_by_one", write="columns_next_row"),
)


# --------------------------------------------------------------------------------------
# The steps, each in every spelling
# --------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, eps: float, spelling: Dsv4Spelling) -> torch.Tensor:
    """RMSNorm without weight over the last dim of fp32 ``x``."""
    if spelling.norm == "pow_mean":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if spelling.norm == "mul_mean":
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    if spelling.norm == "rms_norm":
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    if spelling.norm == "sqrt_recip":
        return x * torch.sqrt(x.square().mean(-1, keepdim=True) + eps).reciprocal()
    # look-alikes
    if spelling.norm == "eps_after_sqrt":
        return x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + eps)
    if spelling.norm == "no_rsqrt":
        return x * (x.pow(2).mean(-1, keepdim=True) + eps)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # div_sqrt


def split_rope_dims(x: torch.Tensor, spelling: Dsv4Spelling) -> tuple[torch.Tensor, torch.Tensor]:
    """(NoPE dims [..., 448], RoPE dims [..., 64])."""
    if spelling.split == "split":
        nope, pe = x.split([NOPE_DIM, ROPE_DIM], dim=-1)
        return nope, pe
    return x[..., :NOPE_DIM], x[..., NOPE_DIM:]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spelling: Dsv4Spelling) -> torch.Tensor:
    """Rotate fp32 ``x [..., 64]`` by ``cos, sin [..., 32]`` (broadcast), GPT-J interleaved pairs."""
    if spelling.rope == "strided":
        e, o = x[..., ::2], x[..., 1::2]
        return torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2)
    if spelling.rope == "complex":
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2)
    # look-alike: NeoX rotate-half pairs (i, i + 32)
    x1, x2 = x[..., : ROPE_DIM // 2], x[..., ROPE_DIM // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (cos, sin), [T, 32] fp32 each."""
    cs = cos_sin_cache[positions]
    return cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :]


def pad_heads(q: torch.Tensor, padded_heads: int, spelling: Dsv4Spelling) -> torch.Tensor:
    """[T, H, 512] -> [T, HP, 512] with zero heads H..HP-1."""
    num_tokens, num_heads, dim = q.shape
    if spelling.pad == "pad":
        return F.pad(q, (0, 0, 0, padded_heads - num_heads))
    out = q.new_zeros(num_tokens, padded_heads, dim)
    out[:, :num_heads] = q
    return out


def ue8m0_quant(x: torch.Tensor, spelling: Dsv4Spelling) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [T, 448]`` -> (e4m3 codes [T, 448] uint8, scale bytes [T, 8] uint8)."""
    block = spelling.quant_block
    padded = -(-NOPE_DIM // block) * block  # 448, or 512 for the 128 look-alike
    if padded != NOPE_DIM:
        x = F.pad(x, (0, padded - NOPE_DIM))
    codes, scale_bytes = pow2_blocks(x.unflatten(-1, (padded // block, block)), spelling)
    pad = scale_bytes.new_zeros(scale_bytes.shape[0], SCALE_BYTES - scale_bytes.shape[1])
    return codes[:, :NOPE_DIM], torch.cat((scale_bytes, pad), dim=-1)


def pow2_blocks(blocks: torch.Tensor, spelling: Dsv4Spelling = DSV4_SPELLINGS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``blocks [n, count, size]`` -> (e4m3 codes [n, count * size] uint8, UE8M0 scale bytes
    [n, count] uint8): a power-of-two scale a block, as engines write the DeepSeek-V4 caches."""
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    e = torch.ceil(torch.log2(amax / FP8_MAX))
    inv_scale = torch.exp2(-e) if spelling.exp2 == "exp2" else torch.pow(2.0, -e)
    scaled = (blocks * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2), (e + 127).clamp(0, 255).to(torch.uint8)


def fp8_ds_mla_cache(num_blocks: int, block_size: int, device=None, row_bytes: int = CACHE_ROW_BYTES) -> torch.Tensor:
    """An empty ``fp8_ds_mla`` cache [NB, S] uint8, S padded up to a multiple of 576."""
    stride = -(-block_size * (row_bytes + SCALE_BYTES) // 576) * 576
    return torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)


# --------------------------------------------------------------------------------------
# The two halves of the preparation
# --------------------------------------------------------------------------------------
def dsv4_q_prep(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    padded_heads: int,
    spelling: Dsv4Spelling,
) -> torch.Tensor:
    """q [T, H, 512] bf16 -> normalised, rotated, head-padded q [T, HP, 512] bf16."""
    x = q.float()
    y = rms_norm(x, eps, spelling)
    nope, pe = split_rope_dims(y, spelling)
    cos, sin = cos_sin(cos_sin_cache, positions)
    pe = rope(pe, cos.unsqueeze(1), sin.unsqueeze(1), spelling)
    out = torch.cat((nope, pe), dim=-1).to(q.dtype)
    return pad_heads(out, padded_heads, spelling)


def dsv4_kv_insert(
    kv: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    block_size: int,
    spelling: Dsv4Spelling,
) -> None:
    """Rotate, quantise and write the first ``len(slot_mapping)`` rows of kv [T, 512] into
    ``k_cache`` (fp8_ds_mla). A negative slot wraps (see the module docstring)."""
    n = slot_mapping.shape[0]
    x = kv[:n].float()
    nope, pe = split_rope_dims(x, spelling)
    cos, sin = cos_sin(cos_sin_cache, positions[:n])
    pe = rope(pe, cos, sin, spelling).to(kv.dtype)
    write_fp8_ds_mla_rows(nope, pe, k_cache, slot_mapping, block_size, spelling)


def write_fp8_ds_mla_rows(nope: torch.Tensor, pe: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_size: int, spelling: Dsv4Spelling = DSV4_SPELLINGS[0]) -> None:
    """The engine's cache write alone: fp32 NoPE values ``[n, 448]`` quantised (UE8M0 block
    scales, e4m3 codes) and bf16 RoPE values ``[n, 64]`` written as fp8_ds_mla rows at the slots."""
    codes, scales = ue8m0_quant(nope, spelling)
    data = torch.cat((codes, pe.view(torch.uint8)), dim=-1)  # [n, 576]

    row = spelling.cache_row_bytes
    blk, pos_in_blk = slot_mapping // block_size, slot_mapping % block_size
    if spelling.write == "columns_next_row":  # look-alike: each row one row further into its block
        pos_in_blk = (slot_mapping + 1) % block_size
    if spelling.write != "view":  # byte columns of the 2-d cache, no view
        blk, pos_in_blk = blk.unsqueeze(1), pos_in_blk.unsqueeze(1)
        data_cols = pos_in_blk * row + torch.arange(CACHE_ROW_BYTES, device=k_cache.device)
        scale_cols = block_size * row + pos_in_blk * SCALE_BYTES + torch.arange(SCALE_BYTES, device=k_cache.device)
        k_cache[blk, data_cols] = data
        k_cache[blk, scale_cols] = scales
        return
    num_blocks = k_cache.shape[0]
    data_view = k_cache[:, : block_size * row].view(num_blocks, block_size, row)
    scale_view = k_cache[:, block_size * row : block_size * (row + SCALE_BYTES)].view(num_blocks, block_size, SCALE_BYTES)
    if row != CACHE_ROW_BYTES:
        data_view = data_view[..., :CACHE_ROW_BYTES]
    data_view[blk, pos_in_blk] = data
    scale_view[blk, pos_in_blk] = scales


def mxfp8_cache(num_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """An empty cache of DeepSeek-V4.1's MXFP8 records [NB, S] uint8, S padded up to a multiple of 512."""
    stride = -(-block_size * MXFP8_SLOT_BYTES // 512) * 512
    return torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)


def write_mxfp8_records(rows: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, *,
                        whole: bool = True) -> None:
    """An engine's DeepSeek-V4.1 cache write: fp32 rows ``[n, 512]`` (the RoPE dims already
    rotated and rounded to bf16) quantised in blocks of 32 (UE8M0 scales, e4m3 codes), each
    slot's 512 codes and then its 16 scale bytes at ``(s % bs) * 528`` of block ``s // bs``.
    ``whole``: one write of the 528-byte records; else the codes and the scale bytes apart."""
    codes, scales = pow2_blocks(rows.unflatten(-1, (MXFP8_SCALES, MXFP8_BLOCK)))
    records = k_cache[:, : block_size * MXFP8_SLOT_BYTES].view(k_cache.shape[0], block_size, MXFP8_SLOT_BYTES)
    blk, pos_in_blk = slot_mapping // block_size, slot_mapping % block_size
    if whole:
        records[blk, pos_in_blk] = torch.cat((codes, scales), dim=-1)
    else:
        records[..., :HEAD_DIM][blk, pos_in_blk] = codes
        records[..., HEAD_DIM:][blk, pos_in_blk] = scales


# --------------------------------------------------------------------------------------
# An attention block that uses them
# --------------------------------------------------------------------------------------
class Dsv4AttentionLayer(nn.Module):
    """q and kv projections, the preparation, and an attention-like consumer of padded q."""

    def __init__(self, dim: int, num_heads: int, padded_heads: int, eps: float, block_size: int,
                 spelling: Dsv4Spelling, generator: torch.Generator) -> None:
        super().__init__()
        self.num_heads, self.padded_heads = num_heads, padded_heads
        self.eps, self.block_size, self.spelling = eps, block_size, spelling
        dtype = spelling.dtype

        def weight(*shape):
            return nn.Parameter((torch.randn(*shape, generator=generator) * shape[-1] ** -0.5).to(dtype),
                                requires_grad=False)

        self.wq = weight(num_heads * HEAD_DIM, dim)
        self.wkv = weight(HEAD_DIM, dim)
        self.kv_norm_weight = nn.Parameter((1 + 0.1 * torch.randn(HEAD_DIM, generator=generator)).to(dtype),
                                           requires_grad=False)
        self.wo = weight(dim, num_heads * HEAD_DIM)

    def forward(self, x, positions, slot_mapping, cos_sin_cache, k_cache):
        num_tokens = x.shape[0]
        q = F.linear(x, self.wq).view(num_tokens, self.num_heads, HEAD_DIM)
        kv = F.linear(x, self.wkv)
        # weighted RMSNorm of kv happens upstream of the fused op (not part of it)
        kv = F.rms_norm(kv.float(), (HEAD_DIM,), self.kv_norm_weight.float(), self.eps).to(kv.dtype)

        q_padded = dsv4_q_prep(q, positions, cos_sin_cache, self.eps, self.padded_heads, self.spelling)
        dsv4_kv_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, self.block_size, self.spelling)

        # attention-like consumer of the padded q (all HP heads, as FlashMLA reads them)
        scores = torch.einsum("thd,sd->hts", q_padded, kv).float() * HEAD_DIM**-0.5
        out = torch.einsum("hts,sd->thd", scores.softmax(-1).to(kv.dtype), kv)
        return x + F.linear(out[:, : self.num_heads].flatten(1), self.wo)


class Dsv4AttentionBlock(nn.Module):
    """A few :class:`Dsv4AttentionLayer` with random weights, one fp8_ds_mla cache each."""

    def __init__(self, num_layers: int = 2, dim: int = 64, num_heads: int = 3, padded_heads: int = 8,
                 eps: float = 1e-6, block_size: int = 16, spelling: Dsv4Spelling = DSV4_SPELLINGS[0],
                 seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(
            Dsv4AttentionLayer(dim, num_heads, padded_heads, eps, block_size, spelling, generator)
            for _ in range(num_layers)
        )

    def forward(self, x, positions, slot_mapping, cos_sin_cache, k_caches: list[torch.Tensor]):
        for layer, k_cache in zip(self.layers, k_caches):
            x = layer(x, positions, slot_mapping, cos_sin_cache, k_cache)
        return x


# --------------------------------------------------------------------------------------
# The benchmark's baseline: the op's reference math, unfused, capturable
# --------------------------------------------------------------------------------------
# DeepSeek-V4 attention-input preparation as unfused plain PyTorch.
#
# What ``prepfuse::dsv4_qnorm_rope_kv_insert`` replaces: the q path (RMSNorm, GPT-J RoPE on
# dims 448..511, one rounding to bf16, zeroed padded heads) and the kv path (RoPE, UE8M0
# block-64 fp8 quantisation, insertion into the ``fp8_ds_mla`` paged cache) as separate
# PyTorch ops: the op module's reference, step by step, with an insertion that has no
# boolean-mask filtering of skipped rows, so it never reads a tensor on the host, can be
# captured in a CUDA graph and traced whole by ``torch.compile``.
def dsv4_prep_unfused(*args) -> None:
    """``prepfuse::dsv4_qnorm_rope_kv_insert``'s arguments and results, as separate PyTorch ops, for slot
    mappings whose slots are ALL valid and distinct: a negative ("skip") slot is not
    filtered out (that would need a boolean mask, i.e. a host sync) and would index the
    cache from its end. The benchmarks use all-valid slot mappings for every
    implementation. No input checks: a model's code would not carry them either."""
    unchecked_reference(*args, as_baseline=True)
