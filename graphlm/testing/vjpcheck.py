"""`check_vjps`: every node's VJP rule of a built graph, each checked on its own.

A wrong gradient of a whole model says only that something is wrong. This check pins it: it runs
the graph once to get every node's input values, then, for each differentiable node in creation
order, rebuilds that one node in float64 on its actual inputs (the same op and attributes), pulls
a random cotangent u back through the op's VJP rule alone (`graphlm.vjp` of that node, so no
other rule is involved) and compares <J^T u, v> with <u, J v> from central differences of the
node's forward along a random direction v per float input. The first node that fails is reported
by op, name and module scope.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

import graphlm as gl
from graphlm.autodiff import vjp
from graphlm.ir import LEAF_OPS, GraphError, Tensor, fmt_shape
from graphlm.registry import REGISTRY, apply
from graphlm.rewrite import ancestors

from .graphs import central_difference, compile

EPS = 1e-6          # central-difference step, relative to each element's size (float64)
RTOL = 1e-5         # <J^T u, v> against <u, J v>, relative to the larger of the two ...
ATOL = 1e-7         # ... or to |J^T u| |v| where the two nearly cancel


@dataclass
class VJPReport:
    """What a passing `check_vjps` checked."""

    checked: list[Tensor] = field(default_factory=list)   # nodes whose VJP rule was checked
    skipped: dict[str, str] = field(default_factory=dict)  # op -> why its nodes were not

    def __repr__(self):
        ops = sorted({n.op for n in self.checked})
        return f"<VJPReport: {len(self.checked)} nodes checked ({len(ops)} ops), skipped {self.skipped}>"


def check_vjps(outputs, feeds: Mapping[str, np.ndarray] | None = None,
               state: Mapping[str, np.ndarray] | None = None, *, executor: str = "reference",
               eps: float = EPS, rtol: float = RTOL, atol: float = ATOL, seed: int = 0) -> VJPReport:
    """Check each node's VJP rule in the graph of `outputs`, fed `feeds` and `state`; raise
    AssertionError naming the first node (op, name, module scope) whose rule is wrong.

    Nodes that are not differentiated are skipped and listed in the report: leaves, ops marked
    non-differentiable (comparisons, ids, optimizer updates) and nodes with no float input.
    `state` is not changed (the values are computed on a copy).
    """
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    nodes = ancestors(outputs)
    report = VJPReport()
    todo = []
    for n in nodes:
        op = REGISTRY[n.op]
        if n.op in LEAF_OPS:
            continue
        if op.updates_state or not op.differentiable:
            report.skipped[n.op] = "not differentiable"
        elif n.dtype.kind != "f" or not any(i.dtype.kind == "f" for i in n.inputs):
            report.skipped[n.op] = "no float input or output"
        else:
            todo.append(n)
    if not todo:
        return report
    inputs = list({i.id: i for n in todo for i in n.inputs}.values())
    program = compile(outputs[0].graph, inputs, executor)
    state_copy = {k: np.array(v, copy=True) for k, v in (state or {}).items()
                  if k in program.state_nodes}
    values = dict(zip((i.id for i in inputs),
                      program.run({k: v for k, v in (feeds or {}).items() if k in program.input_nodes},
                                  state_copy)))
    rng = np.random.default_rng(seed)
    for n in todo:
        try:
            _check_node(n, [values[i.id] for i in n.inputs], rng, executor, eps, rtol, atol,
                        len(report.checked))
        except GraphError as e:   # the rule breaks its contract (wrong count, shape or dtype)
            raise AssertionError(f"check_vjps: the VJP rule fails at {describe(n)}: {e}") from e
        report.checked.append(n)
    return report


def describe(n: Tensor) -> str:
    kind = "backward node" if n.is_backward else "node"
    return f"{kind} {n.label} (op '{n.op}', scope '{n.scope or '<root>'}')"


def _check_node(n: Tensor, arrays, rng, executor, eps, rtol, atol, passed) -> None:
    g = gl.Graph(f"check_vjps: {n.label}")
    leaves, points = [], []
    for k, (t, a) in enumerate(zip(n.inputs, arrays)):
        floating = t.dtype.kind == "f"
        leaves.append(g.input(f"in{k}", t.shape, np.float64 if floating else t.dtype))
        points.append(np.asarray(a, np.float64) if floating else np.asarray(a))
    attrs = dict(n.attrs)
    if "dtype" in attrs and np.dtype(attrs["dtype"]).kind == "f":
        attrs["dtype"] = np.dtype(np.float64).str
    with g.scope(n.scope):
        y = apply(n.op, leaves, **attrs)
    ct = g.input("cotangent", y.shape, y.dtype)
    wrt = [leaf for leaf in leaves if leaf.dtype.kind == "f"]
    with g.scope(n.scope):
        grads = vjp([y], [ct], wrt, partial=True)
    feeds = {f"in{k}": p for k, p in enumerate(points)}
    u = rng.standard_normal(y.shape)
    program = compile(g, grads, executor)
    grad_values = program.run({k: v for k, v in {**feeds, "cotangent": u}.items()
                               if k in program.input_nodes})
    forward = compile(g, [y], executor)
    for leaf, gv in zip(wrt, grad_values):
        x = feeds[leaf.name]
        v = rng.standard_normal(x.shape) * _step_sizes(x)
        plus = forward.run({**feeds, leaf.name: x + eps * v})[0]
        minus = forward.run({**feeds, leaf.name: x - eps * v})[0]
        jv = central_difference(plus, minus, eps)
        ok = np.isfinite(jv)     # an output that overflows on one side says nothing
        analytic, numeric = float(np.vdot(gv, v)), float(np.vdot(u[ok], jv[ok]))
        scale = float(np.linalg.norm(gv) * np.linalg.norm(v))
        if abs(analytic - numeric) > rtol * max(abs(analytic), abs(numeric)) + atol * scale:
            k = leaves.index(leaf)
            raise AssertionError(
                f"check_vjps: the VJP rule is wrong at {describe(n)}, for its input {k} "
                f"({n.inputs[k].label} {fmt_shape(n.inputs[k].shape)}): <J^T u, v> = {analytic:.8g} "
                f"by the rule, <u, J v> = {numeric:.8g} by central differences of the node alone "
                f"(relative error {abs(analytic - numeric) / max(abs(analytic), abs(numeric), 1e-300):.1e}; "
                f"checked in float64 on the {executor} executor; the {passed} nodes before it passed)")


def _step_sizes(x: np.ndarray) -> np.ndarray:
    """Per-element scale of the random direction: relative to the element (so a positive input
    of log or rsqrt stays positive), at least a tenth of the typical size; 0 where x is not
    finite (a masked -inf score stays masked)."""
    finite = np.isfinite(x)
    typical = float(np.sqrt(np.mean(np.square(x[finite])))) if finite.any() else 1.0
    return np.where(finite, np.maximum(np.abs(np.where(finite, x, 0.0)), 0.1 * typical + 1e-3), 0.0)
