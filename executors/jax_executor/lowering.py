"""A program's nodes as one traced JAX function: each node through its rule (rules.py; a custom
op with only a NumPy kernel through a host callback).

Ops without a rule never reach this file: `executors/base.Program` replaces them at compile by
their registered decompositions (graphlm.rewrite.expand_decompositions, JAX's ``lower_fun``
idea), repeatedly, and refuses an op with neither a rule nor a decomposition, naming it.
"""
from __future__ import annotations

import jax.numpy as jnp

from graphlm.ir import LEAF_OPS, Tensor, fmt_shape
from graphlm.registry import REGISTRY

from ..base import ExecutionError, node_where
from .rules import lowering_rule


def evaluate(nodes, env: dict[int, object], writes: dict[str, object]) -> dict[int, object]:
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
        else:
            value = lowering_rule(n.op)(n, *(env[i.id] for i in n.inputs))
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
