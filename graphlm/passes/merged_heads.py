"""Pass `merged_heads`: a causal attention stores its results with the heads' axis after T, so
that merging the heads, and assembling the QKV gradient, are views instead of copies.

A block's attention works on [B, H, T, D] heads; its output projection reads them merged,
``reshape(transpose(y, (0, 2, 1, 3)), [B, T, H * D])``, a copy of y; and the backward assembles
dq, dk and dv, each transposed the same way, into the [3, B * T, C] gradient of the fused QKV
product (`slices_assemble`), a copy of all three. With the attribute ``heads_merged`` (graphlm.ops)
the attention nodes store those results as [..., T, H, D] (the C kernels write their rows H * D
floats apart), and:

- ``transpose(y, swap T and H)`` of a causal_attention (or of the y part of a
  causal_attention_keep) -> the stored array itself; y's other readers (its backward's ``o``)
  read the transposed view;
- ``slices_assemble`` of the three transposed results of one attention backward (kept or not),
  each whole in its third of the output -> ``reshape(backward(heads_merged), shape)``.

The same values in other places: no bit changes. float32, in the native pipeline only, whose C
attention kernels read and write the strided rows (the numpy executor's kernels take them too:
the native executor's fallback).
"""
from __future__ import annotations

from graphlm.ops import heads_merged_shape, op_attrs

from .rewrite import Pass, Rule

_BACKWARDS = ("causal_attention_backward", "causal_attention_backward_kept")


def _heads_swap(ndim: int) -> tuple[int, ...]:
    """The axes of a transpose swapping the axes -3 and -2 (the heads and T) of an ndim array."""
    axes = list(range(ndim))
    axes[-3], axes[-2] = axes[-2], axes[-3]
    return tuple(axes)


def _swaps_heads(t, ndim: int) -> bool:
    """Whether `t` is a transpose swapping the heads and T of an ndim array."""
    return t.op == "transpose" and ndim >= 3 and tuple(t.attrs["axes"]) == _heads_swap(ndim)


def _merges(y, ctx) -> bool:
    """Whether the readers of `y` (an attention's [..., H, T, D] output) are transposes that swap
    T and the heads (at least one) and attention backwards reading it as their output `o`."""
    readers = ctx.readers(y)
    merging = [r for r in readers if _swaps_heads(r, y.ndim)]
    rest = [r for r in readers if r not in merging]
    return (bool(merging) and y.dtype.name == "float32"
            and all(r.op in _BACKWARDS and r.inputs[3] is y and sum(i is y for i in r.inputs) == 1 for r in rest))


def _swap_heads(x, ctx):
    return ctx.emit("transpose", (x,), axes=_heads_swap(x.ndim))


def _attention(node, ctx):
    """causal_attention -> the heads_merged node, its [..., H, T, D] value as a transposed view."""
    if node.attrs.get("heads_merged") or not _merges(node, ctx):
        return None
    merged = ctx.emit("causal_attention", [ctx.new(i) for i in node.inputs], **op_attrs(node), heads_merged=True)
    ctx.memo[("merged", node.id)] = merged
    return _swap_heads(merged, ctx)


def _attention_keep(node, ctx):
    """causal_attention_keep -> the heads_merged node (the same flat size), where its y part
    (slice, then reshape to q's shape) merges."""
    if node.attrs.get("heads_merged"):
        return None
    n = node.inputs[0].size
    for s in ctx.readers(node):
        if s.op == "slice" and s.shape == (n,) and s.attrs["index"][0].start in (0, None) and ctx.private(s):
            (y,) = ctx.readers(s)
            if y.op == "reshape" and y.shape == node.inputs[0].shape and _merges(y, ctx):
                ctx.memo[("merged y", y.id)] = True
                return ctx.emit("causal_attention_keep", [ctx.new(i) for i in node.inputs], **op_attrs(node),
                                heads_merged=True)
    return None


def _kept_y(node, ctx):
    """The y part of a merged causal_attention_keep: stored [..., T, H, D], read as the transposed view."""
    if ("merged y", node.id) not in ctx.memo:
        return None
    merged = ctx.emit("reshape", (ctx.new(node.inputs[0]),), shape=heads_merged_shape(node.shape))
    ctx.memo[("merged", node.id)] = merged
    return _swap_heads(merged, ctx)


def _transpose(node, ctx):
    """transpose(y, swap T and the heads) of a merged attention's y: the stored array."""
    merged = ctx.memo.get(("merged", node.inputs[0].id))
    return merged if merged is not None and _swaps_heads(node, node.ndim) else None


def _whole_third(index, shape, i) -> bool:
    """Whether `index` (normalized) selects all of [i, ...] of an array of `shape`."""
    return (len(index) == len(shape) and index[0] == i
            and all(isinstance(ix, slice) and ix.start in (0, None) and ix.stop in (n, None) and ix.step in (1, None)
                    for ix, n in zip(index[1:], shape[1:])))


def _third(t, ctx):
    """(the attention backward, i) where `t` is transpose(slice(backward, i), swap T and the
    heads), each node read once; else None."""
    if not (_swaps_heads(t, t.ndim) and ctx.private(t)):
        return None
    s = t.inputs[0]
    if s.op != "slice" or not ctx.private(s) or s.inputs[0].op not in _BACKWARDS:
        return None
    back, index = s.inputs[0], s.attrs["index"]
    i = index[0]
    return (back, i) if isinstance(i, int) and _whole_third(index, back.shape, i) else None


def _assemble(node, ctx):
    """slices_assemble of dq, dk, dv of one attention backward, each transposed whole into its
    third: the heads_merged backward, reshaped."""
    if node.shape[0] != 3 or node.dtype.name != "float32":
        return None
    thirds = [_third(t, ctx) for t in node.inputs]
    if None in thirds or len({id(b) for b, _ in thirds}) != 1:
        return None
    back = thirds[0][0]
    if (back.attrs.get("heads_merged") or len(ctx.readers(back)) != 3
            or not all(_whole_third(ix, node.shape, i) for ix, (_, i) in zip(node.attrs["indexes"], thirds))
            or sorted(i for _, i in thirds) != [0, 1, 2]):
        return None
    ctx.absorb(back, *node.inputs, *(t.inputs[0] for t in node.inputs))
    merged = ctx.emit(back.op, [ctx.new(i) for i in back.inputs], **op_attrs(back), heads_merged=True)
    return ctx.emit("reshape", (merged,), shape=node.shape)


MERGED_HEADS = Pass("merged_heads", (
    Rule("causal attention read with its heads merged", ("causal_attention",), _attention),
    Rule("kept causal attention read with its heads merged", ("causal_attention_keep",), _attention_keep),
    Rule("a merged attention's kept y", ("reshape",), _kept_y),
    Rule("the heads' merge of a merged attention", ("transpose",), _transpose),
    Rule("the QKV gradient assembled from an attention backward", ("slices_assemble",), _assemble),
), doc="reshape(transpose(causal_attention(q, k, v))) and slices_assemble of its backward's "
       "transposed results -> views of heads_merged attention nodes")
