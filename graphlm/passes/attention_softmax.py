"""Pass `attention_softmax`: attention's scale and causal mask folded into its softmax, forward
``softmax(causal_mask(x * c))`` -> `softmax_fused` and backward
``causal_mask(softmax_backward(y, g), fill=0) * c`` -> `softmax_backward_fused`, where the
intermediates have no other use (graphs that spell attention out; the fused kernels make the
same arithmetic in fewer passes over the scores)."""
from __future__ import annotations

from .rewrite import Pass, Rule


def scalar_const(node):
    """(other input, const input, const position) when `node` is a mul by a 0-d const, else None."""
    if node.op != "mul" or len(node.inputs) != 2:
        return None
    for pos in (0, 1):
        c = node.inputs[pos]
        if c.op == "const" and c.shape == () and c.dtype == node.dtype and node.inputs[1 - pos].shape == node.shape:
            return node.inputs[1 - pos], c, pos
    return None


def _last_axis(node) -> bool:
    return node.ndim >= 2 and node.attrs.get("axis") == node.ndim - 1


def _forward(node, ctx):
    if not _last_axis(node) or node.dtype.kind != "f":
        return None
    src, mask, scale = node.inputs[0], None, None
    if src.op == "causal_mask" and ctx.private(src):
        mask, src = src, src.inputs[0]
    sc = scalar_const(src) if ctx.private(src) else None
    if sc is not None:
        scale, src = sc, sc[0]
    if mask is None and scale is None:
        return None
    absorbed = [mask] if mask is not None else []
    if scale is not None:   # the mul by the scale
        absorbed.append(mask.inputs[0] if mask is not None else node.inputs[0])
    ctx.absorb(*absorbed)
    ins = [ctx.new(src)] + ([ctx.new(scale[1])] if scale else [])
    return ctx.emit("softmax_fused", ins, mask=(mask.attrs["fill"], mask.attrs["offset"]) if mask is not None else None,
                    scale_pos=scale[2] if scale else None)


def _backward(node, ctx):
    if node.dtype.kind != "f":
        return None
    scale, mask, cur = None, None, node
    sc = scalar_const(node)
    if sc is not None:
        scale, cur = sc, sc[0]
        if not ctx.private(cur):
            return None
    if cur.op == "causal_mask" and cur.attrs["fill"] == 0.0:
        mask, cur = cur, cur.inputs[0]
        if not ctx.private(cur):
            return None
    if cur.op != "softmax_backward" or not _last_axis(cur) or (mask is None and scale is None) \
            or (mask is not None and mask is not node and scale is None):
        return None
    if scale is None and node.op != "causal_mask":
        return None
    ctx.absorb(*(x for x in (cur, mask) if x is not None and x is not node))
    ins = [ctx.new(i) for i in cur.inputs] + ([ctx.new(scale[1])] if scale else [])
    return ctx.emit("softmax_backward_fused", ins, axis=cur.attrs["axis"],
                    mask=(0.0, mask.attrs["offset"]) if mask is not None else None,
                    scale_pos=scale[2] if scale else None)


ATTENTION_SOFTMAX = Pass("attention_softmax", (
    Rule("softmax of scaled, masked scores", ("softmax",), _forward),
    Rule("masked, scaled softmax gradient", ("mul", "causal_mask"), _backward),
), doc="softmax(causal_mask(x * c)) -> softmax_fused; causal_mask(softmax_backward(y, g)) * c -> "
       "softmax_backward_fused")
