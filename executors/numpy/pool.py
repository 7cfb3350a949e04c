"""The numpy executor's thread pool: `set_threads(n)`, the workers, and the closures that run a
kernel whole on one thread or in pieces on n (`threaded`, `parallel`), plus the split thresholds.
Kernels decide their pieces (executors/numpy/tiling.py, the kernel families); this file only runs them.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np


# == threads =========================================================================================
# The executor splits its large kernels over `set_threads(n)` threads itself (NumPy and BLAS
# release the GIL while they compute): matmuls by batch entries or row blocks, blocked kernels
# by blocks, row-wise kernels (layer norm) by rows, AdamW by parameter groups, dropout masks by
# element ranges. Every piece computes exactly what it computes on one thread, so results do not
# depend on the thread count. With more than one thread, BLAS itself runs single-threaded.

_workers = {"threads": 1, "pool": None}
MIN_SPLIT_FLOPS = 1 << 23   # a matmul below this (~100 us on one core) is not split
MIN_SPLIT_ROWS = 1 << 16    # elements: a row-wise kernel below this is not split
MIN_SPLIT_ATTENTION_FLOPS = 1 << 25   # causal attention below this is not split (see below)
MIN_SPLIT_COPY = 1 << 18    # elements: a copy below this is not split
MIN_BLOCKS_PER_THREAD = 4   # a blocked kernel (or a dropout mask) with fewer blocks per thread is not split
# (measured per kernel at batch 1 on 2 threads: attention's 6.3 MFLOP products and the
# 74K-element QKV gradient assembly took longer split than whole; causal attention, whose query
# blocks run Python between their BLAS calls, took 1.55 ms split against 0.83 ms whole at 9.4
# MFLOP, a prefill of 128 tokens at batch 1)


def openblas_libraries() -> list[str]:
    """The paths of the OpenBLAS libraries loaded in this process (NumPy's among them), from
    /proc/self/maps; [] where there is none or no such file."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return []


def openblas_function(*names: str):
    """(name, function) of the first of `names` that an OpenBLAS loaded in this process exports
    (NumPy's: its symbols carry a prefix and suffix by build), or None where none does."""
    for path in openblas_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return name, fn
    return None


def set_blas_threads(n: int) -> bool:
    """Set the thread count of the OpenBLAS NumPy is linked against, at run time. Returns False
    when no OpenBLAS is loaded in this process (another BLAS keeps its own setting)."""
    found = openblas_function("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                              "openblas_set_num_threads") if n > 0 else None
    if found is None:
        return False
    found[1](ctypes.c_int(n))
    return True


def blas_core() -> str | None:
    """The name of the kernels the OpenBLAS NumPy uses runs ("Haswell", "SkylakeX", ...: what it
    detected, or what OPENBLAS_CORETYPE forced), or None where no OpenBLAS says (benchmarks
    record it; the native executor's large products choose by it)."""
    found = openblas_function("scipy_openblas_get_corename64_", "openblas_get_corename64_",
                              "scipy_openblas_get_corename", "openblas_get_corename")
    if found is None:
        return None
    fn = found[1]
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace").strip() or None


def set_threads(n: int) -> None:
    """Run the executor's large kernels on `n` threads and BLAS on one (the executor splits
    products itself; OpenBLAS's own workers spin for a while after every call and would fight
    its threads for the cores). Until called, the executor uses one thread and leaves BLAS as it
    is. Results do not depend on n."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"numpy executor: threads must be a positive int, got {n!r}")
    if n != _workers["threads"]:
        for worker in _workers["pool"] or ():
            worker.stop()
        _workers["threads"], _workers["pool"] = n, [_Worker() for _ in range(n - 1)] or None
    set_blas_threads(1)


def get_threads() -> int:
    """The executor's thread count (`set_threads`)."""
    return _workers["threads"]


def _workers_after_fork() -> None:
    """A forked child has none of its parent's pool threads: start its own (same count), or a
    kernel would post work to a thread that does not exist and wait for ever."""
    global _pool_lock
    _pool_lock = threading.Lock()
    if _workers["pool"] is not None:
        _workers["pool"] = [_Worker() for _ in _workers["pool"]]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_workers_after_fork)


SPIN_SECONDS = 300e-6   # a worker polls this long for its next piece before it sleeps


class _Worker:
    """One pool thread. After a piece it polls (yielding the GIL) for SPIN_SECONDS before it
    sleeps: kernels come back to back, and waking a sleeping thread costs ~50-100 us here, as
    much as a small piece's work. The caller blocks until the piece is done."""

    def __init__(self):
        self.job = None           # the piece to run (set by the caller, cleared by the worker)
        self.busy = False         # set by the caller when it posts a job, cleared when done
        self.error: BaseException | None = None
        self.wake = threading.Event()
        self.done = threading.Event()
        self.alive = True
        threading.Thread(target=self._loop, name="graphlm-numpy", daemon=True).start()

    def _loop(self):
        # floating-point warnings off, as in the caller's run (NumPy's errstate is per thread)
        with np.errstate(all="ignore"):
            self._serve()

    def _serve(self):
        clock, yield_gil = time.perf_counter, time.sleep
        while self.alive:
            start = clock()
            while self.job is None and clock() - start < SPIN_SECONDS:
                yield_gil(0)
            if self.job is None:
                self.wake.wait()
                continue
            job, self.job = self.job, None
            self.wake.clear()   # (the caller posts again only after this piece is done)
            try:
                job()
            except BaseException as e:   # handed to the caller by wait()
                self.error = e
            self.busy = False
            self.done.set()

    def post(self, job):
        self.error, self.busy = None, True
        self.done.clear()
        self.job = job
        self.wake.set()

    def wait(self):
        # (the caller blocks: polling here too, it would contend for the GIL the worker needs
        # to finish its piece; measured 2-7 % slower at batch 1, the same at batch 8)
        if self.busy:
            self.done.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def stop(self):
        self.alive = False
        self.wake.set()


_pool_lock = threading.Lock()


def parallel(parts) -> None:
    """Run the callables `parts` at once: the first on this thread, the others on the workers.
    Waits for all of them (they write planned memory) before raising any error. When another
    caller holds the workers (programs run from several user threads at once), the parts run
    one after the other on this thread: the same results, no sharing of a worker."""
    workers = _workers["pool"]
    if workers is None or not _pool_lock.acquire(blocking=False):
        for part in parts:
            part()
        return
    try:
        _post_and_wait(workers, parts)
    finally:
        _pool_lock.release()


def _post_and_wait(workers, parts) -> None:
    for worker, part in zip(workers, parts[1:]):
        worker.post(part)
    try:
        parts[0]()
    finally:
        errors = []
        for worker, _ in zip(workers, parts[1:]):
            try:
                worker.wait()
            except BaseException as e:
                errors.append(e)
    if errors:
        raise errors[0]


def threaded(whole, split):
    """A closure running ``whole()`` on one thread, or on n threads the callables ``split(n)``
    returns (built once per n; fewer than two means run whole)."""
    cache: dict[int, list] = {}

    def run():
        n = _workers["threads"]
        if n == 1:
            return whole()
        parts = cache.get(n)
        if parts is None:
            parts = cache[n] = split(n)
        if len(parts) < 2:
            return whole()
        parallel(parts)
    run.whole = whole   # (for tools and tests: the one-thread form)
    return run
