"""The native executor's program (a `NumpyProgram` on the native kernel table, its runs of C steps
one call each) and executor."""
from __future__ import annotations

import numpy as np

from graphlm.passes.panel_weights import PANEL_WEIGHTS

from ..numpy import NumpyProgram, get_threads
from .build import available, library
from .products import mkl_products
from .table import KERNELS


class StepRun:
    """Consecutive steps of a program run by one C call (team.c's gl_run_steps), each step's
    team table (`team_closure`'s ``step_table(n)``: its work on n threads as one table) run as
    gl_team_run runs them. The steps' input checks (a cache position, token ids) run first: they
    read only fed inputs, which no step writes. The first run on a thread count, and every run
    where a step has no table for it, calls the steps one by one as closures. Same work, same
    order, so the same bits as the steps run one by one; a decode step's fifty small kernels no
    longer cost a ctypes call each."""

    def __init__(self, steps):
        self.steps = steps
        self.checks = [s.check for s in steps if hasattr(s, "check")]
        self._tables: dict[int, tuple | None] = {}
        self._run = library().gl_run_steps

    def _table(self, threads: int) -> tuple | None:
        """(address, count, the tables): gl_run_steps' rows (a table's address, its pieces), or
        None where a step has no table on `threads` threads. Built only once every step has
        run on that many threads: a closure builds its table there at its first call, and a
        product's build tries its cuts on its own output (executors/numpy/matmul.py,
        `pieces_round_as_whole`), which before its turn may still hold a value the run reads."""
        tables = [s.step_table(threads) for s in self.steps]
        if any(t is None for t in tables):
            return None
        words = np.array([[t.ctypes.data, len(t)] for t in tables], np.int64)
        return words.ctypes.data, len(words), words, tables

    def __call__(self) -> None:
        threads = get_threads()
        found = self._tables.get(threads)
        if found is None:   # the first run on this many threads, or a step without a table
            for step in self.steps:
                step()
            if threads not in self._tables:   # (after each step's first call: see _table)
                self._tables[threads] = self._table(threads)
            return
        for check in self.checks:
            check()
        self._run(found[0], found[1])


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

    def step_runs(self, state=None) -> list[list]:
        """The nodes of each run of steps that `run` makes one C call (`StepRun`); binds first
        as `native_ops` does."""
        if self._bound is None:
            self._bind(self.check_state(state))
        nodes = dict(zip(map(id, self._steps), self._step_nodes))
        return [[nodes[id(s)] for s in step.steps] for step in self._run_steps if isinstance(step, StepRun)]

    def _sequenced(self, steps, step_nodes) -> list:
        """The steps, each run of two or more that can join a `StepRun` as one: a step with a
        team table (``step_table``) whose checked inputs (``step.checked``: positions among its
        node's inputs) are fed inputs or views of them."""
        entries, fed = self.plan.entries, {}

        def is_fed(node) -> bool:
            if node.id not in fed:
                kind = entries[node.id].kind
                fed[node.id] = node.op == "input" or kind == "const" or (kind == "view" and is_fed(node.inputs[0]))
            return fed[node.id]

        out, run = [], []

        def close():
            out.extend([StepRun(list(run))] if len(run) > 1 else run)
            run.clear()
        for step, node in zip(steps, step_nodes):
            if hasattr(step, "step_table") and all(is_fed(node.inputs[i]) for i in getattr(step, "checked", ())):
                run.append(step)
            else:
                close()
                out.append(step)
        close()
        return out


class NativeExecutor:
    """``executors.get("native")``: compile(graph, outputs, poison=False) -> NativeProgram. The C
    kernels are built on the first compile (NativeUnavailable without a working compiler), and
    the products' BLAS is chosen then (a bad GRAPHLM_BLAS fails the compile, before any run)."""

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
        mkl_products()
        return NativeProgram(graph, outputs, poison=poison)
