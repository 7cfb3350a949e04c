"""The reference executor: every node evaluated into a fresh NumPy array. Simple on purpose.

This is the oracle the other executors are tested against, so each kernel is the plainest
NumPy form of its op's definition (graphlm/ops.py). It computes in the nodes' own dtypes.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
from scipy import special

from graphlm.ops import (GELU_A, GELU_B, GELU_DA, GELU_DB, GELU_R2, GELU_R2PI, attention_query_blocks,
                         heads_merged_swap, kept_backward_parts, matmul_sum_folding, norm_parts)
from graphlm.random import counter_uniform, dropout_keep_scale

from .base import ExecutionError, Program, check_index_range, node_where

KERNELS: dict[str, Callable] = {}


def kernel(*names):
    def deco(fn):
        for name in names:
            KERNELS[name] = fn
        return fn
    return deco


def _s(x, like):
    """A Python scalar as `like`'s dtype (so float32 stays float32)."""
    return np.asarray(x, dtype=like.dtype)


# -- elementwise ------------------------------------------------------------------------------------
for _name, _fn in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                   "maximum": np.maximum, "greater": np.greater, "less": np.less,
                   "equal": np.equal}.items():
    KERNELS[_name] = (lambda fn: lambda node, a, b: fn(a, b))(_fn)
for _name, _fn in {"neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
                   "tanh": np.tanh, "sigmoid": special.expit, "square": np.square,
                   "erf": special.erf}.items():
    KERNELS[_name] = (lambda fn: lambda node, x: fn(x))(_fn)

kernel("rsqrt")(lambda node, x: _s(1.0, x) / np.sqrt(x))
kernel("relu")(lambda node, x: np.maximum(x, _s(0.0, x)))
kernel("silu")(lambda node, x: x * special.expit(x))
kernel("pow")(lambda node, x: np.power(x, _s(node.attrs["exponent"], x)))
kernel("cast")(lambda node, x: x.astype(node.dtype))
kernel("where")(lambda node, c, a, b: np.where(c, a, b))


def _gelu_sigmoid(x):
    """The tanh GELU's sigmoid(2*C*(x + K*x^3)), in the order of graphlm.ops' GELU note."""
    a = (x * x * _s(GELU_A, x) + _s(GELU_B, x)) * x
    return _s(1.0, x) / (np.exp(a) + _s(1.0, x))


@kernel("gelu")
def gelu(node, x):
    if node.attrs["approximate"] == "tanh":
        return x * _gelu_sigmoid(x)
    return (special.erf(x * _s(GELU_R2, x)) + _s(1.0, x)) * x * _s(0.5, x)


@kernel("gelu_backward")
def gelu_backward(node, x, g):
    if node.attrs["approximate"] == "tanh":
        s = _gelu_sigmoid(x)
        d = (_s(1.0, x) - s) * s * x * (x * x * _s(GELU_DA, x) + _s(GELU_DB, x)) + s
    else:
        d = (special.erf(x * _s(GELU_R2, x)) + _s(1.0, x)) * _s(0.5, x) + \
            x * np.exp(x * _s(-0.5, x) * x) * _s(GELU_R2PI, x)
    return g * d


# -- reductions --------------------------------------------------------------------------------------
kernel("sum")(lambda node, x: np.sum(x, axis=node.attrs["axes"], keepdims=node.attrs["keepdims"]))
kernel("mean")(lambda node, x: np.mean(x, axis=node.attrs["axes"], keepdims=node.attrs["keepdims"]))
kernel("max")(lambda node, x: np.max(x, axis=node.attrs["axes"], keepdims=node.attrs["keepdims"]))

# -- views and data movement -------------------------------------------------------------------------
kernel("reshape")(lambda node, x: np.reshape(x, node.shape))
kernel("transpose")(lambda node, x: np.transpose(x, node.attrs["axes"]))
kernel("broadcast_to")(lambda node, x: np.broadcast_to(x, node.shape))
kernel("slice")(lambda node, x: x[node.attrs["index"]])
kernel("concat")(lambda node, *xs: np.concatenate(xs, axis=node.attrs["axis"]))
kernel("matmul")(lambda node, a, b: np.matmul(a, b))


@kernel("slice_backward")
def slice_backward(node, g):
    out = np.zeros(node.shape, node.dtype)
    out[node.attrs["index"]] = g
    return out


# -- gather / scatter ----------------------------------------------------------------------------------
@kernel("embedding")
def embedding(node, table, ids):
    check_index_range(node, ids, table.shape[0], "token id")
    return table[ids]


@kernel("embedding_backward")
def embedding_backward(node, ids, g):
    check_index_range(node, ids, node.shape[0], "token id")
    out = np.zeros(node.shape, node.dtype)
    np.add.at(out, ids.reshape(-1), g.reshape(-1, node.shape[1]))
    return out


@kernel("one_hot")
def one_hot(node, ids):
    depth = node.attrs["depth"]
    check_index_range(node, ids, depth)
    return (ids[..., None] == np.arange(depth)).astype(node.dtype)


# -- fused NN ops --------------------------------------------------------------------------------------
@kernel("softmax")
def softmax(node, x):
    e = np.exp(x - np.max(x, axis=node.attrs["axis"], keepdims=True))
    return e / np.sum(e, axis=node.attrs["axis"], keepdims=True)


@kernel("softmax_backward")
def softmax_backward(node, y, g):
    return y * (g - np.sum(g * y, axis=node.attrs["axis"], keepdims=True))


@kernel("log_softmax")
def log_softmax(node, x):
    s = x - np.max(x, axis=node.attrs["axis"], keepdims=True)
    return s - np.log(np.sum(np.exp(s), axis=node.attrs["axis"], keepdims=True))


@kernel("log_softmax_backward")
def log_softmax_backward(node, y, g):
    return g - np.exp(y) * np.sum(g, axis=node.attrs["axis"], keepdims=True)


@kernel("layer_norm")
def layer_norm(node, *arrays):
    x, w, b, _ = norm_parts(arrays, node.attrs)
    xc = x - np.mean(x, axis=-1, keepdims=True)
    y = xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + _s(node.attrs["eps"], x))
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


@kernel("layer_norm_backward")
def layer_norm_backward(node, *arrays):
    x, w, _, (g,) = norm_parts(arrays, node.attrs)
    xc = x - np.mean(x, axis=-1, keepdims=True)
    r = _s(1.0, x) / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + _s(node.attrs["eps"], x))
    xhat = xc * r
    gh = g * w if w is not None else g
    return r * (gh - np.mean(gh, axis=-1, keepdims=True) - xhat * np.mean(gh * xhat, axis=-1, keepdims=True))


@kernel("rms_norm")
def rms_norm(node, *arrays):
    x, w, _, _ = norm_parts(arrays, node.attrs)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _s(node.attrs["eps"], x))
    return y * w if w is not None else y


@kernel("rms_norm_backward")
def rms_norm_backward(node, *arrays):
    x, w, _, (g,) = norm_parts(arrays, node.attrs)
    r = _s(1.0, x) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _s(node.attrs["eps"], x))
    gh = g * w if w is not None else g
    return r * gh - x * (r * r * r) * np.mean(gh * x, axis=-1, keepdims=True)


@kernel("cross_entropy")
def cross_entropy(node, logits, targets):
    check_index_range(node, targets, logits.shape[1], "target")
    m = np.max(logits, axis=1, keepdims=True)
    lse = np.log(np.sum(np.exp(logits - m), axis=1)) + m[:, 0]
    picked = logits[np.arange(logits.shape[0]), targets]
    return np.mean(lse - picked).astype(logits.dtype)


@kernel("cross_entropy_backward")
def cross_entropy_backward(node, logits, targets, g):
    check_index_range(node, targets, logits.shape[1], "target")
    p = _softmax_rows(logits)
    p[np.arange(logits.shape[0]), targets] -= _s(1.0, logits)
    return p * (g / _s(logits.shape[0], logits))


def _softmax_rows(x):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


@kernel("causal_mask")
def causal_mask(node, x):
    t, s = x.shape[-2:]
    keep = np.tri(t, s, k=node.attrs["offset"], dtype=bool)
    return np.where(keep, x, _s(node.attrs["fill"], x))


def _attention_scores(q, k, scale):
    """causal_mask(q @ k^T * scale): the scores of every pair, the masked ones -inf."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * _s(scale, q)
    keep = np.tri(s.shape[-2], s.shape[-1], dtype=bool)
    return np.where(keep, s, _s(-np.inf, s))


def _attention_probs(q, k, scale):
    """softmax(causal_mask(q @ k^T * scale)): the scores of every pair, the masked ones too."""
    return _softmax_rows(_attention_scores(q, k, scale))


def _attention_gradients(p, q, k, v, o, g, scale):
    scale = _s(scale, q)
    ds = p * (np.matmul(g, np.swapaxes(v, -1, -2)) - np.sum(g * o, axis=-1, keepdims=True)) * scale
    return np.stack([np.matmul(ds, k), np.matmul(np.swapaxes(ds, -1, -2), q),
                     np.matmul(np.swapaxes(p, -1, -2), g)])


@kernel("causal_attention")
def causal_attention(node, q, k, v):
    return heads_merged_swap(np.matmul(_attention_probs(q, k, node.attrs["scale"]), v), node.attrs)


@kernel("causal_attention_backward")
def causal_attention_backward(node, q, k, v, o, g):
    return heads_merged_swap(_attention_gradients(_attention_probs(q, k, node.attrs["scale"]), q, k, v, o, g,
                                                  node.attrs["scale"]), node.attrs)


@kernel("causal_attention_keep")
def causal_attention_keep(node, q, k, v):
    s = _attention_scores(q, k, node.attrs["scale"])
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    l = np.sum(e, axis=-1, keepdims=True)
    blocks = [e[..., r0:r1, :r1].reshape(-1) for r0, r1 in attention_query_blocks(q.shape[-2], node.attrs["query_block"])]
    return np.concatenate([heads_merged_swap(np.matmul(e / l, v), node.attrs).reshape(-1), *blocks, l.reshape(-1)])


@kernel("causal_attention_backward_kept")
def causal_attention_backward_kept(node, q, k, v, o, e, l, g):
    p, at = np.zeros(q.shape[:-1] + q.shape[-2:-1], q.dtype), 0
    for r0, r1 in attention_query_blocks(q.shape[-2], node.attrs["query_block"]):
        rows = p[..., r0:r1, :r1]
        rows[...] = e[at:at + rows.size].reshape(rows.shape)
        at += rows.size
    return heads_merged_swap(_attention_gradients(p / l, q, k, v, o, g, node.attrs["scale"]), node.attrs)


def check_cached_position(node, position, capacity: int) -> int:
    """A cached_attention's position as an int, or an ExecutionError naming the node: a decode
    step's token goes at a position of the cache, 0 <= position < capacity."""
    p = int(position)
    if not 0 <= p < capacity:
        raise ExecutionError(f"{node_where(node)}: position {p} is outside the cache's {capacity} "
                             f"positions (0..{capacity - 1})")
    return p


@kernel("cached_attention")
def cached_attention(node, q, k, v, cache_k, cache_v, position):
    """The decomposition's arithmetic in one kernel: all T cached slots, those >= position -inf."""
    t, scale = cache_k.shape[-2], _s(node.attrs["scale"], q)
    check_cached_position(node, position, t)
    mask = np.where(np.arange(t) < position, _s(0.0, q), _s(-np.inf, q))
    s_cache = np.matmul(q, np.swapaxes(cache_k, -1, -2)) * scale + mask
    s_self = np.sum(q * k, axis=-1, keepdims=True) * scale
    p = _softmax_rows(np.concatenate([s_cache, s_self], axis=-1))
    return np.matmul(p[..., :t], cache_v) + p[..., t:] * v


@kernel("dropout")
def dropout(node, x, key):
    return x * dropout_keep_scale(int(key), node.attrs["stream"], x.shape, node.attrs["p"], x.dtype)


@kernel("dropout_mask")
def dropout_mask(node, key):
    return dropout_keep_scale(int(key), node.attrs["stream"], node.shape, node.attrs["p"], node.dtype)


# -- optimizer ops: global gradient norm and in-place updates (graphlm/ops.py, "optimizer ops") ----
@kernel("global_norm")
def global_norm(node, *grads):
    total = np.zeros((), dtype=node.dtype)
    for g in grads:
        flat = g.reshape(-1)
        total += np.dot(flat, flat) if flat.flags.c_contiguous and flat.strides[0] else np.sum(g * g)
    return np.sqrt(total).astype(node.dtype)


def _check_step(node, t):
    if t < 1:
        raise ExecutionError(f"{node_where(node)}: the step count must be >= 1, got {t}")


@kernel("adamw_update")
def adamw_update(node, lr, step, clip_coef, *arrays):
    """AdamW as torch.optim.AdamW computes it, writing param, m and v in place."""
    a = node.attrs
    t = int(step)
    _check_step(node, t)
    b1, b2, lr = a["beta1"], a["beta2"], float(lr)
    step_size = lr / (1.0 - b1 ** t)
    bc2_sqrt = math.sqrt(1.0 - b2 ** t)
    for k, wd in enumerate(a["weight_decay"]):
        p, grad, m, v = arrays[4 * k: 4 * k + 4]
        g = grad * clip_coef.astype(p.dtype)
        if wd:
            p *= _s(1.0 - lr * wd, p)
        m *= _s(b1, p)
        m += _s(1.0 - b1, p) * g
        v *= _s(b2, p)
        v += _s(1.0 - b2, p) * g * g
        denom = np.sqrt(v)
        denom /= _s(bc2_sqrt, p)
        denom += _s(a["eps"], p)
        p -= _s(step_size, p) * m / denom
    return np.zeros((), np.float32)


@kernel("sgd_update")
def sgd_update(node, lr, clip_coef, *arrays):
    """SGD as torch.optim.SGD computes it (coupled weight decay, momentum buffer from zeros)."""
    a = node.attrs
    size = 3 if a["momentum"] else 2
    for k, wd in enumerate(a["weight_decay"]):
        p, grad = arrays[size * k: size * k + 2]
        d = grad * clip_coef.astype(p.dtype)
        if wd:
            d = d + _s(wd, p) * p
        if a["momentum"]:
            buf = arrays[size * k + 2]
            buf *= _s(a["momentum"], p)
            buf += d
            d = buf
        p -= lr.astype(p.dtype) * d
    return np.zeros((), np.float32)


@kernel("cache_write")
def cache_write(node, cache, value, pos):
    axis, p, n = node.attrs["axis"], int(pos), value.shape[node.attrs["axis"]]
    if not 0 <= p <= cache.shape[axis] - n:
        raise ExecutionError(f"{node_where(node)}: cannot write {n} position(s) at {p} into a cache "
                             f"of {cache.shape[axis]} positions")
    index = [slice(None)] * cache.ndim
    index[axis] = slice(p, p + n)
    cache[tuple(index)] = value
    return np.zeros((), np.float32)


# -- the executor ---------------------------------------------------------------------------------------
# -- ops the graph passes produce (graphlm/ops.py, "ops the graph passes produce") ----------------
@kernel("affine_grads")
def affine_grads(node, g, x, d=None):
    lead = tuple(range(g.ndim - 1))
    return np.concatenate([np.sum(g * (x if d is None else x / d), axis=lead), np.sum(g, axis=lead)])


@kernel("bias_gelu")
def bias_gelu(node, m, b):
    return gelu(node, m + b)


@kernel("bias_gelu_backward")
def bias_gelu_backward(node, m, b, g):
    return gelu_backward(node, m + b, g)


@kernel("bias_dropout_add")
def bias_dropout_add(node, r, m, b, keep):
    return r + dropout_apply(node, m + b, keep)


@kernel("matmul_sum")
def matmul_sum(node, a, b):
    pa, sa, pb, sb, shape = matmul_sum_folding(a, b, node.attrs["axes"])
    return np.matmul(pa.reshape(sa), pb.reshape(sb)).reshape(node.shape)


@kernel("matmul_accumulate")
def matmul_accumulate(node, a, b):
    return np.sum(np.matmul(a, b), axis=0, keepdims=node.attrs["keepdims"])


@kernel("panel_matmul")
def panel_matmul(node, x, panels, *bias):
    *batch, c, k, w = panels.shape
    b = np.swapaxes(panels, -3, -2).reshape(*batch, k, c * w)[..., :node.attrs["columns"]]
    y = np.matmul(x, b)
    return y + bias[0] if bias else y


@kernel("slices_assemble")
def slices_assemble(node, *srcs):
    out = np.zeros(node.shape, node.dtype)
    for src, index in zip(srcs, node.attrs["indexes"]):
        window = out[tuple(index) + (Ellipsis,)]
        window[...] = src.reshape(window.shape) + _s(0.0, src)   # as the sum of zero-padded slices
    return out


def _scaled_masked(node, x, c):
    a = node.attrs
    if c:
        x = x * c[0] if a["scale_pos"] == 1 else c[0] * x
    if a["mask"] is not None:
        x = _masked(x, *a["mask"])
    return x


def _masked(x, fill, offset):
    keep = np.tri(x.shape[-2], x.shape[-1], k=offset, dtype=bool)
    return np.where(keep, x, _s(fill, x))


@kernel("softmax_fused")
def softmax_fused(node, x, *c):
    return _softmax_rows(_scaled_masked(node, x, c))


@kernel("softmax_backward_fused")
def softmax_backward_fused(node, y, g, *c):
    a = node.attrs
    d = y * (g - np.sum(g * y, axis=a["axis"], keepdims=True))
    if a["mask"] is not None:
        d = _masked(d, *a["mask"])
    if c:
        d = d * c[0] if a["scale_pos"] == 1 else c[0] * d
    return d


@kernel("dropout_keep")
def dropout_keep(node, key):
    return counter_uniform(int(key), node.attrs["stream"], node.shape) >= np.float32(node.attrs["p"])


@kernel("dropout_apply")
def dropout_apply(node, x, keep):
    return x * keep.astype(x.dtype) * _s(1.0 / (1.0 - node.attrs["p"]), x)


kernel("gelu_sigmoid")(lambda node, x: _gelu_sigmoid(x))


@kernel("gelu_backward_sigmoid")
def gelu_backward_sigmoid(node, x, g, s):
    return g * ((_s(1.0, x) - s) * s * x * (x * x * _s(GELU_DA, x) + _s(GELU_DB, x)) + s)


@kernel("layer_norm_keep")
def layer_norm_keep(node, *arrays):
    x = arrays[0]
    xc = x - np.mean(x, axis=-1, keepdims=True)
    sv = np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + _s(node.attrs["eps"], x))
    parts = [layer_norm(node, *arrays), xc, sv] + ([xc / sv] if node.attrs["keep_xhat"] else [])
    return np.concatenate([p.reshape(-1) for p in parts])


@kernel("layer_norm_backward_kept")
def layer_norm_backward_kept(node, *inputs):
    xc, sv, w, g, residual = kept_backward_parts(inputs, node.attrs)
    r = _s(1.0, xc) / sv
    xhat = xc * r
    gh = g * w if w is not None else g
    dx = r * (gh - np.mean(gh, axis=-1, keepdims=True) - xhat * np.mean(gh * xhat, axis=-1, keepdims=True))
    return dx if residual is None else residual + dx


class ReferenceProgram(Program):
    executor_name = "reference"
    rounds_like_reference = True
    tolerances = {"float64": 0.0, "float32": 0.0}
    pipeline = "none"   # no graph passes: it runs the graph it is given (a rewritten one too)

    def run(self, feeds=None, state=None) -> list[np.ndarray]:
        feeds = self.check_feeds(feeds)
        state = self.check_state(state)
        values: dict[int, np.ndarray] = {}
        for node in self.nodes:
            if node.op == "input":
                values[node.id] = feeds[node.name]
            elif node.op in ("param", "state"):
                values[node.id] = state[node.name]
            elif node.op == "const":
                values[node.id] = node.attrs["value"]
            else:
                with np.errstate(all="ignore"):
                    out = KERNELS[node.op](node, *(values[i.id] for i in node.inputs))
                out = np.asarray(out)
                if out.shape != node.shape or out.dtype != node.dtype:
                    raise ExecutionError(f"{node_where(node)}: kernel gave {out.shape} {out.dtype}, "
                                         f"expected {node.shape} {node.dtype}")
                values[node.id] = out
        return [np.array(values[o.id], copy=True) for o in self.outputs]


class ReferenceExecutor:
    name = "reference"
    kernels = KERNELS
    pipeline = ReferenceProgram.pipeline

    def compile(self, graph, outputs) -> ReferenceProgram:
        return ReferenceProgram(graph, outputs, KERNELS)
