"""Pass `transposed_weights`: ``matmul(x, transpose(W))`` of a param W (a Linear's ``x @ W^T``,
the tied head's ``x @ wte^T``) reads a param ``W.T`` instead, W's transpose in memory of its own,
so the product's right operand has contiguous rows (NN) rather than contiguous columns (NT).

For programs whose params stay fixed over many runs: the Generator's prefill and decode graphs
(graphlm/sample.py), which take ``W.T`` from `transposed_params` once. A product of few rows
runs as ``x @ B`` about twice as fast as dot products along W's rows (the native small-product
kernels at 8 rows, docs/performance.md). Not in any executor's pipeline: an executor cannot know
that a param does not change between runs (a training step changes them all).

Each ``W.T`` is one param of the rewritten graph however many products read it; W itself stays
only where something else reads it (the tied embedding table). A W of more than MAX_BYTES is
left as it is: read from memory rather than cache at every step (GPT-2 small's MLP and head), its
rows stream best as they are (the one-row NT kernel reads four at a time; transposed, GPT-2
small's decode was slower: docs/performance.md), and a copy would cost its size again. The rule reads the weight's size alone, never the batch, so a row of
a batch still rounds as that row alone.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from graphlm.ir import Graph

from .rewrite import Pass, Rule

SUFFIX = ".T"   # W's transpose is the param named W's name + SUFFIX
MAX_BYTES = 4 << 20   # a larger W stays as it is (below)


def transposed_name(name: str) -> str:
    """The name of the param holding param `name`'s transpose."""
    return name + SUFFIX


def last_two_swapped(axes) -> bool:
    n = len(axes)
    return n >= 2 and tuple(axes) == tuple(range(n - 2)) + (n - 1, n - 2)


def _read_transposed(node, ctx):
    a, b = node.inputs
    if (b.op != "transpose" or b.inputs[0].op != "param" or not last_two_swapped(b.attrs["axes"])
            or b.nbytes > MAX_BYTES):
        return None
    name = transposed_name(b.inputs[0].name)
    if name in b.graph.leaves():   # the source graph's own leaf of that name: not W's transpose
        return None
    leaf = ctx.graph.params.get(name)
    if leaf is None:
        leaf = ctx.graph.param(name, b.shape, b.dtype)
    ctx.absorb(b)
    return ctx.emit("matmul", (ctx.new(a), leaf))


TRANSPOSED_WEIGHTS = Pass("transposed_weights", (Rule("product with a transposed param", ("matmul",), _read_transposed),),
                          doc="matmul(x, transpose(W)) -> matmul(x, W.T), W.T a param holding W's transpose")


def transposed_params(graph: Graph, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of the ``W.T`` params of a rewritten `graph` that `params` lacks: each W of
    `params` transposed (last two axes) into contiguous memory of its own."""
    out = {}
    for name in graph.params:
        source = name[:-len(SUFFIX)]
        if name.endswith(SUFFIX) and name not in params and source in params:
            out[name] = np.ascontiguousarray(np.swapaxes(params[source], -1, -2))
    return out
