"""Pass `matmul_sum`: ``sum(matmul(a, b), batch axes)`` (the weight gradient of a batched product)
as one `matmul_sum` node, one product with the summed axes folded into the contraction (it
rounds as that product, not as the batched one; programs with it say so). Only where the folded
operands are views of the inputs' memory (graphlm.ops.matmul_sum_folding on their layouts): a
fold through a copy costs more than it saves."""
from __future__ import annotations

from graphlm.layout import reshapes_as_view
from graphlm.ops import matmul_sum_folding

from .rewrite import Pass, Rule


def _fold(node, ctx):
    mm = node.inputs[0]
    axes = node.attrs["axes"]
    if mm.op != "matmul" or not ctx.private(mm) or not axes or max(axes) >= mm.ndim - 2 \
            or mm.dtype.kind != "f":
        return None
    pa, sa, pb, sb, _ = matmul_sum_folding(ctx.layout(mm.inputs[0]), ctx.layout(mm.inputs[1]), axes)
    if not (reshapes_as_view(pa, sa) and reshapes_as_view(pb, sb)):
        return None
    ctx.absorb(mm)
    a, b = (ctx.new(i) for i in mm.inputs)
    return ctx.emit("matmul_sum", (a, b), axes=axes, keepdims=node.attrs["keepdims"])


MATMUL_SUM = Pass("matmul_sum", (Rule("sum of a batched matmul", ("sum",), _fold),),
                  doc="sum(matmul(a, b), batch axes) -> matmul_sum(a, b)")
