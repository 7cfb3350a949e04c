"""Small helpers the checks share: build a graph from a function, run it, compare arrays.

Executors are found by name through `graphlm.backends` (graphlm never imports the executors
package by name); "reference" is the oracle.
"""
from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np

import graphlm as gl
from graphlm.backends import get_executor


def compile(graph: gl.Graph, outputs, executor: str = "reference"):
    """``graphlm.executors.compile`` without importing the executors package by name."""
    return get_executor(executor).compile(graph, outputs)


def run(graph: gl.Graph, outputs, feeds=None, state=None, executor: str = "reference") -> list[np.ndarray]:
    """Compile `outputs` of `graph` with `executor` and run it once."""
    return compile(graph, outputs, executor).run(feeds or {}, state)


def run_reading(graph: gl.Graph, outputs, feeds, state=None, executor: str = "reference") -> list[np.ndarray]:
    """`run`, feeding only the inputs the compiled outputs read (programs refuse extra feeds)."""
    program = compile(graph, outputs, executor)
    return program.run(reading(program, feeds), state)


def reading(program, feeds) -> dict[str, np.ndarray]:
    """The feeds a compiled program reads."""
    return {k: v for k, v in feeds.items() if k in program.input_nodes}


def build(f: Callable[..., gl.Tensor], arrays: Sequence[np.ndarray], name: str = "check"):
    """A graph whose inputs ``x0, x1, ...`` have the shapes/dtypes of `arrays`, and ``f(*inputs)``."""
    g = gl.Graph(name)
    leaves = [g.input(f"x{i}", np.shape(a), np.asarray(a).dtype) for i, a in enumerate(arrays)]
    out = f(*leaves)
    if not isinstance(out, gl.Tensor):
        raise TypeError(f"the graph-building function returned {type(out).__name__}, not a Tensor")
    return g, leaves, out


def feeds_of(arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds of a `build` graph: ``{"x0": arrays[0], ...}``."""
    return {f"x{i}": np.asarray(a) for i, a in enumerate(arrays)}


def argument_names(f: Callable, count: int) -> list[str]:
    """How error messages call f's arguments: its parameter names where they can be read
    (``def f(x, w)`` -> x, w; a module's `forward`), else x0, x1, ..."""
    if isinstance(f, gl.nn.Module):
        f = f.forward
    try:
        params = [p for p in inspect.signature(f).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:count]]
    return names + [f"x{i}" for i in range(len(names), count)]


def central_difference(plus: np.ndarray, minus: np.ndarray, eps: float) -> np.ndarray:
    """(plus - minus) / (2 eps), and 0 where the two are equal: a masked output (-inf at the
    same place on both sides) does not change, which is a zero derivative, not NaN."""
    with np.errstate(invalid="ignore"):
        return np.where(plus == minus, 0.0, (plus - minus) / (2 * eps))


def is_float(a) -> bool:
    return np.asarray(a).dtype.kind == "f"


def assert_close(actual, expected, rtol: float, atol: float = 0.0, what: str = "value") -> None:
    """allclose with `atol` scaled by the size of `expected` (at least 1), and a clear message."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * scale, err_msg=what)
