"""The numpy executor's program: compile (the passes, then the memory plan), bind every kernel
to arrays over one planned arena, run, profile.

`compile(graph, outputs)` plans memory once (executors/planner.py: schedule, liveness, views,
in-place reuse, one 64-byte aligned arena placed greedy-by-size), then binds every node to
NumPy arrays over that arena and every kernel to a zero-argument closure over those arrays.
`Program.run` copies the feeds into their private buffers, calls the closures in order and
copies the outputs out (the caller owns what `run` returns; a later run never touches it).
`NumpyProgram.kernels` names the table a program uses (executors/numpy/table.py): the native
executor derives its program from this one with a copy of the table in which some kernels are C.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Sequence

import numpy as np

from graphlm.passes import run_pipeline
from graphlm.registry import REGISTRY

from .. import reference
from ..base import Program, normalize_outputs
from ..planner import Plan, aligned_buffer, apply_view, make_plan
from .table import KERNELS, Kernel, inplace_positions, kernel_for, kernel_rounds_own_way, scratch_specs


# == the program ===========================================================================================

class NumpyProgram(Program):
    """A graph compiled onto one planned arena; see the module docstring."""

    executor_name = "numpy"
    kernels: dict[str, Kernel] = KERNELS   # op -> kernel (a derived executor swaps in its own table)
    tolerances = {"float64": 1e-12, "float32": 1e-6}   # against the reference (base.Program)
    pipeline = "numpy"                     # the graph passes it runs first (graphlm/passes/pipelines.py)

    def __init__(self, graph, outputs, poison: bool = False):
        # the graph passes: the program compiles the rewritten graph (`self.graph`); the source
        # graph and the map from its nodes to theirs stay in `self.rewritten`
        self.rewritten = run_pipeline(self.pipeline, graph, normalize_outputs(graph, outputs))
        super().__init__(self.rewritten.graph, self.rewritten.outputs, set(self.kernels) | set(reference.KERNELS))
        self.source_graph = graph   # (the base class names the graph it was given: the rewritten one)
        self.run_nodes = self.nodes   # what the plan schedules: the rewritten graph's needed nodes
        table = self.kernels
        self.plan: Plan = make_plan(self.run_nodes, self.outputs,
                                    functools.partial(inplace_positions, table=table),
                                    functools.partial(scratch_specs, table=table))
        # False where a node rounds differently from the reference run of the source graph
        # (tests then compare within a tolerance): a folded matmul sum, the blocked causal attention
        self.rounds_like_reference = not any(self.rounds_own_way(n) for n in self.run_nodes)
        self._arena = aligned_buffer(self.plan.arena_bytes)
        self._dedicated = {e.node_id: np.empty(self.graph.nodes[e.node_id].shape,
                                               self.graph.nodes[e.node_id].dtype)
                           for e in self.plan.entries.values() if e.kind == "output"}
        self._feed_buffers = {name: np.empty(n.shape, n.dtype) for name, n in self.input_nodes.items()}
        self._feed_pairs = [(buf, name) for name, buf in self._feed_buffers.items()]
        self._bound: list[tuple[str, np.ndarray]] | None = None
        self._checked: list[tuple] | None = None
        self._steps: list[Callable[[], None]] = []      # one closure per scheduled node (profile)
        self._run_steps: list[Callable[[], None]] = []  # what run calls: the steps, or runs of them
        self._state_copies: list[tuple[np.ndarray, np.ndarray]] = []
        self._results: list[np.ndarray] = []
        if poison:
            self.poison_arena()

    def rounds_own_way(self, node) -> bool:
        """Whether this program computes `node` in another arithmetic order than the reference
        run of the source graph: its kernel declares it (the table's `rounds_own_way`: blocked
        attention, the native C exp), or a graph pass made it with an op that rounds unlike the
        ops it replaced (`OpDef.rounds_like_decomposition` False: the folded matmul sum)."""
        op = REGISTRY.get(node.op)   # (None for an executor-private fused op)
        made = op is not None and not op.rounds_like_decomposition and "made_by" in node.attrs
        return made or kernel_rounds_own_way(node, self.kernels)

    def kept_bytes(self) -> int:
        """Bytes kept from forward to backward beyond the graph's own activations: the kept-value
        tensors of the graph passes (attrs["kept"]: dropout keep masks, GELU's sigmoid,
        layer-norm statistics, attention's scores and row sums; executors/planner.kept_bytes).
        They are arena blocks (or parts of one) like any other value, live until their last
        reader, so they are already inside `plan.arena_bytes`; this says how much of it they take."""
        return self.plan.kept_bytes

    def poison_arena(self) -> None:
        """Fill the arena and output buffers with NaN bytes (0xFF): a debugging aid and a test that
        no kernel reads memory it has not written this run."""
        self._arena.fill(0xFF)
        for buf in self._dedicated.values():
            buf.reshape(-1).view(np.uint8).fill(0xFF)

    # -- binding ---------------------------------------------------------------------------------------
    def _arena_array(self, offset: int, shape, dtype) -> np.ndarray:
        return np.ndarray(shape, dtype, buffer=self._arena, offset=offset)

    def _bind(self, state) -> None:
        plan = self.plan
        nodes = {n.id: n for n in self.run_nodes}
        arrays: dict[int, np.ndarray] = {}
        copies = []
        for nid in plan.schedule:
            n = nodes[nid]
            e = plan.entries[nid]
            if n.op == "input":
                arrays[nid] = self._feed_buffers[n.name]
            elif n.op in ("param", "state"):
                arr = state[n.name]
                if not arr.flags.c_contiguous:  # keep a private contiguous copy, refreshed per run
                    private = np.ascontiguousarray(arr)
                    copies.append((private, arr))
                    arr = private
                arrays[nid] = arr
            elif n.op == "const":
                arrays[nid] = n.attrs["value"]
            elif e.kind == "view":
                arrays[nid] = apply_view(n, arrays[n.inputs[0].id])
            elif e.kind == "output":
                arrays[nid] = self._dedicated[nid]
            else:
                off = plan.entries[e.base].offset if e.kind == "inplace" else e.offset
                arrays[nid] = self._arena_array(off, n.shape, n.dtype)
        steps, step_nodes = [], []
        for nid in plan.schedule:
            n = nodes[nid]
            e = plan.entries[nid]
            if e.kind in ("leaf", "const", "view"):
                continue
            scratch = [self._arena_array(s.offset, s.shape, s.dtype) for s in plan.scratch.get(nid, ())]
            k = kernel_for(n.op, self.kernels)
            steps.append(k.build(n, arrays[nid], [arrays[i.id] for i in n.inputs], scratch))
            step_nodes.append(n)
        self._steps = steps
        self._step_nodes = step_nodes
        self._run_steps = self._sequenced(steps, step_nodes)
        self._state_copies = copies
        self._results = [arrays[o.id] for o in self.outputs]
        self._bound = [(name, state[name]) for name in self.state_nodes]

    # -- running -----------------------------------------------------------------------------------------
    def _same_state(self, state) -> bool:
        """Whether `state` holds exactly the arrays of the last checked run, unchanged in shape,
        dtype and (for written state) flags: then check_state would pass and nothing needs
        binding, at a fraction of its cost (~90 us for TinyLM's 62 arrays, per decoded token)."""
        if self._checked is None or state is None:
            return False
        try:
            for name, arr, shape, dtype, written in self._checked:
                a = state[name]
                if a is not arr or a.shape != shape or a.dtype is not dtype:
                    return False
                if written and not (a.flags.writeable and a.flags.c_contiguous):
                    return False
        except (KeyError, TypeError):
            return False
        return True

    def run(self, feeds=None, state=None) -> list[np.ndarray]:
        feeds = self.check_feeds(feeds)
        if not self._same_state(state):
            state = self.check_state(state)
            if self._bound is None or any(state[name] is not arr for name, arr in self._bound):
                self._bind(state)
            self._checked = [(name, state[name], state[name].shape, state[name].dtype,
                              name in self.written_state) for name in self.state_nodes]
        for buf, name in self._feed_pairs:
            np.copyto(buf, feeds[name])
        for private, arr in self._state_copies:
            np.copyto(private, arr)
        with np.errstate(all="ignore"):
            for step in self._run_steps:
                step()
        return [r.copy() for r in self._results]

    def _sequenced(self, steps, step_nodes) -> list[Callable[[], None]]:
        """What `run` calls for these steps, in order: here the steps themselves (a derived
        executor joins runs of them into one call: executors/native/program.py)."""
        return steps

    def profile(self, feeds=None, state=None) -> list[tuple]:
        """Run once, timing every kernel: [(node, seconds), ...] in run order. The node is the
        graph node (or the executor's fused node) the kernel computes; views and leaves take no
        time and are not listed. Results are computed exactly as by `run` (and discarded)."""
        feeds = self.check_feeds(feeds)
        state = self.check_state(state)
        if self._bound is None or any(state[name] is not arr for name, arr in self._bound):
            self._bind(state)
        for buf, name in self._feed_pairs:
            np.copyto(buf, feeds[name])
        for private, arr in self._state_copies:
            np.copyto(private, arr)
        clock = time.perf_counter
        timings = []
        with np.errstate(all="ignore"):
            for node, step in zip(self._step_nodes, self._steps):
                t0 = clock()
                step()
                timings.append((node, clock() - t0))
        return timings


class NumpyExecutor:
    """``executors.get("numpy")``: compile(graph, outputs, poison=False) -> NumpyProgram."""

    name = "numpy"
    kernels = KERNELS
    pipeline = NumpyProgram.pipeline

    def compile(self, graph, outputs, poison: bool = False) -> NumpyProgram:
        return NumpyProgram(graph, outputs, poison=poison)
