"""Back ends that compile and run graphlm graphs.

Contract (design.md section 6): ``executor.compile(graph, outputs) -> Program`` and
``Program.run(feeds, state=None) -> list[np.ndarray]``. `feeds` maps input names to arrays;
`state` maps param/state names to arrays that the program reads and, for update ops, writes
in place, so several programs can share one state.
"""
from __future__ import annotations

from graphlm.backends import available_executors, get_executor, register_executor

from .base import Program
from .custom_kernels import register_kernel


def get(name: str):
    """The executor called `name`: "reference" (the oracle), "numpy" (planned memory), "native"
    (the numpy executor with its hot float32 kernels in C, compiled on first use) or "jax" (one
    XLA program on CPU, GPU or TPU, over many devices and processes; needs the `jax` extra)."""
    return get_executor(name)


def compile(graph, outputs, executor: str = "reference") -> Program:
    """Shortcut for ``executors.get(executor).compile(graph, outputs)``."""
    return get(executor).compile(graph, outputs)


def _reference():
    from .reference import ReferenceExecutor
    return ReferenceExecutor()


def _numpy():
    from .numpy import NumpyExecutor
    return NumpyExecutor()


def _jax():
    from .jax_executor import JaxExecutor
    return JaxExecutor()


def _native():
    from .native import NativeExecutor
    return NativeExecutor()


register_executor("reference", _reference)
register_executor("numpy", _numpy)
register_executor("native", _native)
register_executor("jax", _jax)

__all__ = ["get", "compile", "Program", "available_executors", "register_executor", "register_kernel"]
