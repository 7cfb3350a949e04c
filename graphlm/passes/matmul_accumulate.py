"""Pass `matmul_accumulate`: ``sum(matmul(a, b), axis 0)`` of a 3-D product that `matmul_sum` left
alone (its summed axis folds into the contraction only through a copy) as one `matmul_accumulate`
node. The fused QKV product's input gradient is such a sum, ``sum_j dqkv[j] @ W[j]^T``: stored, its
three [B*T, C] products are written and read back once more by the sum; accumulated, each product
is added into the output by the GEMM itself. The same values: each product rounds as it did, and
they are added in the sum's order. float32, in the native pipeline only: its oneMKL products are
what add as they store (the numpy executor would compute the products and the sum as before)."""
from __future__ import annotations

from .rewrite import Pass, Rule


def _accumulate(node, ctx):
    mm = node.inputs[0]
    if (mm.op != "matmul" or mm.ndim != 3 or tuple(node.attrs["axes"]) != (0,) or not ctx.private(mm)
            or mm.dtype.name != "float32"):
        return None
    ctx.absorb(mm)
    return ctx.emit("matmul_accumulate", tuple(ctx.new(i) for i in mm.inputs), axes=(0,),
                    keepdims=node.attrs["keepdims"])


MATMUL_ACCUMULATE = Pass("matmul_accumulate", (Rule("sum of a 3-D product over its batch axis", ("sum",), _accumulate),),
                         doc="sum(matmul(a, b), axis 0) -> matmul_accumulate(a, b), the products added as stored")
