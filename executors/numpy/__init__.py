"""The numpy executor: all intermediate memory planned at compile time, nothing allocated per run.

Where things live:

- program.py: `NumpyProgram` (compile: passes then the memory plan; bind; run; profile) and
  `NumpyExecutor` (``executors.get("numpy")``).
- table.py: the kernel table `KERNELS`, the `@kernel` decorator and the kernel contract.
- pool.py: the thread pool (`set_threads`, `get_threads`) and the split thresholds.
- tiling.py: cutting arrays into per-thread pieces and cache-sized blocks.
- kernel families: elementwise.py, movement.py (reductions, copies, gather/scatter), matmul.py,
  norms.py (softmax, layer and RMS norm, cross entropy), attention.py, dropout.py, optimizer.py.

Kernels compute the reference's arithmetic in the same order, so float results match the
reference bit for bit except where a kernel declares its own rounding (the kernel table's
`rounds_own_way`: blocked attention) or an op its own (`OpDef.rounds_like_decomposition`: the folded
matmul sum); `NumpyProgram.rounds_like_reference` says whether a program is exact); results never depend on
the thread count (docs/architecture.md, "the thread-count guarantee").
"""
from __future__ import annotations

# the kernel families register their kernels in table.KERNELS on import
from . import attention, dropout, elementwise, matmul, movement, norms, optimizer  # noqa: F401
from .pool import get_threads, set_blas_threads, set_threads
from .program import NumpyExecutor, NumpyProgram
from .table import KERNELS, Kernel, kernel

__all__ = ["KERNELS", "Kernel", "NumpyExecutor", "NumpyProgram", "get_threads", "kernel",
           "set_blas_threads", "set_threads"]
