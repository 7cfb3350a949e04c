"""PyTorch as the test oracle of graphlm's own suite: an op against its torch form, values and
gradients (tinygrad's ``helper_test_op`` pattern), and torch's double backward for a second-order
`graphlm.testing.check_grads` result.

The gradient checker itself is public: `graphlm.testing` (check_grads, check_vjps,
assert_executors_agree, build, run, assert_close). PyTorch is a test oracle only: it is imported
here lazily and never by graphlm itself.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

import graphlm as gl
from graphlm.testing import GradCheckResult, assert_close, build, feeds_of, run
from graphlm.testing.graphs import is_float


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


def torch_hvp(tf: Callable, arrays: Sequence[np.ndarray], result: GradCheckResult) -> list[np.ndarray]:
    """torch's double backward (create_graph=True) for the weights u and directions v of a
    ``check_grads(..., order=2)`` result: the Hessian of sum(tf * u) times v, per float input."""
    torch = torch_module()
    targs = [to_torch(np.asarray(a), requires_grad=is_float(a)) for a in arrays]
    wrt = [targs[i] for i in result.float_inputs]
    loss = (tf(*targs) * to_torch(result.weights)).sum()
    grads = torch.autograd.grad(loss, wrt, create_graph=True)
    inner = sum((gi * to_torch(v)).sum() for gi, v in zip(grads, result.directions))
    hv = torch.autograd.grad(inner, wrt, allow_unused=True)
    return [np.zeros_like(np.asarray(arrays[i])) if h is None else h.detach().numpy()
            for i, h in zip(result.float_inputs, hv)]
