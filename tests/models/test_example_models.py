"""The example models compiled whole with ``backend="prepfuse"``, as the demo compiles them:
projections, an upstream norm, the preparation and an attention consumer, on each device.

A prep spelling compiled alone (``tests/fx_passes``) does not see what a model adds around
it: on CUDA at the demo's sizes a DeepSeek-V4 block with as many padded heads as heads has
no padding step, so attention reads the prepared q through einsum's merged token-and-head
view. Each case asserts every layer fused whole (``dsv4_q+kv``, not ``dsv4_kv``) and the
numbers within the demo's bounds."""

from __future__ import annotations

import pytest
import torch

from prepfuse.demo.dsv4 import run_dsv4_block
from prepfuse.demo.dsv4_indexer import run_dsv4_indexer
from prepfuse.backend import PrepfuseBackend
from prepfuse.demo.gqa import run_gqa_models
from prepfuse.models.gqa import EXAMPLE_MODELS, GqaAttentionBlock, kv_cache
from prepfuse.testing import make_gqa_inputs

LAYERS = 2
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _assert_whole(row) -> None:
    assert row.fused == (LAYERS, LAYERS), row.format()
    assert row.ok, row.format()


@pytest.mark.parametrize("device", DEVICES)
def test_dsv4_block_fuses_every_layer_whole(device):
    """The demo's DeepSeek-V4 block at the device's sizes (CUDA: T=512, 64 heads padded to 64)."""
    _assert_whole(run_dsv4_block(torch.device(device), LAYERS, timed=False))


@pytest.mark.parametrize("heads, padded", [(8, 8), (1, 8), (3, 8)])
def test_dsv4_block_fuses_whatever_the_head_padding(heads, padded):
    """No padding step (heads == padded heads: attention reads the prepared q itself, through
    a view merging tokens and heads), one head padded to more, and three to eight."""
    _assert_whole(run_dsv4_block(torch.device("cpu"), LAYERS, timed=False, sizes=(7, heads, padded, 16, 64)))


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_models_fuse_every_layer(device):
    """Each GQA example model (Qwen3 with fused qkv, HF-style, Llama-style, separate q/k/v)."""
    rows = list(run_gqa_models(torch.device(device), LAYERS, timed=False))
    assert rows
    for row in rows:
        _assert_whole(row)


@pytest.mark.parametrize("device", DEVICES)
def test_dsv4_indexer_fuses_every_layer_whole(device):
    _assert_whole(run_dsv4_indexer(torch.device(device), LAYERS, timed=False))


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_compiled_for_training_declines_naming_no_grad(device):
    """Parameters requiring grad with grad mode on: AOTAutograd traces a backward, whose
    forward saves what the fused ops would overwrite, so each layer's side declines naming
    ``torch.no_grad()``; under ``torch.no_grad()`` the same model fuses every layer."""
    spelling = EXAMPLE_MODELS["Qwen3-style (q/k RMSNorm, NeoX RoPE, bf16 cache)"]
    block = GqaAttentionBlock(LAYERS, 256, 4, 2, 64, spelling=spelling).to(device)
    for p in block.parameters():
        p.requires_grad_(True)
    inputs = make_gqa_inputs(7, 4, 2, 64, 16, device, cache_dtype=spelling.cache_dtype, skip_fraction=0.0)
    x = (torch.randn(7, 256, generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.bfloat16).to(device)

    def compiled_run(backend):
        caches = [tuple(kv_cache(inputs.k_cache.shape[0], 16, 2, 64, spelling, device) for _ in range(2))
                  for _ in range(LAYERS)]
        torch.compile(block, backend=backend, fullgraph=True)(
            x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, caches, inputs.kv_scale)

    training = PrepfuseBackend()
    compiled_run(training)
    whys = [r.why for r in training.reports.near_misses("fuse_gqa_prep")]
    assert not training.reports.matches("fuse_gqa_prep") and len(whys) == LAYERS, training.reports.format(verbose=True)
    assert all("compiled for training" in w and "torch.no_grad()" in w for w in whys), whys
    torch._dynamo.reset()
    inference = PrepfuseBackend()
    with torch.no_grad():
        compiled_run(inference)
    assert len(inference.reports.matches("fuse_gqa_prep")) == LAYERS, inference.reports.format(verbose=True)
