"""The IR and the errors a user meets: graphs, leaves, scopes, dtypes, shape errors, bad feeds,
out-of-range token ids, and the README's example."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm.executors.reference import KERNELS, ReferenceProgram
from graphlm.ir import GraphError, ShapeError
from graphlm.testing import run

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# graphs, leaves, nodes
# ------------------------------------------------------------------------------------------------

def test_leaves_are_exposed_by_name_and_nodes_keep_creation_order():
    g = gl.Graph("m")
    x = g.input("x", (2, 3))
    w = g.param("w", (3, 4))
    step = g.state("step", (), "int64")
    y = x @ w
    assert g.inputs == {"x": x} and g.params == {"w": w} and g.states == {"step": step}
    assert g.leaves() == {"x": x, "w": w, "step": step}
    assert g.nodes == [x, w, step, y] and [n.id for n in g.nodes] == [0, 1, 2, 3]
    assert (y.op, y.inputs, y.shape, y.dtype) == ("matmul", (x, w), (2, 4), np.float32)
    assert (x.op, w.op, step.op, step.dtype) == ("input", "param", "state", np.int64)
    assert x.is_leaf and not y.is_leaf and (y.ndim, y.size, y.nbytes) == (2, 8, 32)


def test_nodes_are_immutable_and_have_no_truth_value():
    g = gl.Graph()
    x = g.input("x", (2,))
    with pytest.raises(AttributeError, match="immutable"):
        x.shape = (3,)
    with pytest.raises(TypeError, match="no truth value"):
        bool(x > 0.0)


def test_scopes_nest_and_are_restored_after_an_error():
    g = gl.Graph()
    x = g.input("x", (2,))
    with g.scope("blocks"):
        with g.scope("0"):
            with g.scope("attention"):
                a = gl.tanh(x)
            b = gl.exp(x)
        with pytest.raises(ShapeError):
            with g.scope("1"):
                gl.reshape(x, (3,))
        c = gl.neg(x)
    d = gl.sqrt(x)
    assert (a.scope, b.scope, c.scope, d.scope, x.scope) == ("blocks.0.attention", "blocks.0", "blocks", "", "")
    assert "in blocks.0.attention" in repr(a)


def test_operators_build_the_matching_ops():
    g = gl.Graph()
    a, b = g.input("a", (2, 2)), g.input("b", (2, 2))
    built = {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "matmul": a @ b, "neg": -a,
             "pow": a ** 3, "square": a ** 2, "greater": a > b, "less": a < b}
    assert {k: v.op for k, v in built.items()} == {k: k for k in built}
    assert (2.0 - a).inputs[1] is a and (2.0 - a).inputs[0].op == "const"
    assert (1.0 / a).op == "div" and (3.0 * a).op == "mul" and (1.0 + a).op == "add"
    assert a ** 1 is a and a.T.op == "transpose" and a.reshape(4).shape == (4,)
    assert a.sum(0).shape == (2,) and a.mean(keepdims=True).shape == (1, 1) and a.max(1).shape == (2,)
    assert a.astype("float64").dtype == np.float64 and a.astype("float32") is a


def test_a_transpose_of_a_transpose_is_one_permutation_or_none():
    g = gl.Graph("t")
    x = g.input("x", (2, 3, 4))
    y = gl.transpose(x, (1, 2, 0))                       # [3, 4, 2]
    z = gl.transpose(y, (2, 0, 1))                       # back to [2, 3, 4]
    assert z is x
    w = gl.transpose(y, (0, 2, 1))                       # [3, 2, 4] = x.transpose(1, 0, 2)
    assert w.op == "transpose" and w.inputs[0] is x and w.attrs["axes"] == (1, 0, 2)
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    (out,) = executors.compile(g, [w]).run({"x": a}, {})
    np.testing.assert_array_equal(out, a.transpose(1, 2, 0).transpose(0, 2, 1))
    with pytest.raises(ShapeError, match=re.escape("axes [0, 0, 1] are not a permutation of 3 axes of [3,4,2]")):
        gl.transpose(y, (0, 0, 1))   # the error names the caller's axes, not a composed permutation


def test_python_scalars_become_consts_of_the_other_operands_dtype():
    g = gl.Graph()
    x32 = g.input("x32", (2,))
    x64 = g.input("x64", (2,), "float64")
    for y, dtype in ((x32 * 2.0, np.float32), (x32 + 1, np.float32), (x64 - 0.5, np.float64),
                     (gl.where(x32 > 0.0, x32, 0.0), np.float32), (gl.maximum(x32, 0.0), np.float32)):
        assert y.dtype == dtype
        assert all(i.dtype == dtype for i in y.inputs if i.dtype.kind == "f")
    assert g.const(1.5).dtype == np.float32 and g.const(3).dtype == np.int64 and g.const(True).dtype == np.bool_
    assert g.const(np.ones(3)).dtype == np.float64  # an explicit float64 array stays float64
    assert g.const(2.0) is g.const(2.0)             # scalar consts are shared
    out = run(g, [x32 * 2.0, x64 - 0.5], {"x32": np.ones(2, np.float32), "x64": np.ones(2)})
    assert [o.dtype for o in out] == [np.float32, np.float64]


def test_mixing_dtypes_is_a_shape_error_not_a_silent_upcast():
    g = gl.Graph()
    x32, x64 = g.input("a", (2,)), g.input("b", (2,), "float64")
    with pytest.raises(ShapeError, match=re.escape("add in <root>: dtype mismatch: [2] float32, [2] float64")):
        x32 + x64
    assert (gl.cast(x32, "float64") + x64).dtype == np.float64


def test_duplicate_leaf_names_are_an_error_naming_the_name_and_kind():
    g = gl.Graph("m")
    g.input("x", (2,))
    g.param("w", (2,))
    with pytest.raises(GraphError, match="input 'x': the name is already used by an input of graph 'm'"):
        g.input("x", (3,))
    with pytest.raises(GraphError, match="state 'w': the name is already used by an param"):
        g.state("w", (2,))
    with pytest.raises(GraphError, match="non-empty string name"):
        g.param("", (2,))
    with pytest.raises(ShapeError, match=r"negative dimension in \[2,-1\]"):
        g.input("y", (2, -1))
    assert list(g.leaves()) == ["x", "w"]


def test_mixing_tensors_of_two_graphs_is_an_error_naming_both_graphs():
    g, h = gl.Graph("g"), gl.Graph("h")
    x, z = g.input("x", (2, 3)), h.input("z", (2, 3))
    n = len(g.nodes)
    for build in (lambda: x + z, lambda: gl.concat([x, z]), lambda: gl.maximum(x, z)):
        with pytest.raises(GraphError, match="belongs to graph '(g|h)', not '(g|h)'; tensors of two graphs cannot be mixed"):
            build()
    assert len(g.nodes) == n, "a failed op must not leave a node behind"
    with pytest.raises(GraphError, match="belongs to graph 'h', not 'g'"):
        executors.compile(g, [z])


# ------------------------------------------------------------------------------------------------
# shape errors: op, module scope and shapes
# ------------------------------------------------------------------------------------------------

def test_matmul_shape_error_names_op_scope_and_shapes_exactly():
    g = gl.Graph()
    x = g.input("x", (2, 5, 8))
    w = g.param("w", (7, 8))
    with g.scope("blocks"), g.scope("0"), g.scope("attention"):
        with pytest.raises(ShapeError) as err:
            gl.matmul(x, w)
    assert str(err.value) == "matmul in blocks.0.attention: cannot multiply [2,5,8] by [7,8]"
    assert isinstance(err.value, ValueError)


SHAPE_ERRORS = [
    (lambda g, x: x + g.input("y", (5,)), "add in <root>: cannot broadcast [2,3] with [5]"),
    (lambda g, x: x @ g.input("v", (4,)), "matmul in <root>: cannot multiply [2,3] by [4]"),
    (lambda g, x: g.input("b", (2, 2, 3)) @ g.input("c", (3, 3, 4)),
     "matmul in <root>: cannot multiply [2,2,3] by [3,3,4] (batch dimensions do not broadcast)"),
    (lambda g, x: gl.reshape(x, (4, 2)), "reshape in <root>: cannot reshape [2,3] into [4,2]"),
    (lambda g, x: gl.reshape(x, (4, -1)), "reshape in <root>: cannot reshape [2,3] into [4,-1]"),
    (lambda g, x: gl.transpose(x, (0, 0)), "transpose in <root>: axes [0, 0] are not a permutation of 2 axes of [2,3]"),
    (lambda g, x: gl.sum(x, 2), "sum in <root>: axis 2 is out of range for 2-d input (shape [2,3])"),
    (lambda g, x: gl.softmax(x, 3), "softmax in <root>: axis 3 is out of range for 2-d input (shape [2,3])"),
    (lambda g, x: x[2], "slice in <root>: index 2 is out of bounds for axis 0 of [2,3]"),
    (lambda g, x: gl.split(x, 2, 1), "split in <root>: axis 1 of [2,3] does not divide into 2 equal parts"),
    (lambda g, x: gl.concat([x, g.input("y", (5,))]), "concat in <root>: cannot concatenate [2,3], [5] along axis 0"),
    (lambda g, x: gl.layer_norm(x, g.param("w", (5,))),
     "layer_norm in <root>: weight [5] does not match the last axis of [2,3]"),
    (lambda g, x: gl.embedding(g.param("t", (5, 3)), x),
     "embedding in <root>: ids must be an integer tensor, got float32 [2,3]"),
    (lambda g, x: gl.cross_entropy(g.input("l", (5, 3)), g.input("t", (4,), "int64")),
     "cross_entropy in <root>: expects logits [N,V] and targets [N], got [5,3] and [4]"),
    (lambda g, x: gl.where(x, x, x), "where in <root>: condition must be bool, got float32 [2,3]"),
    (lambda g, x: gl.causal_mask(g.input("s", (5,))), "causal_mask in <root>: needs at least 2-d scores, got [5]"),
    (lambda g, x: gl.log(g.input("i", (4,), "int64")), "log in <root>: input must be floating point, got int64 [4]"),
    (lambda g, x: gl.dropout(x, 1.0, g.input("k", (), "int64")), "dropout in <root>: probability must be in [0, 1), got 1.0"),
    (lambda g, x: gl.dropout(x, 0.5, g.input("k", (2,), "int64")),
     "dropout in <root>: dropout key must be a scalar integer tensor, got [2]"),
    (lambda g, x: gl.gelu(x, "fast"), "gelu in <root>: approximate must be 'tanh' or 'none', got 'fast'"),
    (lambda g, x: gl.causal_attention(x, x, g.input("v", (2, 4))),
     "causal_attention in <root>: q, k and v must have one shape [..., T, D], got [2,3], [2,3] and [2,4]"),
    (lambda g, x: gl.causal_attention(*(g.input(n, (5,)) for n in "qkv")),
     "causal_attention in <root>: q, k and v must be [..., T, D] with T >= 1, got [5]"),
    (lambda g, x: gl.causal_attention(*(g.input(n, (2, 0, 4)) for n in "qkv")),
     "causal_attention in <root>: q, k and v must be [..., T, D] with T >= 1, got [2,0,4]"),
    (lambda g, x: gl.causal_attention(x, g.input("i", (2, 3), "int64"), x),
     "causal_attention in <root>: k must be floating point, got int64 [2,3]"),
]


@pytest.mark.parametrize("build,message", SHAPE_ERRORS, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(SHAPE_ERRORS)])
def test_shape_errors_name_the_op_the_scope_and_the_shapes(build, message):
    g = gl.Graph()
    x = g.input("x", (2, 3))
    with pytest.raises(ShapeError) as err:
        build(g, x)
    assert str(err.value) == message


# ------------------------------------------------------------------------------------------------
# executors: feeds, state, kernels
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def lookup():
    g = gl.Graph("lookup")
    table = g.param("table", (5, 3))
    ids = g.input("ids", (4,), "int64")
    scale = g.input("scale", (), "float32")
    g.input("unused", (2,))
    y = gl.embedding(table, ids) * scale
    return executors.compile(g, [y]), {"table": np.arange(15, dtype=np.float32).reshape(5, 3)}


BAD_FEEDS = [
    ({"scale": np.float32(1)}, "missing feed for input 'ids' (expected [4] int64)"),
    ({"ids": np.arange(4), "scale": np.float32(1), "unused": np.ones(2, np.float32)},
     "unexpected feed 'unused': an input of the graph that these outputs do not use (this program reads: ids, scale)"),
    ({"ids": np.arange(4), "scale": np.float32(1), "idz": np.arange(4)},
     "unexpected feed 'idz': not an input of the graph (this program reads: ids, scale)"),
    ({"ids": np.arange(3), "scale": np.float32(1)}, "feed for input 'ids': expected [4] int64, got [3] int64"),
    ({"ids": np.arange(4, dtype=np.int32), "scale": np.float32(1)},
     "feed for input 'ids': expected [4] int64, got [4] int32"),
    ({"ids": np.arange(4), "scale": np.array(1.0)}, "feed for input 'scale': expected [] float32, got [] float64"),
]


@pytest.mark.parametrize("feeds,message", BAD_FEEDS, ids=["missing", "unused", "extra", "shape", "dtype", "float64"])
def test_bad_feeds_are_value_errors_naming_the_input_and_both_shapes(lookup, feeds, message):
    program, state = lookup
    with pytest.raises(ValueError) as err:
        program.run(feeds, state)
    assert str(err.value) == message


def test_bad_state_is_a_value_error_naming_the_param(lookup):
    program, _ = lookup
    feeds = {"ids": np.arange(4), "scale": np.float32(2)}
    with pytest.raises(ValueError, match=re.escape("missing state for param 'table' (expected [5,3] float32)")):
        program.run(feeds, {})
    with pytest.raises(ValueError, match=re.escape("state for param 'table': expected [5,3] float32, got [5,3] float64")):
        program.run(feeds, {"table": np.ones((5, 3))})
    (y,) = program.run(feeds, {"table": np.ones((5, 3), np.float32)})
    np.testing.assert_array_equal(y, np.full((4, 3), 2, np.float32))


@pytest.mark.parametrize("bad", [5, -1, 1000])
def test_out_of_range_token_ids_are_clear_errors_not_wrapped_indices(lookup, bad):
    program, state = lookup
    before = state["table"].copy()
    with pytest.raises(ValueError, match=rf"embedding \(embedding#\d+ in <root>\): token id {bad} is out of range \[0, 5\)"):
        program.run({"ids": np.array([0, 1, bad, 2]), "scale": np.float32(1)}, state)
    np.testing.assert_array_equal(state["table"], before)


@pytest.mark.parametrize("bad", [3, -1])
def test_out_of_range_targets_are_clear_errors_in_forward_and_backward(bad):
    g = gl.Graph()
    logits = g.input("logits", (2, 3))
    targets = g.input("targets", (2,), "int64")
    loss = gl.cross_entropy(logits, targets)
    (dl,) = gl.grad(loss, [logits])
    feeds = {"logits": np.zeros((2, 3), np.float32), "targets": np.array([0, bad])}
    for outputs, op in (([loss], "cross_entropy"), ([dl], "cross_entropy_backward")):
        with pytest.raises(ValueError, match=rf"{op} \({op}#\d+ in <root>\): target {bad} is out of range \[0, 3\)"):
            run(g, outputs, feeds)
    g2 = gl.Graph()
    table = g2.param("table", (3, 2))
    ids = g2.input("ids", (2,), "int64")
    (dt,) = gl.grad(gl.sum(gl.embedding(table, ids)), [table])
    program = executors.compile(g2, [dt])
    assert [n.op for n in program.nodes if n.op.startswith("embedding")] == ["embedding_backward"]
    with pytest.raises(ValueError, match=rf"embedding_backward .*: token id {bad} is out of range \[0, 3\)"):
        program.run({"ids": np.array([bad, 0])}, {"table": np.ones((3, 2), np.float32)})


def test_an_executor_without_a_kernel_refuses_to_compile_and_names_the_op():
    g = gl.Graph("needs_tanh")
    x = g.input("x", (2,))
    y = gl.tanh(x) + 1.0
    kernels = {k: v for k, v in KERNELS.items() if k != "tanh"}
    with pytest.raises(NotImplementedError, match="no kernel for op 'tanh'; cannot compile graph 'needs_tanh'"):
        ReferenceProgram(g, [y], kernels)


def test_executor_lookup_and_the_compile_shortcut():
    assert "reference" in executors.available_executors()
    assert executors.get("reference") is executors.get("reference")
    with pytest.raises(ValueError, match="no executor named 'nope'; available: .*reference"):
        executors.get("nope")
    g = gl.Graph()
    x = g.input("x", (3,))
    y = gl.exp(x)
    feeds = {"x": np.array([0.0, 1.0, 2.0], np.float32)}
    a = executors.compile(g, [y], executor="reference").run(feeds)
    b = executors.get("reference").compile(g, [y]).run(feeds)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0], np.exp(feeds["x"]))
    a[0][:] = 0  # outputs are the caller's own arrays
    np.testing.assert_array_equal(executors.compile(g, y).run(feeds)[0], np.exp(feeds["x"]))


# ------------------------------------------------------------------------------------------------
# the README's example runs as written
# ------------------------------------------------------------------------------------------------

def test_readme_example_runs_as_written(capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no ```python block"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 20
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.strip(), "the example prints its result"
    # the values it printed are right: loss = mean(tanh(x @ w)^2) for its x and w
    if {"loss_value", "dw_value"} <= set(namespace):
        x = np.ones((4, 3))
        w = np.full((3, 2), 0.1)
        t = np.tanh(x @ w)
        np.testing.assert_allclose(namespace["loss_value"], np.mean(t * t), rtol=1e-6)
        np.testing.assert_allclose(namespace["dw_value"], x.T @ (2 * t * (1 - t * t) / t.size), rtol=1e-5)


API = ("Graph ShapeError GraphError Tensor grad vjp add sub mul div neg exp log sqrt rsqrt tanh sigmoid "
       "relu gelu silu square pow maximum where erf cast sum mean max reshape transpose broadcast_to "
       "slice concat split matmul embedding softmax log_softmax layer_norm rms_norm cross_entropy "
       "causal_mask dropout").split()


def test_the_functional_api_is_exported_from_the_top_level_package():
    missing = [name for name in API if not hasattr(gl, name)]
    assert not missing, f"graphlm lacks {missing}"
    assert issubclass(gl.ShapeError, ValueError) and issubclass(gl.GraphError, ValueError)
    g = gl.Graph()
    x = g.input("x", (2, 3))
    assert gl.gelu(x).attrs["approximate"] == "tanh"      # GPT-2's form is the default
    (dx,) = gl.grad(gl.sum(x), x)                          # a single wrt tensor works too
    assert dx.shape == (2, 3)
