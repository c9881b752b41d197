"""Demo section: the DeepSeek-V4 lightning-indexer preparation of a few layers, as plain
PyTorch (``prepfuse.models.dsv4_indexer``), compiled with ``backend="prepfuse"``: the
indexer prep sequences fused, the bytes against eager, and on a GPU the time beside
``torch.compile``'s default backend.

Each layer's q RoPE + FP8 quantisation with the scale folded into the head weights, and
its compressed-key RoPE + FP8 quantisation + paged insert, is one fusable sequence
(``fuse_dsv4_indexer_prep`` -> ``prepfuse::dsv4_indexer_rope_fp8_insert``).
"""

from __future__ import annotations

import torch

from prepfuse.demo.compiled import compile_with_prepfuse, show_report, time_beside_default
from prepfuse.demo.rows import Bound, Row
from prepfuse.models.dsv4_indexer import INDEXER_SPELLINGS, indexer_fp8_cache, indexer_k_insert, indexer_q_prep
from prepfuse.testing import e4m3_code_diff, make_dsv4_indexer_inputs


def indexer_layers(num_layers: int, weights_scale: float, block_size: int):
    """One indexer preparation per layer: each layer its own q, weights, k and cache
    (lists), as the layers of a model have. The spelling writes the scale bytes as
    ``exp2(e).view(uint8).view(n, 4)``: torch 2.11's Inductor cannot compile the other
    scales spelling unfused, and the demo times the unfused code under torch.compile."""
    spelling = next(s for s in INDEXER_SPELLINGS if s.name == "slice-strided-view-bytes")

    def step(qs, weights, ks, caches, slot_mapping, positions, k_positions, cos_sin_cache):
        outs = []
        for q, w, k, cache in zip(qs, weights, ks, caches):
            outs.append(indexer_q_prep(q, w, positions, cos_sin_cache, weights_scale, spelling))
            indexer_k_insert(k, cache, slot_mapping, k_positions, cos_sin_cache, block_size, spelling)
        return outs

    return step


def run_dsv4_indexer(device: torch.device, num_layers: int = 3, *, seed: int = 0, verbose: bool = False,
                     timed: bool = True) -> Row:
    generator = torch.Generator().manual_seed(seed)
    on_gpu = device.type == "cuda"
    tokens, heads, block_size = (512, 64, 64) if on_gpu else (7, 4, 16)
    layers = [make_dsv4_indexer_inputs("fp8", tokens, heads, block_size, device, num_k=max(1, tokens // 4),
                                       generator=generator, skip_fraction=0.0) for _ in range(num_layers)]
    inputs = layers[0]  # slots, positions and the table are shared by the layers
    step = indexer_layers(num_layers, inputs.weights_scale, block_size)
    caches = [indexer_fp8_cache(inputs.k_cache.shape[0], block_size, device) for _ in range(num_layers)]
    eager_caches = [c.clone() for c in caches]
    rest = (inputs.slot_mapping, inputs.positions, inputs.k_positions, inputs.cos_sin_cache)
    # The step returns each layer's prepared q codes and weights, which the demo keeps past
    # the call to compare with eager's: fresh graph buffers, not the scratch arena's views
    # that the next call of a graph fusing the same op would overwrite.
    compiled, backend = compile_with_prepfuse(step, output_buffers="graph")
    per_layer = ([x.q for x in layers], [x.weights for x in layers], [x.k for x in layers])
    out = compiled(*per_layer, caches, *rest)
    ref = step(*per_layer, eager_caches, *rest)

    matched = len(backend.reports.matches("dsv4_indexer_q+k"))
    # the op computes the model's math step for step: the same bytes, up to an e4m3 code
    # where a device's eager kernels round an intermediate differently
    code_diff = max(int(e4m3_code_diff(q.view(torch.uint8), rq.view(torch.uint8)).max()) for (q, _), (rq, _) in zip(out, ref))
    weights_differing = sum(int((w != rw).sum()) for (_, w), (_, rw) in zip(out, ref))
    cache_bytes_differing = sum(int((c != rc).sum()) for c, rc in zip(caches, eager_caches))
    if verbose:
        print(f"\n== example model: {num_layers} DeepSeek-V4 indexer preparations, T={tokens} H={heads} "
              f"Tk={inputs.k.shape[0]} block_size={block_size}, compiled with backend=\"prepfuse\"")
        show_report(backend, matched, num_layers)
        print(f"q codes vs eager: max {code_diff} e4m3 codes apart; weights identical: {weights_differing == 0}; "
              f"cache bytes differing: {cache_bytes_differing}")
    bounds = (Bound("q codes apart", code_diff, 1), Bound("weights differing", weights_differing, 0),
              Bound("cache bytes differing", cache_bytes_differing, 0))
    timing = ""
    if on_gpu:
        args = (*per_layer, caches, *rest)
        timing = time_beside_default(step, compiled, args, args)
    return Row("DeepSeek-V4 indexer", bounds, fused=(matched, num_layers), timing=timing)
