"""Building and loading the native executor's C library (the C files in this folder).

The C files are compiled into one library on first use (as tinygrad's CLANG back end does) with
``$CC`` (default ``cc``) and ``-O3 -march=native`` (with AVX-512, 512-bit vectors preferred),
into ``$GRAPHLM_CACHE_DIR`` (default ``~/.cache/graphlm``), named by a hash of the sources,
flags, compiler and CPU; later processes load the cached library. Its size and sha256 are
recorded beside it at build time (``native-KEY.so.json``) and checked before every load, with
every kernel symbol: a truncated, damaged or incomplete file is built again, never mapped. A
library is loaded only from a folder this user owns and no one else can write (the file and its
record likewise); otherwise it is built in a private temporary folder that is removed once the
library is loaded. Without a working compiler, `library()` raises `NativeUnavailable` saying
what failed.
"""
from __future__ import annotations

import ctypes
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

from graphlm.io.runfolder import remove_dead_temporaries

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("kernels.c",     # elementwise and row kernels
                                          "attention.c",   # causal and cached attention
                                          "products.c",    # small products, the one BLAS call
                                          "team.c"))       # the worker team that runs a kernel's pieces
HEADERS = (_HERE / "kernels.h",)   # what the C files share: part of the build's hash, not compiled
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11",
         "-fPIC", "-shared", "-pthread")
HOST_FLAGS = ("-march=native",)   # dropped when the compiler does not take it
# With AVX-512, GCC's -march=native on Intel cores prefers 256-bit vectors (AMD's Zen 4 and 5:
# 512); the products' 8 x 32 blocks then ran at half the core's rate (2048^3 at 97 GFLOP/s
# against 138 with 512-bit ones, one thread of a Xeon with AVX-512: docs/performance.md).
WIDE_FLAGS = ("-mprefer-vector-width=512",)   # where the CPU has avx512f; dropped first


def host_flag_sets() -> list[tuple[str, ...]]:
    """The host-specific flags to try, in order (the first the compiler takes is used)."""
    wide = [HOST_FLAGS + WIDE_FLAGS] if "avx512f" in cpu_flags() else []
    return wide + [HOST_FLAGS, ()]


class NativeUnavailable(RuntimeError):
    """The native kernels could not be built or loaded (no C compiler, or it failed)."""


_P, _I, _U64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float, ctypes.c_int
SIGNATURES = {   # C function -> argument types (every function returns void)
    "gl_exp": (_P, _P, _I),
    "gl_softmax_rows": (_P, _P, _I, _I),
    "gl_binary_rows": (_P, _P, _P, _I, _I, _I, _I, _I, _I),
    "gl_sum_rows": (_P, _P, _I, _I, _I, _I, _I),
    "gl_affine_grads": (_P, _P, _P, _P, _I, _I, _I, _I),
    "gl_copy_rows": (_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I),
    "gl_gelu_tanh": (_P, _P, _P, _I, _F, _F),
    "gl_gelu_tanh_sigmoid": (_P, _P, _I, _F, _F),
    "gl_gelu_tanh_backward": (_P, _P, _P, _P, _I, _F, _F, _F, _F),
    "gl_bias_gelu_tanh": (_P, _P, _P, _I, _I, _I, _F, _F),
    "gl_bias_gelu_tanh_backward": (_P, _P, _P, _P, _I, _I, _I, _F, _F, _F, _F),
    "gl_layer_norm": (_P, _P, _P, _P, _P, _P, _P, _I, _I, _F),
    "gl_layer_norm_backward": (_P, _P, _P, _P, _P, _P, _I, _I, _F),
    "gl_causal_softmax_block": (_P, _P, _I, _I, _I, _I, _I),
    "gl_softmax_ds_block": (_P, _P, _P, _I, _I, _I, _I),
    "gl_cross_entropy_rows": (_P, _P, _P, _I, _I),
    "gl_cross_entropy_backward_rows": (_P, _P, _P, _P, _I, _I, _I),
    "gl_embedding_backward": (_P, _P, _P, _I, _I, _I, _I, _I),
    "gl_dropout_draw": (_P, _P, _P, _I, _I, _P, _U64, _F),
    "gl_dropout_apply": (_P, _P, _P, _I, _F),
    "gl_bias_dropout_add": (_P, _P, _P, _P, _P, _I, _I, _I, _F),
    "gl_adamw": (_P, _P, _P, _P, _I, _F, _INT, _F, _F, _F, _F, _F, _F, _F, _F),
    "gl_adamw_params": (_P, _P, _I, _I),
    "gl_self_dots": (_P, _P, _P, _I, _I, _U64, _I),
    "gl_matmul_small": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I),
    "gl_matmul_small_nt": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I),
    "gl_matmul_large": (_P, _I, _I, _I, _I, _I, _I),
    "gl_matmul_panels": (_P, _I, _I, _I, _I, _I, _I),
    "gl_team_run": (_P, _I),
    "gl_run_steps": (_P, _I),
    "gl_embedding_rows": (_P, _P, _P, _I, _I, _I, _I),
    "gl_cache_write": (_P, _P, _P, _P) + (_I,) * 8,
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


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them ("avx512f", ...); empty where unknown."""
    line = _cpu_signature()
    return set(line.split(":", 1)[1].split()) if line.startswith(("flags", "Features")) else set()


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


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
        for extra in host_flag_sets():
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
    sources = [src.read_text() for src in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*sources, " ".join(FLAGS + host_flag_sets()[0]), " ".join(cc), version,
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
