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
        it (this is how the fused backward ops get second-order gradients). The decomposition is
        also the op's arithmetic order: every executor's kernel computes the same operations in
        the same association, so the reference kernel and the decomposition agree bit for bit
        (tests/test_arithmetic_order.py), except where `rounds_like_decomposition` is False.
    rounds_like_decomposition
        False for an op that computes its decomposition in another order on purpose (matmul_sum
        folds a sum into one product's contraction): a pass that produces it changes result bits
        (executors then say `rounds_like_reference` False), and tests compare the two within a
        tolerance.
    """

    name: str
    infer: Callable[[Sequence[Tensor], dict], tuple[tuple[int, ...], Any]]
    vjp: Optional[Callable[[Tensor, Tensor], list]] = None
    decompose: Optional[Callable[..., Tensor]] = None
    elementwise: bool = False   # output[i] depends on inputs[i] only (after broadcasting)
    view: bool = False          # output can alias its first input's memory (no copy)
    differentiable: bool = True
    updates_state: bool = False  # writes into a state/param input in place (optimizer steps)
    rounds_like_decomposition: bool = True
    doc: str = ""
    vjp_doc: str = ""


REGISTRY: dict[str, OpDef] = {}


def register(name: str, infer, **kwargs) -> OpDef:
    """Declare an op. Each op name may be registered once."""
    if name in REGISTRY:
        raise ValueError(f"op '{name}' is already registered")
    kwargs.pop("inplace", None)   # (accepted for old callers: in-place capability is the kernel table's)
    op = OpDef(name=name, infer=infer, **kwargs)
    REGISTRY[name] = op
    return op


CUSTOM_OPS: set[str] = set()   # the names registered through register_op (not graphlm's own)
UNREGISTER_HOOKS: list[Callable[[str], None]] = []   # executors drop a removed op's kernels


def register_op(name: str, *, infer=None, vjp=None, decompose=None, elementwise: bool = False,
                differentiable: bool | None = None, doc: str = "", vjp_doc: str = "") -> OpDef:
    """Declare a custom op; ``graphlm.apply(name, inputs, **attrs)`` then makes its nodes.

    infer(inputs, attrs) -> (shape, dtype)
        Its shape rule. Optional when `decompose` is given: the shape is then the shape of the
        decomposition built on leaves of the inputs' shapes.
    vjp(node, cotangent) -> [gradient or None, one per input]
        Its VJP rule, built from other ops (``node.inputs``, ``node.attrs``). Without one, the op
        is differentiated through its decomposition.
    decompose(*inputs, **attrs) -> Tensor
        The op written with other ops. An executor that has no kernel for the op runs this
        instead, so such an op runs everywhere; `graphlm.executors.register_kernel` adds a kernel.

    A name taken already, a missing shape rule, or a bad flag is an error naming the op; a shape
    rule that raises or returns something else than (shape, dtype) and a VJP that returns the
    wrong number or shapes of gradients are errors naming the op when a node is made or
    differentiated. `unregister_op(name)` removes a custom op again.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_op: an op name must be an identifier, got {name!r}")
    if name in REGISTRY:
        owner = "a custom op" if name in CUSTOM_OPS else "a graphlm op"
        raise ValueError(f"register_op: op '{name}' is already registered ({owner}); choose "
                         "another name, or unregister_op it first")
    for what, fn in (("infer", infer), ("vjp", vjp), ("decompose", decompose)):
        if fn is not None and not callable(fn):
            raise TypeError(f"register_op('{name}'): {what} must be callable, got {type(fn).__name__}")
    if infer is None:
        if decompose is None:
            raise TypeError(f"register_op('{name}'): the op has no shape rule: pass "
                            "infer=(inputs, attrs) -> (shape, dtype), or decompose=, from which "
                            "the shape is inferred")
        infer = _shape_of_decomposition(decompose)
    if differentiable is None:
        differentiable = vjp is not None or decompose is not None
    op = register(name, _checked_infer(infer), vjp=vjp, decompose=decompose,
                  elementwise=elementwise, differentiable=differentiable, doc=doc, vjp_doc=vjp_doc)
    CUSTOM_OPS.add(name)
    return op


def unregister_op(name: str) -> None:
    """Remove a custom op registered with `register_op` (graphlm's own ops cannot be removed).
    Nodes already made with it stay in their graphs but can no longer be compiled."""
    if name not in CUSTOM_OPS:
        what = "a graphlm op" if name in REGISTRY else "not a registered op"
        raise ValueError(f"unregister_op: '{name}' is {what}, not a custom op")
    CUSTOM_OPS.discard(name)
    del REGISTRY[name]
    for hook in UNREGISTER_HOOKS:
        hook(name)


def _checked_infer(infer):
    def rule(inputs, attrs):
        try:
            result = infer(inputs, attrs)
        except ShapeError:
            raise
        except Exception as e:  # a bug in a user's rule: say which op it belongs to
            raise ShapeError(f"its shape rule raised {type(e).__name__}: {e}") from e
        try:
            shape, dtype = result
            return tuple(int(d) for d in shape), np.dtype(dtype)
        except (TypeError, ValueError):
            raise ShapeError(f"its shape rule returned {result!r}; it must return "
                             "(shape, dtype)") from None
    return rule


def _shape_of_decomposition(decompose):
    def rule(inputs, attrs):
        scratch = Graph("shape rule")
        out = decompose(*(scratch.input(f"x{i}", t.shape, t.dtype) for i, t in enumerate(inputs)),
                        **attrs)
        if not isinstance(out, Tensor):
            raise ShapeError(f"its decomposition returned {type(out).__name__}, not a Tensor")
        return out.shape, out.dtype
    return rule


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
    op = get_op(name)
    if isinstance(inputs, Tensor):
        raise TypeError(f"apply('{name}', inputs): inputs must be a list of tensors, got "
                        "Tensor (write [x] for one input)")
    inputs = tuple(inputs)
    graph = graph_of(inputs)
    graph.check_inputs(name, [t for t in inputs if isinstance(t, Tensor)])
    try:
        shape, dtype = op.infer(inputs, attrs)
    except ShapeError as e:
        where = graph.current_scope or "<root>"
        raise ShapeError(f"{name} in {where}: {e}") from None
    return graph._add(name, tuple(inputs), attrs, shape, dtype)


__all__ = ["OpDef", "REGISTRY", "CUSTOM_OPS", "register", "register_op", "unregister_op", "get_op",
           "apply", "graph_of", "ShapeError", "fmt_shape"]
