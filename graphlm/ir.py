"""The graph IR: one node type (`Tensor`) and the `Graph` that owns the nodes.

A `Tensor` is an immutable handle to a node: the op that makes it, its input nodes, the op's
attributes, and the static shape and dtype inferred when the node was made. Nothing is computed
while a graph is built; executors (the `executors` package) compile and run graphs.

Leaves are nodes with no inputs: `input` (fed per run), `param` (trainable, persistent), `state`
(persistent, not trainable) and `const` (a value baked into the graph).
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator, Sequence

import numpy as np


class ShapeError(ValueError):
    """A node's inputs have shapes or dtypes its op cannot accept.

    The message names the op, the module scope and the offending shapes, e.g.
    ``matmul in blocks.0.attention: cannot multiply [2,5,8] by [7,8]``.
    """


class GraphError(ValueError):
    """A graph is used wrongly: tensors of two graphs mixed, a leaf name taken twice, ..."""


def fmt_shape(shape: Sequence[int]) -> str:
    """``(2, 5, 8)`` -> ``[2,5,8]``, the form every error message uses."""
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


LEAF_OPS = ("input", "param", "state", "const")


class Tensor:
    """A node of a `Graph`. Immutable; made only through ops and `Graph` leaf constructors."""

    __slots__ = ("graph", "id", "op", "inputs", "attrs", "shape", "dtype", "name", "scope",
                 "is_backward", "__weakref__")

    def __init__(self, graph: "Graph", id: int, op: str, inputs: tuple["Tensor", ...],
                 attrs: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype,
                 name: str | None, scope: str, is_backward: bool):
        object.__setattr__(self, "graph", graph)
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "attrs", attrs)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "scope", scope)
        object.__setattr__(self, "is_backward", is_backward)

    def __setattr__(self, key, value):
        raise AttributeError("graphlm.Tensor nodes are immutable")

    # -- descriptive -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_leaf(self) -> bool:
        return self.op in LEAF_OPS

    @property
    def label(self) -> str:
        """The node's name if it has one, else ``op#id``."""
        return self.name if self.name else f"{self.op}#{self.id}"

    def __repr__(self) -> str:
        where = f" in {self.scope}" if self.scope else ""
        bw = " backward" if self.is_backward else ""
        return f"<Tensor {self.label} {self.op} {fmt_shape(self.shape)} {self.dtype}{where}{bw}>"

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self):
        raise TypeError("a graphlm.Tensor has no truth value while the graph is built; "
                        "use graphlm.where / graphlm.greater for data-dependent choices")

    # -- operators (defined in graphlm.ops; bound at import of graphlm) ----------------------
    def __add__(self, o): return _ops.add(self, o)
    def __radd__(self, o): return _ops.add(o, self)
    def __sub__(self, o): return _ops.sub(self, o)
    def __rsub__(self, o): return _ops.sub(o, self)
    def __mul__(self, o): return _ops.mul(self, o)
    def __rmul__(self, o): return _ops.mul(o, self)
    def __truediv__(self, o): return _ops.div(self, o)
    def __rtruediv__(self, o): return _ops.div(o, self)
    def __pow__(self, p): return _ops.pow(self, p)
    def __matmul__(self, o): return _ops.matmul(self, o)
    def __rmatmul__(self, o): return _ops.matmul(o, self)
    def __neg__(self): return _ops.neg(self)
    def __gt__(self, o): return _ops.greater(self, o)
    def __lt__(self, o): return _ops.less(self, o)
    def __getitem__(self, index): return _ops.slice(self, index)

    def reshape(self, *shape):
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return _ops.reshape(self, shape)

    def transpose(self, *axes):
        if len(axes) == 1 and not isinstance(axes[0], int):
            axes = tuple(axes[0])
        return _ops.transpose(self, axes or None)

    @property
    def T(self):
        return _ops.transpose(self)

    def sum(self, axis=None, keepdims=False): return _ops.sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _ops.mean(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return _ops.max(self, axis, keepdims)
    def astype(self, dtype): return _ops.cast(self, dtype)


_ops: Any = None  # graphlm.ops, bound by graphlm/__init__.py (ops import this module)


class Graph:
    """A static graph of ops. Nodes are kept in creation order, which is a topological order.

    Build leaves with `input`, `param`, `state` and `const`, then apply ops (``graphlm.tanh(x)``,
    ``x @ w``). `scope` prefixes the scope of every node made inside it, so each node knows which
    module made it.
    """

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Tensor] = []
        self.inputs: dict[str, Tensor] = {}
        self.params: dict[str, Tensor] = {}
        self.states: dict[str, Tensor] = {}
        self._scopes: list[str] = []
        self._backward = False
        self._scalar_consts: dict[tuple, Tensor] = {}
        self._counters: dict[str, int] = {}
        # backward node -> the forward node whose VJP made it (filled by graphlm.autodiff)
        self.forward_partner: dict[Tensor, Tensor] = {}

    def __repr__(self):
        return (f"<Graph {self.name}: {len(self.nodes)} nodes, {len(self.inputs)} inputs, "
                f"{len(self.params)} params, {len(self.states)} states>")

    def __len__(self):
        return len(self.nodes)

    # -- scopes --------------------------------------------------------------------------------
    @property
    def current_scope(self) -> str:
        return ".".join(s for s in self._scopes if s)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Nodes made inside get scope ``outer.name`` (``blocks.0.attention``)."""
        self._scopes.append(str(name))
        try:
            yield
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def backward_context(self, scope: str) -> Iterator[None]:
        """Used by the differentiation pass: nodes made inside are backward nodes of `scope`."""
        saved = (self._scopes, self._backward)
        self._scopes, self._backward = [scope], True
        try:
            yield
        finally:
            self._scopes, self._backward = saved

    def next_counter(self, key: str) -> int:
        """A per-graph counter (used for default dropout streams): 0, 1, 2, ... per key."""
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        return n

    # -- node creation ---------------------------------------------------------------------------
    def _add(self, op: str, inputs: tuple[Tensor, ...], attrs: dict, shape, dtype,
             name: str | None = None) -> Tensor:
        self.check_inputs(op, inputs)
        node = Tensor(self, len(self.nodes), op, tuple(inputs), dict(attrs),
                      tuple(int(d) for d in shape), np.dtype(dtype), name,
                      self.current_scope, self._backward)
        self.nodes.append(node)
        return node

    def check_inputs(self, op: str, inputs) -> None:
        """Raise GraphError unless every input is a live tensor of this graph."""
        for t in inputs:
            if not isinstance(t, Tensor):
                raise GraphError(f"{op}: input {t!r} is not a graphlm.Tensor")
            if t.id < 0:
                raise GraphError(f"{op}: input {t.op} node was removed from graph '{self.name}' "
                                 "as dead code by the differentiation pass")
            if t.graph is not self:
                raise GraphError(f"{op} in {self.current_scope or '<root>'}: input {t.label} "
                                 f"belongs to graph '{t.graph.name}', not '{self.name}'; "
                                 "tensors of two graphs cannot be mixed")

    def _leaf(self, kind: str, table: dict, name: str, shape, dtype) -> Tensor:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{kind}: a leaf needs a non-empty string name, got {name!r}")
        for other_kind, other in (("input", self.inputs), ("param", self.params),
                                  ("state", self.states)):
            if name in other:
                raise GraphError(f"{kind} '{name}': the name is already used by an {other_kind} "
                                 f"of graph '{self.name}'")
        try:   # operator.index: 2.7 or "3" is refused rather than truncated to a dimension
            if isinstance(shape, (str, bytes)) or any(isinstance(d, (bool, np.bool_)) for d in shape):
                raise TypeError
            shape = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise ShapeError(f"{kind} '{name}': shape must be a sequence of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise ShapeError(f"{kind} '{name}': negative dimension in {fmt_shape(shape)}")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise ShapeError(f"{kind} '{name}': unknown dtype {dtype!r}")
        node = self._add(kind, (), {}, shape, dtype, name=name)
        table[name] = node
        return node

    def input(self, name: str, shape, dtype="float32") -> Tensor:
        """A value fed on every run (`Program.run(feeds=...)`)."""
        return self._leaf("input", self.inputs, name, shape, dtype)

    def param(self, name: str, shape, dtype="float32") -> Tensor:
        """A trainable persistent tensor, read from `Program.run(state=...)`."""
        return self._leaf("param", self.params, name, shape, dtype)

    def state(self, name: str, shape, dtype="float32") -> Tensor:
        """A persistent, non-trainable tensor (optimizer moments, RNG keys, KV caches)."""
        return self._leaf("state", self.states, name, shape, dtype)

    def const(self, value, dtype=None) -> Tensor:
        """A constant baked into the graph. Python scalars default to float32 (int64 for ints)."""
        if isinstance(value, Tensor):
            raise GraphError("const: value is already a graphlm.Tensor")
        if dtype is None and isinstance(value, (bool, int, float)) and not isinstance(value, np.generic):
            dtype = np.bool_ if isinstance(value, bool) else (np.int64 if isinstance(value, int) else np.float32)
        arr = np.array(value, dtype=dtype)
        if arr.dtype == np.float64 and dtype is None and not isinstance(value, np.ndarray):
            arr = arr.astype(np.float32)
        arr.setflags(write=False)
        if arr.ndim == 0:
            key = (arr.item(), arr.dtype.str)
            cached = self._scalar_consts.get(key)
            if cached is not None and cached.is_backward == self._backward:
                return cached
            node = self._add("const", (), {"value": arr}, (), arr.dtype)
            self._scalar_consts[key] = node
            return node
        return self._add("const", (), {"value": arr}, arr.shape, arr.dtype)

    def eliminate_dead_since(self, start: int, live) -> int:
        """Drop the nodes made since node `start` that no tensor of `live` depends on.

        The differentiation pass calls this: VJP rules build cotangents for every input (a const
        operand included) and the ones nobody asked for would otherwise stay in the graph and in
        its renderings. Survivors keep their order and are renumbered. Returns how many went.
        """
        tail = self.nodes[start:]
        keep: set[int] = set()
        stack = [t for t in live if t.graph is self and t.id >= start]
        while stack:
            t = stack.pop()
            if id(t) in keep:
                continue
            keep.add(id(t))
            stack.extend(i for i in t.inputs if i.id >= start and id(i) not in keep)
        survivors = [n for n in tail if id(n) in keep]
        dropped = len(tail) - len(survivors)
        if dropped:
            for i, n in enumerate(survivors):
                object.__setattr__(n, "id", start + i)
            for n in tail:
                if id(n) not in keep:
                    object.__setattr__(n, "id", -1)  # a stale handle fails loudly if ever used
            self.nodes[start:] = survivors
            self._scalar_consts = {k: v for k, v in self._scalar_consts.items() if v.id >= 0}
        return dropped

    # -- views of the graph ------------------------------------------------------------------------
    def leaves(self) -> dict[str, Tensor]:
        """Every named leaf: inputs, params and states."""
        return {**self.inputs, **self.params, **self.states}

    def to_networkx(self):
        """A `networkx.DiGraph`: node id -> attrs op, shape, dtype, scope, name, backward."""
        import networkx as nx

        dg = nx.DiGraph(name=self.name)
        for n in self.nodes:
            dg.add_node(n.id, op=n.op, shape=n.shape, dtype=str(n.dtype), scope=n.scope,
                        name=n.name, backward=n.is_backward)
        for n in self.nodes:
            for i, src in enumerate(n.inputs):
                dg.add_edge(src.id, n.id, index=i)
        return dg
