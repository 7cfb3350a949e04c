"""The JAX lowering rules: one function per op, keyed by op name (JAX's own primitive tables).

A rule is ``rule(node, *operands) -> jax value`` for the node's output, computed with jax.numpy /
lax on the operands' traced values, in the node's dtype. An update op's rule returns
``(token, {input index: new value})``: the functional form of its in-place write.

Only the ops that the graph cannot express with other graphlm ops need a rule here: primitives,
gathers and scatters, the RNG stream, the update ops. Every fused op (softmax, layer_norm, gelu,
cross_entropy, causal_attention and their backward ops, ...) is lowered through its registered
decomposition (lowering.py): XLA fuses the decomposed elementwise ops and reductions itself, so a
hand-fused rule would buy nothing, and a fused op added later runs here with no JAX code.

`HOST_CHECKS` are the run-time checks the reference executor makes on integer operands (token
ids, cache positions, the step count); XLA would clamp or wrap, so the program makes them on the
host, on the fed value, before the step runs (program.py).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from graphlm.random import GOLDEN, MIX1, MIX2, MASK64, mix64

from graphlm.registry import CUSTOM_OPS

from .. import reference
from ..base import ExecutionError, check_index_range, node_where

RULES: dict[str, Callable] = {}


def rule(*names):
    def deco(fn):
        for name in names:
            RULES[name] = fn
        return fn
    return deco


def _c(value, dtype):
    """A Python scalar as a constant of `dtype` (never a weakly typed or float64 constant)."""
    return jnp.asarray(value, dtype=dtype)


# -- elementwise ------------------------------------------------------------------------------------
for _name, _fn in {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
                   "maximum": jnp.maximum, "greater": jnp.greater, "less": jnp.less,
                   "equal": jnp.equal}.items():
    RULES[_name] = (lambda fn: lambda node, a, b: fn(a, b))(_fn)
for _name, _fn in {"neg": jnp.negative, "exp": jnp.exp, "log": jnp.log, "sqrt": jnp.sqrt,
                   "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
                   "square": jnp.square, "erf": lax.erf}.items():
    RULES[_name] = (lambda fn: lambda node, x: fn(x))(_fn)

rule("rsqrt")(lambda node, x: _c(1, x.dtype) / jnp.sqrt(x))   # 1/sqrt(x), the op's order (not lax.rsqrt)
rule("relu")(lambda node, x: jnp.maximum(x, _c(0, x.dtype)))
rule("pow")(lambda node, x: jnp.power(x, _c(node.attrs["exponent"], x.dtype)))
rule("cast")(lambda node, x: x.astype(node.dtype))
rule("where")(lambda node, c, a, b: jnp.where(c, a, b))

# -- reductions -------------------------------------------------------------------------------------
for _name, _fn in {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}.items():
    RULES[_name] = (lambda fn: lambda node, x: fn(x, axis=node.attrs["axes"],
                                                  keepdims=node.attrs["keepdims"]).astype(node.dtype))(_fn)

# -- views and data movement ------------------------------------------------------------------------
rule("reshape")(lambda node, x: jnp.reshape(x, node.shape))
rule("transpose")(lambda node, x: jnp.transpose(x, node.attrs["axes"]))
rule("broadcast_to")(lambda node, x: jnp.broadcast_to(x, node.shape))
rule("slice")(lambda node, x: x[node.attrs["index"]])
rule("slice_backward")(lambda node, g: jnp.zeros(node.shape, node.dtype).at[node.attrs["index"]].set(g))
rule("concat")(lambda node, *xs: jnp.concatenate(xs, axis=node.attrs["axis"]))
rule("matmul")(lambda node, a, b: jnp.matmul(a, b))

# -- gather / scatter -------------------------------------------------------------------------------
rule("embedding")(lambda node, table, ids: jnp.take(table, ids, axis=0))


@rule("embedding_backward")
def embedding_backward(node, ids, g):
    rows = g.reshape(-1, node.shape[1])
    return jnp.zeros(node.shape, node.dtype).at[ids.reshape(-1)].add(rows)


@rule("one_hot")
def one_hot(node, ids):
    return (ids[..., None] == jnp.arange(node.attrs["depth"], dtype=ids.dtype)).astype(node.dtype)


@rule("causal_mask")
def causal_mask(node, x):
    t, s = x.shape[-2:]
    keep = jnp.asarray(np.tri(t, s, k=node.attrs["offset"], dtype=bool))
    return jnp.where(keep, x, _c(node.attrs["fill"], x.dtype))


# -- the dropout stream (graphlm/random.py's counter_uniform, in 64-bit integer ops) ---------------
def _mix64(z):
    z = z ^ lax.shift_right_logical(z, _c(30, jnp.uint64))
    z = z * _c(MIX1, jnp.uint64)
    z = z ^ lax.shift_right_logical(z, _c(27, jnp.uint64))
    z = z * _c(MIX2, jnp.uint64)
    return z ^ lax.shift_right_logical(z, _c(31, jnp.uint64))


def counter_uniform(key, stream: int, shape):
    """float32 uniforms in [0, 1), bit for bit graphlm.random.counter_uniform(key, stream, shape):
    element i is mix64(base + (i+1)*golden) >> 40, base = mix64(key ^ mix64((stream+1)*golden)).
    `key` is a traced integer scalar; uint64 arithmetic wraps as NumPy's does."""
    key = lax.bitcast_convert_type(key.astype(jnp.int64), jnp.uint64) if key.dtype != jnp.uint64 else key
    base = _mix64(key ^ _c(mix64(((int(stream) + 1) * GOLDEN) & MASK64), jnp.uint64))
    n = int(np.prod(shape, dtype=np.int64))
    counter = lax.iota(jnp.uint64, n) + _c(1, jnp.uint64)
    z = _mix64(base + counter * _c(GOLDEN, jnp.uint64))
    u = lax.shift_right_logical(z, _c(40, jnp.uint64)).astype(jnp.float32) * _c(1.0 / 16777216.0, jnp.float32)
    return u.reshape(shape)


def dropout_keep_scale(key, stream, shape, p, dtype):
    """As graphlm.random.dropout_keep_scale: 1/(1-p) where kept, 0 where dropped."""
    keep = counter_uniform(key, stream, shape) >= _c(p, jnp.float32)
    return keep.astype(dtype) * _c(1.0 / (1.0 - p), dtype)


rule("dropout")(lambda node, x, key: x * dropout_keep_scale(key, node.attrs["stream"], x.shape,
                                                             node.attrs["p"], x.dtype))
rule("dropout_keep")(lambda node, key: counter_uniform(key, node.attrs["stream"], node.shape)
                     >= _c(node.attrs["p"], jnp.float32))
rule("dropout_mask")(lambda node, key: dropout_keep_scale(key, node.attrs["stream"], node.shape,
                                                          node.attrs["p"], node.dtype))


# -- optimizer ops: the global norm and functional updates -------------------------------------------
@rule("global_norm")
def global_norm(node, *grads):
    total = sum(jnp.sum(jnp.square(g)) for g in grads)
    return jnp.sqrt(total).astype(node.dtype)


@rule("adamw_update")
def adamw_update(node, lr, step, clip_coef, *arrays):
    """AdamW in the reference kernel's order; the bias corrections in float64 scalars as the
    reference computes them in Python floats. Returns the new (param, m, v) of every group."""
    a = node.attrs
    t = step.astype(jnp.float64)
    lr64 = lr.astype(jnp.float64)
    step_size = lr64 / (1.0 - jnp.power(_c(a["beta1"], jnp.float64), t))
    bc2_sqrt = jnp.sqrt(1.0 - jnp.power(_c(a["beta2"], jnp.float64), t))
    writes = {}
    for k, wd in enumerate(a["weight_decay"]):
        p, grad, m, v = arrays[4 * k: 4 * k + 4]
        dt = p.dtype
        g = grad * clip_coef.astype(dt)
        if wd:
            p = p * (1.0 - lr64 * wd).astype(dt)
        m = m * _c(a["beta1"], dt) + _c(1.0 - a["beta1"], dt) * g
        v = v * _c(a["beta2"], dt) + _c(1.0 - a["beta2"], dt) * g * g
        denom = jnp.sqrt(v) / bc2_sqrt.astype(dt) + _c(a["eps"], dt)
        p = p - step_size.astype(dt) * m / denom
        base = 3 + 4 * k
        writes.update({base: p, base + 2: m, base + 3: v})
    return jnp.zeros((), jnp.float32), writes


@rule("sgd_update")
def sgd_update(node, lr, clip_coef, *arrays):
    a = node.attrs
    size = 3 if a["momentum"] else 2
    writes = {}
    for k, wd in enumerate(a["weight_decay"]):
        p, grad = arrays[size * k: size * k + 2]
        d = grad * clip_coef.astype(p.dtype)
        if wd:
            d = d + _c(wd, p.dtype) * p
        base = 2 + size * k
        if a["momentum"]:
            d = arrays[size * k + 2] * _c(a["momentum"], p.dtype) + d
            writes[base + 2] = d
        writes[base] = p - lr.astype(p.dtype) * d
    return jnp.zeros((), jnp.float32), writes


@rule("cache_write")
def cache_write(node, cache, value, pos):
    new = lax.dynamic_update_slice_in_dim(cache, value, pos.astype(jnp.int64), node.attrs["axis"])
    return jnp.zeros((), jnp.float32), {0: new}


# -- custom ops with only a NumPy kernel (graphlm.executors.register_kernel) ------------------------
def host_kernel(op: str):
    """The rule of a custom op whose kernel is a NumPy function: it runs on the host inside the
    compiled program through `jax.pure_callback` (a device-to-host round trip per run; give the
    op a decomposition, or use it off the hot path). None when `op` has no such kernel."""
    if op not in CUSTOM_OPS or op not in reference.KERNELS:
        return None
    kernel = reference.KERNELS[op]

    def rule(node, *operands):
        out = jax.ShapeDtypeStruct(node.shape, node.dtype)
        return jax.pure_callback(lambda *arrays: np.asarray(kernel(node, *(np.asarray(a) for a in arrays))),
                                 out, *operands)
    return rule


def lowering_rule(op: str):
    """The rule op `op` lowers with: its own, or a custom op's host kernel (None: neither)."""
    return RULES.get(op) or host_kernel(op)


class Lowerable:
    """The ops with a rule (for executors/base.Program: every other op is expanded into its
    decomposition at compile)."""

    def __contains__(self, op: str) -> bool:
        return lowering_rule(op) is not None


# -- host-side checks on integer operands (the reference executor's ExecutionErrors) ---------------
def _check_ids(index: int, what: str, limit: Callable):
    def check(node, value):
        check_index_range(node, value, limit(node), what)
    return index, check


def _check_step(node, t):
    if int(t) < 1:
        raise ExecutionError(f"{node_where(node)}: the step count must be >= 1, got {int(t)}")


def _check_position(node, pos):
    axis, cache, value = node.attrs["axis"], node.inputs[0], node.inputs[1]
    p, n = int(pos), value.shape[axis]
    if not 0 <= p <= cache.shape[axis] - n:
        raise ExecutionError(f"{node_where(node)}: cannot write {n} position(s) at {p} into a cache "
                             f"of {cache.shape[axis]} positions")


# op -> [(operand index, check(node, host value))]
HOST_CHECKS: dict[str, list] = {
    "embedding": [_check_ids(1, "token id", lambda n: n.inputs[0].shape[0])],
    "embedding_backward": [_check_ids(0, "token id", lambda n: n.shape[0])],
    "one_hot": [_check_ids(0, "id", lambda n: n.attrs["depth"])],
    "cross_entropy": [_check_ids(1, "target", lambda n: n.inputs[0].shape[1])],
    "cross_entropy_backward": [_check_ids(1, "target", lambda n: n.inputs[0].shape[1])],
    "adamw_update": [(1, _check_step)],
    "cache_write": [(2, _check_position)],
}
