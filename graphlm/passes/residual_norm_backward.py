"""Pass `residual_norm_backward`: a pre-norm block's residual gradient added where its layer
norm's backward writes. In a pre-norm decoder the residual stream's gradient is
``add(r, layer_norm_backward_kept(xc, sv, [w], g))`` at every norm: r flows on and the norm adds
its input gradient. The pattern writes the norm's gradient and reads it back with r; the fused
``layer_norm_backward_kept(xc, sv, [w], g, r, residual=True)`` adds r as it writes (the add's
rounding: a + b == b + a in IEEE arithmetic, so no bit changes) and the sum is its output.
Only where the add reads the norm's gradient alone (else it is stored anyway), with r of the
same shape and dtype. float32, in the native pipeline only (after kept_values, which makes the
kept backward): its C kernel is what makes the one pass cheaper."""
from __future__ import annotations

from .rewrite import Pass, Rule


def _folds(norm, r, node, ctx) -> bool:
    """Whether `node` = `norm` + `r` can become `norm` with r added: a kept layer-norm backward
    read only here, r the same shape and dtype (no broadcast)."""
    return (norm.op == "layer_norm_backward_kept" and not norm.attrs.get("residual") and ctx.private(norm)
            and norm.shape == r.shape == node.shape and norm.dtype == r.dtype == node.dtype)


def _fold(node, ctx):
    if node.dtype.name != "float32" or len(node.inputs) != 2:
        return None
    for norm, r in (node.inputs, node.inputs[::-1]):
        if _folds(norm, r, node, ctx):
            break
    else:
        return None
    ctx.absorb(norm)
    return ctx.emit("layer_norm_backward_kept", [ctx.new(i) for i in norm.inputs] + [ctx.new(r)],
                    eps=norm.attrs["eps"], has_weight=norm.attrs["has_weight"], residual=True)


RESIDUAL_NORM_BACKWARD = Pass("residual_norm_backward", (
    Rule("a residual gradient plus a layer norm's input gradient", ("add",), _fold),
), doc="add(r, layer_norm_backward_kept(xc, sv, [w], g)) -> layer_norm_backward_kept(xc, sv, [w], g, r, residual=True)")
