"""dropout: a counter-based mask keyed by (key, stream), the same in forward and backward."""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm.ir import ShapeError
from graphlm.random import counter_uniform
from graphlm.testing import run
from tests.gradcheck import check_torch

SHAPE = (64, 96)


def dropout_graph(p=0.25, stream=None, dtype="float32", shape=SHAPE):
    g = gl.Graph()
    x = g.input("x", shape, dtype)
    key = g.input("key", (), "int64")
    u = g.input("u", shape, dtype)
    y = gl.dropout(x, p, key, stream=stream)
    (dx,) = gl.grad(gl.sum(y * u), [x])
    return g, x, key, y, dx


def feeds(key, dtype="float32", shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.uniform(0.5, 1.5, shape).astype(dtype), "key": np.array(key, np.int64),
            "u": rng.uniform(0.5, 1.5, shape).astype(dtype)}


def test_mask_is_the_same_in_forward_and_backward_and_scales_by_one_over_keep():
    p = 0.25
    g, x, key, y, dx = dropout_graph(p)
    f = feeds(7)
    yv, dxv = run(g, [y, dx], f)
    kept = yv != 0
    np.testing.assert_array_equal(dxv != 0, kept)
    scale = np.float32(1 / (1 - p))
    np.testing.assert_array_equal(yv[kept], f["x"][kept] * scale)
    np.testing.assert_array_equal(dxv[kept], f["u"][kept] * scale)
    assert yv.dtype == dxv.dtype == np.float32
    # the mask is the documented counter-based draw: keep where uniform(key, stream, i) >= p
    np.testing.assert_array_equal(kept, counter_uniform(7, y.attrs["stream"], SHAPE) >= np.float32(p))


def test_keep_fraction_is_one_minus_p():
    for p in (0.1, 0.5, 0.9):
        g, _, _, y, _ = dropout_graph(p)
        (yv,) = run(g, [y], {k: v for k, v in feeds(11).items() if k != "u"})
        n = yv.size
        frac = np.count_nonzero(yv) / n
        assert abs(frac - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n), (p, frac)


def mask(key, stream, p=0.25, dtype="float32"):
    g = gl.Graph()
    x = g.input("x", SHAPE, dtype)
    k = g.input("key", (), "int64")
    y = gl.dropout(x, p, k, stream=stream)
    return run(g, [y], {"x": np.ones(SHAPE, dtype), "key": np.array(key, np.int64)})[0]


def test_same_key_and_stream_give_the_same_mask_and_different_ones_differ():
    a = mask(3, 0)
    np.testing.assert_array_equal(a, mask(3, 0))                    # a second graph, same draw
    assert (a != mask(4, 0)).mean() > 0.2                            # another key
    assert (a != mask(3, 1)).mean() > 0.2                            # another stream
    assert (mask(3, 0, dtype="float64") != 0).tolist() == (a != 0).tolist()  # the mask ignores dtype


def test_dropouts_of_one_graph_get_different_streams_by_default():
    g = gl.Graph()
    x = g.input("x", SHAPE)
    key = g.input("key", (), "int64")
    a, b = gl.dropout(x, 0.5, key), gl.dropout(x, 0.5, key)
    assert a.attrs["stream"] != b.attrs["stream"]
    av, bv = run(g, [a, b], {"x": np.ones(SHAPE, np.float32), "key": np.array(5, np.int64)})
    assert (av != bv).mean() > 0.2


def test_p_zero_is_the_identity_and_bad_p_or_key_are_errors():
    g = gl.Graph()
    x = g.input("x", (3,))
    key = g.input("key", (), "int64")
    assert gl.dropout(x, 0.0, key) is x
    with pytest.raises(ShapeError, match=r"probability must be in \[0, 1\), got -0.1"):
        gl.dropout(x, -0.1, key)
    with pytest.raises(ShapeError, match="dropout key must be an integer tensor, got float32"):
        gl.dropout(x, 0.5, g.input("fkey", ()))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_torch_with_the_mask_graphlm_drew(dtype, torch):
    """torch's RNG differs, so torch multiplies by the mask graphlm produced (dropout of ones)."""
    m = mask(9, 2, p=0.3, dtype=dtype)
    x = np.random.default_rng(0).standard_normal(SHAPE)
    key = np.array(9, np.int64)
    check_torch(lambda x, k: gl.dropout(x, 0.3, k, stream=2), lambda x, k: x * torch.from_numpy(m),
                [x, key], dtype)
