"""oneMKL's cblas_sgemm for the native executor's large float32 products: finding and loading it.

Why: on an Intel CPU, oneMKL's sgemm runs TinyLM's training shapes faster than the OpenBLAS
NumPy ships (docs/performance.md has the figures), and the products are two thirds of a
training step. The `mkl` wheel (a dependency on x86-64 Linux) installs libmkl_rt;
it is loaded here privately (RTLD_LOCAL: nothing else in the process, PyTorch's own MKL
included, sees it), set to its sequential layer first (the C team is the only source of threads) and
to strict conditional numerical reproducibility for the CPU it runs on (MKL_CBWR_AUTO |
MKL_CBWR_STRICT: the same bits from run to run whatever the operands' alignment), before any
other call. products.py decides whether the products use it (`mkl_products`, GRAPHLM_BLAS).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os

MKL_THREADING_SEQUENTIAL = 1            # mkl_set_threading_layer's MKL_THREADING_SEQUENTIAL
MKL_CBWR_AUTO, MKL_CBWR_STRICT = 2, 0x10000   # MKL_CBWR_Set's branch and mode flags (mkl_service.h)
MKL_CBWR_SUCCESS = 0


def mkl_rt_paths() -> list[str]:
    """Where libmkl_rt may be: the files of the installed `mkl` distribution, newest soname first."""
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = [str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so")]
    return sorted((p for p in found if os.path.exists(p)), reverse=True)


@functools.cache
def mkl_sgemm() -> tuple[int, str] | None:
    """(the address of oneMKL's LP64 cblas_sgemm, its version) once loaded and set up as the
    module docstring says, or None where the `mkl` distribution is not installed or does not
    load or take those settings."""
    for path in mkl_rt_paths():
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError:
            continue
        lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
        lib.MKL_CBWR_Set.argtypes = [ctypes.c_int]
        lib.MKL_Set_Threading_Layer(MKL_THREADING_SEQUENTIAL)   # (first: a later call does not take)
        if lib.MKL_CBWR_Set(MKL_CBWR_AUTO | MKL_CBWR_STRICT) != MKL_CBWR_SUCCESS:
            continue
        return ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value, _version(lib)
    return None


def _version(lib) -> str:
    buf = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buf, len(buf))
    return buf.value.decode(errors="replace").strip()
