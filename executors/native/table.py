"""The native kernel table: the numpy executor's, with the C kernels registered over it.

`native_kernel` registers a build for ops whose float32, contiguous arrays it takes in C; the
numpy kernel's inplace and scratch rules hold (they ask for the same scratch, so either fits the
plan), and the numpy build runs wherever the C build returns None.
"""
from __future__ import annotations

import numpy as np

from ..numpy import KERNELS as NUMPY_KERNELS
from ..numpy import Kernel
from ..numpy.table import kernel_for

KERNELS: dict[str, Kernel] = dict(NUMPY_KERNELS)


def native_kernel(*names, rounds_own_way=False):
    """Register `build` as the native kernel of each op in `names`: the numpy kernel's inplace
    and scratch rules, and its build wherever `build` returns None (arrays it does not take).
    `rounds_own_way` (True, or ``node -> bool``): the C code rounds its own way on float32 (another
    exp, row sums in another order; the kernel table's flag, executors/numpy/table.py); the numpy
    kernel's flag holds as well."""
    def deco(build):
        for name in names:
            base = kernel_for(name, NUMPY_KERNELS)   # (an op with only a reference kernel: its fallback)

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
