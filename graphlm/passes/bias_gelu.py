"""Pass `bias_gelu`: an MLP's first bias added where its GELU reads it. ``gelu(m + b)`` (b along
the last axis, read through at most one reshape that regroups the rows) becomes `bias_gelu(m, b)`
and its backward ``gelu_backward(m + b, g)`` becomes `bias_gelu_backward(m, b, g)`.

The pattern writes m + b and reads it back in the forward and again in the backward; the fused
nodes form m + b where they read it (one rounding, as the add), so no bit changes and m + b is
never stored: the forward keeps m for the backward instead. Only where every reader of m + b is
such a GELU or GELU backward (else the sum is stored anyway). float32, in the native pipeline
only: its C kernels are what make the fused passes cheaper. (Summing the bias's gradient in the
same pass did not pay: its rows must be summed in order, so its threads take column ranges, and
half rows from memory cost as much as whole ones.)"""
from __future__ import annotations

from .rewrite import Pass, Rule, bias_add, regrouped


def _biased(x, ctx):
    """(m, b, the add and reshape) where `x` is m + b, b along the last axis (read through a
    reshape that keeps the last axis), and every reader of the sum is a GELU or the x of a GELU
    backward (a reshape between read by them only); None otherwise."""
    h = regrouped(x)
    found = bias_add(h)
    if found is None or h.dtype.name != "float32" or ctx.uses(h) != len(ctx.readers(h)):   # (not an output)
        return None
    readers = ctx.readers(h)
    if x is not h:
        if readers != [x] or ctx.uses(x) != len(ctx.readers(x)):
            return None
        readers = ctx.readers(x)
    if not all(r.op == "gelu" or (r.op == "gelu_backward" and r.inputs[1] is not x) for r in readers):
        return None
    return (*found, [h] if x is h else [x, h])


def _fuse(node, ctx):
    found = _biased(node.inputs[0], ctx)
    if found is None:
        return None
    m, b, absorbed = found
    if node.op == "gelu":
        ctx.absorb(*absorbed)
    fused = "bias_gelu" if node.op == "gelu" else "bias_gelu_backward"
    return ctx.emit(fused, (ctx.new_as(m, node.shape), ctx.new(b)) + tuple(ctx.new(g) for g in node.inputs[1:]),
                    approximate=node.attrs["approximate"])


BIAS_GELU = Pass("bias_gelu", (Rule("a GELU of a biased product, or its backward", ("gelu", "gelu_backward"), _fuse),),
                 doc="gelu(m + b) -> bias_gelu(m, b); gelu_backward(m + b, g) -> bias_gelu_backward(m, b, g)")
