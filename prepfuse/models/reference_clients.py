"""Other people's code, part three: attention-input preparation as thirteen more projects spell
it, transcribed into plain PyTorch as test cases (``tests/corpus/test_references.py``). Each case
runs the source's own preparation and cache write, then SDPA over the step's tokens and an output
projection with a residual; the layers are in ``prepfuse.models.references`` (one module a
source). What each spells its own way:

- **meta-llama/llama**: separate ``wq/wk/wv``; a complex64 ``torch.polar`` table sliced by a Python
  int; GPT-J pairs through ``view_as_complex``; ``cache_k[:bsz, start_pos : start_pos + seqlen] = xk``.
- **llama-models** Llama 4: the same, then a weightless fp32 ``rmsnorm`` of q and k after RoPE.
- **llama2.c**: Meta's rotation in real arithmetic on fp32 ``freqs_cos``/``freqs_sin`` ``[S, D/2]``.
- **mistral-inference**: packed ``[T, H, D]``, the complex table gathered by positions, a rolling
  buffer written ``cache.view(-1, Hkv, D).index_copy_(0, positions % W + batch_idx * W, ..)``.
- **torchtitan** Qwen3: one ``wqkv`` grouped per kv head ``[T, n_kv, hpk + 2, D]``, ``nn.RMSNorm``,
  one fp32 ``cat(cos, sin)`` table gathered by positions.
- **litgpt**: one ``qkv``, the norm on ``[B, H, T, D]`` with the weight in fp32, fp32 cos/sin by
  ``index_select``, ``k_cache[:bs, ...].index_copy_(-2, input_pos, k)``; OLMo-2 norms over all heads.
- **gemma_pytorch** Gemma 3: ``(1 + w.float())``, complex NeoX RoPE, a local and a global table,
  ``k_cache.index_copy_(1, input_positions, xk)``, ``q.mul_(scaling)``.
- **lmdeploy**: views of the packed qkv rotated in place (``mul_``, ``add_``), bf16 cos/sin from
  ``position_ids``, the fill through block offsets, fp8 with separate k and v scales.
- **text-generation-inference**: K and V strided views of the projection rotated in place by
  flash-attention's kernel, ``(k.float() * scale.reciprocal()).clamp(...)`` into a uint8 view,
  ``cache.view(-1, Hkv, D)[slots] = k``; Gemma 3's norm on a 2-d ``reshape(-1, D)``.
- **flash-attention**: half-width bf16 tables tiled ``"... d -> ... 1 (2 d)"``, partial rotary, K and
  V in one ``[B, S, 2, Hkv, D]`` cache written by slice assignment.
- **Megatron-LM**: sequence-first ``[S, B, H, D]``, qkv grouped per kv head, bf16 cos/sin; dynamic
  batching writes ``memory_buffer[0, layer, block_idx, local_idx] = key[:n]``.
- **TensorRT-LLM**: 2-d ``[T, H*D]`` q and k, the norm on ``reshape(-1, head_dim)``, RoPE through a
  ``transpose``, ``index_copy_`` through an int16 or int8 view of one request's block.
- **lightllm** Qwen3: k and v projected by ``mm(out=)`` into one ``[T, Hk + Hv, D]`` buffer, norms
  in place, RoPE in bf16, copied to a token pool ``kv_buffer[layer][mem_index]``.

Each case says how many fused calls a GQA prep op could make of a layer (``expected_fused``: what
the math allows, not what the passes do) and what is distinctive (``note``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prepfuse.models.references import FP8, MODELS, Sizes

__all__ = ["ReferenceCase", "REFERENCE_CASES", "build_reference_client", "reference_cache_rows"]

_VARIANTS = {
    "meta-llama": ("llama2", "llama4", "llama2c"), "mistral": ("",), "torchtitan": ("",),
    "litgpt": ("default", "olmo2"), "gemma": ("",), "lmdeploy": ("",), "tgi": ("llama", "gemma3"),
    "flash-attn": ("",), "megatron": ("static", "dynamic"), "trtllm": ("qwen3", "llama"), "lightllm": ("",),
}


@dataclass(frozen=True)
class ReferenceCase:
    """One source's spelling of a layer's preparation (see the module docstring)."""

    name: str
    family: str  # the model class in references.MODELS
    source: str  # repository and file(s) the spelling is from
    expected_fused: int  # fused calls per layer a GQA prep op could make: 1 or 0
    note: str
    variant: str = ""
    kv_heads: int = 2  # 1 where the source's model is MQA
    cache_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.variant not in _VARIANTS.get(self.family, ()):
            raise ValueError(f"{self.name}: no variant {self.variant!r} of family {self.family!r}")
        if self.expected_fused not in (0, 1):
            raise ValueError(f"{self.name}: expected_fused is 0 or 1, got {self.expected_fused}")


_LMDEPLOY = ("InternLM/lmdeploy lmdeploy/pytorch/{models/llama.py,nn/linear/utils.py,backends/default/*,"
             "kernels/cuda/fill_kv_cache.py}, tests/pytorch/kernel/test_fill_kv_cache.py")
REFERENCE_CASES: tuple[ReferenceCase, ...] = (
    ReferenceCase("llama-ref-complex", "meta-llama", "meta-llama/llama llama/model.py", 1,
                  "complex64 GPT-J RoPE on [B, S, H, D], table sliced by a Python int; slice-assigned cache",
                  variant="llama2"),
    ReferenceCase("llama4-norm-after-rope", "meta-llama", "meta-llama/llama-models models/llama4/model.py", 1,
                  "weightless fp32 RMSNorm after RoPE; the op norms first (with w = 1 the two orders agree in "
                  "exact math, a rotation keeps each head's norm; where bf16 rounds differs within the probes' bounds)",
                  variant="llama4"),
    ReferenceCase("llama2c-real-gptj", "meta-llama", "karpathy/llama2.c model.py", 1,
                  "Meta's rotation without complex dtype: unbind / stack; the cache is Meta's (llama2.c has none)",
                  variant="llama2c"),
    ReferenceCase("mistral-inference-rolling", "mistral", "mistralai/mistral-inference src/mistral_inference/"
                  "{rope,transformer_layers,cache}.py", 1,
                  "packed [T, H, D], complex table gathered by positions; bool-mask select, then index_copy_ "
                  "into the flat view of a rolling [B, W, Hkv, D] buffer"),
    ReferenceCase("torchtitan-qwen3", "torchtitan", "pytorch/torchtitan torchtitan/models/common/"
                  "{attention,rope,nn_modules}.py", 1,
                  "wqkv grouped per kv head, split on dim -2; nn.RMSNorm; fp32 cat(cos, sin) table, fp32 "
                  "rotation; the paged write is vLLM's (torchtitan has no cache)"),
    ReferenceCase("litgpt-qwen3", "litgpt", "Lightning-AI/litgpt litgpt/model.py", 1,
                  "norm on the transposed [B, H, T, D] view, weight.float() multiply; fp32 cos/sin by "
                  "promotion; index_copy_(-2, input_pos, k) into [B, Hkv, S, D]", variant="default"),
    ReferenceCase("litgpt-olmo2", "litgpt", "Lightning-AI/litgpt litgpt/model.py (norm_qk_type='olmo2')", 0,
                  "q/k RMSNorm over all heads (H * D wide) before the head view", variant="olmo2"),
    ReferenceCase("gemma-pytorch-gemma3", "gemma", "google/gemma_pytorch gemma/model.py", 1,
                  "(1 + w.float()) norm; complex RoPE with NeoX pairs by stack(chunk); local and global "
                  "tables; index_copy_(1, positions, xk) of a non-contiguous xk; MQA", kv_heads=1),
    ReferenceCase("lmdeploy-llama", "lmdeploy", _LMDEPLOY, 1,
                  "in-place bf16 RoPE on split / unflatten views of the packed qkv; two sequences filled by "
                  "block offsets in three slice writes a cache (one crosses a block)"),
    # one sequence, one slice write a cache: Inductor's CPU code cannot compile two writes into
    # one float8 tensor (torch 2.13: "Promotion for Float8 Types is not supported")
    ReferenceCase("lmdeploy-llama-fp8", "lmdeploy", _LMDEPLOY, 0,
                  "lmdeploy-llama's spelling, one sequence; fp8 clamp(k.float() / k_scale) with separate k "
                  "and v scales (the op takes one kv_scale)", cache_dtype=FP8),
    ReferenceCase("tgi-llama-fp8", "tgi", "huggingface/text-generation-inference server/text_generation_server/"
                  "{models/custom_modeling/flash_llama_modeling.py,layers/rotary.py,layers/attention/kv_cache.py,"
                  "layers/fp8.py}", 1,
                  "K, V strided views of [T, 2, Hkv, D] rotated in place (float kernel, half-width bf16 "
                  "cos/sin); fp8 by x * scale.reciprocal(), clamp; uint8-view flat-slot write",
                  variant="llama", cache_dtype=FP8),
    ReferenceCase("tgi-gemma3", "tgi", "huggingface/text-generation-inference server/text_generation_server/"
                  "models/custom_modeling/flash_gemma3_modeling.py", 1,
                  "norm on a 2-d reshape(-1, D).contiguous() with an fp32 w + 1; in-place RoPE; MQA",
                  variant="gemma3", kv_heads=1),
    ReferenceCase("flash-attn-partial-kv-cache", "flash-attn", "Dao-AILab/flash-attention flash_attn/"
                  "{layers/rotary.py,modules/mha.py}", 1,
                  "bf16 half-width tables tiled (2 d), rotary dim 32 of 64; K and V in one [B, S, 2, Hkv, D] "
                  "cache by slice assignment"),
    ReferenceCase("megatron-static-pre-rope", "megatron", "NVIDIA/Megatron-LM megatron/core/transformer/"
                  "attention.py, models/common/embeddings/rope_utils.py", 0,
                  "[S, B, H, D]; the static cache stores un-rotated keys, the prefix rotated after",
                  variant="static"),
    ReferenceCase("megatron-dynamic-paged", "megatron", "NVIDIA/Megatron-LM megatron/core/{transformer/"
                  "attention.py,inference/contexts/dynamic_context.py}", 1,
                  "[S, B, H, D], qkv grouped per kv head; nn.RMSNorm; GPT-J bf16 RoPE written back into "
                  "key[:n]; two-index write into one [2, L, NB, BS, Hkv, D] buffer", variant="dynamic"),
    ReferenceCase("trtllm-qwen3", "trtllm", "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/{modules/rms_norm.py,"
                  "modules/rotary_embedding.py,modules/qk_norm_attention.py,attention_backend/vanilla.py}", 1,
                  "2-d q/k, norm on reshape(-1, D); RoPE via transpose round trip; index_copy_ through an "
                  "int16 view of one request's block", variant="qwen3"),
    ReferenceCase("trtllm-llama-fp8", "trtllm", "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/{modules/"
                  "rotary_embedding.py,attention_backend/vanilla.py}", 1,
                  "bare .to(e4m3) (no scale, no clamp), index_copy_ through an int8 view", variant="llama",
                  cache_dtype=FP8),
    ReferenceCase("lightllm-qwen3", "lightllm", "ModelTC/lightllm lightllm/models/qwen3/layer_infer/"
                  "transformer_layer_infer.py, triton_kernel/{rmsnorm,rotary_emb,destindex_copy_kv}.py", 1,
                  "k|v by mm(out=) into one buffer, norms in place / slice-assigned back, bf16 in-place "
                  "RoPE; token pool with K and V heads on one axis"),
)

_POS0 = 5  # first position of single-sequence steps: tables are read at rows other than 0..T-1
_HISTORY = (14, 5)  # packed two-sequence steps: tokens already cached per sequence (14 crosses a block)


def _packed(num_tokens: int, history=_HISTORY):
    """Sequences of ``T - T // 2`` and ``T // 2`` new tokens after ``history`` (all ``T`` after
    one history): (seq_lens, positions [T], sequence index per token [T])."""
    seq_lens = [num_tokens - num_tokens // 2, num_tokens // 2] if len(history) == 2 else [num_tokens]
    positions = torch.cat([torch.arange(h, h + n) for h, n in zip(history, seq_lens)])
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(seq_lens)])
    return seq_lens, positions, seq_ids


def _block_table(seq_lens, block_size: int, num_blocks: int, history=_HISTORY):
    """A ``[B, max_blocks]`` table of distinct random blocks covering each sequence's rows."""
    need = max(-(-(h + n) // block_size) for h, n in zip(history, seq_lens))
    assert len(seq_lens) * need <= num_blocks
    return torch.randperm(num_blocks)[: len(seq_lens) * need].view(len(seq_lens), need)


def _step_and_caches(case: ReferenceCase, s: Sizes, num_tokens: int):
    """(x's shape, the step's metadata, (how the caches are held, a cache's shape)): "pair" a
    k and a v cache per layer, "one" a tensor per layer, "shared" one tensor for every layer."""
    T, bs, kv, d, L = num_tokens, s.block_size, s.kv_heads, s.head_dim, s.num_layers
    num_blocks = 2 * -(-(max(_HISTORY) + T) // bs) + 1
    seq_len_max = _POS0 + T + 4
    f = case.family
    if f == "meta-llama":  # two sequences at start_pos, a cache of three
        return (2, T, s.hidden), {"start_pos": _POS0}, ("pair", (3, seq_len_max, kv, d))
    if f == "mistral":  # W = bs rows a sequence: the first one's positions wrap
        seq_lens, positions, seq_ids = _packed(T)
        to_cache_mask = torch.tensor(sum([[x >= n - bs for x in range(n)] for n in seq_lens], []))
        cache_positions = (positions % bs + seq_ids * bs)[to_cache_mask]
        return (T, s.hidden), {"positions": positions, "to_cache_mask": to_cache_mask,
                               "cache_positions": cache_positions}, ("pair", (2, bs, kv, d))
    if f == "torchtitan":
        step = {"positions": torch.arange(_POS0, _POS0 + T), "slots": torch.randperm(num_blocks * bs)[:T]}
        return (T, s.hidden), step, ("pair", (num_blocks, bs, kv, d))
    if f == "litgpt":
        return (1, T, s.hidden), {"input_pos": torch.arange(_POS0, _POS0 + T)}, ("pair", (2, kv, seq_len_max, d))
    if f == "gemma":
        return (1, T, s.hidden), {"input_positions": torch.arange(_POS0, _POS0 + T)}, ("pair", (1, seq_len_max, kv, d))
    if f == "lmdeploy":
        history = (_POS0,) if case.cache_dtype == FP8 else _HISTORY  # one write a cache (the case table)
        seq_lens, positions, _ = _packed(T, history)
        step = {"position_ids": positions[None], "seq_lens": seq_lens, "history_lens": list(history),
                "block_offsets": _block_table(seq_lens, bs, num_blocks, history)}
        if case.cache_dtype == FP8:
            step |= {"k_scale": torch.tensor(3.0 / 448.0), "v_scale": torch.tensor(2.0 / 448.0)}
        return (1, T, s.hidden), step, ("pair", (num_blocks, bs, kv, d))
    if f == "tgi":
        _, positions, _ = _packed(T)
        scale = 3.0 / 448.0 if case.cache_dtype == FP8 else 1.0  # get_kv_scales: one kv_scale for k and v
        step = {"position_ids": positions, "slots": torch.randperm(num_blocks * bs)[:T],
                "kv_scale": torch.tensor(scale), "kv_scale_cpu": scale}
        return (T, s.hidden), step, ("pair", (num_blocks, bs, kv, d))
    if f == "flash-attn":
        return (1, T, s.hidden), {"seqlen_offset": _POS0}, ("one", (1, seq_len_max, 2, kv, d))
    if f == "megatron" and case.variant == "static":
        step = {"sequence_len_offset": _POS0, "batch_size_offset": 0}
        return (T, 1, s.hidden), step, ("pair", (seq_len_max, 1, kv, d))
    if f == "megatron":
        seq_lens, positions, seq_ids = _packed(T)
        table = _block_table(seq_lens, bs, num_blocks)
        step = {"padded_active_token_count": T, "token_to_position_in_request": positions,
                "token_to_block_idx": table[seq_ids, positions // bs],
                "token_to_local_position_within_kv_block": positions % bs}
        return (T, 1, s.hidden), step, ("shared", (2, L, num_blocks, bs, kv, d))
    if f == "trtllm":
        assert _POS0 + T <= bs, "one request's tokens fit its block"
        step = {"position_ids": torch.arange(_POS0, _POS0 + T)[None], "past_seen_token": _POS0,
                "cache_idx": int(torch.randint(0, 3, ()))}
        return (T, s.hidden), step, ("one", (3, 2, bs, kv, d))
    if f == "lightllm":
        _, positions, _ = _packed(T)
        size = num_blocks * bs
        step = {"position_ids": positions, "mem_index": torch.randperm(size)[:T]}
        return (T, s.hidden), step, ("shared", (L, size + 1, 2 * kv, d))
    raise AssertionError(f)


def build_reference_client(case: ReferenceCase, *, num_tokens: int = 7, num_layers: int = 2, device="cpu",
                           seed: int = 0):
    """(module, args) for ``case``: ``module(*args)`` = ``module(x, step, caches)`` runs
    ``num_layers`` layers on fresh bf16 inputs (every slot and position valid and distinct; a
    source's Python-int offsets stay Python ints in ``step``, constants to the compiled graph),
    writing the caches in ``args[2]``, which hold random rows before (a history the
    attention of the sources that read the cache back attends over)."""
    s = Sizes(hidden=256, heads=4, kv_heads=case.kv_heads, head_dim=64, block_size=16, max_pos=4096,
              num_layers=num_layers)
    with torch.random.fork_rng(devices=[]):  # fresh weights and inputs; the global RNG is left alone
        torch.manual_seed(seed)
        model = MODELS[case.family](case, s).to(torch.bfloat16)
        model.finish()
        x_shape, step, (held, shape) = _step_and_caches(case, s, num_tokens)
        x = torch.randn(x_shape).to(torch.bfloat16)

        def history(shape):
            return torch.randn(shape).to(case.cache_dtype).to(device)

        if held == "shared":
            caches = history(shape)
        elif held == "one":
            caches = [history(shape) for _ in range(num_layers)]
        else:
            caches = [(history(shape), history(shape)) for _ in range(num_layers)]
    step = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in step.items()}
    return model.to(device), (x.to(device), step, caches)


def reference_cache_rows(case: ReferenceCase, caches, step: dict, num_tokens: int = 7) -> list[torch.Tensor]:
    """fp32 rows ``[N, Hkv, D]`` every layer's k and v cache holds where a step of ``num_tokens``
    tokens wrote (layer 0's k, v, then layer 1's ...), fp8 codes times the source's scale."""
    f, kv, T = case.family, case.kv_heads, num_tokens
    num_layers = caches.shape[1 if f == "megatron" else 0] if isinstance(caches, torch.Tensor) else len(caches)
    out = []
    for layer in range(num_layers):
        if f == "meta-llama":
            p = step["start_pos"]
            k, v = (c[:2, p : p + T] for c in caches[layer])
        elif f == "mistral":
            k, v = (c.view(-1, *c.shape[2:])[step["cache_positions"]] for c in caches[layer])
        elif f in ("torchtitan", "tgi"):
            slots, bs = step["slots"], caches[layer][0].shape[1]
            k, v = (c[slots // bs, slots % bs] for c in caches[layer])
        elif f == "litgpt":
            k, v = (c[:1, :, step["input_pos"]].transpose(1, 2) for c in caches[layer])
        elif f == "gemma":
            k, v = (c[:, step["input_positions"]] for c in caches[layer])
        elif f == "lmdeploy":
            _, positions, seq_ids = _packed(T, step["history_lens"])
            bs, table = caches[layer][0].shape[1], step["block_offsets"].cpu()
            blocks, rows = table[seq_ids, positions // bs], positions % bs
            k, v = (c[blocks.to(c.device), rows.to(c.device)] for c in caches[layer])
        elif f == "flash-attn":
            p = step["seqlen_offset"]
            k, v = caches[layer][:, p : p + T].unbind(2)
        elif f == "megatron" and case.variant == "static":
            p = step["sequence_len_offset"]
            k, v = (c[p : p + T, :1] for c in caches[layer])
        elif f == "megatron":
            idx = (step["token_to_block_idx"], step["token_to_local_position_within_kv_block"])
            k, v = caches[0, layer][idx], caches[1, layer][idx]
        elif f == "trtllm":
            p, block = step["past_seen_token"], caches[layer][step["cache_idx"]]
            k, v = block[:, p : p + T]
        else:  # lightllm: K heads, then V heads, of each pool row
            k, v = caches[layer][step["mem_index"]].split([kv, kv], dim=1)
        out += [_values(case, r.reshape(-1, kv, r.shape[-1]), step, name) for r, name in ((k, "k"), (v, "v"))]
    return out


def _values(case: ReferenceCase, rows: torch.Tensor, step: dict, name: str) -> torch.Tensor:
    if rows.dtype != FP8:
        return rows.float()
    if case.family == "lmdeploy":
        return rows.float() * step[f"{name}_scale"]
    if case.family == "tgi":
        return rows.float() * step["kv_scale"]
    return rows.float()  # TensorRT-LLM: a bare cast, no scale
