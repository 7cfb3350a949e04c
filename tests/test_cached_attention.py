"""cached_attention, a decode step's attention against the KV cache (graphlm/ops.py), and its kernels.

- every executor against the reference kernel (and the reference against the op's
  decomposition, bit for bit) on random caches at positions 0, mid and T-1, batch 1 and 8;
- the numpy and native kernels read only the cache slots in use: NaN in the slots at and past the
  position changes nothing;
- the native kernel gives a row the bits it gives that row alone (batch 8 against batch 1), on 1
  and 2 threads;
- a position outside [0, T) is an error naming the op; bad shapes are errors naming the op and
  the shapes;
- a decode step's graph is one cached_attention node per layer.
(Its gradient, through the decomposition, is checked against central differences and PyTorch in
tests/test_ops.py's table; the decode's logits against the full forward in tests/test_sample.py.)
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors
from graphlm.executors import numpy as numpy_executor
from graphlm.executors.base import ExecutionError
from graphlm.executors import native
from graphlm.models import GPT, GPTConfig
from graphlm.rewrite import expand_decompositions
from graphlm.sample import build_graph

H, T, D = 3, 12, 8
KERNEL_EXECUTORS = ["numpy", "native"]


def step_graph(batch, t=T):
    """A graph with one cached_attention node on inputs q, k, v, cache_k, cache_v, position."""
    g = gl.Graph("decode attention")
    q, k, v = (g.input(n, (batch, H, 1, D), np.float32) for n in "qkv")
    cache_k, cache_v = (g.input(n, (batch, H, t, D), np.float32) for n in ("cache_k", "cache_v"))
    return g, gl.cached_attention(q, k, v, cache_k, cache_v, g.input("position", (), np.int64))


def step_feeds(batch, position, seed=0, t=T):
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal((batch, H, 1, D)).astype(np.float32) for n in "qkv"}
    feeds.update({n: (2 * rng.standard_normal((batch, H, t, D))).astype(np.float32) for n in ("cache_k", "cache_v")})
    feeds["position"] = np.asarray(position, np.int64)
    return feeds


def terms_magnitude(feeds):
    """sum_j p_j |v_j| in float64 (the scale of the rounding of a weighted sum whose terms may
    cancel), with p the softmax over the slots < position and the token's own key."""
    f = {n: a.astype(np.float64) for n, a in feeds.items() if n != "position"}
    p = int(feeds["position"])
    keys = np.concatenate([f["cache_k"][..., :p, :], f["k"]], -2)
    values = np.concatenate([f["cache_v"][..., :p, :], f["v"]], -2)
    s = f["q"] @ np.swapaxes(keys, -1, -2) / np.sqrt(D)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ np.abs(values)


def run(executor, batch, feeds, t=T):
    g, y = step_graph(batch, t)
    prog = executors.get(executor).compile(g, [y])
    return prog.run(feeds)[0], prog


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("position", [0, T // 2, T - 1])
def test_reference_kernel_is_its_decomposition_bit_for_bit(batch, position):
    g, y = step_graph(batch)
    (decomposed,), _ = expand_decompositions([y], lambda op: op != "cached_attention")
    assert "cached_attention" not in {n.op for n in decomposed.graph.nodes}
    ref = executors.get("reference")
    feeds = step_feeds(batch, position)
    got = ref.compile(g, [y]).run(feeds)[0]
    assert got.tobytes() == ref.compile(decomposed.graph, [decomposed]).run(feeds)[0].tobytes()


@pytest.mark.parametrize("executor", KERNEL_EXECUTORS)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("position", [0, T // 2, T - 1])
def test_kernels_match_the_reference(executor, batch, position, request):
    if executor == "native":
        request.getfixturevalue("native")
    feeds = step_feeds(batch, position, seed=position)
    want, _ = run("reference", batch, feeds)
    got, prog = run(executor, batch, feeds)
    assert np.all(np.abs(got - want) <= 2e-6 * terms_magnitude(feeds)), np.max(np.abs(got - want))
    if executor == "native":
        assert "cached_attention" in prog.native_ops()
    if position == 0:   # nothing cached yet: the token's own value, exactly
        assert np.array_equal(got, feeds["v"])


@pytest.mark.parametrize("executor", KERNEL_EXECUTORS)
def test_kernels_read_only_the_cache_slots_in_use(executor, request):
    """NaN in the slots at and past the position (the one this step's cache_write fills, the
    unused ones) reaches no output: the kernels never read them. The decomposition reads them."""
    if executor == "native":
        request.getfixturevalue("native")
    position = 5
    feeds = step_feeds(8, position, seed=3)
    clean, _ = run(executor, 8, feeds)
    for name in ("cache_k", "cache_v"):
        feeds[name][..., position:, :] = np.nan
    dirty, _ = run(executor, 8, feeds)
    assert dirty.tobytes() == clean.tobytes()
    assert np.all(np.isnan(run("reference", 8, feeds)[0]))


@pytest.mark.threads
@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("threads", [1, 2])
def test_native_row_bits_do_not_depend_on_the_batch_or_the_threads(monkeypatch, threads):
    monkeypatch.setattr(native.attention, "TEAM_MIN_FLOPS", 1)   # split even this small step over the team
    numpy_executor.set_threads(threads)
    feeds = step_feeds(8, 9, seed=4)
    batch, _ = run("native", 8, feeds)
    for i in range(8):
        row = {n: (a[i:i + 1] if a.ndim else a) for n, a in feeds.items()}
        numpy_executor.set_threads(1)
        alone, _ = run("native", 1, row)
        numpy_executor.set_threads(threads)
        assert alone.tobytes() == batch[i:i + 1].tobytes(), i


@pytest.mark.threads
@pytest.mark.usefixtures("native")
def test_a_batch1_decode_steps_attention_runs_on_both_threads():
    """TinyLM's batch-1 step (6 heads, 128 cache slots of 32) has TEAM_MIN_FLOPS of work at a
    full cache: on 2 threads its rows go to the team (3 each), with the bits of 1 thread."""
    from graphlm.sample import Generator
    model = GPT(GPTConfig.preset("tinylm", dropout=0.0))
    params = model.init(seed=0)
    logits = {}
    for threads in (1, 2):
        numpy_executor.set_threads(threads)
        gen = Generator(model, params, executor="native")
        gen.prefill(np.array([[5, 6, 7]]))
        logits[threads] = gen.decode(np.array([8]))
        prog = gen._program(None)
        attention = [s for n, s in zip(prog._step_nodes, prog._steps) if n.op == "cached_attention"]
        split = [s.arrays[-1].tables.get(threads) for s in attention]
        assert len(attention) == 4 and all((t is not None) == (threads == 2) for t in split)
    assert logits[1].tobytes() == logits[2].tobytes()


@pytest.mark.parametrize("executor", ["reference"] + KERNEL_EXECUTORS)
@pytest.mark.parametrize("position", [-1, T, T + 100])
def test_a_position_outside_the_cache_is_an_error_naming_the_op(executor, position, request):
    if executor == "native":
        request.getfixturevalue("native")
    with pytest.raises(ExecutionError, match=rf"cached_attention.*position {position} is outside the "
                                             rf"cache's {T} positions"):
        run(executor, 2, step_feeds(2, position))


def test_bad_shapes_are_errors_naming_the_op_and_the_shapes():
    g = gl.Graph("bad")
    q1 = g.input("q1", (2, H, 1, D), np.float32)
    q2 = g.input("q2", (2, H, 2, D), np.float32)
    cache = g.input("cache", (2, H, T, D), np.float32)
    other = g.input("other", (2, H, T, D + 1), np.float32)
    position = g.input("position", (), np.int64)
    with pytest.raises(gl.ShapeError, match=r"cached_attention.*\[2,3,2,8\]"):
        gl.cached_attention(q2, q2, q2, cache, cache, position)
    with pytest.raises(gl.ShapeError, match=r"cached_attention.*cache_v \[2,3,12,9\]"):
        gl.cached_attention(q1, q1, q1, cache, other, position)
    with pytest.raises(gl.ShapeError, match=r"cached_attention.*position must be a scalar integer"):
        gl.cached_attention(q1, q1, q1, cache, cache, g.input("p2", (2,), np.int64))
    with pytest.raises(gl.ShapeError, match=r"cached_attention.*position must be a scalar integer"):
        gl.cached_attention(q1, q1, q1, cache, cache, g.input("pf", (), np.float32))


def test_a_decode_step_is_one_cached_attention_per_layer():
    config = GPTConfig(vocab_size=32, context_length=16, channels=16, head_count=2, layer_count=3, dropout=0.0)
    g, logits, writes = build_graph(GPT(config), 4, None)
    ops = Counter(n.op for n in g.nodes)
    assert ops["cached_attention"] == 3 and ops["concat"] == 0 and ops["softmax"] == 0
    node = next(n for n in g.nodes if n.op == "cached_attention")
    assert node.shape == (4, 2, 1, 8) and node.inputs[3].op == "state" and node.inputs[5].name == "position"
