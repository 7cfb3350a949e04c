"""The numpy executor's own rewrites of the run list, after the graph passes (graphlm/passes) and
before planning: a forward kernel keeps what its backward would recompute. Each replaces graph
nodes by `FusedNode`s naming executor-private kernels (no result bit changes):
`pair_attention_backward` (the attention scores E and row sums l), kept in arena blocks that
live until their last reader (kernel scratch specs ``(shape, dtype, until_node_id)``). (The
GELU's sigmoid, layer norm's statistics and dropout's keep mask are tensors of the graph
instead: graphlm/passes/kept_values.py and dropout_masks.py.)
"""
from __future__ import annotations

import numpy as np


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


