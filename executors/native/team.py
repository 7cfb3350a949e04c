"""The C worker team (team.c) and the raw words its pieces are made of.

A team piece is a row of int64 words: its kind first (a small product, a cblas_sgemm call
list, a decode step's cached attention, a kernel call), then its arguments; ``gl_team_run(table,
pieces)`` runs a table of them on the team's threads, handing a piece over in a fraction of a
microsecond where the numpy executor's Python pool costs tens. `team_closure` is the one way a
kernel's closure runs on n threads: a table built once per n, else the kernel's fallback. Here
too: array addresses (`ptr`), the batch-entry offsets of broadcast operands, NumPy's own
cblas_sgemm (the BLAS pieces and the C attention call it) and cblas_sdot (the global norm's),
and `split_calls`, which cuts a row kernel's C call into n calls on the team.
"""
from __future__ import annotations

import ctypes
import os
import platform

import numpy as np

from ..numpy import get_threads, pool
from ..numpy.pool import threaded
from ..numpy.tiling import even_cuts, size_groups
from .build import _F, _I, _P, _U64, library

MIN_SPLIT = 1 << 16         # elements: a row kernel below this runs on one thread (split_calls)
TEAM_MIN_FLOPS = 1 << 16    # flops: a small product below this runs whole (a piece handed over costs ~1 us)


def ptr(a) -> int | None:
    """The address of `a`'s first element (None stays NULL)."""
    return None if a is None else a.__array_interface__["data"][0]


def native_arrays(*arrays) -> bool:
    """Whether the native kernels take these arrays (float32, C-contiguous; None for NULL)."""
    return all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays)


def ptr_at(a, per: int, lo: int) -> int | None:
    """The address of element ``lo * per`` of `a` (None stays NULL; per 0: a broadcast array)."""
    return None if a is None else ptr(a) + lo * per * a.itemsize


def entry_offsets(x, batch) -> np.ndarray | None:
    """The element offset of each batch entry of `x` (an operand broadcasting to `batch`, its
    batch axes in front of its last two), in C order of `batch`; None where a stride is not a
    whole number of elements."""
    off = np.zeros(batch, np.int64)
    lead = len(batch) - (x.ndim - 2)
    for axis, (d, st) in enumerate(zip(x.shape[:-2], x.strides[:-2])):
        if d > 1:
            if st % x.itemsize:
                return None
            shape = [1] * len(batch)
            shape[lead + axis] = d
            off = off + (np.arange(d, dtype=np.int64) * (st // x.itemsize)).reshape(shape)
    return off.reshape(-1)


def team_words() -> tuple[int, int, int, int]:
    """(int64 words per piece of gl_team_run's table, words per cblas_sgemm call of a BLAS
    piece, integer words and floats of a kernel call piece): team.c's PIECE_WORDS,
    SGEMM_WORDS, CALL_INTS and CALL_FLOATS, read from the library."""
    return tuple((ctypes.c_int64 * 4).in_dll(library(), "gl_team_words"))


# the calling conventions under which team.c's run_call finds a kernel's arguments
CALLS_BY_CLASS = os.name == "posix" and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


def call_piece(part) -> tuple | None:
    """A kernel call ``functools.partial(library().gl_..., *args)`` as the words of a team piece
    of kind 5 (team.c: the function's address, its integer-class arguments, then its
    floats' bits), read from the function's declared argument types; None where it cannot be
    one (not such a partial, an argument of another type, too many of a class, or a platform
    whose calling convention does not pass the two classes apart)."""
    fn, args = getattr(part, "func", None), getattr(part, "args", ())
    types = getattr(fn, "argtypes", None)
    if not CALLS_BY_CLASS or types is None or getattr(part, "keywords", None) or len(args) != len(types):
        return None
    _, _, max_ints, max_floats = team_words()
    ints, floats = [], []
    for kind, a in zip(types, args):
        if kind is _F:
            floats.append(int(np.float32(a).view(np.uint32)))
        elif kind in (_P, _I, _U64):
            v = 0 if a is None else int(a)
            ints.append(v - (1 << 64) if v >= 1 << 63 else v)   # (a uint64's bits as an int64 word)
        else:
            return None
    if len(ints) > max_ints or len(floats) > max_floats:
        return None
    return (5, ctypes.cast(fn, ctypes.c_void_p).value, *ints, *[0] * (max_ints - len(ints)), *floats)


def call_tables(parts) -> tuple | None:
    """(the team table of the kernel calls `parts`,) where there are two or more and each can be
    a call piece (`call_piece`), else None (team_closure's tables_for)."""
    pieces = [call_piece(part) for part in parts]
    return (team_table(pieces),) if len(pieces) > 1 and None not in pieces else None


def team_table(pieces) -> np.ndarray:
    """gl_team_run's table [pieces, words per piece] int64 from tuples of words (each piece's
    kind first, then its words; the rest of its row 0: team.c, PIECE_WORDS)."""
    table = np.zeros((len(pieces), team_words()[0]), np.int64)
    for row, words in zip(table, pieces):
        row[:len(words)] = words
    return table


def team_closure(whole, tables_for, otherwise=None, whole_piece=None):
    """A closure running ``whole()`` on one thread, and on n threads the team table that
    ``tables_for(n)`` returns (built once per n: (table, *arrays the table's addresses point
    into)), or ``otherwise()`` (default whole) where it returns None. Its ``step_table(n)`` is the
    same work as one team table, for a run of steps in one C call (program.py, `StepRun`):
    whole as a call piece, or as the piece `whole_piece` (its words) where it is none."""
    tables: dict[int, tuple | None] = {}
    team = library().gl_team_run

    def found_for(threads):
        return tables[threads] if threads in tables else tables.setdefault(threads, tables_for(threads))

    def run():
        threads = get_threads()
        if threads == 1:
            return whole()
        found = found_for(threads)
        if found is None:
            return (otherwise or whole)()
        team(found[0].ctypes.data, len(found[0]))

    def step_table(threads):
        """The team table that runs this closure's work on `threads` threads: its own where it
        has one, else ``whole`` as one call piece; None where whole cannot be one (otherwise()
        then splits it on the Python pool)."""
        found = found_for(threads) if threads > 1 else None
        if found is not None:
            return found[0]
        piece = call_piece(whole) or whole_piece
        return None if piece is None else team_table([piece])
    run.whole, run.tables, run.step_table = whole, tables, step_table
    return run


def single_call(call, arrays):
    """A closure running the kernel call `call` (``functools.partial(library().gl_..., *args)``)
    on this thread whatever the thread count, with its `step_table` for a run of steps; `arrays`
    are held so their memory outlives the raw pointers inside the call."""
    run = team_closure(call, lambda threads: None)
    run.arrays = arrays
    return run


def checked_closure(check, inner, checked: tuple[int, ...]):
    """A closure running ``check()`` (which raises, naming the node, where an input is out of
    range: a position, an id), then ``inner()`` (a `team_closure`). For a run of steps its
    ``check`` may run before the whole run (program.py, `StepRun`: where the node's inputs at
    positions `checked` are fed inputs, which no step writes), and its ``step_table`` is
    inner's."""
    def run():
        check()
        inner()
    run.check, run.checked, run.step_table, run.arrays = check, checked, inner.step_table, inner
    return run


def split_calls(call, units: int, unit_size: int, arrays):
    """A closure running ``call(0, units)``, or on n threads ``call(lo, hi)`` over n contiguous
    ranges of units (each `unit_size` elements; split only above MIN_SPLIT elements per thread):
    on the C worker team, as kernel call pieces (`call_piece`), or where a call cannot be one,
    on the Python pool. `arrays` are held so their memory outlives the raw pointers inside the
    calls."""
    whole = call(0, units)

    def split(n):
        if units * unit_size < MIN_SPLIT * n:
            return []
        return [call(lo, hi) for lo, hi in even_cuts(units, n, max(1, 64 // max(1, unit_size)))]

    run = team_closure(whole, lambda n: call_tables(split(n)), threaded(whole, split))
    run.arrays = arrays
    return run


def sized_calls(call, sizes):
    """A closure running ``call(0, len(sizes))``, or on n threads ``call(lo, hi)`` over n runs of
    items of about equal total size (`size_groups`), as kernel call pieces on the team (a kernel
    that walks a list of arrays of uneven sizes: AdamW's parameters, the global norm's gradients)."""
    return team_closure(call(0, len(sizes)), lambda n: call_tables([call(lo, hi) for lo, hi in size_groups(sizes, n)]))


# == NumPy's cblas_sgemm and cblas_sdot ======================================================================

_found: dict[str, tuple[int, int] | None] = {}   # each function, looked up once


def blas_sgemm() -> tuple[int, int] | None:
    """(address of the cblas_sgemm of NumPy's OpenBLAS, the team's piece kind for it: 2 where it
    takes 64-bit integers, 3 for 32-bit), or None where no OpenBLAS with one is loaded."""
    if "sgemm" not in _found:
        kinds = {"scipy_cblas_sgemm64_": 2, "cblas_sgemm64_": 2, "scipy_cblas_sgemm": 3, "cblas_sgemm": 3}
        found = pool.openblas_function(*kinds)
        _found["sgemm"] = None if found is None else (ctypes.cast(found[1], ctypes.c_void_p).value, kinds[found[0]])
    return _found["sgemm"]


def blas_sdot() -> tuple[int, int] | None:
    """(address of the cblas_sdot of NumPy's OpenBLAS, 1 where it takes 64-bit integers else 0):
    the dot np.dot computes for float32 vectors; None where no OpenBLAS with one is loaded."""
    if "sdot" not in _found:
        wide = {"scipy_cblas_sdot64_": 1, "cblas_sdot64_": 1, "scipy_cblas_sdot": 0, "cblas_sdot": 0}
        found = pool.openblas_function(*wide)
        _found["sdot"] = None if found is None else (ctypes.cast(found[1], ctypes.c_void_p).value, wide[found[0]])
    return _found["sdot"]
