"""Other people's code, part two: attention-input preparation as serving engines and
reference projects spell it, written here after reading theirs (vLLM's ``forward_native``
layers, SGLang's token pool, gpt-fast's Llama, nano-vllm's in-place norm), as cases the passes
are measured on (``tests/corpus/test_engines.py``, ``docs/passes.md``'s corpus).

Each case is one attention layer's preparation in the engine's own spelling, then its cache
write, then SDPA over the step's tokens (so the prepared values have a real reader). The
spellings, by engine:

- **vLLM** (``RMSNorm.forward_native``, ``RotaryEmbedding.forward_native``): one fused
  ``qkv_proj``, ``split``; q/k viewed ``[T, H, D]`` for the norm (``x.to(fp32)``,
  ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``, ``.to(bf16) * weight``) and back;
  ``cos_sin = cos_sin_cache.index_select(0, positions)``, ``cos, sin = cos_sin.chunk(2, -1)``,
  the rotation ``x1 * cos - x2 * sin`` with ``cos.unsqueeze(-2).to(x.dtype)`` (in bf16, the
  table in the model dtype as vLLM builds it, or fp32), NeoX ``chunk`` or GPT-J ``x[..., ::2]``
  and ``stack(...).flatten(-2)``, ``cat`` of the pass-through part; the paged insert
  ``reshape_and_cache_flash`` as index assignment into ``[NB, bs, Hkv, D]``.
- **SGLang**: the same rotation (SGLang's ``forward_native`` is vLLM's); the flat token pool
  ``k_buffer[loc] = k`` (``[N, Hkv, D]``), an fp8 pool storing ``(k / k_scale).to(fp8)``
  (no clamp).
- **gpt-fast**: ``[B, S, H, D]`` activations, ``freqs_cis`` a ``[S, D/2, 2]`` bf16 table of
  (cos, sin) pairs indexed by ``input_pos``, the GPT-J rotation on ``x.float().reshape(...,
  -1, 2)`` then ``type_as(x)``; ``transpose(1, 2)``; ``k_out[:, :, input_pos] = k`` into the
  ``[B, Hkv, S_max, D]`` cache of B sequences (all at ``input_pos``; ``freqs_cis`` shared by them).
- **FlashInfer** (``append_paged_kv_cache``): vLLM's preparation, the rows written through a
  page table, ``cache[page_table[pos // bs], pos % bs] = k``.
- **nano-vllm**: ``RMSNorm`` in place (``x.float()``, ``x.mul_(rsqrt(var + eps))``,
  ``x.to(dtype).mul_(weight)``), the rotation in fp32 on ``chunk(x.float(), 2)`` with a
  ``[P, 1, D]`` fp32 table ``cos_sin_cache[positions].chunk(2, -1)``, ``cat(...).to(dtype)``.
  Its ``store_kvcache`` kernel addresses the paged cache by slot alone (row ``slot * D`` of
  ``[NB, bs, Hkv, D]``); the ``slot_view`` case writes that as PyTorch does,
  ``k_cache.view(-1, Hkv, D)[slots] = k``.

Each case says how many fused calls it should give and, where the passes cannot fuse it
yet, why (``expected_reason``); a case of several layers shares positions and slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prepfuse._compat import e4m3_cast_overflow
from prepfuse.models.clients import sequence_rows

__all__ = ["EngineCase", "ENGINE_CASES", "build_engine_client", "engine_cache_rows"]

_ENGINES = ("vllm", "sglang", "gpt-fast", "nano-vllm", "flashinfer")


@dataclass(frozen=True)
class EngineCase:
    """One engine's spelling of a layer's preparation (see the module docstring)."""

    name: str
    engine: str
    qk_norm: bool = True  # Qwen3; False: Llama
    is_neox: bool = True
    rotary_dim: int | None = None  # None: the whole head
    table_dtype: torch.dtype = torch.bfloat16  # vLLM / SGLang cos_sin_cache dtype (vLLM: the model's)
    cache_dtype: torch.dtype = torch.bfloat16
    expected_fused: int = 1  # fused calls per layer
    expected_reason: str = ""  # a fragment of the near miss, where nothing fuses yet
    pattern: str = ""  # the report's pattern name of each fused call
    slot_view: bool = False  # write the paged cache through its flat slot view, cache.view(-1, Hkv, D)[slots]
    batch: int = 1  # gpt-fast: sequences per step, all at the step's positions ([B, Hkv, S, D] caches)

    def __post_init__(self) -> None:
        if self.engine not in _ENGINES:
            raise ValueError(f"engine: must be one of {_ENGINES}, got {self.engine!r}")

    @property
    def bare_fp8_cast(self) -> bool:
        """SGLang's pool and vLLM's ``reshape_and_cache_flash.forward_native`` (a uint8 cache)
        store ``(k / k_scale).to(fp8)`` with no clamp; the others clamp to +-448."""
        return (self.engine == "sglang" and self.cache_dtype == torch.float8_e4m3fn) or self.cache_dtype == torch.uint8

    def expected_on(self, device_type: str) -> tuple[int, str]:
        """(fused calls per layer, a fragment of the near miss where none) on ``device_type``:
        a bare fp8 cast is the op saturating or giving NaN past 464 as torch's cast on that
        device does (``_compat.e4m3_cast_overflow``), and declined where the cast does neither."""
        if self.bare_fp8_cast and e4m3_cast_overflow(device_type) is None:
            return 0, "neither saturation nor NaN past 464"
        return self.expected_fused, self.expected_reason

    @property
    def bf16_rope(self) -> bool:
        """vLLM and SGLang rotate in bf16 (``cos.to(x.dtype)``, three roundings; the fused op
        rotates in fp32): their rows are held to a bound, not bit for bit."""
        return self.engine in ("vllm", "sglang", "flashinfer")

    @property
    def source(self) -> str:
        return {
            "vllm": "vLLM `RMSNorm` / `RotaryEmbedding.forward_native`, `reshape_and_cache_flash` as index assignment",
            "sglang": "SGLang `forward_native` rotation, `MHATokenToKVPool.set_kv_buffer`",
            "gpt-fast": "gpt-fast `apply_rotary_emb`, `KVCache.update`",
            "nano-vllm": "nano-vllm `RMSNorm` (in place), `RotaryEmbedding`",
            "flashinfer": "vLLM's preparation, the cache written through a page table (FlashInfer's `append_paged_kv_cache`)",
        }[self.engine]


_QK = "gqa_qknorm_rope_kv"
_NO_NORM = "gqa_rope_kv"
ENGINE_CASES: tuple[EngineCase, ...] = (
    EngineCase("vllm-qwen3", "vllm", pattern=_QK),
    EngineCase("vllm-qwen3-fp32-table", "vllm", table_dtype=torch.float32, pattern=_QK),
    EngineCase("vllm-llama-gptj-partial", "vllm", qk_norm=False, is_neox=False, rotary_dim=32, pattern=_NO_NORM),
    EngineCase("vllm-llama-fp8", "vllm", qk_norm=False, cache_dtype=torch.float8_e4m3fn, pattern=_NO_NORM),
    # what vLLM runs under torch.compile: reshape_and_cache_flash.forward_native, fp8 codes held
    # in a uint8 cache, written by a bare cast (no clamp)
    EngineCase("vllm-llama-fp8-uint8-cache", "vllm", qk_norm=False, cache_dtype=torch.uint8, pattern=_NO_NORM),
    EngineCase("sglang-qwen3-token-pool", "sglang", pattern=_QK),
    EngineCase("sglang-llama-fp8-token-pool", "sglang", qk_norm=False, cache_dtype=torch.float8_e4m3fn, pattern=_NO_NORM),
    EngineCase("gpt-fast-llama", "gpt-fast", qk_norm=False, is_neox=False, pattern="gqa_rope_kv"),
    # a batch of two sequences at the same positions: freqs_cis shared by both (size 1 on the
    # batch dim), each token's slot b * S + pos
    EngineCase("gpt-fast-llama-batch2", "gpt-fast", qk_norm=False, is_neox=False, pattern="gqa_rope_kv", batch=2),
    EngineCase("nano-vllm-qwen3", "nano-vllm", table_dtype=torch.float32, pattern="gqa_qknorm_rope_kv"),
    EngineCase("nano-vllm-qwen3-slot-view", "nano-vllm", table_dtype=torch.float32, pattern="gqa_qknorm_rope_kv",
               slot_view=True),
    # a page table maps each position's logical page to a block: the pass computes the op's
    # slot per token in front of the call (page_table[pos // bs] * bs + pos % bs)
    EngineCase("flashinfer-qwen3-page-table", "flashinfer", pattern=_QK),
)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    if in_place:  # nano-vllm
        x.mul_(torch.rsqrt(variance + eps))
        return x.to(dtype).mul_(weight)
    x = x * torch.rsqrt(variance + eps)
    return x.to(dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """vLLM's and SGLang's native rotation: ``x [T, H, R]``, ``cos``/``sin`` ``[T, R/2]``, in
    x's dtype (cos/sin cast to it, as vLLM does)."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)


class _EngineLayer(nn.Module):
    """One attention layer's preparation, cache write and SDPA, in ``case.engine``'s spelling."""

    def __init__(self, case: EngineCase, hidden: int, heads: int, kv_heads: int, head_dim: int, max_pos: int):
        super().__init__()
        self.case, self.heads, self.kv_heads, self.head_dim = case, heads, kv_heads, head_dim
        self.rotary_dim = case.rotary_dim or head_dim
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.Parameter(torch.empty(head_dim).uniform_(0.5, 1.5)) if case.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(head_dim).uniform_(0.5, 1.5)) if case.qk_norm else None
        self.eps = 1e-6
        self.max_pos = max_pos

    def build_tables(self) -> None:
        """The cos/sin table in the engine's layout and dtype, from fp32 angles (after the
        module's cast to bf16, which would round an fp32 table)."""
        r = self.rotary_dim
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        freqs = torch.outer(torch.arange(self.max_pos, dtype=torch.float), inv_freq)
        device = self.qkv_proj.weight.device
        if self.case.engine == "gpt-fast":  # [S, R/2, 2] (cos, sin) pairs, bf16
            self.register_buffer("freqs_cis", torch.stack((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16).to(device))
            return
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        if self.case.engine == "nano-vllm":  # [P, 1, R]: cos then sin, fp32
            self.register_buffer("cos_sin_cache", table.unsqueeze(1).to(device))
        else:  # vLLM / SGLang: [P, R], cos then sin, in table_dtype
            self.register_buffer("cos_sin_cache", table.to(self.case.table_dtype).to(device))

    # -- preparation, per engine ------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight) -> torch.Tensor:
        if weight is None:
            return x
        return _rms_norm(x, weight, self.eps, in_place=self.case.engine == "nano-vllm")

    def _vllm_rope(self, positions, q, k):
        """``RotaryEmbedding.forward_native``: q/k ``[T, H*D]`` flat, rotated per head."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        out = []
        for x in (q, k):
            shape = x.shape
            x = x.view(positions.shape[0], -1, self.head_dim)
            rot = _rotate(x[..., : self.rotary_dim], cos, sin, self.case.is_neox)
            out.append(torch.cat((rot, x[..., self.rotary_dim :]), dim=-1).reshape(shape))
        return out

    def _nano_rope(self, positions, q, k):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, 1, R/2] each
        out = []
        for x in (q, k):
            x1, x2 = torch.chunk(x.float(), 2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
        return out

    def _gpt_fast_rope(self, x, input_pos):
        """gpt-fast's ``apply_rotary_emb``: ``x [B, S, H, D]``, pairs (2i, 2i + 1)."""
        freqs_cis = self.freqs_cis[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
        out = torch.stack(
            [
                xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
                xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
            ],
            -1,
        )
        return out.flatten(3).type_as(x)

    def forward(self, x, positions, slots, k_cache, v_cache, kv_scale, block_size):
        hq, hkv, d = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        if self.case.engine == "gpt-fast":
            return self._gpt_fast_forward(x, positions, k_cache, v_cache)
        q, k, v = self.qkv_proj(x).split([hq, hkv, hkv], dim=-1)
        if self.case.engine == "nano-vllm":
            q = self._norm(q.view(-1, self.heads, d), self.q_norm)
            k = self._norm(k.view(-1, self.kv_heads, d), self.k_norm)
            v = v.view(-1, self.kv_heads, d)
            q, k = self._nano_rope(positions, q, k)
        else:
            q = self._norm(q.view(*q.shape[:-1], self.heads, d), self.q_norm).view(q.shape)
            k = self._norm(k.view(*k.shape[:-1], self.kv_heads, d), self.k_norm).view(k.shape)
            q, k = self._vllm_rope(positions, q, k)
            q, k, v = q.view(-1, self.heads, d), k.view(-1, self.kv_heads, d), v.view(-1, self.kv_heads, d)
        self._write(k, v, positions, slots, k_cache, v_cache, kv_scale, block_size)
        return self.o_proj(self._attend(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2)))

    def _gpt_fast_forward(self, x, input_pos, k_cache, v_cache):
        bsz, seqlen, _ = x.shape
        hq, hkv, d = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        q, k, v = self.qkv_proj(x).split([hq, hkv, hkv], dim=-1)
        q = self._gpt_fast_rope(q.view(bsz, seqlen, self.heads, d), input_pos)
        k = self._gpt_fast_rope(k.view(bsz, seqlen, self.kv_heads, d), input_pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v.view(bsz, seqlen, self.kv_heads, d)))
        k_cache[:, :, input_pos] = k  # KVCache.update
        v_cache[:, :, input_pos] = v
        return self.o_proj(self._attend(q, k, v))

    def _write(self, k, v, positions, slots, k_cache, v_cache, kv_scale, block_size):
        fp8 = self.case.cache_dtype == torch.float8_e4m3fn
        if self.case.cache_dtype == torch.uint8:  # reshape_and_cache_flash.forward_native: codes as uint8
            k = (k / kv_scale).to(torch.float8_e4m3fn).view(k_cache.dtype)
            v = (v / kv_scale).to(torch.float8_e4m3fn).view(v_cache.dtype)
            blocks, offsets = torch.floor_divide(slots, block_size), slots % block_size
            k_cache[blocks, offsets, :, :] = k[:slots.shape[0]]
            v_cache[blocks, offsets, :, :] = v[:slots.shape[0]]
            return
        if self.case.engine == "flashinfer":  # slots is the page table: logical page -> block
            pages = slots[positions // block_size]
            k_cache[pages, positions % block_size] = k
            v_cache[pages, positions % block_size] = v
            return
        if self.case.engine == "sglang":  # set_kv_buffer: the token pool [N, Hkv, D]
            if fp8:
                k, v = (k / kv_scale).to(torch.float8_e4m3fn), (v / kv_scale).to(torch.float8_e4m3fn)
            k_cache[slots] = k
            v_cache[slots] = v
            return
        if fp8:  # vLLM's scaled_convert: a true division, saturating
            k = (k.float() / kv_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            v = (v.float() / kv_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        if self.case.slot_view:  # nano-vllm's store_kvcache: slot s is row s of the merged blocks
            k_cache.view(-1, *k_cache.shape[2:])[slots] = k
            v_cache.view(-1, *v_cache.shape[2:])[slots] = v
            return
        k_cache[slots // block_size, slots % block_size] = k
        v_cache[slots // block_size, slots % block_size] = v

    def _attend(self, q, k, v):
        """SDPA over the step's tokens, ``[B, H, S, D]`` in; ``[B*S, H*D]`` out."""
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)
        return out.transpose(1, 2).reshape(-1, self.heads * self.head_dim)


class _EngineLayers(nn.Module):
    def __init__(self, case: EngineCase, num_layers: int, **sizes):
        super().__init__()
        self.case = case
        self.layers = nn.ModuleList(_EngineLayer(case, **sizes) for _ in range(num_layers))

    def forward(self, x, positions, slots, caches, kv_scale, block_size: int):
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            out = layer(x, positions, slots, k_cache, v_cache, kv_scale, block_size)
            x = x + out.view(x.shape)
        return x


def build_engine_client(case: EngineCase, *, num_tokens: int = 7, hidden: int = 256, heads: int = 4,
                        kv_heads: int = 2, head_dim: int = 64, num_layers: int = 2, block_size: int = 16,
                        num_blocks: int | None = None, max_pos: int = 4096, device="cpu", seed: int | None = None):
    """(model, args) for ``case``: ``model(*args)`` runs the layers on fresh random inputs
    (bf16, positions ``0..T-1``, slots all valid and distinct), the caches in ``args[3]``.

    Caches per engine: vLLM paged ``[NB, bs, Hkv, D]`` by slot; SGLang a token pool
    ``[NB * bs, Hkv, D]`` by slot; gpt-fast ``case.batch`` sequences' ``[B, Hkv, NB * bs, D]`` by
    position (its slots are the positions, its x ``[B, T, hidden]``); FlashInfer paged by a page table (its slots are
    the table, a permutation of the blocks)."""
    with torch.random.fork_rng(devices=[]):  # fresh random weights and inputs; the global RNG is left alone
        if seed is None:
            torch.seed()
        else:
            torch.manual_seed(seed)
        model = _EngineLayers(case, num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              max_pos=max_pos).to(torch.bfloat16)
        for layer in model.layers:
            layer.build_tables()
        num_blocks = num_blocks or -(-(num_tokens + 16) // block_size)
        x = torch.randn(case.batch * num_tokens, hidden).to(torch.bfloat16)
        slots = torch.randperm(num_blocks * block_size)[:num_tokens]
        if case.engine == "flashinfer":
            slots = torch.randperm(num_blocks)
    positions = torch.arange(num_tokens)
    if case.engine == "gpt-fast":
        x, slots = x.view(case.batch, num_tokens, hidden), positions
        cache_shape = (case.batch, kv_heads, num_blocks * block_size, head_dim)
    elif case.engine == "sglang":
        cache_shape = (num_blocks * block_size, kv_heads, head_dim)
    else:
        cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    poison = torch.float8_e4m3fn if case.cache_dtype == torch.uint8 else case.cache_dtype  # uint8: fp8 codes
    caches = [tuple(torch.full(cache_shape, -7.0, device=device).to(poison).view(case.cache_dtype) for _ in range(2))
              for _ in range(num_layers)]
    kv_scale = torch.tensor([3.0 / 448.0], device=device)
    model = model.to(device)
    return model, (x.to(device), positions.to(device), slots.to(device), caches, kv_scale, block_size)


def engine_cache_rows(case: EngineCase, caches, slots: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """fp32 rows ``[T, Hkv, D]`` every layer's k and v cache holds at ``slots`` (for FlashInfer,
    the page table: the rows of positions ``0..T-1``, as many as the table's pages hold)."""
    def rows(c):
        if case.engine == "flashinfer":
            positions = torch.arange(slots.shape[0] * block_size, device=slots.device)
            return c[slots[positions // block_size], positions % block_size]
        if case.engine == "gpt-fast":
            return sequence_rows(c, slots)
        if case.engine == "sglang":
            return c[slots]
        return c[slots // block_size, slots % block_size]
    def values(r):  # a uint8 cache holds e4m3 codes
        return (r.view(torch.float8_e4m3fn) if r.dtype == torch.uint8 else r).float()
    return [values(rows(c)) for pair in caches for c in pair]
