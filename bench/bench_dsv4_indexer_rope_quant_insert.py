"""Quick GPU timing of the DeepSeek-V4 indexer ops: the fused op (both formats) against the
FP8 model code (``prepfuse.models.dsv4_indexer``) compiled by ``torch.compile``'s default
and by ``backend="prepfuse"`` (which should fuse it into the op: the report is printed).

    PYTHONPATH=. python bench/bench_dsv4_indexer_rope_quant_insert.py [--out-dir $OUT]

H = 64 indexer heads, one compressed key row per 4 tokens, block size 64. Each number is
the median of single calls replayed from a CUDA graph (``prepfuse.testing.graph_replay_us``:
warm L2, so an optimistic, latency-oriented figure; the MLA op's benchmark has the full
method). Prints a table and, with ``--out-dir``, writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import prepfuse  # noqa: F401
from prepfuse.backend import PrepfuseBackend
from prepfuse.models.dsv4_indexer import INDEXER_SPELLINGS, indexer_k_insert, indexer_q_prep
from prepfuse.ops import DSV4_INDEXER_ROPE_FP8_INSERT, DSV4_INDEXER_ROPE_MXFP4_INSERT
from prepfuse.testing import graph_replay_us, make_dsv4_indexer_inputs

HEADS, BLOCK = 64, 64
TOKENS = (1, 64, 512, 4096, 16384)


def model_step(weights_scale: float):
    # the scale bytes as exp2(e).view(u8).view(n, 4): torch 2.11's Inductor cannot lower the
    # first spelling's exp2(e)[:, None].view(u8) (the baseline crashed on the H200)
    spelling = next(s for s in INDEXER_SPELLINGS if s.name == "slice-strided-view-bytes")

    def step(q, weights, k, k_cache, slot_mapping, positions, k_positions, cos_sin_cache):
        q_fp8, w = indexer_q_prep(q, weights, positions, cos_sin_cache, weights_scale, spelling)
        indexer_k_insert(k, k_cache, slot_mapping, k_positions, cos_sin_cache, BLOCK, spelling)
        return q_fp8, w

    return step


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args()
    rows = []
    for num_tokens in TOKENS:
        num_k = max(1, num_tokens // 4)
        row = {"T": num_tokens, "H": HEADS, "Tk": num_k}
        for fmt, op in (("fp8", DSV4_INDEXER_ROPE_FP8_INSERT), ("mxfp4", DSV4_INDEXER_ROPE_MXFP4_INSERT)):
            inputs = make_dsv4_indexer_inputs(fmt, num_tokens, HEADS, BLOCK, "cuda", num_k=num_k, skip_fraction=0.0)
            row[f"op_{fmt}_us"] = graph_replay_us(lambda: op(*inputs.args()))
        inputs = make_dsv4_indexer_inputs("fp8", num_tokens, HEADS, BLOCK, "cuda", num_k=num_k, skip_fraction=0.0)
        step_args = (inputs.q, inputs.weights, inputs.k, inputs.k_cache, inputs.slot_mapping, inputs.positions,
                     inputs.k_positions, inputs.cos_sin_cache)
        for name, backend in (("inductor", "inductor"), ("prepfuse", PrepfuseBackend({"strict": True}))):
            torch._dynamo.reset()
            compiled = torch.compile(model_step(inputs.weights_scale), backend=backend, fullgraph=True)
            row[f"model_{name}_us"] = graph_replay_us(lambda: compiled(*step_args))
            if name == "prepfuse":
                print(backend.reports.format())
        rows.append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name().lower().replace(" ", "-")
        (args.out_dir / f"dsv4_indexer_rope_quant_insert_{name}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
