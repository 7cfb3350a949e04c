"""The native executor: the numpy executor with its hot float32 kernels in C.

``executors.get("native")`` plans memory and fuses as the numpy executor does (it is a
`NumpyProgram` with another kernel table, and a pipeline of its own in
graphlm/passes/pipelines.py). What changes is
the kernels, each one fused pass in C over the planned float32 arrays instead of several NumPy
passes, and the float32 matmuls, in C too (NumPy's BLAS where a layout does not suit them), cut
over threads on the C worker team, not on the Python pool. A kernel whose arrays are not
float32 and C-contiguous runs the numpy executor's kernel (they ask for the same scratch, so
either fits the plan).

Where things live:

- the C kernels, one file per family as the Python side: kernels.c (elementwise, memory-bound ops,
  layer norm, cross entropy, the embedding gradient, dropout, AdamW), attention.c, products.c; kernels.h what they share (exp_f32, the row
  reductions, the dot product's summation order); team.c the C worker team that runs a kernel's
  pieces on n threads.
- build.py: compiling and loading the library (cached by a hash of sources, flags, compiler and
  CPU; verified before every load); `library()`, `available()`, `NativeUnavailable`.
- team.py: the team's piece tables, `team_closure` (the one way a closure runs on n threads),
  `split_calls` (a row kernel cut into C calls on the team), NumPy's own cblas_sgemm.
- mkl.py: finding and loading oneMKL's cblas_sgemm (the large products on Intel CPUs).
- table.py: the kernel table `KERNELS` and `native_kernel` (registers a C build over the numpy
  kernel of an op).
- kernel families: kernels.py (exp, GELU, softmax, layer norm, cross entropy, the embedding
  gradient, dropout, AdamW), attention.py
  (causal attention whole in C, a decode step's cached attention), products.py (products of
  few rows and large products in C, oneMKL's and OpenBLAS's products cut over the team).
- program.py: `NativeProgram` and `NativeExecutor`.

Rounding. Dropout, AdamW, the embedding gradient and the attention gradient's ds step compute exactly what the numpy
executor computes (same operations in the same order, compiled with -ffp-contract=off); tests
check them bit for bit. exp, GELU, layer norm, cross entropy, the attention softmax and the float32 products
round their own way (another exp, sums in another order) and say so where they are registered
(`native_kernel(..., rounds_own_way=...)`): `NativeProgram.rounds_like_reference` is then False
and tests compare them with the reference within float32 tolerances. No result depends on the
thread count.
"""
from __future__ import annotations

# the kernel families register their C kernels in table.KERNELS on import
from . import attention, kernels, products  # noqa: F401
from .build import NativeUnavailable, available, cache_dir, library
from .program import NativeExecutor, NativeProgram
from .table import KERNELS, native_kernel

__all__ = ["KERNELS", "NativeExecutor", "NativeProgram", "NativeUnavailable", "available", "cache_dir", "library",
           "native_kernel"]
