"""The native executor's row kernels in C (kernels.c): one fused pass per row or element range.

    add and multiply, outer sums, copies     (NumPy's arithmetic and order, without its overheads)
    exp, tanh GELU and its backward          (a vectorised float32 exp, within 2 ulp; also with a bias
                                             added where the GELU reads it: bias_gelu)
    softmax over the last axis               (rowmax, exp, rowsum and divide in one pass per row)
    layer norm and its backward              (one pass per row; row sums in 16 partial sums)
    cross entropy and its backward           (one pass per row; the mean over rows by NumPy)
    the embedding gradient                   (np.add.at's order, in column ranges)
    dropout                                  (the mask drawn and applied in one pass)
    the global norm's dots                   (NumPy's OpenBLAS sdot, gradients shared out on the team)
    AdamW                                    (one pass per parameter)

On n threads each runs as n calls on the C worker team (`split_calls`); AdamW's parameters and
the global norm's gradients are shared out by size on it.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from graphlm.ops import GELU_A, GELU_B, GELU_DA, GELU_DB, kept_backward_parts, norm_parts
from graphlm.random import stream_base

from .. import reference
from ..base import check_index_range
from ..numpy.dropout import keep_threshold
from ..numpy.norms import layer_norm_keep_views
from ..numpy.optimizer import adamw_schedule
from .build import library
from .table import native_kernel
from .team import blas_sdot, checked_closure, native_arrays, ptr, ptr_at, single_call, sized_calls, split_calls



@native_kernel("exp", rounds_own_way=True)
def _exp(node, out, ins, scratch):
    (x,) = ins
    if node.dtype != np.float32 or x.shape != out.shape or not native_arrays(x, out):
        return None
    fn = library().gl_exp
    return split_calls(lambda lo, hi: functools.partial(fn, ptr_at(x, 1, lo), ptr_at(out, 1, lo), hi - lo),
                        out.size, 1, (x, out))


@native_kernel("softmax", rounds_own_way=True)
def _softmax(node, out, ins, scratch):
    (x,) = ins
    if node.dtype != np.float32 or node.attrs["axis"] != node.ndim - 1 or x.shape != out.shape \
            or not native_arrays(x, out) or node.size == 0:
        return None
    fn, cols = library().gl_softmax_rows, node.shape[-1]
    return split_calls(lambda lo, hi: functools.partial(fn, ptr_at(x, cols, lo), ptr_at(out, cols, lo), hi - lo, cols),
                        node.size // cols, cols, (x, out))


def _gelu_closure(node, x, out, keep):
    fn = library().gl_gelu_tanh
    return split_calls(lambda lo, hi: functools.partial(fn, ptr_at(x, 1, lo), ptr_at(out, 1, lo), ptr_at(keep, 1, lo),
                                                         hi - lo, GELU_A, GELU_B), out.size, 1, (x, out, keep))


@native_kernel("gelu", rounds_own_way=lambda node: node.attrs["approximate"] == "tanh")
def _gelu(node, out, ins, scratch):
    (x,) = ins
    if node.attrs["approximate"] != "tanh" or node.dtype != np.float32 or not native_arrays(x, out):
        return None
    return _gelu_closure(node, x, out, None)


@native_kernel("gelu_sigmoid", rounds_own_way=True)
def _gelu_sigmoid(node, out, ins, scratch):
    (x,) = ins
    if node.dtype != np.float32 or not native_arrays(x, out):
        return None
    fn = library().gl_gelu_tanh_sigmoid
    return split_calls(lambda lo, hi: functools.partial(fn, ptr_at(x, 1, lo), ptr_at(out, 1, lo), hi - lo,
                                                         GELU_A, GELU_B), out.size, 1, (x, out))


def _gelu_backward_closure(x, g, s, out):
    fn = library().gl_gelu_tanh_backward
    return split_calls(lambda lo, hi: functools.partial(
        fn, ptr_at(x, 1, lo), ptr_at(g, 1, lo), ptr_at(s, 1, lo), ptr_at(out, 1, lo), hi - lo,
        GELU_A, GELU_B, GELU_DA, GELU_DB), out.size, 1, (x, g, s, out))


@native_kernel("gelu_backward", rounds_own_way=lambda node: node.attrs["approximate"] == "tanh")
def _gelu_backward(node, out, ins, scratch):
    x, g = ins
    if node.attrs["approximate"] != "tanh" or node.dtype != np.float32 or not native_arrays(x, g, out):
        return None
    return _gelu_backward_closure(x, g, None, out)


@native_kernel("gelu_backward_sigmoid", rounds_own_way=True)
def _gelu_backward_sigmoid(node, out, ins, scratch):
    x, g, s = ins
    if node.dtype != np.float32 or not native_arrays(x, g, s, out):
        return None
    return _gelu_backward_closure(x, g, s, out)


def _bias_rows(m, b, *more) -> bool:
    """Whether m (and the arrays `more` of its shape) are contiguous float32 rows and b one row
    along their last axis, as the bias GELU kernels take them."""
    return m.ndim >= 2 and b.shape == m.shape[-1:] and native_arrays(m, b, *more)


@native_kernel("bias_gelu", rounds_own_way=lambda node: node.attrs["approximate"] == "tanh")
def _bias_gelu(node, out, ins, scratch):
    m, b = ins
    if node.attrs["approximate"] != "tanh" or node.dtype != np.float32 or not _bias_rows(m, b, out):
        return None
    fn, cols = library().gl_bias_gelu_tanh, node.shape[-1]
    return split_calls(lambda lo, hi: functools.partial(fn, ptr(m), ptr(b), ptr(out), cols, lo, hi, GELU_A, GELU_B),
                       node.size // cols, cols, (m, b, out))


@native_kernel("bias_gelu_backward", rounds_own_way=lambda node: node.attrs["approximate"] == "tanh")
def _bias_gelu_backward(node, out, ins, scratch):
    m, b, g = ins
    if node.attrs["approximate"] != "tanh" or node.dtype != np.float32 or not _bias_rows(m, b, g, out):
        return None
    fn, cols = library().gl_bias_gelu_tanh_backward, node.shape[-1]
    return split_calls(lambda lo, hi: functools.partial(fn, ptr(m), ptr(b), ptr(g), ptr(out), cols, lo, hi,
                                                         GELU_A, GELU_B, GELU_DA, GELU_DB),
                       node.size // cols, cols, (m, b, g, out))


# == memory-bound ops: add and multiply, sums over outer axes, strided copies ================================
# NumPy's arithmetic in NumPy's order (kernels.c): the numpy executor's bits, without NumPy's
# per-call and per-inner-loop cost (a strided copy in rows of 32 floats is one NumPy inner loop
# per row), and on n threads split over the C team where the numpy executor runs them whole.

_BINARY_OPS = {"add": 0, "mul": 1}   # gl_binary_rows' op codes


def _row_broadcast(y_shape, shape) -> tuple[int, int] | None:
    """(rpy, ny): y's row for row i of `shape` seen as [rows, shape[-1]] is (i // rpy) % ny, for
    a `y_shape` broadcasting to `shape` that is whole along the last axis and whose other
    non-1 axes are one run of `shape`'s; None otherwise."""
    full = (1,) * (len(shape) - len(y_shape)) + tuple(y_shape)
    if not shape or full[-1] != shape[-1]:
        return None
    kept = [i for i, d in enumerate(full[:-1]) if d != 1]
    if not kept:
        return 1, 1
    a, b = kept[0], kept[-1] + 1
    if any(full[i] != shape[i] for i in range(a, b)):
        return None
    return math.prod(shape[b:-1]), math.prod(shape[a:b])


@native_kernel("add", "mul")
def _binary(node, out, ins, scratch):
    """x + y or x * y with y whole along the last axis and broadcast over rows (_row_broadcast)."""
    if node.dtype != np.float32 or len(ins) != 2 or out.ndim == 0 or out.size == 0:
        return None
    x, y = ins if ins[0].shape == out.shape else ins[::-1]   # (both ops commute, bit for bit)
    layout = _row_broadcast(y.shape, out.shape) if x.shape == out.shape else None
    if layout is None or not native_arrays(x, y, out):
        return None
    (rpy, ny), cols = layout, out.shape[-1]
    fn, op = library().gl_binary_rows, _BINARY_OPS[node.op]
    return split_calls(lambda lo, hi: functools.partial(fn, ptr(x), ptr(y), ptr(out), lo, hi, cols, rpy, ny, op),
                       out.size // cols, cols, (x, y, out))


@native_kernel("sum")
def _sum(node, out, ins, scratch):
    """A sum over one run of outer axes (a bias gradient's rows, a batched product's batch)."""
    (x,) = ins
    axes = list(node.attrs["axes"])
    if (node.dtype != np.float32 or x.size == 0 or not axes or axes != list(range(axes[0], axes[-1] + 1))
            or axes[-1] == x.ndim - 1 or not native_arrays(x, out)):
        return None
    groups, rows = math.prod(x.shape[:axes[0]]), math.prod(x.shape[axes[0]:axes[-1] + 1])
    return sum_rows_closure(x, out, groups, rows, math.prod(x.shape[axes[-1] + 1:]))


def sum_rows_closure(x, out, groups: int, rows: int, cols: int):
    """out[g] = the sum of x[g]'s `rows` rows of `cols` floats, in order (gl_sum_rows; contiguous
    arrays), split over the team by columns (the groups' laid end to end)."""
    fn = library().gl_sum_rows
    return split_calls(lambda lo, hi: functools.partial(fn, ptr(x), ptr(out), groups, rows, cols, lo, hi),
                       groups * cols, rows, (x, out))


@native_kernel("affine_grads")
def _affine_grads(node, out, ins, scratch):
    """An affine map's weight and bias gradients [sum(g*x), sum(g)] over the rows, in one pass (x
    divided by the row's d where the node has d)."""
    g, x, *d = ins
    if node.dtype != np.float32 or g.size == 0 or not native_arrays(g, x, *d, out):
        return None
    cols = g.shape[-1]
    fn, dp = library().gl_affine_grads, ptr(d[0]) if d else None
    return split_calls(lambda lo, hi: functools.partial(fn, ptr(g), ptr(x), dp, ptr(out), g.size // cols, cols, lo, hi),
                       cols, g.size // cols, (g, x, *d, out))


def _rows_layout(x) -> tuple[int, ...] | None:
    """(n1, n2, n3, s0, s1, s2, rows): float32 `x` as at most four axes [n0, n1, n2, n3] at
    element strides s0, s1, s2 whose last holds n3 contiguous floats (size-1 axes dropped,
    axes that are one stride apart merged); None where it needs more than four."""
    if x.dtype != np.float32 or x.size == 0 or any(s % 4 for s in x.strides):
        return None
    axes = []   # [size, element stride], inner first
    for d, s in zip(reversed(x.shape), reversed(x.strides)):
        if d == 1:
            continue
        if axes and axes[-1][1] * axes[-1][0] == s // 4:
            axes[-1][0] *= d
        else:
            axes.append([d, s // 4])
    if not axes or axes[0][1] != 1 or len(axes) > 4:
        return None
    axes += [[1, 0]] * (4 - len(axes))
    (n3, _), (n2, s2), (n1, s1), (n0, s0) = axes
    return n1, n2, n3, s0, s1, s2, n0 * n1 * n2


def _copy_closure(src, dst, plus_zero: int):
    """dst (C-contiguous, src's shape) = src (+ 0.0 where plus_zero) by gl_copy_rows, or None."""
    layout = _rows_layout(src)
    if layout is None or not native_arrays(dst) or dst.size != src.size:
        return None
    *dims, rows = layout
    fn = library().gl_copy_rows
    return split_calls(lambda lo, hi: functools.partial(fn, ptr(src), ptr(dst), lo, hi, *dims, plus_zero),
                       rows, dims[2], (src, dst))


@native_kernel("reshape")
def _reshape_copy(node, out, ins, scratch):
    """A reshape whose input's strides need a copy (heads merged back after attention)."""
    return _copy_closure(ins[0], out, 0)   # (np.copyto: -0 stays -0)


@native_kernel("slices_assemble")
def _slices_assemble(node, out, ins, scratch):
    """The gradients of q, k and v written into their slices of the fused qkv's gradient: each a
    strided copy plus 0.0 (the numpy kernel's np.add(src, 0)), where the slices cover out."""
    if not node.attrs["covered"] or not native_arrays(out):
        return None
    copies = []
    for index, src in zip(node.attrs["indexes"], ins):
        window = out[tuple(index) + (Ellipsis,)]
        run = _copy_closure(src, window, 1) if window.flags.c_contiguous and window.size == src.size else None
        if run is None:
            return None
        copies.append(run)

    def run():
        for copy in copies:
            copy()
    run.arrays = copies
    return run


# == layer norm ===========================================================================================

def _norm_ok(node, x, w, b, *arrays) -> bool:
    cols = node.shape[-1]
    return (node.dtype == np.float32 and x.shape == node.shape
            and all(p is None or p.shape == (cols,) for p in (w, b)) and native_arrays(x, w, b, *arrays))


def _layer_norm_closure(node, x, w, b, out, xc, sv, xhat, eps=None):
    """`node`: a tensor of the normalised shape (the layer norm, or layer_norm_keep's input)."""
    fn, cols = library().gl_layer_norm, node.shape[-1]
    eps = float(np.float32(node.attrs["eps"] if eps is None else eps))
    return split_calls(lambda lo, hi: functools.partial(
        fn, ptr_at(x, cols, lo), ptr(w), ptr(b), ptr_at(out, cols, lo), ptr_at(xc, cols, lo), ptr_at(sv, 1, lo),
        ptr_at(xhat, cols, lo), hi - lo, cols, eps), node.size // cols, cols, (x, w, b, out, xc, sv, xhat))


@native_kernel("layer_norm", rounds_own_way=True)
def _layer_norm(node, out, ins, scratch):
    x, w, b, _ = norm_parts(ins, node.attrs)
    if not _norm_ok(node, x, w, b, out):
        return None
    return _layer_norm_closure(node, x, w, b, out, None, None, None)


@native_kernel("layer_norm_keep", rounds_own_way=True)
def _layer_norm_keep(node, out, ins, scratch):
    x, w, b, _ = norm_parts(ins, node.attrs)
    parts = layer_norm_keep_views(out, node)
    y, xc, sv, xhat = parts["y"], parts["xc"], parts["sv"], parts.get("xhat")
    if node.dtype != np.float32 or not _norm_ok(node.inputs[0], x, w, b, y, xc, sv, xhat):
        return None
    return _layer_norm_closure(node.inputs[0], x, w, b, y, xc, sv, xhat, node.attrs["eps"])


def _layer_norm_backward_closure(node, xc, sv, g, w, out, residual=None):
    fn, cols = library().gl_layer_norm_backward, node.shape[-1]
    eps = float(np.float32(node.attrs["eps"]))
    return split_calls(lambda lo, hi: functools.partial(
        fn, ptr_at(xc, cols, lo), ptr_at(sv, 1, lo), ptr_at(g, cols, lo), ptr(w), ptr_at(residual, cols, lo),
        ptr_at(out, cols, lo), hi - lo, cols, eps), node.size // cols, cols, (xc, sv, g, w, residual, out))


@native_kernel("layer_norm_backward_kept", rounds_own_way=True)
def _layer_norm_backward_kept(node, out, ins, scratch):
    xc, sv, w, g, residual = kept_backward_parts(ins, node.attrs)
    if not _norm_ok(node, g, w, None, out, xc, sv, residual):
        return None
    return _layer_norm_backward_closure(node, xc, sv, g, w, out, residual)


@native_kernel("layer_norm_backward", rounds_own_way=True)
def _layer_norm_backward(node, out, ins, scratch):
    x, w, _, (g,) = norm_parts(ins, node.attrs)
    if not _norm_ok(node, x, w, None, g, out) or g.shape != node.shape:
        return None
    return _layer_norm_backward_closure(node, x, None, g, w, out)


# == cross entropy and the embedding gradient ===============================================================
# The numpy kernels run these as whole-array NumPy passes on one thread (max, subtract, exp, sum,
# log, pick; np.add.at); here each row (cross entropy) or column range (the embedding gradient)
# is one pass, split over the team. The targets and ids are checked first, as the numpy kernels do.

def _int64_rows(ids) -> bool:
    return ids.dtype == np.int64 and ids.flags.c_contiguous


@native_kernel("cross_entropy", rounds_own_way=True)
def _cross_entropy(node, out, ins, scratch):
    """Each row's loss in C (gl_cross_entropy_rows) into the numpy kernel's lse scratch, then their
    mean by NumPy: the same order whatever the split."""
    logits, targets = ins
    loss = scratch[2]
    if node.dtype != np.float32 or not native_arrays(logits, loss) or not _int64_rows(targets):
        return None
    (n, v), fn = logits.shape, library().gl_cross_entropy_rows
    rows = split_calls(lambda lo, hi: functools.partial(fn, ptr_at(logits, v, lo), ptr_at(targets, 1, lo),
                                                         ptr_at(loss, 1, lo), hi - lo, v), n, v, (logits, targets, loss))

    def run():
        check_index_range(node, targets, v, "target")
        rows()
        np.mean(loss, out=out)
    run.arrays = rows
    return run


@native_kernel("cross_entropy_backward", rounds_own_way=True)
def _cross_entropy_backward(node, out, ins, scratch):
    logits, targets, g = ins
    if node.dtype != np.float32 or not native_arrays(logits, g, out) or not _int64_rows(targets):
        return None
    (n, v), fn = logits.shape, library().gl_cross_entropy_backward_rows
    rows = split_calls(lambda lo, hi: functools.partial(fn, ptr_at(logits, v, lo), ptr_at(targets, 1, lo), ptr(g),
                                                         ptr_at(out, v, lo), hi - lo, v, n), n, v, (logits, targets, g, out))

    def run():
        check_index_range(node, targets, v, "target")
        rows()
    run.arrays = rows
    return run


@native_kernel("embedding_backward")
def _embedding_backward(node, out, ins, scratch):
    """The table's gradient in column ranges on the team (gl_embedding_backward): every element
    adds its rows in order from zero, the numpy kernel's bits."""
    ids, g = ins
    rows, dim = node.shape
    if node.dtype != np.float32 or not native_arrays(g, out) or not _int64_rows(ids) or g.size != ids.size * dim:
        return None
    fn = library().gl_embedding_backward
    columns = split_calls(lambda lo, hi: functools.partial(fn, ptr(ids), ptr(g), ptr(out), ids.size, rows, dim, lo, hi),
                          dim, ids.size, (ids, g, out))

    def run():
        check_index_range(node, ids, rows, "token id")
        columns()
    run.arrays = columns
    return run


# == an embedding's lookup, a KV cache's write ==============================================================

@native_kernel("embedding")
def _embedding(node, out, ins, scratch):
    """out = table[ids] by rows (gl_embedding_rows), the ids checked first as the numpy kernel
    checks them (one id as a Python int: min() and max() cost ~5 us a decode step)."""
    table, ids = ins
    rows, dim = table.shape
    if node.dtype != np.float32 or not native_arrays(table, out) or not _int64_rows(ids) or out.size != ids.size * dim:
        return None
    fn = library().gl_embedding_rows
    gather = split_calls(lambda lo, hi: functools.partial(fn, ptr(table), ptr(ids), ptr(out), lo, hi, rows, dim),
                         ids.size, dim, (table, ids, out))
    if ids.size == 1:
        item = ids.reshape(-1).item

        def check():
            if not 0 <= item(0) < rows:
                check_index_range(node, ids, rows, "token id")
    else:
        def check():
            check_index_range(node, ids, rows, "token id")
    return checked_closure(check, gather, (1,))


def _write_layout(value, region) -> tuple[int, ...] | None:
    """(n0, n1, n2, value's strides s0, s1, the region's r0, r1) in elements: `value` and `region`
    (the cache's slots it goes to, at position 0), of one shape, as at most three axes whose last
    is contiguous in both (size-1 axes dropped); None where they need more."""
    if value.dtype != np.float32 or region.dtype != np.float32 or any(s % 4 for s in value.strides + region.strides):
        return None
    axes = [[d, vs // 4, rs // 4] for d, vs, rs in zip(value.shape, value.strides, region.strides) if d != 1]
    while len(axes) > 1 and axes[-1][1:] == [1, 1] and axes[-2][1] == axes[-2][2] == axes[-1][0]:
        d = axes.pop()[0]   # (the last two axes contiguous in both: one)
        axes[-1] = [axes[-1][0] * d, 1, 1]
    if not axes or axes[-1][1:] != [1, 1] or len(axes) > 3:
        return None
    axes = [[1, 0, 0]] * (3 - len(axes)) + axes
    (n0, v0, r0), (n1, v1, r1), (n2, _, _) = axes
    return n0, n1, n2, v0, v1, r0, r1


@native_kernel("cache_write")
def _cache_write(node, out, ins, scratch):
    """cache[..., pos:pos+n, ...] = value by rows (gl_cache_write), the position checked first as
    the numpy kernel checks it (0 <= pos <= cache length - n)."""
    cache, value, pos = ins
    axis, n = node.attrs["axis"], value.shape[node.attrs["axis"]]
    if pos.dtype != np.int64 or not native_arrays(cache, out) or value.size == 0:
        return None
    layout = _write_layout(value, cache[(slice(None),) * axis + (slice(0, n),)])
    if layout is None:
        return None
    limit, step = cache.shape[axis] - n, cache.strides[axis] // 4
    write = single_call(functools.partial(library().gl_cache_write, ptr(value), ptr(cache), ptr(pos), ptr(out),
                                          step, *layout), (cache, value, pos, out))
    item = pos.reshape(-1).item

    def check():
        if not 0 <= item(0) <= limit:
            reference.KERNELS["cache_write"](node, cache, value, pos)   # raises, naming the node
    return checked_closure(check, write, (2,))


# == dropout ================================================================================================

def _draw_closure(node, key, mask, x, out):
    """Draw the keep mask of `node` (dropout or dropout_keep) into `mask` in C and, when x is
    given, out = (x * mask) * scale in the same pass; None where the arrays are not native."""
    a = node.attrs
    if mask.dtype != np.bool_ or not mask.flags.c_contiguous or (x is not None and (
            node.dtype != np.float32 or x.shape != out.shape or not native_arrays(x, out))):
        return None
    lib, threshold = library(), keep_threshold(a["p"])
    scale = float(np.float32(1.0 / (1.0 - a["p"])))
    base = np.zeros(1, np.uint64)   # this run's stream start, read by the pieces through its address
    pointers = (ptr(mask), ptr(x), ptr(out))
    draw = split_calls(lambda lo, hi: functools.partial(lib.gl_dropout_draw, *pointers, lo, hi, ptr(base),
                                                         threshold, scale),
                        mask.size, 1, (x, mask, out, base))

    def run():
        base[0] = stream_base(int(key), a["stream"])
        draw()
    return run


@native_kernel("dropout_keep")
def _dropout_keep(node, out, ins, scratch):
    return _draw_closure(node, ins[0], out, None, None)


@native_kernel("dropout_apply")
def _dropout_apply(node, out, ins, scratch):
    x, mask = ins
    if (node.dtype != np.float32 or x.shape != out.shape or not native_arrays(x, out)
            or mask.dtype != np.bool_ or not mask.flags.c_contiguous):
        return None
    lib, scale = library(), float(np.float32(1.0 / (1.0 - node.attrs["p"])))
    return split_calls(lambda lo, hi: functools.partial(
        lib.gl_dropout_apply, ptr_at(x, 1, lo), ptr_at(mask, 1, lo), ptr_at(out, 1, lo), hi - lo, scale),
        out.size, 1, (x, mask, out))


@native_kernel("bias_dropout_add")
def _bias_dropout_add(node, out, ins, scratch):
    """r + ((m + b) * keep) * scale, b one row broadcast over the rows, in one pass."""
    r, m, b, keep = ins
    if (node.dtype != np.float32 or out.ndim == 0 or not native_arrays(r, m, b, out)
            or keep.dtype != np.bool_ or not keep.flags.c_contiguous):
        return None
    lib, scale, cols = library(), float(np.float32(1.0 / (1.0 - node.attrs["p"]))), out.shape[-1]
    return split_calls(lambda lo, hi: functools.partial(
        lib.gl_bias_dropout_add, ptr(r), ptr(m), ptr(b), ptr(keep), ptr(out), cols, lo, hi, scale),
        out.size // cols, cols, (r, m, b, keep, out))


@native_kernel("dropout")
def _dropout(node, out, ins, scratch):
    x, key = ins
    return _draw_closure(node, key, scratch[0], x, out)


# == the global norm ========================================================================================

@native_kernel("global_norm")
def _global_norm(node, out, ins, scratch):
    """sqrt of the gradients' squares summed: each gradient's dot with itself by NumPy's OpenBLAS
    sdot (what the numpy kernel's np.dot calls), the gradients shared out by size over the team,
    then the dots added in input order in float32, as the numpy kernel adds them: its bits."""
    sdot = blas_sdot()
    if sdot is None or node.dtype != np.float32 or not native_arrays(*ins):
        return None
    addrs = np.array([ptr(g) for g in ins], np.int64)
    sizes = np.array([g.size for g in ins], np.int64)
    dots = np.zeros(len(ins), np.float32)
    fn = library().gl_self_dots
    call = lambda lo, hi: functools.partial(fn, addrs.ctypes.data, sizes.ctypes.data, ptr(dots), lo, hi, *sdot)
    dot_all = sized_calls(call, sizes)

    def run():
        dot_all()
        np.copyto(out, np.sqrt(np.add.accumulate(dots)[-1]))   # ((d0 + d1) + d2) + ...: the numpy kernel's order
    run.arrays = (ins, addrs, sizes, dots)
    return run


# == AdamW ===================================================================================================

@native_kernel("adamw_update")
def _adamw_update(node, out, ins, scratch):
    """Every parameter's AdamW update in C (gl_adamw_params over a table of them, shared out by
    size on the team); this run's constants (the schedule's learning rate, the clip coefficient)
    are written to `consts` first, rounded to float32 as the numpy kernel rounds them."""
    lr_a, step_a, coef_a = ins[:3]
    a = node.attrs
    f32 = lambda x: float(np.float32(x))
    decays = sorted(set(a["weight_decay"]))
    table = []   # per parameter: p, grad, m, v, size, decays, its row of consts (gl_adamw_params)
    for k, wd in enumerate(a["weight_decay"]):
        p, grad, m, v = ins[3 + 4 * k: 7 + 4 * k]
        if not native_arrays(p, grad, m, v) or not (p.shape == grad.shape == m.shape == v.shape):
            return None
        table.append([ptr(p), ptr(grad), ptr(m), ptr(v), p.size, 1 if wd else 0, decays.index(wd)])
    table = np.array(table, np.int64).reshape(-1, 7)
    consts = np.zeros(8 + 4 * len(decays), np.float32)
    consts[:5] = [a["beta1"], 1.0 - a["beta1"], a["beta2"], 1.0 - a["beta2"], a["eps"]]
    fn = library().gl_adamw_params
    call = lambda lo, hi: functools.partial(fn, table.ctypes.data, consts.ctypes.data, lo, hi)
    update = sized_calls(call, table[:, 4])

    def run():
        lr, step_size, bc2_sqrt = adamw_schedule(node, lr_a, step_a)
        for r, wd in enumerate(decays):
            consts[8 + 4 * r: 12 + 4 * r] = [f32(coef_a), f32(1.0 - lr * wd), f32(step_size), f32(bc2_sqrt)]
        update()
        out[...] = 0.0
    run.arrays = (ins, table, consts)   # (the raw pointers above point into these)
    return run
