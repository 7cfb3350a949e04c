"""Every op of graphlm, one table row per op (tinygrad's helper_test_op pattern).

Each row says what the op is: the graphlm function, the same function in NumPy (the forward
formula) and in PyTorch (the oracle), and the seeded input shapes it runs on, including
broadcasting, size-1 axes and scalars. From the table:

- forward vs the NumPy formula (float64);
- every float input's gradient vs float64 central differences, the output tangent J v vs
  central differences, and the VJP inner-product identity (graphlm.testing.check_grads);
- forward and torch.autograd.grad of a random weighted sum vs PyTorch in float32 and float64,
  with explicit shape and dtype checks of outputs and gradients;
- every fused op (an op with a `decompose` in the registry) vs its decomposition, values and
  gradients, iterating over the registry so new fused ops are covered automatically;
- every registered op appears in the table.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from scipy import special

from graphlm import executors
import graphlm as gl
from graphlm.ops import (attention_query_blocks, causal_attention_keep_layout, layer_norm_keep_layout, normalize_index,
                         panel_matmul)
from graphlm.random import counter_uniform, dropout_keep_scale
from graphlm.registry import REGISTRY, apply
from graphlm.testing import assert_close, build, check_grads, feeds_of, run
from tests.gradcheck import check_torch

try:  # the oracle; the table refers to these names lazily, inside lambdas
    import torch
    import torch.nn.functional as TF
except ImportError:  # pragma: no cover - torch is in the test extra
    torch = TF = None


# ------------------------------------------------------------------------------------------------
# input specs: what kind of values an input holds (kept away from kinks and ties)
# ------------------------------------------------------------------------------------------------

def F(*shape):
    """Standard normal floats."""
    return ("normal", shape)


def P(*shape):
    """Positive floats in [0.5, 2] (log, sqrt, rsqrt, fractional powers)."""
    return ("positive", shape)


def NZ(*shape):
    """Floats with |x| in [0.3, 2] (relu away from 0, divisors)."""
    return ("nonzero", shape)


def D(*shape):
    """Distinct floats at least 0.25 apart (max without ties)."""
    return ("distinct", shape)


def G(offset, *shape):
    """Integers + offset + small noise: two G inputs with different offsets never tie."""
    return ("grid", shape, offset)


def I(hi, *shape, dtype="int64"):
    """Integer ids in [0, hi)."""
    return ("int", shape, hi, dtype)


def B(*shape):
    return ("bool", shape)


def KEY():
    """A scalar int64 RNG key."""
    return ("key", ())


def make(spec, rng) -> np.ndarray:
    kind, shape = spec[0], spec[1]
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "positive":
        return rng.uniform(0.5, 2.0, shape)
    if kind == "nonzero":
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.3, 2.0, shape)
    if kind == "distinct":
        n = int(np.prod(shape, dtype=np.int64))
        return ((rng.permutation(n) - n / 2) * 0.3 + rng.uniform(-0.02, 0.02, n)).reshape(shape)
    if kind == "grid":
        return rng.integers(-2, 3, shape) + spec[2] + rng.uniform(-0.05, 0.05, shape)
    if kind == "int":
        return rng.integers(0, spec[2], shape).astype(spec[3])
    if kind == "bool":
        return rng.random(shape) < 0.5
    if kind == "key":
        return np.array(rng.integers(0, 2 ** 62), dtype=np.int64)
    raise ValueError(kind)


def make_inputs(case_id: str, specs) -> list[np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    return [np.asarray(make(s, rng)) for s in specs]


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    f: Callable                    # the graphlm function
    inputs: list                   # shape sets: each a tuple of input specs
    ref: Callable | None           # the NumPy formula (float64)
    torch: Callable | None         # the same function in PyTorch
    fd: bool = True                # gradients vs central differences
    grad: bool = True              # gradients vs torch
    fd_tol: float = 1e-6
    identity_tol: float = 1e-10    # <J v, u> == <v, J^T u>; looser only where the graph rounds to float32
    tol32: float | None = None     # float32 tolerance vs torch when 1e-5 is too tight


def tvjp(fn, primal, ct):
    """torch's VJP of fn at primal (differentiable again), the oracle for backward ops."""
    return torch.autograd.grad(fn(primal), primal, ct, create_graph=True)[0]


def zeros_vjp(shape, index):
    """torch oracle for slice_backward: the VJP of x[index] at zeros."""
    def f(g):
        x = torch.zeros(shape, dtype=g.dtype, requires_grad=True)
        return torch.autograd.grad(x[index], x, g, create_graph=True)[0]
    return f


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_log_softmax(x, axis=-1):
    s = x - x.max(axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis, keepdims=True))


def np_layer_norm(x, w=None, b=None, eps=1e-5):
    xc = x - x.mean(-1, keepdims=True)
    y = xc / np.sqrt((xc ** 2).mean(-1, keepdims=True) + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def np_layer_norm_backward(x, w, g, eps=1e-5):
    n = x.shape[-1]
    xc = x - x.mean(-1, keepdims=True)
    r = 1 / np.sqrt((xc ** 2).mean(-1, keepdims=True) + eps)
    xhat = xc * r
    gh = g * (1 if w is None else w)
    return r / n * (n * gh - gh.sum(-1, keepdims=True) - xhat * (gh * xhat).sum(-1, keepdims=True))


def np_rms_norm(x, w=None, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 if w is None else w)


def np_rms_norm_backward(x, w, g, eps=1e-6):
    ms = (x * x).mean(-1, keepdims=True) + eps
    gh = g * (1 if w is None else w)
    return gh / np.sqrt(ms) - x * (gh * x).mean(-1, keepdims=True) / ms ** 1.5


def np_gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + special.erf(x / math.sqrt(2)))


def np_gelu_grad(x, approximate):
    if approximate == "tanh":
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return 0.5 * (1 + special.erf(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def np_cross_entropy(logits, targets):
    return -np_log_softmax(logits)[np.arange(len(targets)), targets].mean()


def np_cross_entropy_backward(logits, targets, g):
    p = np_softmax(logits)
    p[np.arange(len(targets)), targets] -= 1
    return p * g / len(targets)


def np_causal_mask(x, fill=-np.inf, offset=0):
    return np.where(np.tri(*x.shape[-2:], k=offset, dtype=bool), x, fill)


def t_causal_mask(x, fill=-math.inf, offset=0):
    t, s = x.shape[-2:]
    return x.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(offset + 1), fill)


def np_causal_attention_parts(q, k, scale):
    s = np_causal_mask(q @ np.swapaxes(k, -1, -2) * scale)
    return np_softmax(s)


def np_causal_attention(q, k, v, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return np_causal_attention_parts(q, k, scale) @ v


def np_causal_attention_backward(q, k, v, g, scale):
    """The textbook softmax gradient (rowsum(P*dP), not the op's rowsum(g*o))."""
    p = np_causal_attention_parts(q, k, scale)
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * scale
    return np.stack([ds @ k, np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ g])


def t_causal_attention(q, k, v, scale=None):
    return TF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def t_causal_attention_backward(q, k, v, g, scale):
    # (torch's fused attention has no double backward: the plain form, differentiable twice)
    plain = lambda q, k, v: torch.softmax(t_causal_mask(q @ k.transpose(-1, -2) * scale), -1) @ v
    return torch.stack(torch.autograd.grad(plain(q, k, v), (q, k, v), g, create_graph=True))


def _attention_backward(q, k, v, g, scale):
    return apply("causal_attention_backward", (q, k, v, gl.causal_attention(q, k, v, scale), g), scale=scale)


def np_cached_attention(q, k, v, cache_k, cache_v, position):
    """The new token's attention over the cached slots < position and its own key, as a plain
    softmax over position + 1 scores."""
    p, scale = int(position), 1 / math.sqrt(q.shape[-1])
    s = np.concatenate([q @ np.swapaxes(cache_k[..., :p, :], -1, -2), (q * k).sum(-1, keepdims=True)], -1)
    e = np_softmax(s * scale)
    return e[..., :p] @ cache_v[..., :p, :] + e[..., p:] * v


def t_cached_attention(q, k, v, cache_k, cache_v, position):
    p = int(position)
    keys, values = torch.cat([cache_k[..., :p, :], k], -2), torch.cat([cache_v[..., :p, :], v], -2)
    return TF.scaled_dot_product_attention(q, keys, values)


def cached_attention_inputs(lead, t, d, position_bound):
    """q, k, v [*lead, 1, d], the caches [*lead, t, d] and a position drawn in [0, position_bound)."""
    new, cache = (F(*lead, 1, d),) * 3, (F(*lead, t, d),) * 2
    return new + cache + (I(position_bound),)


ATTENTION = [(2, 3, 5, 4), (6, 3), (1, 2, 100, 3)]   # the last: 100 queries make two query blocks


def np_embedding_backward(ids, g, rows):
    out = np.zeros((rows, g.shape[-1]), g.dtype)
    np.add.at(out, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
    return out


def np_slice_backward(g, shape, index):
    out = np.zeros(shape, g.dtype)
    out[index] = g
    return out


def grown(shape):
    """A shape `shape` broadcasts to: a new leading axis of 2 and every size-1 axis made 3."""
    return (2,) + tuple(3 if d == 1 else d for d in shape)


BINARY = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((1,), (2, 1, 3)), ((), (2, 3))]
UNARY = [(3, 4), (2, 1, 5), (1,), ()]
REDUCE = [(3, 4), (2, 3, 4), (1, 4), (2, 1, 3)]
NORM = [(3, 5), (2, 3, 4), (1, 6)]
SLICE_IDX = (slice(1, 3), 2)


def binary(a, b):
    return [(a(*s), b(*t)) for s, t in BINARY]


def unary(kind=F, shapes=UNARY):
    return [(kind(*s),) for s in shapes]


def _dropout_ref(x, key, p=0.3, stream=0):
    return x * dropout_keep_scale(int(key), stream, x.shape, p, x.dtype)


def _dropout_torch(x, key, p=0.3, stream=0):
    mask = dropout_keep_scale(int(key), stream, tuple(x.shape), p, str(x.dtype).replace("torch.", ""))
    return x * torch.from_numpy(mask)


def _np_layer_norm_keep(x, w, b, eps=1e-5):
    xc = x - x.mean(-1, keepdims=True)
    sv = np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    return np.concatenate([p.reshape(-1) for p in (np_layer_norm(x, w, b), xc, sv, xc / sv)])


def _t_layer_norm_keep(x, w, b, eps=1e-5):
    xc = x - x.mean(-1, keepdim=True)
    sv = torch.sqrt((xc * xc).mean(-1, keepdim=True) + eps)
    return torch.cat([p.reshape(-1) for p in (TF.layer_norm(x, x.shape[-1:], w, b, eps=eps), xc, sv, xc / sv)])


def _layer_norm_backward_kept(x, w, g, *r):
    """layer_norm_backward_kept(xc, sv, w, g, [r]) with xc and sv the parts of a layer_norm_keep
    of x (and r, a residual gradient, added when given)."""
    flat = apply("layer_norm_keep", (x,), eps=1e-5, has_weight=False, has_bias=False, keep_xhat=False)
    parts = {name: gl.reshape(flat[a:b], shape) for name, a, b, shape in layer_norm_keep_layout(x.shape, False)}
    return apply("layer_norm_backward_kept", (parts["xc"], parts["sv"], w, g, *r), eps=1e-5, has_weight=True,
                 **({"residual": True} if r else {}))


def _attention_keep_parts(q, k, scale, xp):
    """E = exp(s - rowmax) of the masked scores and l = rowsum(E), in NumPy or torch (`xp`)."""
    s = q @ xp.swapaxes(k, -1, -2) * scale
    t = s.shape[-1]
    if xp is np:
        s = np_causal_mask(s)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e, e.sum(-1, keepdims=True)
    s = t_causal_mask(s)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e, e.sum(-1, keepdim=True)


def _attention_keep_ref(q, k, v, scale, query_block, xp):
    """causal_attention_keep's flat output: y, E's query blocks (keys [0, r1) of rows [r0, r1)), l."""
    e, l = _attention_keep_parts(q, k, scale, xp)
    blocks = [e[..., r0:r1, :r1].reshape(-1) for r0, r1 in attention_query_blocks(q.shape[-2], query_block)]
    cat = np.concatenate if xp is np else torch.cat
    return cat([((e / l) @ v).reshape(-1), *blocks, l.reshape(-1)])


def _attention_keep(q, k, v, scale=0.6, query_block=2):
    return apply("causal_attention_keep", (q, k, v), scale=scale, query_block=query_block)


def _attention_backward_kept(q, k, v, g, scale=0.6, query_block=2):
    """causal_attention_backward_kept(q, k, v, y, E, l, g) on the parts of a causal_attention_keep."""
    flat = _attention_keep(q, k, v, scale, query_block)
    parts = {name: gl.reshape(flat[a:b], shape) for name, a, b, shape in causal_attention_keep_layout(q.shape, query_block)}
    return apply("causal_attention_backward_kept", (q, k, v, parts["y"], parts["e"], parts["l"], g),
                 scale=scale, query_block=query_block)


def _merged(x):
    """[..., H, T, D] -> [..., T, H, D] (NumPy or torch): a heads_merged attention's layout."""
    return np.swapaxes(x, -3, -2) if isinstance(x, np.ndarray) else x.transpose(-3, -2)


def _attention_merged(q, k, v):
    return apply("causal_attention", (q, k, v), scale=0.6, heads_merged=True)


def _attention_backward_merged(q, k, v, g):
    y = gl.causal_attention(q, k, v, 0.6)
    return apply("causal_attention_backward", (q, k, v, y, g), scale=0.6, heads_merged=True)


def _attention_keep_merged_ref(q, k, v, xp):
    """causal_attention_keep's flat output with heads_merged: y as [..., T, H, D], then E and l."""
    flat = _attention_keep_ref(q, k, v, 0.6, 2, xp)
    n = q.numel() if xp is torch else q.size
    y = _merged(flat[:n].reshape(q.shape)).reshape(-1)
    return (np.concatenate if xp is np else torch.cat)([y, flat[n:]])


def _attention_backward_kept_merged(q, k, v, g):
    """causal_attention_backward_kept with heads_merged, on the parts of a heads_merged keep."""
    flat = apply("causal_attention_keep", (q, k, v), scale=0.6, query_block=2, heads_merged=True)
    parts = {name: gl.reshape(flat[a:b], shape) for name, a, b, shape in causal_attention_keep_layout(q.shape, 2, True)}
    o = gl.swapaxes(parts["y"], -3, -2)   # (the [..., H, T, D] view)
    return apply("causal_attention_backward_kept", (q, k, v, o, parts["e"], parts["l"], g),
                 scale=0.6, query_block=2, heads_merged=True)


ATTENTION_MERGED = [(2, 3, 5, 4), (3, 4, 2)]   # [..., H, T, D]: heads_merged needs the heads' axis
ATTENTION_KEEP = [(2, 2, 5, 3), (6, 3), (1, 1)]   # query blocks of 2 rows: 2 (uneven), 3 and 1 blocks
# (E = exp(s - rowmax) has a kink where a row max ties: these inputs have no near tie)


def _unpanel(p, columns):
    """panel_matmul's B [..., k, columns] from its panels [..., C, k, W] (NumPy or torch)."""
    *batch, c, k, w = p.shape
    return p.swapaxes(-3, -2).reshape(*batch, k, c * w)[..., :columns]


CASES = [
    # -- elementwise binary, with broadcasting -------------------------------------------------
    Case("add", gl.add, binary(F, F), np.add, lambda a, b: torch.add(a, b)),
    Case("sub", lambda a, b: a - b, binary(F, F), np.subtract, lambda a, b: a - b),
    Case("mul", gl.mul, binary(F, F), np.multiply, lambda a, b: a * b),
    Case("div", lambda a, b: a / b, binary(F, NZ), np.divide, lambda a, b: a / b),
    Case("maximum", gl.maximum, [(G(0.3, *s), G(0.8, *t)) for s, t in BINARY], np.maximum,
         lambda a, b: torch.maximum(a, b)),
    Case("mul_scalar", lambda x: x * 2.5, unary(), lambda x: x * 2.5, lambda x: x * 2.5),
    Case("add_int_scalar", lambda x: x + 1, unary(), lambda x: x + 1, lambda x: x + 1),
    Case("rsub_scalar", lambda x: 1.5 - x, unary(), lambda x: 1.5 - x, lambda x: 1.5 - x),
    Case("rdiv_scalar", lambda x: 2.0 / x, unary(NZ), lambda x: 2.0 / x, lambda x: 2.0 / x),
    Case("where", gl.where, [(B(3, 4), F(3, 4), F(3, 4)), (B(3, 1), F(1, 4), F(3, 4)),
                             (B(4), F(2, 4), F(1))], np.where, lambda c, a, b: torch.where(c, a, b)),
    Case("where_scalar", lambda c, a: gl.where(c, a, 0.0), [(B(3, 4), F(3, 4)), (B(2, 1), F(3))],
         lambda c, a: np.where(c, a, 0.0), lambda c, a: torch.where(c, a, 0.0)),
    Case("greater", gl.greater, binary(F, F), np.greater, lambda a, b: a > b, fd=False, grad=False),
    Case("less", lambda a, b: a < b, binary(F, F), np.less, lambda a, b: a < b, fd=False, grad=False),
    Case("equal", gl.equal, [(I(3, 3, 4), I(3, 3, 4)), (I(3, 3, 1), I(3, 4))], np.equal,
         lambda a, b: a == b, fd=False, grad=False),
    # -- elementwise unary ------------------------------------------------------------------------
    Case("neg", lambda x: -x, unary(), np.negative, lambda x: -x),
    Case("exp", gl.exp, unary(), np.exp, lambda x: torch.exp(x)),
    Case("log", gl.log, unary(P), np.log, lambda x: torch.log(x)),
    Case("sqrt", gl.sqrt, unary(P), np.sqrt, lambda x: torch.sqrt(x)),
    Case("rsqrt", gl.rsqrt, unary(P), lambda x: 1 / np.sqrt(x), lambda x: torch.rsqrt(x)),
    Case("tanh", gl.tanh, unary(), np.tanh, lambda x: torch.tanh(x)),
    Case("sigmoid", gl.sigmoid, unary(), special.expit, lambda x: torch.sigmoid(x)),
    Case("relu", gl.relu, unary(NZ), lambda x: np.maximum(x, 0), lambda x: torch.relu(x)),
    Case("gelu_tanh", gl.gelu, unary(), lambda x: np_gelu(x, "tanh"),
         lambda x: TF.gelu(x, approximate="tanh")),
    Case("gelu_erf", lambda x: gl.gelu(x, approximate="none"), unary(), lambda x: np_gelu(x, "none"),
         lambda x: TF.gelu(x)),
    Case("silu", gl.silu, unary(), lambda x: x * special.expit(x), lambda x: TF.silu(x)),
    Case("square", gl.square, unary(), np.square, lambda x: torch.square(x)),
    Case("erf", gl.erf, unary(), special.erf, lambda x: torch.erf(x)),
    Case("pow_3", lambda x: x ** 3, unary(), lambda x: x ** 3, lambda x: x ** 3),
    Case("pow_half", lambda x: gl.pow(x, 0.5), unary(P), np.sqrt, lambda x: x ** 0.5),
    Case("pow_neg", lambda x: gl.pow(x, -1.5), unary(P), lambda x: x ** -1.5, lambda x: x ** -1.5),
    Case("cast_roundtrip", lambda x: gl.cast(gl.cast(x, "float32"), x.dtype), unary(),
         lambda x: x.astype(np.float32).astype(x.dtype), lambda x: x.float().to(x.dtype), fd_tol=1e-2, identity_tol=1e-6),
    Case("cast_to_int", lambda x: gl.cast(x * 3.0, "int32"), unary(), lambda x: (x * 3.0).astype(np.int32),
         lambda x: (x * 3.0).to(torch.int32), fd=False, grad=False),
    Case("cast_int_to_float", lambda i: gl.cast(i, "float32"), [(I(9, 3, 4),), (I(9),)],
         lambda i: i.astype(np.float32), lambda i: i.float(), fd=False, grad=False),
    # -- reductions ---------------------------------------------------------------------------------
    Case("sum_all", gl.sum, unary(shapes=REDUCE), np.sum, lambda x: x.sum()),
    Case("sum_axis", lambda x: gl.sum(x, 1), unary(shapes=REDUCE), lambda x: x.sum(1), lambda x: x.sum(1)),
    Case("sum_keepdims", lambda x: x.sum((0, -1), keepdims=True), unary(shapes=REDUCE),
         lambda x: x.sum((0, -1), keepdims=True), lambda x: x.sum((0, -1), keepdim=True)),
    Case("mean_all", gl.mean, unary(shapes=REDUCE), np.mean, lambda x: x.mean()),
    Case("mean_axis", lambda x: gl.mean(x, -1), unary(shapes=REDUCE), lambda x: x.mean(-1),
         lambda x: x.mean(-1)),
    Case("mean_keepdims", lambda x: gl.mean(x, (0, -1), keepdims=True), unary(shapes=REDUCE),
         lambda x: x.mean((0, -1), keepdims=True), lambda x: x.mean((0, -1), keepdim=True)),
    Case("max_all", gl.max, unary(D, REDUCE), np.max, lambda x: x.max()),
    Case("max_axis", lambda x: gl.max(x, 1), unary(D, REDUCE), lambda x: x.max(1),
         lambda x: torch.amax(x, 1)),
    Case("max_keepdims", lambda x: x.max((0, -1), keepdims=True), unary(D, REDUCE),
         lambda x: x.max((0, -1), keepdims=True), lambda x: torch.amax(x, (0, -1), keepdim=True)),
    # -- views and data movement ----------------------------------------------------------------------
    Case("reshape", lambda x: gl.reshape(x, (x.shape[-1], -1)), unary(shapes=REDUCE),
         lambda x: x.reshape(x.shape[-1], -1), lambda x: x.reshape(x.shape[-1], -1)),
    Case("reshape_flat", lambda x: x.reshape(-1), unary(shapes=REDUCE), lambda x: x.reshape(-1),
         lambda x: x.reshape(-1)),
    Case("transpose", gl.transpose, unary(shapes=REDUCE), np.transpose,
         lambda x: x.permute(*reversed(range(x.ndim)))),
    Case("transpose_axes", lambda x: gl.transpose(x, (1, 0, 2)), [(F(2, 3, 4),), (F(1, 3, 2),)],
         lambda x: x.transpose(1, 0, 2), lambda x: x.permute(1, 0, 2)),
    Case("swapaxes", lambda x: gl.swapaxes(x, -1, -2), unary(shapes=REDUCE), lambda x: np.swapaxes(x, -1, -2),
         lambda x: x.transpose(-1, -2)),
    Case("broadcast_to", lambda x: gl.broadcast_to(x, grown(x.shape)), unary(shapes=[(3, 1), (4,), (), (1, 2)]),
         lambda x: np.broadcast_to(x, grown(x.shape)), lambda x: x.expand(grown(tuple(x.shape)))),
    Case("slice", lambda x: x[1:3], unary(shapes=[(4, 5), (4, 2, 3)]), lambda x: x[1:3], lambda x: x[1:3]),
    Case("slice_ellipsis_int", lambda x: x[..., 0], unary(shapes=[(4, 5), (4, 2, 3)]),
         lambda x: x[..., 0], lambda x: x[..., 0]),
    Case("slice_step", lambda x: x[::2, 1:], unary(shapes=[(4, 5), (5, 2, 3)]), lambda x: x[::2, 1:],
         lambda x: x[::2, 1:]),
    Case("slice_int_negative", lambda x: x[-1, -2:], unary(shapes=[(4, 5), (4, 3, 3)]),
         lambda x: x[-1, -2:], lambda x: x[-1, -2:]),
    Case("slice_reverse", lambda x: x[::-1], unary(shapes=[(4, 5), (3,)]), lambda x: x[::-1],
         lambda x: torch.flip(x, [0])),
    Case("slice_reverse_step", lambda x: x[3:0:-2, ::-1], unary(shapes=[(5, 3), (4, 2)]),
         lambda x: x[3:0:-2, ::-1], lambda x: torch.flip(x[torch.tensor([3, 1])], [1])),
    Case("concat", lambda a, b: gl.concat([a, b], 0), [(F(2, 3), F(4, 3)), (F(1, 2, 2), F(3, 2, 2))],
         lambda a, b: np.concatenate([a, b], 0), lambda a, b: torch.cat([a, b], 0)),
    Case("concat_last", lambda a, b, c: gl.concat([a, b, c], -1),
         [(F(2, 3, 1), F(2, 3, 2), F(2, 3, 3)), (F(2, 1), F(2, 2), F(2, 1))],
         lambda a, b, c: np.concatenate([a, b, c], -1), lambda a, b, c: torch.cat([a, b, c], -1)),
    Case("split", lambda x: (lambda a, b: a * 2.0 - b)(*gl.split(x, 2, axis=-1)),
         unary(shapes=[(3, 4), (2, 3, 6)]), lambda x: (lambda a, b: a * 2.0 - b)(*np.split(x, 2, -1)),
         lambda x: (lambda a, b: a * 2.0 - b)(*torch.chunk(x, 2, -1))),
    Case("split_middle", lambda x: gl.split(x, 3, axis=0)[1], unary(shapes=[(6, 2), (3, 1)]),
         lambda x: np.split(x, 3, 0)[1], lambda x: torch.chunk(x, 3, 0)[1]),
    # -- matmul ---------------------------------------------------------------------------------------
    Case("matmul", gl.matmul,
         [(F(3, 4), F(4, 5)), (F(4), F(4, 5)), (F(3, 4), F(4)), (F(4), F(4)), (F(2, 3, 4), F(4, 5)),
          (F(2, 1, 3, 4), F(3, 4, 2)), (F(5), F(2, 5, 3)), (F(2, 3, 4), F(4)), (F(1, 1), F(1, 3))],
         np.matmul, lambda a, b: torch.matmul(a, b)),
    Case("matmul_operator", lambda a, b: a @ b, [(F(2, 3), F(3, 2))], np.matmul, lambda a, b: a @ b),
    # -- gather / scatter --------------------------------------------------------------------------
    Case("embedding", gl.embedding, [(F(5, 3), I(5, 2, 4)), (F(4, 2), I(4, 9)), (F(3, 4), I(3)),
                                     (F(6, 2), I(6, 3, dtype="int32"))],
         lambda t, i: t[i], lambda t, i: TF.embedding(i.long(), t)),
    Case("embedding_backward", lambda i, g: apply("embedding_backward", (i, g), rows=5),
         [(I(5, 2, 4), F(2, 4, 3)), (I(5, 9), F(9, 2))], lambda i, g: np_embedding_backward(i, g, 5),
         lambda i, g: torch.zeros(5, g.shape[-1], dtype=g.dtype).index_add(0, i.reshape(-1), g.reshape(-1, g.shape[-1]))),
    Case("one_hot", lambda i: gl.one_hot(i, 5), [(I(5, 2, 3),), (I(5, 4),)],
         lambda i: np.eye(5, dtype=np.float32)[i], lambda i: TF.one_hot(i, 5).float(), fd=False, grad=False),
    # -- fused NN ops and their backward ops ---------------------------------------------------------
    Case("softmax", gl.softmax, unary(shapes=NORM + [(4, 1)]), np_softmax, lambda x: torch.softmax(x, -1)),
    Case("softmax_axis0", lambda x: gl.softmax(x, 0), unary(shapes=NORM), lambda x: np_softmax(x, 0),
         lambda x: torch.softmax(x, 0)),
    Case("log_softmax", gl.log_softmax, unary(shapes=NORM + [(4, 1)]), np_log_softmax,
         lambda x: torch.log_softmax(x, -1)),
    Case("log_softmax_axis1", lambda x: gl.log_softmax(x, 1), unary(shapes=NORM), lambda x: np_log_softmax(x, 1),
         lambda x: torch.log_softmax(x, 1)),
    Case("softmax_backward", lambda x, g: apply("softmax_backward", (gl.softmax(x), g), axis=x.ndim - 1),
         [(F(*s), F(*s)) for s in NORM], lambda x, g: (lambda y: y * (g - (g * y).sum(-1, keepdims=True)))(np_softmax(x)),
         lambda x, g: tvjp(lambda t: torch.softmax(t, -1), x, g)),
    Case("causal_attention", gl.causal_attention, [(F(*s), F(*s), F(*s)) for s in ATTENTION],
         np_causal_attention, t_causal_attention),
    Case("causal_attention_scaled", lambda q, k, v: gl.causal_attention(q, k, v, scale=0.7),
         [(F(*s), F(*s), F(*s)) for s in ATTENTION[:2]], lambda q, k, v: np_causal_attention(q, k, v, 0.7),
         lambda q, k, v: t_causal_attention(q, k, v, 0.7)),
    Case("causal_attention_backward", lambda q, k, v, g: _attention_backward(q, k, v, g, 0.6),
         [(F(*s), F(*s), F(*s), F(*s)) for s in ATTENTION],
         lambda q, k, v, g: np_causal_attention_backward(q, k, v, g, 0.6),
         lambda q, k, v, g: t_causal_attention_backward(q, k, v, g, 0.6)),
    Case("cached_attention", gl.cached_attention,
         [cached_attention_inputs((2, 3), 5, 4, 5), cached_attention_inputs((), 6, 3, 6),
          cached_attention_inputs((2,), 1, 2, 1), cached_attention_inputs((1, 2), 7, 3, 7),
          cached_attention_inputs((3,), 9, 4, 9)],   # positions 0, T-1, 0 (T = 1), T-1, 2
         np_cached_attention, t_cached_attention),
    Case("log_softmax_backward",
         lambda x, g: apply("log_softmax_backward", (gl.log_softmax(x), g), axis=x.ndim - 1),
         [(F(*s), F(*s)) for s in NORM], lambda x, g: g - np_softmax(x) * g.sum(-1, keepdims=True),
         lambda x, g: tvjp(lambda t: torch.log_softmax(t, -1), x, g)),
    Case("layer_norm", gl.layer_norm, unary(shapes=NORM), np_layer_norm,
         lambda x: TF.layer_norm(x, x.shape[-1:], eps=1e-5)),
    Case("layer_norm_weight_bias", gl.layer_norm, [(F(*s), F(s[-1]), F(s[-1])) for s in NORM], np_layer_norm,
         lambda x, w, b: TF.layer_norm(x, x.shape[-1:], w, b, eps=1e-5)),
    Case("layer_norm_weight", lambda x, w: gl.layer_norm(x, w, eps=1e-3), [(F(*s), F(s[-1])) for s in NORM],
         lambda x, w: np_layer_norm(x, w, eps=1e-3), lambda x, w: TF.layer_norm(x, x.shape[-1:], w, eps=1e-3)),
    Case("layer_norm_bias", lambda x, b: gl.layer_norm(x, bias=b), [(F(*s), F(s[-1])) for s in NORM],
         lambda x, b: np_layer_norm(x, b=b), lambda x, b: TF.layer_norm(x, x.shape[-1:], None, b, eps=1e-5)),
    Case("layer_norm_backward",
         lambda x, w, g: apply("layer_norm_backward", (x, w, g), eps=1e-5, has_weight=True),
         [(F(*s), F(s[-1]), F(*s)) for s in NORM], np_layer_norm_backward,
         lambda x, w, g: tvjp(lambda t: TF.layer_norm(t, t.shape[-1:], w, eps=1e-5), x, g), fd_tol=1e-5),
    Case("layer_norm_backward_no_weight",
         lambda x, g: apply("layer_norm_backward", (x, g), eps=1e-5, has_weight=False),
         [(F(*s), F(*s)) for s in NORM], lambda x, g: np_layer_norm_backward(x, None, g),
         lambda x, g: tvjp(lambda t: TF.layer_norm(t, t.shape[-1:], eps=1e-5), x, g), fd_tol=1e-5),
    Case("rms_norm", gl.rms_norm, unary(shapes=NORM), np_rms_norm, lambda x: TF.rms_norm(x, x.shape[-1:], eps=1e-6)),
    Case("rms_norm_weight", gl.rms_norm, [(F(*s), F(s[-1])) for s in NORM], np_rms_norm,
         lambda x, w: TF.rms_norm(x, x.shape[-1:], w, eps=1e-6)),
    Case("rms_norm_backward",
         lambda x, w, g: apply("rms_norm_backward", (x, w, g), eps=1e-6, has_weight=True),
         [(F(*s), F(s[-1]), F(*s)) for s in NORM], np_rms_norm_backward,
         lambda x, w, g: tvjp(lambda t: TF.rms_norm(t, t.shape[-1:], w, eps=1e-6), x, g)),
    Case("rms_norm_backward_no_weight",
         lambda x, g: apply("rms_norm_backward", (x, g), eps=1e-6, has_weight=False),
         [(F(*s), F(*s)) for s in NORM], lambda x, g: np_rms_norm_backward(x, None, g),
         lambda x, g: tvjp(lambda t: TF.rms_norm(t, t.shape[-1:], eps=1e-6), x, g)),
    Case("gelu_backward_tanh", lambda x, g: apply("gelu_backward", (x, g), approximate="tanh"),
         [(F(*s), F(*s)) for s in UNARY], lambda x, g: g * np_gelu_grad(x, "tanh"),
         lambda x, g: tvjp(lambda t: TF.gelu(t, approximate="tanh"), x, g)),
    Case("gelu_backward_erf", lambda x, g: apply("gelu_backward", (x, g), approximate="none"),
         [(F(*s), F(*s)) for s in UNARY], lambda x, g: g * np_gelu_grad(x, "none"),
         lambda x, g: tvjp(TF.gelu, x, g)),
    Case("cross_entropy", gl.cross_entropy, [(F(4, 5), I(5, 4)), (F(1, 3), I(3, 1)), (F(6, 2), I(2, 6, dtype="int32")),
                                             (F(5, 7), I(7, 5))],
         np_cross_entropy, lambda l, t: TF.cross_entropy(l, t.long())),
    Case("cross_entropy_backward", lambda l, t, g: apply("cross_entropy_backward", (l, t, g)),
         [(F(4, 5), I(5, 4), F()), (F(1, 3), I(3, 1), F()), (F(6, 7), I(7, 6), F())], np_cross_entropy_backward,
         lambda l, t, g: tvjp(lambda z: TF.cross_entropy(z, t), l, g)),
    Case("causal_mask", gl.causal_mask, unary(shapes=[(4, 4), (2, 3, 5), (2, 1, 3, 3)]), np_causal_mask,
         t_causal_mask, fd=False),
    Case("causal_mask_softmax", lambda x: gl.softmax(gl.causal_mask(x)), unary(shapes=[(4, 4), (2, 3, 5)]),
         lambda x: np_softmax(np_causal_mask(x)), lambda x: torch.softmax(t_causal_mask(x), -1)),
    Case("causal_mask_offset", lambda x: gl.causal_mask(x, fill=0.0, offset=1), unary(shapes=[(4, 4), (2, 3, 5)]),
         lambda x: np_causal_mask(x, 0.0, 1), lambda x: t_causal_mask(x, 0.0, 1)),
    Case("dropout", lambda x, k: gl.dropout(x, 0.3, k, stream=0), [(F(4, 5), KEY()), (F(2, 3, 4), KEY())],
         _dropout_ref, _dropout_torch),
    Case("dropout_mask", lambda k: apply("dropout_mask", (k,), p=0.25, stream=3, shape=(4, 5), dtype="<f4"),
         [(KEY(),)], lambda k: dropout_keep_scale(int(k), 3, (4, 5), 0.25, np.float32),
         lambda k: torch.from_numpy(dropout_keep_scale(int(k), 3, (4, 5), 0.25, np.float32)), fd=False, grad=False),
    # -- ops the graph passes produce (graphlm/passes) ------------------------------------------------
    Case("matmul_sum", lambda a, b: apply("matmul_sum", (a, b), axes=(0,), keepdims=False),
         [(F(4, 3, 5), F(4, 5, 2)), (F(2, 3, 2, 4), F(4, 3))],
         lambda a, b: np.sum(a @ b, 0), lambda a, b: torch.sum(a @ b, 0)),
    Case("matmul_sum_keepdims", lambda a, b: apply("matmul_sum", (a, b), axes=(0, 1), keepdims=True),
         [(F(2, 3, 4, 5), F(2, 3, 5, 2))], lambda a, b: np.sum(a @ b, (0, 1), keepdims=True),
         lambda a, b: torch.sum(a @ b, (0, 1), keepdim=True)),
    Case("matmul_accumulate", lambda a, b: apply("matmul_accumulate", (a, b), axes=(0,), keepdims=True),
         [(F(3, 4, 5), F(3, 5, 2)), (F(4, 5), F(3, 5, 2))],
         lambda a, b: np.sum(a @ b, 0, keepdims=True), lambda a, b: torch.sum(a @ b, 0, keepdim=True)),
    Case("panel_matmul", lambda x, p, b: panel_matmul(x, p, 6, b), [(F(5, 7), F(2, 7, 4), F(6))],
         lambda x, p, b: x @ _unpanel(p, 6) + b, lambda x, p, b: x @ _unpanel(p, 6) + b),
    Case("panel_matmul_batched", lambda x, p, b: panel_matmul(x, p, 3, b), [(F(2, 3, 5), F(2, 1, 5, 4), F(2, 1, 3)),
                                                                               (F(3, 5), F(2, 1, 5, 4), F(3))],
         lambda x, p, b: x @ _unpanel(p, 3) + b, lambda x, p, b: x @ _unpanel(p, 3) + b),
    Case("panel_matmul_no_bias", lambda x, p: panel_matmul(x, p, 8), [(F(4, 3), F(2, 3, 4)), (F(1, 3), F(2, 3, 4))],
         lambda x, p: x @ _unpanel(p, 8), lambda x, p: x @ _unpanel(p, 8)),
    Case("slices_assemble", lambda a, b: apply("slices_assemble", (a, b), shape=(3, 4), covered=False,
                                               indexes=[normalize_index(0, (3, 4)), normalize_index(2, (3, 4))]),
         [(F(4), F(2, 2))], lambda a, b: np.stack([a, np.zeros(4), b.reshape(4)]),
         lambda a, b: torch.stack([a, torch.zeros(4, dtype=a.dtype), b.reshape(4)])),
    Case("softmax_fused", lambda x: apply("softmax_fused", (x, x.graph.const(np.asarray(0.7, x.dtype))),
                                          mask=(-math.inf, 0), scale_pos=1),
         unary(shapes=[(4, 4), (2, 3, 5)]), lambda x: np_softmax(np_causal_mask(x * 0.7)),
         lambda x: torch.softmax(t_causal_mask(x * 0.7), -1)),
    Case("softmax_fused_scale_only", lambda x: apply("softmax_fused", (x, x.graph.const(np.asarray(0.5, x.dtype))),
                                                     mask=None, scale_pos=1),
         unary(shapes=[(3, 4)]), lambda x: np_softmax(x * 0.5), lambda x: torch.softmax(x * 0.5, -1)),
    Case("softmax_backward_fused",
         lambda x, g: apply("softmax_backward_fused", (gl.softmax(x), g, x.graph.const(np.asarray(0.7, x.dtype))),
                            axis=x.ndim - 1, mask=(0.0, 0), scale_pos=0),
         [(F(4, 4), F(4, 4)), (F(2, 3, 5), F(2, 3, 5))],
         lambda x, g: np_causal_mask((lambda y: y * (g - (g * y).sum(-1, keepdims=True)))(np_softmax(x)), 0.0) * 0.7,
         lambda x, g: t_causal_mask(tvjp(lambda t: torch.softmax(t, -1), x, g), 0.0) * 0.7),
    Case("gelu_sigmoid", lambda x: apply("gelu_sigmoid", (x,)), unary(),
         lambda x: 0.5 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
         lambda x: 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    Case("gelu_backward_sigmoid", lambda x, g: apply("gelu_backward_sigmoid", (x, g, apply("gelu_sigmoid", (x,)))),
         [(F(*s), F(*s)) for s in UNARY], lambda x, g: g * np_gelu_grad(x, "tanh"),
         lambda x, g: tvjp(lambda t: TF.gelu(t, approximate="tanh"), x, g)),
    Case("affine_grads", lambda g, x, *d: apply("affine_grads", (g, x, *d)),   # (d: x / d, one d per row)
         [(F(4, 5), F(4, 5)), (F(2, 3, 4), F(2, 3, 4)), (F(4, 5), F(4, 5), P(4, 1)), (F(2, 3, 4), F(2, 3, 4), P(2, 3, 1))],
         lambda g, x, *d: np.concatenate([(g * (x / d[0] if d else x)).reshape(-1, x.shape[-1]).sum(0),
                                          g.reshape(-1, x.shape[-1]).sum(0)]),
         lambda g, x, *d: torch.cat([(g * (x / d[0] if d else x)).reshape(-1, x.shape[-1]).sum(0),
                                     g.reshape(-1, x.shape[-1]).sum(0)])),
    Case("bias_gelu", lambda m, b: apply("bias_gelu", (m, b), approximate="tanh"), [(F(4, 5), F(5)), (F(2, 3, 4), F(4))],
         lambda m, b: np_gelu(m + b, "tanh"), lambda m, b: TF.gelu(m + b, approximate="tanh")),
    Case("bias_gelu_backward", lambda m, b, g: apply("bias_gelu_backward", (m, b, g), approximate="tanh"),
         [(F(4, 5), F(5), F(4, 5)), (F(2, 3, 4), F(4), F(2, 3, 4))], lambda m, b, g: g * np_gelu_grad(m + b, "tanh"),
         lambda m, b, g: tvjp(lambda t: TF.gelu(t + b, approximate="tanh"), m, g)),
    Case("layer_norm_keep", lambda x, w, b: apply("layer_norm_keep", (x, w, b), eps=1e-5, has_weight=True,
                                                  has_bias=True, keep_xhat=True),
         [(F(*s), F(s[-1]), F(s[-1])) for s in NORM], _np_layer_norm_keep, _t_layer_norm_keep, fd_tol=1e-5),
    Case("layer_norm_backward_kept", _layer_norm_backward_kept,
         [(F(*s), F(s[-1]), F(*s)) for s in NORM], np_layer_norm_backward,
         lambda x, w, g: tvjp(lambda t: TF.layer_norm(t, t.shape[-1:], w, eps=1e-5), x, g), fd_tol=1e-5),
    Case("layer_norm_backward_kept_residual", _layer_norm_backward_kept,
         [(F(*s), F(s[-1]), F(*s), F(*s)) for s in NORM[:2]], lambda x, w, g, r: r + np_layer_norm_backward(x, w, g),
         lambda x, w, g, r: r + tvjp(lambda t: TF.layer_norm(t, t.shape[-1:], w, eps=1e-5), x, g), fd_tol=1e-5),
    Case("causal_attention_keep", _attention_keep, [(F(*s), F(*s), F(*s)) for s in ATTENTION_KEEP],
         lambda q, k, v: _attention_keep_ref(q, k, v, 0.6, 2, np), lambda q, k, v: _attention_keep_ref(q, k, v, 0.6, 2, torch)),
    Case("causal_attention_backward_kept", _attention_backward_kept,
         [(F(*s), F(*s), F(*s), F(*s)) for s in ATTENTION_KEEP],
         lambda q, k, v, g: np_causal_attention_backward(q, k, v, g, 0.6),
         lambda q, k, v, g: t_causal_attention_backward(q, k, v, g, 0.6)),
    # heads_merged (graphlm/passes/merged_heads.py): the same values, [..., T, H, D]
    Case("causal_attention_heads_merged", _attention_merged, [(F(*s), F(*s), F(*s)) for s in ATTENTION_MERGED],
         lambda q, k, v: _merged(np_causal_attention(q, k, v, 0.6)),
         lambda q, k, v: _merged(t_causal_attention(q, k, v, 0.6))),
    Case("causal_attention_backward_heads_merged", _attention_backward_merged,
         [(F(*s), F(*s), F(*s), F(*s)) for s in ATTENTION_MERGED],
         lambda q, k, v, g: _merged(np_causal_attention_backward(q, k, v, g, 0.6)),
         lambda q, k, v, g: _merged(t_causal_attention_backward(q, k, v, g, 0.6))),
    Case("causal_attention_keep_heads_merged",
         lambda q, k, v: apply("causal_attention_keep", (q, k, v), scale=0.6, query_block=2, heads_merged=True),
         [(F(*s), F(*s), F(*s)) for s in ATTENTION_MERGED],
         lambda q, k, v: _attention_keep_merged_ref(q, k, v, np), lambda q, k, v: _attention_keep_merged_ref(q, k, v, torch)),
    Case("causal_attention_backward_kept_heads_merged", _attention_backward_kept_merged,
         [(F(*s), F(*s), F(*s), F(*s)) for s in ATTENTION_MERGED],
         lambda q, k, v, g: _merged(np_causal_attention_backward(q, k, v, g, 0.6)),
         lambda q, k, v, g: _merged(t_causal_attention_backward(q, k, v, g, 0.6))),
    Case("dropout_keep", lambda k: apply("dropout_keep", (k,), p=0.25, stream=3, shape=(4, 5)),
         [(KEY(),)], lambda k: counter_uniform(int(k), 3, (4, 5)) >= np.float32(0.25),
         lambda k: torch.from_numpy(counter_uniform(int(k), 3, (4, 5)) >= np.float32(0.25)), fd=False, grad=False),
    Case("dropout_apply", lambda x, k: apply("dropout_apply", (x, apply("dropout_keep", (k,), p=0.3, stream=0,
                                                                        shape=x.shape)), p=0.3),
         [(F(4, 5), KEY()), (F(2, 3, 4), KEY())], _dropout_ref, _dropout_torch),
    Case("bias_dropout_add", lambda r, m, b, k: apply("bias_dropout_add", (r, m, b, apply(
        "dropout_keep", (k,), p=0.3, stream=0, shape=r.shape)), p=0.3),
         [(F(4, 5), F(4, 5), F(5), KEY()), (F(2, 3, 4), F(2, 3, 4), F(4), KEY())],
         lambda r, m, b, k: r + _dropout_ref(m + b, k), lambda r, m, b, k: r + _dropout_torch(m + b, k)),
    Case("slice_backward",
         lambda g: apply("slice_backward", (g,), in_shape=(4, 5), index=normalize_index(SLICE_IDX, (4, 5))),
         [(F(2),)], lambda g: np_slice_backward(g, (4, 5), SLICE_IDX), zeros_vjp((4, 5), SLICE_IDX)),
    Case("global_norm", lambda a, b: gl.ops.global_norm([a, b]), [(F(3, 4), F(5)), (F(1), F())],
         lambda a, b: np.sqrt((a * a).sum() + (b * b).sum()),
         lambda a, b: torch.sqrt((a * a).sum() + (b * b).sum()), fd=False, grad=False),
]

PARAMS = [pytest.param(c, k, id=f"{c.name}-{k}") for c in CASES for k in range(len(c.inputs))]
FD_PARAMS = [p for p in PARAMS if p.values[0].fd]


def inputs_of(case: Case, k: int) -> list[np.ndarray]:
    return make_inputs(f"{case.name}-{k}", case.inputs[k])


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,k", PARAMS)
def test_forward_matches_numpy_formula(case, k):
    arrays = inputs_of(case, k)
    g, _, out = build(case.f, arrays)
    (y,) = run(g, [out], feeds_of(arrays))
    expected = np.asarray(case.ref(*arrays))
    assert y.shape == out.shape == expected.shape
    assert y.dtype == out.dtype
    if expected.dtype.kind == "f":
        assert_close(y, expected.astype(y.dtype), 1e-12, 1e-12, f"{case.name} forward vs NumPy")
    else:
        np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("case,k", FD_PARAMS)
def test_gradients_match_central_differences(case, k):
    check_grads(case.f, inputs_of(case, k), rtol=case.fd_tol, atol=case.fd_tol / 10,
                identity_rtol=case.identity_tol)


@pytest.mark.skipif(torch is None, reason="torch is the oracle and is not installed")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case,k", PARAMS)
def test_matches_torch(case, k, dtype):
    tol = case.tol32 if dtype == "float32" and case.tol32 else None
    check_torch(case.f, case.torch, inputs_of(case, k), dtype, tol=tol, grad=case.grad)


# -- coverage -------------------------------------------------------------------------------------

LEAVES = {"input", "param", "state", "const"}


def ops_in(case: Case) -> set[str]:
    ops = set()
    for k in range(len(case.inputs)):
        g, _, _ = build(case.f, inputs_of(case, k))
        ops |= {n.op for n in g.nodes}
    return ops


OPS_BY_CASE = {}


def covered_ops() -> set[str]:
    if not OPS_BY_CASE:
        OPS_BY_CASE.update({c.name: ops_in(c) for c in CASES})
    return set().union(*OPS_BY_CASE.values())


def test_every_registered_op_has_a_row():
    """A new op needs a row in CASES (optimizer update ops are tested with the optimizers)."""
    missing = sorted(n for n, op in REGISTRY.items()
                     if n not in LEAVES and not op.updates_state and n not in covered_ops())
    assert not missing, f"ops with no row in tests/test_ops.py CASES: {missing}"


def test_every_differentiable_op_has_its_gradient_checked():
    fd_ops = set().union(*(OPS_BY_CASE.get(c.name) or ops_in(c) for c in CASES if c.fd))
    missing = sorted(n for n, op in REGISTRY.items()
                     if op.differentiable and n not in LEAVES and not op.updates_state and n not in fd_ops)
    assert not missing, f"differentiable ops without a finite-difference gradient row: {missing}"


# -- fused vs composed ------------------------------------------------------------------------------

FUSED = sorted(n for n, op in REGISTRY.items() if op.decompose is not None)


@pytest.mark.parametrize("op_name", FUSED)
def test_fused_op_agrees_with_its_decomposition(op_name):
    """Every node of `op_name` in the table's graphs, evaluated fused and decomposed."""
    decompose = REGISTRY[op_name].decompose
    checked = 0
    for case in CASES:
        for k in range(len(case.inputs)):
            arrays = inputs_of(case, k)
            g, leaves, _ = build(case.f, arrays)
            nodes = [n for n in list(g.nodes) if n.op == op_name]
            if not nodes:
                continue
            for node in nodes[:1]:
                before = len(g.nodes)
                composed = decompose(*node.inputs, **node.attrs)
                assert composed.shape == node.shape and composed.dtype == node.dtype
                assert op_name not in {n.op for n in g.nodes[before:]}, \
                    f"the decomposition of {op_name} uses {op_name} itself"
                outs = [node, composed]
                floats = [l for l in leaves if l.dtype.kind == "f"]
                if node.dtype.kind == "f" and floats and REGISTRY[op_name].differentiable:
                    u = g.const(np.random.default_rng(k).standard_normal(node.shape))
                    outs += gl.grad(gl.sum(node * u), floats) + gl.grad(gl.sum(composed * u), floats)
                program = executors.compile(g, outs)
                vals = program.run({k: v for k, v in feeds_of(arrays).items() if k in program.input_nodes})
                assert_close(vals[1], vals[0], 1e-12, 1e-12, f"{op_name} decomposed vs fused ({case.name}-{k})")
                n = len(floats) if len(vals) > 2 else 0
                for a, b in zip(vals[2:2 + n], vals[2 + n:]):
                    assert_close(b, a, 1e-10, 1e-12, f"{op_name} gradient decomposed vs fused ({case.name}-{k})")
                checked += 1
    assert checked, f"no row of tests/test_ops.py CASES uses the fused op '{op_name}'; add one"
