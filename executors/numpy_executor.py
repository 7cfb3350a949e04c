"""The numpy executor: all intermediate memory planned at compile time, nothing allocated per run.

`compile(graph, outputs)` plans memory once (executors/planner.py: schedule, liveness, views,
in-place reuse, one 64-byte aligned arena placed greedy-by-size), then binds every node to
NumPy arrays over that arena and every kernel to a zero-argument closure over those arrays.
`Program.run` copies the feeds into their private buffers, calls the closures in order and
copies the outputs out (the caller owns what `run` returns; a later run never touches it).

The kernel table
----------------
`KERNELS[op] = Kernel(build, inplace=..., scratch=...)`, registered with `@kernel(op, ...)`:

- ``build(node, out, ins, scratch) -> callable()``: `out` is the node's planned array, `ins` the
  arrays of its inputs (for update ops: the caller's state arrays, written in place), `scratch`
  the temporaries asked for. The returned closure computes the node into `out`; it must not
  allocate arrays proportional to the data (use ``out=``).
- ``inplace``: input positions the kernel can overwrite with its output (the planner uses one
  only when that input dies at this node and has the output's shape and dtype), or a function
  ``node -> positions``.
- ``scratch(node, inplace_pos) -> [(shape, dtype), ...]``: temporaries for one step; they live in
  the arena.

An op with a reference kernel but no entry here runs the reference kernel and copies its result
into the planned buffer (correct, but it allocates); an op with neither fails at compile.
`NumpyProgram.kernels` names the table a program uses: the native executor (executors/native.py)
derives its program from this one with a copy of the table in which some kernels are C.
Kernels compute exactly the reference's arithmetic, in the same order, so float results match
the reference bit for bit except where noted (`ROUNDS_OWN_WAY`: causal attention in query blocks,
see its section; `NumpyProgram.rounds_like_reference` says whether a program is exact).

Compile-time passes (before planning; each replaces graph nodes by `FusedNode`s that name
executor-private kernels, and none changes a result bit): `fuse_matmul_sums` (the
weight gradient of a batched ``x @ w``: the summed batch folded into one matmul; this one does
round differently),
`assemble_slice_gradients` (the QKV gradient in one node), `fuse_attention_softmax` (scale and
causal mask folded into softmax and its backward), `share_dropout_masks` (one mask per
forward/backward pair, drawn once per run), `pair_gelu_backward`, `pair_layer_norm_backward`
and `pair_attention_backward` (the forward keeps what the backward would recompute, in arena
blocks that live until their last reader: kernel scratch specs ``(shape, dtype,
until_node_id)``). Multi-pass kernels run block by block (`_blocked`, `BLOCK` elements) so their
passes hit cache;
`set_threads(n)` splits large kernels over n threads (see "threads" below; results do not depend
on n). `NumpyProgram.profile` times each kernel.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import special

from graphlm.ops import GELU_A, GELU_B, GELU_DA, GELU_DB, norm_parts
from graphlm.random import GOLDEN, MASK64, MIX1, MIX2, dropout_keep_scale, stream_base

from . import reference
from .base import ExecutionError, Program, check_index_range, node_where
from .planner import ALIGN, Plan, _proto, apply_view, layouts, make_plan


@dataclass(frozen=True)
class Kernel:
    build: Callable
    inplace: Sequence[int] | Callable = ()
    scratch: Callable | None = None


KERNELS: dict[str, Kernel] = {}


def kernel(*names, inplace=(), scratch=None):
    """Register `build` as the kernel of each op in `names`."""
    def deco(build):
        for name in names:
            KERNELS[name] = Kernel(build, inplace, scratch)
        return build
    return deco


def _s(x, dtype):
    """A scalar as a 0-d array of `dtype` (float32 stays float32, as in the reference)."""
    return np.asarray(x, dtype=dtype)


def _all_inputs(node):
    return tuple(range(len(node.inputs)))


def _flat(arr: np.ndarray, shape) -> np.ndarray | None:
    """A reshaped view of `arr`, or None when that would need a copy."""
    try:
        return np.reshape(arr, shape, copy=False)
    except ValueError:
        return None


BLOCK = 1 << 16   # elements per cache block (256 KiB of float32)
SMALL = 4096    # elements: at most this, kernels take a short path with the fewest NumPy calls (decoding)


# == threads =========================================================================================
# The executor splits its large kernels over `set_threads(n)` threads itself (NumPy and BLAS
# release the GIL while they compute): matmuls by batch entries or row blocks, blocked kernels
# by blocks, row-wise kernels (layer norm) by rows, AdamW by parameter groups, dropout masks by
# element ranges. Every piece computes exactly what it computes on one thread, so results do not
# depend on the thread count. With more than one thread, BLAS itself runs single-threaded.

_workers = {"threads": 1, "pool": None}

ROW_QUANTUM_CANDIDATES = (8, 16, 24, 32, 48, 64, 96)   # matmul row blocks: see _matmul_parts
MIN_SPLIT_FLOPS = 1 << 23   # a matmul below this (~100 us on one core) is not split
MIN_SPLIT_ROWS = 1 << 16    # elements: a row-wise kernel below this is not split
MIN_SPLIT_COPY = 1 << 18    # elements: a copy below this is not split
MIN_BLOCKS_PER_THREAD = 4   # a blocked kernel (or a dropout mask) with fewer blocks per thread is not split
# (measured per kernel at batch 1 on 2 threads: attention's 6.3 MFLOP products and the
# 74K-element QKV gradient assembly took longer split than whole)


def set_blas_threads(n: int) -> bool:
    """Set the thread count of the OpenBLAS NumPy is linked against, at run time. Returns False
    when no OpenBLAS is loaded in this process (another BLAS keeps its own setting)."""
    if n <= 0:
        return False
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return False
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                     "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False


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


def _cuts(total: int, n: int, quantum: int = 1) -> list[tuple[int, int]]:
    """[start, stop) ranges cutting range(total) into at most n contiguous pieces as even as
    possible, every boundary a multiple of `quantum`."""
    units = -(-total // quantum)
    bounds = sorted({min(total, (units * i // n) * quantum) for i in range(n + 1)})
    return list(zip(bounds[:-1], bounds[1:]))


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


def _parallel(parts) -> None:
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


def _threaded(whole, split):
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
        _parallel(parts)
    run.whole = whole   # (for tools and tests: the one-thread form)
    return run


def _cut(arr, out_ndim: int, axis: int, start: int, stop: int):
    """`arr`'s piece [start, stop) along `axis` of an output of `out_ndim` dimensions it
    broadcasts to (a broadcast or missing axis stays whole)."""
    k = axis - (out_ndim - arr.ndim)
    if k < 0 or arr.shape[k] == 1:
        return arr
    index = [slice(None)] * arr.ndim
    index[k] = slice(start, stop)
    return arr[tuple(index)]


def _balanced_axis(shape, n: int):
    """(largest piece / length, axis, cuts): the axis of `shape` whose cut into n pieces is the
    most even (the leftmost on a tie: contiguous pieces), or None when no axis has two entries."""
    best = None
    for axis in range(len(shape)):
        if shape[axis] > 1:
            cuts = _cuts(shape[axis], n)
            score = max(e - s for s, e in cuts) / shape[axis]
            if best is None or score < best[0]:
                best = (score, axis, cuts)
    return best


def _elementwise_parts(ins, out, n):
    """[(pieces of ins, piece of out)]: an elementwise ``f(*ins) -> out`` (inputs broadcasting to
    out) cut into at most n pieces along one axis of out; every element is computed as on the
    whole arrays."""
    chosen = _balanced_axis(out.shape, n)
    if chosen is None:
        return []
    _, axis, cuts = chosen
    return [([_cut(x, out.ndim, axis, s, e) for x in ins], _cut(out, out.ndim, axis, s, e)) for s, e in cuts]


def _size_groups(sizes, n: int) -> list[tuple[int, int]]:
    """[a, b) index ranges cutting the items of `sizes` into at most n contiguous runs of about
    equal total size (whole items: each run ends at the first item past an even cut)."""
    ends = np.cumsum(sizes)
    bounds = sorted({0} | {int(np.searchsorted(ends, stop, side="right")) for _, stop in _cuts(int(ends[-1]), n)})
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _run_blocks(body, blocks, blocks_for=None):
    """A closure running body over every block, the blocks split into contiguous runs per thread
    (when each thread gets at least MIN_BLOCKS_PER_THREAD of them). `blocks_for(n)`, when given,
    builds the blocks for n threads instead (an empty list: run whole)."""
    def run_all(part):
        for block in part:
            body(*block)

    def split(n):
        if blocks_for is None and len(blocks) < MIN_BLOCKS_PER_THREAD * n:
            return []
        bl = blocks if blocks_for is None else blocks_for(n)
        return [functools.partial(run_all, bl[a:b]) for a, b in _cuts(len(bl), n)]
    return _threaded(functools.partial(run_all, blocks), split)


def _rowwise(body, arrays, rows: int):
    """A closure running ``body(*arrays)``, on n threads over n contiguous row ranges (each array
    viewed as (rows, -1): full arrays and keepdims row statistics alike). For kernels whose
    passes are cheaper on whole arrays than on cache blocks (layer norm's rows of ~200)."""
    whole = functools.partial(body, *arrays)
    views = [_flat(a, (rows, -1)) for a in arrays]
    if arrays[0].size < MIN_SPLIT_ROWS or any(v is None for v in views):
        return whole
    return _threaded(whole, lambda n: [functools.partial(body, *(v[a:b] for v in views))
                                       for a, b in _cuts(rows, n)])


def _blocked(body, arrays, rows: int | None = None):
    """A closure running ``body(*views)`` block by block over `arrays`, so that all the passes of
    a multi-pass kernel run on data still in cache (the same arithmetic per element and per row).

    rows None: elementwise, all arrays have the same size and are cut as 1-d blocks.
    rows R: each array viewed as (R, -1) (full arrays and keepdims row arrays alike) and cut by
    rows, for reductions along the last axis. Where an array cannot be viewed so (strided
    data), `body` runs once on the whole arrays."""
    if rows is None:
        views, total, per = [_flat(a, (-1,)) for a in arrays], arrays[0].size, BLOCK
    else:
        views, total = [_flat(a, (rows, -1)) for a in arrays], rows
        per = max(1, BLOCK // max(1, arrays[0].size // max(rows, 1)))
    if total <= per or any(v is None for v in views):
        return functools.partial(body, *arrays)
    return _run_blocks(body, [tuple(v[s:s + per] for v in views) for s in range(0, total, per)])


def _mean_last(x, out):
    """np.mean(x, axis=-1, keepdims=True, out=out) for float32/float64, without np.mean's Python
    overhead (~5 us a call; it matters for small rows): the same float sum and division by the
    np.intp count, so bit-identical."""
    if x.dtype not in (np.float32, np.float64):
        return np.mean(x, axis=-1, keepdims=True, out=out)
    np.add.reduce(x, axis=-1, keepdims=True, out=out)
    return np.true_divide(out, np.intp(x.shape[-1]), out=out, casting="unsafe")


# == elementwise ===================================================================================

def _ufunc_kernel(fn):
    # out positional: a partial with keywords costs ~0.4 us more a call (decoding makes ~60);
    # np.maximum deprecates a positional out, so it keeps the keyword. Not split over threads:
    # one pass over memory gains nothing from a second core (measured: batch 8 adds 3.5 -> 5.0 ms)
    if fn is np.maximum:
        return lambda node, out, ins, scratch: functools.partial(fn, *ins, out=out)
    return lambda node, out, ins, scratch: functools.partial(fn, *ins, out)


for _name, _fn in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                   "maximum": np.maximum, "neg": np.negative, "exp": np.exp, "log": np.log,
                   "sqrt": np.sqrt, "tanh": np.tanh, "square": np.square,
                   "sigmoid": special.expit, "erf": special.erf}.items():
    kernel(_name, inplace=_all_inputs)(_ufunc_kernel(_fn))
for _name, _fn in {"greater": np.greater, "less": np.less, "equal": np.equal}.items():
    kernel(_name)(_ufunc_kernel(_fn))


@kernel("rsqrt", inplace=(0,))
def _rsqrt(node, out, ins, scratch):
    (x,), one = ins, _s(1.0, node.dtype)

    def run():
        np.sqrt(x, out=out)
        np.divide(one, out, out=out)
    return run


@kernel("relu", inplace=(0,))
def _relu(node, out, ins, scratch):
    return functools.partial(np.maximum, ins[0], _s(0.0, node.dtype), out=out)


@kernel("silu")
def _silu(node, out, ins, scratch):
    (x,) = ins

    def run():
        special.expit(x, out=out)
        np.multiply(x, out, out=out)
    return run


@kernel("pow", inplace=(0,))
def _pow(node, out, ins, scratch):
    return functools.partial(np.power, ins[0], _s(node.attrs["exponent"], node.dtype), out=out)


@kernel("cast")
def _cast(node, out, ins, scratch):
    return functools.partial(np.copyto, out, ins[0], casting="unsafe")


@kernel("where", inplace=(2,))
def _where(node, out, ins, scratch):
    c, a, b = ins

    def run():
        if b is not out:
            np.copyto(out, b)
        np.copyto(out, a, where=c)
    return run


class _GeluConstants:
    """The tanh GELU's constants as scalars of one dtype (see graphlm.ops' GELU note)."""

    def __init__(self, dt):
        self.one = _s(1.0, dt)
        self.a, self.b, self.da, self.db = (_s(c, dt) for c in (GELU_A, GELU_B, GELU_DA, GELU_DB))


def _gelu_sigmoid(x, s, k):
    """s = 1 / (exp((x*x*A + B)*x) + 1): the one exp of every tanh-GELU kernel, in the
    reference's order."""
    np.multiply(x, x, s)
    np.multiply(s, k.a, s)
    np.add(s, k.b, s)
    np.multiply(s, x, s)
    np.exp(s, s)
    np.add(s, k.one, s)
    np.divide(k.one, s, s)


def _gelu_grad(x, g, s, out, b, k):
    """out = g*(s + (1 - s)*s*x*(x*x*DA + DB)) from the sigmoid s; b is scratch and `out` holds
    the second factor until the last pass (it must not alias x, g or s)."""
    np.subtract(k.one, s, b)
    np.multiply(b, s, b)
    np.multiply(b, x, b)
    np.multiply(x, x, out)
    np.multiply(out, k.da, out)
    np.add(out, k.db, out)
    np.multiply(b, out, b)
    np.add(b, s, b)
    np.multiply(g, b, out)


@kernel("gelu")
def _gelu(node, out, ins, scratch):
    (x,) = ins
    dt = node.dtype
    half, one = _s(0.5, dt), _s(1.0, dt)
    if node.attrs["approximate"] == "tanh":
        k = _GeluConstants(dt)

        def body(x, out):  # x*s; out positional: see _ufunc_kernel
            _gelu_sigmoid(x, out, k)
            np.multiply(x, out, out)
        return _blocked(body, [x, out])
    r2 = _s(1 / math.sqrt(2.0), dt)

    def run_erf():  # 0.5*x*(1 + erf(x/sqrt(2)))
        np.multiply(x, r2, out=out)
        special.erf(out, out=out)
        np.add(one, out, out=out)
        np.multiply(out, x, out=out)
        np.multiply(out, half, out=out)
    return run_erf


def _gelu_backward_scratch(node, pos):
    n = 2 if node.attrs["approximate"] == "tanh" else 1
    return [(node.shape, node.dtype)] * n


@kernel("gelu_backward", scratch=_gelu_backward_scratch)
def _gelu_backward(node, out, ins, scratch):
    x, g = ins
    dt = node.dtype
    half, one = _s(0.5, dt), _s(1.0, dt)
    if node.attrs["approximate"] == "tanh":
        k = _GeluConstants(dt)

        def body(x, g, out, s, b):
            _gelu_sigmoid(x, s, k)
            _gelu_grad(x, g, s, out, b, k)
        return _blocked(body, [x, g, out, *scratch])
    (a,) = scratch
    r2, c2, mhalf = _s(1 / math.sqrt(2.0), dt), _s(1 / math.sqrt(2 * math.pi), dt), _s(-0.5, dt)

    def run_erf():
        # d = 0.5*(1 + erf(x/sqrt2)) + x*exp(-0.5*x*x)/sqrt(2 pi)
        np.multiply(x, r2, out=a)
        special.erf(a, out=a)
        np.add(one, a, out=a)
        np.multiply(half, a, out=a)
        np.multiply(mhalf, x, out=out)
        np.multiply(out, x, out=out)
        np.exp(out, out=out)
        np.multiply(x, out, out=out)
        np.multiply(out, c2, out=out)
        np.add(a, out, out=a)
        np.multiply(g, a, out=out)
    return run_erf


class _SavedSigmoid:
    """The sigmoid s of one float32 tanh-GELU's input, written by the forward kernel and read
    by the backward kernels of the same input (an arena block live until the last of them)."""

    def __init__(self):
        self.s: np.ndarray | None = None
        self.until: int | None = None   # the last backward node reading s (ends its lifetime)


def _pair_with_slots(nodes, pairs, slot_type, keep_op: str, kept_op: str):
    """Rewrite every forward node in `pairs` (forward id -> its backward ids, in run order) to
    `keep_op` and its backward nodes to `kept_op`, sharing one new `slot_type()` whose `until`
    is the last of those backward nodes (the kept arrays live until it). Returns the node list."""
    if not pairs:
        return list(nodes)
    slots = {fid: slot_type() for fid in pairs}
    for fid, bids in pairs.items():
        slots[fid].until = bids[-1]
    slot_of = {bid: slots[fid] for fid, bids in pairs.items() for bid in bids}
    out = []
    for n in nodes:
        if n.id in slots:
            n = FusedNode(n, keep_op, n.inputs, {**n.attrs, "slot": slots[n.id]})
        elif n.id in slot_of:
            n = FusedNode(n, kept_op, n.inputs, {**n.attrs, "slot": slot_of[n.id]})
        out.append(n)
    return out


def pair_gelu_backward(nodes):
    """Let each float32 tanh-GELU whose input also feeds a ``gelu_backward`` keep its sigmoid for
    that backward: ``gelu`` -> ``gelu_keep_sigmoid``, ``gelu_backward`` -> ``gelu_backward_sigmoid``
    (no exp recomputed: 9 passes instead of 16, bit-identical). Returns the new node list."""
    forward = {}
    for k, n in enumerate(nodes):
        if n.op == "gelu" and n.attrs["approximate"] == "tanh" and n.dtype == np.float32:
            forward.setdefault(n.inputs[0].id, (k, n))
    pairs = {}
    for k, n in enumerate(nodes):
        if n.op == "gelu_backward" and n.attrs["approximate"] == "tanh" and n.inputs[0].id in forward:
            fk, f = forward[n.inputs[0].id]
            if fk < k and n.dtype == np.float32:
                pairs.setdefault(f.id, []).append(n.id)
    return _pair_with_slots(nodes, pairs, _SavedSigmoid, "gelu_keep_sigmoid", "gelu_backward_sigmoid")


@kernel("gelu_keep_sigmoid", scratch=lambda node, pos: [(node.shape, node.dtype, node.attrs["slot"].until)])
def _gelu_keep_sigmoid(node, out, ins, scratch):
    (x,) = ins
    slot = node.attrs["slot"]
    (slot.s,) = scratch   # planned in the arena, live until the last backward reads it
    k = _GeluConstants(node.dtype)

    def body(x, out, s):  # the gelu kernel's arithmetic, with the sigmoid kept in s
        _gelu_sigmoid(x, s, k)
        np.multiply(x, s, out)
    return _blocked(body, [x, out, slot.s])


@kernel("gelu_backward_sigmoid", scratch=lambda node, pos: [(node.shape, node.dtype)])
def _gelu_backward_sigmoid(node, out, ins, scratch):
    x, g = ins
    slot, k = node.attrs["slot"], _GeluConstants(node.dtype)

    def body(x, g, s, out, b):  # the gelu_backward kernel's arithmetic, from the kept s
        _gelu_grad(x, g, s, out, b, k)
    return _blocked(body, [x, g, slot.s, out, *scratch])


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
    window = out[node.attrs["index"]]

    def run():
        out.fill(0)
        np.copyto(window, g)
    return run


def _probe_like(x: np.ndarray, rng) -> np.ndarray:
    """Random values in an array of x's shape, dtype and strides (64-byte aligned, as the arena),
    for trying a product's cuts without touching x."""
    if any(st < 0 for st in x.strides):
        return rng.standard_normal(x.shape).astype(x.dtype)
    span = 1 + sum((d - 1) * st for d, st in zip(x.shape, x.strides)) // x.itemsize if x.size else 1
    raw = np.empty(span * x.itemsize + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    buf = raw[start:start + span * x.itemsize].view(x.dtype)
    buf[...] = rng.standard_normal(span)
    return np.lib.stride_tricks.as_strided(buf, x.shape, x.strides)


def pieces_round_as_whole(a, b, out, axis: int, cuts, matmul=np.matmul) -> bool:
    """Whether ``a @ b -> out`` computed as the products of its pieces [s, e) along out's `axis`
    gives the whole product's bytes. Tried on random operands of the same shapes, strides and
    dtype: a BLAS call's order of operations depends on its shapes (blocking, register tiles, the
    small-matrix and gemv paths), not on the values, so one try decides every later run."""
    rng = np.random.default_rng(0)
    pa, pb = _probe_like(a, rng), _probe_like(b, rng)
    whole, split = np.empty(out.shape, out.dtype), np.full(out.shape, np.nan, out.dtype)
    matmul(pa, pb, whole)
    rows = axis == out.ndim - 2
    for s, e in cuts:
        matmul(_cut(pa, out.ndim, axis, s, e), pb if rows else _cut(pb, out.ndim, axis, s, e),
               _cut(split, out.ndim, axis, s, e))
    return whole.tobytes() == split.tobytes()


_checked_cuts: dict[tuple, bool] = {}


def _cuts_round_as_whole(a, b, out, axis: int, cuts) -> bool:
    """pieces_round_as_whole, tried once per distinct product and cut in this process."""
    key = (out.dtype.str, a.shape, a.strides, b.shape, b.strides, out.shape, out.strides, axis, tuple(cuts))
    found = _checked_cuts.get(key)
    if found is None:
        found = _checked_cuts[key] = pieces_round_as_whole(a, b, out, axis, cuts)
    return found


def _matmul_parts(a, b, out, n):
    """[(a_i, b_i, out_i)]: ``a @ b -> out`` cut into at most n products along out's largest
    batch axis or into blocks of rows (at multiples of one of ROW_QUANTUM_CANDIDATES rows), the
    best balanced cut first (a batch cut on a tie: it leaves every GEMM as it was). A cut is used
    only when its pieces round exactly as the whole product, tried once per distinct product on
    random operands of its shapes (`pieces_round_as_whole`): BLAS kernels compute rows in
    register tiles and take other paths for small products, so which cuts are exact depends on
    the BLAS, its kernel and the shape. No exact cut: [] (the product stays whole)."""
    if a.ndim < 2 or b.ndim < 2:
        return []
    options = []   # (largest piece / total, prefer, axis of out, cuts)
    batch = _balanced_axis(out.shape[:-2], n)
    if batch is not None:
        options.append((batch[0], 0, batch[1], batch[2]))
    m, seen = out.shape[-2], set()
    for quantum in ROW_QUANTUM_CANDIDATES:
        if m <= quantum:
            break
        cuts = _cuts(m, n, quantum)
        if cuts[-1][1] - cuts[-1][0] == 1:   # NumPy runs a one-row product as a gemv (other rounding)
            cuts = cuts[:-2] + [(cuts[-2][0], m)]
        if len(cuts) > 1 and tuple(cuts) not in seen:
            seen.add(tuple(cuts))
            options.append((max(e - s for s, e in cuts) / m, 1, out.ndim - 2, cuts))
    for _, _, axis, cuts in sorted(options, key=lambda o: o[:2]):
        if _cuts_round_as_whole(a, b, out, axis, cuts):
            rows = axis == out.ndim - 2
            return [(_cut(a, out.ndim, axis, s, e), b if rows else _cut(b, out.ndim, axis, s, e),
                     _cut(out, out.ndim, axis, s, e)) for s, e in cuts]
    return []


def _matmul_closure(a, b, out):
    """np.matmul(a, b, out), split over the executor's threads when the product is large."""
    whole = functools.partial(np.matmul, a, b, out)   # out positional: see _ufunc_kernel
    batch = int(np.prod(out.shape[:-2], dtype=np.int64)) if out.ndim > 2 else 1
    if a.ndim < 2 or b.ndim < 2 or 2 * batch * out.shape[-2] * a.shape[-1] * out.shape[-1] < MIN_SPLIT_FLOPS:
        return whole
    return _threaded(whole, lambda n: [functools.partial(np.matmul, *p) for p in _matmul_parts(a, b, out, n)])


@kernel("matmul")
def _matmul(node, out, ins, scratch):
    # (not folded here: OpenBLAS rounds a folded float32 product differently from the batched
    # one the reference computes; graphlm.nn.Linear folds its rows in the graph instead)
    return _matmul_closure(ins[0], ins[1], out)


class FusedNode:
    """A node the executor computes differently from the graph: `op` names an executor-private
    kernel; id, shape, dtype and name are those of the graph node it replaces."""

    def __init__(self, node, op, inputs, attrs):
        self.id, self.op, self.inputs, self.attrs = node.id, op, tuple(inputs), attrs
        self.shape, self.dtype, self.name, self.scope = node.shape, node.dtype, node.name, node.scope
        self.graph, self.is_backward, self.node = node.graph, node.is_backward, node

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    label = property(lambda self: self.node.label)


def _matmul_sum_operands(a, b, axes):
    """Views A' [..., m, S*k] and B' [..., S*k, n] such that sum over `axes` of a @ b is A' @ B'
    (the summed batch axes folded into the contraction), or None when NumPy would need copies."""
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    nb = len(batch)
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    rest = [i for i in range(nb) if i not in axes]
    summed = [i for i in range(nb) if i in axes]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    s = int(np.prod([batch[i] for i in summed], dtype=np.int64))
    rest_shape = tuple(batch[i] for i in rest)
    try:
        a2 = np.reshape(a.transpose(rest + [nb] + summed + [nb + 1]), rest_shape + (m, s * k), copy=False)
        b2 = np.reshape(b.transpose(rest + summed + [nb, nb + 1]), rest_shape + (s * k, n), copy=False)
    except ValueError:
        return None
    return a2, b2, rest_shape + (m, n)


def fuse_matmul_sums(nodes, outputs, protos):
    """Replace ``sum(matmul(a, b), batch axes)`` (a batched product's weight gradient) by one
    matmul over the folded axes when the matmul has no other use. Returns (new node list,
    {matmul node: fused node})."""
    consumers: dict[int, list] = {}
    for n in nodes:
        for i in n.inputs:
            consumers.setdefault(i.id, []).append(n)
    output_ids = {o.id for o in outputs}
    replace, fused = {}, {}
    for n in nodes:
        if n.op != "sum" or n.inputs[0].op != "matmul":
            continue
        mm = n.inputs[0]
        axes = n.attrs["axes"]
        if mm.id in output_ids or len(consumers.get(mm.id, ())) != 1 or not axes \
                or max(axes) >= mm.ndim - 2 or mm.dtype.kind != "f":
            continue
        a, b = (protos[i.id] for i in mm.inputs)
        if _matmul_sum_operands(a, b, axes) is None:
            continue
        f = FusedNode(n, "matmul_sum", mm.inputs, dict(n.attrs))
        replace[n.id] = f
        fused[mm] = f
    if not fused:
        return list(nodes), {}
    skip = {mm.id for mm in fused}
    return [replace.get(n.id, n) for n in nodes if n.id not in skip], fused


@kernel("matmul_sum")
def _matmul_sum(node, out, ins, scratch):
    a2, b2, shape = _matmul_sum_operands(ins[0], ins[1], node.attrs["axes"])
    return _matmul_closure(a2, b2, np.reshape(out, shape, copy=False))


def assemble_slice_gradients(nodes, outputs):
    """Replace a tree of ``add`` nodes over ``slice_backward`` nodes with disjoint windows (the
    gradient of q, k and v sliced from one fused QKV product) by one ``slices_assemble`` node that
    writes each gradient into its window (zero-filling only what no window covers), reading
    through any reshape chain above a gradient instead of copying it. Every covered element is
    ``g + 0`` exactly as the reference's sum of zero-padded arrays. Returns the new node list."""
    uses: dict[int, int] = {}
    for n in nodes:
        for i in n.inputs:
            uses[i.id] = uses.get(i.id, 0) + 1
    output_ids = {o.id for o in outputs}
    private = lambda n: uses.get(n.id, 0) == 1 and n.id not in output_ids

    def leaves(n, inner):
        if n.op == "slice_backward":
            return [n]
        if n.op == "add" and all(i.shape == n.shape for i in n.inputs) and n.inputs[0] is not n.inputs[1]:
            found = []
            for i in n.inputs:
                if not private(i):
                    return None
                sub = leaves(i, inner)
                if sub is None:
                    return None
                found += sub
            inner.append(n)
            return found
        return None

    replace, removed = {}, set()
    for n in reversed(nodes):
        if n.op != "add" or n.id in removed or n.dtype.kind != "f":
            continue
        inner: list = []
        found = leaves(n, inner)
        if not found or len(found) < 2:
            continue
        cover = np.zeros(n.shape, np.int8)
        for sb in found:
            cover[sb.attrs["index"]] += 1
        if cover.max() > 1:
            continue
        srcs, shapes = [], []
        base = _proto(n.shape, n.dtype)
        for sb in found:
            src, window = sb.inputs[0], base[sb.attrs["index"]]
            while src.op == "reshape" and private(src) and _flat(window, src.inputs[0].shape) is not None:
                src = src.inputs[0]
            srcs.append(src)
            shapes.append(src.shape)
        removed.update(x.id for x in inner)
        removed.update(sb.id for sb in found)
        for sb, src in zip(found, srcs):   # the reshapes read through
            r = sb.inputs[0]
            while r is not src:
                removed.add(r.id)
                r = r.inputs[0]
        removed.discard(n.id)
        replace[n.id] = FusedNode(n, "slices_assemble", srcs,
                                  {"indexes": [sb.attrs["index"] for sb in found],
                                   "covered": bool(cover.min() == 1)})
    if not replace:
        return list(nodes)
    return [replace.get(n.id, n) for n in nodes if n.id not in removed]


@kernel("slices_assemble")
def _slices_assemble(node, out, ins, scratch):
    zero = _s(0.0, node.dtype)
    windows = [np.reshape(out[idx], src.shape, copy=False) for idx, src in zip(node.attrs["indexes"], ins)]
    covered = node.attrs["covered"]

    def copy(pairs):
        for src, window in pairs:
            np.add(src, zero, out=window)

    def run():
        if not covered:
            out.fill(0)
        copy(zip(ins, windows))

    def split(n):   # each window cut into n pieces; piece k of every window on thread k
        cut = [_elementwise_parts([src], window, n) for src, window in zip(ins, windows)]
        if any(len(c) != len(cut[0]) for c in cut):
            return []
        return [functools.partial(copy, [(c[k][0][0], c[k][1]) for c in cut]) for k in range(len(cut[0]))]
    if not covered or out.size < MIN_SPLIT_COPY:
        return run
    return _threaded(run, split)


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
    ids_col = ids.reshape(-1, 1) if _flat(ids, (-1, 1)) is not None else None
    flat_g, flat_out = _flat(g, (-1,)), out.reshape(-1)
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


# == fused NN ops ========================================================================================

def _keep_shape(node, axis):
    return tuple(1 if i == axis else d for i, d in enumerate(node.shape))


@kernel("softmax", inplace=(0,), scratch=lambda node, pos: [(_keep_shape(node, node.attrs["axis"]), node.dtype)])
def _softmax(node, out, ins, scratch):
    (x,), (m,), axis = ins, scratch, node.attrs["axis"]
    ax = -1 if axis == node.ndim - 1 else axis   # blocks are 2-d views

    def body(x, out, m):  # np.maximum.reduce / np.add.reduce: what np.max / np.sum call
        np.maximum.reduce(x, axis=ax, keepdims=True, out=m)
        np.subtract(x, m, out)
        np.exp(out, out)
        np.add.reduce(out, axis=ax, keepdims=True, out=m)
        np.divide(out, m, out)
    return _by_rows(node, axis, body, [x, out, m])


def _by_rows(node, axis, body, arrays):
    """`body` over blocks of rows when `axis` (the reduced one) is the last, else once."""
    if axis != node.ndim - 1:
        return functools.partial(body, *arrays)
    rows = node.size // node.shape[-1] if node.shape[-1] else 0
    return _blocked(body, arrays, rows)


@kernel("softmax_backward", scratch=lambda node, pos: [(_keep_shape(node, node.attrs["axis"]), node.dtype)])
def _softmax_backward(node, out, ins, scratch):
    (y, g), (s,), axis = ins, scratch, node.attrs["axis"]
    ax = -1 if axis == node.ndim - 1 else axis   # blocks are 2-d views

    def body(y, g, out, s):  # y*(g - sum(g*y))
        np.multiply(g, y, out=out)
        np.sum(out, axis=ax, keepdims=True, out=s)
        np.subtract(g, s, out=out)
        np.multiply(y, out, out=out)
    return _by_rows(node, axis, body, [y, g, out, s])


def _scalar_const(n):
    """(other input, const input, const position) when `n` is a mul by a 0-d const, else None."""
    if n.op != "mul" or len(n.inputs) != 2:
        return None
    for pos in (0, 1):
        c = n.inputs[pos]
        if c.op == "const" and c.shape == () and c.dtype == n.dtype and n.inputs[1 - pos].shape == n.shape:
            return n.inputs[1 - pos], c, pos
    return None


def fuse_attention_softmax(nodes, outputs):
    """Fold the scale and the causal mask around a softmax over the last axis into it, forward
    ``softmax(causal_mask(x * c))`` -> ``softmax_fused`` and backward
    ``causal_mask(softmax_backward(y, g), fill=0) * c`` -> ``softmax_backward_fused``, when the
    intermediates have no other use. The fused kernels run the same arithmetic block by block
    over whole T x S matrices (bit-identical, and two full passes over the scores fewer each
    way). Returns the new node list."""
    uses: dict[int, int] = {}
    for n in nodes:
        for i in n.inputs:
            uses[i.id] = uses.get(i.id, 0) + 1
    output_ids = {o.id for o in outputs}
    private = lambda n: uses.get(n.id, 0) == 1 and n.id not in output_ids
    last = lambda n: n.ndim >= 2 and n.attrs.get("axis") == n.ndim - 1
    replace, removed = {}, set()
    for n in nodes:
        if n.op == "softmax" and last(n) and n.dtype.kind == "f":
            src, mask, scale = n.inputs[0], None, None
            if src.op == "causal_mask" and private(src):
                mask, removed_here, src = src, [src.id], src.inputs[0]
            else:
                removed_here = []
            sc = _scalar_const(src) if private(src) else None
            if sc is not None:
                removed_here.append(src.id)
                scale, src = sc, sc[0]
            if mask is None and scale is None:
                continue
            ins = [src] + ([scale[1]] if scale else [])
            replace[n.id] = FusedNode(n, "softmax_fused", ins, {
                "mask": (mask.attrs["fill"], mask.attrs["offset"]) if mask is not None else None,
                "scale_pos": scale[2] if scale else None})
            removed.update(removed_here)
        elif n.op in ("mul", "causal_mask") and n.dtype.kind == "f":
            root, scale, mask = n, None, None
            sc = _scalar_const(n)
            cur = n
            if sc is not None:
                scale, cur = sc, sc[0]
                if not private(cur):
                    continue
            if cur.op == "causal_mask" and cur.attrs["fill"] == 0.0:
                mask, cur = cur, cur.inputs[0]
                if not private(cur):
                    continue
            if cur.op != "softmax_backward" or not last(cur) or (mask is None and scale is None) \
                    or (mask is not None and mask is not n and scale is None):
                continue
            if scale is None and n.op != "causal_mask":
                continue
            removed.update(x.id for x in (cur, mask) if x is not None and x is not root)
            ins = list(cur.inputs) + ([scale[1]] if scale else [])
            replace[root.id] = FusedNode(root, "softmax_backward_fused", ins, {
                "axis": cur.attrs["axis"],
                "mask": (0.0, mask.attrs["offset"]) if mask is not None else None,
                "scale_pos": scale[2] if scale else None})
    if not replace:
        return list(nodes)
    return [replace.get(n.id, n) for n in nodes if n.id not in removed]


def _matrices(body, arrays, shape):
    """`body` over blocks of whole [T, S] matrices of `arrays` (viewed as (M, T, -1))."""
    t, s_ = shape[-2], shape[-1]
    m = int(np.prod(shape[:-2], dtype=np.int64))
    views = [_flat(a, (m, t, -1)) for a in arrays]
    per = max(1, BLOCK // max(1, t * s_))
    if m <= per or any(v is None for v in views):
        return functools.partial(body, *arrays)
    return _run_blocks(body, [tuple(v[i:i + per] for v in views) for i in range(0, m, per)])


def _above(node, offset):
    t, s_ = node.shape[-2:]
    return ~np.tri(t, s_, k=offset, dtype=bool)


@kernel("softmax_fused", inplace=(0,), scratch=lambda node, pos: [(node.shape[:-1] + (1,), node.dtype)])
def _softmax_fused(node, out, ins, scratch):
    x, k = ins[0], (ins[1] if len(ins) > 1 else None)
    (m,), a = scratch, node.attrs
    mask, pos = a["mask"], a["scale_pos"]
    above = _above(node, mask[1]) if mask else None
    fill = _s(mask[0], node.dtype) if mask else None

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
    return _matrices(body, [x, out, m], node.shape)


@kernel("softmax_backward_fused", scratch=lambda node, pos: [(node.shape[:-1] + (1,), node.dtype)])
def _softmax_backward_fused(node, out, ins, scratch):
    y, g, k = ins[0], ins[1], (ins[2] if len(ins) > 2 else None)
    (s_,), a = scratch, node.attrs
    mask, pos = a["mask"], a["scale_pos"]
    above = _above(node, mask[1]) if mask else None
    zero = _s(0.0, node.dtype)

    def body(y, g, out, s_):  # the softmax_backward, causal_mask and mul kernels' arithmetic
        np.multiply(g, y, out=out)
        np.sum(out, axis=-1, keepdims=True, out=s_)
        np.subtract(g, s_, out=out)
        np.multiply(y, out, out=out)
        if above is not None:
            np.copyto(out, zero, where=above)
        if k is not None:
            np.multiply(*((out, k) if pos == 1 else (k, out)), out=out)
    return _matrices(body, [y, g, out, s_], node.shape)


# == causal attention ==================================================================================
# softmax(causal_mask(q @ k^T * scale)) @ v and its gradient, in query blocks of about
# ATTENTION_QUERY_BLOCK rows: query block [r0, r1) needs keys [0, r1) only, so the scores above the
# block diagonal (a quarter of them with two blocks) are never computed, exponentiated or
# multiplied, nor stored: the scores are kept block after block, block b of all matrices as one
# contiguous [..., r1 - r0, r1] array (strided sub-blocks would make NumPy's broadcasting passes
# buffer every operand and run 2.5x slower per element). Per run of matrices (ATTENTION_CHUNK
# score elements, so a block's passes stay in cache) the forward keeps E = exp(s - rowmax)
# unnormalised and l = rowsum(E); the output is (E @ v) / l, and the backward works from E and g/l:
#   ds = E * ((g/l) @ v^T - rowsum(g*o)/l)   (= P * (dP - rowsum(P*dP)), the softmax gradient)
#   dq = ds @ k * scale,  dk = ds^T @ q * scale,  dv = E^T @ (g/l)
# (dk and dv summed over the query blocks). The scale multiplies q (forward) and dq, dk (backward)
# instead of the T x T scores. This rounds differently from the reference's plain form (tests
# compare within 1e-6 relative); the results do not depend on the thread count.

ROUNDS_OWN_WAY = {"causal_attention", "causal_attention_keep", "causal_attention_backward",
                  "causal_attention_backward_kept"}
ATTENTION_QUERY_BLOCK = 64
ATTENTION_CHUNK = 1 << 17   # score elements per run of matrices (512 KiB of float32)


def _query_blocks(t: int) -> list[tuple[int, int]]:
    return _cuts(t, max(1, round(t / ATTENTION_QUERY_BLOCK)))


def _score_size(t: int) -> int:
    """Score elements kept per matrix: the blocks on and below the diagonal."""
    return sum((r1 - r0) * r1 for r0, r1 in _query_blocks(t))


def _score_blocks(e, lead, t: int) -> list[np.ndarray]:
    """Views ``[*lead, r1 - r0, r1]`` of the query blocks in a score buffer of ``S * prod(lead)``
    elements, block after block (so a run of matrices of one block is contiguous)."""
    flat, m = e.reshape(-1), int(np.prod(lead, dtype=np.int64))
    views, at = [], 0
    for r0, r1 in _query_blocks(t):
        size = (r1 - r0) * r1 * m
        views.append(flat[at:at + size].reshape(tuple(lead) + (r1 - r0, r1)))
        at += size
    return views


def _attention_chunks(lead, t: int, pieces: int = 1) -> list[tuple]:
    """Index tuples that select runs of matrices along the last leading axis (at most
    ATTENTION_CHUNK score elements each, and at least `pieces` runs where there are enough
    matrices). Leading shape () gives one run: the matrix with a new axis in front."""
    if not lead:
        return [(None,)]
    inner = lead[-1]
    per = max(1, min(inner, ATTENTION_CHUNK // max(1, t * t)))
    outer = int(np.prod(lead[:-1], dtype=np.int64))
    while per > 1 and outer * -(-inner // per) < pieces:
        per = -(-per // 2)
    return [tuple(o) + (slice(h, min(h + per, inner)),)
            for o in np.ndindex(*lead[:-1]) for h in range(0, inner, per)]


def _attention_closure(body, arrays, lead, t: int, flops: int):
    """A closure running `body` over runs of matrices of `arrays` (each indexed by the run), the
    runs cut finer and split over the executor's threads when the work is large."""
    def runs(pieces):
        return [tuple(a[idx] for a in arrays) for idx in _attention_chunks(lead, t, pieces)]
    return _run_blocks(body, runs(1), runs if flops >= MIN_SPLIT_FLOPS else lambda n: [])


def _attention_flops(shape) -> int:
    """The forward's product FLOPs with the masked quarter skipped (a split threshold only)."""
    t, d = shape[-2:]
    return 4 * int(np.prod(shape[:-2], dtype=np.int64)) * t * t * d * 3 // 4


def softmax_block(x, lb, r0, up):
    """One query block's scores x ``[m, r1 - r0, r1]`` (query rows from r0) to E = exp(x - rowmax)
    in place, the diagonal block's upper triangle `up` masked to 0; lb ``[m, r1 - r0, 1]`` gets
    rowsum(E)."""
    np.copyto(x[..., r0:], -np.inf, where=up)
    np.maximum.reduce(x, axis=-1, keepdims=True, out=lb)
    np.subtract(x, lb, x)
    np.exp(x, x)
    np.add.reduce(x, axis=-1, keepdims=True, out=lb)


def softmax_ds_block(s, x, ddb):
    """One query block of the softmax gradient, in place: s = (s - ddb) * E (E in x)."""
    np.subtract(s, ddb, s)
    np.multiply(s, x, s)   # E is 0 above the diagonal


# the attention kernels' two block steps; an executor deriving from this one may pass its own
ATTENTION_BLOCK_STEPS = (softmax_block, softmax_ds_block)


def _attention_scores(q, k, v, o, l, qs, e, scale, blocks, above, steps=ATTENTION_BLOCK_STEPS):
    """E (blocks `e`) and l of one run of matrices; and, when `o` is given, o = (E @ v) / l."""
    np.multiply(q, scale, qs)
    for (r0, r1), up, x in zip(blocks, above, e):
        lb = l[..., r0:r1, :]
        np.matmul(qs[..., r0:r1, :], np.swapaxes(k[..., :r1, :], -1, -2), x)
        steps[0](x, lb, r0, up)
        if o is not None:
            np.matmul(x, v[..., :r1, :], o[..., r0:r1, :])
    if o is not None:
        np.divide(o, l, o)


def _attention_gradients(q, k, v, o, g, l, dq, dk, dv, gs, dd, tmp, e, ds, scale, blocks,
                         steps=ATTENTION_BLOCK_STEPS):
    np.multiply(g, o, gs)
    np.add.reduce(gs, axis=-1, keepdims=True, out=dd)   # rowsum(g*o) = rowsum(P*dP)
    np.divide(dd, l, dd)
    np.divide(g, l, gs)
    for (r0, r1), x, s in zip(blocks, e, ds):
        np.matmul(gs[..., r0:r1, :], np.swapaxes(v[..., :r1, :], -1, -2), s)
        steps[1](s, x, dd[..., r0:r1, :])
        np.matmul(s, k[..., :r1, :], dq[..., r0:r1, :])
    # dk, dv: sums over the query blocks of ds_b^T @ q_b and E_b^T @ (g/l)_b, which reach keys
    # [0, r1): the last block (all keys) writes, the others add
    for i in reversed(range(len(blocks))):
        r0, r1 = blocks[i]
        last = i == len(blocks) - 1
        for a, b, out in ((ds[i], q, dk), (e[i], gs, dv)):
            target = out if last else tmp[..., :r1, :]
            np.matmul(np.swapaxes(a, -1, -2), b[..., r0:r1, :], target)
            if not last:
                np.add(out[..., :r1, :], target, out[..., :r1, :])
    np.multiply(dq, scale, dq)
    np.multiply(dk, scale, dk)


def _attention_plan(node):
    t = node.shape[-2]
    blocks = _query_blocks(t)
    above = [~np.tri(r1 - r0, r1 - r0, dtype=bool) for r0, r1 in blocks]
    return blocks, above, _s(node.attrs["scale"], node.dtype)


class _SavedScores:
    """E (flat blocks) and l of one causal_attention, kept by the forward for its backward."""

    def __init__(self):
        self.e = self.l = None
        self.until: int | None = None


def pair_attention_backward(nodes):
    """Let a ``causal_attention`` whose output feeds a ``causal_attention_backward`` (the VJP gives
    it the forward's output) keep E and l for it: ``causal_attention_keep`` and
    ``causal_attention_backward_kept``, no scores recomputed. Returns the new node list."""
    forward = {n.id: n for n in nodes if n.op == "causal_attention"}
    pairs = {}
    for n in nodes:
        if n.op == "causal_attention_backward" and n.inputs[3].id in forward:
            f = forward[n.inputs[3].id]
            if all(a.id == b.id for a, b in zip(f.inputs, n.inputs[:3])) and f.attrs == n.attrs:
                pairs.setdefault(f.id, []).append(n.id)
    return _pair_with_slots(nodes, pairs, _SavedScores, "causal_attention_keep",
                            "causal_attention_backward_kept")


def _scores_specs(shape, dtype, *keep):
    """Scratch specs of E ``[*lead, S]`` and l ``[*lead, T, 1]`` for attention of `shape`."""
    lead, t = shape[:-2], shape[-2]
    return [(lead + (_score_size(t),), dtype, *keep), (lead + (t, 1), dtype, *keep)]


def _attention_scratch(node, pos):
    slot = node.attrs.get("slot")
    return [(node.shape, node.dtype)] + _scores_specs(node.shape, node.dtype,
                                                      *([slot.until] if slot else []))


@kernel("causal_attention", "causal_attention_keep", scratch=_attention_scratch)
def _causal_attention(node, out, ins, scratch, steps=ATTENTION_BLOCK_STEPS):
    q, k, v = ins
    qs, e, l = scratch
    if "slot" in node.attrs:   # planned in the arena, live until the backward reads them
        node.attrs["slot"].e, node.attrs["slot"].l = e, l
    blocks, above, scale = _attention_plan(node)
    lead, t = node.shape[:-2], node.shape[-2]
    body = lambda q, k, v, o, l, qs, *e: _attention_scores(q, k, v, o, l, qs, e, scale, blocks, above, steps)
    return _attention_closure(body, [q, k, v, out, l, qs, *_score_blocks(e, lead, t)], lead, t,
                              _attention_flops(node.shape))


def _attention_backward_scratch(node, pos):
    shape, dt = node.shape[1:], node.dtype
    own = [_scores_specs(shape, dt)[0], (shape, dt), (shape[:-1] + (1,), dt), (shape, dt)]  # ds, g/l, dd, tmp
    if node.op == "causal_attention_backward":   # unpaired: E and l recomputed here
        own += _scores_specs(shape, dt)
    return own


@kernel("causal_attention_backward", "causal_attention_backward_kept", scratch=_attention_backward_scratch)
def _causal_attention_backward(node, out, ins, scratch, steps=ATTENTION_BLOCK_STEPS):
    q, k, v, o, g = ins
    ds, gs, dd, tmp, *own = scratch
    slot = node.attrs.get("slot")
    e, l = (slot.e, slot.l) if slot is not None else own
    blocks, above, scale = _attention_plan(node)
    lead, t = node.shape[1:-2], node.shape[-2]
    nb = len(blocks)

    def body(q, k, v, o, g, l, dq, dk, dv, gs, dd, tmp, *blocks_e_ds):
        e, ds = blocks_e_ds[:nb], blocks_e_ds[nb:]
        if slot is None:   # unpaired: the forward's E and l first (gs holds q * scale meanwhile)
            _attention_scores(q, k, None, None, l, gs, e, scale, blocks, above, steps)
        _attention_gradients(q, k, v, o, g, l, dq, dk, dv, gs, dd, tmp, e, ds, scale, blocks, steps)
    arrays = [q, k, v, o, g, l, out[0], out[1], out[2], gs, dd, tmp,
              *_score_blocks(e, lead, t), *_score_blocks(ds, lead, t)]
    return _attention_closure(body, arrays, lead, t, 2 * _attention_flops(node.shape[1:]))


@kernel("log_softmax", inplace=(0,),
        scratch=lambda node, pos: [(node.shape, node.dtype), (_keep_shape(node, node.attrs["axis"]), node.dtype)])
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
        scratch=lambda node, pos: [(_keep_shape(node, node.attrs["axis"]), node.dtype)])
def _log_softmax_backward(node, out, ins, scratch):
    (y, g), (s,), axis = ins, scratch, node.attrs["axis"]

    def run():  # g - exp(y)*sum(g)
        np.sum(g, axis=axis, keepdims=True, out=s)
        np.exp(y, out=out)
        np.multiply(out, s, out=out)
        np.subtract(g, out, out=out)
    return run


def _rows(node):
    return node.shape[:-1] + (1,)


@kernel("layer_norm", inplace=(0,),
        scratch=lambda node, pos: [(node.shape, node.dtype), (_rows(node), node.dtype), (_rows(node), node.dtype)])
def _layer_norm(node, out, ins, scratch):
    x, w, b, _ = norm_parts(ins, node.attrs)
    sq, m, v = scratch
    eps = _s(node.attrs["eps"], node.dtype)

    if node.size <= SMALL and x.dtype in (np.float32, np.float64):
        # few rows (decoding): the fewest NumPy calls, with the count and eps as arrays of m's
        # shape (a float count divides exactly as np.mean's intp one: see _mean_last)
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
        _mean_last(x, m)
        np.subtract(x, m, out=out)
        np.multiply(out, out, out=sq)
        _mean_last(sq, v)
        np.add(v, eps, out=v)
        np.sqrt(v, out=v)
        np.divide(out, v, out=out)
        if w is not None:
            np.multiply(out, w, out=out)
        if b is not None:
            np.add(out, b, out=out)
    return _rowwise(body, [x, out, sq, m, v], node.size // node.shape[-1])   # (cache blocks of rows measured no faster)


class _SavedNorm:
    """What a layer_norm's backward recomputes, kept by the forward kernel (arena blocks
live until the last node that reads them):
    xc = x - mean(x), sv = sqrt(mean(xc*xc) + eps) (rows) and, when a backward node recomputes
    the normalised input for the weight gradient, xhat = xc / sv."""

    def __init__(self):
        self.xc = self.sv = self.xhat = None
        self.until: int | None = None   # the last node reading the kept values


def pair_layer_norm_backward(nodes):
    """Let a layer_norm keep xc, sv (and xhat) for the nodes after it that recompute them from the
    same input and eps: ``layer_norm_backward`` (-> ``layer_norm_backward_kept``: 4 of its 17
    passes saved) and a plain ``layer_norm(x)`` with no weight or bias (-> ``layer_norm_kept``:
    one copy instead of 7 passes). Those nodes no longer read x, so x's buffer dies earlier.
    Bit-identical: the kept values are computed the same way."""
    forward, users = {}, {}
    position = {n.id: k for k, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "layer_norm" and not n.is_backward:
            forward.setdefault((n.inputs[0].id, n.attrs["eps"]), n)
    for n in nodes:
        key = (n.inputs[0].id, n.attrs.get("eps")) if n.inputs else None
        f = forward.get(key)
        if f is None or position[n.id] <= position[f.id]:
            continue
        if n.op == "layer_norm_backward" or (n.op == "layer_norm" and not n.attrs.get("has_weight")
                                              and not n.attrs.get("has_bias")):
            users.setdefault(f.id, []).append(n)
    slots = {fid: (_SavedNorm(), any(u.op == "layer_norm" for u in us)) for fid, us in users.items()}
    for fid, us in users.items():
        slots[fid][0].until = max((u.id for u in us), key=position.__getitem__)
    user_slot = {u.id: slots[fid][0] for fid, us in users.items() for u in us}
    out = []
    for n in nodes:
        if n.id in slots:
            slot, keep_xhat = slots[n.id]
            n = FusedNode(n, "layer_norm_keep", n.inputs, {**n.attrs, "slot": slot, "keep_xhat": keep_xhat})
        elif n.id in user_slot:
            op = "layer_norm_kept" if n.op == "layer_norm" else "layer_norm_backward_kept"
            # x is no longer read: dropping it lets its buffer die at the forward
            n = FusedNode(n, op, n.inputs[1:], {**n.attrs, "slot": user_slot[n.id]})
        out.append(n)
    return out


def _layer_norm_keep_scratch(node, pos):
    until = node.attrs["slot"].until
    kept = [(node.shape, node.dtype, until), (_rows(node), node.dtype, until)]
    if node.attrs["keep_xhat"]:
        kept.append((node.shape, node.dtype, until))
    return [(node.shape, node.dtype), (_rows(node), node.dtype)] + kept


@kernel("layer_norm_keep", scratch=_layer_norm_keep_scratch)
def _layer_norm_keep(node, out, ins, scratch):
    x, w, b, _ = norm_parts(ins, node.attrs)
    sq, m, *kept = scratch
    a = node.attrs
    slot = a["slot"]
    eps = _s(a["eps"], node.dtype)
    # xc, sv (and xhat) are planned in the arena, live until the last node that reads them
    slot.xc, slot.sv = kept[0], kept[1]
    slot.xhat = kept[2] if a["keep_xhat"] else None
    separate = slot.xhat is not None
    xhat_or_out = slot.xhat if separate else out

    def body(x, out, sq, m, xc, v, xhat):  # the layer_norm kernel's arithmetic, keeping xc, sv and xhat
        _mean_last(x, m)
        np.subtract(x, m, out=xc)
        np.multiply(xc, xc, out=sq)
        _mean_last(sq, v)
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
    return _rowwise(body, [x, out, sq, m, slot.xc, slot.sv, xhat_or_out], node.size // node.shape[-1])


@kernel("layer_norm_kept")
def _layer_norm_kept(node, out, ins, scratch):
    slot = node.attrs["slot"]
    return functools.partial(np.copyto, out, slot.xhat)


@kernel("layer_norm_backward_kept", inplace=lambda node: (len(node.inputs) - 1,),
        scratch=lambda node, pos: [(node.shape, node.dtype)] * 2 + [(_rows(node), node.dtype)] * 3)
def _layer_norm_backward_kept(node, out, ins, scratch):
    w, g = (ins[0] if node.attrs.get("has_weight") else None), ins[-1]   # inputs: [w], [b], g
    xhat, gh, r, m1, m2 = scratch
    slot = node.attrs["slot"]
    one = _s(1.0, node.dtype)

    def body(xc, sv, g, out, xhat, gh, r, m1, m2):  # layer_norm_backward's arithmetic from kept xc, sv
        np.divide(one, sv, out=r)
        np.multiply(xc, r, out=xhat)
        _layer_norm_backward_from_xhat(xhat, r, g, w, out, gh, m1, m2)
    return _rowwise(body, [slot.xc, slot.sv, g, out, xhat, gh, r, m1, m2], node.size // node.shape[-1])


def _last_and_first(node):
    return (len(node.inputs) - 1, 0)


@kernel("layer_norm_backward", inplace=_last_and_first,
        scratch=lambda node, pos: [(node.shape, node.dtype)] * 2 + [(_rows(node), node.dtype)] * 4)
def _layer_norm_backward(node, out, ins, scratch):
    x, w, _, (g,) = norm_parts(ins, node.attrs)
    xhat, gh, m, r, m1, m2 = scratch
    eps, one = _s(node.attrs["eps"], node.dtype), _s(1.0, node.dtype)

    def body(x, g, out, xhat, gh, m, r, m1, m2):  # r*(gh - mean(gh) - xhat*mean(gh*xhat))
        _mean_last(x, m)
        np.subtract(x, m, out=xhat)
        np.multiply(xhat, xhat, out=gh)
        _mean_last(gh, r)
        np.add(r, eps, out=r)
        np.sqrt(r, out=r)
        np.divide(one, r, out=r)
        np.multiply(xhat, r, out=xhat)
        _layer_norm_backward_from_xhat(xhat, r, g, w, out, gh, m1, m2)
    return _rowwise(body, [x, g, out, xhat, gh, m, r, m1, m2], node.size // node.shape[-1])


def _layer_norm_backward_from_xhat(xhat, r, g, w, out, gh, m1, m2):
    """out = r*(gh - mean(gh) - xhat*mean(gh*xhat)) with gh = g*w; overwrites xhat and gh."""
    if w is not None:
        np.multiply(g, w, out=gh)
    else:
        np.copyto(gh, g)
    np.multiply(gh, xhat, out=out)
    _mean_last(out, m2)
    _mean_last(gh, m1)
    np.multiply(xhat, m2, out=xhat)
    np.subtract(gh, m1, out=out)
    np.subtract(out, xhat, out=out)
    np.multiply(r, out, out=out)


@kernel("rms_norm", inplace=(0,),
        scratch=lambda node, pos: ([(node.shape, node.dtype)] if pos is not None else []) + [(_rows(node), node.dtype)])
def _rms_norm(node, out, ins, scratch):
    x, w, _, _ = norm_parts(ins, node.attrs)
    sq, v = (scratch if len(scratch) == 2 else (out, scratch[0]))
    eps = _s(node.attrs["eps"], node.dtype)

    def run():  # x / sqrt(mean(x*x) + eps) * w
        np.multiply(x, x, out=sq)
        _mean_last(sq, v)
        np.add(v, eps, out=v)
        np.sqrt(v, out=v)
        np.divide(x, v, out=out)
        if w is not None:
            np.multiply(out, w, out=out)
    return run


@kernel("rms_norm_backward", inplace=_last_and_first,
        scratch=lambda node, pos: [(node.shape, node.dtype)] * 2 + [(_rows(node), node.dtype)] * 3)
def _rms_norm_backward(node, out, ins, scratch):
    x, w, _, (g,) = norm_parts(ins, node.attrs)
    t, gh, r, r3, m = scratch
    eps, one = _s(node.attrs["eps"], node.dtype), _s(1.0, node.dtype)

    def run():  # r*gh - x*(r*r*r)*mean(gh*x)
        np.multiply(x, x, out=t)
        _mean_last(t, r)
        np.add(r, eps, out=r)
        np.sqrt(r, out=r)
        np.divide(one, r, out=r)
        if w is not None:
            np.multiply(g, w, out=gh)
        else:
            np.copyto(gh, g)
        np.multiply(gh, x, out=t)
        _mean_last(t, m)
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
    flat = _flat(logits, (-1,))
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
    count, one = _s(n, node.dtype), _s(1.0, node.dtype)
    pick = _picker(node, out, targets, idx, picked)
    flat_out = _flat(out, (-1,))

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


@kernel("causal_mask", inplace=(0,))
def _causal_mask(node, out, ins, scratch):
    (x,) = ins
    t, s = node.shape[-2:]
    above = ~np.tri(t, s, k=node.attrs["offset"], dtype=bool)
    fill = _s(node.attrs["fill"], node.dtype)

    def run():
        if x is not out:
            np.copyto(out, x)
        np.copyto(out, fill, where=above)
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


class _MaskSlot:
    """The keep mask shared by the dropout nodes of one (key, stream, p, shape): drawn once per
    run by the first of them (the forward), read by the others (the backward)."""

    def __init__(self):
        self.mask: np.ndarray | None = None
        self.until: int | None = None   # the last dropout node reading the mask


def share_dropout_masks(nodes):
    """Replace every ``dropout`` node by a ``dropout_shared`` node: nodes with the same key input,
    stream, p, shape and dtype (a forward dropout and its backward) share one boolean mask, drawn
    by the first of them in run order. Returns the new node list."""
    slots: dict[tuple, _MaskSlot] = {}
    out = []
    for n in nodes:
        if n.op != "dropout":
            out.append(n)
            continue
        key = (n.inputs[1].id, n.attrs["stream"], n.attrs["p"], n.shape, n.dtype.str)
        draw = key not in slots
        slot = slots.setdefault(key, _MaskSlot())
        slot.until = n.id   # nodes come in run order: the last one met reads the mask last
        out.append(FusedNode(n, "dropout_shared", n.inputs, {**n.attrs, "slot": slot, "draw": draw}))
    return out


_MASK_CHUNK = 1 << 15   # elements per pass when drawing a mask (uint64 temporaries stay in cache)


def keep_threshold(p: float) -> int:
    """The 64-bit threshold of the keep test: mix64(...) >= this  <=>  the uniform >= float32(p)
    (see keep_mask_drawer)."""
    return math.ceil(float(np.float32(p)) * 2 ** 24) << 40


def keep_mask_drawer(shape, stream: int, p: float):
    """A function ``draw(key, mask)`` filling the boolean `mask` (of `shape`) with exactly
    ``graphlm.random.counter_uniform(key, stream, shape) >= float32(p)``, in cache-sized chunks
    with preallocated temporaries (nothing allocated per call); on n executor threads, n
    element ranges at once (each element's value depends only on its index).

    ``u = (mix64(base + (i+1)*golden) >> 40) * 2^-24 >= p`` is the integer test
    ``mix64(...) >= ceil(float32(p) * 2^24) << 40`` (u is k * 2^-24 exactly, k < 2^24). The test
    reads only bits 40-63, which mix64's last step ``z ^= z >> 31`` leaves as they are (z >> 31
    is zero from bit 33 up), so the drawer skips that step: 8 passes per chunk, not 10."""
    n = int(np.prod(shape, dtype=np.int64))
    c = min(n, _MASK_CHUNK)
    with np.errstate(over="ignore"):
        steps = np.arange(1, c + 1, dtype=np.uint64) * np.uint64(GOLDEN)
    threshold = np.uint64(keep_threshold(p))
    m1, m2 = np.uint64(MIX1), np.uint64(MIX2)
    s30, s27 = np.uint64(30), np.uint64(27)

    def draw_range(base, flat, lo, hi, z, t):
        for start in range(lo, hi, c):
            k = min(c, hi - start)
            zk, tk = z[:k], t[:k]
            np.add(steps[:k], np.uint64((base + start * GOLDEN) & MASK64), out=zk)
            np.right_shift(zk, s30, out=tk)
            np.bitwise_xor(zk, tk, out=zk)
            np.multiply(zk, m1, out=zk)
            np.right_shift(zk, s27, out=tk)
            np.bitwise_xor(zk, tk, out=zk)
            np.multiply(zk, m2, out=zk)   # (mix64's last step, z ^= z >> 31, keeps bits 33-63)
            np.greater_equal(zk, threshold, out=flat[start:start + k])

    ranges: dict[int, list] = {}   # threads -> [(lo, hi, z, t)], temporaries per range

    def draw(key: int, mask: np.ndarray) -> None:
        flat, base = mask.reshape(-1), stream_base(key, stream)
        threads = _workers["threads"]
        if n < MIN_BLOCKS_PER_THREAD * threads * c:
            threads = 1
        if threads not in ranges:
            ranges[threads] = [(lo, hi, np.empty(c, np.uint64), np.empty(c, np.uint64))
                               for lo, hi in _cuts(n, threads, c)]
        parts = [functools.partial(draw_range, base, flat, *r) for r in ranges[threads]]
        if len(parts) == 1:
            parts[0]()
        else:
            _parallel(parts)
    return draw


def _dropout_mask_scratch(node, pos):
    """The drawing node's mask, planned in the arena and live until the last node reading it."""
    return [(node.shape, np.bool_, node.attrs["slot"].until)] if node.attrs.get("draw", True) else []


@kernel("dropout_shared", inplace=(0,), scratch=_dropout_mask_scratch)
def _dropout_shared(node, out, ins, scratch):
    x, key = ins
    a = node.attrs
    slot = a["slot"]
    scale = np.asarray(1.0 / (1.0 - a["p"]), dtype=node.dtype)
    if a["draw"]:
        (slot.mask,) = scratch
        draw = keep_mask_drawer(node.shape, a["stream"], a["p"])
    mask = slot.mask

    def body(x, mask, out):  # x * keep * scale == x * (keep * scale) bit for bit (keep is 0 or 1)
        np.multiply(x, mask, out=out)
        np.multiply(out, scale, out=out)
    apply = _blocked(body, [x, mask, out])
    if not a["draw"]:
        return apply

    def run():
        draw(int(key), mask)
        apply()
    return run


@kernel("dropout", inplace=(0,), scratch=lambda node, pos: [(node.shape, np.bool_)])
def _dropout(node, out, ins, scratch):
    """A dropout node compiled on its own (share_dropout_masks normally replaces it)."""
    attrs = {**node.attrs, "slot": _MaskSlot(), "draw": True}
    return _dropout_shared(FusedNode(node, "dropout_shared", node.inputs, attrs), out, ins, scratch)


@kernel("dropout_mask")
def _dropout_mask(node, out, ins, scratch):
    (key,) = ins
    stream, p = node.attrs["stream"], node.attrs["p"]
    return lambda: np.copyto(out, dropout_keep_scale(int(key), stream, node.shape, p, node.dtype))


def _reference_fallback(node, out, ins, scratch):
    """Any op with only a reference kernel: run it and copy the result into the planned buffer."""
    ref = reference.KERNELS[node.op]

    def run():
        res = np.asarray(ref(node, *ins))
        if res.shape != out.shape:
            raise ExecutionError(f"{node_where(node)}: kernel gave {res.shape}, expected {out.shape}")
        np.copyto(out, res, casting="unsafe")
    return run


_FALLBACK = Kernel(_reference_fallback)


def kernel_for(op: str, table: dict[str, Kernel] = KERNELS) -> Kernel | None:
    k = table.get(op)
    if k is None and op in reference.KERNELS:
        return _FALLBACK
    return k


def _inplace_positions(node, table=KERNELS) -> Sequence[int]:
    """Input positions the node's kernel can overwrite (the kernel knows; the fallback none)."""
    k = kernel_for(node.op, table)
    if k is None:
        return ()
    return tuple(k.inplace(node) if callable(k.inplace) else k.inplace)


def _scratch(node, pos, table=KERNELS):
    k = kernel_for(node.op, table)
    return list(k.scratch(node, pos)) if k is not None and k.scratch else []


# == the program ===========================================================================================

class NumpyProgram(Program):
    """A graph compiled onto one planned arena; see the module docstring."""

    executor_name = "numpy"
    kernels: dict[str, Kernel] = KERNELS   # op -> kernel (a derived executor swaps in its own table)
    tolerances = {"float64": 1e-12, "float32": 1e-6}   # against the reference (base.Program)

    def __init__(self, graph, outputs, poison: bool = False):
        super().__init__(graph, outputs, set(self.kernels) | set(reference.KERNELS))
        protos = layouts(self.nodes)[0]
        self.run_nodes, fused = fuse_matmul_sums(self.nodes, self.outputs, protos)
        self.run_nodes = assemble_slice_gradients(self.run_nodes, self.outputs)
        self.run_nodes = fuse_attention_softmax(self.run_nodes, self.outputs)
        self.run_nodes = pair_layer_norm_backward(pair_gelu_backward(share_dropout_masks(self.run_nodes)))
        self.run_nodes = pair_attention_backward(self.run_nodes)
        table = self.kernels
        self.plan: Plan = make_plan(self.run_nodes, self.outputs,
                                    functools.partial(_inplace_positions, table=table),
                                    functools.partial(_scratch, table=table), fused)
        # False where a kernel rounds differently from the reference (tests then compare within
        # a tolerance instead of bit for bit): a folded matmul sum, the blocked causal attention
        self.rounds_like_reference = not fused and not any(self.rounds_own_way(n) for n in self.run_nodes)
        raw = np.empty(self.plan.arena_bytes + ALIGN, dtype=np.uint8)
        start = (-raw.__array_interface__["data"][0]) % ALIGN
        self._arena = raw[start:start + self.plan.arena_bytes]
        self._dedicated = {e.node_id: np.empty(self.graph.nodes[e.node_id].shape,
                                               self.graph.nodes[e.node_id].dtype)
                           for e in self.plan.entries.values() if e.kind == "output"}
        self._feed_buffers = {name: np.empty(n.shape, n.dtype) for name, n in self.input_nodes.items()}
        self._feed_pairs = [(buf, name) for name, buf in self._feed_buffers.items()]
        self._bound: list[tuple[str, np.ndarray]] | None = None
        self._checked: list[tuple] | None = None
        self._steps: list[Callable[[], None]] = []
        self._state_copies: list[tuple[np.ndarray, np.ndarray]] = []
        self._results: list[np.ndarray] = []
        if poison:
            self.poison_arena()

    def rounds_own_way(self, node) -> bool:
        """Whether this program's kernel for `node` rounds differently from the reference's."""
        return node.op in ROUNDS_OWN_WAY

    def kept_bytes(self) -> int:
        """Bytes fused kernels keep from forward to backward (dropout masks, GELU tanh, layer-norm
        statistics). They are arena blocks like any other, live until their last reader, so they
        are already inside `plan.arena_bytes`; this says how much of the arena they take at most."""
        return sum(int(np.prod(sc.shape, dtype=np.int64)) * sc.dtype.itemsize
                   for lst in self.plan.scratch.values() for sc in lst if sc.kept)

    def poison_arena(self) -> None:
        """Fill the arena and output buffers with NaN bytes (0xFF): a debugging aid and a test that
        no kernel reads memory it has not written this run."""
        self._arena.fill(0xFF)
        for buf in self._dedicated.values():
            buf.reshape(-1).view(np.uint8).fill(0xFF)

    # -- binding ---------------------------------------------------------------------------------------
    def _arena_array(self, offset: int, shape, dtype) -> np.ndarray:
        return np.ndarray(shape, dtype, buffer=self._arena, offset=offset)

    def _bind(self, state) -> None:
        plan = self.plan
        nodes = {n.id: n for n in self.run_nodes}
        arrays: dict[int, np.ndarray] = {}
        copies = []
        for nid in plan.schedule:
            n = nodes[nid]
            e = plan.entries[nid]
            if n.op == "input":
                arrays[nid] = self._feed_buffers[n.name]
            elif n.op in ("param", "state"):
                arr = state[n.name]
                if not arr.flags.c_contiguous:  # keep a private contiguous copy, refreshed per run
                    private = np.ascontiguousarray(arr)
                    copies.append((private, arr))
                    arr = private
                arrays[nid] = arr
            elif n.op == "const":
                arrays[nid] = n.attrs["value"]
            elif e.kind == "view":
                arrays[nid] = apply_view(n, arrays[n.inputs[0].id])
            elif e.kind == "output":
                arrays[nid] = self._dedicated[nid]
            else:
                off = plan.entries[e.base].offset if e.kind == "inplace" else e.offset
                arrays[nid] = self._arena_array(off, n.shape, n.dtype)
        steps, step_nodes = [], []
        for nid in plan.schedule:
            n = nodes[nid]
            e = plan.entries[nid]
            if e.kind in ("leaf", "const", "view"):
                continue
            scratch = [self._arena_array(s.offset, s.shape, s.dtype) for s in plan.scratch.get(nid, ())]
            k = kernel_for(n.op, self.kernels)
            steps.append(k.build(n, arrays[nid], [arrays[i.id] for i in n.inputs], scratch))
            step_nodes.append(n)
        self._steps = steps
        self._step_nodes = step_nodes
        self._state_copies = copies
        self._results = [arrays[o.id] for o in self.outputs]
        self._bound = [(name, state[name]) for name in self.state_nodes]

    # -- running -----------------------------------------------------------------------------------------
    def _same_state(self, state) -> bool:
        """Whether `state` holds exactly the arrays of the last checked run, unchanged in shape,
        dtype and (for written state) flags: then check_state would pass and nothing needs
        binding, at a fraction of its cost (~90 us for TinyLM's 62 arrays, per decoded token)."""
        if self._checked is None or state is None:
            return False
        try:
            for name, arr, shape, dtype, written in self._checked:
                a = state[name]
                if a is not arr or a.shape != shape or a.dtype is not dtype:
                    return False
                if written and not (a.flags.writeable and a.flags.c_contiguous):
                    return False
        except (KeyError, TypeError):
            return False
        return True

    def run(self, feeds=None, state=None) -> list[np.ndarray]:
        feeds = self.check_feeds(feeds)
        if not self._same_state(state):
            state = self.check_state(state)
            if self._bound is None or any(state[name] is not arr for name, arr in self._bound):
                self._bind(state)
            self._checked = [(name, state[name], state[name].shape, state[name].dtype,
                              name in self.written_state) for name in self.state_nodes]
        for buf, name in self._feed_pairs:
            np.copyto(buf, feeds[name])
        for private, arr in self._state_copies:
            np.copyto(private, arr)
        with np.errstate(all="ignore"):
            for step in self._steps:
                step()
        return [r.copy() for r in self._results]

    def profile(self, feeds=None, state=None) -> list[tuple]:
        """Run once, timing every kernel: [(node, seconds), ...] in run order. The node is the
        graph node (or the executor's fused node) the kernel computes; views and leaves take no
        time and are not listed. Results are computed exactly as by `run` (and discarded)."""
        feeds = self.check_feeds(feeds)
        state = self.check_state(state)
        if self._bound is None or any(state[name] is not arr for name, arr in self._bound):
            self._bind(state)
        for buf, name in self._feed_pairs:
            np.copyto(buf, feeds[name])
        for private, arr in self._state_copies:
            np.copyto(private, arr)
        clock = time.perf_counter
        timings = []
        with np.errstate(all="ignore"):
            for node, step in zip(self._step_nodes, self._steps):
                t0 = clock()
                step()
                timings.append((node, clock() - t0))
        return timings


class NumpyExecutor:
    """``executors.get("numpy")``: compile(graph, outputs, poison=False) -> NumpyProgram."""

    name = "numpy"
    kernels = KERNELS

    def compile(self, graph, outputs, poison: bool = False) -> NumpyProgram:
        return NumpyProgram(graph, outputs, poison=poison)


# == optimizer updates (graphlm/ops.py "optimizer ops"; owned with graphlm.optim) =====================
# The same arithmetic as the reference kernels, in the same order (bit-identical results), in
# place. AdamW walks every parameter in cache-sized chunks and does all its passes on a chunk
# while it is in cache (one trip through memory instead of a dozen); two chunk-sized scratch
# buffers hold the temporaries, so nothing is allocated per run.

@kernel("global_norm")
def _global_norm(node, out, ins, scratch):
    """sqrt(sum of every gradient's squares), as the reference adds them: a float dot (BLAS) per
    contiguous gradient into a running total of node.dtype, in input order. On n threads the
    dots of n runs of gradients (of about equal size) are computed at once, then added in order:
    the same total bit for bit."""
    flats = [_flat(g, (-1,)) for g in ins]   # (None: reshaped, a copy, at each run as the reference does)
    dots: list = [None] * len(ins)

    def dot(a, b):
        for i in range(a, b):
            f = ins[i].reshape(-1) if flats[i] is None else flats[i]
            dots[i] = np.dot(f, f) if f.flags.c_contiguous and f.strides[0] else np.sum(ins[i] * ins[i])
    sizes = [g.size for g in ins]
    all_dots = functools.partial(dot, 0, len(ins))
    if sum(sizes) >= MIN_SPLIT_ROWS:
        all_dots = _threaded(all_dots, lambda n: [functools.partial(dot, a, b) for a, b in _size_groups(sizes, n)])

    def run():
        all_dots()
        total = np.zeros((), dtype=node.dtype)
        for d in dots:
            total += d
        np.copyto(out, np.sqrt(total), casting="unsafe")
    return run


_ADAMW_CHUNK = 1 << 15


def adamw_schedule(node, lr_a, step_a) -> tuple[float, float, float]:
    """This run's (lr, lr / (1 - beta1^t), sqrt(1 - beta2^t)) of an adamw_update node, from its
    learning-rate and step-count inputs; a step count below 1 is an error naming the node."""
    t = int(step_a)
    if t < 1:
        raise ExecutionError(f"{node_where(node)}: the step count must be >= 1, got {t}")
    lr, a = float(lr_a), node.attrs
    return lr, lr / (1.0 - a["beta1"] ** t), math.sqrt(1.0 - a["beta2"] ** t)


def _adamw_scratch(node, pos):
    n = min(max(t.size for t in node.inputs[3::4]), _ADAMW_CHUNK)
    return [((n,), node.inputs[3].dtype), ((n,), node.inputs[3].dtype)]


def _flat_or_none(*arrays):
    flats = [_flat(a, (-1,)) for a in arrays]
    return None if any(f is None for f in flats) else flats


@kernel("adamw_update", scratch=_adamw_scratch)
def _adamw_update(node, out, ins, scratch):
    lr_a, step_a, coef_a = ins[:3]
    a = node.attrs
    b1, b2, eps = a["beta1"], a["beta2"], a["eps"]
    buf1, buf2 = scratch
    pieces = []   # (p, grad, m, v, weight decay, dtype): 1-d chunks, or whole arrays if not flat
    for k, wd in enumerate(a["weight_decay"]):
        p, grad, m, v = ins[3 + 4 * k: 7 + 4 * k]
        flats = _flat_or_none(p, grad, m, v)
        if flats is None:
            pieces.append((p, grad, m, v, wd, p.dtype, None))
            continue
        for s0 in range(0, p.size, _ADAMW_CHUNK):
            sl = slice(s0, min(p.size, s0 + _ADAMW_CHUNK))
            pieces.append(tuple(f[sl] for f in flats) + (wd, p.dtype, sl.stop - sl.start))

    keys = sorted({(pc[5].str, pc[4]) for pc in pieces})
    groups: dict[int, list] = {}   # threads -> [(pieces, buf1, buf2)]: runs of about equal size

    def groups_for(n):
        if n not in groups:
            groups[n] = [(pieces[a:b], *((buf1, buf2) if k == 0 else (np.empty_like(buf1), np.empty_like(buf2))))
                         for k, (a, b) in enumerate(_size_groups([pc[0].size for pc in pieces], n))]
        return groups[n]

    def update(part, buf1, buf2, consts):
        for p, grad, m, v, wd, dt, n in part:
            coef, decay, sb1, cb1, sb2, cb2, sbc2, seps, sstep = consts[(dt.str, wd)]
            if n is None:   # not flat-able: whole-array temporaries (allocates)
                g, tmp = np.empty(p.shape, dt), np.empty(p.shape, dt)
            else:
                g, tmp = buf1[:n], buf2[:n]
            np.multiply(grad, coef, out=g)
            if wd:
                p *= decay
            m *= sb1
            np.multiply(cb1, g, out=tmp)
            m += tmp
            v *= sb2
            np.multiply(cb2, g, out=tmp)
            tmp *= g
            v += tmp
            np.sqrt(v, out=tmp)
            tmp /= sbc2
            tmp += seps
            np.multiply(sstep, m, out=g)
            g /= tmp
            p -= g

    def run():
        lr, step_size, bc2_sqrt = adamw_schedule(node, lr_a, step_a)
        consts = {}
        for dts, wd in keys:
            dt = np.dtype(dts)
            consts[(dts, wd)] = (
                coef_a.astype(dt), _s(1.0 - lr * wd, dt), _s(b1, dt), _s(1.0 - b1, dt),
                _s(b2, dt), _s(1.0 - b2, dt), _s(bc2_sqrt, dt), _s(eps, dt), _s(step_size, dt))
        n = _workers["threads"]
        if n == 1 or len(pieces) < 2:
            update(pieces, buf1, buf2, consts)
        else:
            _parallel([functools.partial(update, part, g1, g2, consts) for part, g1, g2 in groups_for(n)])
        out[...] = 0.0
    return run
