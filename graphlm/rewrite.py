"""Copying a graph node by node, with two rewrites: a dtype change and decomposing ops.

Nodes are immutable, so a graph changes by copying: `copy_graph` re-applies every node the
outputs need, in creation order, through the op registry (so each copied node's shape and dtype
are inferred again by its op's rule), keeping names, scopes and backward flags.

- ``dtypes={float32: float64}`` is a graph-level dtype change: leaves, consts and ``dtype``
  attributes (casts, one_hot, dropout masks) of one dtype become the other, and every other node
  follows from its op's rule. `graphlm.testing` checks a float32 function's gradients on the
  float64 copy of its graph, so the function is written once.
- ``expand=pred`` replaces each node for which ``pred(node)`` holds by its op's decomposition
  (``OpDef.decompose``), built in the node's scope. Executors use it for ops that have a
  decomposition but no kernel (a custom op registered with only ``decompose=``).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from .ir import LEAF_OPS, Graph, GraphError, Tensor, fmt_shape
from .ops import PASS_ATTRS
from .registry import REGISTRY, apply


def ancestors(outputs: Sequence[Tensor]) -> list[Tensor]:
    """Every node the outputs depend on (themselves included), in creation order."""
    graph = outputs[0].graph
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n.id in seen:
            continue
        seen.add(n.id)
        stack.extend(i for i in n.inputs if i.id not in seen)
    return [graph.nodes[i] for i in sorted(seen)]


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
    src = outputs[0].graph
    dmap = {np.dtype(k): np.dtype(v) for k, v in (dtypes or {}).items()}
    g = Graph(name or src.name)
    new: dict[int, Tensor] = {}

    def dt(d) -> np.dtype:
        return dmap.get(np.dtype(d), np.dtype(d))

    for n in ancestors(outputs):
        with (g.backward_context(n.scope) if n.is_backward else g.scope(n.scope)):
            if n.op in ("input", "param", "state"):
                kind = "input" if leaves_as_inputs else n.op
                new[n.id] = getattr(g, kind)(n.name, n.shape, dt(n.dtype))
                continue
            if n.op == "const":
                value = n.attrs["value"]
                new[n.id] = g.const(value.astype(dt(value.dtype)))
                continue
            ins = [new[i.id] for i in n.inputs]
            attrs = dict(n.attrs)
            if "dtype" in attrs:
                attrs["dtype"] = dt(attrs["dtype"]).str
            if expand is not None and expand(n):
                out = REGISTRY[n.op].decompose(*ins, **{k: v for k, v in attrs.items() if k not in PASS_ATTRS})
                if not isinstance(out, Tensor) or out.shape != n.shape or out.dtype != dt(n.dtype):
                    got = (f"{fmt_shape(out.shape)} {out.dtype}" if isinstance(out, Tensor)
                           else type(out).__name__)
                    raise GraphError(f"the decomposition of op '{n.op}' ({n.label} in "
                                     f"{n.scope or '<root>'}) gave {got}, but the op's shape rule "
                                     f"says {fmt_shape(n.shape)} {dt(n.dtype)}")
                new[n.id] = out
            else:
                new[n.id] = apply(n.op, ins, **attrs)
    for back, fwd in src.forward_partner.items():   # which forward node's VJP made each node
        if back.id in new and fwd.id in new and back.id >= 0 and fwd.id >= 0:
            g.forward_partner[new[back.id]] = new[fwd.id]
    return g, new


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
