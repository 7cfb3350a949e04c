"""Pass `dropout_masks`: every ``dropout(x, key)`` as ``dropout_apply(x, keep)`` with
``keep = dropout_keep(key)``, one keep mask per (key, stream, p, shape): a dropout and its
backward (which has the same key and stream) read one mask, drawn once per run. The mask is a
tensor of the graph, so the memory plan sees its producer, its readers and its lifetime."""
from __future__ import annotations

from .rewrite import Pass, Rule


def _share(node, ctx):
    x, key = node.inputs
    a = node.attrs
    which = ("keep", key.id, a["stream"], a["p"], node.shape)
    keep = ctx.memo.get(which)
    if keep is None:
        keep = ctx.memo[which] = ctx.emit("dropout_keep", (ctx.new(key),), kept=True, p=a["p"],
                                          stream=a["stream"], shape=node.shape)
    return ctx.emit("dropout_apply", (ctx.new(x), keep), p=a["p"])


DROPOUT_MASKS = Pass("dropout_masks", (Rule("dropout", ("dropout",), _share),),
                     doc="dropout(x, key) -> dropout_apply(x, dropout_keep(key)), one keep mask per "
                         "(key, stream, p, shape)")
