"""Kernels for custom ops (`graphlm.register_op`), given by users: `register_kernel`.

A custom op needs no kernel when it has a decomposition (every executor then runs that); a kernel
makes it one node at run time. Each executor keeps its kernels in its own table; this module adds
a plain function ``fn(*input_arrays, **attrs) -> array`` to one of them, wrapped in the form that
executor calls, and checks what the function returns (a wrong shape or dtype is an error naming
the op, never a silent broadcast).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from graphlm.registry import CUSTOM_OPS, UNREGISTER_HOOKS, get_op

from .base import ExecutionError, node_where

EXECUTORS = ("reference", "numpy", "native")
_REGISTERED: dict[str, set[str]] = {}   # op -> executors it was given a kernel on here


def _tables() -> dict[str, dict]:
    from . import native, numpy_executor, reference
    return {"reference": reference.KERNELS, "numpy": numpy_executor.KERNELS, "native": native.KERNELS}


def _checked(node, result) -> np.ndarray:
    result = np.asarray(result)
    if result.shape != node.shape or result.dtype != node.dtype:
        raise ExecutionError(f"{node_where(node)}: the kernel registered for '{node.op}' returned "
                             f"{result.shape} {result.dtype}, expected {node.shape} {node.dtype}")
    return result


def register_kernel(op: str, fn: Callable[..., np.ndarray], executor: str = "reference") -> None:
    """Run custom op `op` with ``fn(*input_arrays, **node_attrs)`` on `executor`.

    The default, "reference", serves the numpy and native executors too (they run a reference
    kernel and copy its result into their planned buffer); "numpy" or "native" gives that
    executor its own kernel. Only ops registered with `graphlm.register_op` take kernels here,
    once per executor.
    """
    get_op(op)
    if op not in CUSTOM_OPS:
        raise ValueError(f"register_kernel: '{op}' is a graphlm op; only custom ops "
                         "(graphlm.register_op) take kernels here")
    if executor not in EXECUTORS:
        raise ValueError(f"register_kernel: no executor '{executor}' takes custom kernels; "
                         f"choose one of {', '.join(EXECUTORS)}")
    if not callable(fn):
        raise TypeError(f"register_kernel('{op}'): the kernel must be callable, got {type(fn).__name__}")
    if executor in _REGISTERED.get(op, ()):
        raise ValueError(f"register_kernel: op '{op}' already has a {executor} kernel")
    table = _tables()[executor]
    if executor == "reference":
        table[op] = lambda node, *arrays: _checked(node, fn(*arrays, **node.attrs))
    else:
        from .numpy_executor import Kernel

        def build(node, out, ins, scratch):
            return lambda: np.copyto(out, _checked(node, fn(*ins, **node.attrs)))
        table[op] = Kernel(build)
    _REGISTERED.setdefault(op, set()).add(executor)


def _drop_kernels(op: str) -> None:
    """`graphlm.unregister_op` hook: a removed op's kernels go with it."""
    executors = _REGISTERED.pop(op, ())
    if executors:
        tables = _tables()
        for name in executors:
            tables[name].pop(op, None)


UNREGISTER_HOOKS.append(_drop_kernels)
