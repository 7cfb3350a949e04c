"""Pass `panel_weights`: a product with a fixed weight, ``matmul(x, W)`` or ``matmul(x, transpose(W))``
of a param W, reads W's matrix B held in column panels (``panel_matmul(x, W.panels)``, graphlm.ops),
and a bias added to it is added as each value is stored (``panel_matmul(x, W.panels, bias)``).

For programs whose params stay fixed over many runs, on executors whose kernels take panels (the
native executor's `fixed_weights_pass`): the Generator's prefill and decode graphs
(graphlm/sample.py), which take ``W.panels`` from `panel_params` once. A decode step's products
stream every weight from memory; a panel is read straight through (k rows of PANEL_WIDTH floats
one after the other) where B's rows sit n floats apart, which the native products run faster
(docs/performance.md), and the bias add is one NumPy call less per product. Every
value rounds as the product and the add it replaces (the native kernel's chain of fused
multiply-adds over k, then one add), so a row of a batch still rounds as that row alone.

The alternative to `transposed_weights` (a program takes one or the other). A W of more than
MAX_BYTES stays as it is, read in place: GPT-2 small's tied head (154 MB, which the embedding
reads too) streams as fast by the one-row NT kernel, and a copy would cost its size again; its
blocks' weights (2.4-9.4 MB) take panels.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from graphlm.ir import Graph
from graphlm.ops import panel_bias_fits, to_panels

from .rewrite import Pass, Rule
from .transposed_weights import last_two_swapped

PANEL_WIDTH = 32            # columns per panel: the native products' column block (products.c)
MAX_BYTES = 16 << 20        # a larger W stays as it is (above)
SUFFIX = ".panels"          # W's panels are the param named W's name (+ ".T" where read transposed) + SUFFIX


def _fixed_weight(b):
    """(the panels' param name, the param W) where a product's right operand `b` is a param W
    or its transpose (last two axes), else None."""
    if b.op == "param" and b.ndim >= 2:
        return b.name + SUFFIX, b
    if b.op == "transpose" and b.inputs[0].op == "param" and last_two_swapped(b.attrs["axes"]):
        return b.inputs[0].name + ".T" + SUFFIX, b.inputs[0]
    return None


def _read_panels(node, ctx):
    x, b = node.inputs
    found = _fixed_weight(b)
    if found is None or b.nbytes > MAX_BYTES or x.ndim < 2 or b.dtype.kind != "f":
        return None
    name, w = found
    if name in b.graph.leaves():   # the source graph's own leaf of that name: not W's panels
        return None
    *batch, k, n = b.shape
    leaf = ctx.graph.params.get(name)
    if leaf is None:
        leaf = ctx.graph.param(name, (*batch, -(-n // PANEL_WIDTH), k, PANEL_WIDTH), b.dtype)
    if b is not w:
        ctx.absorb(b)
    return ctx.emit("panel_matmul", (ctx.new(x), leaf), columns=n)


def _add_bias(node, ctx):
    for product, bias in (node.inputs, node.inputs[::-1]):
        made = ctx.new(product) if product.op == "matmul" else None
        if made is None or made.op != "panel_matmul" or len(made.inputs) != 2 or not ctx.private(product):
            continue
        if bias.dtype != made.dtype or not panel_bias_fits(bias.shape, made.shape):
            continue
        ctx.absorb(product)
        return ctx.emit("panel_matmul", (*made.inputs, ctx.new(bias)), columns=made.shape[-1])
    return None


PANEL_WEIGHTS = Pass("panel_weights", (Rule("product with a fixed weight", ("matmul",), _read_panels),
                                       Rule("bias added to it", ("add",), _add_bias)),
                     doc="matmul(x, W or W^T) (+ bias) -> panel_matmul(x, W.panels (, bias)), W a param")


def panel_params(graph: Graph, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of the ``.panels`` params of a rewritten `graph` that `params` lacks: each from
    its W of `params` (transposed first where its name says ``W.T.panels``)."""
    out = {}
    for name, leaf in graph.params.items():
        if not name.endswith(SUFFIX) or name in params:
            continue
        source = name[:-len(SUFFIX)]
        if source in params:
            b = params[source]
        elif source.endswith(".T") and source[:-2] in params:
            b = np.swapaxes(params[source[:-2]], -1, -2)
        else:
            continue
        out[name] = to_panels(np.asarray(b), leaf.shape[-1])
    return out
