"""Every op of graphlm, one section per op: its public function, shape rule, VJP and flags.

The public functions follow NumPy's names and signatures (``gl.sum(x, axis=1, keepdims=True)``).
Python scalars in ops become consts of the other operand's dtype (nothing upcasts to float64).
Fused ops (softmax, layer_norm, cross_entropy, ...) have their own backward ops, and every fused op
also states its decomposition into simpler ops; the tests check that the two agree.
"""
from __future__ import annotations

import builtins
import math
from typing import Sequence

import numpy as np

from .ir import GraphError, ShapeError, Tensor, fmt_shape
from .registry import apply, graph_of, register

_pysum, _pymax, _pyslice = builtins.sum, builtins.max, builtins.slice



# ================================================================================================
# helpers shared by the rules
# ================================================================================================

def lift(x, like: Tensor) -> Tensor:
    """Turn a Python/NumPy scalar or array into a const of `like`'s graph (and dtype for scalars)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray) and x.ndim > 0:
        return like.graph.const(x)
    if isinstance(x, (bool, int, float, np.generic, np.ndarray)):
        return like.graph.const(np.asarray(x).astype(like.dtype))
    raise TypeError(f"cannot use {type(x).__name__} as an operand of a graphlm op")


def _lift_pair(a, b) -> tuple[Tensor, Tensor]:
    if isinstance(a, Tensor):
        return a, lift(b, a)
    if isinstance(b, Tensor):
        return lift(a, b), b
    raise TypeError("an op needs at least one graphlm.Tensor operand")


def broadcast_shapes(*shapes) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError("cannot broadcast " + " with ".join(fmt_shape(s) for s in shapes)) from None


def _same_dtype(inputs) -> np.dtype:
    dts = {t.dtype for t in inputs}
    if len(dts) > 1:
        raise ShapeError("dtype mismatch: " + ", ".join(f"{fmt_shape(t.shape)} {t.dtype}" for t in inputs)
                         + " (cast explicitly; graphlm never upcasts silently)")
    return inputs[0].dtype


def _require_float(t: Tensor, what="input"):
    if t.dtype.kind != "f":
        raise ShapeError(f"{what} must be floating point, got {t.dtype} {fmt_shape(t.shape)}")


def _require_int(t: Tensor, what="ids"):
    if t.dtype.kind not in "iu":
        raise ShapeError(f"{what} must be an integer tensor, got {t.dtype} {fmt_shape(t.shape)}")


def unbroadcast(g: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum a cotangent of a broadcast result back to an input's `shape`."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                      if d == 1 and g.shape[lead + i] != 1)
    out = sum(g, axis=axes, keepdims=True) if axes else g
    return reshape(out, shape)


def normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < _pymax(ndim, 1) or (ndim == 0):
            raise ShapeError(f"axis {a} is out of range for {ndim}-d input")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated axis in {axis}")
    return tuple(sorted(out))


def _keepdims_shape(shape, axes):
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _reduced_shape(shape, axes, keepdims):
    if keepdims:
        return _keepdims_shape(shape, axes)
    return tuple(d for i, d in enumerate(shape) if i not in axes)


# ================================================================================================
# leaves (made by Graph.input/param/state/const, never by apply)
# ================================================================================================

def _leaf_infer(inputs, attrs):
    raise ShapeError("leaves are made by Graph.input/param/state/const")


for _name, _doc in (("input", "fed on every run"), ("param", "trainable, persistent"),
                    ("state", "persistent, not trainable (moments, RNG keys, KV caches)"),
                    ("const", "a value baked into the graph")):
    register(_name, _leaf_infer, doc=_doc, vjp_doc="(a leaf: where gradients arrive)")


# ================================================================================================
# elementwise ops
# ================================================================================================

def _infer_same(inputs, attrs):
    (x,) = inputs
    _require_float(x)
    return x.shape, x.dtype


def _infer_binary(inputs, attrs):
    return broadcast_shapes(*(t.shape for t in inputs)), _same_dtype(inputs)


def _infer_compare(inputs, attrs):
    shape, _ = _infer_binary(inputs, attrs)
    return shape, np.bool_


def _unary(name, vjp, doc, vjp_doc, decompose=None):
    register(name, _infer_same, vjp=vjp, decompose=decompose, elementwise=True,
             doc=doc, vjp_doc=vjp_doc)


def _binary(name, vjp, doc, vjp_doc):
    register(name, _infer_binary, vjp=vjp, elementwise=True, doc=doc, vjp_doc=vjp_doc)


# --- add, sub, mul, div, maximum ------------------------------------------------------------------
_binary("add", lambda y, g: [unbroadcast(g, y.inputs[0].shape), unbroadcast(g, y.inputs[1].shape)],
        "a + b (broadcasting)", "g, g (each summed back to its input's shape)")
_binary("sub", lambda y, g: [unbroadcast(g, y.inputs[0].shape), unbroadcast(neg(g), y.inputs[1].shape)],
        "a - b (broadcasting)", "g, -g")
_binary("mul", lambda y, g: [unbroadcast(g * y.inputs[1], y.inputs[0].shape),
                             unbroadcast(g * y.inputs[0], y.inputs[1].shape)],
        "a * b (broadcasting)", "g*b, g*a")
def _infer_div(inputs, attrs):
    """True division is a float op: integer a / b has no integer result dtype (NumPy would
    return float64), so it is refused here rather than failing in an executor."""
    shape, dtype = _infer_binary(inputs, attrs)
    if np.dtype(dtype).kind != "f":
        raise ShapeError(f"true division needs floating-point inputs, got {dtype} "
                         f"{fmt_shape(inputs[0].shape)} / {fmt_shape(inputs[1].shape)} "
                         "(cast both to float32 first)")
    return shape, dtype


register("div", _infer_div, vjp=lambda y, g: [unbroadcast(g / y.inputs[1], y.inputs[0].shape),
                                              unbroadcast(neg(g) * y / y.inputs[1], y.inputs[1].shape)],
         elementwise=True, doc="a / b (broadcasting; floating point)", vjp_doc="g/b, -g*y/b")


def _maximum_vjp(y, g):
    a, b = y.inputs
    one, half, zero = lift(1.0, g), lift(0.5, g), lift(0.0, g)
    ga = g * where(greater(a, b), one, where(equal(a, b), half, zero))
    return [unbroadcast(ga, a.shape), unbroadcast(g - ga, b.shape)]


_binary("maximum", _maximum_vjp, "elementwise max(a, b)", "g routed to the larger input (split evenly on ties)")


def add(a, b) -> Tensor:
    """a + b with NumPy broadcasting."""
    return apply("add", _lift_pair(a, b))


def sub(a, b) -> Tensor:
    """a - b with NumPy broadcasting."""
    return apply("sub", _lift_pair(a, b))


def mul(a, b) -> Tensor:
    """a * b with NumPy broadcasting."""
    return apply("mul", _lift_pair(a, b))


def div(a, b) -> Tensor:
    """a / b with NumPy broadcasting."""
    return apply("div", _lift_pair(a, b))


def maximum(a, b) -> Tensor:
    """Elementwise maximum with NumPy broadcasting (ties share the gradient evenly)."""
    return apply("maximum", _lift_pair(a, b))


# --- comparisons (no gradient) --------------------------------------------------------------------
for _name, _doc in (("greater", "a > b"), ("less", "a < b"), ("equal", "a == b")):
    register(_name, _infer_compare, elementwise=True, differentiable=False, doc=_doc + " (bool)",
             vjp_doc="not differentiable")


def greater(a, b) -> Tensor:
    """a > b, a bool tensor."""
    return apply("greater", _lift_pair(a, b))


def less(a, b) -> Tensor:
    """a < b, a bool tensor."""
    return apply("less", _lift_pair(a, b))


def equal(a, b) -> Tensor:
    """a == b, a bool tensor."""
    return apply("equal", _lift_pair(a, b))


# --- where -----------------------------------------------------------------------------------------
def _infer_where(inputs, attrs):
    c, a, b = inputs
    if c.dtype != np.bool_:
        raise ShapeError(f"condition must be bool, got {c.dtype} {fmt_shape(c.shape)}")
    return broadcast_shapes(c.shape, a.shape, b.shape), _same_dtype([a, b])


def _where_vjp(y, g):
    c, a, b = y.inputs
    zero = lift(0.0, g)
    return [None, unbroadcast(where(c, g, zero), a.shape), unbroadcast(where(c, zero, g), b.shape)]


register("where", _infer_where, vjp=_where_vjp, elementwise=True,
         doc="cond ? a : b (broadcasting)", vjp_doc="-, where(c, g, 0), where(c, 0, g)")


def where(cond, a, b) -> Tensor:
    """Elementwise ``a if cond else b`` with broadcasting; `cond` is a bool tensor."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        a, b = _lift_pair(a, b)
    else:
        a = cond.graph.const(np.float32(a))
        b = lift(b, a)
    return apply("where", (cond, a, b))


# --- unary math -------------------------------------------------------------------------------------
_unary("neg", lambda y, g: [neg(g)], "-x", "-g")
_unary("exp", lambda y, g: [g * y], "e^x", "g*y")
_unary("log", lambda y, g: [g / y.inputs[0]], "natural log", "g/x")
_unary("sqrt", lambda y, g: [g / (y * 2.0)], "square root", "g/(2y)")
_unary("rsqrt", lambda y, g: [g * (y * y * y) * -0.5], "1/sqrt(x)", "-g*y^3/2")
_unary("tanh", lambda y, g: [g * (1.0 - y * y)], "hyperbolic tangent", "g*(1-y^2)")
_unary("sigmoid", lambda y, g: [g * (y * (1.0 - y))], "1/(1+e^-x)", "g*y*(1-y)")
_unary("relu", lambda y, g: [where(greater(y.inputs[0], 0.0), g, lift(0.0, g))], "max(x, 0)",
       "g where x > 0 else 0")
_unary("square", lambda y, g: [g * (y.inputs[0] * 2.0)], "x*x", "2*g*x")
_unary("erf", lambda y, g: [g * (exp(neg(square(y.inputs[0]))) * (2.0 / math.sqrt(math.pi)))],
       "the error function", "g*2/sqrt(pi)*exp(-x^2)")


def _silu_vjp(y, g):
    x = y.inputs[0]
    s = sigmoid(x)
    return [g * (s * (x * (1.0 - s) + 1.0))]


_unary("silu", _silu_vjp, "x*sigmoid(x)", "g*s*(1+x*(1-s)), s = sigmoid(x)",
       decompose=lambda x: x * sigmoid(x))


def neg(x) -> Tensor:
    """-x"""
    return apply("neg", (x,))


def exp(x) -> Tensor:
    """e**x"""
    return apply("exp", (x,))


def log(x) -> Tensor:
    """Natural logarithm."""
    return apply("log", (x,))


def sqrt(x) -> Tensor:
    """Square root."""
    return apply("sqrt", (x,))


def rsqrt(x) -> Tensor:
    """1 / sqrt(x)."""
    return apply("rsqrt", (x,))


def tanh(x) -> Tensor:
    """Hyperbolic tangent."""
    return apply("tanh", (x,))


def sigmoid(x) -> Tensor:
    """The logistic function 1 / (1 + exp(-x))."""
    return apply("sigmoid", (x,))


def relu(x) -> Tensor:
    """max(x, 0); the gradient at 0 is 0."""
    return apply("relu", (x,))


def square(x) -> Tensor:
    """x * x"""
    return apply("square", (x,))


def erf(x) -> Tensor:
    """The error function."""
    return apply("erf", (x,))


def silu(x) -> Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    return apply("silu", (x,))


# --- pow(x, scalar) --------------------------------------------------------------------------------
def _infer_pow(inputs, attrs):
    return _infer_same(inputs, attrs)


register("pow", _infer_pow, elementwise=True,
         vjp=lambda y, g: [g * (pow(y.inputs[0], y.attrs["exponent"] - 1.0) * y.attrs["exponent"])],
         doc="x ** p for a Python scalar p", vjp_doc="g*p*x^(p-1)")


def pow(x, exponent) -> Tensor:
    """x ** exponent, with a Python scalar exponent."""
    if isinstance(exponent, Tensor):
        raise TypeError("pow: the exponent must be a Python scalar (use exp/log for tensors)")
    exponent = float(exponent)
    if exponent == 1.0:
        return x
    if exponent == 2.0:
        return square(x)
    return apply("pow", (x,), exponent=exponent)


# --- cast ---------------------------------------------------------------------------------------------
def _infer_cast(inputs, attrs):
    return inputs[0].shape, np.dtype(attrs["dtype"])


register("cast", _infer_cast, elementwise=True,
         vjp=lambda y, g: [cast(g, y.inputs[0].dtype) if y.inputs[0].dtype.kind == "f" else None],
         doc="convert to another dtype", vjp_doc="cast(g, x.dtype)")


def cast(x, dtype) -> Tensor:
    """Convert `x` to `dtype` (the only way to change precision)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return apply("cast", (x,), dtype=dtype.str)


# --- gelu ---------------------------------------------------------------------------------------------
# GPT-2's tanh GELU, 0.5*x*(1 + tanh(u)) with u = C*(x + K*x^3), is exactly x*sigmoid(2u)
# (tanh(u) = 2*sigmoid(2u) - 1). Every executor computes it in that form, in this order:
#     s = 1 / (exp((x*x*GELU_A + GELU_B)*x) + 1),   gelu = x*s                 (-2u = (x*x*A + B)*x)
#     gelu' = ((1 - s)*s*x)*(x*x*GELU_DA + GELU_DB) + s,   gelu_backward = g*gelu'   (2u' = x*x*DA + DB)
# and the exact (erf) GELU, with r = GELU_R2 = 1/sqrt(2) and c = GELU_R2PI = 1/sqrt(2 pi):
#     gelu = ((erf(x*r) + 1)*x)*0.5
#     gelu' = (erf(x*r) + 1)*0.5 + (x*exp((x*-0.5)*x))*c,   gelu_backward = g*gelu'
# one exp instead of a tanh (NumPy's float32 tanh costs twice its exp) and fewer passes; it rounds
# like the tanh form (max error 5e-7 vs float64 on N(0, 2) inputs, the tanh form's 4.7e-7).
# For large |x| exp overflows to inf and s becomes 0 (x < 0) or 1: gelu -> -0 or x, as the tanh form.
GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715
GELU_A, GELU_B = -2 * GELU_C * GELU_K, -2 * GELU_C
GELU_DA, GELU_DB = 6 * GELU_C * GELU_K, 2 * GELU_C
GELU_R2, GELU_R2PI = 1.0 / math.sqrt(2.0), 1.0 / math.sqrt(2.0 * math.pi)


def _infer_gelu(inputs, attrs):
    if attrs["approximate"] not in ("tanh", "none"):
        raise ShapeError(f"approximate must be 'tanh' or 'none', got {attrs['approximate']!r}")
    return _infer_same(inputs[:1], attrs)


def _gelu_sigmoid(x):
    """sigmoid(2*C*(x + K*x^3)) of the tanh GELU, in the executors' order (see above)."""
    return 1.0 / (exp((x * x * GELU_A + GELU_B) * x) + 1.0)


def _gelu_decompose(x, approximate):
    if approximate == "tanh":
        return x * _gelu_sigmoid(x)
    return (erf(x * GELU_R2) + 1.0) * x * 0.5


def _gelu_backward_decompose(x, g, approximate):
    if approximate == "tanh":
        s = _gelu_sigmoid(x)
        d = (1.0 - s) * s * x * (x * x * GELU_DA + GELU_DB) + s
    else:
        d = (erf(x * GELU_R2) + 1.0) * 0.5 + x * exp(x * -0.5 * x) * GELU_R2PI
    return g * d


register("gelu", _infer_gelu, elementwise=True, decompose=_gelu_decompose,
         vjp=lambda y, g: [apply("gelu_backward", (y.inputs[0], g), **y.attrs)],
         doc="GELU; approximate='tanh' (GPT-2's, as x*s, s = 1/(exp((x*x*A + B)*x) + 1)) or 'none' "
             "(((erf(x/sqrt(2)) + 1)*x)*0.5)", vjp_doc="gelu_backward(x, g)")
register("gelu_backward", _infer_gelu, elementwise=True,
         decompose=_gelu_backward_decompose,
         doc="g * gelu'(x) (the order: the GELU note in graphlm/ops.py)", vjp_doc="through its decomposition")


def gelu(x, approximate: str = "tanh") -> Tensor:
    """GELU. ``approximate="tanh"`` is GPT-2's tanh form; ``"none"`` is the exact erf form."""
    return apply("gelu", (x,), approximate=approximate)


# ================================================================================================
# reductions
# ================================================================================================

def _infer_reduce(inputs, attrs):
    (x,) = inputs
    return _reduced_shape(x.shape, attrs["axes"], attrs["keepdims"]), x.dtype


def _sum_vjp(y, g):
    x = y.inputs[0]
    g = reshape(g, _keepdims_shape(x.shape, y.attrs["axes"]))
    return [broadcast_to(g, x.shape)]


def _mean_vjp(y, g):
    x = y.inputs[0]
    n = _count(x.shape, y.attrs["axes"])
    return [broadcast_to(reshape(g, _keepdims_shape(x.shape, y.attrs["axes"])) * (1.0 / n), x.shape)]


def _max_vjp(y, g):
    x = y.inputs[0]
    ks = _keepdims_shape(x.shape, y.attrs["axes"])
    hit = cast(equal(x, reshape(y, ks)), x.dtype)
    count = sum(hit, axis=y.attrs["axes"], keepdims=True)
    return [reshape(g, ks) / count * hit]


def _count(shape, axes):
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


register("sum", _infer_reduce, vjp=_sum_vjp, doc="sum over axes", vjp_doc="broadcast g back")
register("mean", _infer_reduce, vjp=_mean_vjp, doc="sum over axes / n (the count as an integer, as np.mean)",
         vjp_doc="broadcast g/n back")
register("max", _infer_reduce, vjp=_max_vjp, doc="max over axes",
         vjp_doc="g to the maxima (split evenly on ties)")


def _reduce(op, x, axis, keepdims):
    try:
        axes = normalize_axes(axis, x.ndim)
    except ShapeError as e:
        raise ShapeError(f"{op} in {x.graph.current_scope or '<root>'}: {e} (shape {fmt_shape(x.shape)})") from None
    if op != "sum" and x.ndim and any(x.shape[a] == 0 for a in axes):
        raise ShapeError(f"{op} in {x.graph.current_scope or '<root>'}: reduction over an empty axis of {fmt_shape(x.shape)}")
    return apply(op, (x,), axes=axes, keepdims=bool(keepdims))


def sum(x, axis=None, keepdims=False) -> Tensor:
    """Sum over `axis` (None = all, int or tuple)."""
    return _reduce("sum", x, axis, keepdims)


def mean(x, axis=None, keepdims=False) -> Tensor:
    """Mean over `axis` (None = all, int or tuple)."""
    return _reduce("mean", x, axis, keepdims)


def max(x, axis=None, keepdims=False) -> Tensor:
    """Max over `axis` (None = all, int or tuple); ties share the gradient evenly."""
    return _reduce("max", x, axis, keepdims)


# ================================================================================================
# views and data movement
# ================================================================================================

def _infer_reshape(inputs, attrs):
    (x,) = inputs
    shape = attrs["shape"]
    if int(np.prod(shape, dtype=np.int64)) != x.size:
        raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} into {fmt_shape(shape)}")
    return shape, x.dtype


register("reshape", _infer_reshape, view=True,
         vjp=lambda y, g: [reshape(g, y.inputs[0].shape)],
         doc="same data, new shape", vjp_doc="reshape(g, x.shape)")


def reshape(x, shape) -> Tensor:
    """Same data in a new shape; one dimension may be -1."""
    shape = tuple(int(d) for d in ((shape,) if isinstance(shape, (int, np.integer)) else shape))
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape in {x.graph.current_scope or '<root>'}: more than one -1 in {shape}")
    if -1 in shape:
        rest = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if rest == 0 or x.size % rest:
            raise ShapeError(f"reshape in {x.graph.current_scope or '<root>'}: cannot reshape "
                             f"{fmt_shape(x.shape)} into {fmt_shape(shape)}")
        shape = tuple(x.size // rest if d == -1 else d for d in shape)
    if shape == x.shape:
        return x
    return apply("reshape", (x,), shape=shape)


def _infer_transpose(inputs, attrs):
    (x,) = inputs
    axes = attrs["axes"]
    if sorted(axes) != list(range(x.ndim)):
        raise ShapeError(f"axes {list(axes)} are not a permutation of {x.ndim} axes of {fmt_shape(x.shape)}")
    return tuple(x.shape[a] for a in axes), x.dtype


register("transpose", _infer_transpose, view=True,
         vjp=lambda y, g: [transpose(g, tuple(np.argsort(y.attrs["axes"])))],
         doc="permute axes", vjp_doc="transpose(g, inverse permutation)")


def transpose(x, axes=None) -> Tensor:
    """Permute axes (reverse them when `axes` is None), as np.transpose."""
    if axes is None:
        axes = tuple(reversed(range(x.ndim)))
    axes = tuple(int(a) % x.ndim if x.ndim else int(a) for a in axes)
    if axes == tuple(range(x.ndim)):
        return x
    if x.op == "transpose" and sorted(axes) == list(range(x.ndim)):   # two permutations are one
        inner = x.attrs["axes"]
        return transpose(x.inputs[0], tuple(inner[a] for a in axes))
    return apply("transpose", (x,), axes=axes)


def swapaxes(x, a: int, b: int) -> Tensor:
    axes = list(range(x.ndim))
    axes[a], axes[b] = axes[b], axes[a]
    return transpose(x, axes)


def _infer_broadcast_to(inputs, attrs):
    (x,) = inputs
    shape = attrs["shape"]
    if broadcast_shapes(x.shape, shape) != shape:
        raise ShapeError(f"cannot broadcast {fmt_shape(x.shape)} to {fmt_shape(shape)}")
    return shape, x.dtype


register("broadcast_to", _infer_broadcast_to, view=True,
         vjp=lambda y, g: [unbroadcast(g, y.inputs[0].shape)],
         doc="repeat along new or size-1 axes", vjp_doc="sum g back to x.shape")


def broadcast_to(x, shape) -> Tensor:
    """Broadcast `x` to `shape` (NumPy rules)."""
    shape = tuple(int(d) for d in shape)
    if shape == x.shape:
        return x
    return apply("broadcast_to", (x,), shape=shape)


# --- slicing ---------------------------------------------------------------------------------------
def normalize_index(index, shape) -> tuple:
    """Basic indexing -> one entry per axis: a `slice` with concrete bounds, or an int."""
    if not isinstance(index, tuple):
        index = (index,)
    if _pysum(1 for i in index if i is Ellipsis) > 1:
        raise ShapeError("an index can only have a single ellipsis")
    n_real = _pysum(1 for i in index if i is not Ellipsis)
    if n_real > len(shape):
        raise ShapeError(f"too many indices ({n_real}) for {fmt_shape(shape)}")
    expanded = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([_pyslice(None)] * (len(shape) - n_real))
        else:
            expanded.append(i)
    expanded.extend([_pyslice(None)] * (len(shape) - len(expanded)))
    out = []
    for axis, (i, d) in enumerate(zip(expanded, shape)):
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            j = int(i)
            if not -d <= j < d:
                raise ShapeError(f"index {j} is out of bounds for axis {axis} of {fmt_shape(shape)}")
            out.append(j % d)
        elif isinstance(i, _pyslice):
            start, stop, step = i.indices(d)
            # a negative step that runs past index 0 ends at stop = -1, which NumPy would read
            # as "the last element"; None says "through index 0"
            out.append(_pyslice(start, None if stop < 0 else stop, step))
        else:
            raise ShapeError(f"only basic indexing (ints, slices, ...) is supported, got {i!r}")
    return tuple(out)


def _infer_slice(inputs, attrs):
    (x,) = inputs
    shape = tuple(len(range(*s.indices(d))) for s, d in zip(attrs["index"], x.shape)
                  if isinstance(s, _pyslice))
    return shape, x.dtype


def _infer_slice_backward(inputs, attrs):
    return tuple(attrs["in_shape"]), inputs[0].dtype


register("slice", _infer_slice, view=True,
         vjp=lambda y, g: [apply("slice_backward", (g,), in_shape=y.inputs[0].shape,
                                 index=y.attrs["index"])],
         doc="basic indexing x[a:b, ..., i]", vjp_doc="slice_backward(g): g placed in zeros")
register("slice_backward", _infer_slice_backward,
         vjp=lambda y, g: [apply("slice", (g,), index=y.attrs["index"])],
         doc="zeros of the sliced input's shape with g at the index", vjp_doc="slice(g)")


def slice(x, index) -> Tensor:
    """``x[index]`` for basic indexing: ints, slices (with steps) and one Ellipsis."""
    try:
        idx = normalize_index(index, x.shape)
    except ShapeError as e:
        raise ShapeError(f"slice in {x.graph.current_scope or '<root>'}: {e}") from None
    if all(isinstance(s, _pyslice) and s == _pyslice(0, d, 1) for s, d in zip(idx, x.shape)):
        return x
    return apply("slice", (x,), index=idx)


def _infer_concat(inputs, attrs):
    axis = attrs["axis"]
    first = inputs[0]
    for t in inputs[1:]:
        if t.ndim != first.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis):
            raise ShapeError("cannot concatenate " + ", ".join(fmt_shape(t.shape) for t in inputs)
                             + f" along axis {axis}")
    dtype = _same_dtype(inputs)
    shape = list(first.shape)
    shape[axis] = _pysum(t.shape[axis] for t in inputs)
    return tuple(shape), dtype


def _concat_vjp(y, g):
    axis, start, grads = y.attrs["axis"], 0, []
    for t in y.inputs:
        idx = [_pyslice(None)] * g.ndim
        idx[axis] = _pyslice(start, start + t.shape[axis])
        grads.append(slice(g, tuple(idx)))
        start += t.shape[axis]
    return grads


register("concat", _infer_concat, vjp=_concat_vjp, doc="join along an axis",
         vjp_doc="the matching slices of g")


def concat(xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along `axis` (as np.concatenate)."""
    xs = list(xs)
    if not xs:
        raise ShapeError("concat: needs at least one tensor")
    try:
        (axis,) = normalize_axes(axis, xs[0].ndim)
    except ShapeError as e:
        raise ShapeError(f"concat in {xs[0].graph.current_scope or '<root>'}: {e}") from None
    if len(xs) == 1:
        return xs[0]
    return apply("concat", tuple(xs), axis=axis)


def split(x, n: int, axis: int = 0) -> list[Tensor]:
    """Split into `n` equal parts along `axis` (as np.split with an int); each part is a view."""
    (axis,) = normalize_axes(axis, x.ndim)
    if n <= 0 or x.shape[axis] % n:
        raise ShapeError(f"split in {x.graph.current_scope or '<root>'}: axis {axis} of "
                         f"{fmt_shape(x.shape)} does not divide into {n} equal parts")
    step = x.shape[axis] // n
    parts = []
    for k in range(n):
        idx = [_pyslice(None)] * x.ndim
        idx[axis] = _pyslice(k * step, (k + 1) * step)
        parts.append(slice(x, tuple(idx)))
    return parts


# ================================================================================================
# matmul
# ================================================================================================

def _product_batch(a: Tensor, b_batch: tuple, b_text: str) -> tuple[int, ...]:
    """The batch axes of a product of `a` [..., m, k] and an operand whose batch axes are
    `b_batch` (named `b_text` in the error), broadcast."""
    try:
        return tuple(np.broadcast_shapes(a.shape[:-2], b_batch))
    except ValueError:
        raise ShapeError(f"cannot multiply {fmt_shape(a.shape)} by {b_text} "
                         "(batch dimensions do not broadcast)") from None


def _infer_matmul(inputs, attrs):
    a, b = inputs
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"cannot multiply {fmt_shape(a.shape)} by {fmt_shape(b.shape)}")
    batch = _product_batch(a, b.shape[:-2], fmt_shape(b.shape))
    return batch + (a.shape[-2], b.shape[-1]), _same_dtype(inputs)


def _matmul_vjp(y, g):
    a, b = y.inputs
    ga = unbroadcast(matmul(g, swapaxes(b, -1, -2)), a.shape)
    if a.ndim == b.ndim == 2 and b.op == "transpose":
        # b = W^T (Linear): W's gradient comes out as g^T @ a, contiguous [out, in], where
        # a^T @ g would reach W as a transposed view (the transpose's VJP cancels this one)
        return [ga, transpose(matmul(transpose(g), a))]
    return [ga, unbroadcast(matmul(swapaxes(a, -1, -2), g), b.shape)]


register("matmul", _infer_matmul, vjp=_matmul_vjp, doc="batched matrix product (np.matmul)",
         vjp_doc="g @ b^T, a^T @ g (summed over broadcast batch axes; "
                 "for a 2-D b = W^T, (g^T @ a)^T)")


def matmul(a, b) -> Tensor:
    """Matrix product with np.matmul's batching and broadcasting (1-D operands included)."""
    a, b = _lift_pair(a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul in {a.graph.current_scope or '<root>'}: cannot multiply "
                         f"{fmt_shape(a.shape)} by {fmt_shape(b.shape)} (scalars; use mul)")
    if a.ndim == 1 or b.ndim == 1:
        if a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise ShapeError(f"matmul in {a.graph.current_scope or '<root>'}: cannot multiply "
                             f"{fmt_shape(a.shape)} by {fmt_shape(b.shape)}")
        a2 = reshape(a, (1,) + a.shape) if a.ndim == 1 else a
        b2 = reshape(b, b.shape + (1,)) if b.ndim == 1 else b
        out = apply("matmul", (a2, b2))
        shape = out.shape
        if b.ndim == 1:
            shape = shape[:-1]
        if a.ndim == 1:
            shape = shape[:-2] + shape[-1:] if b.ndim > 1 else shape[:-1]
        return reshape(out, shape)
    return apply("matmul", (a, b))


# ================================================================================================
# embedding (gather) and its scatter-add, one_hot
# ================================================================================================

def _infer_embedding(inputs, attrs):
    table, ids = inputs
    if table.ndim != 2:
        raise ShapeError(f"table must be 2-d [rows, dim], got {fmt_shape(table.shape)}")
    _require_int(ids)
    return ids.shape + (table.shape[1],), table.dtype


def _infer_embedding_backward(inputs, attrs):
    ids, g = inputs
    return (attrs["rows"], g.shape[-1]), g.dtype


register("embedding", _infer_embedding,
         vjp=lambda y, g: [apply("embedding_backward", (y.inputs[1], g), rows=y.inputs[0].shape[0]), None],
         doc="table[ids]: gather rows", vjp_doc="embedding_backward(ids, g) (scatter-add); ids get none")
register("embedding_backward", _infer_embedding_backward,
         vjp=lambda y, g: [None, embedding(g, y.inputs[0])],
         doc="scatter-add g's rows into zeros[rows, dim] at ids", vjp_doc="-, embedding(g, ids)")


def embedding(table, ids) -> Tensor:
    """Gather rows: ``table[ids]`` for an integer `ids` tensor of any shape."""
    return apply("embedding", (table, ids))


def _infer_one_hot(inputs, attrs):
    (ids,) = inputs
    _require_int(ids)
    return ids.shape + (attrs["depth"],), np.dtype(attrs["dtype"])


register("one_hot", _infer_one_hot, differentiable=False, doc="one-hot rows of ids",
         vjp_doc="not differentiable")


def one_hot(ids, depth: int, dtype="float32") -> Tensor:
    """``eye(depth)[ids]``."""
    return apply("one_hot", (ids,), depth=int(depth), dtype=np.dtype(dtype).str)


# ================================================================================================
# fused NN ops, each with its own backward op and a decomposition
# ================================================================================================

# --- softmax / log_softmax -------------------------------------------------------------------------
def _infer_axis_op(inputs, attrs):
    x = inputs[0]
    _require_float(x)
    for t in inputs[1:]:
        if t.shape != x.shape:
            raise ShapeError(f"shapes differ: {fmt_shape(x.shape)} and {fmt_shape(t.shape)}")
    return x.shape, _same_dtype(inputs)


def _softmax_decompose(x, axis):
    e = exp(x - max(x, axis, keepdims=True))
    return e / sum(e, axis, keepdims=True)


def _log_softmax_decompose(x, axis):
    s = x - max(x, axis, keepdims=True)
    return s - log(sum(exp(s), axis, keepdims=True))


register("softmax", _infer_axis_op, decompose=_softmax_decompose,
         vjp=lambda y, g: [apply("softmax_backward", (y, g), axis=y.attrs["axis"])],
         doc="e / sum(e) along an axis, e = exp(x - max(x))", vjp_doc="softmax_backward(y, g)")
register("softmax_backward", _infer_axis_op,
         decompose=lambda y, g, axis: y * (g - sum(g * y, axis, keepdims=True)),
         doc="y*(g - sum(g*y))", vjp_doc="through its decomposition")
register("log_softmax", _infer_axis_op, decompose=_log_softmax_decompose,
         vjp=lambda y, g: [apply("log_softmax_backward", (y, g), axis=y.attrs["axis"])],
         doc="s - log(sum(exp(s))) along an axis, s = x - max(x)", vjp_doc="log_softmax_backward(y, g)")
register("log_softmax_backward", _infer_axis_op,
         decompose=lambda y, g, axis: g - exp(y) * sum(g, axis, keepdims=True),
         doc="g - exp(y)*sum(g)", vjp_doc="through its decomposition")


def softmax(x, axis: int = -1) -> Tensor:
    """Softmax along `axis`."""
    return apply("softmax", (x,), axis=_axis_attr(x, axis, "softmax"))


def log_softmax(x, axis: int = -1) -> Tensor:
    """log(softmax(x)) along `axis`, computed stably."""
    return apply("log_softmax", (x,), axis=_axis_attr(x, axis, "log_softmax"))


def _axis_attr(x, axis, op):
    try:
        (a,) = normalize_axes(axis, x.ndim)
    except ShapeError as e:
        raise ShapeError(f"{op} in {x.graph.current_scope or '<root>'}: {e} (shape {fmt_shape(x.shape)})") from None
    return a


# --- layer_norm / rms_norm -------------------------------------------------------------------------
def norm_parts(inputs, attrs):
    """Split a norm node's inputs (tensors, or the arrays an executor holds for them) into
    (x, weight|None, bias|None, rest) by its has_weight/has_bias attrs."""
    x, k = inputs[0], 1
    w = b = None
    if attrs.get("has_weight"):
        w, k = inputs[k], k + 1
    if attrs.get("has_bias"):
        b, k = inputs[k], k + 1
    return x, w, b, inputs[k:]


def _infer_norm(inputs, attrs):
    x, w, b, rest = norm_parts(inputs, attrs)
    _require_float(x)
    if x.ndim == 0:
        raise ShapeError("needs at least 1-d input, got a scalar")
    for what, t in (("weight", w), ("bias", b)):
        if t is not None and t.shape != (x.shape[-1],):
            raise ShapeError(f"{what} {fmt_shape(t.shape)} does not match the last axis of {fmt_shape(x.shape)}")
    for t in rest:
        if t.shape != x.shape:
            raise ShapeError(f"cotangent {fmt_shape(t.shape)} does not match input {fmt_shape(x.shape)}")
    return x.shape, _same_dtype([t for t in inputs if t is not None])


def _lead_axes(x):
    return tuple(range(x.ndim - 1))


def _layer_norm_decompose(*inputs, eps, has_weight, has_bias):
    x, w, b, _ = norm_parts(inputs, dict(has_weight=has_weight, has_bias=has_bias))
    xc = x - mean(x, -1, keepdims=True)
    y = xc / sqrt(mean(xc * xc, -1, keepdims=True) + eps)   # the order every executor follows
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def _layer_norm_backward_decompose(*inputs, eps, has_weight, has_bias=False):
    x, w, _, (g,) = norm_parts(inputs, dict(has_weight=has_weight))
    xc = x - mean(x, -1, keepdims=True)
    return _layer_norm_backward_from(xc, rsqrt(mean(square(xc), -1, keepdims=True) + eps), g, w)


def _layer_norm_backward_from(xc, r, g, w):
    """dx of layer_norm from xc = x - mean(x) and r = 1/sqrt(var + eps)."""
    xhat = xc * r
    gh = g * w if w is not None else g
    return r * (gh - mean(gh, -1, keepdims=True) - xhat * mean(gh * xhat, -1, keepdims=True))


def _layer_norm_vjp(y, g):
    x, w, b, _ = norm_parts(y.inputs, y.attrs)
    eps = y.attrs["eps"]
    dx = apply("layer_norm_backward", (x,) + ((w,) if w is not None else ()) + (g,),
               eps=eps, has_weight=w is not None)
    grads = [dx]
    if w is not None:
        xhat = layer_norm(x, eps=eps)
        grads.append(sum(g * xhat, _lead_axes(x)))
    if b is not None:
        grads.append(sum(g, _lead_axes(x)))
    return grads


register("layer_norm", _infer_norm, decompose=_layer_norm_decompose, vjp=_layer_norm_vjp,
         doc="xc / sqrt(mean(xc*xc) + eps) * w + b over the last axis, xc = x - mean(x)",
         vjp_doc="layer_norm_backward(x, w, g); sum(g*xhat); sum(g)")
register("layer_norm_backward", _infer_norm, decompose=_layer_norm_backward_decompose,
         doc="dx of layer_norm: r*((gh - mean(gh)) - xhat*mean(gh*xhat)), r = 1/sqrt(mean(xc*xc) + eps), "
             "xhat = xc*r, gh = g*w", vjp_doc="through its decomposition")


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Layer normalization over the last axis, then ``* weight + bias`` when given."""
    inputs = (x,) + tuple(t for t in (weight, bias) if t is not None)
    return apply("layer_norm", inputs, eps=float(eps), has_weight=weight is not None,
                 has_bias=bias is not None)


def _rms_norm_decompose(*inputs, eps, has_weight, has_bias=False):
    x, w, _, _ = norm_parts(inputs, dict(has_weight=has_weight))
    y = x / sqrt(mean(square(x), -1, keepdims=True) + eps)   # a division, as layer_norm's
    return y * w if w is not None else y


def _rms_norm_backward_decompose(*inputs, eps, has_weight, has_bias=False):
    x, w, _, (g,) = norm_parts(inputs, dict(has_weight=has_weight))
    r = rsqrt(mean(square(x), -1, keepdims=True) + eps)
    gh = g * w if w is not None else g
    return r * gh - x * (r * r * r) * mean(gh * x, -1, keepdims=True)


def _rms_norm_vjp(y, g):
    x, w, _, _ = norm_parts(y.inputs, y.attrs)
    eps = y.attrs["eps"]
    dx = apply("rms_norm_backward", (x,) + ((w,) if w is not None else ()) + (g,),
               eps=eps, has_weight=w is not None)
    if w is None:
        return [dx]
    return [dx, sum(g * rms_norm(x, eps=eps), _lead_axes(x))]


register("rms_norm", _infer_norm, decompose=_rms_norm_decompose, vjp=_rms_norm_vjp,
         doc="x / sqrt(mean(x*x) + eps) * w over the last axis",
         vjp_doc="rms_norm_backward(x, w, g); sum(g*x/rms)")
register("rms_norm_backward", _infer_norm, decompose=_rms_norm_backward_decompose,
         doc="dx of rms_norm: r*gh - (x*(r*r*r))*mean(gh*x), r = 1/sqrt(mean(x*x) + eps), gh = g*w",
         vjp_doc="through its decomposition")


def rms_norm(x, weight=None, eps: float = 1e-6) -> Tensor:
    """RMS normalization over the last axis: ``x / sqrt(mean(x*x) + eps) * weight``."""
    inputs = (x,) + ((weight,) if weight is not None else ())
    return apply("rms_norm", inputs, eps=float(eps), has_weight=weight is not None)


# --- cross_entropy ---------------------------------------------------------------------------------
def _infer_cross_entropy(inputs, attrs):
    logits, targets = inputs[:2]
    _require_float(logits, "logits")
    _require_int(targets, "targets")
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ShapeError(f"expects logits [N,V] and targets [N], got {fmt_shape(logits.shape)} "
                         f"and {fmt_shape(targets.shape)}")
    if len(inputs) == 3:  # the backward op: (logits, targets, g) -> dlogits
        return logits.shape, _same_dtype([logits, inputs[2]])
    return (), logits.dtype


def _cross_entropy_decompose(logits, targets):
    # mean over rows of lse - logits[target], lse = log(sum(exp(logits - m))) + m, m = the row max
    n, v = logits.shape
    m = max(logits, 1, keepdims=True)
    lse = log(sum(exp(logits - m), 1)) + reshape(m, (n,))
    picked = sum(where(one_hot(targets, v, np.bool_), logits, 0.0), 1)   # one term per row: exact
    return mean(lse - picked)


def _cross_entropy_backward_decompose(logits, targets, g):
    n, v = logits.shape
    return (softmax(logits, -1) - one_hot(targets, v, logits.dtype)) * (g / n)


register("cross_entropy", _infer_cross_entropy, decompose=_cross_entropy_decompose,
         vjp=lambda y, g: [apply("cross_entropy_backward", (y.inputs[0], y.inputs[1], g)), None],
         doc="mean over rows of lse - logits[target], lse = log(sum(exp(logits - m))) + m, "
             "m = the row max",
         vjp_doc="cross_entropy_backward(logits, targets, g) = (softmax - onehot)*g/N")
register("cross_entropy_backward", _infer_cross_entropy, decompose=_cross_entropy_backward_decompose,
         doc="(softmax(logits) - onehot(targets)) * (g / N)", vjp_doc="through its decomposition")


def cross_entropy(logits, targets) -> Tensor:
    """Mean cross-entropy of `logits` [N,V] against integer `targets` [N] (a scalar)."""
    return apply("cross_entropy", (logits, targets))


# --- causal_mask -----------------------------------------------------------------------------------
def _infer_causal_mask(inputs, attrs):
    (x,) = inputs
    if x.ndim < 2:
        raise ShapeError(f"needs at least 2-d scores, got {fmt_shape(x.shape)}")
    return x.shape, x.dtype


def _causal_mask_decompose(x, fill, offset):
    t, s = x.shape[-2:]
    keep = np.tril(np.ones((t, s), dtype=bool), k=offset)
    return where(x.graph.const(keep), x, lift(fill, x))


register("causal_mask", _infer_causal_mask, decompose=_causal_mask_decompose,
         elementwise=False,
         vjp=lambda y, g: [apply("causal_mask", (g,), fill=0.0, offset=y.attrs["offset"])],
         doc="fill entries above the diagonal (j > i + offset) of the last two axes",
         vjp_doc="causal_mask(g, fill=0)")


def causal_mask(scores, fill: float = -math.inf, offset: int = 0) -> Tensor:
    """Fill ``scores[..., i, j]`` with `fill` (-inf) where ``j > i + offset``."""
    return apply("causal_mask", (scores,), fill=float(fill), offset=int(offset))


# --- causal_attention ------------------------------------------------------------------------------
# Fused causal self-attention, as ggml's flash_attn_ext and torch's scaled_dot_product_attention
# (is_causal=True): one node instead of matmul, scale, mask, softmax, matmul. Executors can then
# skip the masked scores (the numpy kernel works in query blocks, see
# docs/architecture.md); the decomposition below is the definition.
def _infer_attention(inputs, attrs):
    q, k, v = inputs[:3]
    for name, t in zip(("q", "k", "v"), (q, k, v)):
        _require_float(t, name)
    if not (q.shape == k.shape == v.shape):
        raise ShapeError(f"q, k and v must have one shape [..., T, D], got {fmt_shape(q.shape)}, "
                         f"{fmt_shape(k.shape)} and {fmt_shape(v.shape)}")
    if q.ndim < 2 or q.shape[-2] == 0:
        raise ShapeError(f"q, k and v must be [..., T, D] with T >= 1, got {fmt_shape(q.shape)}")
    for name, t in zip(("output", "output gradient"), inputs[3:]):
        if t.shape != q.shape:
            raise ShapeError(f"{name} {fmt_shape(t.shape)} must have the shape of q {fmt_shape(q.shape)}")
    return q.shape, _same_dtype(inputs)


# `heads_merged` (an attribute of the four causal attention ops, set by
# graphlm/passes/merged_heads.py): the node stores its [..., H, T, D] result (each of dq, dk, dv)
# with the heads' axis after T, [..., T, H, D], the layout a block's output projection reads as
# [..., T, H * D] (so the heads' merge, and the QKV gradient's assembly, are views). The values
# are the same; only where they lie changes.
def heads_merged_shape(shape) -> tuple[int, ...]:
    """[..., H, T, D] -> [..., T, H, D]: where a `heads_merged` attention stores a result of `shape`."""
    shape = tuple(shape)
    return shape[:-3] + (shape[-2], shape[-3], shape[-1])


def heads_merged_swap(x: np.ndarray, attrs) -> np.ndarray:
    """For a node with `attrs`: its [..., H, T, D] results `x` as it stores them, or the array it
    stores as its [..., H, T, D] view (the same swap both ways); `x` itself where not heads_merged."""
    return np.swapaxes(x, -3, -2) if attrs.get("heads_merged") else x


def _heads_merged(x):
    return swapaxes(x, -3, -2)


def _infer_attention_out(inputs, attrs):
    shape, dtype = _infer_attention(inputs, attrs)
    if not attrs.get("heads_merged"):
        return shape, dtype
    if len(shape) < 3:
        raise ShapeError(f"heads_merged attention needs q [..., H, T, D], got {fmt_shape(shape)}")
    return heads_merged_shape(shape), dtype


def _infer_attention_backward(inputs, attrs):
    _, dtype = _infer_attention(inputs, attrs)
    return (3,) + _infer_attention_out(inputs[:3], attrs)[0], dtype


def _attention_decompose(q, k, v, scale, heads_merged=False):
    y = _attention_probs(q, k, scale) @ v
    return _heads_merged(y) if heads_merged else y


def _attention_probs(q, k, scale):
    return softmax(causal_mask((q @ swapaxes(k, -1, -2)) * scale), -1)


def _attention_backward_from(p, q, k, v, o, g, scale):
    """[dq, dk, dv] stacked from the probabilities p: dS = P*(g @ v^T - rowsum(g*o)) * scale
    (rowsum(g*o) = rowsum(P*dP))."""
    ds = p * (g @ swapaxes(v, -1, -2) - sum(g * o, -1, keepdims=True)) * scale
    grads = (ds @ k, swapaxes(ds, -1, -2) @ q, swapaxes(p, -1, -2) @ g)
    return concat([reshape(d, (1,) + q.shape) for d in grads], axis=0)


def _attention_backward_decompose(q, k, v, o, g, scale, heads_merged=False):
    grads = _attention_backward_from(_attention_probs(q, k, scale), q, k, v, o, g, scale)
    return _heads_merged(grads) if heads_merged else grads


def _attention_vjp(y, g):
    (q, k, v), scale = y.inputs, y.attrs["scale"]
    if y.attrs.get("heads_merged"):   # the [..., H, T, D] output and its gradient
        y, g = _heads_merged(y), _heads_merged(g)
    packed = apply("causal_attention_backward", (q, k, v, y, g), scale=scale)
    return [packed[0], packed[1], packed[2]]


register("causal_attention", _infer_attention_out, vjp=_attention_vjp,
         decompose=_attention_decompose,
         doc="softmax(causal_mask(q @ k^T * scale)) @ v over the last two axes (heads_merged: "
             "stored [..., T, H, D])",
         vjp_doc="causal_attention_backward(q, k, v, y, g) -> [dq, dk, dv]")
register("causal_attention_backward", _infer_attention_backward, decompose=_attention_backward_decompose,
         doc="[dq, dk, dv] of causal_attention, stacked on a new first axis (heads_merged: each "
             "stored [..., T, H, D])",
         vjp_doc="through its decomposition")


def attention_scale(q: Tensor, scale: float | None) -> float:
    """`scale`, or by default ``1/sqrt(D)`` for queries `q` ``[..., D]`` (1 where D is 0)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape and q.shape[-1] else 1.0
    return float(scale)


def causal_attention(q, k, v, scale: float | None = None) -> Tensor:
    """Causal self-attention ``softmax(causal_mask(q @ k^T * scale)) @ v`` on ``[..., T, D]``
    queries, keys and values of one shape; query i attends to keys j <= i. `scale` defaults to
    ``1/sqrt(D)``."""
    return apply("causal_attention", (q, k, v), scale=attention_scale(q, scale))


# --- causal_attention_keep / causal_attention_backward_kept: attention keeps E and l ---------------
# What a causal attention keeps for its backward (made by graphlm/passes/kept_values.py): the
# unnormalised scores E = exp(s - rowmax(s)) of s = causal_mask(q @ k^T * scale) and their row
# sums l, so P = E / l. E is kept in query blocks of about `query_block` rows (an attribute;
# ATTENTION_QUERY_BLOCK by default): block [r0, r1) holds the rows r0..r1-1 and the keys [0, r1)
# only, so the scores above the block diagonal are never stored; the blocks lie one after the
# other, each block of all the [..., T, D] matrices one C-ordered [..., r1 - r0, r1] array (the
# layout the numpy executor's blocked kernel computes them in, executors/numpy/attention.py).
ATTENTION_QUERY_BLOCK = 64


def attention_query_blocks(t: int, query_block: int | None = None) -> list[tuple[int, int]]:
    """The query blocks [r0, r1) of T rows: round(T / query_block) blocks (at least one) as even
    as possible (`query_block` defaults to ATTENTION_QUERY_BLOCK, read at each call)."""
    n = _pymax(1, round(t / (query_block or ATTENTION_QUERY_BLOCK)))
    bounds = sorted({t * i // n for i in range(n + 1)})
    return list(zip(bounds[:-1], bounds[1:]))


def attention_score_size(t: int, query_block: int | None = None) -> int:
    """Score elements kept per matrix: those of the query blocks on and below the diagonal."""
    return _pysum((r1 - r0) * r1 for r0, r1 in attention_query_blocks(t, query_block))


def causal_attention_keep_layout(shape, query_block: int | None = None,
                                 heads_merged: bool = False) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """The parts of causal_attention_keep's flat output for q of `shape` [..., T, D], in order:
    (name, start, stop, shape) of y [..., T, D] ([..., T, H, D] where `heads_merged`), E (flat,
    the query blocks one after the other) and l [..., T, 1]."""
    shape = tuple(shape)
    lead, t = shape[:-2], shape[-2]
    m = int(np.prod(lead, dtype=np.int64))
    n, e = m * t * shape[-1], m * attention_score_size(t, query_block)
    y_shape = heads_merged_shape(shape) if heads_merged else shape
    return [("y", 0, n, y_shape), ("e", n, n + e, (e,)), ("l", n + e, n + e + m * t, lead + (t, 1))]


def _attention_kept_scores(q, k, scale):
    """E = exp(s - rowmax(s)) of the masked scores s, every pair (the masked ones 0), and l."""
    s = causal_mask((q @ swapaxes(k, -1, -2)) * scale)
    e = exp(s - max(s, -1, keepdims=True))
    return e, sum(e, -1, keepdims=True)


def _attention_keep_decompose(q, k, v, scale, query_block, heads_merged=False):
    e, l = _attention_kept_scores(q, k, scale)
    lead = (_pyslice(None),) * (q.ndim - 2)
    blocks = [reshape(slice(e, lead + (_pyslice(r0, r1), _pyslice(0, r1))), (-1,))
              for r0, r1 in attention_query_blocks(q.shape[-2], query_block)]
    y = (e / l) @ v
    return concat([reshape(_heads_merged(y) if heads_merged else y, (-1,)), *blocks, reshape(l, (-1,))], 0)


def _attention_probs_from_kept(e, l, shape, query_block):
    """P = E / l [..., T, T] from the kept blocks of E (zeros right of each block's keys)."""
    lead, t = tuple(shape[:-2]), shape[-2]
    rows, at = [], 0
    for r0, r1 in attention_query_blocks(t, query_block):
        size = int(np.prod(lead, dtype=np.int64)) * (r1 - r0) * r1
        block = reshape(slice(e, (_pyslice(at, at + size),)), lead + (r1 - r0, r1))
        if r1 < t:
            block = concat([block, broadcast_to(lift(0.0, e), lead + (r1 - r0, t - r1))], -1)
        rows.append(block)
        at += size
    return (concat(rows, -2) if len(rows) > 1 else rows[0]) / l


def _attention_backward_kept_decompose(q, k, v, o, e, l, g, scale, query_block, heads_merged=False):
    grads = _attention_backward_from(_attention_probs_from_kept(e, l, q.shape, query_block), q, k, v, o, g, scale)
    return _heads_merged(grads) if heads_merged else grads


def _infer_attention_keep(inputs, attrs):
    _, dtype = _infer_attention_out(inputs, attrs)   # (checks heads_merged's q)
    return (causal_attention_keep_layout(inputs[0].shape, attrs["query_block"])[-1][2],), dtype


def _infer_attention_backward_kept(inputs, attrs):
    q, k, v, o, e, l, g = inputs
    shape, dtype = _infer_attention_backward([q, k, v, o, g], attrs)
    _, (_, _, _, e_shape), (_, _, _, l_shape) = causal_attention_keep_layout(q.shape, attrs["query_block"])
    for name, t, want in (("kept scores E", e, e_shape), ("kept row sums l", l, l_shape)):
        if t.shape != want:
            raise ShapeError(f"{name} {fmt_shape(t.shape)} must be {fmt_shape(want)} for q {fmt_shape(q.shape)} "
                             f"in query blocks of {attrs['query_block']}")
    return shape, _same_dtype(inputs)


register("causal_attention_keep", _infer_attention_keep, decompose=_attention_keep_decompose,
         doc="causal_attention(q, k, v) with what its backward reads, flat: [y, E = exp(s - rowmax) "
             "in query blocks, l = rowsum(E)] (causal_attention_keep_layout; each part a view; "
             "heads_merged: y stored [..., T, H, D])",
         vjp_doc="through its decomposition")
register("causal_attention_backward_kept", _infer_attention_backward_kept,
         decompose=_attention_backward_kept_decompose,
         doc="causal_attention_backward(q, k, v, o, g) from the kept E and l (P = E / l): [dq, dk, dv] "
             "(heads_merged: each stored [..., T, H, D])",
         vjp_doc="through its decomposition")


# --- cached_attention: one decode step's attention against a KV cache ---------------------------
# The query of one new token per row ([..., 1, D]) against the `position` cached keys and values
# in use ([..., T, D] caches, positions 0..position-1) and its own new key and value, one softmax
# over both, as ggml's flash_attn_ext reads a KV cache: one node instead of about ten. The
# decomposition below is the definition and the arithmetic order (it reads all T cached slots,
# those at or past `position` masked to -inf, so its sums run over T + 1 terms); a kernel may read
# only the slots in use, which sums fewer terms and so rounds its own way (executors say so). The
# caches are read as they are before the step: the new key and value reach them through the
# cache_write nodes, which run after every other node. `position` is a scalar integer tensor in
# [0, T); a kernel checks it when it runs (the decomposition would treat a position >= T as a
# full cache, and the cache_write of the same step refuses it).
def _infer_cached_attention(inputs, attrs):
    q, k, v, cache_k, cache_v, position = inputs
    for name, t in zip(("q", "k", "v", "cache_k", "cache_v"), inputs[:5]):
        _require_float(t, name)
    if not (q.shape == k.shape == v.shape) or q.ndim < 2 or q.shape[-2] != 1:
        raise ShapeError(f"q, k and v must have one shape [..., 1, D] (one new token per row), got "
                         f"{fmt_shape(q.shape)}, {fmt_shape(k.shape)} and {fmt_shape(v.shape)}")
    if cache_k.shape != cache_v.shape or cache_k.shape[:-2] != q.shape[:-2] \
            or cache_k.shape[-1:] != q.shape[-1:] or cache_k.shape[-2] < 1:
        raise ShapeError(f"the caches must both be [..., T, D] with T >= 1 and q's leading axes and D "
                         f"(q {fmt_shape(q.shape)}), got cache_k {fmt_shape(cache_k.shape)} and cache_v "
                         f"{fmt_shape(cache_v.shape)}")
    _scalar_input(position, "position", "iu")
    return q.shape, _same_dtype(inputs[:5])


def cached_positions_mask(position: Tensor, capacity: int, like: Tensor) -> Tensor:
    """``[capacity]`` of `like`'s dtype: 0 where a cached position j < position, -inf elsewhere."""
    slots = position.graph.const(np.arange(capacity, dtype=position.dtype))
    return where(less(slots, position), lift(0.0, like), -math.inf)


def _cached_attention_decompose(q, k, v, cache_k, cache_v, position, scale):
    t = cache_k.shape[-2]
    s_cache = (q @ swapaxes(cache_k, -1, -2)) * scale + cached_positions_mask(position, t, q)   # [..., 1, T]
    s_self = sum(q * k, axis=-1, keepdims=True) * scale                                       # [..., 1, 1]
    p = softmax(concat([s_cache, s_self], axis=-1), -1)                                       # [..., 1, T+1]
    return p[..., :t] @ cache_v + p[..., t:] * v


register("cached_attention", _infer_cached_attention, decompose=_cached_attention_decompose,
         doc="one decode step: softmax([q @ cache_k^T * scale + mask(j < position), sum(q*k) * scale]) "
             "@ [cache_v; v], q, k, v [..., 1, D], caches [..., T, D]",
         vjp_doc="through its decomposition")


def cached_attention(q, k, v, cache_k, cache_v, position, scale: float | None = None) -> Tensor:
    """The attention of one new token per row (``q, k, v [..., 1, D]``) against the keys and
    values cached at positions ``< position`` (``cache_k, cache_v [..., T, D]``, `position` a
    scalar integer tensor in [0, T)) and against its own key and value: one softmax over the
    ``position + 1`` scores. `scale` defaults to ``1/sqrt(D)``. -> ``[..., 1, D]``."""
    return apply("cached_attention", (q, k, v, cache_k, cache_v, position), scale=attention_scale(q, scale))


# --- dropout ---------------------------------------------------------------------------------------
def _infer_dropout(inputs, attrs):
    x, key = inputs
    _require_float(x)
    _require_int(key, "dropout key")
    if key.shape != ():
        raise ShapeError(f"dropout key must be a scalar integer tensor, got {fmt_shape(key.shape)}")
    if not 0.0 <= attrs["p"] < 1.0:
        raise ShapeError(f"dropout probability must be in [0, 1), got {attrs['p']}")
    return x.shape, x.dtype


def _infer_dropout_mask(inputs, attrs):
    (key,) = inputs
    _require_int(key, "dropout key")
    return tuple(attrs["shape"]), np.dtype(attrs["dtype"])


register("dropout", _infer_dropout, elementwise=False,
         decompose=lambda x, key, p, stream: x * apply("dropout_mask", (key,), p=p, stream=stream,
                                                       shape=x.shape, dtype=x.dtype.str),
         vjp=lambda y, g: [apply("dropout", (g, y.inputs[1]), **y.attrs), None],
         doc="x * (keep * (1/(1-p))) (1/(1-p) rounded once to x's dtype); keep drawn from a "
             "counter-based RNG keyed by (key, stream)",
         vjp_doc="dropout(g) with the same key and stream (the same mask)")
register("dropout_mask", _infer_dropout_mask, differentiable=False,
         doc="keep * (1/(1-p)) for each element, from (key, stream, element index)",
         vjp_doc="not differentiable")


def dropout(x, p: float, key, stream: int | None = None) -> Tensor:
    """Inverted dropout with a mask from graphlm.random.counter_uniform(key, stream, index).

    `key` is a scalar integer tensor (an input or state: feed a new one per step). Each dropout
    node gets its own `stream` (by default the graph's count of dropout calls so far), so two
    dropouts with one key draw different masks. p = 0 returns `x` unchanged.
    """
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ShapeError(f"dropout in {x.graph.current_scope or '<root>'}: probability must be in [0, 1), got {p}")
    if p == 0.0:
        return x
    if stream is None:
        stream = x.graph.next_counter("dropout")
    return apply("dropout", (x, key), p=p, stream=int(stream))


# ================================================================================================
# optimizer ops (graphlm.optim builds them): the global gradient norm and in-place updates
# ================================================================================================
# An update op writes params and optimizer state in place (updates_state=True, attrs["writes"]
# lists the input indices it writes); programs run update ops after every other node. Each
# update op covers a whole group of parameters in one node (as torch's "foreach"/fused
# optimizers do), so an executor may run it as a few passes over one flat buffer when the
# params, moments and grads are laid out contiguously. Its output is a float32 scalar token
# (0.0) that only says "the update ran": compile it as an output to run the update.
#
# The arithmetic order every executor follows (each product and sum rounded on its own, in the
# param's dtype; the per-step scalars lr/(1-b1^t), sqrt(1-b2^t) and 1-lr*wd computed in float64
# from the float32 lr, then rounded once to the param's dtype):
#   global_norm:  sqrt(total), total = ((0 + dot(g1, g1)) + dot(g2, g2)) + ... in input order
#   adamw_update: g = grad*clip_coef;  p = p*(1 - lr*wd);  m = m*b1 + (1-b1)*g;
#                 v = v*b2 + ((1-b2)*g)*g;  p = p - ((lr/(1-b1^t))*m) / (sqrt(v)/sqrt(1-b2^t) + eps)
#   sgd_update:   d = grad*clip_coef + wd*p;  buf = buf*mu + d (momentum);  p = p - lr*d (or lr*buf)

def _infer_global_norm(inputs, attrs):
    if not inputs:
        raise ShapeError("needs at least one gradient")
    for t in inputs:
        _require_float(t, "gradient")
    return (), _same_dtype(inputs)


register("global_norm", _infer_global_norm, differentiable=False,
         doc="sqrt(sum of squares of every element of every input): the global L2 norm, one dot "
             "per input added in input order",
         vjp_doc="not differentiable (used for gradient clipping)")


def global_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of all elements of all `tensors` together (a scalar)."""
    return apply("global_norm", tuple(tensors))


def _scalar_input(t: Tensor, what: str, kinds: str):
    if t.shape != () or t.dtype.kind not in kinds:
        raise ShapeError(f"{what} must be a scalar {'float' if kinds == 'f' else 'integer'} tensor, "
                         f"got {t.dtype} {fmt_shape(t.shape)}")


def _infer_update_groups(inputs, attrs, n_head: int, group: int, head_names):
    if len(inputs) <= n_head or (len(inputs) - n_head) % group:
        raise ShapeError(f"expects {n_head} scalars then groups of {group} tensors, got "
                         f"{len(inputs)} inputs")
    for t, (what, kinds) in zip(inputs[:n_head], head_names):
        _scalar_input(t, what, kinds)
    for k in range(n_head, len(inputs), group):
        p = inputs[k]
        if p.op not in ("param", "state"):
            raise ShapeError(f"input {k} ({p.label}) must be a param or state leaf: update ops "
                             "write their targets in place")
        _require_float(p, f"param {p.label}")
        for t in inputs[k + 1:k + group]:
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ShapeError(f"{t.label} {fmt_shape(t.shape)} {t.dtype} does not match param "
                                 f"{p.label} {fmt_shape(p.shape)} {p.dtype}")
        for t in inputs[k + 2:k + group]:
            if t.op != "state":
                raise ShapeError(f"optimizer buffer {t.label} of {p.label} must be a state leaf")
    wd = attrs.get("weight_decay", ())
    if len(wd) != (len(inputs) - n_head) // group:
        raise ShapeError(f"weight_decay has {len(wd)} entries for {(len(inputs) - n_head) // group} params")
    return (), np.dtype(np.float32)


def _infer_adamw_update(inputs, attrs):
    return _infer_update_groups(inputs, attrs, 3, 4, (("lr", "f"), ("step", "iu"), ("clip_coef", "f")))


def _infer_sgd_update(inputs, attrs):
    group = 3 if attrs["momentum"] else 2
    return _infer_update_groups(inputs, attrs, 2, group, (("lr", "f"), ("clip_coef", "f")))


register("adamw_update", _infer_adamw_update, differentiable=False, updates_state=True,
         doc="AdamW for groups (param, grad, m, v): g = grad*clip_coef; p *= 1-lr*wd (decoupled); "
             "m = m*b1 + (1-b1)*g; v = v*b2 + ((1-b2)*g)*g; p -= ((lr/(1-b1^t))*m) / (sqrt(v)/sqrt(1-b2^t) + eps); "
             "writes param, m, v in place",
         vjp_doc="not differentiable")
register("sgd_update", _infer_sgd_update, differentiable=False, updates_state=True,
         doc="SGD for groups (param, grad[, buf]): g = grad*clip_coef + wd*p; with momentum "
             "buf = mu*buf + g, step along buf; writes param (and buf) in place",
         vjp_doc="not differentiable")


def adamw_update(lr, step, clip_coef, groups, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0) -> Tensor:
    """One AdamW step for `groups` = [(param, grad, m, v), ...] as one in-place update node.

    `lr` and `clip_coef` are float32 scalars, `step` the integer step number t >= 1 (all nodes,
    usually inputs fed per step). `weight_decay` is a float or one float per group.
    """
    groups = [tuple(gr) for gr in groups]
    wd = _per_group(weight_decay, len(groups))
    flat = tuple(t for gr in groups for t in gr)
    writes = tuple(3 + 4 * k + j for k in range(len(groups)) for j in (0, 2, 3))
    return apply("adamw_update", (lr, step, clip_coef) + flat, beta1=float(betas[0]),
                 beta2=float(betas[1]), eps=float(eps), weight_decay=wd, writes=writes)


def sgd_update(lr, clip_coef, groups, momentum=0.0, weight_decay=0.0) -> Tensor:
    """One SGD step for `groups` = [(param, grad), ...] or [(param, grad, momentum_buffer), ...]."""
    groups = [tuple(gr) for gr in groups]
    size = 3 if momentum else 2
    if any(len(gr) != size for gr in groups):
        raise ShapeError(f"sgd_update: each group must be {size} tensors "
                         f"({'param, grad, buffer' if momentum else 'param, grad'})")
    wd = _per_group(weight_decay, len(groups))
    flat = tuple(t for gr in groups for t in gr)
    writes = tuple(2 + size * k + j for k in range(len(groups)) for j in ((0, 2) if momentum else (0,)))
    return apply("sgd_update", (lr, clip_coef) + flat, momentum=float(momentum), weight_decay=wd,
                 writes=writes)


def _per_group(value, n):
    if isinstance(value, (int, float)):
        return (float(value),) * n
    value = tuple(float(v) for v in value)
    if len(value) != n:
        raise ShapeError(f"weight_decay has {len(value)} entries for {n} params")
    return value


# --- cache_write (the KV cache of graphlm.sample) ----------------------------------------------------
def _infer_cache_write(inputs, attrs):
    cache, value, pos = inputs
    axis = attrs["axis"]
    if cache.op != "state":
        raise ShapeError(f"the cache {cache.label} must be a state leaf (it is written in place)")
    _scalar_input(pos, "position", "iu")
    if not 0 <= axis < cache.ndim or value.ndim != cache.ndim or value.dtype != cache.dtype or \
            any(a != b for i, (a, b) in enumerate(zip(value.shape, cache.shape)) if i != axis) or \
            value.shape[axis] > cache.shape[axis]:
        raise ShapeError(f"cannot write {fmt_shape(value.shape)} {value.dtype} into cache "
                         f"{fmt_shape(cache.shape)} {cache.dtype} along axis {axis}")
    return (), np.dtype(np.float32)


register("cache_write", _infer_cache_write, differentiable=False, updates_state=True,
         doc="cache[..., pos:pos+L, ...] = value along `axis`, in place (KV caches); "
             "a scalar token out",
         vjp_doc="not differentiable")


def cache_write(cache, value, pos, axis: int) -> Tensor:
    """Write `value` into the state `cache` at position `pos` (a scalar integer tensor) along
    `axis`, in place. Runs after every other node of the program (an update op)."""
    axis = int(axis) % cache.ndim
    return apply("cache_write", (cache, value, pos), axis=axis, writes=(0,))


# ================================================================================================
# ops the graph passes produce (graphlm/passes): each is its decomposition computed in one node
# ================================================================================================
# Model code does not build these; a pass (graphlm/passes) rewrites a pattern of the ops above
# into one of them. The reference executor runs them (so a rewritten graph runs everywhere),
# their decomposition is the pattern they replace (tests check both agree) and, with no VJP of
# their own, they are differentiated through it. A node a pass made carries the pass's name in
# attrs["made_by"] (`op_attrs` leaves it out).

PASS_ATTRS = ("made_by", "kept")   # added by passes: the pass's name; True on a kept value


def op_attrs(node: Tensor) -> dict:
    """A node's op attributes without what a pass adds to them (PASS_ATTRS)."""
    return {k: v for k, v in node.attrs.items() if k not in PASS_ATTRS}


# --- matmul_sum: sum(matmul(a, b), batch axes) as one product over the folded axes ---------------
def _infer_matmul_sum(inputs, attrs):
    shape, dtype = _infer_matmul(inputs, attrs)
    if not attrs["axes"] or any(a >= len(shape) - 2 for a in attrs["axes"]):
        raise ShapeError(f"matmul_sum sums batch axes only, got axes {attrs['axes']} of {fmt_shape(shape)}")
    return _reduced_shape(shape, attrs["axes"], attrs["keepdims"]), dtype


def matmul_sum_folding(a, b, axes):
    """The arithmetic of matmul_sum on arrays (every executor follows it): a and b broadcast to
    their common batch, transposed so that the summed batch axes sit beside the contraction axis;
    then ``sum(a @ b, axes) = A' @ B'`` with A' = reshape(pa, (..., m, S*k)) and B' =
    reshape(pb, (..., S*k, n)). Returns (pa, A' shape, pb, B' shape, the product's shape)."""
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    nb = len(batch)
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    rest = [i for i in range(nb) if i not in axes]
    summed = [i for i in range(nb) if i in axes]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    s = int(np.prod([batch[i] for i in summed], dtype=np.int64))
    rest_shape = tuple(batch[i] for i in rest)
    return (a.transpose(rest + [nb] + summed + [nb + 1]), rest_shape + (m, s * k),
            b.transpose(rest + summed + [nb, nb + 1]), rest_shape + (s * k, n), rest_shape + (m, n))


register("matmul_sum", _infer_matmul_sum, rounds_like_decomposition=False,
         decompose=lambda a, b, axes, keepdims: sum(matmul(a, b), axes, keepdims),
         doc="sum(a @ b) over batch axes, as one product with the summed axes folded into the "
             "contraction (a weight gradient; rounds as that one product)",
         vjp_doc="through its decomposition")


# --- matmul_accumulate: the batched products of a sum added up in order ------------------------------
# sum(a @ b, axis 0) where the axis does not fold into the contraction as a view (matmul_sum): the
# input gradient of the fused QKV product, sum over q, k, v of dqkv[j] @ W[j]^T. Each product rounds
# as that product alone and is added to the ones before it in order, as the sum of the stored
# products does; the native executor has its BLAS add each product into the output (a GEMM's
# beta = 1), so the [S, m, n] products are never stored (graphlm/passes/matmul_accumulate.py).
def _infer_matmul_accumulate(inputs, attrs):
    shape, dtype = _infer_matmul(inputs, attrs)
    if len(shape) != 3 or tuple(attrs["axes"]) != (0,):
        raise ShapeError(f"matmul_accumulate sums the batch axis of a 3-D product, got axes {attrs['axes']} "
                         f"of {fmt_shape(shape)}")
    return _reduced_shape(shape, attrs["axes"], attrs["keepdims"]), dtype


register("matmul_accumulate", _infer_matmul_accumulate,
         decompose=lambda a, b, axes, keepdims: sum(matmul(a, b), axes, keepdims),
         doc="sum(a @ b) over the batch axis of a 3-D product, the products added in order (the "
             "decomposition's rounding; the native executor accumulates them in its output)",
         vjp_doc="through its decomposition")


# --- panel_matmul: x @ B (+ bias), B held in column panels -------------------------------------
# B [..., k, n] stored as panels [..., C, k, W]: panel c holds B's columns [cW, cW + W) as k rows of
# W floats one after the other, the last one zero-padded past column n (`to_panels`). A product
# reads each panel straight through memory where B's own rows sit n floats apart; the bias (whole
# along the last axis, one row broadcast over the rows) is added as each value is stored. Made
# by the panel_weights pass for programs whose weights stay fixed (graphlm/passes/panel_weights.py);
# the decomposition is the definition: the panels put back as B, the product, then the add.
def to_panels(b: np.ndarray, width: int) -> np.ndarray:
    """B [..., k, n] as panel_matmul's panels [..., ceil(n / width), k, width] (zero-padded)."""
    *batch, k, n = b.shape
    c = -(-n // width)
    padded = np.zeros((*batch, k, c * width), b.dtype)
    padded[..., :n] = b
    return np.ascontiguousarray(np.swapaxes(padded.reshape(*batch, k, c, width), -3, -2))


def _infer_panel_matmul(inputs, attrs):
    x, panels, *bias = inputs
    n = attrs["columns"]
    if x.ndim < 2 or panels.ndim < 3 or x.shape[-1] != panels.shape[-2]:
        raise ShapeError(f"cannot multiply {fmt_shape(x.shape)} by panels {fmt_shape(panels.shape)} "
                         "(x [..., m, k], panels [..., C, k, W])")
    c, w = panels.shape[-3], panels.shape[-1]
    if not (c - 1) * w < n <= c * w:
        raise ShapeError(f"{c} panels of {w} columns cannot hold {n} columns")
    shape = _product_batch(x, panels.shape[:-3], f"panels {fmt_shape(panels.shape)}") + (x.shape[-2], n)
    if bias and not panel_bias_fits(bias[0].shape, shape):
        raise ShapeError(f"bias {fmt_shape(bias[0].shape)} is not one row of {n} broadcast over "
                         f"the product {fmt_shape(shape)}")
    return shape, _same_dtype(inputs)


def panel_bias_fits(bias_shape, shape) -> bool:
    """Whether a bias of `bias_shape` is what panel_matmul adds to its product of `shape`: one
    row of the product's columns ([..., 1, n] or [n]), broadcast over the product's rows and
    batch without widening it (the panel_weights pass asks it of an add)."""
    bias_shape, shape = tuple(bias_shape), tuple(shape)
    if not bias_shape or bias_shape[-1] != shape[-1] or (len(bias_shape) > 1 and bias_shape[-2] != 1):
        return False
    try:
        return tuple(np.broadcast_shapes(bias_shape, shape)) == shape
    except ValueError:
        return False


def _panel_matmul_decompose(x, panels, *bias, columns):
    *batch, c, k, w = panels.shape
    b = reshape(swapaxes(panels, -3, -2), (*batch, k, c * w))[(Ellipsis, _pyslice(0, columns))]
    y = matmul(x, b)
    return add(y, bias[0]) if bias else y


register("panel_matmul", _infer_panel_matmul, decompose=_panel_matmul_decompose,
         doc="x @ B (+ bias) with B [..., k, n] held as column panels [..., C, k, W] (to_panels)",
         vjp_doc="through its decomposition")


def panel_matmul(x, panels, columns: int, bias=None) -> Tensor:
    """``x @ B (+ bias)`` where `panels` [..., C, k, W] holds B [..., k, columns] in column panels
    (`to_panels`); `bias` [..., 1, columns] or [columns]."""
    return apply("panel_matmul", (x, panels) if bias is None else (x, panels, bias), columns=int(columns))


# --- slices_assemble: disjoint slice gradients written into one array --------------------------
def _window_shape(shape, index) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(d))) for s, d in zip(index, shape) if isinstance(s, _pyslice))


def _infer_slices_assemble(inputs, attrs):
    shape, indexes = tuple(attrs["shape"]), attrs["indexes"]
    if len(indexes) != len(inputs) or not inputs:
        raise ShapeError(f"slices_assemble needs one index per input, got {len(indexes)} for {len(inputs)}")
    for t, index in zip(inputs, indexes):
        if t.size != int(np.prod(_window_shape(shape, index), dtype=np.int64)):
            raise ShapeError(f"input {fmt_shape(t.shape)} does not fill window {fmt_shape(_window_shape(shape, index))}")
    return shape, _same_dtype(inputs)


def _slices_assemble_decompose(*srcs, shape, indexes, covered):
    terms = [apply("slice_backward", (reshape(s, _window_shape(shape, idx)),), in_shape=tuple(shape), index=idx)
             for s, idx in zip(srcs, indexes)]
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


register("slices_assemble", _infer_slices_assemble, decompose=_slices_assemble_decompose,
         doc="zeros of `shape` with each input written into its own (disjoint) window: the "
             "gradient of slices of one array (q, k, v of a fused QKV product)",
         vjp_doc="through its decomposition")


# --- softmax_fused / softmax_backward_fused: attention's scale and causal mask folded in --------
def _scaled_masked(x, c, mask, scale_pos):
    if c is not None:
        x = mul(x, c) if scale_pos == 1 else mul(c, x)
    if mask is not None:
        x = causal_mask(x, fill=mask[0], offset=mask[1])
    return x


def _softmax_fused_decompose(x, *c, mask, scale_pos):
    return softmax(_scaled_masked(x, c[0] if c else None, mask, scale_pos), -1)


def _softmax_backward_fused_decompose(y, g, *c, axis, mask, scale_pos):
    d = apply("softmax_backward", (y, g), axis=axis)
    if mask is not None:
        d = causal_mask(d, fill=mask[0], offset=mask[1])
    if c:
        d = mul(d, c[0]) if scale_pos == 1 else mul(c[0], d)
    return d


def _infer_softmax_fused(inputs, attrs):
    x, scale = inputs[0], inputs[1:]
    _require_float(x)
    if x.ndim < 2:
        raise ShapeError(f"needs at least 2-d scores, got {fmt_shape(x.shape)}")
    if scale and (scale[0].shape != () or scale[0].dtype != x.dtype):
        raise ShapeError(f"the scale must be a {x.dtype} scalar, got {fmt_shape(scale[0].shape)} {scale[0].dtype}")
    return x.shape, x.dtype


def _infer_softmax_backward_fused(inputs, attrs):
    y, g = inputs[:2]
    if y.shape != g.shape:
        raise ShapeError(f"shapes differ: {fmt_shape(y.shape)} and {fmt_shape(g.shape)}")
    return _infer_softmax_fused([y, *inputs[2:]], attrs)


register("softmax_fused", _infer_softmax_fused, decompose=_softmax_fused_decompose,
         doc="softmax over the last axis of causal_mask(x * c): attention's scale (optional "
             "input c) and mask (attrs mask = (fill, offset) or None) folded in",
         vjp_doc="through its decomposition")
register("softmax_backward_fused", _infer_softmax_backward_fused, decompose=_softmax_backward_fused_decompose,
         doc="causal_mask(softmax_backward(y, g), fill=0) * c: softmax_fused's gradient with "
             "respect to x * c, masked and scaled",
         vjp_doc="through its decomposition")


# --- dropout_keep / dropout_apply: one dropout mask, a tensor shared by forward and backward ----
def _infer_dropout_keep(inputs, attrs):
    (key,) = inputs
    _require_int(key, "dropout key")
    if not 0.0 <= attrs["p"] < 1.0:
        raise ShapeError(f"dropout probability must be in [0, 1), got {attrs['p']}")
    return tuple(attrs["shape"]), np.dtype(np.bool_)


def _infer_dropout_apply(inputs, attrs):
    x, keep = inputs
    _require_float(x)
    if keep.dtype != np.bool_ or keep.shape != x.shape:
        raise ShapeError(f"the keep mask must be bool {fmt_shape(x.shape)}, got {fmt_shape(keep.shape)} {keep.dtype}")
    return x.shape, x.dtype


def _dropout_apply_decompose(x, keep, p):
    return mul(mul(x, cast(keep, x.dtype)), lift(1.0 / (1.0 - p), x))


register("dropout_keep", _infer_dropout_keep, differentiable=False,
         doc="the keep mask of dropout(p, key, stream): counter_uniform(key, stream, index) >= "
             "float32(p), as bool",
         vjp_doc="not differentiable")
register("dropout_apply", _infer_dropout_apply, decompose=_dropout_apply_decompose,
         vjp=lambda y, g: [apply("dropout_apply", (g, y.inputs[1]), p=y.attrs["p"]), None],
         doc="(x * keep) * (1/(1-p)): dropout with its mask as an input",
         vjp_doc="dropout_apply(g, keep) (the same mask)")


# --- bias_dropout_add: a residual add of a product's output, its bias added, dropped out ----------
# r + dropout_apply(m + b, keep), b along the last axis: the three ops' roundings in order, so the
# pattern's bits (made by graphlm/passes/bias_dropout_add.py, which says why).
def _infer_bias_dropout_add(inputs, attrs):
    r, m, b, keep = inputs
    _require_float(r)
    if m.shape != r.shape or b.shape != r.shape[-1:] or r.ndim < 1:
        raise ShapeError(f"expects r and m of one shape and b along its last axis, got {fmt_shape(r.shape)}, "
                         f"{fmt_shape(m.shape)} and {fmt_shape(b.shape)}")
    _infer_dropout_apply([m, keep], attrs)
    return r.shape, _same_dtype([r, m, b])


register("bias_dropout_add", _infer_bias_dropout_add,
         decompose=lambda r, m, b, keep, p: add(r, apply("dropout_apply", (add(m, b), keep), p=p)),
         doc="r + dropout_apply(m + b, keep): a residual add of a product's output m with its bias b "
             "along the last axis, dropped out (the three ops' roundings in order)",
         vjp_doc="through its decomposition")


# --- gelu_sigmoid / gelu_backward_sigmoid: the tanh GELU keeps its sigmoid for its backward -----
def _infer_gelu_sigmoid(inputs, attrs):
    (x,) = inputs
    _require_float(x)
    return x.shape, x.dtype


def _infer_gelu_backward_sigmoid(inputs, attrs):
    x, g, s = inputs
    if not x.shape == g.shape == s.shape:
        raise ShapeError(f"shapes differ: {fmt_shape(x.shape)}, {fmt_shape(g.shape)} and {fmt_shape(s.shape)}")
    return x.shape, _same_dtype(inputs)


register("gelu_sigmoid", _infer_gelu_sigmoid, elementwise=True, decompose=_gelu_sigmoid,
         doc="s = sigmoid(2u) of the tanh GELU (gelu(x) = x * s): the value its backward reads",
         vjp_doc="through its decomposition")
register("gelu_backward_sigmoid", _infer_gelu_backward_sigmoid,
         decompose=lambda x, g, s: g * ((1.0 - s) * s * x * (x * x * GELU_DA + GELU_DB) + s),
         doc="gelu_backward(x, g) of the tanh GELU from its kept sigmoid s", vjp_doc="through its decomposition")


# --- affine_grads: the gradients of an affine map's weight and bias in one node -----------------
# y = x * w + b with w and b along the last axis (a layer norm's affine): dw = sum(g * x) and
# db = sum(g) over the leading axes, flat [dw, db] (each part a view); each sum rounds as the `sum`
# op does, so the pattern's bits (made by graphlm/passes/affine_grads.py, which says why). With a
# third input d (one value per row, [..., 1]) x is divided by it where it is read: a layer norm's
# xhat = xc / sv from the kept xc and sv (each quotient rounded as `div` rounds it), so that the
# normalised input is never stored.
def _infer_affine_grads(inputs, attrs):
    g, x, *d = inputs
    _require_float(g, "g")
    if g.shape != x.shape or g.ndim < 2:
        raise ShapeError(f"expects g and x of one shape with at least 2 axes, got {fmt_shape(g.shape)} "
                         f"and {fmt_shape(x.shape)}")
    if len(d) > 1 or (d and d[0].shape != x.shape[:-1] + (1,)):
        raise ShapeError(f"expects at most one divisor d of shape {fmt_shape(x.shape[:-1] + (1,))} (one per row), "
                         f"got {', '.join(fmt_shape(t.shape) for t in d)}")
    return (2 * g.shape[-1],), _same_dtype(inputs)


def _affine_grads_decompose(g, x, d=None):
    xs = x if d is None else x / d
    return concat([sum(g * xs, _lead_axes(x)), sum(g, _lead_axes(x))], 0)


register("affine_grads", _infer_affine_grads, decompose=_affine_grads_decompose,
         doc="[sum(g*x), sum(g)] over the leading axes, flat: an affine map's weight and bias gradients "
             "(each sum the rows in order, as `sum`); with d [..., 1]: x / d in place of x",
         vjp_doc="through its decomposition")


# --- bias_gelu / bias_gelu_backward: an MLP's first bias added where its GELU reads it ------------
# gelu(m + b) with b along the last axis, and its backward gelu_backward(m + b, g) from m and b (m + b
# formed again, one rounding as the add): the pattern's bits (made by graphlm/passes/bias_gelu.py,
# which says why).
def _infer_bias_gelu(inputs, attrs):
    m, b = inputs[:2]
    _require_float(m)
    if b.shape != m.shape[-1:] or m.ndim < 1 or any(t.shape != m.shape for t in inputs[2:]):
        raise ShapeError(f"expects b along the last axis of m{' and g of its shape' if len(inputs) > 2 else ''}, "
                         f"got {', '.join(fmt_shape(t.shape) for t in inputs)}")
    return _infer_gelu([m], attrs)[0], _same_dtype(inputs)


register("bias_gelu", _infer_bias_gelu, decompose=lambda m, b, approximate: gelu(add(m, b), approximate),
         doc="gelu(m + b), b along the last axis: an MLP's first bias added where its GELU reads it",
         vjp_doc="through its decomposition")
register("bias_gelu_backward", _infer_bias_gelu,
         decompose=lambda m, b, g, approximate: apply("gelu_backward", (add(m, b), g), approximate=approximate),
         doc="gelu_backward(m + b, g), b along the last axis: bias_gelu's backward, m + b formed again "
             "where it is read", vjp_doc="through its decomposition")


# --- layer_norm_keep / layer_norm_backward_kept: a layer norm keeps xc and sqrt(var + eps) --------
def layer_norm_keep_layout(shape, keep_xhat: bool) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """The parts of layer_norm_keep's flat output, in order: (name, start, stop, shape) of y,
    xc = x - mean(x), sv = sqrt(mean(xc*xc) + eps) (one per row) and, with keep_xhat, xc / sv."""
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64))
    rows = shape[:-1] + (1,)
    parts, at = [], 0
    for name, size, sh in [("y", n, shape), ("xc", n, shape), ("sv", n // _pymax(shape[-1], 1), rows)] + \
            ([("xhat", n, shape)] if keep_xhat else []):
        parts.append((name, at, at + size, sh))
        at += size
    return parts


def _infer_layer_norm_keep(inputs, attrs):
    shape, dtype = _infer_norm(inputs, attrs)
    return (layer_norm_keep_layout(shape, attrs["keep_xhat"])[-1][2],), dtype


def _layer_norm_keep_decompose(*inputs, eps, has_weight, has_bias, keep_xhat):
    x = inputs[0]
    xc = x - mean(x, -1, keepdims=True)
    sv = sqrt(mean(xc * xc, -1, keepdims=True) + eps)
    parts = [_layer_norm_decompose(*inputs, eps=eps, has_weight=has_weight, has_bias=has_bias), xc, sv]
    parts += [xc / sv] if keep_xhat else []
    return concat([reshape(p, (-1,)) for p in parts], 0)


def kept_backward_parts(inputs, attrs):
    """(xc, sv, w or None, g, r or None) of a layer_norm_backward_kept's inputs [xc, sv, [w], g,
    [r]] (tensors, or the arrays an executor holds for them): w with has_weight, r (the residual
    gradient the result is added to) with residual."""
    xc, sv, *rest = inputs
    rest, r = (rest[:-1], rest[-1]) if attrs.get("residual") else (rest, None)
    return xc, sv, (rest[0] if attrs.get("has_weight") else None), rest[-1], r


def _infer_layer_norm_backward_kept(inputs, attrs):
    if attrs.get("residual") and len(inputs) < 4:
        raise ShapeError("residual gradient none does not match the input gradient: no input for it")
    xc, sv, w, g, r = kept_backward_parts(inputs, attrs)
    if r is not None and (r.shape != xc.shape or r.dtype != xc.dtype):
        raise ShapeError(f"residual gradient {fmt_shape(r.shape)} {r.dtype} does not match the input gradient "
                         f"{fmt_shape(xc.shape)} {xc.dtype}")
    shape, dtype = _infer_norm([xc, *([w] if w is not None else []), g], attrs)
    if sv.shape != shape[:-1] + (1,):
        raise ShapeError(f"row scale {fmt_shape(sv.shape)} does not match {fmt_shape(shape)}")
    return shape, dtype


def _layer_norm_backward_kept_decompose(*inputs, **attrs):
    xc, sv, w, g, r = kept_backward_parts(inputs, attrs)
    dx = _layer_norm_backward_from(xc, 1.0 / sv, g, w)
    return dx if r is None else r + dx


register("layer_norm_keep", _infer_layer_norm_keep, decompose=_layer_norm_keep_decompose,
         doc="layer_norm(x, w, b) with what its backward reads, flat: [y, xc = x - mean, sv = "
             "sqrt(var + eps) per row, and xc/sv with keep_xhat] (layer_norm_keep_layout; each part a view)",
         vjp_doc="through its decomposition")
register("layer_norm_backward_kept", _infer_layer_norm_backward_kept, decompose=_layer_norm_backward_kept_decompose,
         doc="layer_norm_backward from the kept xc and sv: r*(gh - mean(gh) - xhat*mean(gh*xhat)), r = 1/sv, "
             "xhat = xc*r, gh = g*w; with residual, a last input added to it (a residual stream's gradient)",
         vjp_doc="through its decomposition")
