"""The JAX executor's program: the whole graph as one function compiled once by XLA.

``run(feeds, state)`` keeps `state` on the device: NumPy entries are put on the device on first
use and replaced in the dict by the device arrays; the state that update ops write is donated to
the step, and the dict entries are replaced by the new arrays (the old ones are then deleted,
as with any donated JAX buffer). Outputs come back as NumPy arrays (``run(..., to_host=False)``
keeps them on the device); `host_state` copies state to the host for checkpoints.

The function is traced and run with JAX's 64-bit mode on, inside a context manager, so int64
token ids, uint64 dropout counters and float64 graphs keep their dtypes without changing the
caller's global `jax_enable_x64` setting; every node's dtype is the graph's (checked at trace).
"""
from __future__ import annotations

import time
from typing import Mapping

import jax
import numpy as np

from graphlm.ir import LEAF_OPS, Graph, fmt_shape
from graphlm.registry import REGISTRY

from ..base import Program, _check_array, needed_nodes, normalize_outputs
from . import parallel
from .lowering import evaluate
from .rules import HOST_CHECKS, RULES, Lowerable


class JaxProgram(Program):
    executor_name = "jax"
    # against the reference: XLA's own exp/log/tanh and its reduction order
    tolerances = {"float64": 1e-11, "float32": 2e-5}

    def __init__(self, graph: Graph, outputs, devices=None, mesh=None, batch_inputs=None,
                 shard_optimizer_state: bool = False):
        super().__init__(graph, outputs, Lowerable())   # ops without a rule: their decompositions
        self.layout = parallel.Layout(self, parallel.make_mesh(devices, mesh), batch_inputs,
                                      shard_optimizer_state)
        self.read_state = sorted(n for n in self.state_nodes if n not in self.written_state)
        self.host_checks = self._host_checks(outputs)
        self._laid_out: dict[str, jax.Array] = {}   # state arrays already checked and placed
        start = time.perf_counter()
        with jax.enable_x64(True):
            self._compiled = self._lower().compile()
        self.compile_seconds = time.perf_counter() - start

    # -- building -------------------------------------------------------------------------------
    def _function(self, feeds, read, written):
        env = {}
        for n in self.nodes:
            if n.op == "input":
                env[n.id] = feeds[n.name]
            elif n.op in ("param", "state"):
                env[n.id] = read[n.name] if n.name in read else written[n.name]
        writes: dict = {}
        env = evaluate(self.nodes, env, writes)
        new = {name: writes.get(name, written[name]) for name in self.written_state}
        return tuple(env[o.id] for o in self.outputs), new

    def _lower(self):
        lay = self.layout
        spec = lambda node, sharding: jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=sharding)
        feeds = {n: spec(node, lay.feeds[n]) for n, node in self.input_nodes.items()}
        read = {n: spec(self.state_nodes[n], lay.state[n]) for n in self.read_state}
        written = {n: spec(self.state_nodes[n], lay.state[n]) for n in self.written_state}
        out_shardings = (tuple(lay.replicated for _ in self.outputs),
                         {n: lay.state[n] for n in self.written_state})
        fn = jax.jit(self._function, donate_argnums=(2,), out_shardings=out_shardings)
        return fn.lower(feeds, read, written)

    def _host_checks(self, outputs):
        """(node, operand leaf, check) for each integer operand the reference range-checks: the
        operand's value is the fed (or state) value, through reshapes; computed operands are
        not checked (none of graphlm's models computes its ids). Taken from the caller's graph,
        before decompositions, so the errors name the op the caller wrote."""
        out = []
        for n in needed_nodes(normalize_outputs(self.source_graph, outputs)):
            for index, check in HOST_CHECKS.get(n.op, ()):
                src = n.inputs[index]
                while src.op == "reshape":
                    src = src.inputs[0]
                if src.op in ("input", "param", "state"):
                    out.append((n, src, check))
        return out

    # -- running --------------------------------------------------------------------------------
    def run(self, feeds=None, state=None, to_host: bool = True) -> list:
        lay = self.layout
        try:
            feeds = self._check_feeds(feeds)
            state = self._check_state(state)
            for node, leaf, check in self.host_checks:
                value = feeds[leaf.name] if leaf.op == "input" else state[leaf.name]
                host = np.asarray(value) if not isinstance(value, jax.Array) else parallel.to_host(value)
                check(node, host.reshape(leaf.shape) if leaf.op != "input" else host)
            error = None
        except (ValueError, TypeError) as e:   # ExecutionError is a ValueError
            if not lay.multi_process:
                raise
            error = e
        if lay.multi_process:   # no process may wait in a collective for one that stopped
            parallel.raise_if_any_process_failed(error)
        with jax.enable_x64(True):
            args = {n: lay.put_feed(n, v, self.input_nodes[n].shape) for n, v in feeds.items()}
            read = {n: state[n] for n in self.read_state}
            written = {n: state[n] for n in self.written_state}
            outputs, new = self._compiled(args, read, written)
        state.update(new)
        self._laid_out.update(new)
        return [parallel.to_host(o) for o in outputs] if to_host else list(outputs)

    def _check_feeds(self, feeds) -> dict:
        feeds = dict(feeds or {})
        lay = self.layout
        if not lay.multi_process and not any(isinstance(v, jax.Array) for v in feeds.values()):
            return self.check_feeds(feeds)
        for name in feeds:
            if name not in self.input_nodes:
                self.check_feeds({name: feeds[name]})   # raises the executors' one message for it
        for name, node in self.input_nodes.items():
            if name not in feeds:
                raise ValueError(f"missing feed for input '{name}' (expected "
                                 f"{fmt_shape(lay.local_shape(name, node.shape))} {node.dtype})")
            shape = lay.local_shape(name, node.shape)
            if not isinstance(feeds[name], jax.Array):
                feeds[name] = _check_array("feed for input", _Expect(node, shape), feeds[name])
            _expect(f"feed for input '{name}'", node, shape, feeds[name],
                    " (this process's rows)" if shape != node.shape else "")
        return feeds

    def _check_state(self, state) -> Mapping:
        """Check every entry; NumPy ones are put on the device in the program's layout and
        replaced in `state` (once: later runs find the device arrays)."""
        state = state if state is not None else {}
        for name, node in self.state_nodes.items():
            if name not in state:
                raise ValueError(f"missing state for {node.op} '{name}' (expected "
                                 f"{fmt_shape(node.shape)} {node.dtype})")
            value = state[name]
            if value is self._laid_out.get(name) and not value.is_deleted():
                continue   # this program's own output of its last run, or checked then
            if isinstance(value, jax.Array):
                if value.is_deleted():
                    raise ValueError(f"state for {node.op} '{name}' was donated to an earlier run and "
                                     "deleted; pass the array that run put in the state dict")
                _expect(f"state for {node.op} '{name}'", node, node.shape, value)
            else:
                value = _check_array(f"state for {node.op}", node, value)
            with jax.enable_x64(True):
                state[name] = self._laid_out[name] = parallel.put(value, self.layout.state[name])
        return state

    # -- host copies, sizes ------------------------------------------------------------------------
    def host_state(self, state: Mapping) -> dict[str, np.ndarray]:
        """NumPy copies of every entry of `state` (collective over processes: all must call it)."""
        return {k: parallel.to_host(v) for k, v in state.items()}

    @property
    def local_rows(self):
        """The rows of each global batch that this process feeds (None: one process, all)."""
        node = next((self.input_nodes[n] for n in sorted(self.layout.batch_inputs)), None)
        return None if node is None else self.layout.local_rows(node.shape[0])

    @property
    def is_primary(self) -> bool:
        """Whether this process writes checkpoints (process 0)."""
        return parallel.is_primary()

    @property
    def devices(self) -> int:
        return self.layout.size

    def memory_report(self) -> dict:
        """Per-device bytes of params and state, as laid out and if everything were replicated."""
        lay = self.layout
        return {"devices": lay.size, "processes": lay.processes,
                "sharded_state": len(lay.sharded_state),
                "state_bytes_per_device": lay.state_bytes_per_device(self),
                "replicated_state_bytes_per_device": lay.state_bytes_per_device(self, sharded=False)}


class _Expect:
    """A node's name and dtype with another (this process's) shape, for `_check_array`."""

    def __init__(self, node, shape):
        self.name, self.dtype, self.shape = node.name, node.dtype, shape


def _expect(what: str, node, shape, value, note: str = "") -> None:
    if tuple(value.shape) != tuple(shape) or np.dtype(value.dtype) != node.dtype:
        raise ValueError(f"{what}: expected {fmt_shape(shape)} {node.dtype}{note}, got "
                         f"{fmt_shape(value.shape)} {np.dtype(value.dtype)}")


class JaxExecutor:
    """``compile(graph, outputs, devices=N | mesh=Mesh, batch_inputs=None,
    shard_optimizer_state=False)``: see the package docstring."""

    name = "jax"
    kernels = RULES
    multi_device = True   # compile(..., devices=N) runs data parallel

    def compile(self, graph, outputs, **options) -> JaxProgram:
        return JaxProgram(graph, outputs, **options)

    @staticmethod
    def available() -> bool:
        return True
