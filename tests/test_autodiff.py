"""The differentiation pass: what `graphlm.grad` builds, and second-order gradients.

Second order: grad of a gradient (a Hessian-vector product) against central differences of the
first gradient and against torch's double backward (create_graph=True).
"""
from __future__ import annotations

import numpy as np
import pytest

import graphlm as gl
from graphlm.ir import GraphError
from graphlm.testing import assert_close, check_grads, run
from tests.gradcheck import torch_hvp

try:
    import torch
    import torch.nn.functional as TF
except ImportError:  # pragma: no cover
    torch = TF = None


def normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def ids(hi, *shape, seed=0):
    return np.random.default_rng(seed).integers(0, hi, shape)


# ------------------------------------------------------------------------------------------------
# second order
# ------------------------------------------------------------------------------------------------

SECOND_ORDER = [
    ("tanh", gl.tanh, lambda x: torch.tanh(x), [normal(3, 4)]),
    ("mul", gl.mul, lambda a, b: a * b, [normal(3, 4), normal(4, seed=1)]),
    ("mul_self", lambda a: a * a * a, lambda a: a * a * a, [normal(2, 3)]),
    ("div", lambda a, b: a / b, lambda a, b: a / b, [normal(3, 4), normal(3, 4, seed=1) + 4.0]),
    ("matmul", gl.matmul, lambda a, b: a @ b, [normal(2, 3), normal(3, 4, seed=1)]),
    ("matmul_batched", gl.matmul, lambda a, b: a @ b, [normal(2, 2, 3), normal(3, 4, seed=1)]),
    ("softmax", gl.softmax, lambda x: torch.softmax(x, -1), [normal(3, 5)]),
    ("log_softmax", gl.log_softmax, lambda x: torch.log_softmax(x, -1), [normal(3, 5)]),
    ("layer_norm", gl.layer_norm, lambda x, w, b: TF.layer_norm(x, x.shape[-1:], w, b, eps=1e-5),
     [normal(3, 5), normal(5, seed=1), normal(5, seed=2)]),
    ("layer_norm_plain", gl.layer_norm, lambda x: TF.layer_norm(x, x.shape[-1:], eps=1e-5), [normal(2, 3, 4)]),
    ("rms_norm", gl.rms_norm, lambda x, w: TF.rms_norm(x, x.shape[-1:], w, eps=1e-6),
     [normal(3, 5), normal(5, seed=1)]),
    ("gelu_tanh", gl.gelu, lambda x: TF.gelu(x, approximate="tanh"), [normal(3, 4)]),
    ("gelu_erf", lambda x: gl.gelu(x, "none"), TF.gelu if TF else None, [normal(3, 4)]),
    ("silu", gl.silu, lambda x: TF.silu(x), [normal(3, 4)]),
    # the cotangent reaching gelu_backward / softmax_backward depends on their other input: their
    # VJP (through the decomposition) must take partial derivatives, not total ones
    ("gelu_squared", lambda x: gl.square(gl.gelu(x)), lambda x: TF.gelu(x, approximate="tanh") ** 2, [normal(3, 4)]),
    ("softmax_squared", lambda x: gl.square(gl.softmax(x)), lambda x: torch.softmax(x, -1) ** 2, [normal(3, 4)]),
    ("cross_entropy", gl.cross_entropy, lambda l, t: TF.cross_entropy(l, t), [normal(4, 5), ids(5, 4)]),
    ("max", lambda x: gl.max(x, -1) ** 3, lambda x: torch.amax(x, -1) ** 3, [normal(3, 4)]),
    ("embedding", lambda t, i: gl.square(gl.embedding(t, i)), lambda t, i: TF.embedding(i, t) ** 2,
     [normal(5, 3), ids(5, 2, 4)]),
    ("mlp", lambda x, w1, w2: gl.mean(gl.layer_norm(gl.gelu(x @ w1)) @ w2, axis=0),
     lambda x, w1, w2: (TF.layer_norm(TF.gelu(x @ w1, approximate="tanh"), (6,), eps=1e-5) @ w2).mean(0),
     [normal(4, 3), normal(3, 6, seed=1), normal(6, 2, seed=2)]),
]


@pytest.mark.parametrize("name,f,tf,arrays", SECOND_ORDER, ids=[c[0] for c in SECOND_ORDER])
def test_second_order_matches_central_differences_and_torch(name, f, tf, arrays):
    result = check_grads(f, arrays, order=2, rtol=1e-5, atol=1e-6)
    assert any(np.abs(h).max() > 1e-3 for h in result.hvp), "a vanishing Hessian checks nothing"
    if torch is None:
        pytest.skip("torch is not installed")
    for k, (got, expected) in enumerate(zip(result.hvp, torch_hvp(tf, arrays, result))):
        assert got.dtype == np.float64 and got.shape == expected.shape
        assert_close(got, expected, 1e-9, 1e-10, f"{name}: Hessian-vector product of x{k} vs torch")


def test_third_order_of_tanh():
    """grad of grad of grad: d3/dx3 tanh = 2(1-t^2)(3t^2-1)... checked elementwise."""
    g = gl.Graph()
    x = g.input("x", (5,), "float64")
    (d1,) = gl.grad(gl.sum(gl.tanh(x)), [x])
    (d2,) = gl.grad(gl.sum(d1), [x])
    (d3,) = gl.grad(gl.sum(d2), [x])
    xv = np.linspace(-2, 2, 5)
    v1, v2, v3 = run(g, [d1, d2, d3], {"x": xv})
    t = np.tanh(xv)
    assert_close(v1, 1 - t * t, 1e-12)
    assert_close(v2, -2 * t * (1 - t * t), 1e-12)
    assert_close(v3, (1 - t * t) * (6 * t * t - 2), 1e-12)


# ------------------------------------------------------------------------------------------------
# what grad builds
# ------------------------------------------------------------------------------------------------

def test_only_nodes_on_a_path_from_wrt_to_loss_are_differentiated():
    """An off-path branch (exp(y)) adds no backward nodes: the count equals the graph without it."""
    def backward_nodes(with_branch: bool):
        g = gl.Graph()
        x = g.input("x", (3, 4))
        y = g.input("y", (3, 4))
        side = gl.sum(gl.exp(y) * 3.0) if with_branch else g.input("s", ())
        loss = gl.sum(gl.tanh(x)) + side
        n = len(g.nodes)
        gl.grad(loss, [x])
        return g, g.nodes[n:], y

    g, new, y = backward_nodes(True)
    _, new_plain, _ = backward_nodes(False)
    assert len(new) == len(new_plain) > 0
    assert [n.op for n in new] == [n.op for n in new_plain]
    off_path = {n.id for n in g.nodes if n.op in ("exp",) or n is y}
    assert not any(i.id in off_path for n in new for i in n.inputs), "a backward node reads the off-path branch"


def test_fan_out_cotangents_are_summed():
    g = gl.Graph()
    x = g.input("x", (4,), "float64")
    y = gl.tanh(x)
    loss = gl.sum(y * y + y * 3.0 + gl.exp(y))    # y has four consumers
    (dx,) = gl.grad(loss, [x])
    xv = np.array([-1.0, -0.2, 0.3, 1.5])
    (got,) = run(g, [dx], {"x": xv})
    t = np.tanh(xv)
    assert_close(got, (2 * t + 3 + np.exp(t)) * (1 - t * t), 1e-12)


def test_broadcast_gradients_are_summed_back_to_the_input_shapes():
    g = gl.Graph()
    a = g.input("a", (3, 1), "float64")
    b = g.input("b", (4,), "float64")
    s = g.input("s", (), "float64")
    out = (a + b) * s
    w = np.arange(12.0).reshape(3, 4)
    da, db, ds = gl.grad(gl.sum(out * g.const(w)), [a, b, s])
    assert (da.shape, db.shape, ds.shape) == ((3, 1), (4,), ())
    av, bv, sv = np.array([[1.0], [2.0], [3.0]]), np.array([0.5, -1.0, 2.0, 0.0]), np.array(2.0)
    got = run(g, [da, db, ds], {"a": av, "b": bv, "s": sv})
    assert_close(got[0], (w * sv).sum(1, keepdims=True), 1e-12)
    assert_close(got[1], (w * sv).sum(0), 1e-12)
    assert_close(got[2], (w * (av + bv)).sum(), 1e-12)


def test_unreachable_wrt_gets_a_zero_gradient_of_its_shape_and_dtype():
    g = gl.Graph()
    x = g.input("x", (2, 3))
    z = g.param("z", (4, 5))
    loss = gl.sum(gl.tanh(x))
    dx, dz = gl.grad(loss, [x, z])
    assert dz.shape == (4, 5) and dz.dtype == np.float32 and dz.is_backward
    _, dz_value = run(g, [dx, dz], {"x": np.ones((2, 3), np.float32)}, {"z": np.ones((4, 5), np.float32)})
    assert dz_value.dtype == np.float32
    np.testing.assert_array_equal(dz_value, np.zeros((4, 5), np.float32))
    assert "zero gradient" in gl.grad.__doc__


def test_gradient_of_the_loss_itself_and_of_an_intermediate():
    g = gl.Graph()
    x = g.input("x", (3,), "float64")
    h = gl.tanh(x)
    loss = gl.sum(h * h)
    dloss, dh, dh_again = gl.grad(loss, [loss, h, h])
    xv = np.array([0.1, -0.5, 2.0])
    v = run(g, [dloss, dh, dh_again], {"x": xv})
    assert v[0] == 1.0
    assert_close(v[1], 2 * np.tanh(xv), 1e-12)
    assert_close(v[2], v[1], 0)


def test_float32_gradients_stay_float32():
    g = gl.Graph()
    x = g.input("x", (3, 4))
    w = g.param("w", (4, 2))
    loss = gl.mean(gl.layer_norm(gl.gelu(x @ w) * 2.0))
    grads = gl.grad(loss, [x, w])
    assert all(t.dtype == np.float32 for t in g.nodes if t.dtype.kind == "f"), \
        [t for t in g.nodes if t.dtype.kind == "f" and t.dtype != np.float32]
    vals = run(g, grads, {"x": np.ones((3, 4), np.float32)}, {"w": np.full((4, 2), 0.1, np.float32)})
    assert [v.dtype for v in vals] == [np.float32, np.float32]


def test_integer_wrt_is_an_error_naming_the_tensor():
    g = gl.Graph()
    table = g.param("table", (5, 3))
    tok = g.input("tokens", (4,), "int64")
    loss = gl.sum(gl.embedding(table, tok))
    with pytest.raises(GraphError, match=r"cannot differentiate with respect to tokens, an integer tensor \(int64 \[4\]\)"):
        gl.grad(loss, [table, tok])


def test_non_scalar_loss_is_an_error_naming_its_shape():
    g = gl.Graph()
    x = g.input("x", (2, 3))
    y = gl.tanh(x)
    with pytest.raises(GraphError, match=r"loss must be a scalar, got shape \[2,3\]") as err:
        gl.grad(y, [x])
    assert isinstance(err.value, ValueError)


def test_wrt_from_another_graph_is_an_error():
    g, h = gl.Graph("g"), gl.Graph("h")
    x = g.input("x", (2,))
    other = h.input("x", (2,))
    with pytest.raises(GraphError, match="not a tensor of the loss's graph 'g'"):
        gl.grad(gl.sum(x), [other])


def test_backward_nodes_are_flagged_and_scoped_under_their_forward_scope():
    g = gl.Graph()
    x = g.input("x", (2, 3))
    with g.scope("blocks"), g.scope("0"):
        with g.scope("mlp"):
            w = g.param("blocks.0.mlp.weight", (3, 4))
            h = gl.gelu(x @ w)
        with g.scope("norm"):
            y = gl.layer_norm(h)
    loss = gl.mean(y)
    n_forward = len(g.nodes)
    (dw,) = gl.grad(loss, [w])
    forward, backward = g.nodes[:n_forward], g.nodes[n_forward:]
    assert not any(n.is_backward for n in forward)
    assert backward and all(n.is_backward for n in backward)
    by_op = {}
    for n in backward:
        by_op.setdefault(n.op, set()).add(n.scope)
    assert by_op["gelu_backward"] == {"blocks.0.mlp"}
    assert by_op["layer_norm_backward"] == {"blocks.0.norm"}
    assert "blocks.0.mlp" in by_op["matmul"]
    assert {n.scope for n in backward} <= {"", "blocks.0.mlp", "blocks.0.norm"}
    assert dw.is_backward and dw.scope == "blocks.0.mlp"
    assert "backward" in repr(dw)


def test_to_networkx_carries_the_node_attributes_and_edges():
    g = gl.Graph("net")
    x = g.input("x", (2, 3))
    with g.scope("layer"):
        y = gl.tanh(x) * x
    gl.grad(gl.sum(y), [x])
    dg = g.to_networkx()
    assert dg.number_of_nodes() == len(g.nodes)
    assert dg.number_of_edges() == sum(len({i.id for i in n.inputs}) for n in g.nodes)
    for n in g.nodes:
        attrs = dg.nodes[n.id]
        assert (attrs["op"], attrs["shape"], attrs["dtype"], attrs["scope"], attrs["backward"]) == \
            (n.op, n.shape, str(n.dtype), n.scope, n.is_backward)
        for i in n.inputs:
            assert dg.has_edge(i.id, n.id)
    assert dg.nodes[y.id]["scope"] == "layer" and dg.nodes[y.id]["op"] == "mul"
    assert any(a["backward"] for _, a in dg.nodes(data=True))


def test_vjp_with_explicit_cotangents_pulls_back_several_outputs():
    g = gl.Graph()
    x = g.input("x", (3,), "float64")
    a, b = gl.exp(x), x * 2.0
    ca = g.input("ca", (3,), "float64")
    cb = g.input("cb", (3,), "float64")
    (dx,) = gl.vjp([a, b], [ca, cb], [x])
    xv, cav, cbv = np.array([0.0, 1.0, -1.0]), np.array([1.0, 2.0, 3.0]), np.array([-1.0, 0.5, 0.0])
    (got,) = run(g, [dx], {"x": xv, "ca": cav, "cb": cbv})
    assert_close(got, cav * np.exp(xv) + 2 * cbv, 1e-12)


def test_grad_leaves_no_dead_backward_nodes():
    """Cotangents nobody asked for (a const operand's, an unused input's) are not left behind:
    every backward node is an ancestor of some returned gradient."""
    g = gl.Graph()
    x = g.input("x", (3, 4))
    w = g.param("w", (4, 2))
    loss = gl.sum(gl.tanh(x @ w) * 0.5 + 2.0)
    (dw,) = gl.grad(loss, [w])
    live, stack = set(), [dw]
    while stack:
        n = stack.pop()
        if n.id not in live:
            live.add(n.id)
            stack.extend(n.inputs)
    dead = [n for n in g.nodes if n.is_backward and n.id not in live]
    assert dead == []
    assert [n.id for n in g.nodes] == list(range(len(g.nodes)))
    # the gradient of x (an input, not asked for) was never built: no matmul by w^T
    assert sum(1 for n in g.nodes if n.op == "matmul" and n.is_backward) == 1
