"""Copying a graph with two rewrites, a dtype change and decomposing ops, as passes of the one
driver (graphlm/passes/rewrite.py: rule tables, `rewrite`).

Nodes are immutable, so a graph changes by copying: `copy_graph` runs one pass over every node
the outputs need, in creation order; a node no rule replaces is copied with its name, scope and
backward flag, its shape and dtype inferred again by its op's rule where an input's changed.

- ``dtypes={float32: float64}`` (`dtype_change`) is a graph-level dtype change: leaves, consts
  and ``dtype`` attributes (casts, one_hot, dropout masks) of one dtype become the other, and
  every other node follows from its op's rule. `graphlm.testing` checks a float32 function's
  gradients on the float64 copy of its graph, so the function is written once.
- ``expand=pred`` (`decompositions`) replaces each node for which ``pred(node)`` holds by its
  op's decomposition (``OpDef.decompose``), built in the node's scope. Executors use it for ops
  that have a decomposition but no kernel (a custom op registered with only ``decompose=``).
- ``leaves_as_inputs`` makes params and states inputs of the same names (a gradient check
  varies them).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from .ir import LEAF_OPS, Graph, GraphError, Tensor, fmt_shape
from .ops import PASS_ATTRS
from .passes.rewrite import ANY, Pass, Rule, needed, rewrite
from .registry import REGISTRY

ancestors = needed   # every node the outputs depend on (themselves included), in creation order


def _dtype_map(dtypes: Mapping | None) -> dict[np.dtype, np.dtype]:
    return {np.dtype(k): np.dtype(v) for k, v in (dtypes or {}).items()}


def _mapped_attrs(node: Tensor, dmap) -> dict:
    """The node's attributes with a ``dtype`` attribute changed by `dmap`."""
    attrs = dict(node.attrs)
    if "dtype" in attrs:
        d = np.dtype(attrs["dtype"])
        attrs["dtype"] = dmap.get(d, d).str
    return attrs


def dtype_change(dtypes: Mapping, leaves_as_inputs: bool = False) -> tuple[Rule, ...]:
    """The rules of a graph-level dtype change (``{np.float32: np.float64}``); with
    `leaves_as_inputs`, params and states become inputs of the same names too."""
    dmap = _dtype_map(dtypes)

    def leaf(node, ctx):
        kind = "input" if leaves_as_inputs else node.op
        dtype = dmap.get(node.dtype, node.dtype)
        if kind == node.op and dtype == node.dtype:
            return None
        return getattr(ctx.graph, kind)(node.name, node.shape, dtype)

    def const(node, ctx):
        value = node.attrs["value"]
        return ctx.graph.const(value.astype(dmap[value.dtype])) if value.dtype in dmap else None

    def dtype_attribute(node, ctx):
        if "dtype" not in node.attrs or np.dtype(node.attrs["dtype"]) not in dmap:
            return None
        return ctx.copy(node, _mapped_attrs(node, dmap))

    return (Rule("leaves", ("input", "param", "state"), leaf), Rule("consts", ("const",), const),
            Rule("dtype attributes", (ANY,), dtype_attribute))


def decompositions(expand: Callable[[Tensor], bool], dtypes: Mapping | None = None) -> tuple[Rule, ...]:
    """The rule replacing each node with ``expand(node)`` by its op's decomposition (on the
    node's attributes as `dtypes` changes them). One that does not give the node's shape and
    (mapped) dtype is a GraphError naming the op."""
    dmap = _dtype_map(dtypes)

    def decompose(node, ctx):
        if not expand(node):
            return None
        attrs = {k: v for k, v in _mapped_attrs(node, dmap).items() if k not in PASS_ATTRS}
        out = REGISTRY[node.op].decompose(*[ctx.new(i) for i in node.inputs], **attrs)
        want = dmap.get(node.dtype, node.dtype)
        if not isinstance(out, Tensor) or out.shape != node.shape or out.dtype != want:
            got = f"{fmt_shape(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise GraphError(f"the decomposition of op '{node.op}' ({node.label} in "
                             f"{node.scope or '<root>'}) gave {got}, but the op's shape rule "
                             f"says {fmt_shape(node.shape)} {want}")
        return out

    return (Rule("decomposition", (ANY,), decompose),)


def copy_graph(outputs: Sequence[Tensor], *, dtypes: Mapping | None = None,
               expand: Callable[[Tensor], bool] | None = None, leaves_as_inputs: bool = False,
               name: str | None = None) -> tuple[Graph, dict[int, Tensor]]:
    """A new graph holding what `outputs` need; returns it and a map old node id -> new node.

    `dtypes` maps dtypes to replace (``{np.float32: np.float64}``); `expand(node)` says which
    nodes to replace by their op's decomposition. A decomposition must give the node's shape and
    (mapped) dtype; one that does not is a GraphError naming the op. `leaves_as_inputs` makes
    params and states inputs of the same names (fed per run: a gradient check varies them).
    """
    outputs = list(outputs)
    dmap = _dtype_map(dtypes)
    rules = (decompositions(expand, dmap) if expand is not None else ()) + \
        (dtype_change(dmap, leaves_as_inputs) if dmap or leaves_as_inputs else ())
    done = rewrite(outputs[0].graph, outputs, Pass("copy", rules, dtypes=tuple(dmap.items())),
                   copy=True, name=name)
    return done.graph, done.replaced


def expand_decompositions(outputs: Sequence[Tensor], has_kernel: Callable[[str], bool],
                          max_depth: int = 16) -> tuple[list[Tensor], list[str]]:
    """Replace every needed node whose op has no kernel but has a decomposition by that
    decomposition (repeatedly: a decomposition may use other such ops).

    Returns the outputs (in a copied graph if anything was expanded, else the same tensors) and
    the ops still without a kernel (no decomposition either).
    """
    outputs = list(outputs)
    for _ in range(max_depth):
        lacking = {n.op for n in ancestors(outputs) if n.op not in LEAF_OPS and not has_kernel(n.op)}
        expandable = {op for op in lacking if REGISTRY[op].decompose is not None}
        if not expandable:
            return outputs, sorted(lacking)
        _, new = copy_graph(outputs, expand=lambda n: n.op in expandable)
        outputs = [new[o.id] for o in outputs]
    raise GraphError(f"decomposing ops without a kernel did not end after {max_depth} rounds "
                     f"(ops {', '.join(sorted(expandable))}): does a decomposition use its own op?")
