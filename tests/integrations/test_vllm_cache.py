"""vLLM's own k/v cache write, ``vllm::unified_kv_cache_update``, fused by prepfuse inside
vLLM 0.33's pass manager (``prepfuse/integrations/vllm_cache.py``).

The model is one Qwen3-style prep in plain PyTorch (q/k RMSNorm, NeoX RoPE) whose k and v go
to vLLM's op exactly as ``Attention.forward`` hands them over (``_encode_layer_name`` of the
layer's name: a ``LayerName`` graph input under torch 2.14). The layers are vLLM's
``Attention`` with the FlashAttention backend, registered in vLLM's static forward context;
each step runs under ``set_forward_context`` with the slot mapping per layer, and each
layer's ``kv_cache`` is a real ``[num_blocks, Hkv, block_size, 2 * D]`` bf16 tensor, as
FlashAttention's per-layer view is. The compiled graph holds
``prepfuse_vllm::gqa_qknorm_rope_kv_insert_by_layer`` keyed by the layer name and no call
of vLLM's op; every cache byte and q equal the eager run.

The eager reference is vLLM's own path: ``unified_kv_cache_update`` ->
``get_attention_context`` -> ``FlashAttentionImpl.do_kv_cache_update`` ->
``vllm._custom_ops.reshape_and_cache_flash`` -> ``_C_cache_ops.reshape_and_cache_flash``. Two
pieces of it exist only on CUDA and stand in here: ``flash_attn.py`` imports
``reshape_and_cache_flash`` from ``vllm._custom_ops`` on the CUDA platform only (the
``vllm_cuda_write_path`` fixture puts that same function there), and the ``_C_cache_ops``
kernel is registered by vLLM's library, which loads only with the CUDA driver: this module
defines that one op when it is missing, with the schema vLLM's binary holds and plain PyTorch
index writes of the bf16 rows (``kv_cache_dtype="auto"``) as its CPU kernel. The layers'
float16 default dtype stands in for a model's (``vllm_model``). No attention runs.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from prepfuse.models.gqa import GqaSpelling, cos_sin, make_norms, rope, split_qkv

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.utils.torch_utils import _encode_layer_name
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    from prepfuse.fx_passes.matching.engine_writes import register_engine_write, unregister_engine_write
    from prepfuse.integrations.vllm import PrepfuseVllmPass, vllm_engine_write
    from prepfuse.integrations.vllm_cache import BY_LAYER_OP, UNIFIED_KV_CACHE_UPDATE
    from tests.integrations.test_vllm import Watch, compile_with, vllm_backend
except ImportError:
    Attention = None

pytestmark = [pytest.mark.skipif(Attention is None, reason="vLLM is not installed (scripts/test_vllm.sh runs these)"),
              pytest.mark.usefixtures("fresh_dynamo", "vllm_cuda_write_path")]


@pytest.fixture
def vllm_cuda_write_path(monkeypatch):
    """``FlashAttentionImpl.do_kv_cache_update``'s ``reshape_and_cache_flash`` as the CUDA
    platform imports it (``vllm._custom_ops``'s, calling the ``_C_cache_ops`` op)."""
    from vllm import _custom_ops
    from vllm.v1.attention.backends import flash_attn

    monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", _custom_ops.reshape_and_cache_flash, raising=False)

T, HQ, HKV, D, BLOCKS, BLOCK, EPS = 7, 4, 2, 64, 4, 16, 1e-6
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
SPELLING = GqaSpelling("qwen3-vllm-native-rope", rope="halves")
Q_NORM, K_NORM = make_norms(D, EPS, SPELLING, torch.Generator().manual_seed(0))
# vLLM 0.33's schema of the op (its _C_stable_libtorch registers this string)
RESHAPE_AND_CACHE_FLASH = ("reshape_and_cache_flash(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
                           "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")


def _reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """The kernel's bf16 path: row ``t`` of k and v to slot ``slot_mapping[t]`` (negative
    skips), the first ``len(slot_mapping)`` rows."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError("the stand-in writes bf16 caches only")
    keep = slot_mapping >= 0
    slots, n, bs = slot_mapping[keep], slot_mapping.shape[0], key_cache.shape[1]
    key_cache[slots // bs, slots % bs] = key[:n][keep]
    value_cache[slots // bs, slots % bs] = value[:n][keep]


if Attention is not None and not hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
    _STAND_IN = torch.library.Library("_C_cache_ops", "FRAGMENT")  # lives as long as the test module
    _STAND_IN.define(RESHAPE_AND_CACHE_FLASH)
    _STAND_IN.impl("reshape_and_cache_flash", _reshape_and_cache_flash, "CPU")


def layer_prep(qkv, table, positions, layer_name: str):
    """One attention's prep, k and v handed to vLLM's cache write as ``Attention.forward``
    hands them (its non-direct path): (q, the write's dummy, which attention would take)."""
    q, k, v = split_qkv(qkv, HQ, HKV, D, SPELLING)
    q, k = Q_NORM(q), K_NORM(k)
    cos, sin = cos_sin(table, positions)
    q, k = rope(q, cos, sin, SPELLING), rope(k, cos, sin, SPELLING)
    return q, torch.ops.vllm.unified_kv_cache_update(k, v, _encode_layer_name(layer_name))


def two_layers(qkv0, qkv1, table, positions):
    q0, dep0 = layer_prep(qkv0, table, positions, LAYERS[0])
    q1, dep1 = layer_prep(qkv1, table, positions, LAYERS[1])
    return q0, q1, dep0, dep1


def vllm_model(prepfuse_pass, dtype=torch.bfloat16):
    """vLLM's backend for the hand-in, and its attention layers (FlashAttention, ``auto``
    cache) in the config's static forward context. vLLM's ``ModelConfig`` reads a Hugging Face
    model, which this machine has none of; without one a layer's ``auto`` cache is float16
    (``kv_cache_dtype_str_to_dtype``), so the layers get ``dtype`` as a model of that dtype
    gives them (``model_config.dtype``); ``None`` keeps vLLM's float16."""
    backend = vllm_backend(prepfuse_pass)
    with set_current_vllm_config(backend.vllm_config):
        layers = [Attention(HQ, D, D ** -0.5, HKV, prefix=name, attn_backend=FlashAttentionBackend)
                  for name in LAYERS]
    for layer in layers:
        layer.kv_cache_torch_dtype = dtype or layer.kv_cache_torch_dtype
    return backend, layers


def fresh_caches(layers, seed: int) -> list[torch.Tensor]:
    """Each layer's cache, FlashAttention's ``[NB, Hkv, BS, 2 * D]`` view, random bf16 (the
    rows' dtype: the float16 layers of the decline test are read when compiling only)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HKV, BLOCK, 2 * D, generator=gen).to(torch.bfloat16) for _ in layers]


def inputs(seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    table = 2 * torch.rand(64, D, generator=gen) - 1
    return (*qkv, table, torch.randperm(60, generator=gen)[:T])


def step(backend, layers, caches, slots, fn, args, compiled: bool):
    """One forward under vLLM's forward context: the layers' caches set, the slots per layer;
    compiled (Inductor inside vLLM's pass context, as ``test_vllm.compile_with``) or eager."""
    for layer, cache in zip(layers, caches):
        layer.kv_cache = cache
    slot_mapping = {name: s for name, s in zip(LAYERS, slots) if s is not None}
    with set_current_vllm_config(backend.vllm_config), \
            set_forward_context(None, backend.vllm_config, slot_mapping=slot_mapping):
        return compile_with(backend, fn, args, fx_graph_cache=False)[0] if compiled else fn(*args)


SLOTS = (torch.tensor([5, 9, 17, 2, 30, 11, 40]), torch.tensor([3, 12, 63, 8, 20, 1]))
# a batch of 4 tokens padded to a CUDA graph's 7 (layer 1's mapping of 6, as vLLM's may be shorter)
PADDED = (torch.tensor([5, 9, 17, 2, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]) if Attention else None,
          torch.tensor([3, 12, 63, 8, PAD_SLOT_ID, PAD_SLOT_ID]) if Attention else None)


@pytest.mark.parametrize("slots", [SLOTS, PADDED, (None, None)], ids=["slots", "padded-batch", "profiling-run-no-slots"])
def test_vllms_cache_write_fuses_into_the_by_layer_call(slots):
    """Both layers' writes fuse; every cache byte is vLLM's own write's: a padding slot
    (``PAD_SLOT_ID``) leaves the cache as it was, the last slot included."""
    prepfuse_pass = PrepfuseVllmPass({"strict": True})
    backend, layers = vllm_model(prepfuse_pass)
    watch = backend.pass_manager.fix_functionalization = Watch(backend.pass_manager.fix_functionalization)
    args = inputs(3)
    compiled_caches, eager_caches = fresh_caches(layers, 4), fresh_caches(layers, 4)
    out = step(backend, layers, compiled_caches, slots, two_layers, args, compiled=True)
    ref = step(backend, layers, eager_caches, slots, two_layers, args, compiled=False)
    for got, want in zip(out, ref):  # q, and the dummies
        assert torch.equal(got, want)
    for got, want in zip(compiled_caches, eager_caches):  # every byte, k and v halves of each row
        assert torch.equal(got, want)
    (report,) = prepfuse_pass.reports
    assert report.pattern_counts() == {"gqa_qknorm_rope_kv": 2, f"{BY_LAYER_OP}/v1": 2}
    assert report.near_misses() == [] and report.functionalized_left == []
    # the final graph: two by-layer calls, in place, and no call of vLLM's write
    assert watch.targets.count(BY_LAYER_OP) == 2 and UNIFIED_KV_CACHE_UPDATE not in watch.targets


def final_targets(layers_dtype) -> tuple[list, object]:
    """(the final graph's call targets, the report) of ``two_layers`` compiled in vLLM with
    layers of ``layers_dtype`` (None: vLLM's float16 without a model)."""
    prepfuse_pass = PrepfuseVllmPass({"strict": True})
    backend, layers = vllm_model(prepfuse_pass, dtype=layers_dtype)
    watch = backend.pass_manager.fix_functionalization = Watch(backend.pass_manager.fix_functionalization)
    step(backend, layers, fresh_caches(layers, 4), SLOTS, two_layers, inputs(3), compiled=True)
    (report,) = prepfuse_pass.reports
    return watch.targets, report


def test_a_cache_the_op_cannot_write_stays_vllms():
    """Layers declaring float16 caches (vLLM's ``auto`` without a model): decided when
    compiling, vLLM's write stays, the graph is the one compiled with vLLM's write
    undeclared, and the report names the op and why, once per call."""
    targets, report = final_targets(None)
    assert targets.count(UNIFIED_KV_CACHE_UPDATE) == 2 and BY_LAYER_OP not in targets
    assert report.matched_counts["fuse_gqa_prep"] == 0
    whys = [r.why for r in report.near_misses("fuse_gqa_prep")]
    assert len(whys) == 2 and all(re.fullmatch(
        r"engine write vllm::unified_kv_cache_update at .*: layer model\.layers\.0\.self_attn\.attn keeps a auto "
        r"\(torch\.float16\) cache; the by-layer op writes bf16 caches \(vLLM quantises fp8 inside its write, with "
        r"the layer's _k_scale\); left to the engine", why) for why in whys), whys
    unregister_engine_write(UNIFIED_KV_CACHE_UPDATE)
    try:
        undeclared, plain = final_targets(None)
    finally:
        register_engine_write(vllm_engine_write())
    assert targets == undeclared and plain.near_misses("fuse_gqa_prep") == []


def vllm_modules(backend, seed: int, norm: str = "rms"):
    """vLLM's own q/k norms and ``get_rope``'s NeoX rotary embedding, built under the config as
    a model builds them (custom ops ``none``, Inductor's default: ``forward_native``, the norm
    an IR op). ``norm``: ``RMSNorm`` with random bf16 weights near 1 (Qwen3), or
    ``GemmaRMSNorm`` with fp32 weights near 0 applied as ``1 + w`` before the rounding (Gemma-3)."""
    gen = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(backend.vllm_config):
        norms = [RMSNorm(D, eps=EPS, dtype=torch.bfloat16) if norm == "rms" else GemmaRMSNorm(D, eps=EPS)
                 for _ in range(2)]
        rotary = get_rope(D, max_position=64, is_neox_style=True, dtype=torch.bfloat16)
    for n in norms:
        weight = 0.3 * torch.randn(D, generator=gen)
        n.weight.data = (1 + weight).to(torch.bfloat16) if norm == "rms" else weight
    return (*norms, rotary)


def qwen3_attention_prep(modules, qkv, positions, layer_name: str):
    """``Qwen3Attention.forward`` between its qkv projection and its attention, as vLLM 0.33
    writes it, k and v handed to vLLM's cache write as ``Attention.forward`` hands them."""
    q_norm, k_norm, rotary = modules
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q = q_norm(q.view(*q.shape[:-1], HQ, D)).view(q.shape)
    k = k_norm(k.view(*k.shape[:-1], HKV, D)).view(k.shape)
    q, k = rotary(positions, q, k)
    dep = torch.ops.vllm.unified_kv_cache_update(k.view(-1, HKV, D), v.reshape(-1, HKV, D),
                                                 _encode_layer_name(layer_name))
    return q, dep


@pytest.mark.parametrize("norm", ["rms", "gemma"], ids=["RMSNorm", "GemmaRMSNorm"])
def test_vllms_own_norm_and_rope_fuse_with_its_cache_write(norm):
    """vLLM's ``RMSNorm`` or ``GemmaRMSNorm`` (the IR op ``vllm_ir::rms_norm``, read through
    its native implementation) and ``get_rope``, two layers: each layer's q/k norm, RoPE and
    cache write become one by-layer call, q and every cache byte as the same code in eager."""
    prepfuse_pass = PrepfuseVllmPass({"strict": True})
    backend, layers = vllm_model(prepfuse_pass)
    modules = [vllm_modules(backend, seed, norm) for seed in (0, 1)]
    watch = backend.pass_manager.fix_functionalization = Watch(backend.pass_manager.fix_functionalization)

    def model(qkv0, qkv1, table, positions):
        q0, dep0 = qwen3_attention_prep(modules[0], qkv0, positions, LAYERS[0])
        q1, dep1 = qwen3_attention_prep(modules[1], qkv1, positions, LAYERS[1])
        return q0, q1, dep0, dep1

    args = inputs(3)
    compiled_caches, eager_caches = fresh_caches(layers, 4), fresh_caches(layers, 4)
    with torch.no_grad():
        out = step(backend, layers, compiled_caches, SLOTS, model, args, compiled=True)
        ref = step(backend, layers, eager_caches, SLOTS, model, args, compiled=False)
    (report,) = prepfuse_pass.reports
    assert report.pattern_counts().get("gqa_qknorm_rope_kv") == 2, report.format(verbose=True)
    assert watch.targets.count(BY_LAYER_OP) == 2 and UNIFIED_KV_CACHE_UPDATE not in watch.targets
    assert not any("vllm_ir" in str(t) for t in watch.targets)  # both norms inside the fused calls
    for got, want in zip(out[:2], ref[:2]):
        torch.testing.assert_close(got, want, atol=2**-6, rtol=2**-6)
    for got, want in zip(compiled_caches, eager_caches):
        torch.testing.assert_close(got, want, atol=2**-6, rtol=2**-6)
