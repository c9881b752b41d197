"""What the GQA operand-form tests share: one call on fresh poisoned outputs, and the
parity check of a kernel against the reference and of the separate-projections op against
the fused one (both ops run one kernel: ``on_qkv_columns``)."""

from __future__ import annotations

from prepfuse.ops import GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, gqa_qknorm_rope_kv_insert_reference
from prepfuse.testing import GqaInputs, compare_gqa


def run(impl, inputs: GqaInputs, *, separate: bool = False) -> GqaInputs:
    """``impl`` on fresh poisoned outputs of ``inputs`` (``separate``: the three-source arguments)."""
    out = inputs.fresh_outputs()
    impl(*(out.separate_args() if separate else out.args()))
    return out


def assert_kernel_matches_reference(kernel, inputs: GqaInputs, seed: int) -> None:
    """``kernel`` writes the reference's bytes, bit for bit, and so does the separate op."""
    expected, actual = run(gqa_qknorm_rope_kv_insert_reference, inputs), run(kernel, inputs)
    assert compare_gqa(expected, actual).exact(), f"seed={seed}: {compare_gqa(expected, actual)}"
    separate = run(GQA_SEPARATE_QKNORM_ROPE_KV_INSERT, inputs, separate=True)
    assert compare_gqa(actual, separate).exact(), f"seed={seed}: separate op {compare_gqa(actual, separate)}"
