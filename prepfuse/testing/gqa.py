"""``prepfuse::gqa_qknorm_rope_kv_insert`` (and its separate-projections op): one call's inputs,
made fresh and poisoned, the comparison, and the bound of Hugging Face's all-bf16 RoPE."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prepfuse.ops.gqa_qknorm_rope_kv_insert import FP8_CACHE_DTYPES, rms_norm_reference
from prepfuse.testing.common import (
    Q_POISON, bf16_ulp_diff, e4m3_code_diff, fresh_generator, poisoned_like, random_slots, rope_cos_sin_cache,
    seeded_generator,
)

__all__ = ["GqaInputs", "make_gqa_inputs", "CACHE_LAYOUTS", "with_cache_layout", "with_fp32_norm_weights",
           "with_full_cos_sin", "with_cos_sin_operands", "exact_sum_qkv", "seeded_gqa_inputs", "GqaComparison", "compare_gqa",
           "normed_pair_sum", "bf16_rope_pair_bound", "assert_fused_write_close"]


@dataclass
class GqaInputs:
    """One call's arguments of ``prepfuse::gqa_qknorm_rope_kv_insert``."""

    qkv: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    q_out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor | None
    cos_sin_cache: torch.Tensor | None
    kv_scale: torch.Tensor | None
    num_q_heads: int
    num_kv_heads: int
    is_neox: bool
    eps: float
    full_cos_sin: bool = False  # cos_sin_cache rows are R cos then R sin (``with_full_cos_sin``)
    cos: torch.Tensor | None = None  # the two-table form instead of cos_sin_cache (``with_cos_sin_operands``)
    sin: torch.Tensor | None = None
    fp8_saturate: bool = True  # False: NaN where an fp8 value rounds past 448 (a bare non-saturating cast)
    wrap_indices: bool = False  # a negative slot or position counts from the end (``common.with_wrapped_indices``)
    v_scale: torch.Tensor | None = None  # v's own fp8 scale (vLLM's v_scale); None: kv_scale serves both

    def args(self) -> tuple:
        return (
            self.qkv, self.q_norm_weight, self.k_norm_weight, self.q_out, self.k_cache, self.v_cache,
            self.slot_mapping, self.positions, self.cos_sin_cache, self.kv_scale,
            self.num_q_heads, self.num_kv_heads, self.is_neox, self.eps, self.full_cos_sin, self.cos, self.sin,
            self.fp8_saturate, self.wrap_indices, self.v_scale,
        )

    def by_layer_args(self, layer_name: str, engine: str) -> tuple:
        """The by-layer op's arguments: the caches and slots left to ``engine``'s resolver."""
        args = self.args()
        return (*args[:4], layer_name, engine, *args[7:])

    @property
    def head_dim(self) -> int:
        return self.q_out.shape[2]

    def separate_args(self, token_padding: int = 0) -> tuple:
        """The same call as ``prepfuse::gqa_separate_qknorm_rope_kv_insert``'s arguments:
        qkv's q, k and v columns copied into three tensors of their own (as three
        projections give them), each row followed by ``token_padding`` unused values
        (a token stride wider than the row)."""
        d = self.head_dim
        widths = (self.num_q_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        sources = []
        for part, width in zip(self.qkv.split(widths, dim=1), widths):
            padded = torch.full((part.shape[0], width + token_padding), -7.0, dtype=part.dtype, device=part.device)
            padded[:, :width] = part
            sources.append(padded[:, :width])
        return (
            *sources, self.q_norm_weight, self.k_norm_weight, self.q_out, self.k_cache, self.v_cache,
            self.slot_mapping, self.positions, self.cos_sin_cache, self.kv_scale, self.is_neox, self.eps,
            self.full_cos_sin, self.cos, self.sin, self.fp8_saturate, self.wrap_indices, self.v_scale,
        )

    def fresh_outputs(self) -> "GqaInputs":
        """The same inputs with newly poisoned q_out and caches (same shapes and strides)."""
        return replace(
            self,
            q_out=poisoned_like(self.q_out, value=Q_POISON),
            k_cache=poisoned_like(self.k_cache),
            v_cache=poisoned_like(self.v_cache),
        )


def make_gqa_inputs(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device,
    *,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    norm: bool = True,
    cache_dtype: torch.dtype = torch.bfloat16,
    generator: torch.Generator | None = None,
    num_inserted: int | None = None,
    skip_fraction: float = 0.1,
    spare_slots: int = 64,
    max_pos: int = 8192,
    eps: float = 1e-6,
) -> GqaInputs:
    """Fresh random inputs with poisoned outputs.

    qkv rows are a view of a wider buffer (token stride > width, as when qkv is a slice
    of a larger projection output), with a wide per-head dynamic range. The caches are
    the two halves of one ``[NB, 2, BS, Hkv, D]`` buffer (FlashInfer's layout), so their
    block strides are not their sizes. For fp8 caches ``kv_scale`` is drawn so that a few
    values saturate at +-448 and the smallest fall into e4m3's subnormals. The first
    ``num_inserted`` rows (default all) get distinct random slots; about
    ``skip_fraction`` of them are -1.
    """
    gen = fresh_generator(generator)
    num_inserted = num_tokens if num_inserted is None else num_inserted
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    n_heads = num_q_heads + 2 * num_kv_heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    heads = randn(num_tokens, n_heads, head_dim) * torch.exp(randn(num_tokens, n_heads, 1) * 2)
    wide = torch.zeros(num_tokens, n_heads * head_dim + 24, dtype=torch.bfloat16)
    wide[:, 8 : 8 + n_heads * head_dim] = heads.flatten(1).to(torch.bfloat16)
    qkv = wide.to(device)[:, 8 : 8 + n_heads * head_dim]

    weights = [None, None]
    if norm:
        weights = [(randn(head_dim) * 0.3 + 1).to(torch.bfloat16).to(device) for _ in range(2)]
    kv_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        # |normed k| is O(1): saturation starts between 2 and 4, so a few k values clamp;
        # v and unnormed k keep qkv's per-head range (e^(2*randn)), so whole heads clamp
        # and others fall into e4m3's subnormals
        kv_scale = torch.tensor([(2.0 + 2.0 * float(torch.rand(1, generator=gen))) / 448.0], device=device)

    num_blocks, slots = random_slots(num_inserted, spare_slots, block_size, skip_fraction, gen)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    kv_buffer = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)

    inputs = GqaInputs(
        qkv=qkv,
        q_norm_weight=weights[0],
        k_norm_weight=weights[1],
        q_out=torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.bfloat16, device=device),
        k_cache=kv_buffer[:, 0],
        v_cache=kv_buffer[:, 1],
        slot_mapping=slots.to(device),
        positions=positions.to(device),
        cos_sin_cache=rope_cos_sin_cache(max_pos, device, rotary_dim=rotary_dim),
        kv_scale=kv_scale,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        is_neox=is_neox,
        eps=eps,
    )
    return inputs.fresh_outputs()


def with_fp32_norm_weights(inputs: GqaInputs, generator: torch.Generator | None = None):
    """``(inputs, (w_q, w_k))``: the same call with fp32 norm weights ``1 + w`` for
    Gemma-3-like bf16 weights ``w`` near 0 (``Gemma3RMSNorm`` multiplies by
    ``1.0 + weight.float()`` in fp32, then rounds once), and the two bf16 ``w`` a Hugging
    Face module would hold. Needs inputs with a norm."""
    if inputs.q_norm_weight is None:
        raise ValueError("inputs: have no norm weights (made with norm=False)")
    generator = fresh_generator(generator)
    head_dim = inputs.q_norm_weight.shape[0]
    gemma = [(0.3 * torch.randn(head_dim, generator=generator)).to(torch.bfloat16).to(inputs.q_norm_weight.device)
             for _ in range(2)]
    fp32 = [1.0 + w.float() for w in gemma]
    return replace(inputs, q_norm_weight=fp32[0], k_norm_weight=fp32[1]), tuple(gemma)


CACHE_LAYOUTS = ("paged", "heads-first", "token-pool")


def with_cache_layout(inputs: GqaInputs, layout: str) -> GqaInputs:
    """The same call with caches in ``layout``, as the pass writes them through views
    (``fuse_gqa_prep``): ``"heads-first"``, a ``[NB, Hkv, bs, D]`` cache as its
    ``[NB, bs, Hkv, D]`` permutation; ``"token-pool"``, a flat ``[NB * bs, Hkv, D]`` pool as
    ``[NB * bs, 1, Hkv, D]`` (block size 1, slot s row s); ``"paged"``, as they are. Slots
    address the same capacity in every layout; the caches come poisoned."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"layout: must be one of {CACHE_LAYOUTS}, got {layout!r}")
    num_blocks, block_size, heads, head_dim = inputs.k_cache.shape
    if layout == "paged":
        return inputs

    def cache():
        like = dict(dtype=inputs.k_cache.dtype, device=inputs.k_cache.device)
        if layout == "heads-first":
            return torch.empty(num_blocks, heads, block_size, head_dim, **like).permute(0, 2, 1, 3)
        return torch.empty(num_blocks * block_size, heads, head_dim, **like).unsqueeze(1)

    return replace(inputs, k_cache=cache(), v_cache=cache()).fresh_outputs()


def with_full_cos_sin(inputs: GqaInputs, generator: torch.Generator | None = None) -> GqaInputs:
    """The same call with a full-width ``[P, 2R]`` table (``full_cos_sin``: R cos, then R
    sin, one per rotated dim, as Hugging Face's rotary module gives them).

    Without ``generator``: the half table's values spread over the dims each rotates (NeoX
    ``cat((c, c))``, GPT-J ``c.repeat_interleave(2)``), the same math as the half table, so
    both forms must write the same bytes. With one: every entry perturbed on its own, so the
    two dims of a pair use different values and a kernel that reads the wrong entry shows."""
    half = inputs.cos_sin_cache
    cos, sin = half.chunk(2, dim=-1)
    if inputs.is_neox:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    table = torch.cat((cos, sin), dim=-1)
    if generator is not None:
        noise = torch.rand(table.shape, generator=generator, dtype=torch.float32).to(table.device)
        table = table * (0.75 + 0.5 * noise)
    return replace(inputs, cos_sin_cache=table.contiguous(), full_cos_sin=True)


def with_cos_sin_operands(inputs: GqaInputs, *, dtype: torch.dtype = torch.float32, per_token: bool = False,
                          row_padding: int = 0) -> tuple[GqaInputs, GqaInputs]:
    """``(operands, table)``: the same call with ``cos`` and ``sin`` as two tensors in place
    of ``cos_sin_cache``, and the table-form call that must write the same bytes.

    ``dtype``: the operands' dtype (bf16: the values rounded once, and the table form holds
    those rounded values, widened exactly); ``per_token``: each token's row gathered, with
    ``positions=None`` (as a model computing cos/sin per token hands them over);
    ``row_padding``: each row followed by that many unread values (a row stride wider than
    the row: a column slice of a wider table)."""
    if inputs.cos_sin_cache is None:
        raise ValueError("inputs: already have cos and sin operands")
    table = inputs.cos_sin_cache.to(dtype).float()
    cos, sin = table.chunk(2, dim=-1)
    positions = inputs.positions
    if per_token:
        cos, sin, positions = cos[positions], sin[positions], None
    operands = []
    for values in (cos, sin):
        rows, width = values.shape
        padded = torch.full((rows, width + row_padding), float("nan"), dtype=dtype, device=values.device)
        padded[:, :width] = values.to(dtype)
        operands.append(padded[:, :width])
    with_operands = replace(inputs, positions=positions, cos_sin_cache=None, cos=operands[0], sin=operands[1])
    return with_operands, replace(inputs, cos_sin_cache=table.contiguous())


def exact_sum_qkv(inputs: GqaInputs, generator: torch.Generator) -> GqaInputs:
    """The same inputs with qkv replaced by integers in [-64, 64] times 2^k, one k per head
    in [-20, 10]: a head's sum of squares (at most 256 * 2^12 units of 2^(2k)) is exact in
    fp32 in any order, so kernel and reference share mean(x^2) and hence the norm."""
    qkv = inputs.qkv
    num_tokens, width = qkv.shape
    n_heads = width // inputs.head_dim
    ints = torch.randint(-64, 65, (num_tokens, n_heads, inputs.head_dim), generator=generator).float()
    powers = torch.exp2(torch.randint(-20, 11, (num_tokens, n_heads, 1), generator=generator).float())
    values = (ints * powers).flatten(1).to(torch.bfloat16)
    qkv = qkv.clone() if qkv.is_contiguous() else torch.empty_strided(qkv.shape, qkv.stride(), dtype=qkv.dtype)
    qkv.copy_(values)
    return replace(inputs, qkv=qkv.to(inputs.q_out.device))


def seeded_gqa_inputs(*shape, exact_sum: bool = True, **options) -> tuple[GqaInputs, int]:
    """(``make_gqa_inputs(*shape, **options)`` from a fresh seed, the seed), with qkv from
    ``exact_sum_qkv`` unless ``exact_sum`` is False: exact comparisons of a kernel with the
    reference need sums of squares that no summation order can move."""
    generator, seed = seeded_generator()
    inputs = make_gqa_inputs(*shape, generator=generator, **options)
    return (exact_sum_qkv(inputs, generator) if exact_sum else inputs), seed


@dataclass
class GqaComparison:
    """How two runs of the GQA op on the same inputs differ."""

    q_elements: int
    q_mismatches: int  # elements of q_out that differ at all
    q_max_ulp: int  # largest difference, bf16 ULPs
    cache_elements: int  # elements of k_cache and v_cache together
    cache_mismatches: int  # cache elements that differ at all (untouched ones included)
    cache_max_diff: int  # largest difference, bf16 ULPs or e4m3 codes

    def exact(self) -> bool:
        return self.q_mismatches == 0 and self.cache_mismatches == 0


def compare_gqa(a: GqaInputs, b: GqaInputs) -> GqaComparison:
    """Compare the outputs of two runs (q_out and both whole caches)."""
    ulp = bf16_ulp_diff(a.q_out, b.q_out)
    diffs = []
    for x, y in ((a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
        if x.dtype in FP8_CACHE_DTYPES:  # uint8: e4m3fn codes (vLLM's "fp8" cache)
            diffs.append(e4m3_code_diff(x.view(torch.uint8), y.view(torch.uint8)).flatten())
        else:
            diffs.append(bf16_ulp_diff(x, y).flatten())
    cache = torch.cat(diffs)
    return GqaComparison(
        q_elements=a.q_out.numel(),
        q_mismatches=int((ulp != 0).sum()),
        q_max_ulp=int(ulp.max()) if ulp.numel() else 0,
        cache_elements=cache.numel(),
        cache_mismatches=int((cache != 0).sum()),
        cache_max_diff=int(cache.max()) if cache.numel() else 0,
    )


def normed_pair_sum(inputs: GqaInputs, which: str) -> torch.Tensor:
    """``|a| + |b|`` per value of q (``which="q"``, [T, Hq, D]) or k ([T, Hkv, D]): ``a`` the
    value normed as the reference normalises it, ``b`` its RoPE partner (a pass-through dim
    is its own). A one-ULP move of the normed input, carried through RoPE, moves a result by
    at most ``2^-6`` of it (docs/ops.md, the GQA op's agreement)."""
    hq, hkv = inputs.num_q_heads, inputs.num_kv_heads
    heads = inputs.qkv.unflatten(1, (hq + 2 * hkv, -1))
    x, w = (heads[:, :hq], inputs.q_norm_weight) if which == "q" else (heads[:, hq : hq + hkv], inputs.k_norm_weight)
    normed = (rms_norm_reference(x, w, inputs.eps) if w is not None else x).float().abs()
    head_dim, rot = normed.shape[-1], inputs.cos_sin_cache.shape[1]
    d = torch.arange(head_dim)
    partner = torch.where(d < rot // 2, d + rot // 2, d - rot // 2) if inputs.is_neox else d ^ 1
    partner = torch.where(d < rot, partner, d).to(normed.device)
    return normed + normed[..., partner]


def bf16_rope_pair_bound(x: torch.Tensor, rotary_dim: int, is_neox: bool, factor: float = 1.25 * 2**-7) -> torch.Tensor:
    """How far Hugging Face's all-bf16 RoPE of ``x [..., D]`` may be from the GQA op's fp32
    rotation, per value: ``factor * (|a| + |b|)`` on rotated dims (``a``, ``b`` the value's
    pair: ``(i, i + R/2)`` NeoX, ``(2i, 2i + 1)`` GPT-J), 0 on pass-through dims.

    HF casts cos/sin to bf16 and rounds both products and their sum in bf16; with the op's
    final rounding that is four relative errors of at most 2^-9 each, 2^-7 in all (0.0081
    measured, docs/decisions.md); ``factor`` leaves a hair above it.
    """
    a = x[..., :rotary_dim].float().abs()
    if is_neox:
        partner = torch.cat((a[..., rotary_dim // 2 :], a[..., : rotary_dim // 2]), dim=-1)
    else:
        partner = a.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    bound = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    bound[..., :rotary_dim] = factor * (a + partner)
    return bound


def assert_fused_write_close(q, k_cache, v_cache, q_ref, k_ref, v_ref) -> None:
    """A fused call on CUDA beside eager code that rotates in fp32: v bit for bit; k within a
    rounding of the fp32 rotation (the kernel may contract a multiply-add eager rounds twice:
    one e4m3 code of an fp8 cache, one bf16 ULP of a bf16 one); q likewise."""
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    if k_cache.dtype == torch.float8_e4m3fn:
        assert int(e4m3_code_diff(k_cache.view(torch.uint8), k_ref.view(torch.uint8)).max()) <= 1
    else:
        torch.testing.assert_close(k_cache.float(), k_ref.float(), rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-7, atol=2**-7)
