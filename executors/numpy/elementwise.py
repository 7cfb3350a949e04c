"""Kernels of the numpy executor: elementwise ops (ufuncs, GELU with its kept sigmoid, the causal mask)."""
from __future__ import annotations

import functools

import numpy as np
from scipy import special

from graphlm.ops import GELU_A, GELU_B, GELU_DA, GELU_DB, GELU_R2, GELU_R2PI

from .table import all_inputs, kernel, scalar
from .tiling import blocked


# == elementwise ===================================================================================

def _ufunc_kernel(fn):
    # out positional: a partial with keywords costs ~0.4 us more a call (decoding makes ~60);
    # np.maximum deprecates a positional out, so it keeps the keyword. Not split over threads:
    # one pass over memory gains nothing from a second core (measured: batch 8 adds 3.5 -> 5.0 ms)
    if fn is np.maximum:
        return lambda node, out, ins, scratch: functools.partial(fn, *ins, out=out)
    return lambda node, out, ins, scratch: functools.partial(fn, *ins, out)


for _name, _fn in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                   "maximum": np.maximum, "neg": np.negative, "exp": np.exp, "log": np.log,
                   "sqrt": np.sqrt, "tanh": np.tanh, "square": np.square,
                   "sigmoid": special.expit, "erf": special.erf}.items():
    kernel(_name, inplace=all_inputs)(_ufunc_kernel(_fn))
for _name, _fn in {"greater": np.greater, "less": np.less, "equal": np.equal}.items():
    kernel(_name)(_ufunc_kernel(_fn))


@kernel("rsqrt", inplace=(0,))
def _rsqrt(node, out, ins, scratch):
    (x,), one = ins, scalar(1.0, node.dtype)

    def run():
        np.sqrt(x, out=out)
        np.divide(one, out, out=out)
    return run


@kernel("relu", inplace=(0,))
def _relu(node, out, ins, scratch):
    return functools.partial(np.maximum, ins[0], scalar(0.0, node.dtype), out=out)


@kernel("silu")
def _silu(node, out, ins, scratch):
    (x,) = ins

    def run():
        special.expit(x, out=out)
        np.multiply(x, out, out=out)
    return run


@kernel("pow", inplace=(0,))
def _pow(node, out, ins, scratch):
    return functools.partial(np.power, ins[0], scalar(node.attrs["exponent"], node.dtype), out=out)


@kernel("cast")
def _cast(node, out, ins, scratch):
    return functools.partial(np.copyto, out, ins[0], casting="unsafe")


@kernel("where", inplace=(2,))
def _where(node, out, ins, scratch):
    c, a, b = ins

    def run():
        if b is not out:
            np.copyto(out, b)
        np.copyto(out, a, where=c)
    return run


class _GeluConstants:
    """The tanh GELU's constants as scalars of one dtype (see graphlm.ops' GELU note)."""

    def __init__(self, dt):
        self.one = scalar(1.0, dt)
        self.a, self.b, self.da, self.db = (scalar(c, dt) for c in (GELU_A, GELU_B, GELU_DA, GELU_DB))


def _gelu_sigmoid(x, s, k):
    """s = 1 / (exp((x*x*A + B)*x) + 1): the one exp of every tanh-GELU kernel, in the
    reference's order."""
    np.multiply(x, x, s)
    np.multiply(s, k.a, s)
    np.add(s, k.b, s)
    np.multiply(s, x, s)
    np.exp(s, s)
    np.add(s, k.one, s)
    np.divide(k.one, s, s)


def _gelu_grad(x, g, s, out, b, k):
    """out = g*(s + (1 - s)*s*x*(x*x*DA + DB)) from the sigmoid s; b is scratch and `out` holds
    the second factor until the last pass (it must not alias x, g or s)."""
    np.subtract(k.one, s, b)
    np.multiply(b, s, b)
    np.multiply(b, x, b)
    np.multiply(x, x, out)
    np.multiply(out, k.da, out)
    np.add(out, k.db, out)
    np.multiply(b, out, b)
    np.add(b, s, b)
    np.multiply(g, b, out)


@kernel("gelu")
def _gelu(node, out, ins, scratch):
    (x,) = ins
    dt = node.dtype
    half, one = scalar(0.5, dt), scalar(1.0, dt)
    if node.attrs["approximate"] == "tanh":
        k = _GeluConstants(dt)

        def body(x, out):  # x*s; out positional: see _ufunc_kernel
            _gelu_sigmoid(x, out, k)
            np.multiply(x, out, out)
        return blocked(body, [x, out])
    r2 = scalar(GELU_R2, dt)

    def run_erf():  # ((erf(x*r) + 1)*x)*0.5 (graphlm.ops' GELU note)
        np.multiply(x, r2, out=out)
        special.erf(out, out=out)
        np.add(out, one, out=out)
        np.multiply(out, x, out=out)
        np.multiply(out, half, out=out)
    return run_erf


def _gelu_backward_scratch(node, pos):
    n = 2 if node.attrs["approximate"] == "tanh" else 1
    return [(node.shape, node.dtype)] * n


@kernel("gelu_backward", scratch=_gelu_backward_scratch)
def _gelu_backward(node, out, ins, scratch):
    x, g = ins
    dt = node.dtype
    half, one = scalar(0.5, dt), scalar(1.0, dt)
    if node.attrs["approximate"] == "tanh":
        k = _GeluConstants(dt)

        def body(x, g, out, s, b):
            _gelu_sigmoid(x, s, k)
            _gelu_grad(x, g, s, out, b, k)
        return blocked(body, [x, g, out, *scratch])
    (a,) = scratch
    r2, c2, mhalf = scalar(GELU_R2, dt), scalar(GELU_R2PI, dt), scalar(-0.5, dt)

    def run_erf():
        # g*((erf(x*r) + 1)*0.5 + (x*exp((x*-0.5)*x))*c) (graphlm.ops' GELU note)
        np.multiply(x, r2, out=a)
        special.erf(a, out=a)
        np.add(a, one, out=a)
        np.multiply(a, half, out=a)
        np.multiply(x, mhalf, out=out)
        np.multiply(out, x, out=out)
        np.exp(out, out=out)
        np.multiply(x, out, out=out)
        np.multiply(out, c2, out=out)
        np.add(a, out, out=a)
        np.multiply(g, a, out=out)
    return run_erf


@kernel("gelu_sigmoid")
def _gelu_sigmoid_kernel(node, out, ins, scratch):
    (x,), k = ins, _GeluConstants(node.dtype)
    return blocked(lambda x, s: _gelu_sigmoid(x, s, k), [x, out])   # the gelu kernel's sigmoid


@kernel("gelu_backward_sigmoid", scratch=lambda node, pos: [(node.shape, node.dtype)])
def _gelu_backward_sigmoid(node, out, ins, scratch):
    k = _GeluConstants(node.dtype)

    def body(x, g, s, out, b):  # the gelu_backward kernel's arithmetic, from the kept s
        _gelu_grad(x, g, s, out, b, k)
    return blocked(body, [*ins, out, *scratch])


@kernel("causal_mask", inplace=(0,))
def _causal_mask(node, out, ins, scratch):
    (x,) = ins
    t, s = node.shape[-2:]
    above = ~np.tri(t, s, k=node.attrs["offset"], dtype=bool)
    fill = scalar(node.attrs["fill"], node.dtype)

    def run():
        if x is not out:
            np.copyto(out, x)
        np.copyto(out, fill, where=above)
    return run
