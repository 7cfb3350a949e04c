"""`assert_executors_agree`: every executor against the reference executor, on one graph.

Each executor states its own numeric contract: a program's ``tolerance(dtype)`` is the relative
error it allows against the reference (0.0: bit for bit; `graphlm.executors.base.Program`).
Outputs and every state array the program writes in place (optimizer steps, caches) are
compared; each executor runs on its own copy of the state.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

import graphlm as gl
from graphlm.backends import available_executors, get_executor
from graphlm.ir import Tensor

from .graphs import assert_close


def usable_executors() -> list[str]:
    """The executors registered here that work on this machine (native needs a C compiler)."""
    return [name for name in available_executors() if executor_problem(name) is None]


def executor_problem(name: str) -> str | None:
    """Why executor `name` cannot run here (it fails to load, or says it is unavailable), or
    None when it can."""
    try:
        executor = get_executor(name)
        if getattr(executor, "available", lambda: True)():
            return None
        hint = " (no working C compiler)" if name == "native" else ""
        return f"the {name} executor says it is unavailable here{hint}"
    except Exception as e:   # an executor whose library is missing must not break a test session
        return f"the {name} executor does not load here: {type(e).__name__}: {e}"


def assert_executors_agree(graph: gl.Graph, outputs, feeds: Mapping[str, np.ndarray] | None = None,
                           state: Mapping[str, np.ndarray] | None = None,
                           executors: Sequence[str] | None = None) -> dict[str, list[np.ndarray]]:
    """Run `outputs` of `graph` on the reference executor and on each of `executors` (default:
    every usable one) and assert each agrees within its own tolerance; returns the results by
    executor. A disagreement names the executor, the output (or written state) and the node.
    `state` itself is not changed."""
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    names = usable_executors() if executors is None else list(executors)
    results = {}
    _, reference_values, reference_state = _run("reference", graph, outputs, feeds, state)
    results["reference"] = reference_values
    for name in names:
        if name == "reference":
            continue
        program, values, after = _run(name, graph, outputs, feeds, state)
        labelled = [(f"output {k} ({o.label}, op '{o.op}' in '{o.scope or '<root>'}')", o.dtype, a, b)
                    for k, (o, a, b) in enumerate(zip(outputs, values, reference_values))]
        labelled += [(f"state '{k}' after the run", reference_state[k].dtype, after[k], reference_state[k])
                     for k in program.written_state]
        for what, dtype, got, want in labelled:
            got, want = np.asarray(got), np.asarray(want)
            assert got.shape == want.shape and got.dtype == want.dtype, \
                f"{name} executor, {what}: {got.shape} {got.dtype}, reference {want.shape} {want.dtype}"
            tol = program.tolerance(dtype)
            message = f"the {name} executor disagrees with the reference on {what} (tolerance {tol:g})"
            if tol == 0.0 or got.dtype.kind != "f":
                np.testing.assert_array_equal(got, want, err_msg=message)
            else:
                assert_close(got, want, tol, tol, message)
        results[name] = values
    return results


def _run(name, graph, outputs, feeds, state):
    program = get_executor(name).compile(graph, outputs)
    copy = {k: np.array(v, copy=True) for k, v in (state or {}).items() if k in program.state_nodes}
    values = program.run({k: v for k, v in (feeds or {}).items() if k in program.input_nodes}, copy)
    return program, values, copy
