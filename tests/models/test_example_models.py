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
from prepfuse.demo.gqa import run_gqa_models

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
