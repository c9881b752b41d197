"""vLLM's IR ops read through their native implementation (``matching/op_references.py``).

vLLM 0.33 writes its norms as IR ops (``vllm_ir::rms_norm``, ``fused_add_rms_norm``, ...):
``RMSNorm.forward_native`` calls ``vllm.ir.ops.rms_norm``, which reaches the post-grad graph
as one node and is lowered to a kernel only after the custom passes. Each IR op is registered
with its native implementation in plain PyTorch (``IrOp.impls["native"].impl_fn``), the math
vLLM's own tests hold every kernel to. The finder here gives the families that
implementation for any op of the ``vllm_ir`` namespace, found from the op: a new IR op needs
no declaration. An op without a native implementation, or its ``maybe_inplace`` overload
(which may write an argument), stays opaque.
"""

from __future__ import annotations

from typing import Callable

import torch
from vllm.ir.op import IrOp

from prepfuse.fx_passes.matching.op_references import register_reference_finder

__all__ = ["IR_NAMESPACE", "native_implementation"]

IR_NAMESPACE = "vllm_ir"


def native_implementation(op: torch._ops.OpOverload) -> Callable | None:
    """The native implementation of the IR op ``op`` is the default overload of, or None."""
    ir_op = IrOp.registry.get(op._schema.name.split("::", 1)[-1])
    if ir_op is None or getattr(ir_op, "torch_op", None) is not op or "native" not in ir_op.impls:
        return None
    return ir_op.impls["native"].impl_fn


register_reference_finder(IR_NAMESPACE, native_implementation)
