"""The rewrite mechanism: rules as data, one driver. It is graphlm's only graph copier: the graph
passes (graphlm/passes) and the copies of graphlm/rewrite.py (a dtype change, decompositions
expanded, leaves as inputs) are all passes it runs.

`rewrite(graph, outputs, pass_)` copies the nodes the outputs need into a new graph in order
(when no rule matches anywhere, the result is the source graph itself, unless `copy=True`);
for each node it tries the pass's rules for that node's op (a rule naming `ANY` sees every
node but leaves, which a rule must name), and the first that returns a tensor replaces the
node. A node no rule replaced is copied with its name, scope and backward flag, its shape and
dtype inferred again by its op's rule where an input's changed. Nodes a replacement made
redundant (the intermediates it absorbed) are left dead and dropped at the end, so a rule only
builds what it replaces; so is a leaf no node reads any more (from the graph's tables too).
Rules see the source graph (`Context.uses`, `Context.private`) and build in the new one
(`Context.new`, `Context.new_as`, `Context.emit`, `Context.copy`). Which forward node's VJP made
each backward node (`Graph.forward_partner`) carries over. Two matchers several passes share sit
here too: `regrouped` (a reshape that keeps the last axis) and `bias_add` (m + b, b along the
last axis).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from graphlm.ir import LEAF_OPS, Graph, GraphError, Tensor
from graphlm.layout import layouts
from graphlm.ops import normalize_index
from graphlm.registry import REGISTRY

ANY = "*"   # in Rule.ops: every op but the leaves


@dataclass(frozen=True)
class Rule:
    """`apply(node, ctx) -> Tensor | None` for nodes whose op is in `ops`: the node's
    replacement (built with ctx.emit, same shape and dtype), or None where it does not match."""
    name: str
    ops: tuple[str, ...]
    apply: Callable[[Tensor, "Context"], "Tensor | None"]


@dataclass(frozen=True)
class Pass:
    """A named rule table. Rules are tried in order; the first match wins. `dtypes`: pairs
    (from, to) of a dtype change the pass makes (a replacement of a `from` node is a `to` node)."""
    name: str
    rules: tuple[Rule, ...]
    doc: str = ""
    dtypes: tuple[tuple[np.dtype, np.dtype], ...] = ()

    def rules_for(self, op: str) -> list[Rule]:
        """The rules that look at nodes of `op`, in order."""
        return [r for r in self.rules if op in r.ops or (ANY in r.ops and op not in LEAF_OPS)]


@dataclass
class Rewritten:
    """A rewritten graph: `graph` and its `outputs` (in the order given), and `replaced`, from
    each source node id to the node that computes its value now, or, for a node whose work a
    replacement absorbed, the node that absorbed it."""
    graph: Graph
    outputs: list[Tensor]
    replaced: dict[int, Tensor] = field(default_factory=dict)
    passes: tuple[str, ...] = ()

    def made_by(self, node: Tensor) -> str | None:
        """The pass that made `node` of the rewritten graph (None: copied as it was)."""
        return node.attrs.get("made_by")


class Context:
    """What a rule sees while the driver rewrites one node."""

    def __init__(self, graph: Graph, nodes: Sequence[Tensor], output_ids: set[int], pass_name: str):
        self.graph, self._outputs, self.pass_name = graph, output_ids, pass_name
        self._nodes, self._layouts = nodes, None
        self._readers: dict[int, list[Tensor]] = {}
        for n in nodes:
            for i in n.inputs:
                self._readers.setdefault(i.id, []).append(n)
        self._new: dict[int, Tensor] = {}
        self.absorbed: dict[int, int] = {}   # source id -> the source id whose replacement took it
        self.memo: dict = {}                 # per pass: what a rule shares between nodes
        self.node: Tensor | None = None      # the source node being rewritten

    def uses(self, node: Tensor) -> int:
        """How many nodes read `node` in the source graph (an output counts as one more)."""
        return len(self._readers.get(node.id, ())) + (node.id in self._outputs)

    def readers(self, node: Tensor) -> list[Tensor]:
        """The source nodes that read `node`, in order (once per input position)."""
        return list(self._readers.get(node.id, ()))

    def private(self, node: Tensor) -> bool:
        """Whether only one node reads `node` and it is not an output (a rule may absorb it)."""
        return self.uses(node) == 1

    def layout(self, node: Tensor):
        """A stand-in array with the strides a source node's value has where view ops are views
        (graphlm/layout.py), to ask whether a rewrite needs a copy."""
        if self._layouts is None:
            self._layouts = layouts(self._nodes)[0]
        return self._layouts[node.id]

    def new(self, node: Tensor) -> Tensor:
        """The new graph's tensor for a source node already rewritten (an input of this one)."""
        return self._new[node.id]

    def absorb(self, *nodes: Tensor) -> None:
        """Record that the replacement being built does the work of these source nodes."""
        for n in nodes:
            self.absorbed[n.id] = self.node.id

    def emit(self, op: str, inputs: Sequence[Tensor], kept: bool = False, **attrs) -> Tensor:
        """A node of `op` in the new graph (scope and backward flag of the node being rewritten),
        marked as made by this pass; `kept`: a value a forward keeps for its backward (marked
        attrs["kept"], so plans and pictures can count it)."""
        shape, dtype = REGISTRY[op].infer(list(inputs), attrs)
        marks = {"made_by": self.pass_name, **({"kept": True} if kept else {})}
        return self.graph._add(op, tuple(inputs), {**attrs, **marks}, shape, dtype)

    def emit_part(self, flat: Tensor, start: int, stop: int, shape, kept: bool = False) -> Tensor:
        """The part [start, stop) of a flat buffer (a node whose output packs several values) as
        a view of `shape`: a slice, then a reshape unless the part is flat itself."""
        index = normalize_index(slice(start, stop), flat.shape)
        if tuple(shape) == (stop - start,):
            return self.emit("slice", (flat,), index=index, kept=kept)
        return self.emit("reshape", (self.emit("slice", (flat,), index=index),), shape=tuple(shape), kept=kept)

    def new_as(self, node: Tensor, shape) -> Tensor:
        """`node`'s new tensor with its rows regrouped to `shape` (a reshape view) where the rule
        read it through such a reshape (`regrouped`)."""
        t = self.new(node)
        return t if t.shape == tuple(shape) else self.emit("reshape", (t,), shape=tuple(shape))

    def copy(self, node: Tensor, attrs: dict | None = None) -> Tensor:
        """`node` (a source node, not a leaf) in the new graph on its inputs' new tensors, with
        `attrs` instead of its own if given: its name kept, its shape and dtype inferred again
        where an input or an attribute changed (not marked as made by the pass)."""
        return _copy(self.graph, node, [self.new(i) for i in node.inputs], attrs)


# -- what several passes' rules match ---------------------------------------------------------------
def regrouped(x: Tensor) -> Tensor:
    """What `x` reads where it is a reshape that keeps the last axis (the rows regrouped, as a
    product's [B*T, C] read as [B, T, C]); else `x` itself."""
    return x.inputs[0] if x.op == "reshape" and x.inputs[0].shape[-1:] == x.shape[-1:] else x


def bias_add(node: Tensor) -> tuple[Tensor, Tensor] | None:
    """(m, b) where `node` is m + b (either order) with b along m's last axis; else None."""
    if node.op != "add":
        return None
    for m, b in (node.inputs, node.inputs[::-1]):
        if m.shape == node.shape and b.shape == node.shape[-1:]:
            return m, b
    return None


def needed(outputs: Sequence[Tensor]) -> list[Tensor]:
    """The nodes the outputs depend on, in creation (topological) order."""
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n.id not in seen:
            seen.add(n.id)
            stack.extend(i for i in n.inputs if i.id not in seen)
    return [outputs[0].graph.nodes[i] for i in sorted(seen)]


def _copy(graph: Graph, node: Tensor, inputs, attrs: dict | None = None) -> Tensor:
    """`node` copied into `graph` on `inputs` (see Context.copy)."""
    if node.op in ("input", "param", "state"):
        table = {"input": graph.inputs, "param": graph.params, "state": graph.states}[node.op]
        return graph._leaf(node.op, table, node.name, node.shape, node.dtype)
    shape, dtype = node.shape, node.dtype
    if attrs is not None or any(i.shape != s.shape or i.dtype != s.dtype for i, s in zip(inputs, node.inputs)):
        shape, dtype = REGISTRY[node.op].infer(list(inputs), node.attrs if attrs is None else attrs)
    return graph._add(node.op, tuple(inputs), node.attrs if attrs is None else attrs, shape, dtype, name=node.name)


def rewrite(graph: Graph, outputs: Sequence[Tensor], pass_: Pass, copy: bool = False,
            name: str | None = None) -> Rewritten:
    """Run one pass over the part of `graph` the outputs need. `copy`: a new graph (named
    `name`, else as the source) even where no rule matched."""
    outputs = list(outputs)
    for o in outputs:
        if not isinstance(o, Tensor) or o.graph is not graph:
            raise GraphError(f"pass {pass_.name}: output {o!r} is not a tensor of graph '{graph.name}'")
    nodes = needed(outputs)
    new_graph = Graph(name or graph.name)
    ctx = Context(new_graph, nodes, {o.id for o in outputs}, pass_.name)
    dtypes = {np.dtype(a): np.dtype(b) for a, b in pass_.dtypes}
    by_op: dict[str, list[Rule]] = {}
    changed = False
    for n in nodes:
        new_graph._scopes, new_graph._backward = [n.scope], n.is_backward
        made = None
        ctx.node = n
        rules = by_op[n.op] if n.op in by_op else by_op.setdefault(n.op, pass_.rules_for(n.op))
        for rule in rules:
            made = rule.apply(n, ctx)
            if made is not None:
                changed = True
                if made.shape != n.shape or made.dtype != dtypes.get(n.dtype, n.dtype):
                    raise GraphError(f"pass {pass_.name}, rule {rule.name}: replaced {n.op} {n.label} "
                                     f"{n.shape} {n.dtype} by {made.op} {made.shape} {made.dtype}")
                break
        ctx._new[n.id] = made if made is not None else _copy(new_graph, n, [ctx.new(i) for i in n.inputs])
    new_graph._scopes, new_graph._backward = [], False
    if not changed and not copy:   # no rule matched: the source graph itself
        return Rewritten(graph, outputs, {n.id: n for n in nodes}, (pass_.name,))
    new_outputs = [ctx.new(o) for o in outputs]
    new_graph.eliminate_dead_since(0, new_outputs)
    for table in (new_graph.inputs, new_graph.params, new_graph.states):   # leaves no node reads now
        for name in [k for k, leaf in table.items() if leaf.id < 0]:
            del table[name]
    replaced = {}
    for n in nodes:
        t, owner = ctx._new[n.id], n.id
        while t.id < 0 and owner in ctx.absorbed:   # dead: absorbed into another node's replacement
            owner = ctx.absorbed[owner]
            t = ctx._new[owner]
        if t.id >= 0:
            replaced[n.id] = t
    for back, fwd in graph.forward_partner.items():   # which forward node's VJP made each node
        b, f = replaced.get(back.id), replaced.get(fwd.id)
        if b is not None and f is not None and b.is_backward:
            new_graph.forward_partner.setdefault(b, f)
    return Rewritten(new_graph, new_outputs, replaced, (pass_.name,))


def compose(first: Rewritten, second: Rewritten) -> Rewritten:
    """`second` (run on first's graph) after `first`: the map from first's source nodes."""
    replaced = {sid: second.replaced[t.id] for sid, t in first.replaced.items() if t.id in second.replaced}
    return Rewritten(second.graph, second.outputs, replaced, first.passes + second.passes)
