"""graphlm.testing catches planted bugs: each test plants one (a flipped-sign VJP, a broadcast not
summed back, a wrong second derivative, a right VJP over a wrong kernel, a wrong rule deep in a
GPT) and asserts the checker fails and says where; and the checkers pass on every registered op.

Custom ops made here are removed again by the `custom_ops` fixture, so no other test sees them.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors
from graphlm.models import GPT, GPTConfig
from graphlm.registry import CUSTOM_OPS, REGISTRY
from graphlm.testing import (assert_executors_agree, build, check_grads, check_op, check_vjps,
                             feeds_of, run_reading, usable_executors)


@pytest.fixture
def custom_ops():
    """Registers ops through `register_op` and unregisters them after the test."""
    made = []

    def register(name, **rules):
        gl.register_op(name, **rules)
        made.append(name)
        return lambda *xs, **attrs: gl.apply(name, list(xs), **attrs)

    yield register
    for name in made:
        gl.unregister_op(name)
    assert not CUSTOM_OPS & set(made)


def same_shape(inputs, attrs):
    return inputs[0].shape, inputs[0].dtype


def softplus_rules(vjp_sign=1.0):
    return dict(infer=same_shape, elementwise=True,
                vjp=lambda y, g: [g * gl.sigmoid(y.inputs[0]) * vjp_sign],
                decompose=lambda x: gl.log(1.0 + gl.exp(x)))


X = np.random.default_rng(0).standard_normal((3, 4))


# -- check_grads -----------------------------------------------------------------------------------

def test_check_grads_passes_a_right_custom_op_in_float32_and_float64(custom_ops):
    softplus = custom_ops("softplus_ok", **softplus_rules())
    for dtype in (np.float32, np.float64):
        result = check_grads(lambda x: softplus(x) * x, [X.astype(dtype)], order=2)
        assert result.grads[0].dtype == np.float64      # checked on the float64 copy
        assert len(result.checks) == 2 and result.hvp is not None


def test_flipped_sign_vjp_is_caught_and_the_worst_index_named(custom_ops):
    softplus = custom_ops("softplus_flipped", **softplus_rules(vjp_sign=-1.0))

    def f(activations):
        return softplus(activations)

    with pytest.raises(AssertionError) as err:
        check_grads(f, [X.astype(np.float32)])
    message = str(err.value)
    assert "gradient of f with respect to 'activations' ([3,4])" in message
    index = tuple(int(i) for i in re.search(r"at index \((\d+), (\d+)\)", message).groups())
    analytic, numeric = map(float, re.search(r"autodiff gives (\S+), central differences (\S+) ", message).groups())
    assert index in np.ndindex(3, 4) and abs(numeric) > 1e-3
    assert analytic == pytest.approx(-numeric, rel=1e-6)   # the flipped sign, at that index
    assert "relative error 2.0e+00" in message


def test_missing_broadcast_reduction_is_an_error_naming_the_op(custom_ops):
    """add's VJP without summing the broadcast back: a [3,4] gradient for a [4] input."""
    bad_add = custom_ops("add_unreduced", infer=lambda ins, a: (np.broadcast_shapes(ins[0].shape, ins[1].shape), ins[0].dtype),
                         vjp=lambda y, g: [g, g], decompose=lambda a, b: a + b)
    with pytest.raises(gl.GraphError, match=r"the VJP of op 'add_unreduced' \(add_unreduced#\d+ in <root>\) gave "
                                            r"\[3,4\] float64 for input 1, which is \[4\] float64 \(sum a broadcast back"):
        check_grads(bad_add, [X, X[0]])
    g = gl.Graph("model")
    a, b = g.input("a", (3, 4), "float64"), g.input("b", (4,), "float64")
    with g.scope("layer"):
        y = bad_add(gl.tanh(a), b)
    with pytest.raises(AssertionError, match=rf"check_vjps: the VJP rule fails at node {y.label} \(op 'add_unreduced', "
                                             r"scope 'layer'\): the VJP of op 'add_unreduced' .* gave \[3,4\]"):
        check_vjps([gl.sum(y)], {"a": X, "b": X[0]})


def test_broadcast_reduced_wrongly_is_caught(custom_ops):
    """A VJP with the right shape but a mean where the broadcast needs a sum."""
    bad_add = custom_ops("add_mean_reduced", infer=lambda ins, a: (np.broadcast_shapes(ins[0].shape, ins[1].shape), ins[0].dtype),
                         vjp=lambda y, g: [g, gl.mean(g, axis=0)], decompose=lambda a, b: a + b)
    with pytest.raises(AssertionError, match=r"gradient of f with respect to 'b' \(\[4\]\) is wrong"):
        check_grads(lambda a, b: bad_add(a, b) * a, [X, X[0]])
    g = gl.Graph("agree")
    a, b = g.input("a", (3, 4), "float64"), g.input("b", (4,), "float64")
    with pytest.raises(AssertionError, match=r"check_vjps: the VJP rule is wrong at node add_mean_reduced#\d+ "
                                             r"\(op 'add_mean_reduced', scope '<root>'\), for its input 1"):
        check_vjps([bad_add(a, b)], {"a": X, "b": X[0]})


def test_wrong_second_derivative_passes_order_1_and_fails_order_2(custom_ops):
    """cube's VJP is right to first order, but is built from a square op whose own VJP is
    wrong, so only the second derivative is off."""
    square = custom_ops("square_bad_vjp", infer=same_shape, vjp=lambda y, g: [g * y.inputs[0]],  # 2x g is right
                        decompose=lambda x: x * x)
    cube = custom_ops("cube", infer=same_shape, vjp=lambda y, g: [g * square(y.inputs[0]) * 3.0],
                      decompose=lambda x: x * x * x)
    check_grads(cube, [X], order=1)
    with pytest.raises(AssertionError, match=r"the second derivative of f with respect to 'x0' \(\[3,4\]\) is wrong"):
        check_grads(cube, [X], order=2)
    # and check_vjps pins it: the backward node made by cube's VJP has the wrong rule
    g = gl.Graph("cubes")
    x = g.input("x", (3, 4), "float64")
    (dx,) = gl.grad(gl.sum(cube(x)), [x])
    check_vjps([cube(x)], {"x": X})
    with pytest.raises(AssertionError, match=r"at backward node square_bad_vjp#\d+ \(op 'square_bad_vjp'"):
        check_vjps([dx], {"x": X})


def test_right_vjp_over_a_wrong_kernel_is_caught(custom_ops):
    """The VJP and decomposition are right; the kernel computes log(1 + exp(x)) + 0.01 x^2."""
    rules = softplus_rules()
    softplus = custom_ops("softplus_wrong_kernel", **rules)
    executors.register_kernel("softplus_wrong_kernel", lambda x: np.logaddexp(0, x) + 0.01 * x * x)
    # the forward no longer fits the VJP: central differences of the kernel disagree
    with pytest.raises(AssertionError, match="gradient of f with respect to 'x0'"):
        check_grads(softplus, [X])
    # a wrong kernel on one executor only: that executor disagrees with the reference
    other = custom_ops("softplus_wrong_numpy", **softplus_rules())
    executors.register_kernel("softplus_wrong_numpy", lambda x: np.logaddexp(0, x) * 1.001, executor="numpy")
    g = gl.Graph("kernels")
    x = g.input("x", (3, 4))
    y = other(x)
    with pytest.raises(AssertionError, match=r"the numpy executor disagrees with the reference on output 0 "
                                             r"\(softplus_wrong_numpy#\d+, op 'softplus_wrong_numpy'"):
        assert_executors_agree(g, [y], {"x": X.astype(np.float32)}, executors=["numpy"])


def test_check_grads_uses_the_function_argument_names_and_skips_integer_inputs():
    table = np.random.default_rng(1).standard_normal((5, 3))
    ids = np.array([0, 3, 3, 1])
    result = check_grads(lambda weights, tokens: gl.square(gl.embedding(weights, tokens)), [table, ids])
    assert result.float_inputs == [0]
    assert result.checks[0].startswith("gradient of 'weights' ([5,3])")
    with pytest.raises(ValueError, match="no floating-point argument"):
        check_grads(lambda t: gl.cast(t, "float64"), [ids])


# -- check_vjps in a GPT -----------------------------------------------------------------------------

def tiny_gpt_training_graph():
    cfg = GPTConfig(vocab_size=17, context_length=8, channels=16, head_count=2, layer_count=4,
                    dropout=0.1)
    model = GPT(cfg).train()
    g, loss = model.loss_graph(2, 8)
    grads = gl.grad(loss, list(g.params.values()))
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 17, (2, 8)), "targets": rng.integers(0, 17, (2, 8)),
             "dropout_key": np.array(7, dtype=np.int64)}
    params = model.init(seed=0)
    return g, [loss, *grads], feeds, {k: params[k] for k in g.params}


def test_check_vjps_passes_a_whole_gpt_training_step_and_leaves_its_state_alone():
    from graphlm.optim import SGD
    g, outputs, feeds, state = tiny_gpt_training_graph()
    optimizer = SGD(lr=0.1, momentum=0.9)
    step = optimizer.minimize(outputs[0])
    state = {**state, **optimizer.init_state()}
    before = {k: v.copy() for k, v in state.items()}
    report = check_vjps([*outputs, step.update], {**feeds, **optimizer.feeds(0)}, state)
    assert len(g.nodes) > 400 and len(report.checked) > 400
    assert {"causal_attention", "layer_norm", "gelu", "dropout", "cross_entropy", "embedding",
            "layer_norm_backward", "causal_attention_backward"} <= {n.op for n in report.checked}
    assert report.skipped["sgd_update"] == "not differentiable"
    assert all(np.array_equal(state[k], before[k]) for k in state)


def test_check_vjps_names_the_planted_node_in_a_gpt(monkeypatch):
    """gelu's VJP rule with a flipped sign: the first gelu node, in block 0, is named."""
    g, outputs, feeds, state = tiny_gpt_training_graph()
    gelu = REGISTRY["gelu"]
    monkeypatch.setitem(REGISTRY, "gelu", dataclasses.replace(gelu, vjp=lambda y, g: [-v for v in gelu.vjp(y, g)]))
    first = next(n for n in g.nodes if n.op == "gelu")
    with pytest.raises(AssertionError) as err:
        check_vjps(outputs, feeds, state)
    assert first.scope == "blocks.0"
    assert f"at node {first.label} (op 'gelu', scope 'blocks.0'), for its input 0" in str(err.value)


def test_check_vjps_names_a_planted_custom_op_deep_in_a_gpt(custom_ops):
    """A scale op with a flipped-sign VJP, used only in the third block's MLP output layer."""
    scale = custom_ops("scale_flipped", infer=same_shape, vjp=lambda y, g: [-g * 1.5],
                       decompose=lambda x: x * 1.5)
    cfg = GPTConfig(vocab_size=17, context_length=8, channels=16, head_count=2, layer_count=4)
    model = GPT(cfg)
    layer = model.blocks[2].mlp_output
    original = layer.forward
    object.__setattr__(layer, "forward", lambda x: scale(original(x)))
    g, loss = model.loss_graph(2, 8)
    planted = [n for n in g.nodes if n.op == "scale_flipped"]
    assert len(planted) == 1 and planted[0].scope == "blocks.2.mlp_output"
    params = model.init(seed=0)
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 17, (2, 8)), "targets": rng.integers(0, 17, (2, 8))}
    with pytest.raises(AssertionError, match=rf"at node {planted[0].label} \(op 'scale_flipped', "
                                             r"scope 'blocks.2.mlp_output'\)"):
        check_vjps([loss], feeds, {k: params[k] for k in g.params})


# -- every registered op -------------------------------------------------------------------------------

def op_table():
    from tests.test_ops import CASES, inputs_of
    return [(case, k, inputs_of(case, k)) for case in CASES for k in range(len(case.inputs))]


def test_check_vjps_passes_on_every_registered_op():
    """Every op of the op table, as a graph, has its VJP rule checked (non-differentiable ops
    are reported as skipped), and all pass."""
    checked, skipped = set(), set()
    for case, k, arrays in op_table():
        g, _, out = build(case.f, arrays)
        report = check_vjps([out], feeds_of(arrays))
        checked |= {n.op for n in report.checked}
        skipped |= set(report.skipped)
    ops = {n for n, op in REGISTRY.items() if n not in ("input", "param", "state", "const")
           and not op.updates_state and n not in CUSTOM_OPS}
    differentiable = {n for n in ops if REGISTRY[n].differentiable}
    assert differentiable <= checked, f"VJP rules never checked: {sorted(differentiable - checked)}"
    assert ops <= checked | skipped


def test_executors_agree_on_every_op_and_on_a_training_step_with_its_state():
    names = usable_executors()
    assert {"reference", "numpy"} <= set(names)
    for case, k, arrays in op_table():
        arrays = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in arrays]
        g, _, out = build(case.f, arrays)
        results = assert_executors_agree(g, [out], feeds_of(arrays))
        assert set(results) == set(names)
    # SGD with momentum, not AdamW: Adam's first step is lr * sign(g), and the key bias's gradient
    # is zero up to rounding (softmax ignores a shift of all scores), so there it amplifies
    # rounding noise into +-lr and no tolerance would hold.
    from graphlm.optim import SGD
    cfg = GPTConfig(vocab_size=17, context_length=8, channels=16, head_count=2, layer_count=2,
                    dropout=0.1)
    model = GPT(cfg).train()
    g, loss = model.loss_graph(2, 8)
    optimizer = SGD(lr=0.1, momentum=0.9)
    step = optimizer.minimize(loss)
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 17, (2, 8)), "targets": rng.integers(0, 17, (2, 8)),
             "dropout_key": np.array(7, dtype=np.int64), **optimizer.feeds(0)}
    state = {**model.init(seed=0), **optimizer.init_state()}
    before = {k: v.copy() for k, v in state.items()}
    results = assert_executors_agree(g, [loss, step.update], feeds, state)
    assert set(results) == set(names)
    assert all(np.array_equal(state[k], before[k]) for k in state)   # each ran on its own copy


def test_a_disagreeing_state_update_is_named(monkeypatch):
    """An executor whose update op writes its param differently is caught on that state."""
    from graphlm.executors import numpy_executor, reference
    from graphlm.optim import SGD
    g = gl.Graph("sgd")
    w = g.param("w", (3,))
    sgd = SGD(lr=0.1)
    step = sgd.minimize(gl.sum(gl.square(w)))
    state = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
    assert_executors_agree(g, [step.update], sgd.feeds(0), state, executors=["numpy"])
    right = reference.KERNELS["sgd_update"]

    def build(node, out, ins, scratch):
        def run():
            np.copyto(out, right(node, *ins))
            ins[2] *= np.float32(1.001)          # the planted bug: the param written 0.1% off
        return run
    monkeypatch.setitem(numpy_executor.KERNELS, "sgd_update", numpy_executor.Kernel(build))
    with pytest.raises(AssertionError, match="the numpy executor disagrees with the reference on state 'w' after the run"):
        assert_executors_agree(g, [step.update], sgd.feeds(0), state, executors=["numpy"])


def test_check_grads_checks_a_module_with_its_parameters_and_dropout():
    """A decoder block in training mode: its parameters (named by their module paths) are
    differentiated like arguments; the dropout key it reads is fed unchanged."""
    from graphlm import nn
    block = nn.DecoderBlock(8, 2, dropout=0.2).train()
    x = np.random.default_rng(2).standard_normal((2, 3, 8)).astype(np.float32)
    params = {**block.init(seed=0), "dropout_key": np.array(11, np.int64)}
    result = check_grads(block, [x], params=params)
    checked = [line.split("'")[1] for line in result.checks]
    assert checked[0] == "x" and "attention.qkv_weight" in checked and "mlp_output.bias" in checked
    assert len(checked) == 1 + len(block.parameters())
    with pytest.raises(ValueError, match="f's graph reads .*dropout_key.*: give their values in params="):
        check_grads(block, [x], params=block.init(seed=0))


def test_check_grads_runs_on_every_executor(graphlm_executor):
    """The plugin's fixture in graphlm's own suite: the same checks on each executor."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 5, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32)
    result = check_grads(lambda x, w: gl.softmax(gl.layer_norm(x) @ w), [x, w], order=2,
                         executor=graphlm_executor)
    assert all(f"on the {graphlm_executor} executor" in line for line in result.checks)


def test_a_large_input_is_localised_on_a_sample_of_its_elements(custom_ops):
    softplus = custom_ops("softplus_flipped_large", **softplus_rules(vjp_sign=-1.0))
    with pytest.raises(AssertionError, match=r"at index \(\d+, \d+\) \(worst of 512 sampled elements of 2000\): "
                                             r"autodiff gives (\S+), central differences"):
        check_grads(softplus, [np.random.default_rng(4).standard_normal((40, 50))])


def test_check_op_passes_a_right_custom_op_and_catches_a_wrong_kernel(custom_ops):
    custom_ops("softplus_checked", **softplus_rules())
    result = check_op("softplus_checked", [X.astype(np.float32)])
    assert result.hvp is not None                       # second order by default
    executors.register_kernel("softplus_checked", lambda x: np.logaddexp(0, x))
    check_op("softplus_checked", [X.astype(np.float32)])
    custom_ops("softplus_bad_native", **softplus_rules())
    executors.register_kernel("softplus_bad_native", lambda x: np.logaddexp(0, x) * 1.001, executor="native")
    if "native" in usable_executors():
        with pytest.raises(AssertionError, match="check_op: the native kernel of op 'softplus_bad_native' "
                                                 "disagrees with the op's decomposition"):
            check_op("softplus_bad_native", [X])


@pytest.mark.parametrize("op_name", sorted(n for n, op in REGISTRY.items() if op.decompose is not None
                                           and n not in CUSTOM_OPS))
def test_check_op_passes_every_fused_op_of_the_table(op_name):
    """Each graphlm op with a decomposition, at its first node in the op table's graphs, on that
    node's input values: gradients, kernels against the decomposition, executors."""
    for case, k, arrays in op_table():
        g, _, _ = build(case.f, arrays)
        node = next((n for n in g.nodes if n.op == op_name), None)
        if node is not None:
            values = run_reading(g, list(node.inputs), feeds_of(arrays))
            check_op(op_name, values, node.attrs, order=1)
            return
    raise AssertionError(f"no row of the op table uses {op_name}")


@pytest.mark.parametrize("variant", [{}, dict(norm="rmsnorm", mlp="swiglu", tie_weights=True)])
def test_check_grads_checks_a_float32_gpt_on_the_float64_copy_of_its_graph(variant):
    """The model is declared and initialised in float32; every parameter's gradient is checked
    in float64 without a second float64 model."""
    model = GPT(GPTConfig(vocab_size=6, context_length=4, channels=8, head_count=2, layer_count=1, **variant))
    params = model.init(seed=4)
    assert all(v.dtype == np.float32 for v in params.values())
    tokens, targets = np.array([[0, 1, 2, 5]]), np.array([[1, 2, 3, 4]])
    result = check_grads(model.loss, [tokens, targets], params=params)
    assert len(result.checks) == len(params) and result.output.dtype == np.float64
