"""The numpy executor's compile-time rewrites of the run list (before planning). Each replaces
graph nodes by `FusedNode`s that name executor-private kernels; none changes a result bit except
`fuse_matmul_sums` (a folded product rounds its own way):

`fuse_matmul_sums` (the weight gradient of a batched ``x @ w``: the summed batch folded into one
matmul), `assemble_slice_gradients` (the QKV gradient in one node), `fuse_attention_softmax`
(scale and causal mask folded into softmax and its backward), `share_dropout_masks` (one mask
per forward/backward pair, drawn once per run), `pair_gelu_backward`, `pair_layer_norm_backward`
and `pair_attention_backward` (the forward keeps what the backward would recompute, in arena
blocks that live until their last reader).
"""
from __future__ import annotations

import numpy as np

from ..planner import _proto
from .matmul import matmul_sum_operands
from .tiling import flat_view


class SavedSigmoid:
    """The sigmoid s of one float32 tanh-GELU's input, written by the forward kernel and read
    by the backward kernels of the same input (an arena block live until the last of them)."""

    def __init__(self):
        self.s: np.ndarray | None = None
        self.until: int | None = None   # the last backward node reading s (ends its lifetime)


def _pair_with_slots(nodes, pairs, slot_type, keep_op: str, kept_op: str):
    """Rewrite every forward node in `pairs` (forward id -> its backward ids, in run order) to
    `keep_op` and its backward nodes to `kept_op`, sharing one new `slot_type()` whose `until`
    is the last of those backward nodes (the kept arrays live until it). Returns the node list."""
    if not pairs:
        return list(nodes)
    slots = {fid: slot_type() for fid in pairs}
    for fid, bids in pairs.items():
        slots[fid].until = bids[-1]
    slot_of = {bid: slots[fid] for fid, bids in pairs.items() for bid in bids}
    out = []
    for n in nodes:
        if n.id in slots:
            n = FusedNode(n, keep_op, n.inputs, {**n.attrs, "slot": slots[n.id]})
        elif n.id in slot_of:
            n = FusedNode(n, kept_op, n.inputs, {**n.attrs, "slot": slot_of[n.id]})
        out.append(n)
    return out


def pair_gelu_backward(nodes):
    """Let each float32 tanh-GELU whose input also feeds a ``gelu_backward`` keep its sigmoid for
    that backward: ``gelu`` -> ``gelu_keep_sigmoid``, ``gelu_backward`` -> ``gelu_backward_sigmoid``
    (no exp recomputed: 9 passes instead of 16, bit-identical). Returns the new node list."""
    forward = {}
    for k, n in enumerate(nodes):
        if n.op == "gelu" and n.attrs["approximate"] == "tanh" and n.dtype == np.float32:
            forward.setdefault(n.inputs[0].id, (k, n))
    pairs = {}
    for k, n in enumerate(nodes):
        if n.op == "gelu_backward" and n.attrs["approximate"] == "tanh" and n.inputs[0].id in forward:
            fk, f = forward[n.inputs[0].id]
            if fk < k and n.dtype == np.float32:
                pairs.setdefault(f.id, []).append(n.id)
    return _pair_with_slots(nodes, pairs, SavedSigmoid, "gelu_keep_sigmoid", "gelu_backward_sigmoid")


class FusedNode:
    """A node the executor computes differently from the graph: `op` names an executor-private
    kernel; id, shape, dtype and name are those of the graph node it replaces."""

    def __init__(self, node, op, inputs, attrs):
        self.id, self.op, self.inputs, self.attrs = node.id, op, tuple(inputs), attrs
        self.shape, self.dtype, self.name, self.scope = node.shape, node.dtype, node.name, node.scope
        self.graph, self.is_backward, self.node = node.graph, node.is_backward, node

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    label = property(lambda self: self.node.label)


def fuse_matmul_sums(nodes, outputs, protos):
    """Replace ``sum(matmul(a, b), batch axes)`` (a batched product's weight gradient) by one
    matmul over the folded axes when the matmul has no other use. Returns (new node list,
    {matmul node: fused node})."""
    consumers: dict[int, list] = {}
    for n in nodes:
        for i in n.inputs:
            consumers.setdefault(i.id, []).append(n)
    output_ids = {o.id for o in outputs}
    replace, fused = {}, {}
    for n in nodes:
        if n.op != "sum" or n.inputs[0].op != "matmul":
            continue
        mm = n.inputs[0]
        axes = n.attrs["axes"]
        if mm.id in output_ids or len(consumers.get(mm.id, ())) != 1 or not axes \
                or max(axes) >= mm.ndim - 2 or mm.dtype.kind != "f":
            continue
        a, b = (protos[i.id] for i in mm.inputs)
        if matmul_sum_operands(a, b, axes) is None:
            continue
        f = FusedNode(n, "matmul_sum", mm.inputs, dict(n.attrs))
        replace[n.id] = f
        fused[mm] = f
    if not fused:
        return list(nodes), {}
    skip = {mm.id for mm in fused}
    return [replace.get(n.id, n) for n in nodes if n.id not in skip], fused


def assemble_slice_gradients(nodes, outputs):
    """Replace a tree of ``add`` nodes over ``slice_backward`` nodes with disjoint windows (the
    gradient of q, k and v sliced from one fused QKV product) by one ``slices_assemble`` node that
    writes each gradient into its window (zero-filling only what no window covers), reading
    through any reshape chain above a gradient instead of copying it. Every covered element is
    ``g + 0`` exactly as the reference's sum of zero-padded arrays. Returns the new node list."""
    uses: dict[int, int] = {}
    for n in nodes:
        for i in n.inputs:
            uses[i.id] = uses.get(i.id, 0) + 1
    output_ids = {o.id for o in outputs}
    private = lambda n: uses.get(n.id, 0) == 1 and n.id not in output_ids

    def leaves(n, inner):
        if n.op == "slice_backward":
            return [n]
        if n.op == "add" and all(i.shape == n.shape for i in n.inputs) and n.inputs[0] is not n.inputs[1]:
            found = []
            for i in n.inputs:
                if not private(i):
                    return None
                sub = leaves(i, inner)
                if sub is None:
                    return None
                found += sub
            inner.append(n)
            return found
        return None

    replace, removed = {}, set()
    for n in reversed(nodes):
        if n.op != "add" or n.id in removed or n.dtype.kind != "f":
            continue
        inner: list = []
        found = leaves(n, inner)
        if not found or len(found) < 2:
            continue
        cover = np.zeros(n.shape, np.int8)
        for sb in found:
            cover[sb.attrs["index"]] += 1
        if cover.max() > 1:
            continue
        srcs, shapes = [], []
        base = _proto(n.shape, n.dtype)
        for sb in found:
            src, window = sb.inputs[0], base[sb.attrs["index"]]
            while src.op == "reshape" and private(src) and flat_view(window, src.inputs[0].shape) is not None:
                src = src.inputs[0]
            srcs.append(src)
            shapes.append(src.shape)
        removed.update(x.id for x in inner)
        removed.update(sb.id for sb in found)
        for sb, src in zip(found, srcs):   # the reshapes read through
            r = sb.inputs[0]
            while r is not src:
                removed.add(r.id)
                r = r.inputs[0]
        removed.discard(n.id)
        replace[n.id] = FusedNode(n, "slices_assemble", srcs,
                                  {"indexes": [sb.attrs["index"] for sb in found],
                                   "covered": bool(cover.min() == 1)})
    if not replace:
        return list(nodes)
    return [replace.get(n.id, n) for n in nodes if n.id not in removed]


def scalar_const(n):
    """(other input, const input, const position) when `n` is a mul by a 0-d const, else None."""
    if n.op != "mul" or len(n.inputs) != 2:
        return None
    for pos in (0, 1):
        c = n.inputs[pos]
        if c.op == "const" and c.shape == () and c.dtype == n.dtype and n.inputs[1 - pos].shape == n.shape:
            return n.inputs[1 - pos], c, pos
    return None


def fuse_attention_softmax(nodes, outputs):
    """Fold the scale and the causal mask around a softmax over the last axis into it, forward
    ``softmax(causal_mask(x * c))`` -> ``softmax_fused`` and backward
    ``causal_mask(softmax_backward(y, g), fill=0) * c`` -> ``softmax_backward_fused``, when the
    intermediates have no other use. The fused kernels run the same arithmetic block by block
    over whole T x S matrices (bit-identical, and two full passes over the scores fewer each
    way). Returns the new node list."""
    uses: dict[int, int] = {}
    for n in nodes:
        for i in n.inputs:
            uses[i.id] = uses.get(i.id, 0) + 1
    output_ids = {o.id for o in outputs}
    private = lambda n: uses.get(n.id, 0) == 1 and n.id not in output_ids
    last = lambda n: n.ndim >= 2 and n.attrs.get("axis") == n.ndim - 1
    replace, removed = {}, set()
    for n in nodes:
        if n.op == "softmax" and last(n) and n.dtype.kind == "f":
            src, mask, scale = n.inputs[0], None, None
            if src.op == "causal_mask" and private(src):
                mask, removed_here, src = src, [src.id], src.inputs[0]
            else:
                removed_here = []
            sc = scalar_const(src) if private(src) else None
            if sc is not None:
                removed_here.append(src.id)
                scale, src = sc, sc[0]
            if mask is None and scale is None:
                continue
            ins = [src] + ([scale[1]] if scale else [])
            replace[n.id] = FusedNode(n, "softmax_fused", ins, {
                "mask": (mask.attrs["fill"], mask.attrs["offset"]) if mask is not None else None,
                "scale_pos": scale[2] if scale else None})
            removed.update(removed_here)
        elif n.op in ("mul", "causal_mask") and n.dtype.kind == "f":
            root, scale, mask = n, None, None
            sc = scalar_const(n)
            cur = n
            if sc is not None:
                scale, cur = sc, sc[0]
                if not private(cur):
                    continue
            if cur.op == "causal_mask" and cur.attrs["fill"] == 0.0:
                mask, cur = cur, cur.inputs[0]
                if not private(cur):
                    continue
            if cur.op != "softmax_backward" or not last(cur) or (mask is None and scale is None) \
                    or (mask is not None and mask is not n and scale is None):
                continue
            if scale is None and n.op != "causal_mask":
                continue
            removed.update(x.id for x in (cur, mask) if x is not None and x is not root)
            ins = list(cur.inputs) + ([scale[1]] if scale else [])
            replace[root.id] = FusedNode(root, "softmax_backward_fused", ins, {
                "axis": cur.attrs["axis"],
                "mask": (0.0, mask.attrs["offset"]) if mask is not None else None,
                "scale_pos": scale[2] if scale else None})
    if not replace:
        return list(nodes)
    return [replace.get(n.id, n) for n in nodes if n.id not in removed]


class SavedScores:
    """E (flat blocks) and l of one causal_attention, kept by the forward for its backward."""

    def __init__(self):
        self.e = self.l = None
        self.until: int | None = None


def pair_attention_backward(nodes):
    """Let a ``causal_attention`` whose output feeds a ``causal_attention_backward`` (the VJP gives
    it the forward's output) keep E and l for it: ``causal_attention_keep`` and
    ``causal_attention_backward_kept``, no scores recomputed. Returns the new node list."""
    forward = {n.id: n for n in nodes if n.op == "causal_attention"}
    pairs = {}
    for n in nodes:
        if n.op == "causal_attention_backward" and n.inputs[3].id in forward:
            f = forward[n.inputs[3].id]
            if all(a.id == b.id for a, b in zip(f.inputs, n.inputs[:3])) and f.attrs == n.attrs:
                pairs.setdefault(f.id, []).append(n.id)
    return _pair_with_slots(nodes, pairs, SavedScores, "causal_attention_keep",
                            "causal_attention_backward_kept")


class SavedNorm:
    """What a layer_norm's backward recomputes, kept by the forward kernel (arena blocks
live until the last node that reads them):
    xc = x - mean(x), sv = sqrt(mean(xc*xc) + eps) (rows) and, when a backward node recomputes
    the normalised input for the weight gradient, xhat = xc / sv."""

    def __init__(self):
        self.xc = self.sv = self.xhat = None
        self.until: int | None = None   # the last node reading the kept values


def pair_layer_norm_backward(nodes):
    """Let a layer_norm keep xc, sv (and xhat) for the nodes after it that recompute them from the
    same input and eps: ``layer_norm_backward`` (-> ``layer_norm_backward_kept``: 4 of its 17
    passes saved) and a plain ``layer_norm(x)`` with no weight or bias (-> ``layer_norm_kept``:
    one copy instead of 7 passes). Those nodes no longer read x, so x's buffer dies earlier.
    Bit-identical: the kept values are computed the same way."""
    forward, users = {}, {}
    position = {n.id: k for k, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "layer_norm" and not n.is_backward:
            forward.setdefault((n.inputs[0].id, n.attrs["eps"]), n)
    for n in nodes:
        key = (n.inputs[0].id, n.attrs.get("eps")) if n.inputs else None
        f = forward.get(key)
        if f is None or position[n.id] <= position[f.id]:
            continue
        if n.op == "layer_norm_backward" or (n.op == "layer_norm" and not n.attrs.get("has_weight")
                                              and not n.attrs.get("has_bias")):
            users.setdefault(f.id, []).append(n)
    slots = {fid: (SavedNorm(), any(u.op == "layer_norm" for u in us)) for fid, us in users.items()}
    for fid, us in users.items():
        slots[fid][0].until = max((u.id for u in us), key=position.__getitem__)
    user_slot = {u.id: slots[fid][0] for fid, us in users.items() for u in us}
    out = []
    for n in nodes:
        if n.id in slots:
            slot, keep_xhat = slots[n.id]
            n = FusedNode(n, "layer_norm_keep", n.inputs, {**n.attrs, "slot": slot, "keep_xhat": keep_xhat})
        elif n.id in user_slot:
            op = "layer_norm_kept" if n.op == "layer_norm" else "layer_norm_backward_kept"
            # x is no longer read: dropping it lets its buffer die at the forward
            n = FusedNode(n, op, n.inputs[1:], {**n.attrs, "slot": user_slot[n.id]})
        out.append(n)
    return out


class MaskSlot:
    """The keep mask shared by the dropout nodes of one (key, stream, p, shape): drawn once per
    run by the first of them (the forward), read by the others (the backward)."""

    def __init__(self):
        self.mask: np.ndarray | None = None
        self.until: int | None = None   # the last dropout node reading the mask


def share_dropout_masks(nodes):
    """Replace every ``dropout`` node by a ``dropout_shared`` node: nodes with the same key input,
    stream, p, shape and dtype (a forward dropout and its backward) share one boolean mask, drawn
    by the first of them in run order. Returns the new node list."""
    slots: dict[tuple, MaskSlot] = {}
    out = []
    for n in nodes:
        if n.op != "dropout":
            out.append(n)
            continue
        key = (n.inputs[1].id, n.attrs["stream"], n.attrs["p"], n.shape, n.dtype.str)
        draw = key not in slots
        slot = slots.setdefault(key, MaskSlot())
        slot.until = n.id   # nodes come in run order: the last one met reads the mask last
        out.append(FusedNode(n, "dropout_shared", n.inputs, {**n.attrs, "slot": slot, "draw": draw}))
    return out
