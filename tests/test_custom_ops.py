"""Custom ops through the public API: graphlm.register_op / apply / unregister_op and
graphlm.executors.register_kernel. Each error names the op; an op with a decomposition runs on
every executor without a kernel; one without refuses to compile, naming it."""
from __future__ import annotations

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors
from graphlm.registry import CUSTOM_OPS, REGISTRY
from graphlm.testing import assert_close, assert_executors_agree, check_grads, usable_executors


@pytest.fixture
def op_names():
    """Names registered in a test, unregistered after it."""
    made = []
    yield made
    for name in made:
        if name in CUSTOM_OPS:
            gl.unregister_op(name)


def same(inputs, attrs):
    return inputs[0].shape, inputs[0].dtype


def register(op_names, name, **rules):
    op_names.append(name)
    return gl.register_op(name, **rules)


def test_a_decomposed_op_runs_on_every_executor_without_a_kernel(op_names):
    register(op_names, "softplus_d", vjp=lambda y, g: [g * gl.sigmoid(y.inputs[0])],
             decompose=lambda x: gl.log(1.0 + gl.exp(x)), elementwise=True, doc="log(1 + e^x)")
    g = gl.Graph("decomposed")
    x = g.input("x", (3, 4))
    with g.scope("act"):
        y = gl.apply("softplus_d", [x]) * 2.0
    assert y.inputs[0].op == "softplus_d" and y.inputs[0].scope == "act"
    (dx,) = gl.grad(gl.sum(y), [x])
    xv = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    results = assert_executors_agree(g, [y, dx], {"x": xv})
    assert set(results) == set(usable_executors()) >= {"reference", "numpy"}
    y_ref, dx_ref = results["reference"]
    assert y_ref.dtype == np.float32
    assert_close(y_ref, 2 * np.logaddexp(0, xv), 1e-6, 1e-6)
    assert_close(dx_ref, 2 / (1 + np.exp(-xv)), 1e-6, 1e-6)
    program = executors.compile(g, [y], executor="numpy")
    assert program.source_graph is g and "softplus_d" not in {n.op for n in program.nodes}
    assert {n.scope for n in program.nodes if n.op in ("exp", "log")} == {"act"}


def test_a_shape_rule_is_inferred_from_the_decomposition(op_names):
    register(op_names, "outer_d", decompose=lambda a, b: gl.reshape(a, (-1, 1)) * gl.reshape(b, (1, -1)))
    g = gl.Graph()
    y = gl.apply("outer_d", [g.input("a", (3,), "float64"), g.input("b", (5,), "float64")])
    assert y.shape == (3, 5) and y.dtype == np.float64
    check_grads(lambda a, b: gl.apply("outer_d", [a, b]), [np.arange(3.0), np.ones(5)], order=2)


def test_an_op_without_kernel_or_decomposition_refuses_to_compile_on_every_executor(op_names):
    register(op_names, "opaque", infer=same, vjp=lambda y, g: [g])
    g = gl.Graph("needs_opaque")
    y = gl.apply("opaque", [g.input("x", (2,))])
    for name in usable_executors():
        with pytest.raises(NotImplementedError, match=rf"the {name} executor has no kernel for op 'opaque'; "
                                                      r"cannot compile graph 'needs_opaque' \(no decomposition"):
            executors.compile(g, [y], executor=name)


def test_a_registered_kernel_runs_and_its_result_is_checked(op_names):
    register(op_names, "twice", infer=same, vjp=lambda y, g: [g * 2.0], decompose=lambda x: x * 2.0)
    calls = []

    def kernel(x):
        calls.append(x.shape)
        return x * np.float32(2.0)
    executors.register_kernel("twice", kernel)
    g = gl.Graph()
    x = g.input("x", (4,))
    y = gl.apply("twice", [x])
    xv = np.arange(4, dtype=np.float32)
    for name in usable_executors():
        program = executors.compile(g, [y], executor=name)
        assert program.graph is g      # a kernel: nothing to expand
        np.testing.assert_array_equal(program.run({"x": xv})[0], 2 * xv)
    assert len(calls) == len(usable_executors())
    with pytest.raises(ValueError, match="op 'twice' already has a reference kernel"):
        executors.register_kernel("twice", kernel)
    register(op_names, "wrong_shape", infer=same)
    executors.register_kernel("wrong_shape", lambda x: x[:2])
    z = gl.apply("wrong_shape", [x])
    with pytest.raises(ValueError, match=r"wrong_shape \(wrong_shape#\d+ in <root>\): the kernel registered for "
                                         r"'wrong_shape' returned \(2,\) float32, expected \(4,\) float32"):
        executors.compile(g, [z], executor="numpy").run({"x": xv})


def test_register_kernel_refuses_graphlm_ops_unknown_ops_and_executors(op_names):
    with pytest.raises(ValueError, match="'tanh' is a graphlm op; only custom ops"):
        executors.register_kernel("tanh", np.tanh)
    with pytest.raises(KeyError, match="unknown op 'no_such_op'"):
        executors.register_kernel("no_such_op", np.tanh)
    register(op_names, "k_target", infer=same)
    with pytest.raises(ValueError, match="no executor 'gpu' takes custom kernels"):
        executors.register_kernel("k_target", np.tanh, executor="gpu")


def test_duplicate_names_and_missing_rules_are_errors_naming_the_op(op_names):
    with pytest.raises(ValueError, match=r"register_op: op 'tanh' is already registered \(a graphlm op\)"):
        gl.register_op("tanh", infer=same)
    register(op_names, "mine", infer=same)
    with pytest.raises(ValueError, match=r"op 'mine' is already registered \(a custom op\)"):
        gl.register_op("mine", infer=same)
    with pytest.raises(TypeError, match=r"register_op\('shapeless'\): the op has no shape rule"):
        gl.register_op("shapeless", vjp=lambda y, g: [g])
    assert "shapeless" not in REGISTRY
    with pytest.raises(ValueError, match="an op name must be an identifier"):
        gl.register_op("two words", infer=same)
    with pytest.raises(TypeError, match=r"register_op\('bad_vjp'\): vjp must be callable"):
        gl.register_op("bad_vjp", infer=same, vjp="g")
    with pytest.raises(ValueError, match="'tanh' is a graphlm op, not a custom op"):
        gl.unregister_op("tanh")


def test_a_broken_shape_rule_is_a_shape_error_naming_the_op_and_scope(op_names):
    register(op_names, "returns_shape_only", infer=lambda inputs, attrs: inputs[0].shape)
    register(op_names, "raises", infer=lambda inputs, attrs: inputs[3].shape)
    g = gl.Graph()
    x = g.input("x", (2, 3))
    with g.scope("blocks.1"):
        with pytest.raises(gl.ShapeError, match=r"returns_shape_only in blocks.1: its shape rule returned "
                                                r"\(2, 3\); it must return \(shape, dtype\)"):
            gl.apply("returns_shape_only", [x])
        with pytest.raises(gl.ShapeError, match=r"raises in blocks.1: its shape rule raised IndexError"):
            gl.apply("raises", [x])
    with pytest.raises(KeyError, match="unknown op 'never_registered'"):
        gl.apply("never_registered", [x])
    with pytest.raises(TypeError, match=r"apply\('raises', inputs\): inputs must be a list of tensors, got Tensor"):
        gl.apply("raises", x)


@pytest.mark.parametrize("vjp, message", [
    (lambda y, g: [g, g], r"returned 2 gradients for 1 inputs"),
    (lambda y, g: g, r"returned Tensor; it must return a list with one gradient \(or None\) per input \(1\)"),
    (lambda y, g: [gl.sum(g, axis=0)], r"gave \[3\] float32 for input 0, which is \[2,3\] float32 \(sum a broadcast"),
    (lambda y, g: [gl.cast(g, "float64")], r"gave \[2,3\] float64 for input 0, which is \[2,3\] float32"),
    (lambda y, g: [1.0], r"returned float for input 0; expected a graphlm.Tensor or None"),
])
def test_a_vjp_returning_the_wrong_gradients_is_an_error_naming_the_op(op_names, vjp, message):
    register(op_names, "bad_grads", infer=same, vjp=vjp)
    g = gl.Graph()
    x = g.input("x", (2, 3))
    with g.scope("mlp"):
        y = gl.apply("bad_grads", [x])
    with pytest.raises(gl.GraphError, match=r"the VJP of op 'bad_grads' \(bad_grads#\d+ in mlp\) " + message):
        gl.grad(gl.sum(y), [x])


def test_unregister_removes_the_op_and_its_kernels(op_names):
    gl.register_op("short_lived", infer=same)
    executors.register_kernel("short_lived", lambda x: x)
    gl.unregister_op("short_lived")
    from graphlm.executors import reference
    assert "short_lived" not in REGISTRY and "short_lived" not in reference.KERNELS
    gl.register_op("short_lived", infer=same, decompose=lambda x: x * 1.0)   # the name is free again
    op_names.append("short_lived")
    g = gl.Graph()
    x = g.input("x", (2,))
    (y,) = executors.compile(g, [gl.apply("short_lived", [x])]).run({"x": np.ones(2, np.float32)})
    np.testing.assert_array_equal(y, np.ones(2, np.float32))
