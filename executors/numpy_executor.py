"""The numpy executor's former single-module name, kept so existing imports work: its public names,
from the package executors/numpy/ (import from there in new code)."""
from __future__ import annotations

from .numpy import KERNELS, Kernel, NumpyExecutor, NumpyProgram, get_threads, kernel, set_blas_threads, set_threads

__all__ = ["KERNELS", "Kernel", "NumpyExecutor", "NumpyProgram", "get_threads", "kernel",
           "set_blas_threads", "set_threads"]
