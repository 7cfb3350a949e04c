"""The differentiation pass: reverse mode over the graph, adding backward nodes to it.

`grad(loss, wrt)` walks, in reverse creation order, only the nodes that lie on a path from a
`wrt` tensor to `loss`; cotangents of a node with several consumers are summed; each op's VJP
rule (graphlm.registry) reduces broadcasts back to its input shapes. The backward nodes are
ordinary nodes of the same graph, flagged `is_backward` and scoped under the forward node's
scope, so they can be rendered, planned, executed and differentiated again (second order).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .ir import GraphError, Tensor, fmt_shape
from .registry import REGISTRY
from . import ops


def grad(loss: Tensor, wrt: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """Gradients of the scalar `loss` with respect to each tensor of `wrt`, as graph nodes.

    A `wrt` tensor that `loss` does not depend on gets a zero gradient (a broadcast zero, which
    costs no memory in the numpy executor). Integer tensors in `wrt` are an error.
    """
    wrt = [wrt] if isinstance(wrt, Tensor) else list(wrt)
    if not isinstance(loss, Tensor):
        raise GraphError(f"grad: loss must be a graphlm.Tensor, got {type(loss).__name__}")
    if loss.shape != ():
        raise GraphError(f"grad: loss must be a scalar, got shape {fmt_shape(loss.shape)} "
                         f"({loss.label}); reduce it first (e.g. graphlm.mean)")
    if loss.dtype.kind != "f":
        raise GraphError(f"grad: loss must be floating point, got {loss.dtype}")
    for w in wrt:
        if not isinstance(w, Tensor) or w.graph is not loss.graph:
            raise GraphError(f"grad: {w!r} is not a tensor of the loss's graph '{loss.graph.name}'")
        if w.dtype.kind != "f":
            raise GraphError(f"grad: cannot differentiate with respect to {w.label}, an integer "
                             f"tensor ({w.dtype} {fmt_shape(w.shape)})")
    graph = loss.graph
    start = len(graph.nodes)
    with graph.backward_context(loss.scope):
        seed = graph.const(np.ones((), dtype=loss.dtype))
    grads = vjp([loss], [seed], wrt)
    graph.eliminate_dead_since(start, grads)  # cotangents of consts etc. that nobody needs
    return grads


def vjp(outputs: Sequence[Tensor], cotangents: Sequence[Tensor], wrt: Sequence[Tensor],
        zeros_for_unreached: bool = True, partial: bool = False) -> list[Tensor | None]:
    """Pull `cotangents` of `outputs` back to `wrt` (the general form of `grad`).

    By default a `wrt` tensor that depends on another `wrt` tensor passes its cotangent on (total
    derivatives, as torch.autograd.grad). ``partial=True`` treats the `wrt` tensors as independent
    variables and stops at them: the partial derivatives that a fused op's VJP needs when it is
    differentiated through its decomposition and one input depends on another.
    """
    graph = outputs[0].graph
    wrt_ids = {w.id for w in wrt}
    top = max(o.id for o in outputs)
    # nodes that depend on some wrt tensor ...
    depends = set(wrt_ids)
    for node in graph.nodes[min(wrt_ids, default=top + 1): top + 1]:
        if any(i.id in depends for i in node.inputs):
            depends.add(node.id)
    # ... and that some output depends on
    needed: set[int] = set()
    stack = [o for o in outputs if o.id in depends]
    while stack:
        node = stack.pop()
        if node.id in needed:
            continue
        needed.add(node.id)
        if partial and node.id in wrt_ids:
            continue
        stack.extend(i for i in node.inputs if i.id in depends and i.id not in needed)

    pending: dict[int, list[Tensor]] = {}
    for o, c in zip(outputs, cotangents):
        if c.shape != o.shape:
            raise GraphError(f"vjp: cotangent {fmt_shape(c.shape)} does not match output "
                             f"{o.label} {fmt_shape(o.shape)}")
        pending.setdefault(o.id, []).append(c)

    for node_id in sorted(needed, reverse=True):
        node = graph.nodes[node_id]
        if not node.inputs or node_id not in pending:
            continue
        if partial and node_id in wrt_ids:
            continue
        if not any(i.id in needed for i in node.inputs):
            continue
        op = REGISTRY[node.op]
        made_from = len(graph.nodes)
        with graph.backward_context(node.scope):
            ct = _total(pending[node_id])
            pending[node_id] = [ct]
            if op.vjp is not None:
                grads = op.vjp(node, ct)
            elif op.decompose is not None:
                grads = _vjp_through_decomposition(node, ct)
            else:
                raise GraphError(f"grad: op '{node.op}' ({node.label} in {node.scope or '<root>'}) "
                                 "has no gradient rule")
        for made in graph.nodes[made_from:]:
            graph.forward_partner.setdefault(made, node)
        for inp, g in zip(node.inputs, _checked_vjp_result(node, grads)):
            if g is None or inp.id not in needed:
                continue
            pending.setdefault(inp.id, []).append(g)

    results: list[Tensor | None] = []
    for w in wrt:
        if w.id in pending:
            with graph.backward_context(w.scope):
                total = _total(pending[w.id])
                pending[w.id] = [total]
            results.append(total)
        elif zeros_for_unreached:
            with graph.backward_context(w.scope):
                results.append(ops.broadcast_to(graph.const(np.zeros((), dtype=w.dtype)), w.shape))
        else:
            results.append(None)
    return results


def _checked_vjp_result(node: Tensor, grads) -> list[Tensor | None]:
    """A VJP rule's result, checked: one entry per input, each None or a tensor of its input's
    shape and dtype. A rule that breaks this (a custom op's most likely bug: a broadcast input's
    gradient not summed back) is a GraphError naming the op and the node."""
    where = f"the VJP of op '{node.op}' ({node.label} in {node.scope or '<root>'})"
    if not isinstance(grads, (list, tuple)):
        raise GraphError(f"{where} returned {type(grads).__name__}; it must return a list with "
                         f"one gradient (or None) per input ({len(node.inputs)})")
    if len(grads) != len(node.inputs):
        raise GraphError(f"{where} returned {len(grads)} gradients for {len(node.inputs)} inputs")
    for k, (inp, g) in enumerate(zip(node.inputs, grads)):
        if g is None:
            continue
        if not isinstance(g, Tensor):
            raise GraphError(f"{where} returned {type(g).__name__} for input {k}; expected a "
                             "graphlm.Tensor or None")
        if g.shape != inp.shape or (inp.dtype.kind == "f" and g.dtype != inp.dtype):
            hint = (" (sum a broadcast back to the input's shape: graphlm.ops.unbroadcast)"
                    if g.shape != inp.shape else "")
            raise GraphError(f"{where} gave {fmt_shape(g.shape)} {g.dtype} for input {k}, which is "
                             f"{fmt_shape(inp.shape)} {inp.dtype}{hint}")
    return list(grads)


def _total(terms: list[Tensor]) -> Tensor:
    total = terms[0]
    for t in terms[1:]:
        total = ops.add(total, t)
    return total


def _vjp_through_decomposition(node: Tensor, ct: Tensor) -> list[Tensor | None]:
    """The VJP of a fused op without its own rule: differentiate its decomposition."""
    out = REGISTRY[node.op].decompose(*node.inputs, **ops.op_attrs(node))
    float_inputs = [i for i in node.inputs if i.dtype.kind == "f"]
    grads = dict(zip((i.id for i in float_inputs),
                     vjp([out], [ct], float_inputs, zeros_for_unreached=False, partial=True)))
    return [grads.get(i.id) for i in node.inputs]
