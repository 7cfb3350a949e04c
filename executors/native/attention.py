"""Attention in C: causal attention (training, prefill) and a decode step's cached attention.

Causal attention runs whole in C where NumPy's BLAS has a cblas_sgemm to call
(gl_causal_attention and _backward in attention.c: the numpy kernel's query-block steps, its
products as those BLAS calls), its score matrices cut in ranges on the C worker team; elsewhere
(and for the backward that recomputes the scores) it is the numpy kernel with its two block
steps, the causal softmax and the ds step, in C. A decode step's cached attention
(gl_cached_attention) reads only the cache slots in use, its (batch row, head) rows cut over
the team.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from graphlm.ops import heads_merged_swap

from ..numpy.attention import (attention_flops, attention_plan, build_causal_attention, build_causal_attention_backward,
                               keep_views, softmax_block, softmax_ds_block)
from ..numpy.tiling import even_cuts
from ..reference import check_cached_position
from .build import library
from .table import native_kernel
from .team import (TEAM_MIN_FLOPS, blas_sgemm, call_tables, checked_closure, entry_offsets, native_arrays, ptr,
                   team_closure, team_table)


# == causal attention ======================================================================================

def _softmax_block(x, lb, r0, up):
    if not (x.flags.c_contiguous and x.ndim == 3 and lb.ndim == 3):
        return softmax_block(x, lb, r0, up)
    m, rows, cols = x.shape
    library().gl_causal_softmax_block(ptr(x), ptr(lb), m, rows, cols, r0, lb.strides[0] // lb.itemsize)


def _ds_block(s, x, ddb):
    if not (s.flags.c_contiguous and x.flags.c_contiguous and s.ndim == 3 and ddb.ndim == 3):
        return softmax_ds_block(s, x, ddb)
    m, rows, cols = s.shape
    library().gl_softmax_ds_block(ptr(s), ptr(x), ptr(ddb), m, rows, cols, ddb.strides[0] // ddb.itemsize)


ATTENTION_BLOCK_STEPS = (_softmax_block, _ds_block)


def _with_native_steps(numpy_build):
    """The numpy attention kernel `numpy_build` with the C block steps (float32 only)."""
    def build(node, out, ins, scratch):
        if node.dtype != np.float32:
            return None
        library()
        return numpy_build(node, out, ins, scratch, steps=ATTENTION_BLOCK_STEPS)
    return build


# Where NumPy's BLAS has a cblas_sgemm to call, causal attention runs whole in C instead
# (gl_causal_attention and _backward: the same steps, the products as BLAS calls), its score
# matrices cut in ranges on the C worker team; the backward without kept scores stays above.
MIN_TEAM_ATTENTION_FLOPS = 1 << 20   # causal attention below this runs whole on one thread
# Its products in C (attention.c, plan_product; the figures: docs/performance.md), else each a call
# of NumPy's cblas_sgemm (also where a transposed operand is larger than the C side packs)
ATTENTION_PRODUCTS_IN_C = True


def _attention_in_c(node, fn, shape, strided, arrays, flops):
    """The closure of `fn` (gl_causal_attention or _backward) over the score matrices of q's
    `shape`, from its plan words (attention.c): `arrays` in the kernel's order, of which
    `strided` (q, k, v, g, o and dq, None where the kernel has none: [..., T, D] views whose rows
    are contiguous floats, any row and matrix strides) are given by their rows' stride and
    per-matrix offsets (from the address of the array in `arrays`), the others contiguous; None
    where no sgemm is found or an array is not laid out so."""
    sgemm = blas_sgemm()
    lead, (t, d) = shape[:-2], shape[-2:]
    strided = list(strided) + [None] * (ctypes.c_int64.in_dll(library(), "gl_attention_strided").value - len(strided))
    given = [x for x in strided if x is not None]
    rows_ok = lambda x: x.dtype == np.float32 and x.strides[-1] == 4 and x.strides[-2] % 4 == 0
    whole = [x for x in arrays if not any(x is y for y in given)]
    if sgemm is None or not all(rows_ok(x) for x in given) or not native_arrays(*whole) or 0 in shape:
        return None
    offsets = [np.zeros(int(np.prod(lead, dtype=np.int64)), np.int64) if x is None else entry_offsets(x, lead)
               for x in strided]
    if any(o is None for o in offsets):
        return None
    table = np.ascontiguousarray(np.stack(offsets, axis=1), np.int64)
    blocks, _, scale = attention_plan(node, shape)
    slots = ctypes.c_int64.in_dll(library(), "gl_attention_plan_arrays").value
    plan = np.array([t, d, len(table), len(blocks), *sgemm, int(ATTENTION_PRODUCTS_IN_C),
                     *(0 if x is None else x.strides[-2] // 4 for x in strided),
                     ptr(table), *map(ptr, arrays), *[0] * (slots - len(arrays)),
                     *(r0 for r0, _ in blocks), blocks[-1][1]], np.int64)
    call = lambda m0, m1: functools.partial(fn, ptr(plan), m0, m1, float(scale))
    m = len(table)

    def tables_for(threads):
        if m < 2 or flops < MIN_TEAM_ATTENTION_FLOPS:
            return None
        return call_tables([call(m0, m1) for m0, m1 in even_cuts(m, threads)])
    run = team_closure(call(0, m), tables_for)
    run.arrays = (plan, table, *arrays)   # (the raw addresses in the plan point into these)
    return run


def _causal_attention(node, out, ins, scratch):
    if node.dtype != np.float32:
        return None
    q, k, v = ins
    if node.op == "causal_attention_keep":
        (qs,), parts = scratch, keep_views(out, node)
        y, e, l = parts["y"], parts["e"], parts["l"]
    else:
        (qs, e, l), y = scratch, heads_merged_swap(out, node.attrs)
    return (_attention_in_c(node, library().gl_causal_attention, q.shape, [q, k, v, None, y],
                            [q, k, v, y, e, l, qs], attention_flops(q.shape))
            or _with_native_steps(build_causal_attention)(node, out, ins, scratch))


def _causal_attention_backward(node, out, ins, scratch):
    if node.dtype != np.float32:
        return None
    run = None
    if node.op == "causal_attention_backward_kept":
        q, k, v, o, e, l, g = ins
        ds, gs, dd, tmp = scratch
        run = _attention_in_c(node, library().gl_causal_attention_backward, q.shape,
                              [q, k, v, g, o, heads_merged_swap(out, node.attrs)[0]],
                              [q, k, v, o, g, e, l, out, ds, gs, tmp, dd], 2 * attention_flops(q.shape))
    return run or _with_native_steps(build_causal_attention_backward)(node, out, ins, scratch)


native_kernel("causal_attention", "causal_attention_keep")(_causal_attention)
native_kernel("causal_attention_backward", "causal_attention_backward_kept")(_causal_attention_backward)


def _rows_of(x, d: int):
    """`x` [..., rows-shape, D] as (rows, the element stride between rows) without a copy, or None
    where its rows are not d contiguous floats one stride apart."""
    rows = x.reshape(-1, d) if x.size else None
    if rows is None or ptr(rows) != ptr(x) or rows.strides[1] != 4 or rows.strides[0] % 4:
        return None
    return rows, rows.strides[0] // 4


@native_kernel("cached_attention", rounds_own_way=True)
def _cached_attention(node, out, ins, scratch):
    """gl_cached_attention over the (batch row, head) rows, which read only the cache slots in
    use; on n threads the rows run as n ranges on the C worker team (team.c), each row
    computed as it is alone."""
    q, k, v, cache_k, cache_v, position = ins
    scores = scratch[0]
    t, d = cache_k.shape[-2], cache_k.shape[-1]
    if node.dtype != np.float32 or position.dtype != np.int64 or d == 0 or not native_arrays(cache_k, cache_v, scores):
        return None
    views = [_rows_of(x, d) for x in (q, k, v, out)]
    if any(x is None for x in views):
        return None
    (_, ldq), (_, ldk), (_, ldv), (_, ldo) = views
    rows = views[0][0].shape[0]
    fn, pointers = library().gl_cached_attention, [ptr(x) for x in (q, k, v, cache_k, cache_v, out, scores, position)]
    scale = float(np.float32(node.attrs["scale"]))

    def call(r0, r1):
        return functools.partial(fn, *pointers, r0, r1, t, d, ldq, ldk, ldv, ldo, t * d, scale)

    scale_bits = int(np.float32(scale).view(np.uint32))

    def piece(r0, r1):   # (team.c's kind 4: more arguments than a call piece holds)
        return (4, *pointers, r0, r1, t, d, ldq, ldk, ldv, ldo, t * d, scale_bits)

    def pieces(threads):
        """On n threads: (a gl_team_run table of n row ranges,) where the work at a full cache
        reaches TEAM_MIN_FLOPS; else None (whole on this thread): TinyLM's batch-1 step, 6 rows
        of a 128-slot cache, is split (docs/performance.md)."""
        full_cache_flops = 4 * rows * t * d   # the scores and the weighted sum over every slot
        if threads < 2 or rows < 2 or full_cache_flops < TEAM_MIN_FLOPS:
            return None
        return (team_table([piece(r0, r1) for r0, r1 in even_cuts(rows, threads)]),)
    inner = team_closure(call(0, rows), pieces, whole_piece=piece(0, rows))

    def check():   # (C trusts the position: it indexes the caches)
        check_cached_position(node, position, t)
    run = checked_closure(check, inner, (5,))
    run.arrays = (q, k, v, cache_k, cache_v, out, scores, position, inner)   # (the raw pointers point into these)
    return run
