"""Pass `kept_values`: a forward op keeps what its backward would recompute, as a tensor of the
graph (its producer, its readers and its lifetime are the memory plan's like any other value).

- the tanh GELU whose input also feeds a ``gelu_backward``: ``gelu(x)`` -> view 0 of
  ``gelu_keep(x)`` = [gelu(x), s], and ``gelu_backward(x, g)`` -> ``gelu_backward_sigmoid(x, g, s)``
  with s view 1 (no exp recomputed; the same arithmetic, bit for bit). float32 only, as the
  numpy executor's kernels are written for it.
"""
from __future__ import annotations

from graphlm.ops import normalize_index

from .rewrite import Pass, Rule


def _tanh_gelu(node) -> bool:
    return node.attrs["approximate"] == "tanh" and node.dtype.name == "float32"


def _gelu(node, ctx):
    x = node.inputs[0]
    if not _tanh_gelu(node) or not any(r.op == "gelu_backward" and _tanh_gelu(r) and r.inputs[0] is x
                                       and r.id > node.id for r in ctx.readers(x)):
        return None
    both = ctx.emit("gelu_keep", (ctx.new(x),))
    ctx.memo[("gelu sigmoid", x.id)] = ctx.emit("slice", (both,), kept=True, index=normalize_index(1, both.shape))
    return ctx.emit("slice", (both,), index=normalize_index(0, both.shape))


def _gelu_backward(node, ctx):
    x, g = node.inputs
    s = ctx.memo.get(("gelu sigmoid", x.id))
    if s is None or not _tanh_gelu(node):
        return None
    return ctx.emit("gelu_backward_sigmoid", (ctx.new(x), ctx.new(g), s))


KEPT_VALUES = Pass("kept_values", (
    Rule("tanh GELU with its backward", ("gelu",), _gelu),
    Rule("tanh GELU backward from the kept sigmoid", ("gelu_backward",), _gelu_backward),
), doc="gelu(x) + gelu_backward(x, g) -> gelu_keep(x)[0] + gelu_backward_sigmoid(x, g, gelu_keep(x)[1])")
