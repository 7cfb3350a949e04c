"""Pass `slice_gradients`: a tree of ``add`` nodes over ``slice_backward`` nodes with disjoint
windows (the gradient of q, k and v sliced from one fused QKV product) as one `slices_assemble`
node, which writes each gradient into its window (zero-filling only what no window covers),
reading through any private reshape chain above a gradient instead of copying it. Each covered
element is ``g + 0``, as in the sum of zero-padded arrays it replaces."""
from __future__ import annotations

import numpy as np

from graphlm.layout import reshapes_as_view, stand_in

from .rewrite import Pass, Rule


def _leaves(node, ctx, inner):
    """The slice_backward leaves of the add tree at `node` (its private inner adds collected in
    `inner`), or None when the tree holds anything else."""
    if node.op == "slice_backward":
        return [node]
    if node.op == "add" and all(i.shape == node.shape for i in node.inputs) and node.inputs[0] is not node.inputs[1]:
        found = []
        for i in node.inputs:
            sub = _leaves(i, ctx, inner) if ctx.private(i) else None
            if sub is None:
                return None
            found += sub
        inner.append(node)
        return found
    return None


def _assemble(node, ctx):
    if node.dtype.kind != "f":
        return None
    inner: list = []
    found = _leaves(node, ctx, inner)
    if not found or len(found) < 2:
        return None
    cover = np.zeros(node.shape, np.int8)
    for sb in found:
        cover[sb.attrs["index"]] += 1
    if cover.max() > 1:
        return None
    base, srcs = stand_in(node.shape, node.dtype), []
    for sb in found:
        src, window = sb.inputs[0], base[sb.attrs["index"]]
        chain = []
        while src.op == "reshape" and ctx.private(src) and reshapes_as_view(window, src.inputs[0].shape):
            chain.append(src)
            src = src.inputs[0]
        ctx.absorb(sb, *chain)
        srcs.append(ctx.new(src))
    ctx.absorb(*(n for n in inner if n is not node))
    return ctx.emit("slices_assemble", srcs, shape=node.shape, indexes=[sb.attrs["index"] for sb in found],
                    covered=bool(cover.min() == 1))


SLICE_GRADIENTS = Pass("slice_gradients", (Rule("sum of disjoint slice gradients", ("add",), _assemble),),
                       doc="add(... slice_backward(g_i) ...) over disjoint windows -> slices_assemble(g_i...)")
