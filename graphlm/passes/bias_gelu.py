"""Pass `bias_gelu`: a product's bias added in the tanh GELU that follows it. ``gelu(m + b)`` (b
along the last axis; through a reshape that regroups the rows) becomes `bias_gelu(m, b)` and the
GELU's ``gelu_backward(m + b, g)`` becomes `bias_gelu_backward(m, b, g)`: m + b is computed where
it is read and never stored, where the pattern wrote it, read it back in the forward and read it
again in the backward (the backward now reads m instead, the same size). x = m + b rounded first,
then the GELU's own arithmetic, so no bit changes. float32, in the native pipeline only: its C
kernels are what make it cheaper."""
from __future__ import annotations

from .rewrite import Pass, Rule


def _gelu_reader(r, x) -> bool:
    """Whether `r` is a tanh GELU of `x` or that GELU's backward (x its input, not its cotangent)."""
    if r.op == "gelu":
        return r.attrs["approximate"] == "tanh"
    return r.op == "gelu_backward" and r.attrs["approximate"] == "tanh" and r.inputs[0] is x and r.inputs[1] is not x


def _biased(x, ctx):
    """(m, b, absorbed nodes) where `x`, read only as the input of tanh GELUs and their backwards,
    is m + b (b along the last axis), through at most one reshape that keeps the last axis."""
    readers = ctx.readers(x)
    if x.dtype.name != "float32" or ctx.uses(x) != len(readers) or not all(_gelu_reader(r, x) for r in readers):
        return None
    h = x
    if x.op == "reshape" and x.inputs[0].shape[-1:] == x.shape[-1:] and ctx.private(x.inputs[0]):
        h = x.inputs[0]
    if h.op != "add":
        return None
    for m, b in (h.inputs, h.inputs[::-1]):
        if m.shape == h.shape and b.shape == h.shape[-1:]:
            return m, b, [n for n in (x, h) if n.op in ("add", "reshape")]
    return None


def _gelu(node, ctx):
    x = node.inputs[0]
    found = _biased(x, ctx) if node.attrs["approximate"] == "tanh" else None
    if found is None:
        return None
    m, b, absorbed = found
    ctx.absorb(*absorbed)
    mv = ctx.new(m)
    if m.shape != x.shape:   # (rows regrouped: a view)
        mv = ctx.emit("reshape", (mv,), shape=x.shape)
    ctx.memo[("bias gelu", x.id)] = mv, ctx.new(b)
    return ctx.emit("bias_gelu", (mv, ctx.new(b)), approximate="tanh")


def _gelu_backward(node, ctx):
    made = ctx.memo.get(("bias gelu", node.inputs[0].id))
    if made is None:
        return None
    return ctx.emit("bias_gelu_backward", (*made, ctx.new(node.inputs[1])), approximate="tanh")


BIAS_GELU = Pass("bias_gelu", (Rule("a product's bias added in the GELU", ("gelu",), _gelu),
                               Rule("that GELU's backward", ("gelu_backward",), _gelu_backward)),
                 doc="gelu(m + b) -> bias_gelu(m, b); gelu_backward(m + b, g) -> bias_gelu_backward(m, b, g)")
