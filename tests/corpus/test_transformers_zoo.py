"""Every decoder attention of the installed transformers (``prepfuse.models.hf_zoo``): what
``discover()`` finds, and a fixed sample of its models built engine-style, run eagerly and
compiled with ``backend="prepfuse"`` to the same written caches and output.

The sample spans the kinds of attention code: Llama's, Llama-4's (whose cos Inductor would
lay out transposed but for the fused call's pinned input strides), Qwen3's per-head q/k RMSNorm, MQA
without RoPE (GPT-BigCode), partial rotary (Phi), a norm over the whole q and k projections
(OLMo-2), Gemma's ``1 + w`` norm with soft-capping (Gemma-2), MLA (DeepSeek-V3: k and q of
nope and rope parts) and M-RoPE (Qwen2-VL). How many calls each fuses is not asserted here
(``bench/tools/survey_transformers.py`` tables it); numerics are, as
``tests/corpus/test_transformers.py`` bounds them against eager: each written cache row within
2^-5 of eager's (the rotation's bf16 roundings, the second layer reading the first's
difference). Shapes are the zoo's (T=7, two layers, block 16); the FX graph cache is off.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from prepfuse.models.hf_zoo import ZooLayers, build_zoo_model, discover, zoo_cache_rows  # noqa: E402
from prepfuse.testing import max_row_rel_diff  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
SAMPLE = ("llama", "llama4", "qwen3", "gpt_bigcode", "phi", "olmo2", "gemma2", "deepseek_v3", "qwen2_vl")
MIN_MODELS = 120  # transformers 5.17 gives 165; far fewer means the rules stopped finding decoders


@functools.lru_cache(maxsize=None)
def discovered() -> tuple[dict, dict]:
    """(name -> model, entry model type left out -> why), once a test run: discovery imports
    every family's modeling module."""
    excluded: dict[str, str] = {}
    return {m.name: m for m in discover(excluded)}, excluded


def test_discover_finds_the_decoders():
    models, _ = discovered()
    assert len(models) >= MIN_MODELS, sorted(models)
    assert set(SAMPLE) <= set(models), set(SAMPLE) - set(models)
    qwen3 = models["qwen3"]
    assert (qwen3.attention, qwen3.config, qwen3.rotary) == ("Qwen3Attention", "Qwen3Config", "Qwen3RotaryEmbedding")
    assert models["llama"].source == "transformers.models.llama.modeling_llama.LlamaAttention"
    assert len({m.source for m in models.values()}) == len(models)  # a class reached twice is one model
    assert not [m.attention for m in models.values() if "Cross" in m.attention or "Vision" in m.attention]


def test_discover_says_why_it_left_an_entry_out():
    models, excluded = discovered()
    assert "gemma3_text" in excluded and "model gemma3's" in excluded["gemma3_text"]  # Gemma3ForCausalLM: one class
    assert "another family's decoder" in excluded["llava"]  # its language model is AutoModel's
    assert "does not dispatch" in excluded["falcon"]  # its attention calls SDPA itself
    assert not set(excluded) & {m.model_type for m in models.values()}


@pytest.mark.parametrize("name", SAMPLE)
def test_zoo_model_compiles_to_eager_numerics(name):
    module, (x, positions, slots, caches) = build_zoo_model(discovered()[0][name], seed=5)
    assert isinstance(module, ZooLayers) and len(caches) == 2
    eager_caches = [tuple(c.clone() for c in pair) for pair in caches]
    with torch.no_grad():
        eager = module(x, positions, slots, eager_caches)
        out = torch.compile(module, backend="prepfuse", fullgraph=True)(x, positions, slots, caches)
    got, want = (zoo_cache_rows(c, slots, module.block_size) for c in (caches, eager_caches))
    assert all((rows != -7).any(-1).all() for rows in want)  # eager wrote every row of the step
    err = max_row_rel_diff(got, want)
    assert err <= 2**-5, err
    untouched = torch.ones(caches[0][0].shape[:2].numel(), dtype=torch.bool)
    untouched[slots] = False
    for cache in (c for pair in caches + eager_caches for c in pair):  # nothing written beside the step's slots
        assert (cache.flatten(0, 1)[untouched] == -7).all()
    torch.testing.assert_close(out.float(), eager.float(), rtol=0.05, atol=0.05)
