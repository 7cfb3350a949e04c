"""The numpy executor's kernel table and its contract.

`KERNELS[op] = Kernel(build, inplace=..., scratch=...)`, registered with `@kernel(op, ...)` by
the kernel families of this package (elementwise, movement, matmul, norms, attention, dropout,
optimizer):

- ``build(node, out, ins, scratch) -> callable()``: `out` is the node's planned array, `ins` the
  arrays of its inputs (for update ops: the caller's state arrays, written in place), `scratch`
  the temporaries asked for. The returned closure computes the node into `out`; it must not
  allocate arrays proportional to the data (use ``out=``).
- ``inplace``: input positions the kernel can overwrite with its output (the planner uses one
  only when that input dies at this node and has the output's shape and dtype), or a function
  ``node -> positions``.
- ``scratch(node, inplace_pos) -> [(shape, dtype), ...]``: temporaries for one step; they live in
  the arena, during that step only (a value a later node reads is a tensor of the graph: a kept
  value, graphlm/passes/kept_values.py).
- ``rounds_own_way``: True (or a function ``node -> bool``) where the kernel deliberately computes
  its op in another arithmetic order than the op's section of graphlm/ops.py fixes (blocked
  attention's sums, the native C exp): the one place an executor declares it. A program with such
  a node has ``rounds_like_reference`` False and is compared with the reference within its
  ``tolerances``; every other kernel must match the reference kernel bit for bit (tests/test_arithmetic_order.py).

An op with a reference kernel but no entry here runs the reference kernel and copies its result
into the planned buffer (correct, but it allocates); an op with neither fails at compile.
Kernels compute exactly the reference's arithmetic, in the same order, unless they say otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .. import reference
from ..base import ExecutionError, node_where


@dataclass(frozen=True)
class Kernel:
    build: Callable
    inplace: Sequence[int] | Callable = ()
    scratch: Callable | None = None
    rounds_own_way: bool | Callable = False

    def rounds_own_way_on(self, node) -> bool:
        """This kernel's `rounds_own_way` for `node`."""
        flag = self.rounds_own_way
        return bool(flag(node) if callable(flag) else flag)


KERNELS: dict[str, Kernel] = {}


def kernel(*names, inplace=(), scratch=None, rounds_own_way=False):
    """Register `build` as the kernel of each op in `names`."""
    def deco(build):
        for name in names:
            KERNELS[name] = Kernel(build, inplace, scratch, rounds_own_way)
        return build
    return deco


def scalar(x, dtype):
    """A scalar as a 0-d array of `dtype` (float32 stays float32, as in the reference)."""
    return np.asarray(x, dtype=dtype)


def all_inputs(node):
    return tuple(range(len(node.inputs)))


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


def inplace_positions(node, table=KERNELS) -> Sequence[int]:
    """Input positions the node's kernel can overwrite (the kernel knows; the fallback none)."""
    k = kernel_for(node.op, table)
    if k is None:
        return ()
    return tuple(k.inplace(node) if callable(k.inplace) else k.inplace)


def kernel_rounds_own_way(node, table=KERNELS) -> bool:
    """Whether the node's kernel in `table` declares its own rounding (see the module docstring)."""
    k = kernel_for(node.op, table)
    return k is not None and k.rounds_own_way_on(node)


def scratch_specs(node, pos, table=KERNELS):
    k = kernel_for(node.op, table)
    return list(k.scratch(node, pos)) if k is not None and k.scratch else []
