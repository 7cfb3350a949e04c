"""Pass `affine_grads`: an affine map's weight and bias gradients, ``sum(g * x)`` and ``sum(g)``
over the leading axes (a layer norm's: layer_norm's VJP), as the two halves of one
`affine_grads(g, x)` node, each a view. The pattern writes g * x and reads it back, and reads g
twice; the fused node reads g and x once. The weight's sum comes first in the VJP's order; the
bias's sum, met later, becomes the view made then. Each sum rounds as the `sum` op (the rows in
order, from 0), so the pass changes no bit. float32, in the native pipeline only: its C kernel
is what makes the one pass cheaper (the numpy executor would compute the same two reductions).

Where x is a private ``div(xc, d)`` with d one value per row (the native kept_values pass's
xhat = xc / sv of a layer norm), the division is absorbed too: ``affine_grads(g, xc, d)`` divides
as it reads, the same quotients, so xhat is never stored."""
from __future__ import annotations

from .rewrite import Pass, Rule


def _over_rows(node, of=None) -> bool:
    """Whether `node` is a sum over every axis of its input (`of`, if given) but the last."""
    if node.op != "sum" or (of is not None and node.inputs[0] is not of):
        return False
    x = node.inputs[0]
    return x.ndim >= 2 and tuple(node.attrs["axes"]) == tuple(range(x.ndim - 1))


def _made(node, ctx):
    """A sum an earlier rule replaced with a view of its flat node."""
    return ctx.memo.get(("summed", node.id))


def _per_row_quotient(x, ctx) -> bool:
    """Whether `x` is ``div(xc, d)``, read only here, with d one value per row of xc."""
    if x.op != "div" or not ctx.private(x):
        return False
    xc, d = x.inputs
    return xc.shape == x.shape and d.shape == x.shape[:-1] + (1,) and xc.dtype == d.dtype == x.dtype


def _affine(node, ctx):
    p = node.inputs[0]
    if not _over_rows(node) or p.op != "mul" or not ctx.private(p) or p.dtype.name != "float32" \
            or any(i.shape != p.shape for i in p.inputs):
        return None
    for g, x in (p.inputs, p.inputs[::-1]):
        bias = next((r for r in ctx.readers(g) if r.id > node.id and _over_rows(r, g)), None)
        if bias is not None:
            break
    else:
        return None
    ctx.absorb(p)
    if _per_row_quotient(x, ctx):
        ctx.absorb(x)
        flat = ctx.emit("affine_grads", (ctx.new(g), *(ctx.new(i) for i in x.inputs)))
    else:
        flat = ctx.emit("affine_grads", (ctx.new(g), ctx.new(x)))
    c = g.shape[-1]
    ctx.memo[("summed", bias.id)] = ctx.emit_part(flat, c, 2 * c, bias.shape)
    return ctx.emit_part(flat, 0, c, node.shape)


AFFINE_GRADS = Pass("affine_grads", (
    Rule("a sum an earlier rule computed", ("sum",), _made),
    Rule("an affine map's weight and bias gradients", ("sum",), _affine),
), doc="sum(g * x) and sum(g) over the rows -> the halves of affine_grads(g, x)")
