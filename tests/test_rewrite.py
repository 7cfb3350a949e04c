"""graphlm.rewrite.copy_graph: a copy keeps every node's op, name, scope, backward flag and
forward partner, re-infers shapes and dtypes, and changes dtypes at graph level."""
from __future__ import annotations

import numpy as np
import pytest

import graphlm as gl
from graphlm.rewrite import copy_graph, expand_decompositions
from graphlm.testing import run


def small_graph():
    g = gl.Graph("small")
    x = g.input("x", (2, 3))
    w = g.param("w", (3, 4))
    with g.scope("layer"):
        y = gl.gelu(x @ w) + 0.5
        h = gl.one_hot(g.input("ids", (2,), "int64"), 4)
    loss = gl.mean(gl.square(y * h))
    (dw,) = gl.grad(loss, [w])
    return g, [loss, dw]


def test_a_float64_copy_keeps_the_graph_and_changes_every_float32():
    g, outputs = small_graph()
    g64, new = copy_graph(outputs, dtypes={np.float32: np.float64})
    old_nodes = [n for n in g.nodes if n.id in new]
    assert len(g64.nodes) == len(old_nodes) and g64.name == "small"
    for n in old_nodes:
        m = new[n.id]
        assert (m.op, m.name, m.scope, m.is_backward, m.shape) == (n.op, n.name, n.scope, n.is_backward, n.shape)
        assert m.dtype == (np.float64 if n.dtype == np.float32 else n.dtype)
    assert new[g.params["w"].id].op == "param"
    assert {(new[b.id].id, new[f.id].id) for b, f in g.forward_partner.items() if b.id in new} == \
        {(b.id, f.id) for b, f in g64.forward_partner.items()}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3)), "ids": np.array([1, 3])}
    state = {"w": rng.standard_normal((3, 4))}
    got = run(g64, [new[o.id] for o in outputs], feeds, state)
    want = run(g, outputs, {"x": feeds["x"].astype(np.float32), "ids": feeds["ids"]},
               {"w": state["w"].astype(np.float32)})
    for a, b in zip(got, want):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_leaves_as_inputs_and_expansion():
    g, outputs = small_graph()
    g2, new = copy_graph(outputs, leaves_as_inputs=True)
    assert set(g2.inputs) == {"x", "w", "ids"} and not g2.params
    expanded, missing = expand_decompositions(outputs, lambda op: op != "gelu")
    assert not missing and expanded[0].graph is not g
    assert "gelu" not in {n.op for n in expanded[0].graph.nodes}
    same, _ = expand_decompositions(outputs, lambda op: True)
    assert same[0] is outputs[0]          # nothing to expand: no copy


def test_a_decomposition_of_the_wrong_shape_is_an_error_naming_the_op():
    gl.register_op("bad_decomposition", infer=lambda ins, a: (ins[0].shape, ins[0].dtype),
                   decompose=lambda x: gl.sum(x))
    try:
        g = gl.Graph()
        y = gl.apply("bad_decomposition", [g.input("x", (2,))])
        with pytest.raises(gl.GraphError, match=r"the decomposition of op 'bad_decomposition' \(bad_decomposition#1 "
                                                r"in <root>\) gave \[\] float32, but the op's shape rule says \[2\] float32"):
            copy_graph([y], expand=lambda n: n.op == "bad_decomposition")
    finally:
        gl.unregister_op("bad_decomposition")


def test_copies_are_passes_of_the_one_driver():
    """copy_graph's dtype change is a rule table the pass driver runs: the same graph either way;
    a copy with nothing to change is still a new graph (a caller may add nodes to it)."""
    from graphlm import passes
    from graphlm.rewrite import dtype_change
    g, outputs = small_graph()
    to64 = passes.Pass("to float64", dtype_change({np.float32: np.float64}),
                       dtypes=((np.dtype(np.float32), np.dtype(np.float64)),))
    rw = passes.rewrite(g, outputs, to64)
    g64, new = copy_graph(outputs, dtypes={np.float32: np.float64})
    assert [(n.op, n.name, n.shape, n.dtype, n.scope) for n in rw.graph.nodes] == \
        [(n.op, n.name, n.shape, n.dtype, n.scope) for n in g64.nodes]
    pairs = lambda graph: {(b.id, f.id) for b, f in graph.forward_partner.items()}
    assert pairs(rw.graph) == pairs(g64) and pairs(g64)
    same, new = copy_graph(outputs)
    assert same is not g and [n.op for n in same.nodes] == [n.op for n in g.nodes if n.id in new]
    with pytest.raises(gl.GraphError, match=r"pass to float64, rule leaves: replaced input x"):
        passes.rewrite(g, outputs, passes.Pass("to float64", to64.rules))   # the pass must declare its dtype change
