"""How DeepSeek-V4 code pads its prepared q to the attention kernel's head count.

FlashMLA reads ``[T, HP, 512]`` with ``HP >= H`` (64 where H <= 64, else 128). The fused op
writes those zero heads itself, so a reader of the prepared q that only pads it is served
by the op's ``q_out`` directly. Three spellings reach the graph:

- ``F.pad(q, (0, 0, 0, HP - H))``: one ``constant_pad_nd``;
- ``out = q.new_zeros(T, HP, 512); out[:, :H] = q``: ``slice_scatter(full(0), q, 1, 0, H)``;
- a caller's buffer written whole, ``buf[:, :H] = q; buf[:, H:] = 0`` (either order): the
  same scatter into ``buf`` chained with a scatter of zeros into heads ``H:``; the op then
  writes the caller's buffer itself (no scratch, no copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from prepfuse.fx_passes.matching.nodes import INT_MAX, aten, is_op, same_size, shape, slice_params, val

__all__ = ["Padding", "head_padding"]


@dataclass
class Padding:
    """A reader of the prepared q that pads it to ``padded_heads`` with zero heads."""

    node: torch.fx.Node  # the padded [T, HP, 512] value
    padded_heads: int
    buffer: torch.fx.Node | None  # a caller's [T, HP, 512] buffer written whole, else None


def _heads_scatter(node, start, end) -> bool:
    return is_op(node, aten.slice_scatter.default) and slice_params(node.args[2:], node.kwargs) in (
        (1, start, end, 1), (-2, start, end, 1))


def _zeros_into(scatter, src) -> bool:
    """``scatter`` writes zeros into heads ``H:`` of ``src`` (a broadcast ``copy`` or a zero tensor)."""
    z = scatter.args[1]
    if is_op(z, aten.copy.default) and is_op(z.args[0], aten.slice.Tensor) and z.args[0].args[0] is src:
        z = z.args[1]
    return is_op(z, aten.full.default) and z.args[1] == 0


def head_padding(user: torch.fx.Node, prepared: torch.fx.Node, head_dim: int) -> Padding | None:
    """How ``user`` pads ``prepared [T, H, head_dim]`` with zero heads, or None."""
    num_heads = shape(prepared)[1]
    if is_op(user, aten.constant_pad_nd.default):
        pad = list(user.args[1])
        value = user.args[2] if len(user.args) > 2 else 0.0
        if len(pad) == 4 and pad[:3] == [0, 0, 0] and value == 0 and isinstance(pad[3], int) and pad[3] >= 0:
            return Padding(user, num_heads + pad[3], None)
        return None
    written = user
    if is_op(user, aten.copy.default) and user.args[1] is prepared and len(user.users) == 1:
        written = next(iter(user.users))
    if not (_heads_scatter(written, 0, num_heads) and written.args[1] is (user if written is not user else prepared)):
        return None
    dest = written.args[0]
    out_shape = shape(dest)
    if (len(out_shape) != 3 or not same_size(out_shape[0], shape(prepared)[0]) or out_shape[2] != head_dim
            or val(dest).dtype != val(prepared).dtype):
        return None
    if is_op(dest, aten.full.default) and dest.args[1] == 0:
        return Padding(written, out_shape[1], None)
    end = (out_shape[1], INT_MAX)
    if any(_heads_scatter(dest, num_heads, e) for e in end) and _zeros_into(dest, dest.args[0]):  # zeros first
        return Padding(written, out_shape[1], dest.args[0])
    zeroing = [u for u in written.users if any(_heads_scatter(u, num_heads, e) for e in end) and u.args[0] is written]
    if len(zeroing) == 1 and _zeros_into(zeroing[0], written) and all(
            u is zeroing[0] or is_op(u, aten.slice.Tensor) for u in written.users):  # zeros after
        return Padding(zeroing[0], out_shape[1], dest)
    return None
