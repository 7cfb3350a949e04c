"""The jax executor against the reference executor (the oracle), and its run-time contract.

- every op case of tests/test_ops.py, forward and gradients, in float64 and float32 (each row's
  inputs and both dtypes in one graph: one XLA compile per row);
- seeded random DAGs; a GPT training step (dropout, loss, backward, clipping, AdamW) for several
  steps against the numpy executor;
- dropout masks bit for bit graphlm.random's stream;
- state stays on the device and is donated, the caller's x64 setting is left alone;
- an op with only a decomposition runs with no JAX code; an op with neither is refused naming it;
- bad input gets the other executors' errors and leaves state alone.

Data parallel and multi-process runs are in tests/test_jax_parallel.py (they need subprocesses).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

# JAX comes with the test extra; CI (GRAPHLM_REQUIRE_JAX=1) fails instead of skipping without it
jax = __import__("jax") if os.environ.get("GRAPHLM_REQUIRE_JAX") else pytest.importorskip("jax")

import graphlm as gl
from graphlm import executors, optim
from graphlm.executors.base import ExecutionError
from graphlm.executors.jax_executor import JaxProgram
from graphlm.random import dropout_keep_scale
from graphlm.registry import REGISTRY, apply, register
from tests.gradcheck import assert_close, feeds_of
from tests.test_numpy_executor import BAD_FEEDS, feed_errors, gpt_step, random_dag, simple_graph
from tests.test_ops import CASES, inputs_of

JAX = executors.get("jax")
REF = executors.get("reference")
NUMPY = executors.get("numpy")
TOL = {d: (JaxProgram.tolerances[d], JaxProgram.tolerances[d] / 10) for d in ("float64", "float32")}


def compare(actual, expected, dtype, what):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert isinstance(a, np.ndarray), f"{what}[{i}] is {type(a).__name__}, not a NumPy array"
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}[{i}]: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
        if e.dtype.kind != "f":
            np.testing.assert_array_equal(a, e, err_msg=f"{what}[{i}]")
        else:
            assert_close(a, e, *TOL[str(e.dtype)], f"{what}[{i}]")


def _all_inputs_both_dtypes(case):
    """One graph holding the case on each of its inputs, in float64 and in float32 (one XLA
    compile for them all), with the gradients of each; inputs ``k.float64.x0, ...``."""
    g = gl.Graph(case.name)
    outputs, feeds, labels = [], {}, []
    for k, dtype in ((k, d) for k in range(len(case.inputs)) for d in ("float64", "float32")):
        arrays = [a.astype(dtype) if a.dtype.kind == "f" else a for a in inputs_of(case, k)]
        leaves = [g.input(f"{k}.{dtype}.x{i}", a.shape, a.dtype) for i, a in enumerate(arrays)]
        feeds.update({leaf.name: a for leaf, a in zip(leaves, arrays)})
        out = case.f(*leaves)
        outs = [out]
        floats = [x for x in leaves if x.dtype.kind == "f"]
        if (case.grad or case.fd) and floats and out.dtype.kind == "f":
            u = np.random.default_rng(7).standard_normal(out.shape).astype(out.dtype)
            outs += gl.grad(gl.sum(out * g.const(u)) if out.shape else out * g.const(u), floats)
        outputs += outs
        labels += [(k, dtype)] * len(outs)
    return g, outputs, feeds, labels


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_op_cases_match_reference_in_float64_and_float32(case):
    g, outputs, feeds, labels = _all_inputs_both_dtypes(case)
    got = JAX.compile(g, outputs).run(feeds)
    want = REF.compile(g, outputs).run(feeds)
    for i, (k, dtype) in enumerate(labels):
        compare(got[i:i + 1], want[i:i + 1], dtype, f"{case.name}-{k} output {i} ({dtype} graph)")


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_random_dags_match_reference(seed):
    dtype = "float64" if seed % 8 else "float32"
    g, outputs, feeds, state = random_dag(seed, dtype)
    want = REF.compile(g, outputs).run(feeds, state)
    compare(JAX.compile(g, outputs).run(feeds, dict(state)), want, dtype, f"dag {seed}")


# -- dropout: the same stream, bit for bit -------------------------------------------------------------

@pytest.mark.parametrize("key", [0, 1, 2**62 + 12345, 2**63 - 1, -7])
def test_dropout_masks_are_the_numpy_streams_bits(key):
    g = gl.Graph("masks")
    k = g.input("key", (), "int64")
    outs = [apply("dropout_mask", (k,), p=p, stream=s, shape=shape, dtype="<f4")
            for p, s, shape in ((0.1, 0, (7, 5)), (0.5, 3, (2, 3, 4)), (0.9, 2**31 + 5, (64,)))]
    got = JAX.compile(g, outs).run({"key": np.asarray(key, np.int64)})
    for out, (p, s, shape) in zip(got, ((0.1, 0, (7, 5)), (0.5, 3, (2, 3, 4)), (0.9, 2**31 + 5, (64,)))):
        want = dropout_keep_scale(key, s, shape, p, np.float32)
        assert out.tobytes() == want.tobytes(), f"key {key} stream {s}"


# -- a GPT training step, several steps, against numpy -----------------------------------------------------

def test_gpt_training_steps_with_dropout_match_numpy():
    from graphlm.models import GPT, GPTConfig
    from graphlm.nn import DROPOUT_KEY
    from graphlm.train import dropout_key

    cfg = GPTConfig(vocab_size=13, context_length=8, channels=16, head_count=2, layer_count=2,
                    dropout=0.2, attention_bias=False)
    model = GPT(cfg)
    model.train()
    g, loss = model.loss_graph(4, name="gpt_train")
    opt = optim.AdamW(lr=optim.WarmupCosine(3e-2, 2, 6), clip_norm=0.5)
    step = opt.minimize(loss)
    outputs = [loss, step.grad_norm, step.update]
    assert DROPOUT_KEY in g.inputs
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 13, (4, 8)), "targets": rng.integers(0, 13, (4, 8))}
               for _ in range(5)]
    runs = {}
    for name, ex in (("numpy", NUMPY), ("jax", JAX)):
        state = {**model.init(1), **opt.init_state()}
        prog = ex.compile(g, outputs)
        trace = [prog.run({**b, **opt.feeds(s), DROPOUT_KEY: dropout_key(3, s)}, state)[:2]
                 for s, b in enumerate(batches)]
        runs[name] = (trace, state)
    (t1, s1), (t2, s2) = runs["numpy"], runs["jax"]
    for s, ((l1, n1), (l2, n2)) in enumerate(zip(t1, t2)):
        assert_close(l2, l1, 1e-5, 1e-6, f"loss of step {s}")
        assert_close(n2, n1, 1e-4, 1e-6, f"grad norm of step {s}")
    assert t2[-1][0] < t2[0][0]
    assert all(isinstance(v, jax.Array) for v in s2.values())
    for k in s1:
        assert_close(np.asarray(s2[k]), s1[k], 1e-4, 1e-5, k)


@pytest.mark.parametrize("optimizer", ["SGD", "SGD-momentum"])
def test_sgd_updates_match_the_reference(optimizer):
    g, outputs, feeds, params, _ = gpt_step(2)
    opt = optim.SGD(lr=0.1, momentum=0.9 if "momentum" in optimizer else 0.0, weight_decay=0.01)
    step = opt.minimize(outputs[0])
    results = []
    for ex in (REF, JAX):
        state = {**{k: v.copy() for k, v in params.items()}, **opt.init_state(params)}
        prog = ex.compile(g, [outputs[0], step.update])
        results.append(([prog.run({**feeds, **opt.feeds(s)}, state)[0] for s in range(3)], state))
    (l1, s1), (l2, s2) = results
    for a, b in zip(l2, l1):
        assert_close(a, b, 1e-5, 1e-6, "loss")
    for k in s1:
        assert_close(np.asarray(s2[k]), s1[k], 1e-5, 1e-6, k)


# -- state on the device, donation, dtypes --------------------------------------------------------------

def _sgd_graph(dtype="float32"):
    g = gl.Graph("sgd")
    x = g.input("x", (4, 3), dtype)
    w = g.param("w", (3, 2), dtype)
    loss = gl.mean(gl.square(gl.tanh(x @ w)))
    step = optim.SGD(lr=0.5, weight_decay=0.0).minimize(loss)
    return g, [loss, step.update]


def test_state_stays_on_the_device_and_written_state_is_donated():
    g, outs = _sgd_graph()
    prog = JAX.compile(g, outs)
    w0 = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    state = {"w": w0.copy()}
    feeds = {"x": np.ones((4, 3), np.float32), "optimizer.lr": np.float32(0.5)}
    ref_state = {"w": w0.copy()}
    ref = REF.compile(g, outs)
    for _ in range(3):
        first = state["w"]
        loss = prog.run(feeds, state)[0]
        assert isinstance(state["w"], jax.Array) and state["w"] is not first
        if isinstance(first, jax.Array):
            assert first.is_deleted()      # donated: the step wrote the new weights in its buffer
        assert_close(loss, ref.run(feeds, ref_state)[0], 1e-6, 1e-7, "loss")
    np.testing.assert_allclose(np.asarray(state["w"]), ref_state["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(w0, w0.copy())        # the caller's NumPy array is untouched
    with pytest.raises(ValueError, match="donated to an earlier run"):
        prog.run(feeds, {"w": first})
    on_device = prog.run(feeds, state, to_host=False)
    assert isinstance(on_device[0], jax.Array)


def test_float64_graphs_run_without_changing_the_callers_x64_setting():
    before = jax.config.jax_enable_x64
    g, outs = _sgd_graph("float64")
    prog = JAX.compile(g, outs)
    state = {"w": np.full((3, 2), 0.25)}
    (loss, _) = prog.run({"x": np.ones((4, 3)), "optimizer.lr": np.float32(0.5)}, state)
    assert loss.dtype == np.float64 and state["w"].dtype == np.float64
    assert jax.config.jax_enable_x64 == before
    assert jax.numpy.asarray(1.0).dtype == (np.float64 if before else np.float32)


# -- lowering: rules, decompositions, refusals ----------------------------------------------------------

def test_an_op_with_only_a_decomposition_runs_with_no_jax_code():
    name = "test_only_softplus"
    register(name, lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
             decompose=lambda x, beta: gl.log(gl.exp(x * beta) + 1.0) * (1.0 / beta))
    name2 = "test_only_softplus_twice"      # decomposes into the op above: lowered recursively
    register(name2, lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
             decompose=lambda x: apply(name, (apply(name, (x,), beta=2.0),), beta=0.5))
    try:
        g = gl.Graph("softplus")
        x = g.input("x", (3, 4), "float64")
        outs = [apply(name2, (gl.tanh(x),))]
        data = np.random.default_rng(0).standard_normal((3, 4))
        (got,) = JAX.compile(g, outs).run({"x": data})
        sp = lambda v, b: np.log1p(np.exp(v * b)) / b
        np.testing.assert_allclose(got, sp(sp(np.tanh(data), 2.0), 0.5), rtol=1e-13)
        from graphlm.executors.jax_executor import RULES
        assert name not in RULES and name2 not in RULES
    finally:
        del REGISTRY[name], REGISTRY[name2]


def test_an_op_with_no_rule_and_no_decomposition_is_refused_at_compile_naming_it():
    name, outer = "test_only_unlowerable", "test_only_decomposes_to_unlowerable"
    register(name, lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype))
    register(outer, lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
             decompose=lambda x: apply(name, (x,)))
    try:
        g = gl.Graph("nolowering")
        x = g.input("x", (3,))
        with pytest.raises(NotImplementedError, match=f"jax executor has no kernel for op '{name}'"):
            JAX.compile(g, [gl.tanh(apply(name, (x,)))])
        with pytest.raises(NotImplementedError, match=f"jax executor has no kernel for op '{name}'"):
            JAX.compile(g, [apply(outer, (x,))])
    finally:
        del REGISTRY[name], REGISTRY[outer]


# -- bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("feeds", BAD_FEEDS)
def test_feed_errors_match_the_reference(feeds):
    got, want = feed_errors(JAX, feeds)
    assert got == want


def test_state_errors_name_the_entry():
    g, outs = simple_graph()
    prog = JAX.compile(g, outs)
    x = {"x": np.zeros((2, 3), np.float32)}
    with pytest.raises(ValueError, match="missing state for param 'w'"):
        prog.run(x, {})
    with pytest.raises(ValueError, match=r"state for param 'w': expected \[3,4\] float32, got \[4,3\]"):
        prog.run(x, {"w": jax.numpy.zeros((4, 3), np.float32)})


def test_bad_ids_fail_like_the_reference_and_leave_state_alone():
    g, outputs, feeds, params, _ = gpt_step(2)
    opt = optim.AdamW(lr=1e-2)
    step = opt.minimize(outputs[0])
    prog = JAX.compile(g, [outputs[0], step.update])
    state = {**params, **opt.init_state(params)}
    prog.run({**feeds, **opt.feeds(0)}, state)
    before = {k: np.asarray(v).copy() for k, v in state.items()}
    for bad_name, value, message in (("tokens", 11, "token id 11 is out of range"),
                                     ("targets", -1, "target -1 is out of range")):
        bad = {**feeds, **opt.feeds(1), bad_name: feeds[bad_name].copy()}
        bad[bad_name][1, 3] = value
        with pytest.raises(ExecutionError, match=message) as err:
            prog.run(bad, state)
        with pytest.raises(ExecutionError) as ref_err:
            REF.compile(g, [outputs[0]]).run({k: bad[k] for k in ("tokens", "targets")}, params)
        assert str(err.value) == str(ref_err.value)
    with pytest.raises(ExecutionError, match="step count must be >= 1, got 0"):
        prog.run({**feeds, **opt.feeds(-1)}, state)
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])


def test_registered_by_name_and_entry_point():
    from graphlm.backends import available_executors
    from graphlm.executors.jax_executor import JaxExecutor

    assert "jax" in available_executors()
    assert isinstance(executors.get("jax"), JaxExecutor)
