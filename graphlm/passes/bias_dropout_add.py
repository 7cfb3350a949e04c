"""Pass `bias_dropout_add`: a residual add of a product's output, its bias added and dropped out,
``r + dropout_apply(m + b, keep)`` (through a reshape that regroups the rows), as one
`bias_dropout_add(r, m, b, keep)` node: a transformer block's residual update after its output
projection. The pattern writes m + b and the dropped value and reads each back; the fused node
reads r, m, b and the mask once. The same three roundings in order, so no bit changes. float32,
in the native pipeline only: its C kernel is what makes the one pass cheaper."""
from __future__ import annotations

from .rewrite import Pass, Rule, bias_add, regrouped


def _dropped_bias_add(t, ctx):
    """(m, b, keep, absorbed nodes) where `t` is dropout_apply(m + b, keep), b along the last
    axis, read through at most one reshape that keeps the last axis, each node read once."""
    if t.op != "dropout_apply" or not ctx.private(t):
        return None
    x, keep = t.inputs
    h = regrouped(x)
    found = bias_add(h)
    if found is None or not ctx.private(h) or not ctx.private(x):
        return None
    return (*found, keep, [t, h] if h is x else [t, x, h])


def _fuse(node, ctx):
    if node.dtype.name != "float32" or any(i.shape != node.shape for i in node.inputs):
        return None
    for r, dropped in (node.inputs, node.inputs[::-1]):
        found = _dropped_bias_add(dropped, ctx) if r is not dropped else None
        if found is not None:
            break
    else:
        return None
    m, b, keep, absorbed = found
    ctx.absorb(*absorbed)
    return ctx.emit("bias_dropout_add", (ctx.new(r), ctx.new_as(m, node.shape), ctx.new(b), ctx.new(keep)),
                    p=dropped.attrs["p"])


BIAS_DROPOUT_ADD = Pass("bias_dropout_add", (Rule("a residual add of a dropped-out biased product", ("add",), _fuse),),
                        doc="r + dropout_apply(m + b, keep) -> bias_dropout_add(r, m, b, keep)")
