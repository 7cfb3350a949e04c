"""The native executor: the numpy executor with its hot float32 kernels in C.

``executors.get("native")`` plans memory and fuses exactly as the numpy executor does (it is a
`NumpyProgram` with another kernel table): the same arena, the same schedule, NumPy and BLAS for
the matmuls of many rows, cut over threads where the numpy executor cuts them (but run on the C
worker team of native_team.c, not on the Python pool: "BLAS products" below). What changes is
the kernels below, each one fused pass in C over the planned float32 arrays instead of several
NumPy passes (executors/native_kernels.c):

    exp, tanh GELU and its backward          (a vectorised float32 exp, within 2 ulp)
    softmax over the last axis               (rowmax, exp, rowsum and divide in one pass per row)
    layer norm and its backward              (one pass per row; row sums in 16 partial sums)
    causal attention's softmax and gradient  (the matmuls stay BLAS; the blocks' softmax in C)
    dropout                                  (the mask drawn and applied in one pass)
    AdamW                                    (one pass per parameter)
    matmuls of at most SMALL_ROWS rows       (decoding and short prefills: x @ W^T)
    a decode step's cached attention         (reading only the cache slots in use)

Small products. BLAS takes other paths for a product of 1 row (GEMV) and of 8 (small-m GEMM,
at a third of the core's rate), so a batch-8 decode step cost 2-3x what it could and its rows
rounded unlike batch 1's. In C every output element is one fixed sequence of fused
multiply-adds that depends on k alone (native_kernels.c, "small products"): a row of a batch is
the bits of that row computed alone, whatever the blocking, the column cut or the thread.
On n threads they run as n pieces on a team of C threads (native_team.c), which take a piece
in a fraction of a microsecond: a decode step's products are a few microseconds each, less
than the numpy pool's Python threads take to hand one over.

A kernel whose arrays are not float32 and C-contiguous runs the numpy executor's kernel (they
ask for the same scratch, so either fits the plan).

Rounding. Dropout, AdamW and the attention gradient's ds step compute exactly what the numpy
executor computes (same operations in the same order, compiled with -ffp-contract=off); tests
check them bit for bit. exp, GELU, layer norm and the attention softmax round their own way
(another exp, sums in another order) and say so where they are registered
(`native_kernel(..., rounds_own_way=...)`): `NativeProgram.rounds_like_reference` is then False
and tests compare them with the reference within float32 tolerances.

Building. The C files (SOURCES) are compiled into one library on first use (as tinygrad's
CLANG back end does) with ``$CC`` (default ``cc``) and ``-O3 -march=native``, into
``$GRAPHLM_CACHE_DIR`` (default ``~/.cache/graphlm``), named by a hash of the sources, flags,
compiler and CPU; later processes
load the cached library. Its size and sha256 are recorded beside it at build time
(``native-KEY.so.json``) and checked before every load, with every kernel symbol: a truncated,
damaged or incomplete file is built again, never mapped. A library is loaded only from a folder
this user owns and no one else can write (the file and its record likewise); otherwise it is
built in a private temporary folder that is removed once the library is loaded. Without a
working compiler, compiling a program raises `NativeUnavailable` saying what failed; the numpy
executor needs none.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from graphlm.io.runfolder import remove_dead_temporaries
from graphlm.ops import GELU_A, GELU_B, GELU_DA, GELU_DB, norm_parts
from graphlm.random import stream_base

from .numpy import KERNELS as NUMPY_KERNELS
from .numpy import Kernel, NumpyProgram, get_threads
from .numpy.attention import (attention_flops, attention_plan, build_causal_attention, build_causal_attention_backward,
                              keep_views, softmax_block, softmax_ds_block)
from .numpy.dropout import keep_threshold
from .numpy.norms import layer_norm_keep_views
from .numpy.optimizer import adamw_schedule
from .numpy import pool
from .reference import check_cached_position
from .numpy.pool import parallel, threaded
from .numpy.matmul import matmul_closure, matmul_parts, matmul_sum_closure, probe_like, same_bits, strided_empty
from .numpy.tiling import even_cuts, size_groups

SOURCES = (Path(__file__).with_name("native_kernels.c"),   # the kernels
           Path(__file__).with_name("native_team.c"))      # the worker team that runs a product's pieces
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11",
         "-fPIC", "-shared", "-pthread")
HOST_FLAGS = ("-march=native",)   # dropped when the compiler does not take it

MIN_SPLIT = 1 << 16   # elements: a native kernel below this runs on one thread


class NativeUnavailable(RuntimeError):
    """The native kernels could not be built or loaded (no C compiler, or it failed)."""


# == building and loading the library ==================================================================

_P, _I, _U64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float, ctypes.c_int
SIGNATURES = {   # C function -> argument types (every function returns void)
    "gl_exp": (_P, _P, _I),
    "gl_softmax_rows": (_P, _P, _I, _I),
    "gl_gelu_tanh": (_P, _P, _P, _I, _F, _F),
    "gl_gelu_tanh_sigmoid": (_P, _P, _I, _F, _F),
    "gl_gelu_tanh_backward": (_P, _P, _P, _P, _I, _F, _F, _F, _F),
    "gl_layer_norm": (_P, _P, _P, _P, _P, _P, _P, _I, _I, _F),
    "gl_layer_norm_backward": (_P, _P, _P, _P, _P, _I, _I, _F),
    "gl_causal_softmax_block": (_P, _P, _I, _I, _I, _I, _I),
    "gl_softmax_ds_block": (_P, _P, _P, _I, _I, _I, _I),
    "gl_dropout_draw": (_P, _P, _P, _I, _I, _P, _U64, _F),
    "gl_dropout_apply": (_P, _P, _P, _I, _F),
    "gl_adamw": (_P, _P, _P, _P, _I, _F, _INT, _F, _F, _F, _F, _F, _F, _F, _F),
    "gl_matmul_small": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I),
    "gl_matmul_small_nt": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I),
    "gl_team_run": (_P, _I),
    "gl_cached_attention": (_P,) * 8 + (_I,) * 9 + (_F,),
    "gl_causal_attention": (_P, _I, _I, _F),
    "gl_causal_attention_backward": (_P, _I, _I, _F),
}

_library: dict[str, object] = {}
_library_lock = threading.Lock()


def cache_dir() -> Path:
    """Where compiled libraries are kept: $GRAPHLM_CACHE_DIR, else $XDG_CACHE_HOME/graphlm, else
    ~/.cache/graphlm."""
    if os.environ.get("GRAPHLM_CACHE_DIR"):
        return Path(os.environ["GRAPHLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphlm"


def _cpu_signature() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _run_compiler(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _compiler() -> list[str]:
    """$CC as an argument list (it may carry a wrapper: "ccache gcc")."""
    raw = os.environ.get("CC") or "cc"
    try:
        cc = shlex.split(raw)
    except ValueError as e:
        raise NativeUnavailable(f"the native executor could not use CC={raw!r}: it is not a valid "
                                f"command line ({e}); set CC to a compiler such as gcc") from None
    if not cc or shutil.which(cc[0]) is None:
        raise NativeUnavailable(f"the native executor needs a C compiler: '{' '.join(cc) or raw}' was not "
                                "found (install gcc or clang, or set CC to one; the numpy executor "
                                "needs none)")
    return cc


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".json")


def _file_identity(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _private(path: Path) -> bool:
    """Whether only this user can change `path` (owned by us, not group- or world-writable)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _compile(cc: list[str], target: Path) -> None:
    """Compile SOURCES into `target` (written whole or not at all), with its size and hash recorded
    beside it (`_record_path`) so a later load can tell a damaged file from a good one."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tried = []
        for extra in (HOST_FLAGS, ()):
            cmd = [*cc, *FLAGS, *extra, *map(str, SOURCES), "-o", str(tmp), "-lm"]
            done = _run_compiler(cmd)
            if done.returncode == 0:
                os.chmod(tmp, 0o600)
                record = tmp.with_name(tmp.name + ".json")
                record.write_text(json.dumps(_file_identity(tmp)))
                os.chmod(record, 0o600)   # (whatever the umask: _private must hold for both)
                os.replace(record, _record_path(target))
                os.replace(tmp, target)
                return
            tried.append(f"$ {' '.join(cmd)}\n{done.stderr.strip()[-2000:]}")
        raise NativeUnavailable("the native executor could not compile its kernels "
                                f"({', '.join(src.name for src in SOURCES)}):\n" + "\n".join(tried))
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".json")):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _load_verified(target: Path):
    """The library at `target` when it is ours, private, matches its recorded size and hash and
    has every kernel; else None (missing or damaged: the caller builds it again). The hash is
    checked before dlopen: a truncated file must not be mapped (its pages would SIGBUS)."""
    record = _record_path(target)
    if not (_private(target) and _private(record)):
        return None
    try:
        expected = json.loads(record.read_text())
        if _file_identity(target) != expected:
            return None
        lib = ctypes.CDLL(str(target))
    except (OSError, ValueError):
        return None
    if not all(hasattr(lib, name) for name in SIGNATURES):
        return None
    return lib


def _usable_cache_dir() -> Path | None:
    """cache_dir(), created private (0700) if missing; None when it is unusable or others could
    write there (a library must never be loaded from a folder another user can change)."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.environ.get("GRAPHLM_CACHE_DIR") and not _private(folder) \
                and folder.stat().st_uid == os.getuid():
            folder.chmod(0o700)   # our own default cache made group-writable by a umask of 002
    except OSError:
        return None
    if _private(folder):
        return folder if os.access(folder, os.W_OK | os.X_OK) else None
    warnings.warn(f"graphlm: not loading native kernels from {folder}: other users can write there "
                  "(building them in a private temporary folder instead)", RuntimeWarning, stacklevel=2)
    return None


def library():
    """The loaded kernel library (compiled on first use, then cached on disk and here)."""
    lib = _library.get("lib")
    if lib is not None:   # (the attention kernels ask once per block: no lock on this path)
        return lib
    with _library_lock:
        if "lib" not in _library:
            if "error" in _library:   # (a failed build is not retried in this process)
                raise NativeUnavailable(_library["error"])
            try:
                _library["lib"] = _build_and_load()
            except NativeUnavailable as e:
                _library["error"] = str(e)
                raise
        return _library["lib"]


def _build_and_load():
    cc = _compiler()
    try:
        version = _run_compiler([*cc, "--version"]).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the native executor could not run the C compiler '{' '.join(cc)}': {e}") from None
    sources = [src.read_text() for src in SOURCES]
    key = hashlib.sha256("\0".join([*sources, " ".join(FLAGS + HOST_FLAGS), " ".join(cc), version,
                                    _cpu_signature()]).encode()).hexdigest()[:20]
    name = f"native-{key}.so"
    folder = _usable_cache_dir()
    if folder is not None:
        remove_dead_temporaries(folder, f".{name}.tmp-")
        lib = _load_verified(folder / name)
        if lib is None:   # missing or damaged: built again
            try:
                _compile(cc, folder / name)
                lib = _load_verified(folder / name)
            except OSError:
                lib = None
    else:
        lib = None
    if lib is None:   # no usable cache: build in a private temporary folder, removed once loaded
        tmpdir = Path(tempfile.gettempdir())
        remove_dead_temporaries(tmpdir, "graphlm-native-")
        private = Path(tempfile.mkdtemp(prefix=f"graphlm-native-{os.getpid()}-"))
        try:
            _compile(cc, private / name)
            lib = _load_verified(private / name)
        finally:
            shutil.rmtree(private, ignore_errors=True)   # (the loaded library stays mapped)
        if lib is None:
            raise NativeUnavailable(f"the native executor built {name} but could not load it (or it "
                                    "lacks kernels); the numpy executor needs no C compiler")
    for fn_name, argtypes in SIGNATURES.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def available() -> bool:
    """Whether the native kernels can be built and loaded on this machine."""
    try:
        library()
        return True
    except NativeUnavailable:
        return False


# == helpers ==============================================================================================

def _ptr(a) -> int | None:
    return None if a is None else a.__array_interface__["data"][0]


def _native(*arrays) -> bool:
    """Whether the native kernels take these arrays (float32, C-contiguous; None for NULL)."""
    return all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays)


def _split_calls(call, units: int, unit_size: int, arrays):
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


def _at(a, per: int, lo: int) -> int | None:
    """The address of element ``lo * per`` of `a` (None stays NULL; per 0: a broadcast array)."""
    return None if a is None else _ptr(a) + lo * per * a.itemsize


KERNELS: dict[str, Kernel] = dict(NUMPY_KERNELS)


def native_kernel(*names, rounds_own_way=False):
    """Register `build` as the native kernel of each op in `names`: the numpy kernel's inplace
    and scratch rules, and its build wherever `build` returns None (arrays it does not take).
    `rounds_own_way` (True, or ``node -> bool``): the C code rounds its own way on float32 (another
    exp, row sums in another order; the kernel table's flag, executors/numpy/table.py); the numpy
    kernel's flag holds as well."""
    def deco(build):
        for name in names:
            base = NUMPY_KERNELS[name]

            own = Kernel(build, rounds_own_way=rounds_own_way)

            def rounds(node, base=base, own=own):
                return (node.dtype == np.float32 and own.rounds_own_way_on(node)) or base.rounds_own_way_on(node)

            def build_or_numpy(node, out, ins, scratch, build=build, base=base):
                run = build(node, out, ins, scratch)
                if run is None:
                    return base.build(node, out, ins, scratch)
                run.native = True   # (NativeProgram.native_ops reads it)
                return run
            KERNELS[name] = Kernel(build_or_numpy, base.inplace, base.scratch, rounds)
        return build
    return deco


# == elementwise =========================================================================================

@native_kernel("exp", rounds_own_way=True)
def _exp(node, out, ins, scratch):
    (x,) = ins
    if node.dtype != np.float32 or x.shape != out.shape or not _native(x, out):
        return None
    fn = library().gl_exp
    return _split_calls(lambda lo, hi: functools.partial(fn, _at(x, 1, lo), _at(out, 1, lo), hi - lo),
                        out.size, 1, (x, out))


@native_kernel("softmax", rounds_own_way=True)
def _softmax(node, out, ins, scratch):
    (x,) = ins
    if node.dtype != np.float32 or node.attrs["axis"] != node.ndim - 1 or x.shape != out.shape \
            or not _native(x, out) or node.size == 0:
        return None
    fn, cols = library().gl_softmax_rows, node.shape[-1]
    return _split_calls(lambda lo, hi: functools.partial(fn, _at(x, cols, lo), _at(out, cols, lo), hi - lo, cols),
                        node.size // cols, cols, (x, out))


def _gelu_closure(node, x, out, keep):
    fn = library().gl_gelu_tanh
    return _split_calls(lambda lo, hi: functools.partial(fn, _at(x, 1, lo), _at(out, 1, lo), _at(keep, 1, lo),
                                                         hi - lo, GELU_A, GELU_B), out.size, 1, (x, out, keep))


@native_kernel("gelu", rounds_own_way=lambda node: node.attrs["approximate"] == "tanh")
def _gelu(node, out, ins, scratch):
    (x,) = ins
    if node.attrs["approximate"] != "tanh" or node.dtype != np.float32 or not _native(x, out):
        return None
    return _gelu_closure(node, x, out, None)


@native_kernel("gelu_sigmoid", rounds_own_way=True)
def _gelu_sigmoid(node, out, ins, scratch):
    (x,) = ins
    if node.dtype != np.float32 or not _native(x, out):
        return None
    fn = library().gl_gelu_tanh_sigmoid
    return _split_calls(lambda lo, hi: functools.partial(fn, _at(x, 1, lo), _at(out, 1, lo), hi - lo, GELU_A, GELU_B),
                        out.size, 1, (x, out))


def _gelu_backward_closure(x, g, s, out):
    fn = library().gl_gelu_tanh_backward
    return _split_calls(lambda lo, hi: functools.partial(
        fn, _at(x, 1, lo), _at(g, 1, lo), _at(s, 1, lo), _at(out, 1, lo), hi - lo,
        GELU_A, GELU_B, GELU_DA, GELU_DB), out.size, 1, (x, g, s, out))


@native_kernel("gelu_backward", rounds_own_way=lambda node: node.attrs["approximate"] == "tanh")
def _gelu_backward(node, out, ins, scratch):
    x, g = ins
    if node.attrs["approximate"] != "tanh" or node.dtype != np.float32 or not _native(x, g, out):
        return None
    return _gelu_backward_closure(x, g, None, out)


@native_kernel("gelu_backward_sigmoid", rounds_own_way=True)
def _gelu_backward_sigmoid(node, out, ins, scratch):
    x, g, s = ins
    if node.dtype != np.float32 or not _native(x, g, s, out):
        return None
    return _gelu_backward_closure(x, g, s, out)


# == layer norm ===========================================================================================

def _norm_ok(node, x, w, b, *arrays) -> bool:
    cols = node.shape[-1]
    return (node.dtype == np.float32 and x.shape == node.shape
            and all(p is None or p.shape == (cols,) for p in (w, b)) and _native(x, w, b, *arrays))


def _layer_norm_closure(node, x, w, b, out, xc, sv, xhat, eps=None):
    """`node`: a tensor of the normalised shape (the layer norm, or layer_norm_keep's input)."""
    fn, cols = library().gl_layer_norm, node.shape[-1]
    eps = float(np.float32(node.attrs["eps"] if eps is None else eps))
    return _split_calls(lambda lo, hi: functools.partial(
        fn, _at(x, cols, lo), _ptr(w), _ptr(b), _at(out, cols, lo), _at(xc, cols, lo), _at(sv, 1, lo),
        _at(xhat, cols, lo), hi - lo, cols, eps), node.size // cols, cols, (x, w, b, out, xc, sv, xhat))


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


def _layer_norm_backward_closure(node, xc, sv, g, w, out):
    fn, cols = library().gl_layer_norm_backward, node.shape[-1]
    eps = float(np.float32(node.attrs["eps"]))
    return _split_calls(lambda lo, hi: functools.partial(
        fn, _at(xc, cols, lo), _at(sv, 1, lo), _at(g, cols, lo), _ptr(w), _at(out, cols, lo),
        hi - lo, cols, eps), node.size // cols, cols, (xc, sv, g, w, out))


@native_kernel("layer_norm_backward_kept", rounds_own_way=True)
def _layer_norm_backward_kept(node, out, ins, scratch):
    xc, sv, *rest = ins
    w, g = (rest[0] if node.attrs.get("has_weight") else None), rest[-1]
    if not _norm_ok(node, g, w, None, out, xc, sv):
        return None
    return _layer_norm_backward_closure(node, xc, sv, g, w, out)


@native_kernel("layer_norm_backward", rounds_own_way=True)
def _layer_norm_backward(node, out, ins, scratch):
    x, w, _, (g,) = norm_parts(ins, node.attrs)
    if not _norm_ok(node, x, w, None, g, out) or g.shape != node.shape:
        return None
    return _layer_norm_backward_closure(node, x, None, g, w, out)


# == causal attention: the numpy kernels with their two block steps in C ====================================

def _softmax_block(x, lb, r0, up):
    if not (x.flags.c_contiguous and x.ndim == 3 and lb.ndim == 3):
        return softmax_block(x, lb, r0, up)
    m, rows, cols = x.shape
    library().gl_causal_softmax_block(_ptr(x), _ptr(lb), m, rows, cols, r0, lb.strides[0] // lb.itemsize)


def _ds_block(s, x, ddb):
    if not (s.flags.c_contiguous and x.flags.c_contiguous and s.ndim == 3 and ddb.ndim == 3):
        return softmax_ds_block(s, x, ddb)
    m, rows, cols = s.shape
    library().gl_softmax_ds_block(_ptr(s), _ptr(x), _ptr(ddb), m, rows, cols, ddb.strides[0] // ddb.itemsize)


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


def _attention_in_c(node, fn, shape, strided, arrays, flops):
    """The closure of `fn` (gl_causal_attention or _backward) over the score matrices of q's
    `shape`, from its plan words (native_kernels.c): `arrays` in the kernel's order, of which
    `strided` (q, k, v and g: rows of contiguous floats, any matrix strides) are given by their
    rows' stride and per-matrix offsets, the others contiguous; None where no sgemm is found or
    an array is not laid out so."""
    sgemm = blas_sgemm()
    lead, (t, d) = shape[:-2], shape[-2:]
    rows_ok = lambda x: x.dtype == np.float32 and x.strides[-1] == 4 and x.strides[-2] % 4 == 0
    whole = [x for x in arrays if not any(x is y for y in strided)]
    if sgemm is None or not all(rows_ok(x) for x in strided) or not _native(*whole) or 0 in shape:
        return None
    offsets = [_entry_offsets(x, lead) for x in strided]
    if any(o is None for o in offsets):
        return None
    pad = 4 - len(strided)   # (4 per matrix, and 4 strides: q, k, v, g)
    table = np.ascontiguousarray(np.stack(offsets + [np.zeros_like(offsets[0])] * pad, axis=1), np.int64)
    blocks, _, scale = attention_plan(node, shape)
    slots = ctypes.c_int64.in_dll(library(), "gl_attention_plan_arrays").value
    plan = np.array([t, d, len(table), len(blocks), *sgemm, *(x.strides[-2] // 4 for x in strided), *[0] * pad,
                     _ptr(table), *map(_ptr, arrays), *[0] * (slots - len(arrays)),
                     *(r0 for r0, _ in blocks), blocks[-1][1]], np.int64)
    call = lambda m0, m1: functools.partial(fn, _ptr(plan), m0, m1, float(scale))
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
        (qs, e, l), y = scratch, out
    return (_attention_in_c(node, library().gl_causal_attention, q.shape, [q, k, v], [q, k, v, y, e, l, qs],
                            attention_flops(q.shape))
            or _with_native_steps(build_causal_attention)(node, out, ins, scratch))


def _causal_attention_backward(node, out, ins, scratch):
    if node.dtype != np.float32:
        return None
    run = None
    if node.op == "causal_attention_backward_kept":
        q, k, v, o, e, l, g = ins
        ds, gs, dd, tmp = scratch
        run = _attention_in_c(node, library().gl_causal_attention_backward, node.shape[1:], [q, k, v, g],
                              [q, k, v, o, g, e, l, out, ds, gs, tmp, dd], 2 * attention_flops(node.shape[1:]))
    return run or _with_native_steps(build_causal_attention_backward)(node, out, ins, scratch)


native_kernel("causal_attention", "causal_attention_keep")(_causal_attention)
native_kernel("causal_attention_backward", "causal_attention_backward_kept")(_causal_attention_backward)


# == dropout ================================================================================================

def _draw_closure(node, key, mask, x, out):
    """Draw the keep mask of `node` (dropout or dropout_keep) into `mask` in C and, when x is
    given, out = (x * mask) * scale in the same pass; None where the arrays are not native."""
    a = node.attrs
    if mask.dtype != np.bool_ or not mask.flags.c_contiguous or (x is not None and (
            node.dtype != np.float32 or x.shape != out.shape or not _native(x, out))):
        return None
    lib, threshold = library(), keep_threshold(a["p"])
    scale = float(np.float32(1.0 / (1.0 - a["p"])))
    base = np.zeros(1, np.uint64)   # this run's stream start, read by the pieces through its address
    pointers = (_ptr(mask), _ptr(x), _ptr(out))
    draw = _split_calls(lambda lo, hi: functools.partial(lib.gl_dropout_draw, *pointers, lo, hi, _ptr(base),
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
    if (node.dtype != np.float32 or x.shape != out.shape or not _native(x, out)
            or mask.dtype != np.bool_ or not mask.flags.c_contiguous):
        return None
    lib, scale = library(), float(np.float32(1.0 / (1.0 - node.attrs["p"])))
    return _split_calls(lambda lo, hi: functools.partial(
        lib.gl_dropout_apply, _at(x, 1, lo), _at(mask, 1, lo), _at(out, 1, lo), hi - lo, scale),
        out.size, 1, (x, mask, out))


@native_kernel("dropout")
def _dropout(node, out, ins, scratch):
    x, key = ins
    return _draw_closure(node, key, scratch[0], x, out)


# == AdamW ===================================================================================================

@native_kernel("adamw_update")
def _adamw_update(node, out, ins, scratch):
    lr_a, step_a, coef_a = ins[:3]
    a = node.attrs
    f32 = lambda x: float(np.float32(x))   # (each constant rounded to float32 as the numpy kernel's)
    moments = (f32(a["beta1"]), f32(1.0 - a["beta1"]), f32(a["beta2"]), f32(1.0 - a["beta2"]))
    params = []   # (pointers, size, weight decay) per parameter, bound once
    for k, wd in enumerate(a["weight_decay"]):
        p, grad, m, v = ins[3 + 4 * k: 7 + 4 * k]
        if not _native(p, grad, m, v) or not (p.shape == grad.shape == m.shape == v.shape):
            return None
        params.append(((_ptr(p), _ptr(grad), _ptr(m), _ptr(v)), p.size, wd))
    fn, eps = library().gl_adamw, f32(a["eps"])
    consts = {}   # weight decay -> this run's constants, read by the pieces

    def update(part):
        for pointers, size, wd in part:
            coef, decay, step_size, bc2 = consts[wd]
            fn(*pointers, size, coef, 1 if wd else 0, decay, *moments, bc2, eps, step_size)

    groups: dict[int, list] = {}

    def run():
        lr, step_size, bc2_sqrt = adamw_schedule(node, lr_a, step_a)
        coef, step_size, bc2_sqrt = f32(coef_a), f32(step_size), f32(bc2_sqrt)
        for wd in set(a["weight_decay"]):
            consts[wd] = (coef, f32(1.0 - lr * wd), step_size, bc2_sqrt)
        n = get_threads()
        if n == 1 or len(params) < 2:
            update(params)
        else:
            if n not in groups:
                groups[n] = [params[lo:hi] for lo, hi in size_groups([size for _, size, _ in params], n)]
            parallel([functools.partial(update, part) for part in groups[n]])
        out[...] = 0.0
    run.arrays = ins   # (the raw pointers above point into these)
    return run


# == small products: matmuls of few rows (decoding) ==========================================================

SMALL_ROWS = 16             # a matmul of at most this many rows per product runs in C (gl_matmul_small)
SMALL_COLUMN_QUANTUM = 32   # a column cut falls on a multiple of this (the C kernel's widest block)
TEAM_MIN_FLOPS = 1 << 16    # a small product below this runs whole on n threads (a piece handed over costs ~1 us)


def _entry_offsets(x, batch) -> np.ndarray | None:
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
    piece, integer words and floats of a kernel call piece): native_team.c's PIECE_WORDS,
    SGEMM_WORDS, CALL_INTS and CALL_FLOATS, read from the library."""
    return tuple((ctypes.c_int64 * 4).in_dll(library(), "gl_team_words"))


# the calling conventions under which native_team.c's run_call finds a kernel's arguments
CALLS_BY_CLASS = os.name == "posix" and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


def call_piece(part) -> tuple | None:
    """A kernel call ``functools.partial(library().gl_..., *args)`` as the words of a team piece
    of kind 5 (native_team.c: the function's address, its integer-class arguments, then its
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
    kind first, then its words; the rest of its row 0: native_team.c, PIECE_WORDS)."""
    table = np.zeros((len(pieces), team_words()[0]), np.int64)
    for row, words in zip(table, pieces):
        row[:len(words)] = words
    return table


def team_closure(whole, tables_for, otherwise=None):
    """A closure running ``whole()`` on one thread, and on n threads the team table that
    ``tables_for(n)`` returns (built once per n: (table, *arrays the table's addresses point
    into)), or ``otherwise()`` (default whole) where it returns None."""
    tables: dict[int, tuple | None] = {}
    team = library().gl_team_run

    def run():
        threads = get_threads()
        if threads == 1:
            return whole()
        found = tables[threads] if threads in tables else tables.setdefault(threads, tables_for(threads))
        if found is None:
            return (otherwise or whole)()
        team(found[0].ctypes.data, len(found[0]))
    run.whole, run.tables = whole, tables
    return run


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
    parts = [_entry_offsets(x, batch) for x in (a, b, out)]
    if any(p is None for p in parts):
        return None
    return name, a.strides[-2] // f, ldb, out.strides[-2] // f, np.ascontiguousarray(np.stack(parts, axis=1))


def small_matmul_closure(a, b, out):
    """``a @ b -> out`` by the C kernel for products of few rows, or None (small_product_layout).
    Every element is computed the same way whatever the rows around it or the thread (see
    native_kernels.c), so the pieces of a split (batch entries or column ranges) are exact. On
    n threads a product of at least TEAM_MIN_FLOPS runs as n pieces on the C worker team
    (native_team.c: a piece is handed over in a fraction of a microsecond, where the Python pool
    costs tens), one table of pieces built per n."""
    layout = small_product_layout(a, b, out)
    if layout is None:
        return None
    name, lda, ldb, ldo, offsets = layout
    fn = getattr(library(), name)
    m, k, n, entries = out.shape[-2], a.shape[-1], out.shape[-1], len(offsets)
    pointers = (_ptr(a), _ptr(b), _ptr(out), _ptr(offsets))
    whole = functools.partial(fn, *pointers, 0, entries, m, k, lda, ldb, ldo, 0, n)
    kind = 1 if name == "gl_matmul_small_nt" else 0

    def pieces(threads):
        """The cuts [(e0, e1, j0, j1), ...] on `threads` threads ([] where it runs whole)."""
        if threads < 2 or 2 * entries * m * k * n < TEAM_MIN_FLOPS:
            return []
        by_entry, by_column = even_cuts(entries, threads), even_cuts(n, threads, SMALL_COLUMN_QUANTUM)
        if max(e - s for s, e in by_entry) / entries <= max(e - s for s, e in by_column) / n:
            cuts = [(e0, e1, 0, n) for e0, e1 in by_entry]     # the more even cut (entries on a tie)
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


# == BLAS products on the team (a training step's products on n threads) ==================================
# The numpy executor cuts a large product into pieces that round as the whole (matmul_parts) and
# runs them on its Python pool, whose hand-over of the GIL cost 50-100 us a piece here. In this
# executor the same pieces run on the C worker team as the very cblas_sgemm calls NumPy's matmul
# makes for them, checked once per product against np.matmul on random operands of its shapes and
# strides (a BLAS other than the one NumPy calls, or a call NumPy would make another way, shows
# there). Where the check fails or no OpenBLAS is loaded, the pieces run on the Python pool.

_sgemm: dict[str, tuple[int, int] | None] = {}


def blas_sgemm() -> tuple[int, int] | None:
    """(address of the cblas_sgemm of NumPy's OpenBLAS, the team's piece kind for it: 2 where it
    takes 64-bit integers, 3 for 32-bit), or None where no OpenBLAS with one is loaded."""
    if "fn" not in _sgemm:
        found = None
        for path in pool.openblas_libraries():
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name, kind in (("scipy_cblas_sgemm64_", 2), ("cblas_sgemm64_", 2),
                               ("scipy_cblas_sgemm", 3), ("cblas_sgemm", 3)):
                fn = getattr(lib, name, None)
                if fn is not None:
                    found = (ctypes.cast(fn, ctypes.c_void_p).value, kind)
                    break
            if found:
                break
        _sgemm["fn"] = found
    return _sgemm["fn"]


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
    """The cblas_sgemm calls [(transa, transb, m, n, k, a, lda, b, ldb, c, ldc), ...] that compute
    ``a @ b -> out`` (a batch entry one call each), or None where it is not made of plain float32
    GEMMs (a vector, an output NumPy would write transposed, a @ a.T, which NumPy hands to syrk)."""
    if out.dtype != np.float32 or a.dtype != np.float32 or b.dtype != np.float32 or min(a.ndim, b.ndim) < 2:
        return None
    batch = out.shape[:-2]
    a, b = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (a, b))
    calls = []
    for e in np.ndindex(*batch):
        ae, be, oe = a[e], b[e], out[e]
        m, k, n = oe.shape[0], ae.shape[1], oe.shape[1]
        ta, tb, to = _blas_operand(ae), _blas_operand(be), _blas_operand(oe)
        if None in (ta, tb, to) or to[0] or min(m, n, k) < 2 or _ptr(ae) == _ptr(be):
            return None
        calls.append((ta[0], tb[0], m, n, k, _ptr(ae), ta[1], _ptr(be), tb[1], _ptr(oe), to[1]))
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
    moves = [(_ptr(a), a.nbytes, _ptr(pa)), (_ptr(b), b.nbytes, _ptr(pb)), (_ptr(out), out.nbytes, _ptr(got))]

    def moved(address):
        for lo, size, to in moves:
            if lo <= address < lo + size:
                return address - lo + to
        raise ValueError("a piece's operand outside its product")
    probe = [[c[:5] + (moved(c[5]), c[6], moved(c[7]), c[8], moved(c[9]), c[10]) for c in piece] for piece in calls]
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


@native_kernel("matmul", rounds_own_way=lambda node: node.shape[-2] <= SMALL_ROWS)
def _matmul(node, out, ins, scratch):
    return small_matmul_closure(ins[0], ins[1], out) or blas_matmul_closure(ins[0], ins[1], out)


@native_kernel("matmul_sum")
def _matmul_sum(node, out, ins, scratch):
    return matmul_sum_closure(node, out, ins, blas_matmul_closure)


# == cached attention: one decode step against the KV cache ===================================================

def _rows_of(x, d: int):
    """`x` [..., rows-shape, D] as (rows, the element stride between rows) without a copy, or None
    where its rows are not d contiguous floats one stride apart."""
    rows = x.reshape(-1, d) if x.size else None
    if rows is None or _ptr(rows) != _ptr(x) or rows.strides[1] != 4 or rows.strides[0] % 4:
        return None
    return rows, rows.strides[0] // 4


@native_kernel("cached_attention", rounds_own_way=True)
def _cached_attention(node, out, ins, scratch):
    """gl_cached_attention over the (batch row, head) rows, which read only the cache slots in
    use; on n threads the rows run as n ranges on the C worker team (native_team.c), each row
    computed as it is alone."""
    q, k, v, cache_k, cache_v, position = ins
    scores = scratch[0]
    t, d = cache_k.shape[-2], cache_k.shape[-1]
    if node.dtype != np.float32 or position.dtype != np.int64 or d == 0 or not _native(cache_k, cache_v, scores):
        return None
    views = [_rows_of(x, d) for x in (q, k, v, out)]
    if any(x is None for x in views):
        return None
    (_, ldq), (_, ldk), (_, ldv), (_, ldo) = views
    rows = views[0][0].shape[0]
    fn, pointers = library().gl_cached_attention, [_ptr(x) for x in (q, k, v, cache_k, cache_v, out, scores, position)]
    scale = float(np.float32(node.attrs["scale"]))

    def call(r0, r1):
        return functools.partial(fn, *pointers, r0, r1, t, d, ldq, ldk, ldv, ldo, t * d, scale)

    scale_bits = int(np.float32(scale).view(np.uint32))

    def pieces(threads):
        """On n threads: (a gl_team_run table of n row ranges,) where the work at a full cache
        reaches 4 TEAM_MIN_FLOPS; else None (whole on this thread)."""
        full_cache_flops = 4 * rows * t * d   # the scores and the weighted sum over every slot
        if threads < 2 or rows < 2 or full_cache_flops < 4 * TEAM_MIN_FLOPS:
            return None
        return (team_table([(4, *pointers, r0, r1, t, d, ldq, ldk, ldv, ldo, t * d, scale_bits)
                            for r0, r1 in even_cuts(rows, threads)]),)
    inner = team_closure(call(0, rows), pieces)

    def run():
        check_cached_position(node, position, t)   # (C trusts the position: it indexes the caches)
        inner()
    run.arrays = (q, k, v, cache_k, cache_v, out, scores, position, inner)   # (the raw pointers point into these)
    return run


# == the program and executor =================================================================================

class NativeProgram(NumpyProgram):
    """A `NumpyProgram` on the native kernel table."""

    executor_name = "native"
    kernels = KERNELS
    tolerances = {"float64": 1e-12, "float32": 2e-5}   # its C exp, GELU, norms round their own way

    def native_ops(self, state=None) -> set[str]:
        """The ops whose kernels run in C in this program (the others run the numpy kernels);
        binds the program to `state` first if it has not run yet."""
        if self._bound is None:
            self._bind(self.check_state(state))
        return {n.op for n, step in zip(self._step_nodes, self._steps) if getattr(step, "native", False)}


class NativeExecutor:
    """``executors.get("native")``: compile(graph, outputs, poison=False) -> NativeProgram. The C
    kernels are built on the first compile (NativeUnavailable without a working compiler)."""

    name = "native"
    kernels = KERNELS

    @staticmethod
    def available() -> bool:
        """Whether the C kernels build and load here (compiling them if needed)."""
        return available()

    def compile(self, graph, outputs, poison: bool = False) -> NativeProgram:
        library()
        return NativeProgram(graph, outputs, poison=poison)
