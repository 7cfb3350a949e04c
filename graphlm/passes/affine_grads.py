"""Pass `affine_grads`: an affine map's weight and bias gradients, ``sum(g * x)`` and ``sum(g)``
over the leading axes (a layer norm's: layer_norm's VJP), as one `affine_grads` node whose two
halves are views. The pattern writes g * x and reads it back, and reads g twice; the fused node
reads g and x once. Each sum rounds as before (the rows in order), so the rewrite changes no bit.
The weight's sum comes first in the VJP's order; the bias's sum, met later, becomes the view
made then. In the native pipeline only: its C kernel is what makes the one pass cheaper (the
numpy executor would compute the same two reductions)."""
from __future__ import annotations

from graphlm.ops import normalize_index

from .rewrite import Pass, Rule


def _over_rows(node) -> bool:
    """Whether `node` is a sum over every axis of its input but the last (not kept)."""
    x = node.inputs[0]
    return (node.op == "sum" and x.ndim >= 2 and not node.attrs["keepdims"]
            and tuple(node.attrs["axes"]) == tuple(range(x.ndim - 1)))


def _half(ctx, flat, which: int):
    c = flat.shape[0] // 2
    return ctx.emit("slice", (flat,), index=normalize_index(slice(which * c, (which + 1) * c), flat.shape))


def _fuse(node, ctx):
    made = ctx.memo.get(("affine bias", node.id))
    if made is not None:   # the bias's sum: the second half of the node its weight's sum made
        return made
    p = node.inputs[0]
    if not _over_rows(node) or p.op != "mul" or not ctx.private(p) or p.dtype.kind != "f" \
            or any(i.shape != p.shape for i in p.inputs):
        return None
    for g, x in (p.inputs, p.inputs[::-1]):
        bias = next((r for r in ctx.readers(g) if r.id > node.id and _over_rows(r)), None)
        if bias is not None:
            break
    else:
        return None
    ctx.absorb(p)
    flat = ctx.emit("affine_grads", (ctx.new(g), ctx.new(x)))
    ctx.memo[("affine bias", bias.id)] = _half(ctx, flat, 1)
    return _half(ctx, flat, 0)


AFFINE_GRADS = Pass("affine_grads", (Rule("an affine map's weight and bias gradients", ("sum",), _fuse),),
                    doc="sum(g * x) and sum(g) over the leading axes -> the halves of affine_grads(g, x)")
