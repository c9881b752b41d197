"""``bench/decode_floor.py``'s ladder kernels without a GPU: each step computes what its row
says it does (under the Triton interpreter), so that a difference between two rows on the
H200 is the cost of that step and not of a kernel that does something else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from prepfuse._compat import has_triton, triton_interpret_mode

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.skipif(not (has_triton() and triton_interpret_mode()),
                                reason="needs triton under TRITON_INTERPRET=1")

D = 128


def _rows():
    g = torch.Generator().manual_seed(5)
    src = torch.randn(4, D, generator=g).to(torch.bfloat16)
    table = torch.randn(16, D, generator=g)
    pos = torch.tensor([3])
    return src, table, pos


def _stored(kernel, *args):
    """What ``kernel[(4,)](src, dst, pos, table, *args)`` leaves in a NaN-filled ``dst``, on
    ``_rows()``'s inputs (the same each call)."""
    src, table, pos = _rows()
    dst = torch.full_like(src, float("nan"))
    kernel[(4,)](src, dst, pos, table, *args, num_warps=1)
    return dst


def test_chain_norm_is_the_normed_row_times_the_table_row():
    import decode_floor

    dst = _stored(decode_floor._chain_norm_kernel, 1e-6, D)
    src, table, _ = _rows()
    x = src.float()
    rstd = 1.0 / torch.sqrt((x * x).sum(1, keepdim=True) / D + 1e-6)
    torch.testing.assert_close(dst.float(), (x * rstd * table[3]).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_chain_norm_variants_scale_by_what_their_rows_say():
    """rsqrt.approx is the normed row to approximation; the no-root row scales by the mean
    square itself (the reduction's result, kept alive)."""
    import decode_floor

    src, table, _ = _rows()
    x = src.float()
    mean_sq = (x * x).sum(1, keepdim=True) / D + 1e-6
    exact = _stored(decode_floor._chain_norm_kernel, 1e-6, D, 0).float()
    approx = _stored(decode_floor._chain_norm_kernel, 1e-6, D, 1).float()
    torch.testing.assert_close(approx, exact, rtol=1e-2, atol=1e-2)
    summed = _stored(decode_floor._chain_norm_kernel, 1e-6, D, 2).float()
    torch.testing.assert_close(summed, (x * mean_sq * table[3]).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(summed, exact, rtol=1e-2, atol=1e-2)


def test_chain_with_unused_arguments_is_the_chain():
    import decode_floor

    dst_chain = _stored(decode_floor._chain_kernel, D)
    dst_args = _stored(decode_floor._chain_args_kernel, *[17 + 2 * i for i in range(31)], D)
    assert torch.equal(dst_args, dst_chain)
    src, table, _ = _rows()
    # the interpreter's bf16 conversion need not round to nearest: one bf16 step apart at most
    torch.testing.assert_close(dst_chain.float(), src.float() * table[3], rtol=2 ** -7, atol=1e-6)


def test_chain_with_more_code_is_the_chain_but_its_first_value():
    """The xorshift rounds only decide one value (lane 0 of program 0, whose index hashes to 0),
    so the row times the chain's memory traffic with more code, not other work."""
    import decode_floor

    dst_chain = _stored(decode_floor._chain_kernel, D)
    dst_code = _stored(decode_floor._chain_code_kernel, D, 8)
    assert dst_code[0, 0] == 0
    dst_code[0, 0] = dst_chain[0, 0]
    assert torch.equal(dst_code, dst_chain)


def test_chain_after_a_jump_is_the_chain():
    import decode_floor

    assert torch.equal(_stored(decode_floor._chain_far_kernel, 3, D, 8), _stored(decode_floor._chain_kernel, D))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_gqa_grid_cut_runs_only_the_first_programs():
    """The cut rows time what their names say: at T=1 the q programs write q_out and no
    cache row, the q and k programs q_out and k_cache but no v row, and a cut as large as
    the grid is the whole op; the module's kernel is restored after each."""
    import decode_floor

    from prepfuse.ops import gqa_qknorm_rope_kv_insert as gqa_op
    from prepfuse.ops import gqa_qknorm_rope_kv_insert_triton
    from prepfuse.testing import seeded_gqa_inputs

    hq, hkv = 4, 2
    inputs, seed = seeded_gqa_inputs(1, hq, hkv, 64, 16, "cpu", skip_fraction=0.0)
    whole = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*whole.args())
    kernel = gqa_op._gqa_qknorm_rope_kv_insert_kernel
    for programs, writes in ((hq, ("q_out",)), (hq + hkv, ("q_out", "k_cache")),
                             (hq + 2 * hkv, ("q_out", "k_cache", "v_cache"))):
        cut, poisoned = inputs.fresh_outputs(), inputs.fresh_outputs()
        with decode_floor._grid_cut("gqa", programs):
            gqa_qknorm_rope_kv_insert_triton(*cut.args())
        assert gqa_op._gqa_qknorm_rope_kv_insert_kernel is kernel
        for name in ("q_out", "k_cache", "v_cache"):
            expected = getattr(whole if name in writes else poisoned, name)
            assert torch.equal(_bits(getattr(cut, name)), _bits(expected)), f"seed={seed}: {programs} programs, {name}"
    # the whole op does write every output (the poisoned copies are not what it leaves)
    for name in ("q_out", "k_cache", "v_cache"):
        assert not torch.equal(_bits(getattr(whole, name)), _bits(getattr(inputs.fresh_outputs(), name)))


def test_gqa_prefixes_name_the_grid_of_the_case():
    import decode_floor

    assert decode_floor.gqa_prefixes("gqa-qwen3-8b") == {
        "op gqa-qwen3-8b, first program only": 1,
        "op gqa-qwen3-8b, q programs only (32 of 48)": 32,
        "op gqa-qwen3-8b, q and k programs (40 of 48)": 40,
    }


def test_gqa_slots_skipped_computes_q_and_stores_no_cache_row():
    """The slot -1 rows run the same programs with the cache stores masked: q_out as the
    op's, both caches untouched, and the original inputs' slots left as they were."""
    import decode_floor

    from prepfuse.ops import gqa_qknorm_rope_kv_insert_triton
    from prepfuse.testing import seeded_gqa_inputs

    inputs, seed = seeded_gqa_inputs(1, 4, 2, 64, 16, "cpu", skip_fraction=0.0)
    slots = inputs.slot_mapping.clone()
    whole = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*whole.args())
    skipped = decode_floor.gqa_slots_skipped(inputs.fresh_outputs())
    poisoned = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*skipped.args())
    assert torch.equal(_bits(skipped.q_out), _bits(whole.q_out)), f"seed={seed}"
    for name in ("k_cache", "v_cache"):
        assert torch.equal(_bits(getattr(skipped, name)), _bits(getattr(poisoned, name))), f"seed={seed}: {name}"
    assert torch.equal(inputs.slot_mapping, slots) and bool((slots >= 0).all())


def test_gqa_kv_first_rows_launch_the_k_programs_first(monkeypatch):
    """The kv-first rows run what they say: the whole launch writes every output as the op's
    own order does, and its cut to Hkv programs writes k_cache and nothing else (the k
    programs lead the grid); the rows are gated before they are timed."""
    import bench_gqa_qknorm_rope_kv_insert as gqa
    import decode_floor

    from prepfuse.ops import gqa_qknorm_rope_kv_insert_triton
    from prepfuse.testing import seeded_gqa_inputs

    hq, hkv = 4, 2
    monkeypatch.setitem(gqa.MODELS, "tiny", (hq, hkv) + tuple(gqa.MODELS["qwen3-8b"][2:]))
    gated = []
    monkeypatch.setattr(gqa, "_gate", lambda fn, inputs, model: (gated.append(model) or True, {}))
    inputs, seed = seeded_gqa_inputs(1, hq, hkv, 64, 16, "cpu", skip_fraction=0.0)
    whole = inputs.fresh_outputs()
    gqa_qknorm_rope_kv_insert_triton(*whole.args())

    rows = decode_floor.gqa_kv_first_rows("gqa-tiny", inputs)
    assert list(rows) == ["op gqa-tiny, kv programs first",
                          "op gqa-tiny, kv programs first, k programs only (2 of 8)"]
    assert len(gated) == 1
    poisoned = inputs.fresh_outputs()
    for name, writes in zip(rows, (("q_out", "k_cache", "v_cache"), ("k_cache",))):
        for out in ("q_out", "k_cache", "v_cache"):
            getattr(inputs, out).copy_(getattr(poisoned, out))
        rows[name]()
        for out in ("q_out", "k_cache", "v_cache"):
            expected = getattr(whole if out in writes else poisoned, out)
            assert torch.equal(_bits(getattr(inputs, out)), _bits(expected)), f"seed={seed}: {name}, {out}"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_indexer_rows_cut_the_q_programs_and_put_the_k_row_first(fmt, monkeypatch):
    """The indexer rows run what they say at T=1 (64 q programs of one head, then the k row):
    the q-programs cut writes q and the weights and no cache byte, the k-first launch writes
    what the op writes, and its cut to one program writes the k row's slot and nothing of q;
    the k-first launch is gated before it is timed."""
    import bench_dsv4_indexer_rope_quant_insert as idx
    import decode_floor

    from prepfuse.ops import dsv4_indexer_rope_fp8_insert_triton, dsv4_indexer_rope_mxfp4_insert_triton
    from prepfuse.testing import make_dsv4_indexer_inputs

    # the Triton launch itself (on the CPU the op's dispatcher runs the reference)
    op = dsv4_indexer_rope_fp8_insert_triton if fmt == "fp8" else dsv4_indexer_rope_mxfp4_insert_triton
    gated = []
    monkeypatch.setattr(idx, "gate", lambda impl, f, fn, inputs: (gated.append((impl, f)) or True, {}))
    inputs = make_dsv4_indexer_inputs(fmt, 1, 64, 64, "cpu", num_k=1, skip_fraction=0.0,
                                      generator=torch.Generator().manual_seed(7))
    outputs = ["q_out", "weights_out", "k_cache"] + (["q_scale"] if fmt == "mxfp4" else [])
    whole = inputs.fresh_outputs()
    op(*whole.args())

    def launch(inp):
        op(*inp.args())

    rows = decode_floor.indexer_rows(f"indexer-{fmt}", launch, inputs)
    assert list(rows) == [f"op indexer-{fmt}, q programs only (64 of 65)", f"op indexer-{fmt}, k programs first",
                          f"op indexer-{fmt}, k programs first, k programs only (1 of 65)"]
    assert gated == [("fused", fmt)]
    poisoned = inputs.fresh_outputs()
    writes = (("q_out", "weights_out", "q_scale"), tuple(outputs), ("k_cache",))
    for name, written in zip(rows, writes):
        for out in outputs:
            getattr(inputs, out).copy_(getattr(poisoned, out))
        rows[name]()
        for out in outputs:
            expected = getattr(whole if out in written else poisoned, out)
            assert torch.equal(_bits(getattr(inputs, out)), _bits(expected)), f"{name}, {out}"
