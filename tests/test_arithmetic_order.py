"""Each op's arithmetic order is fixed in one place and every executor follows it, bit for bit.

The order lives in the op's section of graphlm/ops.py: its decomposition (which IS the formula:
the same operations in the same association), or, for an op without one, the formula line of its
doc. Two checks make that hold, on float32 inputs (the working dtype, where a reassociation shows;
float64 hides most of them), over every row of tests/test_ops.py's table:

- the reference kernel of every op with a decomposition against that decomposition run op by op
  on the reference executor: bit for bit, except an op that says it rounds unlike its
  decomposition (`OpDef.rounds_like_decomposition` False: matmul_sum folds a sum into one
  product), which agrees within DECOMPOSED_RTOL;
- node by node, every node of each row's graph after an executor's passes (forward and gradients),
  computed alone by the numpy and native executors on the reference's values of its inputs,
  against the reference kernel: bit for bit, except where the executor's kernel table declares
  that kernel's own rounding (`Kernel.rounds_own_way`: blocked attention, the native C exp, GELU
  and layer norm), where it agrees within the program's own float32 tolerance.

The jax executor is left out: XLA rounds its own exp, tanh, logistic and reductions (its program
says so: `rounds_like_reference` False) and its tests compare it within its tolerance; its rules
(executors/jax_executor/rules.py) spell the same formulas.
"""
from __future__ import annotations

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors
from graphlm.ir import LEAF_OPS
from graphlm.ops import op_attrs
from graphlm.registry import REGISTRY, apply
from graphlm.testing import assert_close, build, feeds_of
from graphlm.testing.agree import executor_problem
from tests.test_numpy_executor import graph_with_grads
from tests.test_ops import CASES, inputs_of

REF = executors.get("reference")
DECOMPOSED_RTOL = 1e-6   # float32, an op that rounds unlike its decomposition (a reassociated sum)


def float32_inputs(case, k):
    return [a.astype(np.float32) if a.dtype.kind == "f" else a for a in inputs_of(case, k)]


def bits_differ(got, want) -> str | None:
    """None where `got` and `want` are the same bits (NaNs alike), else a short description."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    same = (got == want) | ((got != got) & (want != want)) if got.dtype.kind == "f" else got == want
    same &= np.signbit(got) == np.signbit(want) if got.dtype.kind == "f" else True
    if np.all(same):
        return None
    i = np.unravel_index(np.argmin(same), same.shape) if same.ndim else ()
    return f"{int(np.size(same) - np.count_nonzero(same))} of {np.size(same)} elements differ, e.g. at {i}: {got[i]!r} vs {want[i]!r}"


def assert_bits_or_close(got, want, exact: bool, rtol: float, what: str, hint: str):
    """Bit for bit where `exact`, else within `rtol` relative (graphlm.testing.assert_close)."""
    if exact:
        problem = bits_differ(got, want)
        assert problem is None, f"{what}: {problem} ({hint})"
    else:
        assert rtol > 0
        assert_close(got, want, rtol, rtol, what)


# -- the reference kernel is its decomposition ------------------------------------------------------

DECOMPOSED = sorted(n for n, op in REGISTRY.items() if op.decompose is not None)


@pytest.mark.parametrize("op_name", DECOMPOSED)
def test_reference_kernel_computes_its_decomposition_bit_for_bit(op_name):
    op = REGISTRY[op_name]
    checked = 0
    for case in CASES:
        for k in range(len(case.inputs)):
            arrays = float32_inputs(case, k)
            g, _, _ = build(case.f, arrays)
            for node in [n for n in list(g.nodes) if n.op == op_name][:1]:
                composed = op.decompose(*node.inputs, **node.attrs)
                program = REF.compile(g, [node, composed])
                fused, spelled = program.run({n: v for n, v in feeds_of(arrays).items() if n in program.input_nodes})
                what = f"op '{op_name}' in row {case.name}-{k} (float32): its reference kernel vs its decomposition"
                assert_bits_or_close(fused, spelled, op.rounds_like_decomposition, DECOMPOSED_RTOL, what,
                                     "the kernel must compute the decomposition's operations in its order, "
                                     "graphlm/ops.py")
                checked += 1
    assert checked, f"no row of tests/test_ops.py CASES uses op '{op_name}'"


def test_an_op_that_rounds_unlike_its_decomposition_really_does():
    """The exception is a stated fact, not a blanket: matmul_sum's folded product does round
    differently from the batched product and its sum (else the flag would hide nothing)."""
    assert [n for n, op in REGISTRY.items() if not op.rounds_like_decomposition] == ["matmul_sum"]
    rng = np.random.default_rng(0)
    g = gl.Graph("fold")
    a, b = g.input("a", (6, 5, 33), np.float32), g.input("b", (6, 33, 7), np.float32)
    node = apply("matmul_sum", (a, b), axes=(0,), keepdims=False)
    composed = REGISTRY["matmul_sum"].decompose(a, b, axes=(0,), keepdims=False)
    feeds = {"a": rng.standard_normal((6, 5, 33)).astype(np.float32),
             "b": rng.standard_normal((6, 33, 7)).astype(np.float32)}
    fused, spelled = REF.compile(g, [node, composed]).run(feeds)
    assert bits_differ(fused, spelled) is not None
    assert_close(fused, spelled, DECOMPOSED_RTOL, DECOMPOSED_RTOL, "matmul_sum vs its decomposition")


# -- every executor's kernel is the reference kernel ---------------------------------------------------

def single_node_checks(executor_name: str):
    """(row, node, its input arrays) for every distinct computing node of every row's graph after
    the executor's passes, forward and gradients, with the reference's values of its inputs. For
    an executor deriving from the numpy one (native), only the nodes whose kernel is its own."""
    executor = executors.get(executor_name)
    numpy_kernels = executors.get("numpy").kernels
    own = (lambda op: True) if executor_name == "numpy" else \
        (lambda op: executor.kernels.get(op) is not numpy_kernels.get(op))
    seen, out = set(), []
    for case in CASES:
        for k in range(len(case.inputs)):
            arrays = float32_inputs(case, k)
            g, outputs = graph_with_grads(case.f, arrays, case.grad or case.fd)
            rewritten = executor.compile(g, outputs).graph   # the graph after the executor's passes
            nodes = [n for n in rewritten.nodes if n.op not in LEAF_OPS and not REGISTRY[n.op].view
                     and not REGISTRY[n.op].updates_state and own(n.op)]
            key_of = {n.id: (n.op, repr(sorted(n.attrs.items())), tuple((i.shape, i.dtype.str) for i in n.inputs))
                      for n in nodes}
            todo = [n for n in nodes if key_of[n.id] not in seen]
            if not todo:
                continue
            inputs = list({i.id: i for n in todo for i in n.inputs}.values())
            feeds = feeds_of(arrays)
            reference = REF.compile(rewritten, inputs)
            values = dict(zip((i.id for i in inputs),
                              reference.run({n: v for n, v in feeds.items() if n in reference.input_nodes})))
            for n in todo:
                seen.add(key_of[n.id])
                out.append((f"{case.name}-{k}", n, [values[i.id] for i in n.inputs]))
    return out


def alone(node, arrays):
    """A graph computing `node`'s op on inputs fed `arrays`."""
    g = gl.Graph(f"{node.op} alone")
    leaves = [g.input(f"in{i}", np.shape(a), np.asarray(a).dtype) for i, a in enumerate(arrays)]
    with g.scope(node.scope):
        y = apply(node.op, leaves, **op_attrs(node))
    return g, y, {f"in{i}": np.array(a, order="C") for i, a in enumerate(arrays)}   # (one layout for both)


@pytest.mark.parametrize("executor_name", ["numpy", "native"])
def test_every_kernel_computes_the_reference_kernels_order_node_by_node(executor_name):
    problem = executor_problem(executor_name)
    if problem is not None:
        pytest.skip(problem)
    executor = executors.get(executor_name)
    checked = 0
    for row, node, arrays in single_node_checks(executor_name):
        g, y, feeds = alone(node, arrays)
        program = executor.compile(g, [y])
        (got,) = program.run(feeds)
        (want,) = REF.compile(g, [y]).run(feeds)
        what = f"the {executor_name} executor's kernel of op '{node.op}' (node {node.label} of row {row}, " \
               "float32) vs the reference kernel"
        assert_bits_or_close(got, want, program.rounds_like_reference, program.tolerance(got.dtype), what,
                             "a kernel computes its op in the order of graphlm/ops.py, or declares rounds_own_way")
        checked += 1
    assert checked > (100 if executor_name == "numpy" else 10)
