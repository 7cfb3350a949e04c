"""Graph passes (graphlm/passes): each rule on its own, the rewritten graph against the source
graph on the reference executor, the replacement map, the driver's checks and the pipelines."""
from __future__ import annotations

import re

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors, passes
from graphlm.ir import GraphError
from graphlm.passes.affine_grads import AFFINE_GRADS
from graphlm.passes.attention_softmax import ATTENTION_SOFTMAX
from graphlm.passes.bias_dropout_add import BIAS_DROPOUT_ADD
from graphlm.passes.bias_gelu import BIAS_GELU
from graphlm.passes.dropout_masks import DROPOUT_MASKS
from graphlm.passes.kept_values import KEPT_STATISTICS, KEPT_VALUES
from graphlm.passes.matmul_accumulate import MATMUL_ACCUMULATE
from graphlm.passes.matmul_sum import MATMUL_SUM
from graphlm.passes.merged_heads import MERGED_HEADS
from graphlm.passes.panel_weights import PANEL_WEIGHTS, panel_params
from graphlm.passes.residual_norm_backward import RESIDUAL_NORM_BACKWARD
from graphlm.passes.slice_gradients import SLICE_GRADIENTS
from graphlm.passes.transposed_weights import TRANSPOSED_WEIGHTS, transposed_params
from graphlm.testing import assert_close

REF = executors.get("reference")


def both(g, outputs, pass_, feeds, state=None):
    """(rewritten, values of the rewritten graph, values of the source graph), both on reference."""
    rw = passes.rewrite(g, outputs, pass_)
    got = REF.compile(rw.graph, rw.outputs).run(feeds, state)
    want = REF.compile(g, outputs).run(feeds, state)
    return rw, got, want


def ops_of(graph) -> list[str]:
    return [n.op for n in graph.nodes]


def test_matmul_sum_folds_a_batched_weight_gradient():
    g = gl.Graph("mm")
    x = g.input("x", (4, 5, 6), "float64")
    w = g.param("w", (6, 3), "float64")
    loss = gl.sum(gl.tanh(x @ w))
    (gw,) = gl.grad(loss, [w])
    rng = np.random.default_rng(0)
    feeds, state = {"x": rng.standard_normal((4, 5, 6))}, {"w": rng.standard_normal((6, 3))}
    rw, got, want = both(g, [loss, gw], MATMUL_SUM, feeds, state)
    assert ops_of(rw.graph).count("matmul_sum") == 1
    fold = next(n for n in rw.graph.nodes if n.op == "matmul_sum")
    assert fold.attrs["made_by"] == "matmul_sum" and rw.made_by(fold) == "matmul_sum"
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12)   # one product: rounds on its own
    assert got[0].tobytes() == want[0].tobytes()
    # the map: the sum now is the fold, the absorbed matmul points at it
    summed = next(n for n in g.nodes if n.op == "sum" and n.inputs[0].op == "matmul")
    assert rw.replaced[summed.id] is fold and rw.replaced[summed.inputs[0].id] is fold


def test_matmul_sum_is_left_alone_where_the_product_has_another_use_or_folds_only_by_copy():
    g = gl.Graph("mm2")
    x = g.input("x", (4, 5, 6))
    w = g.input("w", (4, 6, 3))
    p = x @ w
    kept = gl.sum(p, axis=0)
    assert "matmul_sum" not in ops_of(passes.rewrite(g, [kept, p], MATMUL_SUM).graph)   # p is an output
    # x @ w^T summed over the batch: w^T's layout folds only through a copy
    h = g.input("h", (4, 5, 3))
    gx = gl.sum(h @ gl.swapaxes(w, -1, -2), axis=0)
    assert "matmul_sum" not in ops_of(passes.rewrite(g, [gx], MATMUL_SUM).graph)


def test_matmul_accumulate_takes_the_qkv_input_gradient_that_matmul_sum_leaves():
    """x [1, N, C] @ w [3, C, C]: x's gradient sums g[j] @ w[j]^T over j, whose w^T folds only by a
    copy; after matmul_sum, the sum and its product are one matmul_accumulate node, the same bits."""
    g = gl.Graph("qkv")
    x = g.input("x", (1, 6, 4))
    w = g.param("w", (3, 4, 4))
    loss = gl.sum(gl.tanh(x @ w))
    (gx,) = gl.grad(loss, [x])
    rng = np.random.default_rng(0)
    feeds, state = {"x": rng.standard_normal((1, 6, 4)).astype(np.float32)}, {"w": rng.standard_normal((3, 4, 4)).astype(np.float32)}
    rw = passes.run_pipeline((MATMUL_SUM, MATMUL_ACCUMULATE), g, [loss, gx])
    assert ops_of(rw.graph).count("matmul_accumulate") == 1 and "matmul_sum" not in ops_of(rw.graph)
    acc = next(n for n in rw.graph.nodes if n.op == "matmul_accumulate")
    assert acc.shape == (1, 6, 4) and acc.attrs["made_by"] == "matmul_accumulate"
    got = REF.compile(rw.graph, rw.outputs).run(feeds, state)
    want = REF.compile(g, [loss, gx]).run(feeds, state)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))


def test_matmul_accumulate_is_left_alone_where_the_products_are_read_or_the_sum_is_another():
    g = gl.Graph("acc")
    a, b = g.input("a", (3, 5, 4)), g.input("b", (3, 4, 2))
    p = a @ b
    assert "matmul_accumulate" not in ops_of(passes.rewrite(g, [gl.sum(p, axis=0), p], MATMUL_ACCUMULATE).graph)
    for other in (gl.sum(a @ b, axis=1), gl.sum(a @ b), gl.sum(g.input("c", (2, 3, 5, 4)) @ b, axis=0)):
        assert "matmul_accumulate" not in ops_of(passes.rewrite(g, [other], MATMUL_ACCUMULATE).graph)
    d = g.input("d", (3, 5, 4), "float64")
    assert "matmul_accumulate" not in ops_of(passes.rewrite(g, [gl.sum(d @ gl.cast(b, "float64"), axis=0)],
                                                          MATMUL_ACCUMULATE).graph)


def test_matmul_accumulate_names_the_op_on_a_sum_it_does_not_make():
    g = gl.Graph("bad")
    a, b = g.input("a", (2, 3, 5, 4)), g.input("b", (4, 2))
    with pytest.raises(gl.ShapeError, match=r"matmul_accumulate.*sums the batch axis of a 3-D product"):
        gl.apply("matmul_accumulate", (a, b), axes=(0,), keepdims=False)
    with pytest.raises(gl.ShapeError, match=r"matmul_accumulate.*got axes \(1,\)"):
        gl.apply("matmul_accumulate", (a[0], b), axes=(1,), keepdims=False)


@pytest.mark.parametrize("parts", [(0, 1, 2), (0, 2)])
def test_slice_gradients_are_one_assemble_node_bit_for_bit(parts):
    g = gl.Graph("qkv")
    x = g.input("x", (3, 8, 12), "float64")
    heads = [gl.reshape(x[j], (2, 4, 12)) for j in parts]
    loss = gl.sum(gl.tanh(heads[0]) * heads[-1]) + gl.sum(heads[len(heads) // 2] * 0.5)
    (gx,) = gl.grad(loss, [x])
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 8, 12))}
    rw, got, want = both(g, [gx], SLICE_GRADIENTS, feeds)
    ops = ops_of(rw.graph)
    assert ops.count("slices_assemble") == 1 and "slice_backward" not in ops
    node = next(n for n in rw.graph.nodes if n.op == "slices_assemble")
    assert node.attrs["covered"] == (len(parts) == 3)
    assert all(i.op != "reshape" for i in node.inputs)   # read through the private reshapes
    assert got[0].tobytes() == want[0].tobytes()


def test_overlapping_slice_gradients_stay_a_sum():
    g = gl.Graph("overlap")
    x = g.input("x", (6,), "float64")
    loss = gl.sum(x[0:4] * x[2:6])
    (gx,) = gl.grad(loss, [x])
    assert "slices_assemble" not in ops_of(passes.rewrite(g, [gx], SLICE_GRADIENTS).graph)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attention_softmax_folds_scale_and_mask_both_ways_bit_for_bit(dtype):
    g = gl.Graph("att")
    q = g.input("q", (2, 6, 4), dtype)
    k = g.input("k", (2, 6, 4), dtype)
    s = gl.softmax(gl.causal_mask((q @ gl.swapaxes(k, -1, -2)) * 0.5), -1)
    loss = gl.sum(s * s)
    gq, gk = gl.grad(loss, [q, k])
    rng = np.random.default_rng(2)
    feeds = {"q": rng.standard_normal((2, 6, 4)).astype(dtype), "k": rng.standard_normal((2, 6, 4)).astype(dtype)}
    rw, got, want = both(g, [s, gq, gk], ATTENTION_SOFTMAX, feeds)
    ops = ops_of(rw.graph)
    assert ops.count("softmax_fused") == 1 and ops.count("softmax_backward_fused") == 1
    assert "causal_mask" not in ops and "softmax" not in ops and "softmax_backward" not in ops
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()


def test_a_masked_score_with_another_reader_is_not_folded():
    g = gl.Graph("att2")
    x = g.input("x", (4, 4))
    m = gl.causal_mask(x * 0.5)
    s = gl.softmax(m, -1)
    rw = passes.rewrite(g, [s, m], ATTENTION_SOFTMAX)
    fused = [n for n in rw.graph.nodes if n.op == "softmax_fused"]
    # the mask is an output, so only the scale could fold, and it feeds the mask, not the softmax
    assert fused == [] and ops_of(rw.graph).count("causal_mask") == 1


def test_dropout_masks_are_one_tensor_per_stream_read_by_forward_and_backward():
    g = gl.Graph("drop")
    x = g.input("x", (4, 9), "float64")
    key = g.input("key", (), "int64")
    y = gl.dropout(gl.tanh(x), 0.4, key, stream=1) + gl.dropout(x, 0.4, key, stream=2)
    (gx,) = gl.grad(gl.sum(y * y), [x])
    feeds = {"x": np.random.default_rng(3).standard_normal((4, 9)), "key": np.asarray(11, np.int64)}
    rw, got, want = both(g, [y, gx], DROPOUT_MASKS, feeds)
    keeps = [n for n in rw.graph.nodes if n.op == "dropout_keep"]
    applies = [n for n in rw.graph.nodes if n.op == "dropout_apply"]
    assert len(keeps) == 2 and len(applies) == 4 and "dropout" not in ops_of(rw.graph)
    assert sorted(a.inputs[1].id for a in applies) == sorted(2 * [k.id for k in keeps])
    assert not keeps[0].is_backward   # drawn where the forward dropout was
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_tanh_gelu_keeps_its_sigmoid_as_a_tensor_float32_only(dtype):
    g = gl.Graph("gelu")
    x = g.input("x", (3, 7), dtype)
    y = gl.gelu(gl.tanh(x))
    (gx,) = gl.grad(gl.sum(y * y), [x])
    feeds = {"x": (np.random.default_rng(5).standard_normal((3, 7)) * 3).astype(dtype)}
    rw, got, want = both(g, [y, gx], KEPT_VALUES, feeds)
    ops = ops_of(rw.graph)
    if dtype == "float64":
        assert "gelu_sigmoid" not in ops and "gelu" in ops
        return
    assert "gelu" not in ops and "gelu_backward" not in ops
    (back,) = [n for n in rw.graph.nodes if n.op == "gelu_backward_sigmoid"]
    s = back.inputs[2]
    assert s.op == "gelu_sigmoid" and s.attrs["kept"] and not s.is_backward
    assert any(n.op == "mul" and n.inputs[1] is s for n in rw.graph.nodes)   # gelu(x) = x * s
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()   # the same arithmetic in the same order
    prog = executors.get("numpy").compile(g, [y, gx])
    assert prog.kept_bytes() >= s.nbytes
    assert prog.plan.entries[s.id].last > prog.plan.entries[s.id].first   # lives until the backward reads it


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_layer_norm_keeps_its_statistics_as_tensors(dtype):
    g = gl.Graph("ln")
    x = g.input("x", (4, 6), dtype)
    w, b = g.param("w", (6,), dtype), g.param("b", (6,), dtype)
    y = gl.layer_norm(gl.tanh(x), w, b)
    loss = gl.sum(y * y)
    gx, gw, gb = gl.grad(loss, [x, w, b])   # gw reads a plain layer_norm(x): the kept xhat
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((4, 6)).astype(dtype)}
    state = {"w": rng.standard_normal(6).astype(dtype), "b": rng.standard_normal(6).astype(dtype)}
    rw, got, want = both(g, [y, gx, gw, gb], KEPT_VALUES, feeds, state)
    ops = ops_of(rw.graph)
    assert ops.count("layer_norm_keep") == 1 and "layer_norm" not in ops and "layer_norm_backward" not in ops
    (keep,) = [n for n in rw.graph.nodes if n.op == "layer_norm_keep"]
    assert keep.attrs["keep_xhat"]
    (back,) = [n for n in rw.graph.nodes if n.op == "layer_norm_backward_kept"]
    xc, sv = back.inputs[:2]
    assert xc.attrs["kept"] and sv.attrs["kept"] and sv.shape == (4, 1)
    for a, b_ in zip(got, want):
        assert a.tobytes() == b_.tobytes()
    prog = executors.get("numpy").compile(g, [y, gx, gw, gb])
    assert {prog.plan.entries[t.id].kind for t in (xc, sv)} == {"view"}   # parts of layer_norm_keep's buffer


def test_affine_grads_is_a_layer_norms_weight_and_bias_gradient_in_one_node_bit_for_bit():
    dtype = "float32"   # (the C kernel's; float64 is left alone, below)
    g = gl.Graph("ln_affine")
    x = g.input("x", (3, 4, 6), dtype)
    w, b = g.param("w", (6,), dtype), g.param("b", (6,), dtype)
    y = gl.layer_norm(x, w, b)
    loss = gl.sum(y * gl.tanh(y))
    gx, gw, gb = gl.grad(loss, [x, w, b])
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((3, 4, 6)).astype(dtype)}
    state = {"w": rng.standard_normal(6).astype(dtype), "b": rng.standard_normal(6).astype(dtype)}
    rw, got, want = both(g, [gx, gw, gb], AFFINE_GRADS, feeds, state)
    (fused,) = [n for n in rw.graph.nodes if n.op == "affine_grads"]
    assert fused.shape == (12,) and rw.made_by(fused) == "affine_grads"
    assert "sum" not in ops_of(rw.graph)   # both sums (the loss is not an output)
    assert [o.op for o in rw.outputs[1:]] == ["slice", "slice"] and all(o.inputs[0] is fused for o in rw.outputs[1:])
    for a, b_ in zip(got, want):
        assert a.tobytes() == b_.tobytes()
    # the map: the weight's sum and the product it absorbed point at the first half, the bias's sum at the second
    wsum = next(n for n in g.nodes if n.op == "sum" and n.inputs[0].op == "mul" and n.shape == (6,))
    assert rw.replaced[wsum.id] is rw.replaced[wsum.inputs[0].id] is rw.outputs[1]
    assert rw.replaced[gb.id] is rw.outputs[2]
    g64 = gl.Graph("ln_affine64")
    x64 = g64.input("x", (3, 4, 6), "float64")
    w64, b64 = g64.param("w", (6,), "float64"), g64.param("b", (6,), "float64")
    grads64 = gl.grad(gl.sum(gl.layer_norm(x64, w64, b64) ** 2), [w64, b64])
    assert "affine_grads" not in ops_of(passes.rewrite(g64, grads64, AFFINE_GRADS).graph)


def test_the_native_pipeline_keeps_no_xhat_its_weight_gradient_divides_xc_by_sv_bit_for_bit():
    """KEPT_STATISTICS keeps y, xc and sv only: the weight gradient's plain layer norm becomes
    div(xc, sv), which affine_grads absorbs (affine_grads(g, xc, sv)); the bits of the source
    graph, with either pass alone or both."""
    g = gl.Graph("ln_no_xhat")
    x = g.input("x", (3, 4, 6), "float32")
    w, b = g.param("w", (6,), "float32"), g.param("b", (6,), "float32")
    y = gl.layer_norm(x, w, b)
    outputs = [y, *gl.grad(gl.sum(y * gl.tanh(y)), [x, w, b])]
    rng = np.random.default_rng(9)
    feeds = {"x": (rng.standard_normal((3, 4, 6)) * 2 + 1).astype(np.float32)}
    state = {"w": rng.standard_normal(6).astype(np.float32), "b": rng.standard_normal(6).astype(np.float32)}
    want = REF.compile(g, outputs).run(feeds, state)
    kept = passes.rewrite(g, outputs, KEPT_STATISTICS)
    (keep,) = [n for n in kept.graph.nodes if n.op == "layer_norm_keep"]
    assert not keep.attrs["keep_xhat"] and keep.shape == (3 * 4 * 6 * 2 + 3 * 4,)   # y, xc, sv
    (div,) = [n for n in kept.graph.nodes if n.op == "div"]
    assert [i.shape for i in div.inputs] == [(3, 4, 6), (3, 4, 1)] and "layer_norm" not in ops_of(kept.graph)
    both_ = passes.run_pipeline((KEPT_STATISTICS, AFFINE_GRADS), g, outputs)
    assert "div" not in ops_of(both_.graph)
    (fused,) = [n for n in both_.graph.nodes if n.op == "affine_grads"]
    assert [i.shape for i in fused.inputs] == [(3, 4, 6), (3, 4, 6), (3, 4, 1)]
    assert all(i.inputs[0].inputs[0].op == "layer_norm_keep" for i in fused.inputs[1:])   # xc and sv: its parts
    for rw in (kept, both_):
        for a, b_ in zip(REF.compile(rw.graph, rw.outputs).run(feeds, state), want):
            assert a.tobytes() == b_.tobytes()


def _pre_norm_stack(dtype="float32", layers=2, shape=(3, 4, 6)):
    """A pre-norm residual stack, x + f(layer_norm(x)) per layer, with a final norm: its input's
    gradient is the residual gradient plus each norm's input gradient (an add per norm)."""
    g = gl.Graph("pre_norm")
    x = g.input("x", shape, dtype)
    h = x
    for i in range(layers):
        w = g.param(f"w{i}", shape[-1:], dtype)
        h = h + gl.tanh(gl.layer_norm(h, w, None)) * (i + 1.5)
    y = gl.layer_norm(h, None, None)
    outputs = [y, *gl.grad(gl.sum(y * gl.tanh(y)), [x])]
    rng = np.random.default_rng(12)
    feeds = {"x": (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)}
    state = {f"w{i}": rng.standard_normal(shape[-1]).astype(dtype) for i in range(layers)}
    return g, outputs, feeds, state


def test_residual_norm_backward_adds_the_residual_gradient_where_the_norm_writes_bit_for_bit():
    g, outputs, feeds, state = _pre_norm_stack()
    want = REF.compile(g, outputs).run(feeds, state)
    kept = passes.rewrite(g, outputs, KEPT_STATISTICS)
    assert ops_of(kept.graph).count("layer_norm_backward_kept") == 3
    rw = passes.run_pipeline((KEPT_STATISTICS, RESIDUAL_NORM_BACKWARD), g, outputs)
    fused = [n for n in rw.graph.nodes if n.op == "layer_norm_backward_kept" and n.attrs.get("residual")]
    # the two block norms add the residual stream's gradient: each add absorbed
    assert len(fused) == 2 and ops_of(rw.graph).count("add") == ops_of(kept.graph).count("add") - 2
    assert all(n.inputs[-1].shape == n.shape and rw.made_by(n) == "residual_norm_backward" for n in fused)
    for a, b_ in zip(REF.compile(rw.graph, rw.outputs).run(feeds, state), want):
        assert a.tobytes() == b_.tobytes()


def test_residual_norm_backward_leaves_a_gradient_read_twice_float64_and_broadcasts():
    g64, outputs64, _, _ = _pre_norm_stack("float64")
    rw = passes.run_pipeline((KEPT_STATISTICS, RESIDUAL_NORM_BACKWARD), g64, outputs64)
    assert not any(n.attrs.get("residual") for n in rw.graph.nodes)
    g = gl.Graph("norm_twice")
    x, u = g.input("x", (4, 6)), g.input("u", (4, 6))
    y = gl.layer_norm(x, None, None)
    (gx,) = gl.grad(gl.sum(y * u), [x])
    for outputs in ([y, gx + u], [y, gx + u, gx], [y, gx + gl.reshape(u[0], (6,))]):   # read again; r broadcast
        rw = passes.run_pipeline((KEPT_STATISTICS, RESIDUAL_NORM_BACKWARD), g, outputs)
        (back,) = [n for n in rw.graph.nodes if n.op == "layer_norm_backward_kept"]
        assert bool(back.attrs.get("residual")) == (len(outputs) == 2 and outputs[1].inputs[1] is u), outputs


def test_a_residual_that_does_not_match_the_gradient_is_named():
    g = gl.Graph("residual_shape")
    xc, sv, gr = g.input("xc", (4, 6)), g.input("sv", (4, 1)), g.input("g", (4, 6))
    with pytest.raises(gl.ir.ShapeError, match=re.escape(
            "residual gradient [4,5] float32 does not match the input gradient [4,6] float32")):
        gl.registry.apply("layer_norm_backward_kept", (xc, sv, gr, g.input("r", (4, 5))), eps=1e-5,
                          has_weight=False, residual=True)
    with pytest.raises(gl.ir.ShapeError, match=re.escape("residual gradient none does not match")):
        gl.registry.apply("layer_norm_backward_kept", (xc, sv), eps=1e-5, has_weight=False, residual=True)


def test_affine_grads_takes_one_divisor_per_row_and_names_a_wrong_one():
    g = gl.Graph("affine_d")
    u, d = g.input("u", (4, 5)), g.input("d", (4, 5))
    with pytest.raises(gl.ir.ShapeError, match=re.escape(
            "affine_grads in <root>: expects at most one divisor d of shape [4,1] (one per row), got [4,5]")):
        gl.registry.apply("affine_grads", (u, u, d))


def test_affine_grads_leaves_a_product_with_another_use_or_a_sum_without_its_bias():
    g = gl.Graph("affine2")
    u, v = g.input("u", (4, 5)), g.input("v", (4, 5))
    p = u * v
    assert "affine_grads" not in ops_of(passes.rewrite(g, [gl.sum(p, axis=0), gl.sum(u, axis=0), p], AFFINE_GRADS).graph)
    assert "affine_grads" not in ops_of(passes.rewrite(g, [gl.sum(u * v, axis=0)], AFFINE_GRADS).graph)
    assert "affine_grads" not in ops_of(passes.rewrite(g, [gl.sum(u * v, axis=1), gl.sum(u, axis=1)], AFFINE_GRADS).graph)
    rng = np.random.default_rng(8)
    feeds = {"u": rng.standard_normal((4, 5), np.float32), "v": rng.standard_normal((4, 5), np.float32)}
    kept, got, want = both(g, [gl.sum(u * v, axis=0, keepdims=True), gl.sum(u, axis=0, keepdims=True)], AFFINE_GRADS, feeds)
    assert "affine_grads" in ops_of(kept.graph) and [o.shape for o in kept.outputs] == [(1, 5), (1, 5)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
    rw = passes.rewrite(g, [gl.sum(u * v, axis=0), gl.sum(v, axis=0)], AFFINE_GRADS)   # the bias of either factor
    (fused,) = [n for n in rw.graph.nodes if n.op == "affine_grads"]
    assert fused.inputs[0].name == "v"


def test_bias_gelu_forms_an_mlps_biased_product_where_its_gelu_reads_it_bit_for_bit():
    """gelu(x @ w + b) with the product's rows regrouped, and its backward: bias_gelu(m, b) and
    bias_gelu_backward(m, b, g) on the product m itself, so m + b is never stored; the same bits
    (on the reference) as the pattern."""
    g = gl.Graph("mlp")
    x = g.input("x", (6, 5), "float32")
    w, b = g.param("w", (5, 4), "float32"), g.param("b", (4,), "float32")
    y = gl.gelu(gl.reshape(x @ w + b, (2, 3, 4)))
    outputs = [y] + gl.grad(gl.sum(y * gl.tanh(y)), [x, w, b])
    rng = np.random.default_rng(10)
    feeds = {"x": rng.standard_normal((6, 5), np.float32)}
    state = {"w": rng.standard_normal((5, 4), np.float32), "b": rng.standard_normal(4, np.float32)}
    rw, got, want = both(g, outputs, BIAS_GELU, feeds, state)
    (fwd,) = [n for n in rw.graph.nodes if n.op == "bias_gelu"]
    (bwd,) = [n for n in rw.graph.nodes if n.op == "bias_gelu_backward"]
    assert rw.outputs[0] is fwd and fwd.inputs[1].name == "b" and bwd.inputs[1].name == "b"
    assert fwd.inputs[0].op == "reshape" and fwd.inputs[0].inputs[0].op == "matmul"   # m, regrouped: a view
    assert bwd.inputs[0].inputs[0] is fwd.inputs[0].inputs[0] and not {"gelu", "gelu_backward"} & set(ops_of(rw.graph))
    assert not [n for n in rw.graph.nodes if n.op == "add" and fwd.inputs[1] in n.inputs]   # m + b never stored
    assert all(a.tobytes() == b_.tobytes() for a, b_ in zip(got, want))
    # left alone: m + b read by another node too, and float64 (the C kernels' float32 only)
    h = x @ w + b
    assert "bias_gelu" not in ops_of(passes.rewrite(g, [gl.gelu(h), h], BIAS_GELU).graph)
    assert "bias_gelu" not in ops_of(passes.rewrite(g, [gl.gelu(h), gl.exp(h)], BIAS_GELU).graph)
    g64 = gl.Graph("mlp64")
    m64, b64 = g64.input("m", (3, 4), "float64"), g64.input("b", (4,), "float64")
    y64 = gl.gelu(m64 + b64)
    assert "bias_gelu" not in ops_of(passes.rewrite(g64, [y64] + gl.grad(gl.sum(y64), [m64]), BIAS_GELU).graph)


def test_bias_dropout_add_is_a_residual_update_in_one_node_bit_for_bit():
    """A block's residual update after its output projection, r + dropout(x @ w + b) with the
    product's rows regrouped, after dropout_masks: one bias_dropout_add node; its gradients too."""
    g = gl.Graph("residual")
    r, x = g.input("r", (2, 3, 4)), g.input("x", (6, 5))
    w, b = g.param("w", (5, 4)), g.param("b", (4,))
    key = g.input("key", (), "int64")
    y = r + gl.dropout(gl.reshape(x @ w + b, (2, 3, 4)), 0.25, key, stream=1)
    loss = gl.sum(y * y)
    outputs = [y] + gl.grad(loss, [r, w, b])
    masked = passes.rewrite(g, outputs, DROPOUT_MASKS)
    rw = passes.rewrite(masked.graph, masked.outputs, BIAS_DROPOUT_ADD)
    (fused,) = [n for n in rw.graph.nodes if n.op == "bias_dropout_add"]
    assert rw.outputs[0] is fused and fused.inputs[0].name == "r" and fused.inputs[2].name == "b"
    assert [n.op for n in rw.graph.nodes].count("dropout_apply") == 1   # the backward's, the same mask
    rng = np.random.default_rng(9)
    feeds = {"r": rng.standard_normal((2, 3, 4), np.float32), "x": rng.standard_normal((6, 5), np.float32),
             "key": np.asarray(3, np.int64)}
    state = {"w": rng.standard_normal((5, 4), np.float32), "b": rng.standard_normal(4, np.float32)}
    got = REF.compile(rw.graph, rw.outputs).run(feeds, state)
    want = REF.compile(g, outputs).run(feeds, state)
    assert all(a.tobytes() == b_.tobytes() for a, b_ in zip(got, want))
    # left alone: the biased product read elsewhere too, and float64 (the C kernel's float32 only)
    h = x @ w + b
    kept = passes.rewrite(g, [r + gl.dropout(gl.reshape(h, (2, 3, 4)), 0.25, key, stream=1), h], DROPOUT_MASKS)
    assert "bias_dropout_add" not in ops_of(passes.rewrite(kept.graph, kept.outputs, BIAS_DROPOUT_ADD).graph)
    g64 = gl.Graph("residual64")
    r64, m64, b64 = g64.input("r", (3, 4), "float64"), g64.input("m", (3, 4), "float64"), g64.input("b", (4,), "float64")
    k64 = g64.input("key", (), "int64")
    d64 = passes.rewrite(g64, [r64 + gl.dropout(m64 + b64, 0.25, k64)], DROPOUT_MASKS)
    assert "bias_dropout_add" not in ops_of(passes.rewrite(d64.graph, d64.outputs, BIAS_DROPOUT_ADD).graph)


def _block_attention(dtype="float32", b=2, t=7, h=3, d=4, extra_read=False):
    """A block's attention as graphlm.nn builds it: one batched QKV product, its thirds split into
    [B, H, T, D] heads, the output's heads merged for the projection; its gradients."""
    c = h * d
    g = gl.Graph("block_attention")
    x, u = g.input("x", (b * t, c), dtype), g.input("u", (b * t, c), dtype)
    w, wo = g.param("w", (3, c, c), dtype), g.param("wo", (c, c), dtype)
    qkv = x @ w
    q, k, v = (gl.transpose(gl.reshape(qkv[i], (b, t, h, d)), (0, 2, 1, 3)) for i in range(3))
    y = gl.causal_attention(q, k, v)
    out = gl.reshape(gl.transpose(y, (0, 2, 1, 3)), (b * t, c)) @ wo
    loss = gl.sum(out * u) + (gl.sum(y * y) if extra_read else 0.0)
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((b * t, c)).astype(dtype), "u": rng.standard_normal((b * t, c)).astype(dtype)}
    state = {"w": (rng.standard_normal((3, c, c)) / 3).astype(dtype), "wo": rng.standard_normal((c, c)).astype(dtype)}
    return g, [out] + gl.grad(loss, [x, w, wo]), feeds, state


def _before_merged_heads(g, outputs):
    """The graph as the native pipeline hands it to merged_heads (its last pass)."""
    native = passes.PIPELINES["native"]
    assert native[-1] is MERGED_HEADS
    return passes.run_pipeline(native[:-1], g, outputs)


@pytest.mark.parametrize("kept", [True, False])
def test_merged_heads_make_the_heads_merge_and_the_qkv_gradient_views_bit_for_bit(monkeypatch, kept):
    """After the native pipeline's other passes: the attention (kept scores or not) and its
    backward store [B, T, H, D]; no transpose of their results is left to copy and the QKV
    gradient is a reshape of the backward's output; the same bits on the reference executor,
    and the native executor (its C kernels writing the strided rows) within the attention's
    tolerance, with every view op a view of the plan."""
    from graphlm.passes import kept_values
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", 3)
    monkeypatch.setattr(kept_values, "KEEP_SCORES_PER_OUTPUT", 4 if kept else 0)
    g, outputs, feeds, state = _block_attention()
    before = _before_merged_heads(g, outputs)
    rw = passes.rewrite(before.graph, before.outputs, MERGED_HEADS)
    forward, backward = ("causal_attention_keep", "causal_attention_backward_kept") if kept else \
        ("causal_attention", "causal_attention_backward")
    assert "slices_assemble" in ops_of(before.graph) and "slices_assemble" not in ops_of(rw.graph)
    (fwd,) = [n for n in rw.graph.nodes if n.op == forward]
    (back,) = [n for n in rw.graph.nodes if n.op == backward]
    assert fwd.attrs["heads_merged"] and back.attrs["heads_merged"] and back.shape == (3, 2, 7, 3, 4)
    assert all(rw.made_by(n) == "merged_heads" for n in (fwd, back))
    # what reads the attention's results: the projection and the QKV gradient's products through reshapes
    assert not any(n.op == "transpose" and n.inputs[0].op == "reshape" and n.inputs[0].inputs[0] is back
                   for n in rw.graph.nodes)
    got = REF.compile(rw.graph, rw.outputs).run(feeds, state)
    want = REF.compile(g, outputs).run(feeds, state)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
    native = executors.get("native").compile(g, outputs)
    assert any(n.op == backward and n.attrs.get("heads_merged") for n in native.graph.nodes)
    views = [n for n in native.graph.nodes if n.op in ("reshape", "transpose", "slice")]
    assert views and all(native.plan.entries[n.id].kind in ("view", "leaf") for n in views)
    for a, b, what in zip(native.run(feeds, state), want, ["out", "dx", "dw", "dwo"]):
        assert_close(a, b, 1e-5, 1e-5, f"native {what}")
    numpy_run = executors.get("numpy").compile(rw.graph, rw.outputs).run(feeds, state)   # its kernels, strided
    for a, b, what in zip(numpy_run, want, ["out", "dx", "dw", "dwo"]):
        assert_close(a, b, 1e-5, 1e-5, f"numpy {what}")


def test_merged_heads_leave_an_attention_read_otherwise_float64_or_a_foreign_third(monkeypatch):
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", 3)
    for dtype, extra in (("float64", False), ("float32", True)):   # y also read whole, unmerged: left alone
        g, outputs, _, _ = _block_attention(dtype, extra_read=extra)
        before = _before_merged_heads(g, outputs)
        after = passes.rewrite(before.graph, before.outputs, MERGED_HEADS)
        merged = {n.op for n in after.graph.nodes if n.attrs.get("heads_merged")}
        # (float32: its backward's results are still assembled in place)
        assert merged == ({"causal_attention_backward_kept"} if extra else set()), dtype
    # an assembly one of whose thirds is not the attention backward's: left alone
    g = gl.Graph("foreign")
    q, k, v, o, gy = (g.input(n, (2, 3, 5, 4)) for n in "qkvog")
    grads = gl.registry.apply("causal_attention_backward", (q, k, v, o, gy), scale=0.5)
    thirds = [gl.transpose(grads[0], (0, 2, 1, 3)), gl.transpose(grads[1], (0, 2, 1, 3)), gl.transpose(q, (0, 2, 1, 3))]
    index = lambda i: gl.ops.normalize_index((i, slice(None), slice(None)), (3, 10, 12))
    assembled = gl.registry.apply("slices_assemble", thirds, shape=(3, 10, 12), indexes=[index(i) for i in range(3)])
    assert "slices_assemble" in ops_of(passes.rewrite(g, [assembled], MERGED_HEADS).graph)
    with pytest.raises(gl.ir.ShapeError, match=r"causal_attention in <root>: heads_merged attention needs q "
                                               r"\[\.\.\., H, T, D\], got \[5,3\]"):
        gl.registry.apply("causal_attention", (g.input("q2", (5, 3)),) * 3, scale=0.5, heads_merged=True)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_causal_attention_keeps_its_scores_as_tensors(monkeypatch, dtype):
    """causal_attention + its backward -> causal_attention_keep (flat: y, E in query blocks, l;
    views) + causal_attention_backward_kept(q, k, v, y, E, l, g), on the reference executor
    within the attention tolerance; a backward of another forward output is left alone."""
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", 3)   # T = 7: two query blocks, [0, 3) and [3, 7)
    shape = (2, 2, 7, 4)
    g = gl.Graph("att")
    q, k, v, u = (g.input(n, shape, dtype) for n in "qkvu")
    y = gl.causal_attention(q, k, v)
    gq, gk, gv = gl.grad(gl.sum(y * u), [q, k, v])
    o = g.input("o", shape, dtype)   # a backward on a fed output: no forward to keep for it
    alone = gl.registry.apply("causal_attention_backward", (q, k, v, o, u), scale=y.attrs["scale"])
    rng = np.random.default_rng(7)
    feeds = {n: rng.standard_normal(shape).astype(dtype) for n in "qkvuo"}
    rw, got, want = both(g, [y, gq, gk, gv, alone], KEPT_VALUES, feeds)
    ops = ops_of(rw.graph)
    assert ops.count("causal_attention_keep") == 1 and ops.count("causal_attention_backward_kept") == 1
    assert "causal_attention" not in ops and ops.count("causal_attention_backward") == 1   # `alone`
    (keep,) = [n for n in rw.graph.nodes if n.op == "causal_attention_keep"]
    (back,) = [n for n in rw.graph.nodes if n.op == "causal_attention_backward_kept"]
    assert keep.attrs["query_block"] == back.attrs["query_block"] == 3 and not keep.is_backward
    yk, e, l = back.inputs[3:6]
    assert e.attrs["kept"] and l.attrs["kept"] and not yk.attrs.get("kept")
    assert e.shape == (4 * (3 * 3 + 4 * 7),) and l.shape == (2, 2, 7, 1)   # blocks on and below the diagonal
    assert rw.outputs[0] is yk
    tol = 1e-6 if dtype == "float32" else 1e-12
    for a, b, what in zip(got, want, ["y", "dq", "dk", "dv", "alone"]):
        assert_close(a, b, tol, tol, what)
    prog = executors.get("numpy").compile(g, [gq, gk, gv])   # (y not an output: its buffer is the arena's)
    (keep,) = [n for n in prog.graph.nodes if n.op == "causal_attention_keep"]
    (back,) = [n for n in prog.graph.nodes if n.op == "causal_attention_backward_kept"]
    e, l = back.inputs[4:6]
    assert {prog.plan.entries[t.id].kind for t in (e, l)} == {"view"}   # parts of causal_attention_keep's buffer
    assert prog.kept_bytes() == prog.plan.kept_bytes == e.nbytes + l.nbytes
    block = next(b for b in prog.plan.blocks if b.owner == keep.id and not b.scratch)
    assert prog.plan.kept_in(block) == e.nbytes + l.nbytes
    assert block.last == prog.plan.schedule.index(back.id)   # E and l live until the backward reads them


def test_a_causal_attention_keeps_its_scores_only_where_they_are_cheap(monkeypatch):
    """Scores of more than KEEP_SCORES_PER_OUTPUT elements per output element (a long context
    over narrow heads, as GPT-2 small's T = 1024, D = 64) are recomputed by the backward, not
    kept; at the limit they are kept."""
    from graphlm.passes import kept_values
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", 4)
    for d, kept in ((2, False), (8, True)):   # T = 16: E = 4 * (4 + 8 + 12 + 16) = 160 per matrix
        g = gl.Graph("att_long")
        q, k, v = (g.input(n, (1, 16, d)) for n in "qkv")
        y = gl.causal_attention(q, k, v)
        grads = gl.grad(gl.sum(y * y), [q, k, v])
        assert (160 <= kept_values.KEEP_SCORES_PER_OUTPUT * 16 * d) == kept == kept_values.keeps_scores((1, 16, d))
        rw = passes.rewrite(g, [y, *grads], KEPT_VALUES)
        assert ("causal_attention_keep" in ops_of(rw.graph)) == kept, d
        assert ("causal_attention_backward" in ops_of(rw.graph)) != kept, d


def test_a_causal_attention_without_its_own_backward_keeps_nothing():
    g = gl.Graph("att_fwd")
    q, k, v = (g.input(n, (3, 5, 2)) for n in "qkv")
    y = gl.causal_attention(q, k, v)
    y2 = gl.causal_attention(q, k, v, scale=0.3)
    # the backward of y2's op read with y's output: not y2's own, and y has no backward of its own
    other = gl.registry.apply("causal_attention_backward", (q, k, v, y, y), scale=0.3)
    rw = passes.rewrite(g, [y, y2, other], KEPT_VALUES)
    assert rw.graph is g


def test_the_numpy_pipeline_runs_on_reference_and_numpy_alike():
    """A GPT training step after the numpy executor's pipeline: the reference executor runs the
    rewritten graph, and the numpy executor's program compiled the same ops."""
    from graphlm.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=11, context_length=8, channels=16, head_count=2, layer_count=1, dropout=0.1)
    model = GPT(cfg)
    model.train()
    g, loss = model.loss_graph(2, name="pipe")
    params = [g.params[k] for k in sorted(g.params)]
    grads = gl.grad(loss, params)
    rw = passes.run_pipeline(executors.get("numpy").pipeline, g, [loss, *grads])
    made = {n.attrs.get("made_by") for n in rw.graph.nodes} - {None}
    assert {"dropout_masks", "slice_gradients"} <= made
    rng = np.random.default_rng(4)
    feeds = {"tokens": rng.integers(0, 11, (2, 8)), "targets": rng.integers(0, 11, (2, 8)),
             "dropout_key": np.asarray(5, np.int64)}
    state = model.init(seed=1)
    want = REF.compile(g, [loss, *grads]).run(feeds, state)
    got = REF.compile(rw.graph, rw.outputs).run(feeds, state)
    prog = executors.get("numpy").compile(g, [loss, *grads])
    assert sorted(ops_of(prog.graph)) == sorted(ops_of(rw.graph))
    exact = prog.rounds_like_reference
    for a, b in zip(got, want):
        if exact:
            assert a.tobytes() == b.tobytes()
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # every source node the outputs need maps to a node of the rewritten graph
    assert all(t.graph is rw.graph and t.id >= 0 for t in rw.replaced.values())


def test_transposed_weights_reads_each_weight_transposed_once_and_drops_what_nothing_reads():
    g = gl.Graph("tw")
    x = g.input("x", (2, 3, 4), "float64")
    w = g.param("w", (5, 4), "float64")         # a Linear's weight, read twice as w^T
    e = g.param("e", (6, 5), "float64")         # a tied table: also read as itself
    q = g.param("q", (2, 4, 4), "float64")      # batched: only its last two axes swap
    u = g.input("u", (4, 5), "float64")         # not a param: fed each run, left alone
    h = gl.tanh(x @ gl.transpose(w)) + gl.tanh(x) @ gl.transpose(w)
    outs = [h @ gl.transpose(e), gl.sum(e, axis=1), x @ gl.transpose(q, (0, 2, 1)), gl.tanh(x) @ u]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 3, 4)), "u": rng.standard_normal((4, 5))}
    params = {k: rng.standard_normal(v.shape) for k, v in g.params.items()}
    rw = passes.rewrite(g, outs, TRANSPOSED_WEIGHTS)
    assert sorted(rw.graph.params) == ["e", "e.T", "q.T", "w.T"]       # w: nothing reads it now
    assert not any(n.op == "transpose" and n.inputs[0].op == "param" for n in rw.graph.nodes)
    assert rw.graph.params["q.T"].shape == (2, 4, 4) and rw.graph.inputs.keys() == {"x", "u"}
    extra = transposed_params(rw.graph, params)
    assert sorted(extra) == ["e.T", "q.T", "w.T"] and all(a.flags.c_contiguous for a in extra.values())
    assert transposed_params(rw.graph, {**params, **extra}) == {}       # nothing left to take
    got = REF.compile(rw.graph, rw.outputs).run(feeds, {**params, **extra})
    want = REF.compile(g, outs).run(feeds, params)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    # a transpose of other axes, or of a non-param, is copied as it was
    other = [g.input("y", (4, 3, 2), "float64") @ gl.transpose(q, (1, 0, 2)), x @ gl.transpose(g.input("v", (5, 4), "float64"))]
    assert passes.rewrite(g, other, TRANSPOSED_WEIGHTS).graph is g
    taken = g.param("e.T", (5, 6), "float64")   # a param of W.T's name already: not W's transpose
    xw = x[0] @ gl.transpose(w)
    assert passes.rewrite(g, [xw @ taken + xw @ gl.transpose(e)], TRANSPOSED_WEIGHTS).graph.params.keys() \
        == {"w.T", "e.T", "e"}


def test_a_weight_past_max_bytes_is_read_as_it_is(monkeypatch):
    from graphlm.passes import transposed_weights
    g = gl.Graph("big")
    x = g.input("x", (2, 4))
    small, big = g.param("small", (6, 4)), g.param("big", (12, 6))   # 96 and 288 bytes
    outs = [x @ gl.transpose(small), (x @ gl.transpose(small)) @ gl.transpose(big)]
    monkeypatch.setattr(transposed_weights, "MAX_BYTES", 95)
    assert passes.rewrite(g, outs, TRANSPOSED_WEIGHTS).graph is g
    monkeypatch.setattr(transposed_weights, "MAX_BYTES", 96)
    assert sorted(passes.rewrite(g, outs, TRANSPOSED_WEIGHTS).graph.params) == ["big", "small.T"]
    monkeypatch.setattr(transposed_weights, "MAX_BYTES", 288)
    assert sorted(passes.rewrite(g, outs, TRANSPOSED_WEIGHTS).graph.params) == ["big.T", "small.T"]


def test_a_generators_programs_read_the_transposed_weights():
    """The Generator's prefill and decode graphs read each Linear weight and the tied head as W.T,
    taken once from the params it was given; the originals stay shared, not copied."""
    from graphlm.models import GPT, GPTConfig
    from graphlm.sample import Generator
    model = GPT(GPTConfig(vocab_size=11, context_length=8, channels=16, head_count=2, layer_count=1, dropout=0.0))
    params = model.init(seed=2)
    gen = Generator(model, params, batch_size=2, executor="numpy")
    decode = gen._graphs[None][0]
    linear = sorted(k[:-2] for k in decode.params if k.endswith(".T"))
    assert linear == sorted(f"blocks.0.{m}.weight" for m in ("attention.output", "mlp_input", "mlp_output")) \
        + ["language_model_head.weight"]
    assert not set(linear) & set(decode.params) and all(gen.state[k] is v for k, v in params.items())
    for k in linear:
        assert gen.state[k + ".T"].tobytes() == np.ascontiguousarray(params[k].T).tobytes()
    assert not any(n.op == "transpose" and n.inputs[0].op == "param" for n in decode.nodes)
    logits = gen.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
    want = model.logits(params, np.array([[1, 2, 3], [4, 5, 6]]), executor="reference")[:, -1]
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)


def test_panel_weights_reads_each_fixed_weight_in_panels_and_adds_its_bias_in_the_product():
    from graphlm.ops import to_panels
    g = gl.Graph("pw")
    x = g.input("x", (2, 3, 4), "float64")
    w = g.param("w", (40, 4), "float64")        # a Linear's weight, read as w^T: 40 columns, 2 panels
    b = g.param("b", (40,), "float64")
    q = g.param("q", (2, 4, 5), "float64")      # batched and read as it is (qkv): panels of q itself
    qb = g.param("qb", (2, 1, 5), "float64")
    e = g.param("e", (6, 40), "float64")        # a tied table: also read as itself
    h = x @ gl.transpose(w) + b                 # product + bias: one panel product
    kept = x @ gl.transpose(w)                  # read twice (an output and an add): its add stays
    outs = [gl.tanh(h) @ gl.transpose(e), gl.sum(e, axis=1), x @ q + qb, kept, kept + b, qb + x @ q]
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((2, 3, 4))}
    params = {k: rng.standard_normal(v.shape) for k, v in g.params.items()}
    rw = passes.rewrite(g, outs, PANEL_WEIGHTS)
    assert sorted(rw.graph.params) == ["b", "e", "e.T.panels", "q.panels", "qb", "w.T.panels"]
    assert rw.graph.params["w.T.panels"].shape == (2, 4, 32) and rw.graph.params["q.panels"].shape == (2, 1, 4, 32)
    products = [n for n in rw.graph.nodes if n.op == "panel_matmul"]
    assert not [n for n in rw.graph.nodes if n.op == "matmul"]
    assert sorted(len(n.inputs) for n in products) == [2, 2, 3, 3, 3]   # kept's and the head's: no bias
    assert [n.op for n in rw.graph.nodes].count("add") == 1             # kept + b
    extra = panel_params(rw.graph, params)
    assert extra["w.T.panels"].tobytes() == to_panels(params["w"].T, 32).tobytes()
    assert extra["q.panels"].tobytes() == to_panels(params["q"], 32).tobytes()
    assert panel_params(rw.graph, {**params, **extra}) == {}           # nothing left to take
    got = REF.compile(rw.graph, rw.outputs).run(feeds, {**params, **extra})
    want = REF.compile(g, outs).run(feeds, params)
    for a, c in zip(got, want):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-14)
    # a product of a non-param, a transpose of other axes, a bias of another shape: left as they are
    v = g.input("v", (4, 40), "float64")
    other = [x @ v + b, g.input("y", (4, 3, 2), "float64") @ gl.transpose(q, (1, 0, 2)),
             x @ gl.transpose(w) + g.param("rows", (3, 40), "float64")]
    rw2 = passes.rewrite(g, other, PANEL_WEIGHTS)
    assert [n.op for n in rw2.graph.nodes].count("add") == 2 and "rows" in rw2.graph.params
    taken = g.param("w.T.panels", (2, 4, 32), "float64")   # a param of the panels' name already
    assert passes.rewrite(g, [x @ gl.transpose(w) + gl.sum(taken)], PANEL_WEIGHTS).graph is g


def test_panel_weights_leaves_a_weight_past_its_max_bytes(monkeypatch):
    from graphlm.passes import panel_weights
    g = gl.Graph("big")
    x = g.input("x", (2, 4))
    small, big = g.param("small", (6, 4)), g.param("big", (12, 6))   # 96 and 288 bytes
    outs = [(x @ gl.transpose(small)) @ gl.transpose(big)]
    monkeypatch.setattr(panel_weights, "MAX_BYTES", 96)
    assert sorted(passes.rewrite(g, outs, PANEL_WEIGHTS).graph.params) == ["big", "small.T.panels"]
    monkeypatch.setattr(panel_weights, "MAX_BYTES", 95)
    assert passes.rewrite(g, outs, PANEL_WEIGHTS).graph is g


def test_a_generator_reads_weights_in_the_layout_of_its_executor():
    """The numpy executor's Generator reads W.T, the native one's W.panels (its kernels read
    panels best); both taken once from the params given, which stay shared, not copied."""
    from graphlm.models import GPT, GPTConfig
    from graphlm.sample import Generator
    pytest.importorskip("graphlm.executors.native").library()
    model = GPT(GPTConfig(vocab_size=11, context_length=8, channels=16, head_count=2, layer_count=1, dropout=0.0))
    params = model.init(seed=2)
    tokens = np.array([[1, 2, 3], [4, 5, 6]])
    want = model.logits(params, tokens, executor="reference")[:, -1]
    layouts = {}
    for executor in ("numpy", "native"):
        gen = Generator(model, params, batch_size=2, executor=executor)
        decode = gen._graphs[None][0]
        layouts[executor] = sorted(k.rsplit(".", 2)[-1] if "panels" in k else k.rsplit(".", 1)[-1]
                                   for k in decode.params if k not in params)
        assert all(gen.state[k] is v for k, v in params.items())
        np.testing.assert_allclose(gen.prefill(tokens), want, rtol=1e-5, atol=1e-6)
    assert layouts["numpy"] == ["T"] * 4                              # three Linears and the head
    assert layouts["native"] == ["panels"] * 5                        # and the qkv weight, read as it is


def test_a_rule_that_changes_the_shape_is_refused():
    g = gl.Graph("bad")
    x = g.input("x", (3, 4))
    y = gl.tanh(x)
    wrong = passes.Pass("wrong", (passes.Rule("tanh to a sum", ("tanh",),
                                              lambda n, ctx: ctx.emit("sum", (ctx.new(n.inputs[0]),), axes=(0,),
                                                                      keepdims=False)),))
    with pytest.raises(GraphError, match=r"pass wrong, rule tanh to a sum: replaced tanh .* by sum"):
        passes.rewrite(g, [y], wrong)


def test_unknown_pipeline_is_named():
    g = gl.Graph("p")
    x = g.input("x", (2,))
    with pytest.raises(ValueError, match="unknown pass pipeline 'fast'; known: native, none, numpy"):
        passes.run_pipeline("fast", g, [gl.tanh(x)])
    rw = passes.run_pipeline("none", g, [x])
    assert rw.graph is g and rw.passes == ()


def test_executors_declare_their_pipeline():
    assert executors.get("numpy").pipeline == "numpy" and executors.get("reference").pipeline == "none"
    assert passes.PIPELINES["numpy"] == (MATMUL_SUM, SLICE_GRADIENTS, ATTENTION_SOFTMAX, DROPOUT_MASKS, KEPT_VALUES)
    from graphlm.passes.kept_values import KEPT_STATISTICS
    assert executors.get("native").pipeline == "native"
    assert passes.PIPELINES["native"] == (MATMUL_SUM, SLICE_GRADIENTS, ATTENTION_SOFTMAX, DROPOUT_MASKS, KEPT_STATISTICS,
                                          MATMUL_ACCUMULATE, AFFINE_GRADS, RESIDUAL_NORM_BACKWARD, BIAS_DROPOUT_ADD,
                                          BIAS_GELU, MERGED_HEADS)
    assert [r.name for r in KEPT_STATISTICS.rules] == [r.name for r in KEPT_VALUES.rules if "GELU" not in r.name]


def test_render_draws_the_graph_after_a_pipeline(tmp_path, capsys):
    from graphlm.tools import cli
    config = '{"preset": "tinylm", "layer_count": 1, "context_length": 16, "dropout": 0.1}'
    before, after = tmp_path / "before.dot", tmp_path / "after.dot"
    assert cli.main(["render", "--config", config, "--graph", "train", "--depth", "9", "--out", str(before)]) == 0
    assert cli.main(["render", "--config", config, "--graph", "train", "--depth", "9", "--passes", "numpy",
                     "--out", str(after)]) == 0
    capsys.readouterr()
    assert "dropout_keep" not in before.read_text() and "dropout_apply" not in before.read_text()
    assert "dropout_keep" in after.read_text() and "dropout_apply" in after.read_text()
    with pytest.raises(SystemExit):
        cli.main(["render", "--config", config, "--passes", "fast", "--out", str(after)])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
