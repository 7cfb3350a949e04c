"""The numpy executor's performance kernels (issue 7) against the reference executor and
graphlm.random: dropout masks drawn once per run and shared with the backward, ..."""
from __future__ import annotations

import numpy as np
import pytest

import executors
import graphlm as gl
from executors import numpy_executor
from graphlm.random import counter_uniform
from tests.gradcheck import assert_close

NUMPY = executors.get("numpy")
REF = executors.get("reference")


def run_both(g, outputs, feeds, state=None):
    got = NUMPY.compile(g, outputs, poison=True).run(feeds, state)
    want = REF.compile(g, outputs).run(feeds, state)
    return got, want


# -- dropout -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,p,key,stream", [
    ((8, 128, 192), 0.1, 12345, 3),                       # several chunks
    ((3, 5), 0.5, 2 ** 62 + 7, 0),                        # smaller than a chunk, big key
    ((numpy_executor._MASK_CHUNK + 1,), 0.999, 1, 9),     # a one-element last chunk
    ((7,), 0.0, 5, 1),                                    # p = 0 keeps everything
])
def test_keep_mask_drawer_is_counter_uniform_exactly(shape, p, key, stream):
    mask = np.empty(shape, bool)
    numpy_executor.keep_mask_drawer(shape, stream, p)(key, mask)
    np.testing.assert_array_equal(mask, counter_uniform(key, stream, shape) >= np.float32(p))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dropout_forward_and_backward_share_one_mask_and_match_reference(dtype):
    g = gl.Graph("drop")
    x = g.input("x", (4, 33), dtype)
    key = g.input("key", (), "int64")
    h = gl.tanh(x)
    y = gl.dropout(h, 0.3, key, stream=5) * 2.0 + gl.dropout(h, 0.3, key, stream=6)
    loss = gl.sum(y * y)
    dx = gl.grad(loss, [x])[0]
    prog = NUMPY.compile(g, [y, dx])
    shared = [n for n in prog.run_nodes if n.op == "dropout_shared"]
    assert len(shared) == 4 and sum(n.attrs["draw"] for n in shared) == 2   # two streams, two draws
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((4, 33)).astype(dtype)
    xv[0, :3] = [np.inf, -np.inf, np.nan]
    for k in (3, 4, 3):    # a new key draws a new mask; the same key the same one
        feeds = {"x": xv, "key": np.asarray(k, np.int64)}
        got, want = run_both(g, [y, dx], feeds)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


# -- GELU: the backward reads the forward's tanh -------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_backward_reuses_the_forward_tanh_float32_only(dtype):
    g = gl.Graph("gelu")
    x = g.input("x", (6, 50), dtype)
    w = g.param("w", (50, 50), dtype)
    h = x @ w
    y = gl.gelu(h)
    loss = gl.sum(y * y * 0.5)
    gx, gw = gl.grad(loss, [x, w])
    prog = NUMPY.compile(g, [y, gx, gw])
    ops = {n.op for n in prog.run_nodes}
    assert ("gelu_keep_tanh" in ops and "gelu_backward_tanh" in ops) == (dtype == "float32")
    rng = np.random.default_rng(1)
    xv = (rng.standard_normal((6, 50)) * 3).astype(dtype)
    state = {"w": rng.standard_normal((50, 50)).astype(dtype) * 0.3}
    for scale in (1.0, 0.5):   # a second run with other data uses that run's tanh
        got, want = run_both(g, [y, gx, gw], {"x": xv * scale}, state)
        for a, b in zip(got, want):   # the same arithmetic in the same order: bit for bit
            np.testing.assert_array_equal(a, b)
