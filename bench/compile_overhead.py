"""Compile-time cost of prepfuse's passes: the demo model, and each case of the corpus of
other people's code (``prepfuse.models.clients``: transformers' attention modules run
engine-style; ``prepfuse.models.engine_clients``: vLLM, SGLang, gpt-fast, nano-vllm), compiled with backend="prepfuse" with its passes (validating each rewrite on
probes, the default), with its passes and ``validate="quick"`` (the unit-scale probe alone),
and with none (``passes=()``), fresh each time (no FX graph cache).

    PYTHONPATH=. python bench/compile_overhead.py [--layers 3] [--repeats 3] [--no-corpus] [--cases a,b]

Prints seconds per compile (median of the repeats) for each, what the passes add, what the
edge-value probe adds over the quick validation, and the passes' own time measured inside
the pass manager. Runs on the CPU or a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import prepfuse  # noqa: F401
from prepfuse.backend import PrepfuseBackend
from prepfuse.fx_passes.pass_manager import PrepfusePassManager
from prepfuse.models.dsv4 import Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.testing import make_dsv4_inputs


def demo_model(layers: int, device):
    """The demo's DeepSeek-V4 block and its arguments."""
    tokens, heads, padded, block_size, dim = 7, 3, 8, 16, 64
    block = Dsv4AttentionBlock(layers, dim, heads, padded, block_size=block_size).to(device)
    inputs = make_dsv4_inputs(tokens, heads, padded, block_size, device, skip_fraction=0.0)
    caches = [fp8_ds_mla_cache(inputs.k_cache.shape[0], block_size, device) for _ in range(layers)]
    x = torch.randn(tokens, dim, device=device).to(torch.bfloat16)
    return block, (x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, caches)


def client_model(case):
    def build(layers: int, device):
        from prepfuse.models.clients import build_client
        from prepfuse.models.engine_clients import EngineCase, build_engine_client
        return (build_engine_client if isinstance(case, EngineCase) else build_client)(
            case, num_layers=layers, device=device)
    return build


def compile_seconds(build, options: dict, layers: int, device) -> tuple[float, float]:
    """(wall seconds of the first call, i.e. the compile; seconds inside the pass manager)."""
    torch._dynamo.reset()
    block, call_args = build(layers, device)
    options = {"inductor_config": {"fx_graph_cache": False}, **options}
    compiled = torch.compile(block, backend=PrepfuseBackend(options), fullgraph=True)

    in_passes = 0.0
    original = PrepfusePassManager.__call__

    def timed(self, graph):
        nonlocal in_passes
        start = time.perf_counter()
        original(self, graph)
        in_passes += time.perf_counter() - start

    PrepfusePassManager.__call__ = timed
    try:
        start = time.perf_counter()
        with torch.no_grad():
            compiled(*call_args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, in_passes
    finally:
        PrepfusePassManager.__call__ = original


VARIANTS = {  # the default (two probes), one probe, no passes
    "passes": {},
    "validate=quick": {"validate": "quick"},
    "no passes": {"passes": ()},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-corpus", action="store_true", help="the demo model only")
    parser.add_argument("--cases", default=None, help="comma-separated corpus case names (default: every case)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {"demo (DeepSeek-V4 block)": demo_model}
    if not args.no_corpus:
        from prepfuse.models.clients import CLIENT_CASES
        from prepfuse.models.engine_clients import ENGINE_CASES
        wanted = set(args.cases.split(",")) if args.cases else None
        models.update({case.name: client_model(case) for case in (*CLIENT_CASES, *ENGINE_CASES)
                       if wanted is None or case.name in wanted})
    compile_seconds(demo_model, {}, args.layers, device)  # warm: imports, first-use costs of Inductor
    print(f"torch {torch.__version__}, {device}, {args.layers} layers, median of {args.repeats} fresh compiles")
    for name, build in models.items():
        rows = {}
        for label, options in VARIANTS.items():
            runs = [compile_seconds(build, options, args.layers, device) for _ in range(args.repeats)]
            rows[label] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        (total, inside), (quick, inside_quick), (bare, _) = rows.values()
        print(f"  {name:26s} passes {total:6.2f} s ({inside:5.3f} s in the pass manager, {100 * inside / total:4.1f}%)"
              f"   validate=quick {quick:6.2f} s ({inside_quick:5.3f} s)   no passes {bare:6.2f} s   "
              f"passes add {total - bare:+.2f} s ({100 * (total - bare) / bare:+.0f}%), "
              f"the edge probe {total - quick:+.2f} s")

if __name__ == "__main__":
    main()
