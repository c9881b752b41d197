"""The README's main command runs its checks on the CPU too: keep them passing."""

import torch

from prepfuse.demo.dsv4 import run_dsv4_block_demo, run_dsv4_demo
from prepfuse.demo.dsv4_indexer import run_indexer_demo
from prepfuse.demo.gqa import run_gqa_models_demo


def test_op_demo_passes_on_cpu():
    assert run_dsv4_demo(torch.device("cpu"), num_tokens=5, num_heads=2, block_size=16)


def test_model_demo_fuses_every_layer_and_matches_eager():
    assert run_dsv4_block_demo(torch.device("cpu"), num_layers=2)


def test_gqa_models_demo_fuses_every_layer_and_matches_eager():
    assert run_gqa_models_demo(torch.device("cpu"), num_layers=2)


def test_indexer_demo_fuses_every_layer_and_matches_eager():
    assert run_indexer_demo(torch.device("cpu"), num_layers=2)
