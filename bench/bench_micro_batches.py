"""Two micro-batches of one compiled model on two streams (dual-batch overlap), each with
scratch of its own (``prepfuse.scratch.micro_batch``).

Each micro-batch's forward (the example DeepSeek-V4 block, ``backend="prepfuse"``) is
captured in its own CUDA graph under its lane, after a profiling run that reserves both
lanes and a ``freeze()``. Timed (medians of CUDA-event pairs around each replay set):
micro-batch 0 alone, 1 alone, both one after the other on one stream, and both at once on
two streams. The concurrent replay's outputs and caches must be byte-identical to the
serial one's (checked first, on fresh random inputs). With one shared reservation the
arena's stream ordering would serialize the two; with lanes they overlap where each
forward leaves the GPU room (small token counts: decode and short prefill).

    PYTHONPATH=. python bench/bench_micro_batches.py [--tokens 16,64,256] [--layers 8] [--out-dir D]

Writes ``micro_batches_<device>.json`` (and prints the table) under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import harness  # noqa: F401  (puts the repository on sys.path)
import torch

from prepfuse.backend import PrepfuseBackend
from prepfuse.models.dsv4 import Dsv4AttentionBlock, fp8_ds_mla_cache
from prepfuse.scratch import ScratchArena, micro_batch, use_arena
from prepfuse.testing import make_dsv4_inputs

HEADS, PADDED, BLOCK, DIM = 16, 64, 64, 1024


def batch(tokens: int, layers: int, device):
    inputs = make_dsv4_inputs(tokens, HEADS, PADDED, BLOCK, device, skip_fraction=0.0)
    caches = [fp8_ds_mla_cache(inputs.k_cache.shape[0], BLOCK, device) for _ in range(layers)]
    x = (torch.randn(tokens, DIM, device=device) * 0.5).to(torch.bfloat16)
    return [x, inputs.positions, inputs.slot_mapping, inputs.cos_sin_cache, caches]


def median_ms(fn, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(tokens: int, layers: int) -> dict:
    device = torch.device("cuda")
    torch._dynamo.reset()
    block = Dsv4AttentionBlock(layers, DIM, HEADS, PADDED, block_size=BLOCK).to(device)
    compiled = torch.compile(block, backend=PrepfuseBackend({"inductor_config": {"fx_graph_cache": False}}))
    batches = [batch(tokens, layers, device) for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    with use_arena(ScratchArena()) as arena, torch.no_grad():
        outs, graphs = [None, None], [None, None]
        for i in range(2):  # the profiling run: every lane reserved before freeze()
            with micro_batch(i):
                compiled(*batches[i])
        torch.cuda.synchronize()
        arena.freeze()
        for i in range(2):
            with micro_batch(i), torch.cuda.stream(streams[i]):
                compiled(*batches[i])  # warm on this stream
                graphs[i] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[i], stream=streams[i]):
                    outs[i] = compiled(*batches[i])
        torch.cuda.synchronize()
        lanes = sorted(r.name for r in arena.reservations())

        def snapshot():
            return [o.clone() for o in outs] + [c.clone() for b in batches for c in b[4]]

        def fresh_caches():
            for b in batches:
                for c in b[4]:
                    c.zero_()

        def serial():
            for g in graphs:
                g.replay()

        def concurrent():
            current = torch.cuda.current_stream()
            for s, g in zip(streams, graphs):
                s.wait_stream(current)
                with torch.cuda.stream(s):
                    g.replay()
            for s in streams:
                current.wait_stream(s)

        fresh_caches()
        serial()
        torch.cuda.synchronize()
        want = snapshot()
        fresh_caches()
        concurrent()
        torch.cuda.synchronize()
        got = snapshot()
        identical = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(want, got))
        if not identical:
            raise SystemExit(f"T={tokens}: concurrent micro-batches differ from serial ones")
        row = {
            "tokens_per_micro_batch": tokens, "layers": layers, "lanes": lanes, "identical_to_serial": identical,
            "mb0_alone_ms": median_ms(graphs[0].replay), "mb1_alone_ms": median_ms(graphs[1].replay),
            "serial_ms": median_ms(serial), "concurrent_ms": median_ms(concurrent),
        }
    row["overlap_saving"] = 1 - row["concurrent_ms"] / (row["mb0_alone_ms"] + row["mb1_alone_ms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16,64,256")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    rows = [measure(int(t), args.layers) for t in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name()}, DeepSeek-V4 block, {args.layers} layers, H={HEADS} (padded {PADDED})")
    print("T/micro-batch  mb0 alone  mb1 alone  serial    concurrent  saving vs sum  identical")
    for r in rows:
        print(f"{r['tokens_per_micro_batch']:13d}  {r['mb0_alone_ms']:7.3f}ms {r['mb1_alone_ms']:7.3f}ms "
              f"{r['serial_ms']:7.3f}ms {r['concurrent_ms']:8.3f}ms  {100 * r['overlap_saving']:10.0f}%  "
              f"{r['identical_to_serial']}")
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    name = "nvidia-h200" if "h200" in name else name
    out = Path(args.out_dir) / f"micro_batches_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
