"""`check_grads`: a function's gradients against float64 central differences (JAX's check_grads).

For ``f(*tensors) -> Tensor`` and input arrays, the check builds f's graph once, in the inputs'
dtypes; a float32 graph is copied to float64 (`graphlm.rewrite.copy_graph`, a graph-level dtype
change, so f is written once). Then, per order k = 1..order, for the function F_k of the float
inputs (F_1 = f; F_k = the gradient of <F_{k-1}, u_{k-1}>, flattened and concatenated):

- loss = sum(F_k * u_k) for a random u_k fed as an input, and its gradient J^T u_k by `grad`;
- along one random direction v per float input: <J^T u_k, v> (autodiff) against <u_k, J v> with
  J v from central differences (eps) of the same executor's forward; on failure the check
  localises the error per element of that input (the worst index, its analytic and numeric
  values and their relative error);
- J v by the transpose trick (the VJP is linear in u_k, so d<J^T u_k, v>/du_k = J v) against the
  central differences, elementwise;
- the VJP inner-product identity <J v, u_k> == <v, J^T u_k>, both from autodiff.

So order 2 checks the Hessian of <f, u_1> (the derivative of every VJP rule's own nodes), which
a first-order check cannot see.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

import graphlm as gl
from graphlm.ir import fmt_shape
from graphlm.rewrite import copy_graph

from .graphs import (argument_names, assert_close, build, central_difference, compile, feeds_of,
                     is_float, reading)

EPS = 1e-4            # the central-difference step (float64)
RTOL = 1e-6           # gradients against central differences
ATOL = 1e-7           # ... scaled by the size of the expected value (at least 1)
IDENTITY_RTOL = 1e-10  # <J v, u> == <v, J^T u>: both from autodiff, equal to rounding in float64
LOCALISE_MAX = 512    # elements of one input differentiated one by one to name the worst index

TO_FLOAT64 = {np.float32: np.float64, np.float16: np.float64}


@dataclass
class GradCheckResult:
    """What a passing `check_grads` computed (float64), for callers that compare further
    (with PyTorch, say)."""

    output: np.ndarray                 # f(*args)
    grads: list[np.ndarray]            # d sum(f * weights) / d float input, in input order
    float_inputs: list[int]            # which were differentiated: argument positions, then
                                       # len(args) + k for the k-th param of f's graph
    weights: np.ndarray                # u_1, the output's random cotangent
    hvp: list[np.ndarray] | None = None         # order >= 2: H d per float input, where H is
    directions: list[np.ndarray] | None = None  # the Hessian of sum(f * weights), d = directions
    checks: list[str] = field(default_factory=list)   # one line per derivative checked


def check_grads(f: Callable[..., gl.Tensor], args: Sequence, *, order: int = 1,
                executor: str = "reference", eps: float = EPS, rtol: float = RTOL,
                atol: float = ATOL, identity_rtol: float = IDENTITY_RTOL, seed: int = 0,
                params: Mapping[str, np.ndarray] | None = None) -> GradCheckResult:
    """Check every float argument's derivatives of `f`, up to `order`, against float64 central
    differences; raise AssertionError naming the argument, the worst index, the analytic and
    numeric values and their relative error.

    `f` takes one graph tensor per argument and returns a tensor. Integer and bool arguments
    (token ids, targets, masks, RNG keys) are fed unchanged and not differentiated. Keep inputs
    away from kinks (relu at 0, ties of max): a central difference across one is no derivative.

    `params` gives values to the named leaves that f makes itself: a module's parameters are
    differentiated like arguments (and named by their parameter names), other inputs and states
    it reads (a dropout key) are fed unchanged. ``check_grads(layer, [x], params=layer.init())``
    checks a module.
    """
    if order < 1:
        raise ValueError(f"check_grads: order must be 1 or more, got {order}")
    arrays = [np.asarray(a) for a in args]
    names = argument_names(f, len(arrays))
    g, leaves, out = build(f, arrays, name=f"check_grads({getattr(f, '__name__', 'f')})")
    if out.dtype.kind != "f":
        raise ValueError(f"check_grads: f returns {out.dtype}, not a floating-point tensor")
    own = {n: t for n, t in g.leaves().items() if n not in feeds_of(arrays)}
    params = dict(params or {})
    missing, unused = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or unused:
        raise ValueError("check_grads: " + "; ".join(
            (["f's graph reads " + ", ".join(missing) + ": give their values in params="] if missing else [])
            + (["params= names " + ", ".join(unused) + ", which f's graph does not have"] if unused else [])))
    # the float64 copy, with f's own leaves as inputs (fed, so they can be varied)
    g, new = copy_graph([out, *leaves, *own.values()], dtypes=TO_FLOAT64, leaves_as_inputs=True)
    out = new[out.id]
    trainable = [n for n, t in own.items() if t.op == "param" and t.dtype.kind == "f"]
    leaves = [new[t.id] for t in leaves] + [new[own[n].id] for n in trainable]
    names = names + trainable
    fixed = {n: np.asarray(params[n]) for n in own if n not in trainable}
    arrays = arrays + [np.asarray(params[n]) for n in trainable]
    arrays = [a.astype(np.float64) if is_float(a) else a for a in arrays]
    float_idx = [i for i, a in enumerate(arrays) if is_float(a)]
    if not float_idx:
        raise ValueError("check_grads: f has no floating-point argument to differentiate")
    if out.dtype != np.float64:
        raise AssertionError(f"check_grads: f's output is {out.dtype} in the float64 copy of its "
                             "graph; an op upcasts or downcasts on its own")
    wrt = [leaves[i] for i in float_idx]
    feeds = {**{t.name: a for t, a in zip(leaves, arrays)},
             **{n: a.astype(np.float64) if is_float(a) else a for n, a in fixed.items()}}
    rng = np.random.default_rng(seed)
    fname = getattr(f, "__name__", type(f).__name__)
    fname = fname if fname.isidentifier() else "f"

    target, result = out, None
    for k in range(1, order + 1):
        level = _check_level(g, wrt, target, feeds, k, rng, fname, [names[i] for i in float_idx],
                             [arrays[i] for i in float_idx], executor, eps, rtol, atol, identity_rtol)
        feeds[level.cotangent.name] = level.u
        if result is None:
            result = GradCheckResult(level.y, level.grad_values, float_idx, level.u)
        elif k == 2:
            offsets = np.cumsum([0] + [int(np.prod(w.shape, dtype=np.int64)) for w in wrt])
            result.hvp = level.grad_values
            result.directions = [level.u[a:b].reshape(w.shape)
                                 for a, b, w in zip(offsets[:-1], offsets[1:], wrt)]
        result.checks += level.checks
        # the next order differentiates this one's gradients
        target = gl.concat([gl.reshape(gi, (-1,)) for gi in level.grads]) if len(wrt) > 1 \
            else gl.reshape(level.grads[0], (-1,))
    return result


@dataclass
class _Level:
    y: np.ndarray
    u: np.ndarray
    cotangent: gl.Tensor
    grads: list[gl.Tensor]
    grad_values: list[np.ndarray]
    checks: list[str]


def _check_level(g, wrt, target, feeds, order, rng, fname, names, points, executor, eps, rtol, atol,
                 identity_rtol) -> _Level:
    what = {1: "gradient", 2: "second derivative"}.get(order, f"derivative of order {order}")
    u = rng.standard_normal(target.shape)
    cotangent = g.input(f"check_grads.cotangent{order}", target.shape, target.dtype)
    grads = gl.grad(gl.sum(target * cotangent), wrt)
    directions = [rng.standard_normal(w.shape) for w in wrt]
    # J v by the transpose trick: the VJP J^T u is linear in u, so d<J^T u, v>/du = J v
    jvps = [gl.grad(gl.sum(gi * g.const(v)), [cotangent])[0] for gi, v in zip(grads, directions)]
    feeds = {**feeds, cotangent.name: u}
    program = compile(g, [target] + grads + jvps, executor)
    values = program.run(reading(program, feeds))
    y, grad_values, jvp_values = values[0], values[1:1 + len(wrt)], values[1 + len(wrt):]
    forward = compile(g, [target], executor)

    def f_at(name, point):
        return forward.run(reading(forward, {**feeds, name: point}))[0]

    checks = []
    for w, name, x, v, gv, jv in zip(wrt, names, points, directions, grad_values, jvp_values):
        label = f"'{name}' ({fmt_shape(w.shape)})"
        assert gv.shape == w.shape and gv.dtype == np.float64, \
            f"check_grads: the {what} for {label} came out {gv.shape} {gv.dtype}"
        fd_jv = central_difference(f_at(w.name, x + eps * v), f_at(w.name, x - eps * v), eps)
        analytic, numeric = float(np.vdot(gv, v)), float(np.vdot(u, fd_jv))
        if not np.isclose(analytic, numeric, rtol=rtol, atol=atol * max(1.0, abs(numeric))):
            detail = _localise(lambda p: float(np.vdot(u, f_at(w.name, p))), x, gv, eps, rng)
            raise AssertionError(
                f"check_grads: the {what} of {fname} with respect to {label} is wrong (checked in "
                f"float64 on the {executor} executor): "
                f"d<F, u>/d{name} for a random cotangent u{detail}; along a random direction "
                f"autodiff gives {analytic:.8g}, central "
                f"differences {numeric:.8g} (relative error {_rel(analytic, numeric):.1e}, rtol {rtol:g})")
        assert_close(jv, fd_jv, rtol, atol,
                     f"check_grads: the {what}'s tangent J v along a random direction of {label} "
                     f"(autodiff, by transposing the VJP) vs central differences")
        assert_close(np.vdot(jv, u), np.vdot(v, gv), identity_rtol, identity_rtol / 100,
                     f"check_grads: the VJP inner-product identity <J v, u> == <v, J^T u> for {label} "
                     f"({what})")
        checks.append(f"{what} of {label} on the {executor} executor: autodiff {analytic:+.8g}, "
                      f"central differences {numeric:+.8g}, relative error {_rel(analytic, numeric):.1e}")
    values = [np.asarray(v) for v in grad_values]
    return _Level(y, u, cotangent, grads, values, checks)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def _localise(scalar_at, x: np.ndarray, grad: np.ndarray, eps: float, rng) -> str:
    """The element of `x` where autodiff and central differences of scalar_at disagree most."""
    n = x.size
    flat = np.arange(n) if n <= LOCALISE_MAX else rng.choice(n, LOCALISE_MAX, replace=False)
    worst = None
    for i in flat:
        e = np.zeros(n)
        e[i] = eps
        e = e.reshape(x.shape)
        numeric = float(central_difference(scalar_at(x + e), scalar_at(x - e), eps))
        analytic = float(grad.reshape(-1)[i])
        err = abs(analytic - numeric)
        if worst is None or err > worst[0]:
            worst = (err, i, analytic, numeric)
    _, i, analytic, numeric = worst
    index = tuple(int(j) for j in np.unravel_index(i, x.shape)) if x.ndim else ()
    sampled = "" if n <= LOCALISE_MAX else f" (worst of {LOCALISE_MAX} sampled elements of {n})"
    return (f", at index {index}{sampled}: autodiff gives {analytic:.8g}, central differences "
            f"{numeric:.8g} (relative error {_rel(analytic, numeric):.1e})")
