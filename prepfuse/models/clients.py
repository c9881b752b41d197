"""Other people's code: Hugging Face transformers' own attention modules, run the way engines
run them, as cases the passes are measured on (``tests/corpus/``, ``bench/compile_overhead.py``,
``docs/passes.md``'s corpus).

An engine runs HF modeling code with an attention function of its own registered through
transformers' ``AttentionInterface`` (``ENGINE_ATTENTION``): the module projects, norms and
ropes q and k in its own layout (``[B, S, H, D]``, transposed to ``[B, H, S, D]``), and the
function writes the step's k and v into a paged cache ``[num_blocks, block_size, Hkv, D]``
by index assignment (``cache[slots // bs, slots % bs] = k.transpose(1, 2).reshape(B*S, Hkv, D)``),
or (``cache="static"``) into the static cache ``[B, Hkv, max_len, D]`` of a batch of sequences as
transformers' StaticCache does (``index_copy_(2, cache_position, k)``), then attends (SDPA over the step's tokens; where an engine reads the cache back is its own
kernel's business). ``cache="hf-paged"`` runs transformers' own serving path instead: its
continuous-batching attention function (``"paged|sdpa"``) and its ``PagedAttentionCache.update``,
which writes a token pool ``[N, Hkv, D]`` with ``index_copy_(0, write_index, k)`` and reads the
step's rows back with ``index_select`` before attending. cos/sin come from the model's own rotary module, as the model computes
them (``rotary="module"``: from ``inv_freq`` in the forward, cast to the activation dtype), or
from outside the compiled code (``rotary="inputs"``: full-width tables passed in).

``transformers`` is a test dependency, not a runtime one: this module imports it when a case
is built. Each case says how many fused calls it should give and, where the passes cannot
fuse it yet, why (``expected_reason``): the corpus table reports both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ClientCase", "CLIENT_CASES", "ENGINE_ATTENTION", "build_client", "cache_rows", "register_engine_attention",
           "sequence_rows"]

ENGINE_ATTENTION = "prepfuse_paged"  # the name the engine's attention function is registered under


def _engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An engine's attention function: the step's k and v into the paged cache by index
    assignment, then SDPA over the step's tokens (causal, GQA by repeating kv heads)."""
    k_cache, v_cache, slots, block_size = kwargs["k_cache"], kwargs["v_cache"], kwargs["slot_mapping"], kwargs["block_size"]
    batch, kv_heads, seq, head_dim = key.shape
    if k_cache.dim() == 4 and k_cache.shape[1] == kv_heads and block_size is None:
        # a static cache [B, Hkv, max_len, D], written as transformers' StaticCache
        # writes its layers (``StaticLayer.update``): index_copy_ at the cache positions
        k_cache.index_copy_(2, slots, key)
        v_cache.index_copy_(2, slots, value)
    else:
        k_cache[slots // block_size, slots % block_size] = key.transpose(1, 2).reshape(batch * seq, kv_heads, head_dim)
        v_cache[slots // block_size, slots % block_size] = value.transpose(1, 2).reshape(batch * seq, kv_heads, head_dim)
    return causal_gqa_attention(query, key, value, scaling), None


def causal_gqa_attention(query, key, value, scaling) -> torch.Tensor:
    """Causal SDPA over the step's tokens, kv heads repeated for GQA: ``[B, S, H, Dv]``."""
    groups = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous()


def register_engine_attention() -> None:
    """Register ``_engine_attention`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ENGINE_ATTENTION, _engine_attention)


@dataclass(frozen=True)
class ClientCase:
    """One piece of client code: a transformers model family's attention, how cos/sin reach
    it, and what the passes should make of it."""

    name: str
    family: str  # transformers.models.<family>
    prefix: str  # class name prefix: <prefix>Config, <prefix>Attention, <prefix>RotaryEmbedding
    rotary: str = "module"  # "module": the model's rotary module inside the compiled code; "inputs"
    expected_fused: int = 1  # fused calls per layer
    expected_reason: str = ""  # a fragment of the near miss, where nothing fuses yet
    pattern: str = ""  # the report's pattern name of each fused call
    config: tuple = ()  # extra config items
    config_prefix: str = ""  # <config_prefix>Config when it is not <prefix>Config (Gemma-3's Gemma3TextConfig)
    cache: str = "paged"  # "paged": [NB, bs, Hkv, D] by slot; "static": [B, Hkv, max_len, D] by position;
    #   "hf-paged": transformers' own PagedAttentionCache, a token pool [N, Hkv, D] written by its update
    batch: int = 1  # sequences per step (static caches only: B of them, all at the step's positions)

    @property
    def source(self) -> str:
        return f"transformers.models.{self.family}.modeling_{self.family}.{self.prefix}Attention"


CLIENT_CASES: tuple[ClientCase, ...] = (
    ClientCase("hf-qwen3", "qwen3", "Qwen3", pattern="gqa_qknorm_rope_kv+separate"),
    ClientCase("hf-llama", "llama", "Llama", pattern="gqa_rope_kv+separate"),
    ClientCase("hf-qwen2", "qwen2", "Qwen2", pattern="gqa_rope_kv+separate"),
    ClientCase("hf-mistral", "mistral", "Mistral", pattern="gqa_rope_kv+separate"),
    # one sequence's static cache, written as transformers' StaticCache writes it (index_copy_)
    ClientCase("hf-qwen3-static-cache", "qwen3", "Qwen3", cache="static", pattern="gqa_qknorm_rope_kv+separate"),
    # a batch of sequences' static cache [B, Hkv, max_len, D], every sequence at the step's
    # positions (a padded batch): the pass computes each token's slot b * max_len + pos
    ClientCase("hf-llama-static-cache-batch3", "llama", "Llama", cache="static", batch=3,
               pattern="gqa_rope_kv+separate"),
    # cos/sin made outside the compiled code: full-width values the graph cannot prove are
    # two equal halves, read whole by the op (``full_cos_sin``: cos and sin [T, R] each)
    ClientCase("hf-qwen3-cos-sin-inputs", "qwen3", "Qwen3", rotary="inputs",
               pattern="gqa_qknorm_rope_kv+separate"),
    ClientCase("hf-llama-cos-sin-inputs", "llama", "Llama", rotary="inputs",
               pattern="gqa_rope_kv+separate"),
    # transformers' own continuous-batching path: attention "paged|sdpa", PagedAttentionCache.update
    ClientCase("hf-qwen3-paged-attention-cache", "qwen3", "Qwen3", cache="hf-paged",
               pattern="gqa_qknorm_rope_kv+separate"),
    # another norm: Gemma3RMSNorm, (x * (1 + w)).to(bf16) in fp32 (the op's fp32-weight form);
    # one sliding-window and one global layer, each with its own rotary table (layer types)
    ClientCase("hf-gemma3", "gemma3", "Gemma3", config_prefix="Gemma3Text",
               config=(("layer_types", ("sliding_attention", "full_attention")), ("sliding_window", 64)),
               pattern="gqa_qknorm_rope_kv+separate"),
)


class _EngineLayers(nn.Module):
    """``num_layers`` attention modules of one model family sharing the rotary module, the
    slots and (as engines do) the step's positions: each writes its own caches."""

    def __init__(self, case: ClientCase, config, num_layers: int, block_size: int):
        super().__init__()
        module = importlib.import_module(f"transformers.models.{case.family}.modeling_{case.family}")
        attention = getattr(module, f"{case.prefix}Attention")
        self.layers = nn.ModuleList(attention(config, i) for i in range(num_layers))
        self.rotary = getattr(module, f"{case.prefix}RotaryEmbedding")(config)
        self.case, self.block_size = case, block_size

    def forward(self, x, position_ids, slot_mapping, caches, cos_sin=None):
        # per layer type (Gemma-3: sliding and global layers rotate with their own bases), as
        # the model's decoder computes them: once per type, each layer reading its type's
        # (a rotary module with layer_types takes the type; the others' layers may name one too)
        per_type = hasattr(self.rotary, "layer_types")
        types = {layer.layer_type if per_type else None for layer in self.layers}
        if cos_sin is not None:
            tables = dict.fromkeys(types, cos_sin)
        elif not per_type:
            tables = {None: self.rotary(x, position_ids)}
        else:
            tables = {t: self.rotary(x, position_ids, t) for t in sorted(types)}
        if self.case.cache == "hf-paged":  # transformers' own serving path writes and reads the pool
            pool, tokens = _token_pool(caches), x.shape[1]
            causal = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()[None, None]
            for layer in self.layers:
                out, _ = layer(x, tables[None], causal, cache=pool, read_index=[slot_mapping], write_index=[slot_mapping])
                x = x + out
            return x
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            block_size = None if self.case.cache == "static" else self.block_size
            out, _ = layer(x, tables[layer.layer_type if per_type else None], None, k_cache=k_cache, v_cache=v_cache,
                           slot_mapping=slot_mapping, block_size=block_size)
            x = x + out
        return x


def _token_pool(caches):
    """transformers' ``PagedAttentionCache`` over the given per-layer ``[N, Hkv, D]`` pools, one
    full-attention group (what its constructor would build for these layers, without the
    memory sizing it does first): its own ``update`` writes them."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    pool = PagedAttentionCache.__new__(PagedAttentionCache)
    pool.key_cache, pool.value_cache = [k for k, _ in caches], [v for _, v in caches]
    pool.layer_index_to_group_indices = {i: (0, i) for i in range(len(caches))}
    pool.sliding_windows = dict.fromkeys(range(len(caches)), 1)
    return pool


def build_client(case: ClientCase, *, num_tokens: int = 7, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 64, num_layers: int = 2, block_size: int = 16, num_blocks: int | None = None,
                 device="cpu", seed: int | None = None):
    """(model, args) for ``case``: ``model(*args)`` runs the layers on fresh random inputs
    (bf16 weights and activations, slots all valid and distinct), the caches in ``args[3]``."""
    register_engine_attention()
    module = importlib.import_module(f"transformers.models.{case.family}.modeling_{case.family}")
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in case.config}  # (tuples keep the case hashable)
    if "layer_types" in extra:  # one per layer, the case's pattern repeated
        extra["layer_types"] = [extra["layer_types"][i % len(extra["layer_types"])] for i in range(num_layers)]
    config = getattr(module, f"{case.config_prefix or case.prefix}Config")(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=64, num_hidden_layers=num_layers, max_position_embeddings=4096, **extra)
    config._attn_implementation = "paged|sdpa" if case.cache == "hf-paged" else ENGINE_ATTENTION
    with torch.random.fork_rng(devices=[]):  # fresh random weights and inputs; the global RNG is left alone
        if seed is None:
            torch.seed()
        else:
            torch.manual_seed(seed)
        model = _EngineLayers(case, config, num_layers, block_size).to(torch.bfloat16)
        for layer in model.layers:  # HF inits norm weights to ones (Gemma: zeros): make them say something
            for norm in ("q_norm", "k_norm"):
                if hasattr(layer, norm):
                    getattr(layer, norm).weight.data.uniform_(0.5, 1.5)  # Gemma applies 1 + w: 1.5 to 2.5
        x = torch.randn(case.batch, num_tokens, hidden).to(torch.bfloat16)
        num_blocks = num_blocks or -(-(num_tokens + 16) // block_size)
        slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    model = model.to(device)
    positions = torch.arange(num_tokens, device=device)[None].expand(case.batch, num_tokens)
    cache_shape = {"static": (case.batch, kv_heads, num_blocks * block_size, head_dim),  # the slots are positions
                   "hf-paged": (num_blocks * block_size, kv_heads, head_dim),  # a token pool: the slots are rows
                   }.get(case.cache, (num_blocks, block_size, kv_heads, head_dim))
    caches = [tuple(torch.full(cache_shape, -7.0, dtype=torch.bfloat16, device=device) for _ in range(2))
              for _ in range(num_layers)]
    args = [x.to(device), positions, slots.to(device), caches]
    if case.rotary == "inputs":
        with torch.no_grad():
            args.append(tuple(t.clone() for t in model.rotary(args[0], positions)))
    return model, tuple(args)


def cache_rows(caches, slots: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """fp32 rows ``[T, Hkv, D]`` every layer's k and v cache holds at ``slots``: a paged cache's
    ``cache[s // bs, s % bs]``, a static one's ``cache[b, :, s]`` (its slots are positions; ``[B*T,
    Hkv, D]``, sequence by sequence), a token pool's ``cache[s]``."""
    def rows(c):
        if c.dim() == 3:
            return c[slots]
        if c.dim() == 4 and c.shape[2] > block_size:
            return sequence_rows(c, slots)
        return c[slots // block_size, slots % block_size]
    return [rows(c).float() for pair in caches for c in pair]


def sequence_rows(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows ``[B*T, Hkv, D]`` a static cache ``[B, Hkv, S, D]`` holds at ``positions`` (every
    sequence's, sequence by sequence: the token order of ``[B, T, ...]`` activations)."""
    return cache[:, :, positions].transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])
