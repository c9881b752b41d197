"""GQA (Qwen3 / Llama style) attention-input preparation, unfused, as model authors write it.

The math is the op's (``prepfuse/ops/gqa_qknorm_rope_kv_insert.py``) in plain PyTorch, the Hugging
Face way: split the fused qkv projection, a weighted per-head RMSNorm module on q and k (Qwen3;
Llama has none), RoPE with cos/sin gathered by position from a vLLM ``[P, R]`` table, and the paged
write ``cache[slot // bs, slot % bs] = rows`` into ``[num_blocks, bs, Hkv, D]``. A spelling is a row
of a table (:class:`GqaSpelling`), not a copied class:

==========  ============================================================================
axis        choices
==========  ============================================================================
norm        ``hf``: ``Qwen3RMSNorm``; ``none`` (Llama); ``gemma``: ``Gemma3RMSNorm``,
            ``(normed * (1.0 + weight.float())).to(bf16)``; ``weight_in_fp32``:
            ``(weight.float() * normed).to(bf16)`` (both: the op's fp32-weight form)
split       ``split``: ``qkv.split([Hq*D, Hkv*D, Hkv*D], -1)``; ``slice``: ``qkv[:, :Hq*D]`` ..;
            ``separate``: three projections, ``qkv`` the tuple ``(q, k, v)``
rope        ``hf_bf16``: ``q * cos + rotate_half(q) * sin`` with ``cat((c, c), -1).to(q.dtype)``,
            all in bf16; ``hf_fp32``: the same on ``q.float()`` with the fp32 table;
            ``halves``: vLLM's ``cat((x1*c - x2*s, x2*c + x1*s))`` in fp32; ``gptj``:
            ``x[..., ::2]``, ``x[..., 1::2]``, ``stack(.., -1).flatten(-2)`` in fp32
rotary_dim  ``None`` (all of D) or ``R < D``: rotate ``x[..., :R]``, ``cat`` the rest back
cache       bf16, or fp8 ``(x.float() / kv_scale).clamp(-448, 448).to(e4m3)``, ``kv_scale [1]``
layout      ``slots_heads`` (paged); ``heads_slots`` ``[NB, Hkv, bs, D]``; ``flat`` token pool
            ``[N, Hkv, D]``; ``slot_view`` ``cache.view(-1, Hkv, D)[slot]`` (nano-vllm);
            ``sequence`` / ``sequence_index_copy``: one sequence's ``[1, Hkv, S, D]``
==========  ============================================================================

Against the op: the ``hf`` norm is the op's step for step (same bits on the CPU); ``hf_fp32``,
``halves`` and ``gptj`` RoPE equal it bit for bit; ``hf_bf16`` rounds in bf16 three times and
differs on about 40% of the rotated values by at most about ``2^-7 * (|a| + |b|)`` (the op is the
more accurate); fp8 rows are the op's quantisation of the bf16 rows. :data:`GQA_LOOKALIKES` look
the same and compute something else (eps differing between q and k norm, ``rotate_half``
without its sign, which is no rotation, fp16), or the same math another way (each row one row
further into its block, a multiply by ``1/kv_scale``). Eager index assignment writes a negative slot through Python's wraparound; the
fused call does the same (the pass emits ``wrap_indices=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prepfuse.ops.gqa_qknorm_rope_kv_insert import FP8_MAX, HEAD_DIMS, unchecked_reference

_NORMS = ("hf", "none", "weight_in_fp32", "gemma")
_SPLITS = ("split", "slice", "separate")
_ROPES = ("hf_bf16", "hf_fp32", "halves", "gptj", "hf_unsigned")
_CACHE_LAYOUTS = ("slots_heads", "heads_slots", "flat", "slot_view", "sequence", "sequence_index_copy", "next_row")
_FP8_SCALINGS = ("div", "mul_reciprocal")


@dataclass(frozen=True)
class GqaSpelling:
    """One way of writing GQA preparation (see the module docstring's table)."""

    name: str
    norm: str = "hf"
    split: str = "split"
    rope: str = "hf_bf16"
    rotary_dim: int | None = None  # None: the whole head
    cache_dtype: torch.dtype = torch.bfloat16
    dtype: torch.dtype = torch.bfloat16  # look-alike: float16
    k_eps: float | None = None  # look-alike: a k norm eps other than q's
    cache_layout: str = "slots_heads"  # "heads_slots": [NB, Hkv, bs, D]; "flat": [NB*bs, Hkv, D] written
    # cache[slot] (a token pool); "slot_view": [NB, bs, Hkv, D] written cache.view(-1, Hkv, D)[slot];
    # "sequence" / "sequence_index_copy": [1, Hkv, NB*bs, D] written cache[:, :, slot] / index_copy_ (a slot is a position); "next_row": (slot + 1) % bs, which
    # the pass fuses as a (block, row) write and a recogniser blind to whose slots a row index
    # reads would misread (the validation tests' planted bug)
    fp8_scaling: str = "div"  # look-alike: x * (1 / kv_scale)

    def __post_init__(self) -> None:
        for axis, allowed in (("norm", _NORMS), ("split", _SPLITS), ("rope", _ROPES),
                              ("cache_layout", _CACHE_LAYOUTS), ("fp8_scaling", _FP8_SCALINGS)):
            if getattr(self, axis) not in allowed:
                raise ValueError(f"{axis}: must be one of {allowed}, got {getattr(self, axis)!r}")
        if self.cache_dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float16):
            raise ValueError(f"cache_dtype: must be torch.bfloat16 or torch.float8_e4m3fn (float16: look-alike), "
                             f"got {self.cache_dtype}")
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise ValueError(f"rotary_dim: must be a positive even int or None, got {self.rotary_dim}")

    @property
    def has_norm(self) -> bool:
        return self.norm != "none"

    @property
    def is_neox(self) -> bool:
        return self.rope != "gptj"


# Spellings of the real math; together they use every choice of every axis.
GQA_SPELLINGS: tuple[GqaSpelling, ...] = (
    GqaSpelling("qwen3-hf"),  # Qwen3 as Hugging Face writes it
    GqaSpelling("qwen3-hf_fp32-slice-fp8", rope="hf_fp32", split="slice", cache_dtype=torch.float8_e4m3fn),
    GqaSpelling("llama-hf", norm="none"),  # Llama: no q/k norm
    GqaSpelling("llama-halves-partial-fp8", norm="none", rope="halves", rotary_dim=32, cache_dtype=torch.float8_e4m3fn),
    GqaSpelling("qwen3-gptj-slice", rope="gptj", split="slice"),
    GqaSpelling("llama-gptj-partial", norm="none", rope="gptj", rotary_dim=32),
    GqaSpelling("qwen3-hf-partial", rotary_dim=32),
    GqaSpelling("qwen3-hf-separate", split="separate"),  # HF's q_proj, k_proj, v_proj
    GqaSpelling("llama-gptj-separate-fp8", norm="none", rope="gptj", split="separate", cache_dtype=torch.float8_e4m3fn),
    # a paged cache with heads before slots, [NB, Hkv, bs, D], written cache[s // bs, :, s % bs]
    GqaSpelling("qwen3-hf-heads-first", cache_layout="heads_slots"),
    GqaSpelling("llama-hf_fp32-heads-first-fp8", norm="none", rope="hf_fp32", cache_layout="heads_slots",
                cache_dtype=torch.float8_e4m3fn),
    # a flat token pool [N, Hkv, D] written k_buffer[loc] = k (SGLang's MHATokenToKVPool)
    GqaSpelling("qwen3-hf_fp32-token-pool", rope="hf_fp32", cache_layout="flat"),
    # norm weights applied in fp32 before one rounding: Gemma-3's (x * (1 + w)).to(bf16), and
    # (w.float() * x).to(bf16); the op's fp32-weight form
    GqaSpelling("gemma3-hf", norm="gemma"),
    GqaSpelling("qwen3-hf-weight-in-fp32", norm="weight_in_fp32"),
    # the paged cache written by slot through its flat view, cache.view(-1, Hkv, D)[slot] = k
    GqaSpelling("llama-hf_fp32-slot-view-fp8", norm="none", rope="hf_fp32", cache_layout="slot_view",
                cache_dtype=torch.float8_e4m3fn),
    # one sequence's cache [1, Hkv, S, D] written by position: gpt-fast, Hugging Face's StaticCache
    GqaSpelling("qwen3-hf-sequence-cache", cache_layout="sequence"),
    GqaSpelling("llama-hf_fp32-static-cache", norm="none", rope="hf_fp32", cache_layout="sequence_index_copy"),
)

# Code that looks like the above and computes something else: never fused (but
# ``cache_row_offset_by_one``, fused as a (block, row) write: test_gqa says why).
GQA_LOOKALIKES: tuple[GqaSpelling, ...] = (
    GqaSpelling("k_norm_eps_differs", rope="hf_fp32", k_eps=1e-5),
    GqaSpelling("rotate_half_unsigned", rope="hf_unsigned"),
    GqaSpelling("cache_row_offset_by_one", cache_layout="next_row"),
    GqaSpelling("fp8_mul_reciprocal", rope="hf_fp32", cache_dtype=torch.float8_e4m3fn, fp8_scaling="mul_reciprocal"),
    GqaSpelling("float16", dtype=torch.float16, cache_dtype=torch.float16),
)


# --------------------------------------------------------------------------------------
# The steps, each in every spelling
# --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Hugging Face's ``Qwen3RMSNorm`` (= ``LlamaRMSNorm``): normalise in fp32, round to the
    input dtype, then multiply by the weight in that dtype. ``norm="weight_in_fp32"``:
    ``(weight.float() * normed).to(dtype)``, one rounding after the weight;
    ``norm="gemma"``: ``Gemma3RMSNorm``, ``(normed * (1.0 + weight.float())).to(dtype)``
    with a weight near 0."""

    def __init__(self, weight: torch.Tensor, eps: float, norm: str = "hf") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon, self.norm = eps, norm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.norm == "weight_in_fp32":  # one rounding after the weight
            return (self.weight.float() * hidden_states).to(input_dtype)
        if self.norm == "gemma":  # Gemma3RMSNorm: (x * w).to(dtype), w = 1 + weight, in fp32
            return (hidden_states * (1.0 + self.weight.float())).to(input_dtype)
        return self.weight * hidden_states.to(input_dtype)

    def op_weight(self) -> torch.Tensor:
        """The norm weight the GQA ops take for this norm: the bf16 weight (applied after the
        rounding), or the fp32 one applied before it (``weight.float()``, ``1 + weight``)."""
        if self.norm == "weight_in_fp32":
            return self.weight.data.float()
        if self.norm == "gemma":
            return 1.0 + self.weight.data.float()
        return self.weight.data


def split_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, spelling: GqaSpelling):
    """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] of the fused projection's output (or,
    ``separate``, of the three projections' outputs)."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if spelling.split == "separate":
        q, k, v = qkv
        num_tokens = q.shape[0]
        return (q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
                v.view(num_tokens, num_kv_heads, head_dim))
    if spelling.split == "split":
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    else:
        q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    num_tokens = qkv.shape[0]
    return (q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (cos, sin), [T, R/2] fp32 each, gathered by position."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return cos, sin


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spelling: GqaSpelling) -> torch.Tensor:
    """Rotate bf16 heads ``x [T, H, D]`` (the first ``rotary_dim`` dims) by ``cos, sin [T, R/2]``."""
    rot_dim = spelling.rotary_dim or x.shape[-1]
    rot, rest = (x, None) if rot_dim == x.shape[-1] else (x[..., :rot_dim], x[..., rot_dim:])
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # every head
    if spelling.rope in ("hf_bf16", "hf_unsigned"):  # HF: cos/sin in the activation dtype, three roundings
        cos, sin = torch.cat((cos, cos), dim=-1).to(x.dtype), torch.cat((sin, sin), dim=-1).to(x.dtype)
        # look-alike: cat((x2, x1)) mixes each pair with one sign, no rotation either way
        rotated = rotate_half(rot) if spelling.rope == "hf_bf16" else rot.roll(rot.shape[-1] // 2, -1)
        out = (rot * cos) + (rotated * sin)
    elif spelling.rope == "hf_fp32":
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        h = rot.float()
        out = ((h * cos) + (rotate_half(h) * sin)).to(x.dtype)
    elif spelling.rope == "halves":  # vLLM's forward_native
        x1, x2 = torch.chunk(rot.float(), 2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    else:  # gptj: interleaved pairs
        h = rot.float()
        e, o = h[..., ::2], h[..., 1::2]
        out = torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2).to(x.dtype)
    return out if rest is None else torch.cat((out, rest), dim=-1)


def cache_rows(x: torch.Tensor, kv_scale: torch.Tensor | None, spelling: GqaSpelling) -> torch.Tensor:
    """bf16 rows as the cache stores them: as is, or e4m3 of ``clamp(x / kv_scale, +-448)``."""
    if spelling.cache_dtype != torch.float8_e4m3fn:
        return x
    if spelling.fp8_scaling == "div":
        scaled = x.float() / kv_scale
    else:  # look-alike: rounds differently from a true division
        scaled = x.float() * (1.0 / kv_scale)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def insert(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, spelling: GqaSpelling) -> None:
    """``cache[slot // bs, slot % bs] = rows`` (or the spelling's layout's form of it) for the
    first ``len(slot_mapping)`` rows (every slot valid, see the module docstring)."""
    n = slot_mapping.shape[0]
    if spelling.cache_layout == "slots_heads":  # [NB, bs, Hkv, D]
        block_size = cache.shape[1]
        cache[slot_mapping // block_size, slot_mapping % block_size] = rows[:n]
    elif spelling.cache_layout == "flat":  # a token pool [N, Hkv, D] (SGLang's k_buffer[loc] = k)
        cache[slot_mapping] = rows[:n]
    elif spelling.cache_layout == "slot_view":  # [NB, bs, Hkv, D] by slot alone, through its flat view
        cache.view(-1, *cache.shape[2:])[slot_mapping] = rows[:n]
    elif spelling.cache_layout == "sequence":  # one sequence's [1, Hkv, S, D] (gpt-fast's KVCache.update)
        cache[:, :, slot_mapping] = rows[:n].transpose(0, 1).unsqueeze(0)
    elif spelling.cache_layout == "sequence_index_copy":  # the same, as Hugging Face's StaticCache writes it
        cache.index_copy_(2, slot_mapping, rows[:n].transpose(0, 1).unsqueeze(0))
    elif spelling.cache_layout == "next_row":  # look-alike: each row one row further into its block
        block_size = cache.shape[1]
        cache[slot_mapping // block_size, (slot_mapping + 1) % block_size] = rows[:n]
    else:  # heads before slots: [NB, Hkv, bs, D]
        block_size = cache.shape[2]
        cache[slot_mapping // block_size, :, slot_mapping % block_size] = rows[:n]


def gqa_prep(
    qkv: torch.Tensor,
    q_norm: nn.Module | None,
    k_norm: nn.Module | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    spelling: GqaSpelling,
) -> torch.Tensor:
    """qkv [T, (Hq + 2*Hkv)*D] (``separate``: the tuple of q, k, v) -> the prepared q
    [T, Hq, D]; k and v of the first ``len(slot_mapping)`` tokens written into the caches."""
    if spelling.split == "separate":
        head_dim = qkv[0].shape[1] // num_q_heads
    else:
        head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads, head_dim, spelling)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    cos, sin = cos_sin(cos_sin_cache, positions)
    q, k = rope(q, cos, sin, spelling), rope(k, cos, sin, spelling)
    insert(k_cache, cache_rows(k, kv_scale, spelling), slot_mapping, spelling)
    insert(v_cache, cache_rows(v, kv_scale, spelling), slot_mapping, spelling)
    return q


def make_norms(head_dim: int, eps: float, spelling: GqaSpelling, generator: torch.Generator):
    """(q_norm, k_norm) modules with random weights near 1, or (None, None) without norm."""
    if not spelling.has_norm:
        return None, None
    norms = []
    for norm_eps in (eps, eps if spelling.k_eps is None else spelling.k_eps):
        weight = 0.3 * torch.randn(head_dim, generator=generator)
        weight = (weight if spelling.norm == "gemma" else 1 + weight).to(spelling.dtype)  # gemma: 1 + w is applied
        norms.append(RMSNorm(weight, norm_eps, spelling.norm))
    return tuple(norms)


def kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, spelling: GqaSpelling,
             device=None) -> torch.Tensor:
    """A zeroed paged cache in the spelling's layout and dtype."""
    sequence = (1, num_kv_heads, num_blocks * block_size, head_dim)
    shape = {"heads_slots": (num_blocks, num_kv_heads, block_size, head_dim),
             "flat": (num_blocks * block_size, num_kv_heads, head_dim),
             "sequence": sequence, "sequence_index_copy": sequence}.get(
        spelling.cache_layout, (num_blocks, block_size, num_kv_heads, head_dim))
    return torch.zeros(shape, device=device).to(spelling.cache_dtype)


# --------------------------------------------------------------------------------------
# Example models: an attention block that uses the preparation
# --------------------------------------------------------------------------------------
class GqaAttentionLayer(nn.Module):
    """The fused qkv projection, the preparation, and causal-free attention over the
    cache's just-written rows (read back through q and the bf16 k, v)."""

    def __init__(self, dim: int, num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 spelling: GqaSpelling, generator: torch.Generator) -> None:
        super().__init__()
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: must be one of {HEAD_DIMS}, got {head_dim}")
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.spelling = num_q_heads, num_kv_heads, head_dim, spelling

        def weight(*shape):
            return nn.Parameter((torch.randn(*shape, generator=generator) * shape[-1] ** -0.5).to(spelling.dtype),
                                requires_grad=False)

        if spelling.split == "separate":  # HF: q_proj, k_proj, v_proj
            self.wq = weight(num_q_heads * head_dim, dim)
            self.wk = weight(num_kv_heads * head_dim, dim)
            self.wv = weight(num_kv_heads * head_dim, dim)
        else:
            self.wqkv = weight((num_q_heads + 2 * num_kv_heads) * head_dim, dim)
        self.wo = weight(dim, num_q_heads * head_dim)
        self.q_norm, self.k_norm = make_norms(head_dim, eps, spelling, generator)

    def forward(self, x, positions, slot_mapping, cos_sin_cache, k_cache, v_cache, kv_scale=None):
        if self.spelling.split == "separate":
            qkv = (F.linear(x, self.wq), F.linear(x, self.wk), F.linear(x, self.wv))
            v = qkv[2]
        else:
            qkv = F.linear(x, self.wqkv)
            v = qkv[:, -self.num_kv_heads * self.head_dim :]
        q = gqa_prep(qkv, self.q_norm, self.k_norm, k_cache, v_cache, slot_mapping, positions, cos_sin_cache,
                     kv_scale, self.num_q_heads, self.num_kv_heads, self.spelling)
        # attention-like consumer of the prepared q: each q head against its group's v
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        v = v.repeat_interleave(self.num_q_heads // self.num_kv_heads, dim=1)
        scores = torch.einsum("thd,shd->hts", q, v).float() * self.head_dim**-0.5
        out = torch.einsum("hts,shd->thd", scores.softmax(-1).to(v.dtype), v)
        return x + F.linear(out.flatten(1), self.wo)


class GqaAttentionBlock(nn.Module):
    """A few :class:`GqaAttentionLayer` with random weights, one (k, v) cache pair each."""

    def __init__(self, num_layers: int = 2, dim: int = 64, num_q_heads: int = 4, num_kv_heads: int = 2,
                 head_dim: int = 64, eps: float = 1e-6, spelling: GqaSpelling = GQA_SPELLINGS[0], seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.spelling = spelling
        self.layers = nn.ModuleList(
            GqaAttentionLayer(dim, num_q_heads, num_kv_heads, head_dim, eps, spelling, generator)
            for _ in range(num_layers)
        )

    def forward(self, x, positions, slot_mapping, cos_sin_cache, caches: list[tuple[torch.Tensor, torch.Tensor]],
                kv_scale=None):
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            x = layer(x, positions, slot_mapping, cos_sin_cache, k_cache, v_cache, kv_scale)
        return x


# The demo's example models: Qwen3-style blocks (fused qkv, and HF's separate q/k/v
# projections) and a Llama-style block.
EXAMPLE_MODELS: dict[str, GqaSpelling] = {
    "Qwen3-style (q/k RMSNorm, NeoX RoPE, bf16 cache)": GQA_SPELLINGS[0],
    "Qwen3 HF-style (separate q_proj/k_proj/v_proj, q/k RMSNorm, NeoX RoPE, bf16 cache)": GqaSpelling(
        "qwen3-hf-separate", split="separate"),
    "Llama-style (no q/k norm, NeoX RoPE, fp8 cache)": GqaSpelling("llama-hf-fp8", norm="none",
                                                                   cache_dtype=torch.float8_e4m3fn),
}


# --------------------------------------------------------------------------------------
# The benchmark's baseline: the op's reference math, unfused, capturable
# --------------------------------------------------------------------------------------
# GQA (Qwen3 / Llama) attention-input preparation as unfused plain PyTorch.
#
# What ``prepfuse::gqa_qknorm_rope_kv_insert`` replaces: split of the fused qkv, per-head
# weighted RMSNorm of q and k (optional), RoPE, the q store, and the k/v insertion into
# paged caches (bf16, or fp8-e4m3 with a per-tensor scale), as separate PyTorch ops: the op
# module's reference, with an insertion that has no boolean-mask filtering of skipped rows,
# so it never reads a tensor on the host, can be captured in a CUDA graph and traced whole
# by ``torch.compile``.
def gqa_prep_unfused(*args) -> None:
    """``prepfuse::gqa_qknorm_rope_kv_insert``'s arguments and results, as separate PyTorch ops, for slot
    mappings whose slots are ALL valid and distinct: a negative ("skip") slot is not
    filtered out (that would need a boolean mask, i.e. a host sync) and would index the
    cache from its end. The benchmarks use all-valid slot mappings for every
    implementation. No input checks: a model's code would not carry them either."""
    unchecked_reference(*args, as_baseline=True)
