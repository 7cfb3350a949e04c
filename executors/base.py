"""What every executor shares: the program's view of a graph and the checks on feeds and state."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from graphlm.ir import Graph, GraphError, Tensor, fmt_shape
from graphlm.registry import REGISTRY
from graphlm.rewrite import ancestors, expand_decompositions


class ExecutionError(ValueError):
    """A run could not go on: bad data met by a kernel (an out-of-range token id, ...)."""


def node_where(node: Tensor) -> str:
    return f"{node.op} ({node.label} in {node.scope or '<root>'})"


def check_index_range(node: Tensor, ids: np.ndarray, limit: int, what: str = "id") -> None:
    """Raise a clear error instead of wrapping negative ids or reading out of bounds."""
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = ids[(ids < 0) | (ids >= limit)].reshape(-1)[0]
        raise ExecutionError(f"{node_where(node)}: {what} {int(bad)} is out of range [0, {limit})")


def normalize_outputs(graph: Graph, outputs) -> list[Tensor]:
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    if not outputs:
        raise GraphError("compile: no outputs given")
    for o in outputs:
        if not isinstance(o, Tensor):
            raise GraphError(f"compile: output {o!r} is not a graphlm.Tensor")
        if o.graph is not graph:
            raise GraphError(f"compile: output {o.label} belongs to graph '{o.graph.name}', "
                             f"not '{graph.name}'")
    return outputs


def needed_nodes(outputs: Sequence[Tensor]) -> list[Tensor]:
    """The nodes the outputs depend on, in creation (topological) order."""
    order = ancestors(outputs)
    # Update ops (optimizer steps) write params/state in place, so they run after every other
    # node: a backward node may still read a weight that its update would change.
    updates = [n for n in order if REGISTRY[n.op].updates_state]
    if updates:
        update_ids = {n.id for n in updates}
        for n in order:
            if n.id not in update_ids and any(i.id in update_ids for i in n.inputs):
                raise GraphError(f"{node_where(n)} reads the result of an update op; update ops "
                                 "must be the last nodes of a program")
        order = [n for n in order if n.id not in update_ids] + updates
    return order


class Program:
    """A compiled graph. Subclasses implement `run`; this class checks feeds and state.

    An op with no kernel in `kernels` but with a decomposition (a custom op registered with
    ``decompose=``) runs as that decomposition: the program then holds a copy of the graph with
    those nodes expanded (`self.graph`; the caller's graph is `self.source_graph`), and its
    outputs are the copies of the requested ones, in the same order.
    """

    executor_name = "?"
    # The numeric contract against the reference executor, read through `tolerance(dtype)`
    # (graphlm.testing.assert_executors_agree): a program that rounds like the reference matches
    # it bit for bit in every dtype (each kernel computes its op in the order graphlm/ops.py fixes);
    # otherwise results agree within these relative tolerances.
    rounds_like_reference = False
    tolerances = {"float64": 1e-12, "float32": 1e-5}

    def tolerance(self, dtype) -> float:
        """The relative error this program's results may have against the reference's (scaled
        like graphlm.testing.assert_close); 0.0 means bit for bit."""
        dtype = np.dtype(dtype)
        if dtype.kind != "f" or self.rounds_like_reference:
            return 0.0
        return self.tolerances.get(dtype.name, max(self.tolerances.values()))

    def __init__(self, graph: Graph, outputs, kernels: Mapping):
        self.source_graph = graph
        outputs, missing = expand_decompositions(normalize_outputs(graph, outputs),
                                                 lambda op: op in kernels)
        if missing:
            raise NotImplementedError(f"the {self.executor_name} executor has no kernel for op "
                                      f"{', '.join(repr(m) for m in missing)}; cannot compile "
                                      f"graph '{graph.name}' (no decomposition to run instead: "
                                      "register a kernel with graphlm.executors.register_kernel "
                                      "or give the op a decompose= rule)")
        self.graph = outputs[0].graph
        self.outputs = outputs
        self.nodes = needed_nodes(self.outputs)
        self.input_nodes = {n.name: n for n in self.nodes if n.op == "input"}
        self.state_nodes = {n.name: n for n in self.nodes if n.op in ("param", "state")}
        self.written_state = sorted({n.inputs[i].name for n in self.nodes
                                     if REGISTRY[n.op].updates_state
                                     for i in n.attrs.get("writes", ())})

    def __repr__(self):
        return (f"<{type(self).__name__} of '{self.graph.name}': {len(self.nodes)} nodes, "
                f"{len(self.outputs)} outputs>")

    # -- checks ------------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        feeds = dict(feeds or {})
        for name in feeds:
            if name not in self.input_nodes:
                known = ", ".join(sorted(self.input_nodes)) or "none"
                kind = "an input of the graph that these outputs do not use" \
                    if name in self.graph.inputs else "not an input of the graph"
                raise ValueError(f"unexpected feed '{name}': {kind} (this program reads: {known})")
        for name, node in self.input_nodes.items():
            if name not in feeds:
                raise ValueError(f"missing feed for input '{name}' (expected {fmt_shape(node.shape)} "
                                 f"{node.dtype})")
            feeds[name] = _check_array("feed for input", node, feeds[name])
        return feeds

    def check_state(self, state: Mapping[str, np.ndarray] | None) -> Mapping[str, np.ndarray]:
        state = state if state is not None else {}
        for name, node in self.state_nodes.items():
            if name not in state:
                raise ValueError(f"missing state for {node.op} '{name}' (expected "
                                 f"{fmt_shape(node.shape)} {node.dtype})")
            arr = _check_array(f"state for {node.op}", node, state[name])
            if arr is not state[name]:
                raise ValueError(f"state for {node.op} '{name}' must be a numpy array, got "
                                 f"{type(state[name]).__name__}")
            if name in self.written_state and not (arr.flags.writeable and arr.flags.c_contiguous):
                raise ValueError(f"state for {node.op} '{name}' is updated in place, so it must be a "
                                 "writable C-contiguous array")
        return state


def _check_array(what: str, node: Tensor, value) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype == np.float64 and not isinstance(value, np.ndarray) and node.dtype == np.float32:
        arr = arr.astype(np.float32)  # a Python list of floats: take it as the node's dtype
    if arr.shape != node.shape or arr.dtype != node.dtype:
        raise ValueError(f"{what} '{node.name}': expected {fmt_shape(node.shape)} {node.dtype}, "
                         f"got {fmt_shape(arr.shape)} {arr.dtype}")
    return arr
