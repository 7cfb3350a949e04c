"""Kernels of the numpy executor: reductions, data movement (copies of views, concat, slice
gradients and their assembly) and gather/scatter (embedding, one-hot, the KV-cache write)."""
from __future__ import annotations

import functools

import numpy as np

from .. import reference
from ..base import check_index_range
from ..planner import apply_view
from . import pool
from .pool import threaded
from .table import kernel, scalar
from .tiling import elementwise_parts, flat_view


# == reductions =====================================================================================

# (np.sum and np.max on an ndarray are np.add.reduce and np.maximum.reduce behind ~3 us of Python)
for _name, _fn in {"sum": np.add.reduce, "mean": np.mean, "max": np.maximum.reduce}.items():
    kernel(_name)((lambda fn: lambda node, out, ins, scratch: functools.partial(
        fn, ins[0], axis=node.attrs["axes"], keepdims=node.attrs["keepdims"], out=out))(_fn))


# == data movement (view ops reach here only when their input's strides need a copy) ================

@kernel("reshape")
def _reshape_copy(node, out, ins, scratch):
    (x,) = ins
    return functools.partial(np.copyto, np.reshape(out, x.shape, copy=False), x)


@kernel("transpose", "broadcast_to", "slice")
def _view_copy(node, out, ins, scratch):
    return functools.partial(np.copyto, out, apply_view(node, ins[0]))


@kernel("concat")
def _concat(node, out, ins, scratch):
    return functools.partial(np.concatenate, ins, axis=node.attrs["axis"], out=out)


@kernel("slice_backward")
def _slice_backward(node, out, ins, scratch):
    (g,) = ins
    window = out[tuple(node.attrs["index"]) + (Ellipsis,)]   # (Ellipsis: a 0-d window stays a view)

    def run():
        out.fill(0)
        np.copyto(window, g)
    return run


@kernel("slices_assemble")
def _slices_assemble(node, out, ins, scratch):
    zero = scalar(0.0, node.dtype)
    windows = [np.reshape(out[tuple(idx) + (Ellipsis,)], src.shape, copy=False) for idx, src in zip(node.attrs["indexes"], ins)]
    covered = node.attrs["covered"]

    def copy(pairs):
        for src, window in pairs:
            np.add(src, zero, out=window)

    def run():
        if not covered:
            out.fill(0)
        copy(zip(ins, windows))

    def split(n):   # each window cut into n pieces; piece k of every window on thread k
        cut = [elementwise_parts([src], window, n) for src, window in zip(ins, windows)]
        if any(len(c) != len(cut[0]) for c in cut):
            return []
        return [functools.partial(copy, [(c[k][0][0], c[k][1]) for c in cut]) for k in range(len(cut[0]))]
    if not covered or out.size < pool.MIN_SPLIT_COPY:
        return run
    return threaded(run, split)


# == gather / scatter ==================================================================================

@kernel("embedding")
def _embedding(node, out, ins, scratch):
    table, ids = ins
    rows = table.shape[0]

    if ids.size == 1:  # decoding: one id, checked as a Python int (min()/max() cost ~5 us)
        item = ids.item

        def run_one():
            i = item()
            if i < 0 or i >= rows:
                check_index_range(node, ids, rows, "token id")
            np.take(table, ids, axis=0, out=out, mode="clip")
        return run_one

    def run():
        check_index_range(node, ids, rows, "token id")
        np.take(table, ids, axis=0, out=out, mode="clip")  # 'raise' would buffer a copy
    return run


@kernel("embedding_backward", scratch=lambda node, pos: [((node.inputs[0].size, node.shape[1]), np.intp)])
def _embedding_backward(node, out, ins, scratch):
    """np.add.at over the flat table with one flat index per element (id * dim + column): NumPy's
    1-d fast path, 4x faster than the row-wise np.add.at. Each element still adds its
    contributions in the order they occur, from zero, so the result is bit-identical."""
    ids, g = ins
    rows, dim = node.shape
    (index,) = scratch
    ids_col = ids.reshape(-1, 1) if flat_view(ids, (-1, 1)) is not None else None
    flat_g, flat_out = flat_view(g, (-1,)), out.reshape(-1)
    columns = np.arange(dim, dtype=np.intp)
    flat_index = index.reshape(-1)

    def run():
        check_index_range(node, ids, rows, "token id")
        out.fill(0)
        np.multiply(ids_col, dim, out=index, casting="unsafe")
        np.add(index, columns, out=index)
        np.add.at(flat_out, flat_index, flat_g)

    if ids_col is None or flat_g is None:
        def run_strided():
            check_index_range(node, ids, rows, "token id")
            out.fill(0)
            np.add.at(out, ids.reshape(-1), g.reshape(-1, dim))
        return run_strided
    return run


@kernel("one_hot")
def _one_hot(node, out, ins, scratch):
    (ids,) = ins
    depth = node.attrs["depth"]
    columns = np.arange(depth)
    ids_col = ids[..., None]

    def run():
        check_index_range(node, ids, depth)
        np.equal(ids_col, columns, out=out, casting="unsafe")
    return run


@kernel("cache_write")
def _cache_write(node, out, ins, scratch):
    """The reference kernel's write, without its per-run Python setup (the KV cache in place)."""
    cache, value, pos = ins
    axis, n = node.attrs["axis"], value.shape[node.attrs["axis"]]
    limit = cache.shape[axis] - n
    before = (slice(None),) * axis

    def run():
        p = int(pos)
        if not 0 <= p <= limit:
            reference.KERNELS["cache_write"](node, cache, value, pos)  # raises, naming the node
        cache[before + (slice(p, p + n),)] = value
        out[()] = 0
    return run
