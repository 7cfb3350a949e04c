"""The native executor's program (a `NumpyProgram` on the native kernel table) and executor."""
from __future__ import annotations

from graphlm.passes.panel_weights import PANEL_WEIGHTS

from ..numpy import NumpyProgram
from .build import available, library
from .table import KERNELS


class NativeProgram(NumpyProgram):
    """A `NumpyProgram` on the native kernel table."""

    executor_name = "native"
    kernels = KERNELS
    pipeline = "native"   # its graph passes (graphlm/passes/pipelines.py)
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
    pipeline = NativeProgram.pipeline
    fixed_weights_pass = PANEL_WEIGHTS   # the layout of weights that stay fixed (graphlm.sample)

    @staticmethod
    def available() -> bool:
        """Whether the C kernels build and load here (compiling them if needed)."""
        return available()

    def compile(self, graph, outputs, poison: bool = False) -> NativeProgram:
        library()
        return NativeProgram(graph, outputs, poison=poison)
