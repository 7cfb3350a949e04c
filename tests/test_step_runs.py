"""The native executor's runs of steps (executors/native/program.py, `StepRun`): consecutive C
kernels run by one call (team.c's gl_run_steps).

- a decode step's program is one run, and it gives the bits of its steps called one by one, on
  1 and 2 threads, batch 1 and 3; so does a fresh training step's program on 2 threads, whose
  products try their cuts at their first call (the run's table is built after it);
- the run's input checks come first: a position past the cache (which the positional
  embedding meets first) or a token id out of range is the op's one-line error, and neither the
  KV cache nor any output is written;
- a check that reads a computed value (not a fed input) cannot go first: that step runs alone;
- the embedding and cache_write kernels in C give the numpy executor's bits.
"""
from __future__ import annotations

import numpy as np
import pytest

import graphlm as gl
from graphlm import ops
from graphlm import executors
from graphlm.executors import numpy as numpy_executor
from graphlm.executors.base import ExecutionError
from graphlm.models import GPT, GPTConfig
from graphlm.sample import Generator

native = pytest.importorskip("graphlm.executors.native")
if not native.available():
    pytest.skip("no C compiler", allow_module_level=True)


@pytest.fixture(scope="module")
def model_and_params():
    config = GPTConfig(vocab_size=64, context_length=16, channels=32, head_count=2, layer_count=2, dropout=0.0)
    model = GPT(config)
    return model, model.init(7)


def decode_program(model, params, batch):
    gen = Generator(model, params, batch_size=batch, executor="native")
    gen.prefill(np.random.default_rng(batch).integers(0, 64, (batch, 5)))
    return gen, gen._program(None)


def one_by_one(prog, feeds, state):
    """The program's results with its steps called one by one (no run of steps)."""
    runs = prog._run_steps
    prog._run_steps = prog._steps
    try:
        return prog.run(feeds, state)
    finally:
        prog._run_steps = runs


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_decode_step_is_one_run_with_the_bits_of_its_steps(model_and_params, batch, threads):
    model, params = model_and_params
    gen, prog = decode_program(model, params, batch)
    numpy_executor.set_threads(threads)
    feeds = {"tokens": np.arange(batch).reshape(batch, 1) + 3, "position": np.asarray(5, np.int64)}
    caches = {n: gen.state[n].copy() for n in gen.cache_names}
    prog.run(feeds, gen.state)   # (the first run on a thread count calls the steps one by one)
    for n in gen.cache_names:
        gen.state[n][...] = caches[n]
    runs = prog.step_runs(gen.state)
    assert len(runs) == 1 and [n.id for n in runs[0]] == [n.id for n in prog._step_nodes]
    assert {"embedding", "cache_write", "add", "cached_attention", "panel_matmul"} <= {n.op for n in runs[0]}
    together = prog.run(feeds, gen.state)
    written = {n: gen.state[n].copy() for n in gen.cache_names}
    for n in gen.cache_names:
        gen.state[n][...] = caches[n]
    alone = one_by_one(prog, feeds, gen.state)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(together, alone))
    assert all(written[n].tobytes() == gen.state[n].tobytes() for n in gen.cache_names)
    assert any(not np.array_equal(written[n], caches[n]) for n in gen.cache_names)   # (it wrote)


@pytest.mark.parametrize("feed, message", [({"position": 16}, r"positional_embedding.*16 is out of range \[0, 16\)"),
                                           ({"position": -1}, r"positional_embedding.*-1 is out of range"),
                                           ({"tokens": 64}, r"token_embedding.*token id 64 is out of range \[0, 64\)"),
                                           ({"tokens": -2}, "token id -2 is out of range")])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_runs_checks_come_first_and_nothing_is_written(model_and_params, feed, message, batch):
    model, params = model_and_params
    gen, prog = decode_program(model, params, batch)
    feeds = {"tokens": np.full((batch, 1), 4, np.int64), "position": np.asarray(5, np.int64)}
    name, value = next(iter(feed.items()))
    if name == "tokens":
        feeds["tokens"][-1, 0] = value
    else:
        feeds["position"] = np.asarray(value, np.int64)
    prog.run({"tokens": np.full((batch, 1), 4, np.int64), "position": np.asarray(5, np.int64)}, gen.state)
    before = {n: a.copy() for n, a in gen.state.items()}
    results = [r.copy() for r in prog._results]
    with pytest.raises(ExecutionError, match=message) as err:
        prog.run(feeds, gen.state)
    assert "\n" not in str(err.value) and ("cache" in str(err.value) or "embedding" in str(err.value))
    assert all(before[n].tobytes() == gen.state[n].tobytes() for n in before)
    assert all(a.tobytes() == r.tobytes() for a, r in zip(results, prog._results))


def test_a_check_of_a_computed_value_does_not_go_first():
    """An embedding whose ids are computed in the program (not fed) runs alone, its check at its
    own turn; the C steps before and after it still form runs."""
    g = gl.Graph("computed ids")
    x = g.input("x", (4, 8), np.float32)
    ids = g.input("ids", (4,), np.int64)
    table = g.param("table", (10, 8), np.float32)
    y = gl.gelu(x * 2.0 + 1.0, approximate="tanh")
    e = gl.embedding(table, ids + 1)   # ids + 1: computed, not fed
    out = gl.gelu(y + e, approximate="tanh") * 3.0
    prog = executors.get("native").compile(g, [out])
    rng = np.random.default_rng(0)
    params = {"table": rng.standard_normal((10, 8)).astype(np.float32)}
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "ids": np.array([0, 3, 8, 2])}
    runs = prog.step_runs(params)
    assert runs and all("embedding" not in {n.op for n in run} for run in runs)
    assert any(n.op == "embedding" for n in prog._step_nodes)
    want = executors.get("numpy").compile(g, [out]).run(feeds, params)[0]
    got = prog.run(feeds, params)[0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ExecutionError, match="token id 10 is out of range"):
        prog.run({**feeds, "ids": np.array([0, 9, 1, 1])}, params)


@pytest.mark.parametrize("batch, length", [(4, 1), (1, 3)])   # a decode step's write, a prefill's
def test_embedding_and_cache_write_in_c_give_the_numpy_executors_bits(batch, length):
    g = gl.Graph("gather and write")
    ids = g.input("ids", (batch, length), np.int64)
    pos = g.input("pos", (), np.int64)
    table = g.param("table", (20, 12), np.float32)
    cache = g.state("cache", (batch, 2, 9, 6), np.float32)
    rows = gl.embedding(table, ids)                                               # [batch, length, 12]
    value = gl.transpose(gl.reshape(rows, (batch, length, 2, 6)), (0, 2, 1, 3))   # heads: a strided view
    write = ops.cache_write(cache, value, pos, axis=2)
    rng = np.random.default_rng(batch)
    feeds = {"ids": rng.integers(0, 20, (batch, length)), "pos": np.asarray(4, np.int64)}
    weights, results = rng.standard_normal((20, 12)).astype(np.float32), {}
    for name in ("numpy", "native"):
        state = {"table": weights, "cache": np.zeros((batch, 2, 9, 6), np.float32)}
        prog = executors.get(name).compile(g, [rows, write])
        out = prog.run(feeds, state)
        results[name] = (out, state["cache"])
        if name == "native":
            assert {"embedding", "cache_write"} <= prog.native_ops()
    (a, ca), (b, cb) = results["numpy"], results["native"]
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b)) and ca.tobytes() == cb.tobytes()
    assert cb[:, :, 4:4 + length].all() and not cb[:, :, :4].any() and not cb[:, :, 4 + length:].any()


@pytest.mark.threads
def test_a_fresh_training_steps_first_runs_on_two_threads_give_the_bits_of_its_steps(monkeypatch):
    """A product's first call on n threads tries its cuts on its own output (BLAS pieces, the
    exactness probe), which only its turn may write: a run of steps builds its table only after
    its steps' first calls, so a fresh program's first two steps (one by one, then as runs) give
    the bits of the steps called one by one (the loss, the gradient norm and the updated
    weights). Building the tables before the first run had changed the first step's loss by 0.03."""
    from graphlm.models import GPT
    from graphlm.optim import AdamW
    config = GPTConfig.preset("tinylm")

    def first_step(runs: bool):
        model = GPT(config)
        g = gl.Graph("train")
        tokens, targets = (g.input(n, (1, config.context_length), np.int64) for n in ("tokens", "targets"))
        model.train()
        opt = AdamW(lr=1e-3, clip_norm=1.0)
        step = opt.minimize(model.loss(tokens, targets))
        prog = executors.get("native").compile(g, [step.loss, step.grad_norm, step.update])
        if not runs:
            monkeypatch.setattr(prog, "_sequenced", lambda steps, nodes: steps)
        state = {**model.init(0), **opt.init_state()}
        rng = np.random.default_rng(0)
        feeds = {"tokens": rng.integers(0, 256, (1, config.context_length)),
                 "targets": rng.integers(0, 256, (1, config.context_length)), **opt.feeds(0)}
        if "dropout_key" in g.inputs:
            feeds["dropout_key"] = np.asarray(11, np.int64)
        numpy_executor.set_threads(2)
        out = [prog.run(feeds, state), prog.run({**feeds, **opt.feeds(1)}, state)]   # (the second as a run)
        return out, state, prog
    (got, state, prog), (want, state_alone, _) = first_step(True), first_step(False)
    assert any(len(run) > 5 for run in prog.step_runs())
    for step in (0, 1):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got[step], want[step])), step
    assert all(state[n].tobytes() == state_alone[n].tobytes() for n in state)
