"""The native executor's matmuls: small, large and panel products in C; BLAS products on the C team.

Small products. BLAS takes other paths for a product of 1 row (GEMV) and of 8 (small-m GEMM,
at a third of the core's rate), so a batch-8 decode step cost 2-3x what it could and its rows
rounded unlike batch 1's. In C (gl_matmul_small, products.c) every output
element is one fixed sequence of fused multiply-adds that depends on k alone: a row of a batch
is the bits of that row computed alone, whatever the blocking, the column cut or the thread. On
n threads they run as n pieces on the C worker team, which takes a piece in a fraction of a
microsecond: a decode step's products are a few microseconds each, less than the numpy pool's
Python threads take to hand one over.

Large products. Every other float32 product (training, long prefills) can run in C too
(gl_matmul_large: the same NN kernel over tiles of b packed into column panels that stay in L2):
each element is again one chain of fused multiply-adds over k in order, so its bits do not
depend on the cut or the thread. With AVX-512 it keeps up with OpenBLAS's AVX-512 kernels and
passes its AVX2 ones (docs/performance.md), so it is used where the C code is compiled for
AVX-512 and NumPy's OpenBLAS runs other kernels (an older OpenBLAS, or OPENBLAS_CORETYPE set, as
on some of this project's machines; `large_products_in_c`) and oneMKL does not run them;
elsewhere a BLAS runs them (the cuts below, on the team). `LARGE_PRODUCTS_IN_C` True or False
forces the choice.

oneMKL products. On an Intel CPU where the `mkl` wheel is installed, the large products are
oneMKL's cblas_sgemm calls (mkl.py says why),
whole on one thread and cut over the team on n, each cut used only where its pieces give the
whole call's bits; they round their own way (not np.matmul's bits). `GRAPHLM_BLAS=openblas`
(or `mkl`) overrides the choice; `MKL_PRODUCTS` True or False forces it (tests).

Panel products. A Generator's products on this executor read B in column panels, the bias
added at the store (graphlm.ops.panel_matmul, gl_matmul_panels): the small kernel's NN chains
at any row count, B read straight through memory.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from graphlm.passes.panel_weights import PANEL_WIDTH   # (the panels gl_matmul_panels takes)

from ..numpy.matmul import (accumulate_operands, matmul_accumulate_closure, matmul_closure, matmul_parts,
                            matmul_sum_closure, probe_like, same_bits, strided_empty)
from ..numpy.pool import MIN_SPLIT_FLOPS, blas_core
from ..numpy.tiling import even_cuts
from .build import cpu_flags, cpu_vendor, library
from .kernels import sum_rows_closure
from .mkl import mkl_sgemm
from .table import native_kernel
from .team import (TEAM_MIN_FLOPS, blas_sgemm, call_tables, entry_offsets, native_arrays, ptr, team_closure, team_table,
                   team_words)


# == small products: matmuls of few rows (decoding) ==========================================================

SMALL_ROWS = 16             # a matmul of at most this many rows per product runs in C (gl_matmul_small)
SMALL_COLUMN_QUANTUM = 32   # a column cut falls on a multiple of this (the C kernel's widest block)


def small_product_layout(a, b, out):
    """How gl_matmul_small (or _nt) takes ``a @ b -> out``: (C function name, lda, ldb, ldo,
    offsets [entries, 3]), or None where it does not (not float32, more than SMALL_ROWS rows,
    empty, or rows not contiguous: b's rows (NN) or columns (NT, a transposed view) must be)."""
    m, k, n = out.shape[-2], a.shape[-1], out.shape[-1]
    if (out.dtype != np.float32 or a.dtype != np.float32 or b.dtype != np.float32 or m > SMALL_ROWS
            or out.size == 0 or a.ndim < 2 or b.ndim < 2):
        return None
    f = 4   # float32's itemsize
    if not (a.strides[-1] == f or k <= 1) or out.strides[-1] != f or any(x.strides[-2] % f for x in (a, b, out)):
        return None
    if b.strides[-1] == f or n == 1 or k == 0:
        name, ldb = "gl_matmul_small", b.strides[-2] // f
    elif b.strides[-2] == f and b.strides[-1] % f == 0:
        name, ldb = "gl_matmul_small_nt", b.strides[-1] // f
    else:
        return None
    batch = out.shape[:-2]
    parts = [entry_offsets(x, batch) for x in (a, b, out)]
    if any(p is None for p in parts):
        return None
    return name, a.strides[-2] // f, ldb, out.strides[-2] // f, np.ascontiguousarray(np.stack(parts, axis=1))


def entries_more_even(by_entry, entries: int, by_column, columns: int) -> bool:
    """Whether a cut of the batch entries (`by_entry`, even_cuts' ranges) shares a product out
    at least as evenly as the cut of its columns (or panels) `by_column`: the largest piece's
    share of the whole, the entries on a tie."""
    return max(e - s for s, e in by_entry) / entries <= max(e - s for s, e in by_column) / columns


def small_matmul_closure(a, b, out):
    """``a @ b -> out`` by the C kernel for products of few rows, or None (small_product_layout).
    Every element is computed the same way whatever the rows around it or the thread (see
    products.c), so the pieces of a split (batch entries or column ranges) are exact. On
    n threads a product of at least TEAM_MIN_FLOPS runs as n pieces on the C worker team
    (team.c: a piece is handed over in a fraction of a microsecond, where the Python pool
    costs tens), one table of pieces built per n."""
    layout = small_product_layout(a, b, out)
    if layout is None:
        return None
    name, lda, ldb, ldo, offsets = layout
    fn = getattr(library(), name)
    m, k, n, entries = out.shape[-2], a.shape[-1], out.shape[-1], len(offsets)
    pointers = (ptr(a), ptr(b), ptr(out), ptr(offsets))
    whole = functools.partial(fn, *pointers, 0, entries, m, k, lda, ldb, ldo, 0, n)
    kind = 1 if name == "gl_matmul_small_nt" else 0

    def pieces(threads):
        """The cuts [(e0, e1, j0, j1), ...] on `threads` threads ([] where it runs whole)."""
        if threads < 2 or 2 * entries * m * k * n < TEAM_MIN_FLOPS:
            return []
        by_entry, by_column = even_cuts(entries, threads), even_cuts(n, threads, SMALL_COLUMN_QUANTUM)
        if entries_more_even(by_entry, entries, by_column, n):
            cuts = [(e0, e1, 0, n) for e0, e1 in by_entry]
        else:
            cuts = [(0, entries, j0, j1) for j0, j1 in by_column]
        return cuts if len(cuts) > 1 else []

    def tables_for(threads):
        cuts = pieces(threads)
        return (team_table([(kind, *pointers, e0, e1, m, k, lda, ldb, ldo, j0, j1)
                            for e0, e1, j0, j1 in cuts]),) if cuts else None
    run = team_closure(whole, tables_for)
    run.arrays = (a, b, out, offsets)   # (the raw pointers above point into these)
    run.small_product, run.pieces = True, pieces   # (for tools and tests)
    return run


# == large products: every other float32 matmul, in C =====================================================

LARGE_PRODUCTS_IN_C = None   # None: decided by large_products_in_c(); True / False: forced
LARGE_ROW_QUANTUM = 8        # a row cut falls on a multiple of this (the kernel's tallest block)
COPY_MIN_ROWS = 64           # a piece of this many rows copies b's own rows into panels (products.c)
AVX512_BLAS_CORES = ("skylakex", "cooperlake", "sapphirerapids")   # OpenBLAS's AVX-512 kernel sets


@functools.cache
def _c_beats_blas() -> bool:
    core = (blas_core() or "").lower()
    return "avx512f" in cpu_flags() and not any(core.startswith(c) for c in AVX512_BLAS_CORES)


def large_products_in_c() -> bool:
    """Whether the large products run in C: `LARGE_PRODUCTS_IN_C` where set, else where the
    library is compiled for AVX-512, NumPy's OpenBLAS does not run its AVX-512 kernels and the
    products are not oneMKL's (the module docstring; the same answer for the whole process)."""
    if LARGE_PRODUCTS_IN_C is not None:
        return bool(LARGE_PRODUCTS_IN_C)
    return _c_beats_blas() and not mkl_products()


def large_product_plan(a, b, out) -> tuple[np.ndarray, np.ndarray] | None:
    """(gl_matmul_large's plan words for ``a @ b -> out``: a, b, out, offsets, k, n, sai, sap,
    sbp, sbj, ldo, copy_rows (products.c); the entries' offsets they point to), or None where it
    does not take the product: not float32, empty, a stride not a whole non-negative number of
    elements, a or b without contiguous rows or columns, out's rows not contiguous."""
    if out.dtype != np.float32 or a.dtype != np.float32 or b.dtype != np.float32 or out.size == 0 \
            or a.ndim < 2 or b.ndim < 2:
        return None
    f = 4   # float32's itemsize
    if any(st < 0 or st % f for x in (a, b, out) for st in x.strides):
        return None
    m, k, n = out.shape[-2], a.shape[-1], out.shape[-1]
    sai, sap = a.strides[-2] // f, a.strides[-1] // f
    sbp, sbj = b.strides[-2] // f, b.strides[-1] // f
    if m == 1 and sap != 1:   # (a stride along an axis of one or no element says nothing)
        sai = 1
    if k <= 1:
        sap = 1
    if n == 1 or k == 0:
        sbj = 1
    if out.strides[-1] != f or (sap != 1 and sai != 1) or (sbj != 1 and sbp != 1):
        return None
    batch = out.shape[:-2]
    parts = [entry_offsets(x, batch) for x in (a, b, out)]
    if any(p is None for p in parts):
        return None
    offsets = np.ascontiguousarray(np.stack(parts, axis=1))
    plan = np.array([ptr(a), ptr(b), ptr(out), ptr(offsets), k, n, sai, sap, sbp, sbj, out.strides[-2] // f,
                     COPY_MIN_ROWS], np.int64)
    return plan, offsets


def large_matmul_closure(a, b, out):
    """``a @ b -> out`` by gl_matmul_large, or None (large_product_plan). On n threads: n pieces
    on the C worker team, cut along the rows (a multiple of LARGE_ROW_QUANTUM) where the
    product has at least as many rows as columns, else along the columns (SMALL_COLUMN_QUANTUM);
    every piece computes its elements as the whole does."""
    found = large_product_plan(a, b, out) if large_products_in_c() else None
    if found is None:
        return None
    plan, offsets = found
    fn = library().gl_matmul_large
    m, n, entries = out.shape[-2], out.shape[-1], len(offsets)
    whole = functools.partial(fn, ptr(plan), 0, entries, 0, m, 0, n)

    def tables_for(threads):
        if 2 * entries * m * n * a.shape[-1] < TEAM_MIN_FLOPS:
            return None
        if m >= n:
            parts = [functools.partial(fn, ptr(plan), 0, entries, i0, i1, 0, n)
                     for i0, i1 in even_cuts(m, threads, LARGE_ROW_QUANTUM)]
        else:
            parts = [functools.partial(fn, ptr(plan), 0, entries, 0, m, j0, j1)
                     for j0, j1 in even_cuts(n, threads, SMALL_COLUMN_QUANTUM)]
        return call_tables(parts)
    run = team_closure(whole, tables_for)
    run.arrays = (a, b, out, plan, offsets)   # (the plan's addresses point into these)
    run.large_product = True
    return run


# == panel products: x @ B (+ bias) with B in column panels (a Generator's fixed weights) ==================
# graphlm.ops.panel_matmul, made by the panel_weights pass: a panel of B is k rows of 32 floats one
# after the other, which the blocks of gl_matmul_panels read straight through (products.c). Its
# elements are gl_matmul_small's NN chains (then the bias add), so a decode step's bits are the
# same as with B in rows.


def panel_product_plan(x, panels, bias, out) -> tuple[np.ndarray, np.ndarray] | None:
    """(gl_matmul_panels' plan words: x, panels, bias, out, offsets, k, lda, ldo, n; the entries'
    offsets [entries, 4]), or None where it does not take the product: not float32, empty,
    panels not 32 wide or not contiguous, x's or out's rows not contiguous, a bias not one
    contiguous row per entry."""
    arrays = (x, panels, out) + (() if bias is None else (bias,))
    if any(t.dtype != np.float32 for t in arrays) or out.size == 0 or panels.shape[-1] != PANEL_WIDTH:
        return None
    f, k, (m, n) = 4, x.shape[-1], out.shape[-2:]
    dense = (k * PANEL_WIDTH * f, PANEL_WIDTH * f, f)   # (a stride along an axis of one element says nothing)
    if any(d > 1 and st != want for d, st, want in zip(panels.shape[-3:], panels.strides[-3:], dense)) \
            or out.strides[-1] != f or not (x.strides[-1] == f or k <= 1) \
            or any(t.strides[-2] % f or t.strides[-2] < 0 for t in (x, out)):
        return None
    batch = out.shape[:-2]
    rowed = np.broadcast_to(bias, out.shape) if bias is not None else None
    if rowed is not None and ((rowed.strides[-1] != f and n > 1) or (rowed.strides[-2] != 0 and m > 1)):
        return None
    parts = [entry_offsets(x, batch), entry_offsets(panels[..., 0, :, :], batch),
             entry_offsets(rowed, batch) if rowed is not None else np.zeros(int(np.prod(batch)), np.int64),
             entry_offsets(out, batch)]
    if any(p is None for p in parts):
        return None
    offsets = np.ascontiguousarray(np.stack(parts, axis=1))
    plan = np.array([ptr(x), ptr(panels), ptr(bias) or 0, ptr(out), ptr(offsets), k, x.strides[-2] // f,
                     out.strides[-2] // f, n], np.int64)
    return plan, offsets


def panel_matmul_closure(x, panels, bias, out):
    """``x @ B (+ bias) -> out`` by gl_matmul_panels, or None (panel_product_plan). On n threads:
    n pieces on the C worker team, cut along the rows (a multiple of LARGE_ROW_QUANTUM) where the
    product has more rows than the panels have columns, else along the panels (or the entries,
    where that cut is more even); every piece computes its elements as the whole does."""
    found = panel_product_plan(x, panels, bias, out)
    if found is None:
        return None
    plan, offsets = found
    fn = library().gl_matmul_panels
    m, n, entries, cn = out.shape[-2], out.shape[-1], len(offsets), panels.shape[-3]
    whole = functools.partial(fn, ptr(plan), 0, entries, 0, m, 0, cn)

    def tables_for(threads):
        if 2 * entries * m * n * x.shape[-1] < TEAM_MIN_FLOPS:
            return None
        by_entry, by_panel = even_cuts(entries, threads), even_cuts(cn, threads)
        if m > n:
            parts = [(0, entries, i0, i1, 0, cn) for i0, i1 in even_cuts(m, threads, LARGE_ROW_QUANTUM)]
        elif entries_more_even(by_entry, entries, by_panel, cn):
            parts = [(e0, e1, 0, m, 0, cn) for e0, e1 in by_entry]
        else:
            parts = [(0, entries, 0, m, c0, c1) for c0, c1 in by_panel]
        return call_tables([functools.partial(fn, ptr(plan), *part) for part in parts])
    run = team_closure(whole, tables_for)
    run.arrays = (x, panels, bias, out, plan, offsets)   # (the plan's addresses point into these)
    run.panel_product = True
    return run


@native_kernel("panel_matmul", rounds_own_way=True)
def _panel_matmul(node, out, ins, scratch):
    x, panels, *bias = ins
    return panel_matmul_closure(x, panels, bias[0] if bias else None, out)


# == BLAS products on the team (a training step's products on n threads) ==================================
# The numpy executor cuts a large product into pieces that round as the whole (matmul_parts) and
# runs them on its Python pool, whose hand-over of the GIL cost 50-100 us a piece here. In this
# executor the same pieces run on the C worker team as the very cblas_sgemm calls NumPy's matmul
# makes for them, checked once per product against np.matmul on random operands of its shapes and
# strides (a BLAS other than the one NumPy calls, or a call NumPy would make another way, shows
# there). Where the check fails or no OpenBLAS is loaded, the pieces run on the Python pool.


def _blas_operand(x) -> tuple[int, int] | None:
    """(transposed, leading dimension) of a 2-D float32 view as NumPy's matmul hands it to a
    row-major cblas_sgemm (not transposed where it can be), or None where it cannot."""
    (r, c), (s0, s1), f = x.shape, x.strides, x.itemsize
    if s1 == f and s0 % f == 0 and s0 // f >= max(1, c):
        return 0, s0 // f
    if s0 == f and s1 % f == 0 and s1 // f >= max(1, r):
        return 1, s1 // f
    return None


def sgemm_calls(a, b, out) -> list[tuple] | None:
    """The cblas_sgemm calls [(transa, transb, m, n, k, a, lda, b, ldb, c, ldc, accumulate), ...]
    that compute ``a @ b -> out`` (a batch entry one call each; accumulate 0), or None where it is
    not made of plain float32 GEMMs (a vector, an output NumPy would write transposed, a @ a.T,
    which NumPy hands to syrk)."""
    if out.dtype != np.float32 or a.dtype != np.float32 or b.dtype != np.float32 or min(a.ndim, b.ndim) < 2:
        return None
    batch = out.shape[:-2]
    a, b = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (a, b))
    calls = []
    for e in np.ndindex(*batch):
        ae, be, oe = a[e], b[e], out[e]
        m, k, n = oe.shape[0], ae.shape[1], oe.shape[1]
        ta, tb, to = _blas_operand(ae), _blas_operand(be), _blas_operand(oe)
        if None in (ta, tb, to) or to[0] or min(m, n, k) < 2 or ptr(ae) == ptr(be):
            return None
        calls.append((ta[0], tb[0], m, n, k, ptr(ae), ta[1], ptr(be), tb[1], ptr(oe), to[1], 0))
    return calls


def _sgemm_tables(calls_per_piece, sgemm) -> tuple[np.ndarray, np.ndarray]:
    """(pieces, calls) tables for gl_team_run: piece i makes the calls calls_per_piece[i]."""
    fn, kind = sgemm
    calls = np.array([c for piece in calls_per_piece for c in piece], np.int64).reshape(-1, team_words()[1])
    bounds = np.cumsum([0] + [len(piece) for piece in calls_per_piece])
    return team_table([(kind, fn, calls.ctypes.data, c0, c1) for c0, c1 in zip(bounds[:-1], bounds[1:])]), calls


def blas_team_tables(a, b, out, threads, sgemm):
    """(pieces, calls) running ``a @ b -> out`` on `threads` threads of the team, or None where
    the numpy executor's cut (matmul_parts) is none or its calls do not give np.matmul's bytes."""
    parts = matmul_parts(a, b, out, threads)
    calls = [sgemm_calls(*part) for part in parts]
    if len(parts) < 2 or any(c is None for c in calls) or any(st < 0 for x in (a, b, out) for st in x.strides):
        return None
    # the check: the same calls moved onto random operands of the same shapes and strides
    rng = np.random.default_rng(0)
    pa, pb, got, want = probe_like(a, rng), probe_like(b, rng), strided_empty(out)[0], strided_empty(out)[0]
    np.matmul(pa, pb, want)
    moves = [(ptr(a), a.nbytes, ptr(pa)), (ptr(b), b.nbytes, ptr(pb)), (ptr(out), out.nbytes, ptr(got))]

    def moved(address):
        for lo, size, to in moves:
            if lo <= address < lo + size:
                return address - lo + to
        raise ValueError("a piece's operand outside its product")
    probe = [[c[:5] + (moved(c[5]), c[6], moved(c[7]), c[8], moved(c[9]), *c[10:]) for c in piece] for piece in calls]
    table, _keep = _sgemm_tables(probe, sgemm)
    library().gl_team_run(table.ctypes.data, len(table))
    return _sgemm_tables(calls, sgemm) if same_bits(got, want) else None


def blas_matmul_closure(a, b, out):
    """The numpy executor's matmul_closure (np.matmul, split over threads when large), with its
    pieces on n threads run by the C worker team (section comment above)."""
    base = matmul_closure(a, b, out)
    whole, sgemm = getattr(base, "whole", None), blas_sgemm()
    if whole is None or sgemm is None:   # never split, or no OpenBLAS: as the numpy executor
        return base
    run = team_closure(whole, lambda threads: blas_team_tables(a, b, out, threads, sgemm), base)
    run.arrays = (a, b, out)   # (the tables' addresses point into these)
    return run


# == oneMKL products: the large products on Intel CPUs ===================================================

MKL_PRODUCTS = None   # None: decided by mkl_products(); True / False: forced (True still needs oneMKL)
BLAS_CHOICES = {"mkl": True, "openblas": False}   # GRAPHLM_BLAS's values


@functools.cache
def _mkl_by_default() -> bool:
    choice = os.environ.get("GRAPHLM_BLAS", "").strip().lower()
    if choice and choice not in BLAS_CHOICES:
        raise ValueError(f"GRAPHLM_BLAS={choice!r} is not one of {', '.join(BLAS_CHOICES)} (unset: oneMKL on an "
                         "Intel CPU where it is installed)")
    if choice == "mkl" and mkl_sgemm() is None:
        raise ValueError("GRAPHLM_BLAS=mkl, but oneMKL is not installed here (pip install mkl)")
    if choice:
        return BLAS_CHOICES[choice]
    return cpu_vendor() == "GenuineIntel" and mkl_sgemm() is not None


def mkl_products() -> bool:
    """Whether the large float32 products are oneMKL's: `MKL_PRODUCTS` where set, else
    GRAPHLM_BLAS where set, else on an Intel CPU where oneMKL is installed (the same answer for
    the whole process)."""
    if MKL_PRODUCTS is not None:
        return bool(MKL_PRODUCTS) and mkl_sgemm() is not None
    return _mkl_by_default()


def large_products_by() -> str:
    """Who runs the large float32 products in this process (benchmarks record it): "C", "oneMKL
    <version>" or "OpenBLAS <its kernels>"."""
    if large_products_in_c():
        return "C"
    if mkl_products():
        return "oneMKL " + mkl_sgemm()[1].split("Version ")[-1].split("-")[0]
    return f"OpenBLAS {blas_core() or '?'}"


def _mkl_tables(calls_per_piece) -> tuple[np.ndarray, np.ndarray]:
    """_sgemm_tables for oneMKL's cblas_sgemm (the team's kind 3: 32-bit integers)."""
    return _sgemm_tables(calls_per_piece, (mkl_sgemm()[0], 3))


def mkl_matmul(a, b, out) -> None:
    """``a @ b -> out`` as oneMKL's cblas_sgemm calls on the calling thread (NaN where it is not
    made of them): what a oneMKL product computes whole, for trying its cuts (matmul_parts)."""
    calls = sgemm_calls(a, b, out)
    if calls is None:
        out[...] = np.nan   # (no cut with such a piece is taken: it cannot match the whole)
        return
    table, _calls = _mkl_tables([calls])
    library().gl_team_run(table.ctypes.data, 1)


def mkl_matmul_closure(a, b, out):
    """``a @ b -> out`` by oneMKL where `mkl_products()` and it is made of plain GEMMs
    (sgemm_calls), else None: whole as one team piece, on n threads the cut matmul_parts finds
    exact against that whole (none: whole on the calling thread), its pieces on the team."""
    calls = sgemm_calls(a, b, out) if mkl_products() else None
    if calls is None:
        return None
    table, words = _mkl_tables([calls])
    team = library().gl_team_run

    def whole():
        team(table.ctypes.data, 1)

    flops = 2 * out.size * a.shape[-1]

    def tables_for(threads):
        parts = matmul_parts(a, b, out, threads, mkl_matmul) if flops >= MIN_SPLIT_FLOPS else []
        cut = [sgemm_calls(*part) for part in parts]
        return _mkl_tables(cut) if len(cut) > 1 and None not in cut else None
    run = team_closure(whole, tables_for, whole_piece=tuple(table[0]))
    run.arrays = (a, b, out, table, words)   # (the tables' addresses point into these)
    run.mkl_product = True
    return run


def product_closure(a, b, out):
    """The native ``a @ b -> out``: a small product, a large one in C, oneMKL's, else NumPy's BLAS
    on the team."""
    return (small_matmul_closure(a, b, out) or large_matmul_closure(a, b, out) or mkl_matmul_closure(a, b, out)
            or blas_matmul_closure(a, b, out))


def _own_rounding(node) -> bool:
    return node.dtype == np.float32 and (node.shape[-2] <= SMALL_ROWS or large_products_in_c() or mkl_products())


@native_kernel("matmul", rounds_own_way=_own_rounding)
def _matmul(node, out, ins, scratch):
    return product_closure(ins[0], ins[1], out)


@native_kernel("matmul_sum", rounds_own_way=_own_rounding)
def _matmul_sum(node, out, ins, scratch):
    return matmul_sum_closure(node, out, ins, product_closure)


def mkl_accumulate_closure(a, b, out):
    """matmul_accumulate ``sum(a[s] @ b[s]) -> out`` as oneMKL calls where `mkl_products()` and each
    product is one plain GEMM, else None: product 0 written, each later one added by the GEMM itself
    (beta 1), so no product is stored. Used only where that chain gives the bits of the products
    computed alone and added in order (tried once on random operands: a BLAS adds C as it likes).
    On n threads, the cut matmul_parts finds exact for product 0 (the others have its shapes and
    strides), each piece making its S calls in order."""
    if not mkl_products():
        return None
    a3, b3, total = accumulate_operands(a, b, out)
    calls = [sgemm_calls(a3[s], b3[s], total) for s in range(len(a3))]
    if None in calls or not _chain_adds_in_order(a3, b3, total):
        return None
    table, words = _mkl_tables([_chain(a3, b3, calls[0][0])])
    team = library().gl_team_run

    def whole():
        team(table.ctypes.data, 1)

    def tables_for(threads):
        flops = 2 * total.size * a3.shape[-1] * len(a3)
        parts = matmul_parts(a3[0], b3[0], total, threads, mkl_matmul) if flops >= MIN_SPLIT_FLOPS else []
        cut = [sgemm_calls(*part) for part in parts]
        return _mkl_tables([_chain(a3, b3, c[0]) for c in cut]) if len(cut) > 1 and None not in cut else None
    run = team_closure(whole, tables_for, whole_piece=tuple(table[0]))
    run.arrays = (a, b, out, table, words)   # (the tables' addresses point into these)
    run.mkl_product = True
    return run


def _chain(a3, b3, call) -> list[tuple]:
    """The S calls of one piece of matmul_accumulate from its call for product 0 (a3[s], b3[s]
    have product 0's shapes and strides: the same call at shifted addresses, adding from s = 1)."""
    return [call[:5] + (call[5] + ptr(a3[s]) - ptr(a3[0]), call[6], call[7] + ptr(b3[s]) - ptr(b3[0]),
                        *call[8:11], int(s > 0)) for s in range(len(a3))]


_chains_checked: dict[tuple, bool] = {}   # (shapes and strides) -> _chain_adds_in_order's answer


def _chain_adds_in_order(a3, b3, total) -> bool:
    """Whether oneMKL's accumulating chain gives, on random operands of these shapes and strides,
    the bits of each product computed alone and added in order (tried once per shapes and
    strides: GPT-2 small's twelve layers ask twelve times)."""
    key = tuple((x.shape, x.strides) for x in (a3, b3, total))
    if key not in _chains_checked:
        _chains_checked[key] = _try_chain(a3, b3, total)
    return _chains_checked[key]


def _try_chain(a3, b3, total) -> bool:
    rng = np.random.default_rng(0)
    pa, pb, got = probe_like(a3, rng), probe_like(b3, rng), strided_empty(total)[0]
    table, _keep = _mkl_tables([_chain(pa, pb, sgemm_calls(pa[0], pb[0], got)[0])])
    library().gl_team_run(table.ctypes.data, 1)
    want, one = strided_empty(total)[0], strided_empty(total)[0]
    mkl_matmul(pa[0], pb[0], want)
    for s in range(1, len(pa)):
        mkl_matmul(pa[s], pb[s], one)
        np.add(want, one, out=want)
    return same_bits(got, want)


def _sum_on_team(products, total):
    """The batch axis of the [S, m, n] products summed into `total` by the native `sum`'s C kernel
    on the team (matmul_accumulate where oneMKL's chain is not taken: the product and the sum it
    replaced), or None where the arrays are not native."""
    if not native_arrays(products, total):
        return None
    return sum_rows_closure(products, total, 1, products.shape[0], total.size)


@native_kernel("matmul_accumulate", rounds_own_way=_own_rounding)
def _matmul_accumulate(node, out, ins, scratch):
    return (mkl_accumulate_closure(*ins, out)
            or matmul_accumulate_closure(out, ins, scratch, product_closure, sum_closure=_sum_on_team))
