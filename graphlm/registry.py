"""The op registry: every op is declared once, with its shape/dtype rule, VJP rule and flags.

Kernels are not here: each executor keeps its own table of kernels keyed by op name and refuses
to compile a graph that uses an op it has no kernel for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .ir import Graph, ShapeError, Tensor, fmt_shape


@dataclass(frozen=True)
class OpDef:
    """One op's rules, side by side.

    infer(inputs, attrs) -> (shape, dtype)
        The static shape/dtype rule. Raises ShapeError with a message about the shapes; the
        registry prefixes it with the op name and module scope.
    vjp(node, cotangent) -> list[Tensor | None], one entry per input
        Builds the backward nodes (from existing ops). None means "no gradient flows".
    decompose(*inputs, **attrs) -> Tensor
        The same function composed from simpler ops. Fused ops have one: tests check the two
        agree, and an op whose `vjp` is None but has a decomposition is differentiated through
        it (this is how the fused backward ops get second-order gradients).
    """

    name: str
    infer: Callable[[Sequence[Tensor], dict], tuple[tuple[int, ...], Any]]
    vjp: Optional[Callable[[Tensor, Tensor], list]] = None
    decompose: Optional[Callable[..., Tensor]] = None
    elementwise: bool = False   # output[i] depends on inputs[i] only (after broadcasting)
    inplace: bool = False       # a kernel may write its output over a dying same-size input
    view: bool = False          # output can alias its first input's memory (no copy)
    differentiable: bool = True
    updates_state: bool = False  # writes into a state/param input in place (optimizer steps)
    doc: str = ""
    vjp_doc: str = ""


REGISTRY: dict[str, OpDef] = {}


def register(name: str, infer, **kwargs) -> OpDef:
    """Declare an op. Each op name may be registered once."""
    if name in REGISTRY:
        raise ValueError(f"op '{name}' is already registered")
    op = OpDef(name=name, infer=infer, **kwargs)
    REGISTRY[name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op '{name}'") from None


def graph_of(args) -> Graph:
    for a in args:
        if isinstance(a, Tensor):
            return a.graph
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    return b.graph
    raise TypeError("an op needs at least one graphlm.Tensor input")


def apply(name: str, inputs: Sequence[Tensor], **attrs) -> Tensor:
    """Make a node of op `name`: check inputs, infer shape/dtype, add it to the graph."""
    op = REGISTRY[name]
    graph = graph_of(inputs)
    for t in inputs:
        if isinstance(t, Tensor) and t.graph is not graph:
            graph._add(name, tuple(inputs), attrs, (), np.float32)  # raises the mixing error
    try:
        shape, dtype = op.infer(inputs, attrs)
    except ShapeError as e:
        where = graph.current_scope or "<root>"
        raise ShapeError(f"{name} in {where}: {e}") from None
    return graph._add(name, tuple(inputs), attrs, shape, dtype)


__all__ = ["OpDef", "REGISTRY", "register", "get_op", "apply", "graph_of", "ShapeError",
           "fmt_shape"]
