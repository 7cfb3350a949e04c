"""Kernels of the numpy executor: softmax (plain and with scale and causal mask folded in),
log-softmax, layer norm (with its kept statistics), RMS norm and cross entropy, forward and backward."""
from __future__ import annotations

import functools

import numpy as np

from graphlm.ops import kept_backward_parts, layer_norm_keep_layout, norm_parts

from ..base import check_index_range
from .table import kernel, scalar
from .tiling import SMALL, by_matrices, by_rows, flat_view, keep_shape, mean_last, row_shape, rowwise


@kernel("softmax", inplace=(0,), scratch=lambda node, pos: [(keep_shape(node, node.attrs["axis"]), node.dtype)])
def _softmax(node, out, ins, scratch):
    (x,), (m,), axis = ins, scratch, node.attrs["axis"]
    ax = -1 if axis == node.ndim - 1 else axis   # blocks are 2-d views

    def body(x, out, m):  # np.maximum.reduce / np.add.reduce: what np.max / np.sum call
        np.maximum.reduce(x, axis=ax, keepdims=True, out=m)
        np.subtract(x, m, out)
        np.exp(out, out)
        np.add.reduce(out, axis=ax, keepdims=True, out=m)
        np.divide(out, m, out)
    return by_rows(node, axis, body, [x, out, m])


@kernel("softmax_backward", scratch=lambda node, pos: [(keep_shape(node, node.attrs["axis"]), node.dtype)])
def _softmax_backward(node, out, ins, scratch):
    (y, g), (s,), axis = ins, scratch, node.attrs["axis"]
    ax = -1 if axis == node.ndim - 1 else axis   # blocks are 2-d views

    def body(y, g, out, s):  # y*(g - sum(g*y))
        np.multiply(g, y, out=out)
        np.sum(out, axis=ax, keepdims=True, out=s)
        np.subtract(g, s, out=out)
        np.multiply(y, out, out=out)
    return by_rows(node, axis, body, [y, g, out, s])


def _above(node, offset):
    t, s_ = node.shape[-2:]
    return ~np.tri(t, s_, k=offset, dtype=bool)


@kernel("softmax_fused", inplace=(0,), scratch=lambda node, pos: [(node.shape[:-1] + (1,), node.dtype)])
def _softmax_fused(node, out, ins, scratch):
    x, k = ins[0], (ins[1] if len(ins) > 1 else None)
    (m,), a = scratch, node.attrs
    mask, pos = a["mask"], a["scale_pos"]
    above = _above(node, mask[1]) if mask else None
    fill = scalar(mask[0], node.dtype) if mask else None

    def body(x, out, m):  # the mul, causal_mask and softmax kernels' arithmetic, in order
        src = x
        if k is not None:
            np.multiply(*((x, k) if pos == 1 else (k, x)), out=out)
            src = out
        if above is not None:
            if src is not out:
                np.copyto(out, src)
            np.copyto(out, fill, where=above)
            src = out
        np.maximum.reduce(src, axis=-1, keepdims=True, out=m)
        np.subtract(src, m, out)
        np.exp(out, out)
        np.add.reduce(out, axis=-1, keepdims=True, out=m)
        np.divide(out, m, out)
    return by_matrices(body, [x, out, m], node.shape)


@kernel("softmax_backward_fused", scratch=lambda node, pos: [(node.shape[:-1] + (1,), node.dtype)])
def _softmax_backward_fused(node, out, ins, scratch):
    y, g, k = ins[0], ins[1], (ins[2] if len(ins) > 2 else None)
    (s_,), a = scratch, node.attrs
    mask, pos = a["mask"], a["scale_pos"]
    above = _above(node, mask[1]) if mask else None
    zero = scalar(0.0, node.dtype)

    def body(y, g, out, s_):  # the softmax_backward, causal_mask and mul kernels' arithmetic
        np.multiply(g, y, out=out)
        np.sum(out, axis=-1, keepdims=True, out=s_)
        np.subtract(g, s_, out=out)
        np.multiply(y, out, out=out)
        if above is not None:
            np.copyto(out, zero, where=above)
        if k is not None:
            np.multiply(*((out, k) if pos == 1 else (k, out)), out=out)
    return by_matrices(body, [y, g, out, s_], node.shape)


@kernel("log_softmax", inplace=(0,),
        scratch=lambda node, pos: [(node.shape, node.dtype), (keep_shape(node, node.attrs["axis"]), node.dtype)])
def _log_softmax(node, out, ins, scratch):
    (x,), (e, m), axis = ins, scratch, node.attrs["axis"]

    def run():  # s = x - max(x); s - log(sum(exp(s)))
        np.max(x, axis=axis, keepdims=True, out=m)
        np.subtract(x, m, out=out)
        np.exp(out, out=e)
        np.sum(e, axis=axis, keepdims=True, out=m)
        np.log(m, out=m)
        np.subtract(out, m, out=out)
    return run


@kernel("log_softmax_backward", inplace=(0,),
        scratch=lambda node, pos: [(keep_shape(node, node.attrs["axis"]), node.dtype)])
def _log_softmax_backward(node, out, ins, scratch):
    (y, g), (s,), axis = ins, scratch, node.attrs["axis"]

    def run():  # g - exp(y)*sum(g)
        np.sum(g, axis=axis, keepdims=True, out=s)
        np.exp(y, out=out)
        np.multiply(out, s, out=out)
        np.subtract(g, out, out=out)
    return run


@kernel("layer_norm", inplace=(0,),
        scratch=lambda node, pos: [(node.shape, node.dtype), (row_shape(node), node.dtype), (row_shape(node), node.dtype)])
def _layer_norm(node, out, ins, scratch):
    x, w, b, _ = norm_parts(ins, node.attrs)
    sq, m, v = scratch
    eps = scalar(node.attrs["eps"], node.dtype)

    if node.size <= SMALL and x.dtype in (np.float32, np.float64):
        # few rows (decoding): the fewest NumPy calls, with the count and eps as arrays of m's
        # shape (a float count divides exactly as np.mean's intp one: see mean_last)
        count = np.full(m.shape, node.shape[-1], node.dtype)
        eps_rows = np.full(v.shape, eps, node.dtype)
        reduce, divide, subtract, multiply, add, sqrt = (np.add.reduce, np.divide, np.subtract,
                                                         np.multiply, np.add, np.sqrt)

        def run_small():
            reduce(x, axis=-1, keepdims=True, out=m)
            divide(m, count, m)
            subtract(x, m, out)
            multiply(out, out, sq)
            reduce(sq, axis=-1, keepdims=True, out=v)
            divide(v, count, v)
            add(v, eps_rows, v)
            sqrt(v, v)
            divide(out, v, out)
            if w is not None:
                multiply(out, w, out)
            if b is not None:
                add(out, b, out)
        return run_small

    def body(x, out, sq, m, v):  # xc = x - mean(x); xc / sqrt(mean(xc*xc) + eps) * w + b
        mean_last(x, m)
        np.subtract(x, m, out=out)
        np.multiply(out, out, out=sq)
        mean_last(sq, v)
        np.add(v, eps, out=v)
        np.sqrt(v, out=v)
        np.divide(out, v, out=out)
        if w is not None:
            np.multiply(out, w, out=out)
        if b is not None:
            np.add(out, b, out=out)
    return rowwise(body, [x, out, sq, m, v], node.size // node.shape[-1])   # (cache blocks of rows measured no faster)


def layer_norm_keep_views(out, node) -> dict:
    """The parts of a layer_norm_keep node's flat output (graphlm.ops.layer_norm_keep_layout) as
    views: y, xc, sv (per row) and, with keep_xhat, xhat."""
    x = node.inputs[0]
    return {name: out[a:b].reshape(shape) for name, a, b, shape in
            layer_norm_keep_layout(x.shape, node.attrs["keep_xhat"])}


@kernel("layer_norm_keep", scratch=lambda node, pos: [(node.inputs[0].shape, node.dtype),
                                                      (node.inputs[0].shape[:-1] + (1,), node.dtype)])
def _layer_norm_keep(node, out, ins, scratch):
    x, w, b, _ = norm_parts(ins, node.attrs)
    sq, m = scratch
    parts = layer_norm_keep_views(out, node)
    y, xhat = parts["y"], parts.get("xhat")
    eps = scalar(node.attrs["eps"], node.dtype)
    separate = xhat is not None

    def body(x, out, sq, m, xc, v, xhat):  # the layer_norm kernel's arithmetic, keeping xc, sv and xhat
        mean_last(x, m)
        np.subtract(x, m, out=xc)
        np.multiply(xc, xc, out=sq)
        mean_last(sq, v)
        np.add(v, eps, out=v)
        np.sqrt(v, out=v)
        np.divide(xc, v, out=xhat)
        y = xhat
        if w is not None:
            np.multiply(y, w, out=out)
            y = out
        if b is not None:
            np.add(y, b, out=out)
        elif w is None and separate:   # (views of one array are distinct objects: no `is` test)
            np.copyto(out, xhat)
    return rowwise(body, [x, y, sq, m, parts["xc"], parts["sv"], xhat if separate else y], x.size // x.shape[-1])


def _g_position(node):
    """The input a layer_norm_backward_kept may write over: g (read whole before the output)."""
    return (len(node.inputs) - (2 if node.attrs.get("residual") else 1),)


@kernel("layer_norm_backward_kept", inplace=_g_position,
        scratch=lambda node, pos: [(node.shape, node.dtype)] * 2 + [(row_shape(node), node.dtype)] * 3)
def _layer_norm_backward_kept(node, out, ins, scratch):
    xc, sv, w, g, residual = kept_backward_parts(ins, node.attrs)   # inputs: xc, sv, [w], g, [r]
    xhat, gh, r, m1, m2 = scratch
    one = scalar(1.0, node.dtype)

    def body(xc, sv, g, out, xhat, gh, r, m1, m2, residual=None):   # layer_norm_backward's arithmetic from kept xc, sv
        np.divide(one, sv, out=r)
        np.multiply(xc, r, out=xhat)
        _layer_norm_backward_from_xhat(xhat, r, g, w, out, gh, m1, m2)
        if residual is not None:
            np.add(residual, out, out=out)
    arrays = [xc, sv, g, out, xhat, gh, r, m1, m2] + ([residual] if residual is not None else [])
    return rowwise(body, arrays, node.size // node.shape[-1])


def _last_and_first(node):
    return (len(node.inputs) - 1, 0)


@kernel("layer_norm_backward", inplace=_last_and_first,
        scratch=lambda node, pos: [(node.shape, node.dtype)] * 2 + [(row_shape(node), node.dtype)] * 4)
def _layer_norm_backward(node, out, ins, scratch):
    x, w, _, (g,) = norm_parts(ins, node.attrs)
    xhat, gh, m, r, m1, m2 = scratch
    eps, one = scalar(node.attrs["eps"], node.dtype), scalar(1.0, node.dtype)

    def body(x, g, out, xhat, gh, m, r, m1, m2):  # r*(gh - mean(gh) - xhat*mean(gh*xhat))
        mean_last(x, m)
        np.subtract(x, m, out=xhat)
        np.multiply(xhat, xhat, out=gh)
        mean_last(gh, r)
        np.add(r, eps, out=r)
        np.sqrt(r, out=r)
        np.divide(one, r, out=r)
        np.multiply(xhat, r, out=xhat)
        _layer_norm_backward_from_xhat(xhat, r, g, w, out, gh, m1, m2)
    return rowwise(body, [x, g, out, xhat, gh, m, r, m1, m2], node.size // node.shape[-1])


def _layer_norm_backward_from_xhat(xhat, r, g, w, out, gh, m1, m2):
    """out = r*(gh - mean(gh) - xhat*mean(gh*xhat)) with gh = g*w; overwrites xhat and gh."""
    if w is not None:
        np.multiply(g, w, out=gh)
    else:
        np.copyto(gh, g)
    np.multiply(gh, xhat, out=out)
    mean_last(out, m2)
    mean_last(gh, m1)
    np.multiply(xhat, m2, out=xhat)
    np.subtract(gh, m1, out=out)
    np.subtract(out, xhat, out=out)
    np.multiply(r, out, out=out)


@kernel("rms_norm", inplace=(0,),
        scratch=lambda node, pos: ([(node.shape, node.dtype)] if pos is not None else []) + [(row_shape(node), node.dtype)])
def _rms_norm(node, out, ins, scratch):
    x, w, _, _ = norm_parts(ins, node.attrs)
    sq, v = (scratch if len(scratch) == 2 else (out, scratch[0]))
    eps = scalar(node.attrs["eps"], node.dtype)

    def run():  # x / sqrt(mean(x*x) + eps) * w
        np.multiply(x, x, out=sq)
        mean_last(sq, v)
        np.add(v, eps, out=v)
        np.sqrt(v, out=v)
        np.divide(x, v, out=out)
        if w is not None:
            np.multiply(out, w, out=out)
    return run


@kernel("rms_norm_backward", inplace=_last_and_first,
        scratch=lambda node, pos: [(node.shape, node.dtype)] * 2 + [(row_shape(node), node.dtype)] * 3)
def _rms_norm_backward(node, out, ins, scratch):
    x, w, _, (g,) = norm_parts(ins, node.attrs)
    t, gh, r, r3, m = scratch
    eps, one = scalar(node.attrs["eps"], node.dtype), scalar(1.0, node.dtype)

    def run():  # r*gh - x*(r*r*r)*mean(gh*x)
        np.multiply(x, x, out=t)
        mean_last(t, r)
        np.add(r, eps, out=r)
        np.sqrt(r, out=r)
        np.divide(one, r, out=r)
        if w is not None:
            np.multiply(g, w, out=gh)
        else:
            np.copyto(gh, g)
        np.multiply(gh, x, out=t)
        mean_last(t, m)
        np.multiply(r, r, out=r3)
        np.multiply(r3, r, out=r3)
        np.multiply(x, r3, out=t)
        np.multiply(t, m, out=t)
        np.multiply(r, gh, out=out)
        np.subtract(out, t, out=out)
    return run


def _picker(node, logits, targets, idx, picked):
    """A closure filling `picked[i] = logits[i, targets[i]]` without allocating."""
    n, v = logits.shape
    flat = flat_view(logits, (-1,))
    if flat is None:
        def pick_slow():
            picked[...] = logits[np.arange(n), targets]
        return pick_slow
    row_start = np.arange(n, dtype=np.intp) * v

    def pick():
        np.add(row_start, targets, out=idx)
        np.take(flat, idx, out=picked, mode="clip")
    return pick


def _ce_scratch(node, pos):
    n, v = node.inputs[0].shape
    dt = node.inputs[0].dtype
    return [((n, v), dt), ((n, 1), dt), ((n,), dt), ((n,), np.intp), ((n,), dt)]


@kernel("cross_entropy", scratch=_ce_scratch)
def _cross_entropy(node, out, ins, scratch):
    logits, targets = ins
    e, m, lse, idx, picked = scratch
    v = logits.shape[1]
    m0 = m[:, 0]
    pick = _picker(node, logits, targets, idx, picked)

    def run():  # mean(log(sum(exp(logits - max))) + max - logits[target])
        check_index_range(node, targets, v, "target")
        np.max(logits, axis=1, keepdims=True, out=m)
        np.subtract(logits, m, out=e)
        np.exp(e, out=e)
        np.sum(e, axis=1, out=lse)
        np.log(lse, out=lse)
        np.add(lse, m0, out=lse)
        pick()
        np.subtract(lse, picked, out=lse)
        np.mean(lse, out=out)
    return run


def _ce_backward_scratch(node, pos):
    n, v = node.shape
    return [((n, 1), node.dtype), ((n,), np.intp), ((n,), node.dtype), ((), node.dtype)]


@kernel("cross_entropy_backward", inplace=(0,), scratch=_ce_backward_scratch)
def _cross_entropy_backward(node, out, ins, scratch):
    logits, targets, g = ins
    s, idx, picked, scale = scratch
    n, v = node.shape
    count, one = scalar(n, node.dtype), scalar(1.0, node.dtype)
    pick = _picker(node, out, targets, idx, picked)
    flat_out = flat_view(out, (-1,))

    def run():  # (softmax(logits) - onehot(targets)) * g / N
        check_index_range(node, targets, v, "target")
        np.max(logits, axis=-1, keepdims=True, out=s)
        np.subtract(logits, s, out=out)
        np.exp(out, out=out)
        np.sum(out, axis=-1, keepdims=True, out=s)
        np.divide(out, s, out=out)
        pick()
        np.subtract(picked, one, out=picked)
        flat_out[idx] = picked
        np.divide(g, count, out=scale)
        np.multiply(out, scale, out=out)
    return run
