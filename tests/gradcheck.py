"""Shared test helpers: run a graph, check its gradients against float64 central differences,
and compare an op with PyTorch.

Other test files use them as ``from tests.gradcheck import check_grads, check_torch, ...``.

The gradient check follows JAX's ``check_grads``: for a graph-building function
``f(*tensors) -> Tensor`` and float64 input arrays it builds ``loss = sum(f(...) * u)`` for fixed
random weights `u` (fed as the input ``cotangent``), takes ``graphlm.grad``, and compares with
central differences (eps 1e-4) of the same executor's forward along one random direction `v`
per float input. It also checks the VJP inner-product identity ``<J v, u> == <v, J^T u>``, with
``J v`` obtained by differentiating the VJP with respect to its cotangent (the transpose trick,
so it comes from autodiff, not from finite differences), and ``J v`` elementwise against the
central differences of the output.

PyTorch is a test oracle only: it is imported here lazily and never by graphlm itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from graphlm import executors
import graphlm as gl

EPS = 1e-4


# ------------------------------------------------------------------------------------------------
# running graphs
# ------------------------------------------------------------------------------------------------

def run(graph: gl.Graph, outputs, feeds=None, state=None, executor: str = "reference") -> list[np.ndarray]:
    """Compile `outputs` of `graph` with `executor` and run it once."""
    return executors.compile(graph, outputs, executor=executor).run(feeds or {}, state)


def run_reading(graph: gl.Graph, outputs, feeds, state=None, executor: str = "reference") -> list[np.ndarray]:
    """`run`, feeding only the inputs the compiled outputs read (programs refuse extra feeds)."""
    program = executors.compile(graph, outputs, executor=executor)
    return program.run({k: v for k, v in feeds.items() if k in program.input_nodes}, state)


def build(f: Callable[..., gl.Tensor], arrays: Sequence[np.ndarray], name: str = "check"):
    """A graph whose inputs ``x0, x1, ...`` have the shapes/dtypes of `arrays`, and ``f(*inputs)``."""
    g = gl.Graph(name)
    leaves = [g.input(f"x{i}", a.shape, a.dtype) for i, a in enumerate(arrays)]
    out = f(*leaves)
    if not isinstance(out, gl.Tensor):
        raise TypeError(f"the graph-building function returned {type(out).__name__}, not a Tensor")
    return g, leaves, out


def feeds_of(arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"x{i}": np.asarray(a) for i, a in enumerate(arrays)}


def is_float(a) -> bool:
    return np.asarray(a).dtype.kind == "f"


def assert_close(actual, expected, rtol: float, atol: float = 0.0, what: str = "value") -> None:
    """allclose with `atol` scaled by the size of `expected` (at least 1), and a clear message."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * scale, err_msg=what)


# ------------------------------------------------------------------------------------------------
# the finite-difference gradient check
# ------------------------------------------------------------------------------------------------

@dataclass
class GradCheckResult:
    output: np.ndarray            # f(*arrays)
    grads: list[np.ndarray]       # d sum(f * u) / d float input, in input order
    float_inputs: list[int]       # which inputs were differentiated


def check_grads(f: Callable[..., gl.Tensor], arrays: Sequence[np.ndarray], *, eps: float = EPS,
                rtol: float = 1e-6, atol: float = 1e-7, identity_rtol: float = 1e-10, seed: int = 0,
                executor: str = "reference") -> GradCheckResult:
    """Check every float input's gradient of `f` against float64 central differences.

    Integer and bool inputs (token ids, targets, conditions, RNG keys) are fed unchanged and not
    differentiated. Keep inputs away from kinks (relu at 0, ties of max/maximum): a central
    difference across a kink is not a derivative. `identity_rtol` is the tolerance of the
    inner-product identity, which holds to rounding unless the graph computes in float32.
    """
    arrays = [np.asarray(a) for a in arrays]
    float_idx = [i for i, a in enumerate(arrays) if is_float(a)]
    for i in float_idx:
        assert arrays[i].dtype == np.float64, f"check_grads needs float64 inputs; x{i} is {arrays[i].dtype}"
    g, leaves, out = build(f, arrays)
    assert out.dtype == np.float64, f"output of f is {out.dtype}; float64 inputs must give float64"
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(out.shape)
    cotangent = g.input("cotangent", out.shape, out.dtype)
    loss = gl.sum(out * cotangent)
    grads = gl.grad(loss, [leaves[i] for i in float_idx])
    directions = [rng.standard_normal(arrays[i].shape) for i in float_idx]
    # J v by the transpose trick: the VJP J^T u is linear in u, so d<J^T u, v>/du = J v.
    jvps = [gl.grad(gl.sum(gi * g.const(v)), [cotangent])[0] for gi, v in zip(grads, directions)]

    feeds = {**feeds_of(arrays), "cotangent": u}
    values = run(g, [out] + grads + jvps, feeds, executor=executor)
    y, grad_values, jvp_values = values[0], values[1:1 + len(grads)], values[1 + len(grads):]
    forward = executors.compile(g, [out], executor=executor)

    for k, i in enumerate(float_idx):
        assert grad_values[k].shape == arrays[i].shape and grad_values[k].dtype == np.float64, \
            f"grad of x{i}: {grad_values[k].shape} {grad_values[k].dtype} for input {arrays[i].shape}"
        v = directions[k]
        plus, minus = feeds_of(arrays), feeds_of(arrays)
        plus[f"x{i}"] = arrays[i] + eps * v
        minus[f"x{i}"] = arrays[i] - eps * v
        fd_jv = (forward.run(plus)[0] - forward.run(minus)[0]) / (2 * eps)
        # 1. the output's tangent along v: autodiff (transpose of the VJP) vs central differences
        assert_close(jvp_values[k], fd_jv, rtol, atol, f"J v for x{i} vs central differences")
        # 2. the gradient: <J^T u, v> (autodiff) vs <u, J v> (central differences)
        assert_close(np.vdot(grad_values[k], v), np.vdot(u, fd_jv), rtol, atol,
                     f"directional derivative along a random direction for x{i}")
        # 3. the VJP inner-product identity <J v, u> == <v, J^T u>, both from autodiff
        assert_close(np.vdot(jvp_values[k], u), np.vdot(v, grad_values[k]), identity_rtol, identity_rtol / 100,
                     f"inner-product identity <J v, u> == <v, J^T u> for x{i}")
    return GradCheckResult(y, grad_values, float_idx)


@dataclass
class SecondOrderResult:
    hvp: list[np.ndarray]           # grad(sum_i <grad_i, v_i>, x_i) for each float input
    weights: np.ndarray             # u: loss = sum(f(...) * u)
    directions: list[np.ndarray]    # v_i, one per float input
    float_inputs: list[int]


def check_second_order(f: Callable[..., gl.Tensor], arrays: Sequence[np.ndarray], *, eps: float = EPS,
                       rtol: float = 1e-6, atol: float = 1e-7, seed: int = 1,
                       executor: str = "reference") -> SecondOrderResult:
    """Hessian-vector products by grad of a gradient, against central differences of the gradient.

    loss = sum(f(...) * u); h = grad(sum_i <grad_i, v_i>, float inputs), which is H v for the
    joint direction v = (v_1, v_2, ...). Returns h with u and v, so a caller can compare with
    torch's double backward (`torch_hvp`).
    """
    arrays = [np.asarray(a) for a in arrays]
    float_idx = [i for i, a in enumerate(arrays) if is_float(a)]
    g, leaves, out = build(f, arrays)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(out.shape)
    wrt = [leaves[i] for i in float_idx]
    grads = gl.grad(gl.sum(out * g.const(u)), wrt)
    directions = [rng.standard_normal(arrays[i].shape) for i in float_idx]
    inner = gl.sum(gl.concat([gl.reshape(gl.sum(gi * g.const(v)), (1,)) for gi, v in zip(grads, directions)]))
    hvp = gl.grad(inner, wrt)
    feeds = feeds_of(arrays)
    hv = run_reading(g, hvp, feeds, executor=executor)
    plus, minus = dict(feeds), dict(feeds)
    for i, v in zip(float_idx, directions):
        plus[f"x{i}"] = arrays[i] + eps * v
        minus[f"x{i}"] = arrays[i] - eps * v
    grads_plus = run_reading(g, grads, plus, executor=executor)
    grads_minus = run_reading(g, grads, minus, executor=executor)
    for k, (gp, gm) in enumerate(zip(grads_plus, grads_minus)):
        assert_close(hv[k], (gp - gm) / (2 * eps), rtol, atol,
                     f"Hessian-vector product for x{float_idx[k]} vs central differences of the gradient")
    return SecondOrderResult(hv, u, directions, float_idx)


def torch_hvp(tf: Callable, arrays: Sequence[np.ndarray], result: SecondOrderResult) -> list[np.ndarray]:
    """torch's double backward (create_graph=True) for the u and v of a `check_second_order` result."""
    torch = torch_module()
    targs = [to_torch(np.asarray(a), requires_grad=is_float(a)) for a in arrays]
    wrt = [targs[i] for i in result.float_inputs]
    loss = (tf(*targs) * to_torch(result.weights)).sum()
    grads = torch.autograd.grad(loss, wrt, create_graph=True)
    inner = sum((gi * to_torch(v)).sum() for gi, v in zip(grads, result.directions))
    hv = torch.autograd.grad(inner, wrt, allow_unused=True)
    return [np.zeros_like(np.asarray(arrays[i])) if h is None else h.detach().numpy()
            for i, h in zip(result.float_inputs, hv)]


# ------------------------------------------------------------------------------------------------
# PyTorch as the oracle
# ------------------------------------------------------------------------------------------------

TOLERANCES = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def torch_module():
    """The torch module (imported once per session by Python's module cache)."""
    import torch
    return torch


def to_torch(a: np.ndarray, requires_grad: bool = False):
    torch = torch_module()
    t = torch.from_numpy(np.array(a, copy=True))  # a copy keeps 0-d arrays 0-d
    return t.requires_grad_(True) if requires_grad else t


def torch_dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def check_torch(f: Callable[..., gl.Tensor], tf: Callable, arrays: Sequence[np.ndarray], dtype, *,
                tol: float | None = None, grad: bool = True, seed: int = 0,
                executor: str = "reference") -> None:
    """Compare `f` (graphlm) with `tf` (the same function in torch) in `dtype`.

    Float inputs are cast to `dtype`. Checks the forward value, shape and dtype, and the gradient
    of a random weighted sum of the output with respect to every float input (torch.autograd.grad),
    with each gradient's shape and dtype (grad=False: the forward only). A float32 computation
    must stay float32.
    """
    torch = torch_module()
    dtype = np.dtype(dtype)
    tol = TOLERANCES[dtype] if tol is None else tol
    arrays = [np.asarray(a).astype(dtype) if is_float(a) else np.asarray(a) for a in arrays]
    float_idx = [i for i, a in enumerate(arrays) if is_float(a)]
    g, leaves, out = build(f, arrays)
    differentiable = grad and out.dtype.kind == "f" and bool(float_idx)
    outputs = [out]
    u = np.random.default_rng(seed).standard_normal(out.shape).astype(out.dtype if differentiable else dtype)
    if differentiable:
        outputs += gl.grad(gl.sum(out * g.const(u)), [leaves[i] for i in float_idx])
    values = run(g, outputs, feeds_of(arrays), executor=executor)

    targs = [to_torch(a, requires_grad=is_float(a) and differentiable) for a in arrays]
    ty = tf(*targs)
    assert tuple(ty.shape) == out.shape == values[0].shape, \
        f"output shape: graphlm {out.shape} (ran {values[0].shape}), torch {tuple(ty.shape)}"
    assert str(values[0].dtype) == torch_dtype_name(ty), \
        f"output dtype: graphlm {values[0].dtype}, torch {ty.dtype}"
    if float_idx and out.dtype.kind == "f":
        assert values[0].dtype == dtype, f"a {dtype} computation gave {values[0].dtype}"
    expected = ty.detach().numpy()
    if expected.dtype.kind == "f":
        assert_close(values[0], expected, tol, tol, "forward vs torch")
    else:
        np.testing.assert_array_equal(values[0], expected, err_msg="forward vs torch")
    if not differentiable:
        return
    float_targs = [targs[i] for i in float_idx]
    tgrads = torch.autograd.grad((ty * to_torch(u)).sum(), float_targs, allow_unused=True)
    for k, (i, tg) in enumerate(zip(float_idx, tgrads)):
        got = values[1 + k]
        exp = np.zeros_like(arrays[i]) if tg is None else tg.numpy()
        assert got.shape == arrays[i].shape == exp.shape, \
            f"grad of x{i}: graphlm {got.shape}, torch {exp.shape}, input {arrays[i].shape}"
        assert got.dtype == dtype == exp.dtype, f"grad of x{i}: graphlm {got.dtype}, torch {exp.dtype}"
        assert_close(got, exp, tol, tol, f"grad of x{i} vs torch")
