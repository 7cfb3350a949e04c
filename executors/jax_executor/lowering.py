"""A graph's nodes as one traced JAX function: each node through its rule (rules.py) or, for an
op without one, through its registered decomposition (JAX's ``lower_fun``: the op is rebuilt from
simpler graphlm ops in a scratch graph, once per node at compile time, and that graph is lowered
in its place, recursively). An op with neither is refused at compile, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp

from graphlm.ir import LEAF_OPS, Graph, Tensor, fmt_shape
from graphlm.registry import REGISTRY

from ..base import ExecutionError, needed_nodes, node_where
from .rules import RULES


class Lowerable:
    """The ops this executor can lower (for the executor-independent compile check and the op
    table): those with a rule, and those with a decomposition (checked further at compile)."""

    def __contains__(self, op: str) -> bool:
        return op in RULES or (op in REGISTRY and REGISTRY[op].decompose is not None)

    def __iter__(self):
        return iter(sorted(op for op in REGISTRY if op in self and op not in LEAF_OPS))


@dataclass
class Decomposition:
    """A node rebuilt from simpler ops: the scratch graph's inputs (one per node input), its
    output and the nodes between, with the decompositions of those in turn."""

    inputs: list[Tensor]
    output: Tensor
    nodes: list[Tensor]
    inner: dict[int, "Decomposition"] = field(default_factory=dict)


def plan(nodes, chain: tuple[str, ...] = ()) -> dict[int, Decomposition]:
    """The decompositions the nodes without a rule lower through (node id -> Decomposition).
    Raises NotImplementedError naming any op that has neither a rule nor a decomposition."""
    out: dict[int, Decomposition] = {}
    missing = sorted({n.op for n in nodes if n.op not in LEAF_OPS and n.op not in RULES
                      and REGISTRY[n.op].decompose is None})
    if missing:
        via = f" (in the decomposition of {' -> '.join(repr(c) for c in chain)})" if chain else ""
        raise NotImplementedError(
            f"the jax executor has no lowering rule and no decomposition for op "
            f"{', '.join(repr(m) for m in missing)}{via}")
    for n in nodes:
        if n.op not in LEAF_OPS and n.op not in RULES:
            out[n.id] = decompose(n, chain)
    return out


def decompose(node: Tensor, chain: tuple[str, ...] = ()) -> Decomposition:
    if node.op in chain:
        raise NotImplementedError(f"the decomposition of op {chain[0]!r} uses {node.op!r} again "
                                  "(a cycle); give one of them a jax rule")
    g = Graph(f"{node.op}.decomposition")
    ins = [g.input(f"in{i}", t.shape, t.dtype) for i, t in enumerate(node.inputs)]
    out = REGISTRY[node.op].decompose(*ins, **node.attrs)
    if out.shape != node.shape or out.dtype != node.dtype:
        raise ExecutionError(f"{node_where(node)}: its decomposition gives {fmt_shape(out.shape)} "
                             f"{out.dtype}, expected {fmt_shape(node.shape)} {node.dtype}")
    nodes = needed_nodes([out])
    return Decomposition(ins, out, nodes, plan(nodes, chain + (node.op,)))


def evaluate(nodes, env: dict[int, object], decompositions: dict[int, Decomposition],
             writes: dict[str, object]) -> dict[int, object]:
    """Trace `nodes` in order. `env` holds the values of the leaves that are not consts
    (node id -> traced value) and receives every node's value; an update op's new values of
    the state it writes go into `writes` by state name."""
    for n in nodes:
        if n.id in env:
            continue
        if n.op == "const":
            value = jnp.asarray(n.attrs["value"], dtype=n.dtype)
        elif n.op in LEAF_OPS:
            raise ExecutionError(f"{node_where(n)} '{n.name}' has no value (an internal error)")
        elif n.id in decompositions:
            d = decompositions[n.id]
            inner = {t.id: env[x.id] for t, x in zip(d.inputs, n.inputs)}
            value = evaluate(d.nodes, inner, d.inner, writes)[d.output.id]
        else:
            value = RULES[n.op](n, *(env[i.id] for i in n.inputs))
            if REGISTRY[n.op].updates_state:
                value, new = value
                for index, v in new.items():
                    target = n.inputs[index]
                    _check_value(target, v, f"{node_where(n)} writing {target.name}")
                    writes[target.name] = v
        _check_value(n, value, node_where(n))
        env[n.id] = value
    return env


def _check_value(node: Tensor, value, where: str) -> None:
    shape, dtype = tuple(value.shape), value.dtype
    if shape != node.shape or dtype != node.dtype:
        raise ExecutionError(f"{where}: the jax lowering gives {fmt_shape(shape)} {dtype}, expected "
                             f"{fmt_shape(node.shape)} {node.dtype}")
