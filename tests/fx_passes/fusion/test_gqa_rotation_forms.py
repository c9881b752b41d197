"""The op's math written with the rotation turned the other way, or with q scaled before it.

- nanochat's ``rotate_half`` is ``cat((x2, -x1))``: each pair turns by -angle, the op's
  rotation with sin negated. It norms q and k without a weight after the rotation, which
  equals the op's norm-then-rotate because the rotation keeps each pair's length (cos/sin
  made in the graph from one angle).
- Muse's q is ``q_norm(q) * qk_scale_factor`` before the rotation: the factor rides on q's
  norm weight.
Both fuse, equal to eager within the op's bounds. q turned one way and k the other is no
one rotation: declined, and the code stays Inductor's value for value.
"""

from __future__ import annotations

import pytest
import torch

from prepfuse.backend import PrepfuseBackend

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, HQ, HKV, D, BLOCKS, BLOCK, EPS = 6, 4, 2, 64, 4, 8, 1e-6
FACTOR = 3.87


def unweighted_norm(x):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def cos_sin(inv_freq, positions):
    """[T, 1, D] cos and sin of one angle per pair, Hugging Face's ``cat((f, f))``."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(torch.bfloat16)[:, None], emb.sin().to(torch.bfloat16)[:, None]


def turn(x, cos, sin, backwards: bool):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    other = torch.cat((x2, -x1), -1) if backwards else torch.cat((-x2, x1), -1)
    return x * cos + other * sin


def split(qkv):
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    return q.view(T, HQ, D), k.view(T, HKV, D), v.view(T, HKV, D)


def write(k, v, slots, k_cache, v_cache):
    k_cache[slots // BLOCK, slots % BLOCK] = k
    v_cache[slots // BLOCK, slots % BLOCK] = v


def nanochat(qkv, inv_freq, positions, slots, k_cache, v_cache):
    q, k, v = split(qkv)
    cos, sin = cos_sin(inv_freq, positions)
    q, k = turn(q, cos, sin, backwards=True), turn(k, cos, sin, backwards=True)
    q, k = unweighted_norm(q), unweighted_norm(k)
    write(k, v, slots, k_cache, v_cache)
    return q


def muse(qkv, inv_freq, positions, slots, k_cache, v_cache):
    q, k, v = split(qkv)
    cos, sin = cos_sin(inv_freq, positions)
    q, k = unweighted_norm(q) * FACTOR, unweighted_norm(k)
    q, k = turn(q, cos, sin, backwards=False), turn(k, cos, sin, backwards=False)
    write(k, v, slots, k_cache, v_cache)
    return q


def q_and_k_turned_apart(qkv, inv_freq, positions, slots, k_cache, v_cache):
    q, k, v = split(qkv)
    cos, sin = cos_sin(inv_freq, positions)
    q, k = turn(q, cos, sin, backwards=True), turn(k, cos, sin, backwards=False)
    write(k, v, slots, k_cache, v_cache)
    return q


def inputs():
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2).float() / D)
    positions, slots = torch.arange(T) + 3, torch.tensor([5, 9, 17, 2, 30, 11])
    caches = [torch.randn(BLOCKS, BLOCK, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    return qkv, inv_freq, positions, slots, caches


def run(fn, backend):
    qkv, inv_freq, positions, slots, caches = inputs()
    written = [c.clone() for c in caches]
    with torch.no_grad():
        got = fn(qkv, inv_freq, positions, slots, *written) if backend is None else \
            torch.compile(fn, backend=backend, fullgraph=True)(qkv, inv_freq, positions, slots, *written)
    return got, written


def close(a, b):
    """Within two bf16 steps of the row's largest value (the op rounds once, the code per step)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2**-6 * b.abs().amax(-1, keepdim=True) + 1e-6).all())


@pytest.mark.parametrize("fn", [nanochat, muse])
def test_fuses_equal_to_eager(fn):
    backend = PrepfuseBackend({})
    got, written = run(fn, backend)
    want, eager = run(fn, None)
    assert backend.reports.pattern_counts().get("gqa_qknorm_rope_kv") == 1, \
        backend.reports.format(verbose=True)
    assert close(got, want)
    assert all(close(c, e) for c, e in zip(written, eager))


def test_names_the_turn_and_the_factor():
    for fn, words in ((nanochat, "turned by -angle"), (muse, f"times {FACTOR:g}")):
        torch._dynamo.reset()
        backend = PrepfuseBackend({})
        run(fn, backend)
        assert words in backend.reports.format(verbose=True)


def test_q_and_k_turned_apart_is_declined():
    prepfuse = PrepfuseBackend({})
    got, written = run(q_and_k_turned_apart, prepfuse)
    assert not prepfuse.reports.pattern_counts(), prepfuse.reports.format(verbose=True)
    assert "differs" in prepfuse.reports.near_misses()[0].why
    torch._dynamo.reset()
    want, inductor_written = run(q_and_k_turned_apart, "inductor")
    assert torch.equal(got, want)
    assert all(torch.equal(c, e) for c, e in zip(written, inductor_written))
