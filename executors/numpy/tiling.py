"""Tiling helpers of the numpy executor: cutting arrays into contiguous pieces (per thread) and
cache-sized blocks (per pass), so that every piece computes what the whole would, element for
element. No kernel lives here; the families call these.
"""
from __future__ import annotations

import functools

import numpy as np

from . import pool
from .pool import threaded


def flat_view(arr: np.ndarray, shape) -> np.ndarray | None:
    """A reshaped view of `arr`, or None when that would need a copy."""
    try:
        return np.reshape(arr, shape, copy=False)
    except ValueError:
        return None


BLOCK = 1 << 16   # elements per cache block (256 KiB of float32)
SMALL = 4096    # elements: at most this, kernels take a short path with the fewest NumPy calls (decoding)


def even_cuts(total: int, n: int, quantum: int = 1) -> list[tuple[int, int]]:
    """[start, stop) ranges cutting range(total) into at most n contiguous pieces as even as
    possible, every boundary a multiple of `quantum`."""
    units = -(-total // quantum)
    bounds = sorted({min(total, (units * i // n) * quantum) for i in range(n + 1)})
    return list(zip(bounds[:-1], bounds[1:]))


def cut_along(arr, out_ndim: int, axis: int, start: int, stop: int):
    """`arr`'s piece [start, stop) along `axis` of an output of `out_ndim` dimensions it
    broadcasts to (a broadcast or missing axis stays whole)."""
    k = axis - (out_ndim - arr.ndim)
    if k < 0 or arr.shape[k] == 1:
        return arr
    index = [slice(None)] * arr.ndim
    index[k] = slice(start, stop)
    return arr[tuple(index)]


def balanced_axis(shape, n: int):
    """(largest piece / length, axis, cuts): the axis of `shape` whose cut into n pieces is the
    most even (the leftmost on a tie: contiguous pieces), or None when no axis has two entries."""
    best = None
    for axis in range(len(shape)):
        if shape[axis] > 1:
            cuts = even_cuts(shape[axis], n)
            score = max(e - s for s, e in cuts) / shape[axis]
            if best is None or score < best[0]:
                best = (score, axis, cuts)
    return best


def elementwise_parts(ins, out, n):
    """[(pieces of ins, piece of out)]: an elementwise ``f(*ins) -> out`` (inputs broadcasting to
    out) cut into at most n pieces along one axis of out; every element is computed as on the
    whole arrays."""
    chosen = balanced_axis(out.shape, n)
    if chosen is None:
        return []
    _, axis, cuts = chosen
    return [([cut_along(x, out.ndim, axis, s, e) for x in ins], cut_along(out, out.ndim, axis, s, e)) for s, e in cuts]


def size_groups(sizes, n: int) -> list[tuple[int, int]]:
    """[a, b) index ranges cutting the items of `sizes` into at most n contiguous runs of about
    equal total size (whole items: each run ends at the first item past an even cut)."""
    ends = np.cumsum(sizes)
    bounds = sorted({0} | {int(np.searchsorted(ends, stop, side="right")) for _, stop in even_cuts(int(ends[-1]), n)})
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def run_blocks(body, blocks, blocks_for=None):
    """A closure running body over every block, the blocks split into contiguous runs per thread
    (when each thread gets at least pool.MIN_BLOCKS_PER_THREAD of them). `blocks_for(n)`, when given,
    builds the blocks for n threads instead (an empty list: run whole)."""
    def run_all(part):
        for block in part:
            body(*block)

    def split(n):
        if blocks_for is None and len(blocks) < pool.MIN_BLOCKS_PER_THREAD * n:
            return []
        bl = blocks if blocks_for is None else blocks_for(n)
        return [functools.partial(run_all, bl[a:b]) for a, b in even_cuts(len(bl), n)]
    return threaded(functools.partial(run_all, blocks), split)


def rowwise(body, arrays, rows: int):
    """A closure running ``body(*arrays)``, on n threads over n contiguous row ranges (each array
    viewed as (rows, -1): full arrays and keepdims row statistics alike). For kernels whose
    passes are cheaper on whole arrays than on cache blocks (layer norm's rows of ~200)."""
    whole = functools.partial(body, *arrays)
    views = [flat_view(a, (rows, -1)) for a in arrays]
    if arrays[0].size < pool.MIN_SPLIT_ROWS or any(v is None for v in views):
        return whole
    return threaded(whole, lambda n: [functools.partial(body, *(v[a:b] for v in views))
                                       for a, b in even_cuts(rows, n)])


def blocked(body, arrays, rows: int | None = None):
    """A closure running ``body(*views)`` block by block over `arrays`, so that all the passes of
    a multi-pass kernel run on data still in cache (the same arithmetic per element and per row).

    rows None: elementwise, all arrays have the same size and are cut as 1-d blocks.
    rows R: each array viewed as (R, -1) (full arrays and keepdims row arrays alike) and cut by
    rows, for reductions along the last axis. Where an array cannot be viewed so (strided
    data), `body` runs once on the whole arrays."""
    if rows is None:
        views, total, per = [flat_view(a, (-1,)) for a in arrays], arrays[0].size, BLOCK
    else:
        views, total = [flat_view(a, (rows, -1)) for a in arrays], rows
        per = max(1, BLOCK // max(1, arrays[0].size // max(rows, 1)))
    if total <= per or any(v is None for v in views):
        return functools.partial(body, *arrays)
    return run_blocks(body, [tuple(v[s:s + per] for v in views) for s in range(0, total, per)])


def mean_last(x, out):
    """np.mean(x, axis=-1, keepdims=True, out=out) for float32/float64, without np.mean's Python
    overhead (~5 us a call; it matters for small rows): the same float sum and division by the
    np.intp count, so bit-identical."""
    if x.dtype not in (np.float32, np.float64):
        return np.mean(x, axis=-1, keepdims=True, out=out)
    np.add.reduce(x, axis=-1, keepdims=True, out=out)
    return np.true_divide(out, np.intp(x.shape[-1]), out=out, casting="unsafe")


# == fused NN ops ========================================================================================

def keep_shape(node, axis):
    return tuple(1 if i == axis else d for i, d in enumerate(node.shape))


def by_rows(node, axis, body, arrays):
    """`body` over blocks of rows when `axis` (the reduced one) is the last, else once."""
    if axis != node.ndim - 1:
        return functools.partial(body, *arrays)
    rows = node.size // node.shape[-1] if node.shape[-1] else 0
    return blocked(body, arrays, rows)


def by_matrices(body, arrays, shape):
    """`body` over blocks of whole [T, S] matrices of `arrays` (viewed as (M, T, -1))."""
    t, s_ = shape[-2], shape[-1]
    m = int(np.prod(shape[:-2], dtype=np.int64))
    views = [flat_view(a, (m, t, -1)) for a in arrays]
    per = max(1, BLOCK // max(1, t * s_))
    if m <= per or any(v is None for v in views):
        return functools.partial(body, *arrays)
    return run_blocks(body, [tuple(v[i:i + per] for v in views) for i in range(0, m, per)])


def row_shape(node):
    return node.shape[:-1] + (1,)
