"""Kernels of the numpy executor: matmul and the folded matmul sum, split over threads only along
cuts whose pieces round exactly as the whole product (tried once per distinct product)."""
from __future__ import annotations

import functools

import numpy as np

from graphlm.ops import matmul_sum_folding

from ..planner import aligned_buffer
from . import pool
from .pool import threaded
from .table import kernel
from .tiling import balanced_axis, cut_along, even_cuts, flat_view


ROW_QUANTUM_CANDIDATES = (8, 16, 24, 32, 48, 64, 96)   # matmul row blocks: see matmul_parts
COLUMN_QUANTUM_CANDIDATES = (16, 32, 64, 96)           # and column blocks


def strided_empty(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An uninitialised array of x's shape, dtype and strides (64-byte aligned, as the arena),
    and the flat buffer under it."""
    if any(st < 0 for st in x.strides):
        flat = np.empty(x.size, x.dtype)
        return flat.reshape(x.shape), flat
    span = 1 + sum((d - 1) * st for d, st in zip(x.shape, x.strides)) // x.itemsize if x.size else 1
    flat = aligned_buffer(span * x.itemsize).view(x.dtype)
    return np.lib.stride_tricks.as_strided(flat, x.shape, x.strides), flat


def probe_like(x: np.ndarray, rng) -> np.ndarray:
    """Random values in an array of x's shape, dtype and strides, for trying a product's cuts
    without touching x (drawn in float32 up to float32: no float64 copy of a large operand)."""
    out, flat = strided_empty(x)
    flat[...] = rng.standard_normal(flat.size, dtype=np.float32 if x.itemsize <= 4 else np.float64)
    return out


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    bits = np.dtype(f"i{x.dtype.itemsize}")
    return bool(np.array_equal(x.view(bits), y.view(bits)))


def pieces_round_as_whole(a, b, out, axis: int, cuts, matmul=np.matmul) -> bool:
    """Whether ``a @ b -> out`` computed as the products of its pieces [s, e) along out's `axis`
    gives the whole product's bytes. Tried on random operands of the same shapes, strides and
    dtype: a BLAS call's order of operations depends on its shapes (blocking, register tiles, the
    small-matrix and gemv paths), not on the values, so one try decides every later run.
    `out` receives the whole probe product (call this only where out is about to be written:
    the kernel's first run on that many threads), and each piece is computed into one buffer of
    its own shape and strides, so the try costs the two operands and one piece, not two outputs."""
    rng = np.random.default_rng(0)
    pa, pb = probe_like(a, rng), probe_like(b, rng)
    matmul(pa, pb, out)
    for s, e in cuts:
        want = cut_along(out, out.ndim, axis, s, e)
        got, _ = strided_empty(want)
        matmul(*operand_pieces(pa, pb, out.ndim, axis, s, e), got)
        if not same_bits(got, want):
            return False
    return True


def operand_pieces(a, b, out_ndim: int, axis: int, start: int, stop: int):
    """(a's piece, b's piece) whose product is out's piece [start, stop) along `axis`: a row
    block reads all of b, a column block all of a, a batch block both operands' entries."""
    if axis == out_ndim - 2:
        return cut_along(a, out_ndim, axis, start, stop), b
    if axis == out_ndim - 1:
        return a, cut_along(b, out_ndim, axis, start, stop)
    return cut_along(a, out_ndim, axis, start, stop), cut_along(b, out_ndim, axis, start, stop)


_checked_cuts: dict[tuple, bool] = {}


def _cuts_round_as_whole(a, b, out, axis: int, cuts, matmul=np.matmul) -> bool:
    """pieces_round_as_whole, tried once per distinct product, cut and matmul in this process."""
    key = (out.dtype.str, a.shape, a.strides, b.shape, b.strides, out.shape, out.strides, axis, tuple(cuts), matmul)
    found = _checked_cuts.get(key)
    if found is None:
        found = _checked_cuts[key] = pieces_round_as_whole(a, b, out, axis, cuts, matmul)
    return found


def matmul_parts(a, b, out, n, matmul=np.matmul):
    """[(a_i, b_i, out_i)]: ``a @ b -> out`` cut into at most n products along out's largest
    batch axis, into blocks of rows (at multiples of one of ROW_QUANTUM_CANDIDATES) or into
    blocks of columns (COLUMN_QUANTUM_CANDIDATES), the best balanced cut first. On a tie a batch
    cut (it leaves every GEMM as it was), then the cut that reads less twice: every row block
    reads all of b (k x n), every column block all of a (m x k), so columns where n > m (a
    weight gradient of few rows and many columns, where the row blocks each packed all of the
    wide gradient). A cut is used only when its pieces round exactly as the whole product,
    tried once per distinct product on random operands of its shapes (`pieces_round_as_whole`):
    BLAS kernels compute in register tiles and take other paths for small products, so which
    cuts are exact depends on the BLAS, its kernel and the shape (`matmul`: the function whose
    pieces and whole are compared, np.matmul or the native executor's oneMKL products). No exact
    cut: [] (the product stays whole)."""
    if a.ndim < 2 or b.ndim < 2:
        return []
    options = []   # (largest piece / total, prefer, axis of out, cuts)
    batch = balanced_axis(out.shape[:-2], n)
    if batch is not None:
        options.append((batch[0], 0, batch[1], batch[2]))
    m, cols = out.shape[-2:]
    for axis, length, quanta, prefer in ((out.ndim - 2, m, ROW_QUANTUM_CANDIDATES, 1 if m >= cols else 2),
                                         (out.ndim - 1, cols, COLUMN_QUANTUM_CANDIDATES, 2 if m >= cols else 1)):
        seen = set()
        for quantum in quanta:
            if length <= quantum:
                break
            cuts = even_cuts(length, n, quantum)
            if cuts[-1][1] - cuts[-1][0] == 1:   # NumPy runs a one-row (one-column) product as a gemv
                cuts = cuts[:-2] + [(cuts[-2][0], length)]
            if len(cuts) > 1 and tuple(cuts) not in seen:
                seen.add(tuple(cuts))
                options.append((max(e - s for s, e in cuts) / length, prefer, axis, cuts))
    for _, _, axis, cuts in sorted(options, key=lambda o: o[:2]):
        if _cuts_round_as_whole(a, b, out, axis, cuts, matmul):
            return [(*operand_pieces(a, b, out.ndim, axis, s, e), cut_along(out, out.ndim, axis, s, e))
                    for s, e in cuts]
    return []


def matmul_closure(a, b, out):
    """np.matmul(a, b, out), split over the executor's threads when the product is large."""
    whole = functools.partial(np.matmul, a, b, out)   # out positional: see _ufunc_kernel
    batch = int(np.prod(out.shape[:-2], dtype=np.int64)) if out.ndim > 2 else 1
    if a.ndim < 2 or b.ndim < 2 or 2 * batch * out.shape[-2] * a.shape[-1] * out.shape[-1] < pool.MIN_SPLIT_FLOPS:
        return whole
    return threaded(whole, lambda n: [functools.partial(np.matmul, *p) for p in matmul_parts(a, b, out, n)])


@kernel("matmul")
def _matmul(node, out, ins, scratch):
    # (not folded here: OpenBLAS rounds a folded float32 product differently from the batched
    # one the reference computes; graphlm.nn.Linear folds its rows in the graph instead)
    return matmul_closure(ins[0], ins[1], out)


def matmul_sum_operands(a, b, axes):
    """Views A' [..., m, S*k] and B' [..., S*k, n] such that sum over `axes` of a @ b is A' @ B'
    (graphlm.ops.matmul_sum_folding), or None when NumPy would need copies."""
    pa, sa, pb, sb, shape = matmul_sum_folding(a, b, axes)
    try:
        return np.reshape(pa, sa, copy=False), np.reshape(pb, sb, copy=False), shape
    except ValueError:
        return None


def _folded_operand(perm, shape):
    """(A', refresh): A' a view of `perm` reshaped to `shape`, or, where its strides do not
    allow that, a buffer made once here and refreshed from `perm` by calling `refresh()`."""
    view = flat_view(perm, shape)
    if view is not None:
        return view, None
    buf = np.empty(shape, perm.dtype)
    return buf, functools.partial(np.copyto, np.reshape(buf, perm.shape), perm)


@kernel("matmul_sum")
def _matmul_sum(node, out, ins, scratch):
    return matmul_sum_closure(node, out, ins, matmul_closure)


def matmul_sum_closure(node, out, ins, product_closure):
    """The folded matmul sum as one product A' @ B' by ``product_closure(A', B', out')`` (this
    executor's matmul_closure; the native executor passes its own)."""
    pa, sa, pb, sb, shape = matmul_sum_folding(ins[0], ins[1], node.attrs["axes"])
    (a2, refresh_a), (b2, refresh_b) = _folded_operand(pa, sa), _folded_operand(pb, sb)
    product = product_closure(a2, b2, np.reshape(out, shape, copy=False))
    refresh = [r for r in (refresh_a, refresh_b) if r is not None]
    if not refresh:
        return product

    def run():   # (operands whose strides fold only through a copy: rare, outside the arena)
        for r in refresh:
            r()
        product()
    return run


def accumulate_operands(a, b, out):
    """matmul_accumulate's operands as [S, m, k] and [S, k, n] (broadcast) and its output as [m, n]."""
    s = max(x.shape[0] for x in (a, b) if x.ndim == 3)
    a3, b3 = (np.broadcast_to(x, (s,) + x.shape[-2:]) for x in (a, b))
    return a3, b3, np.reshape(out, out.shape[-2:], copy=False)


def accumulate_scratch(node, pos):
    """matmul_accumulate's scratch: the [S, m, n] products where they are stored and summed."""
    s = max(x.shape[0] for x in node.inputs if x.ndim == 3)
    return [((s,) + node.shape[-2:], node.dtype)]


def matmul_accumulate_closure(out, ins, scratch, product_closure, sum_closure=None):
    """``sum(a[s] @ b[s]) -> out`` as the decomposition computes it: the batched product by
    ``product_closure(a, b, products)`` into the scratch, then its sum over the batch axis in
    order, by ``sum_closure(products, out)`` where given (the native executor's C sum on its
    team), else NumPy's."""
    (products,) = scratch
    product = product_closure(ins[0], ins[1], products)
    total = np.reshape(out, out.shape[-2:], copy=False)
    add_up = (sum_closure(products, total) if sum_closure else None) or functools.partial(np.sum, products, 0, out=total)

    def run():
        product()
        add_up()
    return run


@kernel("matmul_accumulate", scratch=accumulate_scratch)
def _matmul_accumulate(node, out, ins, scratch):
    return matmul_accumulate_closure(out, ins, scratch, matmul_closure)
