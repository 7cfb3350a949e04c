"""The native executor (the numpy executor with C kernels) against the reference and numpy executors.

- the C exp within 2 ulp of float64's exp over float32's range, and its edges (inf, NaN, underflow);
- every op case of tests/test_ops.py, forward and gradients, on the reference's tolerances;
- each native kernel (GELU, layer norm, attention, dropout, AdamW) on shapes that hit its
  fallbacks, 1-3 threads, against the reference; dropout and AdamW bit for bit with numpy;
- GPT training steps against the reference, on 1 and 2 threads (bit-identical to each other);
- building: the cached library is reused, a missing or failing compiler is named in the error
  and leaves nothing half-written.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm.executors import native
from graphlm.executors import numpy as numpy_executor
from graphlm.passes import PIPELINES
from graphlm.passes.bias_gelu import BIAS_GELU
from graphlm.testing import assert_close, feeds_of
from tests.test_fast_kernels import train_steps
from tests.test_numpy_executor import _peak_allocation, compare, gpt_step, graph_with_grads, random_dag
from tests.test_ops import PARAMS, inputs_of

NATIVE = executors.get("native")
NUMPY = executors.get("numpy")
REF = executors.get("reference")
pytestmark = pytest.mark.usefixtures("native")   # skipped without a C compiler (failed in CI)


def run_all(graph, outputs, feeds, state=None):
    """(native program, native results, numpy results, reference results)."""
    prog = NATIVE.compile(graph, outputs, poison=True)
    got = prog.run(feeds, state)
    return (prog, got, NUMPY.compile(graph, outputs).run(feeds, state),
            REF.compile(graph, outputs).run(feeds, state))


def close32(actual, expected, what, rtol=2e-5, atol=2e-6):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, what
        assert_close(a, e, rtol, atol, f"{what}[{i}]")


# -- the exp ---------------------------------------------------------------------------------------------

def c_exp(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty_like(x)
    native.library().gl_exp(x.ctypes.data, y.ctypes.data, x.size)
    return y


def test_exp_is_within_two_ulp_of_float64_over_the_float32_range():
    x = np.concatenate([np.linspace(-87.3, 88.3, 1_000_003, dtype=np.float32),
                        np.random.default_rng(0).standard_normal(100_000).astype(np.float32)])
    y = c_exp(x)
    want = np.exp(x.astype(np.float64))
    ulp = np.abs(y - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulp.max() <= 2.0, f"worst {ulp.max():.2f} ulp at x = {x[np.argmax(ulp)]}"
    assert y.dtype == np.float32


def test_exp_edges_inf_nan_and_underflow():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 89.0, 1e30, -88.0, -1e30, 88.3], np.float32)
    y = c_exp(x)
    assert np.isnan(y[0])
    np.testing.assert_array_equal(y[1:], [np.inf, 0.0, 1.0, 1.0, np.inf, np.inf, 0.0, 0.0,
                                          np.float32(np.exp(np.float64(x[-1])))])


def row_sum_order(x: np.ndarray) -> np.float32:
    """kernels.h's row_sum restated in float32: 16 lane sums over the whole chunks, the tail
    summed from 0, then the lanes added to it one by one."""
    whole = x.size // 16 * 16
    lanes = np.zeros(16, np.float32)
    for i in range(0, whole, 16):
        lanes = lanes + x[i:i + 16]
    s = np.float32(0.0)
    for v in list(x[whole:]) + list(lanes):
        s = np.float32(s + v)
    return s


@pytest.mark.parametrize("rows,cols,r0", [(64, 128, 64), (37, 40, 3), (5, 21, 16), (20, 9, 0)])
def test_causal_softmax_block_rounds_as_row_sum(rows, cols, r0):
    """gl_causal_softmax_block (the C attention's forward step) on two score matrices: each row's
    largest E is exp(0) = 1, E is 0 above the diagonal (keys past r0 + i), and l is row_sum's sum
    of the row's E in row_sum's order to the bit, whatever the row's length (its rows' sums run
    side by side, 16 at a time)."""
    rng = np.random.default_rng(6)
    s = (rng.standard_normal((2, rows, cols)) * 4).astype(np.float32)
    l = np.full((2, rows), np.nan, np.float32)
    native.library().gl_causal_softmax_block(s.ctypes.data, l.ctypes.data, 2, rows, cols, r0, rows)
    for m in range(2):
        for i in range(rows):
            n = min(r0 + i + 1, cols)
            assert s[m, i, :n].max() == 1.0 and not s[m, i, n:].any(), (m, i)
            assert l[m, i].tobytes() == row_sum_order(s[m, i, :n]).tobytes(), (m, i, n)


# -- every op case ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case,k", PARAMS)
def test_op_cases_match_reference(case, k, dtype):
    arrays = [a.astype(dtype) if a.dtype.kind == "f" else a for a in inputs_of(case, k)]
    g, outputs = graph_with_grads(case.f, arrays, case.grad or case.fd)
    prog, got, mid, want = run_all(g, outputs, feeds_of(arrays))
    what = f"{case.name}-{k} {dtype}"
    if dtype == "float64":   # no native kernel takes float64: the numpy executor's results exactly
        compare(got, mid, True, what)
    if prog.rounds_like_reference or dtype == "float64":
        compare(got, want, prog.rounds_like_reference, what)
    else:
        close32(got, want, what)


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_random_float32_dags_match_reference(seed):
    g, outputs, feeds, state = random_dag(seed, "float32")
    prog, got, _, want = run_all(g, outputs, feeds, state)
    close32(got, want, f"dag {seed}")


# -- each kernel, on its fast path and its fallbacks ----------------------------------------------------------

@pytest.fixture
def small_pieces(monkeypatch):
    """Split every native kernel over threads, however small (pieces of 64 elements or one row)."""
    monkeypatch.setattr(native.team, "MIN_SPLIT", 1)


def _threads(n):
    numpy_executor.set_threads(n)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 64, 96), (1,)])
def test_gelu_and_exp_forward_and_backward(small_pieces, shape, threads):
    rng = np.random.default_rng(1)
    g = gl.Graph("gelu")
    x = g.input("x", shape, np.float32)
    y = gl.gelu(x, approximate="tanh")
    loss = gl.sum(y * y) + gl.sum(gl.exp(x * 0.5))
    outputs = [y, gl.exp(x)] + gl.grad(loss, [x])
    feeds = {"x": (rng.standard_normal(shape) * 4).astype(np.float32)}
    _threads(threads)
    prog, got, _, want = run_all(g, outputs, feeds)
    assert {"gelu", "gelu_backward", "exp"} <= prog.native_ops()   # the sigmoid recomputed, not kept
    assert not prog.rounds_like_reference
    close32(got, want, "gelu")
    kept = KeepingSigmoid(g, outputs)   # the numpy pipeline's kept sigmoid, on the same C kernels
    assert {"gelu_sigmoid", "gelu_backward_sigmoid"} <= kept.native_ops()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(kept.run(feeds), got))


class KeepingSigmoid(native.NativeProgram):
    """The native program on the numpy executor's pipeline, whose tanh GELU keeps its sigmoid."""
    pipeline = "numpy"


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 3])
def test_adds_products_sums_and_copies_in_c_give_numpys_bits(small_pieces, threads, monkeypatch):
    """add and mul (same shape, a row vector, a [G, 1, C] bias, a [T, C] table, the broadcast
    operand first), sums over outer axes (rows, two axes, the middle axis per group, the first of
    three), a reshape of a transposed view and slices_assemble of transposed gradients run in C
    (gl_binary_rows, gl_sum_rows, gl_copy_rows) and give the numpy executor's (the reference's)
    bits, -0.0 included, on any cut over threads; a broadcast along the last axis or a sum over
    the last axis takes the numpy kernel."""
    rng = np.random.default_rng(11)
    b, t, h, d = 2, 5, 3, 4
    g = gl.Graph("memory_bound")
    x = g.input("x", (b, t, h * d), np.float32)
    w = g.input("w", (3, b * t, h * d), np.float32)
    row, grp, tab = (g.input(n, s, np.float32) for n, s in (("row", (h * d,)), ("grp", (3, 1, h * d)),
                                                             ("tab", (t, h * d))))
    col = g.input("col", (b, t, 1), np.float32)
    heads = gl.transpose(gl.reshape(x, (b, t, h, d)), (0, 2, 1, 3))              # [b, h, t, d], a view
    merged = gl.reshape(gl.transpose(heads * 2.0, (0, 2, 1, 3)), (b, t, h * d))   # a copy of strided rows
    parts = [gl.transpose(gl.reshape(w[i], (b, t, h, d)), (0, 2, 1, 3)) for i in range(3)]
    u = g.const(rng.standard_normal((b, h, t, d)).astype(np.float32))
    loss = gl.sum(parts[0] * u) + gl.sum(parts[1] * parts[1]) + gl.sum(gl.exp(parts[2]))
    outputs = [x + x, x * x, x + row, row * x, w + grp, x + tab, x * col, merged,
               gl.sum(x, axis=0), gl.sum(x, axis=(0, 1)), gl.sum(w, axis=1, keepdims=True), gl.sum(w, axis=0),
               gl.sum(x, axis=2)] + gl.grad(loss, [w])
    feeds = {n: rng.standard_normal(v.shape).astype(np.float32)
             for n, v in (("x", x), ("w", w), ("row", row), ("grp", grp), ("tab", tab), ("col", col))}
    feeds["x"].reshape(-1)[::7] = -0.0    # (+0 from a sum or the assembly's x + 0, -0 from a copy)
    feeds["w"].reshape(-1)[::5] = -0.0
    feeds["w"][:, :, 0] = -0.0            # a column of -0 only: NumPy's sums start from +0, so +0
    feeds["x"][:, :, 1] = -0.0
    _threads(threads)
    prog, got, mid, want = run_all(g, outputs, feeds)
    assert {"add", "mul", "sum", "reshape", "slices_assemble"} <= prog.native_ops()
    assert any(n.op == "slices_assemble" for n in prog._step_nodes)
    for i, (a, m, r) in enumerate(zip(got, mid, want)):
        assert a.tobytes() == m.tobytes(), f"output {i} differs from the numpy executor's bits"
        if i != len(got) - 1:   # (the gradient goes through exp: the native exp rounds its own way)
            assert a.tobytes() == r.tobytes(), f"output {i} differs from the reference's bits"


@pytest.mark.threads
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("shape", [(5, 10, 12), (3, 7, 40), (2, 9, 100)])
def test_group_sums_cut_across_groups_give_numpys_bits(small_pieces, threads, shape):
    """A sum over the middle axis of [G, R, C] (a QKV bias's gradient) cuts the groups' columns
    laid end to end over the threads (gl_sum_rows): a piece may end inside one group and go on
    into the next; each column still sums its rows in order from +0, the reference's bits."""
    rng = np.random.default_rng(15)
    g = gl.Graph("group_sums")
    w = g.input("w", shape, np.float32)
    feeds = {"w": rng.standard_normal(shape).astype(np.float32)}
    feeds["w"][:, :, 1] = -0.0   # a column of -0 only: +0
    _threads(threads)
    prog, got, mid, want = run_all(g, [gl.sum(w, axis=1, keepdims=True)], feeds)
    assert "sum" in prog.native_ops()
    assert got[0].tobytes() == mid[0].tobytes() == want[0].tobytes()


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 3])
def test_a_residual_update_in_c_gives_the_patterns_bits(small_pieces, threads):
    """r + dropout(m + b) (m a product's rows, regrouped), fused by the native pipeline into one C
    pass (gl_bias_dropout_add, its rows cut over threads), gives the numpy executor's and the
    reference's bits."""
    rng = np.random.default_rng(13)
    g = gl.Graph("residual")
    r, m = g.input("r", (2, 7, 24), np.float32), g.input("m", (14, 24), np.float32)
    b = g.param("b", (24,), np.float32)
    key = g.input("key", (), np.int64)
    outputs = [r + gl.dropout(gl.reshape(m + b, (2, 7, 24)), 0.2, key, stream=4)]
    feeds = {"r": rng.standard_normal((2, 7, 24)).astype(np.float32),
             "m": rng.standard_normal((14, 24)).astype(np.float32), "key": np.asarray(11, np.int64)}
    state = {"b": rng.standard_normal(24).astype(np.float32)}
    _threads(threads)
    prog, got, mid, want = run_all(g, outputs, feeds, state)
    assert "bias_dropout_add" in prog.native_ops()
    assert got[0].tobytes() == mid[0].tobytes() == want[0].tobytes()


class WithoutBiasGelu(native.NativeProgram):
    """The native program without the bias_gelu pass: the pattern it fuses, on the same C kernels."""
    pipeline = tuple(p for p in PIPELINES["native"] if p is not BIAS_GELU)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 3])
def test_an_mlp_bias_with_its_gelu_in_c_gives_the_patterns_bits(small_pieces, threads):
    """gelu(m + b) and its backward (m a product's rows, regrouped), fused by the native pipeline
    into C passes that form m + b where they read it (gl_bias_gelu_tanh and its backward, rows cut
    over threads), give the pattern's bits on the same C kernels, m + b never stored; and the
    reference's values."""
    rng = np.random.default_rng(14)
    g = gl.Graph("mlp")
    x = g.input("x", (2, 7, 5), np.float32)
    w, b = g.param("w", (5, 40), np.float32), g.param("b", (40,), np.float32)
    y = gl.gelu(gl.reshape(gl.reshape(x, (14, 5)) @ w + b, (2, 7, 40)), approximate="tanh")
    u = g.const(rng.standard_normal((2, 7, 40)).astype(np.float32))
    outputs = [y] + gl.grad(gl.sum(y * u), [x, w, b])
    feeds = {"x": (rng.standard_normal((2, 7, 5)) * 2).astype(np.float32)}
    state = {"w": rng.standard_normal((5, 40)).astype(np.float32),
             "b": rng.standard_normal(40).astype(np.float32)}
    _threads(threads)
    prog, got, _, want = run_all(g, outputs, feeds, state)
    assert {"bias_gelu", "bias_gelu_backward"} <= prog.native_ops()
    assert not any(n.op in ("add", "gelu", "gelu_backward") for n in prog._step_nodes)   # m + b never stored
    pattern = WithoutBiasGelu(g, outputs)
    assert {"add", "gelu", "gelu_backward"} <= pattern.native_ops(state)
    for i, (a, p) in enumerate(zip(got, pattern.run(feeds, state))):
        assert a.tobytes() == p.tobytes(), f"output {i} differs from the pattern's bits"
    close32(got, want, "bias gelu", rtol=1e-4, atol=1e-5)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm_forward_and_backward(small_pieces, affine, threads):
    rng = np.random.default_rng(2)
    shape = (3, 17, 40)   # rows of 40: two 16-lane runs and a tail
    g = gl.Graph("ln")
    x = g.input("x", shape, np.float32)
    w = g.param("w", (40,), np.float32) if affine[0] else None
    b = g.param("b", (40,), np.float32) if affine[1] else None
    y = gl.layer_norm(x, w, b, eps=1e-5)
    u = g.const(rng.standard_normal(shape).astype(np.float32))
    wrt = [x] + [p for p in (w, b) if p is not None]
    outputs = [y] + gl.grad(gl.sum(y * u), wrt)
    feeds = {"x": (rng.standard_normal(shape) * 3 + 1).astype(np.float32)}
    state = {p.name: rng.standard_normal(40).astype(np.float32) for p in (w, b) if p is not None}
    _threads(threads)
    prog, got, _, want = run_all(g, outputs, feeds, state)
    assert {"layer_norm_keep", "layer_norm_backward_kept"} <= prog.native_ops()
    assert ("affine_grads" in prog.native_ops()) == all(affine)   # the weight's and bias's sums in one pass
    close32(got, want, "layer norm", rtol=1e-4, atol=1e-5)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 3])
def test_affine_grads_in_c_give_the_sums_bits(small_pieces, threads):
    """sum(g * x) and sum(g) over the rows, fused by the native pipeline into one C pass
    (gl_affine_grads, its columns cut over threads), give the reference's bits, -0.0 included."""
    rng = np.random.default_rng(12)
    g = gl.Graph("affine")
    u, v = g.input("u", (3, 7, 45), np.float32), g.input("v", (3, 7, 45), np.float32)
    outputs = [gl.sum(u * v, axis=(0, 1)), gl.sum(u, axis=(0, 1))]
    feeds = {"u": rng.standard_normal((3, 7, 45)).astype(np.float32),
             "v": rng.standard_normal((3, 7, 45)).astype(np.float32)}
    feeds["u"][:, :, 2] = -0.0   # a column of -0 only: the sums start from +0, so +0
    _threads(threads)
    prog, got, mid, want = run_all(g, outputs, feeds)
    assert "affine_grads" in prog.native_ops()
    for a, m, r in zip(got, mid, want):
        assert a.tobytes() == m.tobytes() == r.tobytes()
    # v / d, d one value per row (a layer norm's xhat = xc / sv): divided where the C kernel reads v
    d = g.input("d", (3, 7, 1), np.float32)
    outputs = [gl.sum(u * (v / d), axis=(0, 1)), gl.sum(u, axis=(0, 1))]
    feeds["d"] = rng.uniform(0.3, 3.0, (3, 7, 1)).astype(np.float32)
    prog, got, mid, want = run_all(g, outputs, feeds)
    (fused,) = [n for n in prog.graph.nodes if n.op == "affine_grads"]
    assert len(fused.inputs) == 3 and "div" not in {n.op for n in prog.graph.nodes}
    for a, m, r in zip(got, mid, want):
        assert a.tobytes() == m.tobytes() == r.tobytes()


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2])
def test_a_residual_gradient_added_in_the_c_layer_norm_backward_gives_the_adds_bits(small_pieces, threads, monkeypatch):
    """A pre-norm stack's input gradient, the residual gradient added where each norm's backward
    writes (residual_norm_backward): the bits of the native pipeline without that pass."""
    from tests.test_passes import _pre_norm_stack
    g, outputs, feeds, state = _pre_norm_stack(shape=(3, 5, 40))
    _threads(threads)
    prog, got, _, want = run_all(g, outputs, feeds, state)
    fused = [n for n in prog.graph.nodes if n.op == "layer_norm_backward_kept" and n.attrs.get("residual")]
    assert len(fused) == 2 and "layer_norm_backward_kept" in prog.native_ops()
    close32(got, want, "residual layer norm backward", rtol=1e-4, atol=1e-5)
    monkeypatch.setitem(PIPELINES, "native", tuple(p for p in PIPELINES["native"] if p.name != "residual_norm_backward"))
    apart = NATIVE.compile(g, outputs)
    assert not any(n.attrs.get("residual") for n in apart.graph.nodes)
    for a, b in zip(got, apart.run(feeds, state)):
        assert a.tobytes() == b.tobytes()


def test_unpaired_layer_norm_backward_and_plain_gelu_backward():
    """gl.grad of a graph whose forward is not computed: the backward kernels recompute."""
    rng = np.random.default_rng(3)
    g = gl.Graph("unpaired")
    x = g.input("x", (6, 24), np.float32)
    gy = g.input("gy", (6, 24), np.float32)
    w = g.param("w", (24,), np.float32)
    from graphlm.ops import apply
    outputs = [apply("gelu_backward", (x, gy), approximate="tanh"),
               apply("layer_norm_backward", (x, w, gy), eps=1e-5, has_weight=True, has_bias=False)]
    feeds = {"x": rng.standard_normal((6, 24)).astype(np.float32), "gy": rng.standard_normal((6, 24)).astype(np.float32)}
    prog, got, _, want = run_all(g, outputs, feeds, {"w": rng.standard_normal(24).astype(np.float32)})
    assert prog.native_ops() == {"gelu_backward", "layer_norm_backward"}
    close32(got, want, "unpaired", rtol=1e-4, atol=1e-5)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t", [1, 5, 64, 130])
def test_causal_attention_forward_and_backward(small_pieces, t, threads):
    rng = np.random.default_rng(4)
    shape = (2, 3, t, 8)
    g = gl.Graph("attention")
    q, k, v = (g.input(n, shape, np.float32) for n in "qkv")
    o = gl.causal_attention(q, k, v, scale=0.3)
    u = g.const(rng.standard_normal(shape).astype(np.float32))
    outputs = [o] + gl.grad(gl.sum(o * u), [q, k, v])
    feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}
    _threads(threads)
    prog, got, _, want = run_all(g, outputs, feeds)
    from graphlm.passes.kept_values import keeps_scores
    kept = keeps_scores(shape)   # a long T over D = 8: the scores recomputed
    assert prog.native_ops() == ({"causal_attention_keep", "causal_attention_backward_kept"} if kept
                                 else {"causal_attention", "causal_attention_backward"})
    close32(got, want, "attention", rtol=1e-4, atol=1e-5)


@pytest.mark.threads
@pytest.mark.parametrize("products_in_c", [True, False])
@pytest.mark.parametrize("query_block", [64, 16, 5])
def test_causal_attention_whole_in_c_matches_the_reference_and_any_cut(monkeypatch, query_block, products_in_c):
    """The kept-scores pair runs whole in C (gl_causal_attention and _backward, their products in C
    or as NumPy's BLAS calls) on q, k, v with matrix strides (views of one fused QKV), in one query block
    or several uneven ones: within float32 rounding of the reference, the same bits on 1 thread
    and cut in matrix ranges on 2 and 3, no masked score read (NaN-poisoned arena); without a
    BLAS sgemm to call it falls back to the numpy kernel with C steps."""
    from graphlm.passes import kept_values
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", query_block)
    monkeypatch.setattr(kept_values, "KEEP_SCORES_PER_OUTPUT", 10)
    monkeypatch.setattr(native.attention, "MIN_TEAM_ATTENTION_FLOPS", 0)
    monkeypatch.setattr(native.attention, "ATTENTION_PRODUCTS_IN_C", products_in_c)
    rng = np.random.default_rng(6)
    b, h, t, d = 2, 3, 37, 8
    g = gl.Graph("attention_c")
    x = g.input("x", (b, t, 3 * h * d), np.float32)
    q, k, v = (gl.transpose(gl.reshape(x[:, :, i * h * d:(i + 1) * h * d], (b, t, h, d)), (0, 2, 1, 3)) for i in range(3))
    o = gl.causal_attention(q, k, v, scale=0.35)
    u = g.const(rng.standard_normal(o.shape).astype(np.float32))
    outputs = [o] + gl.grad(gl.sum(o * u), [x])
    feeds = {"x": rng.standard_normal((b, t, 3 * h * d)).astype(np.float32)}
    prog = NATIVE.compile(g, outputs, poison=True)
    runs = []
    for threads in (1, 2, 3):
        _threads(threads)
        runs.append(prog.run(feeds))
    in_c = [n.op for n, step in zip(prog._step_nodes, prog._steps) if "attention" in n.op and hasattr(step, "tables")]
    assert sorted(in_c) == ["causal_attention_backward_kept", "causal_attention_keep"]
    want = REF.compile(g, outputs).run(feeds)
    close32(runs[0], want, "attention in C", rtol=1e-5, atol=1e-6)
    for other in runs[1:]:
        assert all(a.tobytes() == c.tobytes() for a, c in zip(runs[0], other))
    monkeypatch.setattr(native.attention, "blas_sgemm", lambda: None)
    fallback = NATIVE.compile(g, outputs, poison=True)
    close32(fallback.run(feeds), runs[0], "numpy kernel with C steps", rtol=1e-5, atol=1e-6)
    assert not any(hasattr(step, "tables") for n, step in zip(fallback._step_nodes, fallback._steps) if "attention" in n.op)


# -- cross entropy and the embedding gradient ----------------------------------------------------------

def _lm_head_graph(n, v, dim):
    """Embedding, a head tied to the table, cross entropy, and the gradients of both inputs."""
    g = gl.Graph("lm_head")
    x = g.input("x", (n, dim), np.float32)
    ids, targets = g.input("ids", (n,), np.int64), g.input("targets", (n,), np.int64)
    table = g.param("table", (v, dim), np.float32)
    loss = gl.cross_entropy((x + gl.embedding(table, ids)) @ gl.transpose(table, (1, 0)), targets)
    return g, [loss] + gl.grad(loss * 3.0, [x, table])


def _embedding_gradient_graph(n, v, dim):
    """The table's gradient of sum(embedding(table, ids) * u): an embedding_backward alone."""
    g = gl.Graph("embedding_grad")
    table = g.param("table", (v, dim), np.float32)
    ids, u = g.input("ids", (n,), np.int64), g.input("u", (n, dim), np.float32)
    (dt,) = gl.grad(gl.sum(gl.embedding(table, ids) * u), [table])
    return g, dt


@pytest.mark.threads
@pytest.mark.parametrize("n, v", [(300, 37), (2048, 256)])
def test_cross_entropy_and_the_embedding_gradient_in_c(n, v):
    """Cross entropy and its gradient within float32 rounding of the reference (C exp), the same
    bits on 1 and 2 threads; the embedding gradient, ids repeated many times, the numpy kernel's
    bits (np.add.at's order)."""
    rng = np.random.default_rng(8)
    dim = 24
    g, outputs = _lm_head_graph(n, v, dim)
    feeds = {"x": rng.standard_normal((n, dim)).astype(np.float32), "ids": rng.integers(0, 5, n),
             "targets": rng.integers(0, v, n)}
    state = {"table": rng.standard_normal((v, dim)).astype(np.float32)}
    runs = []
    for threads in (1, 2):
        _threads(threads)
        prog, got, numpy_got, want = run_all(g, outputs, feeds, state)
        runs.append(got)
    assert {"cross_entropy", "cross_entropy_backward", "embedding_backward"} <= prog.native_ops()
    close32(got, want, "lm head")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))
    # the embedding gradient alone, native against numpy, bit for bit
    g2, dt = _embedding_gradient_graph(n, v, dim)
    f2 = {"ids": rng.integers(0, 7, n), "u": rng.standard_normal((n, dim)).astype(np.float32)}
    for threads in (1, 2):
        _threads(threads)
        prog2 = NATIVE.compile(g2, [dt], poison=True)
        assert "embedding_backward" in prog2.native_ops(state)
        (a,) = prog2.run(f2, state)
        (b,) = NUMPY.compile(g2, [dt]).run(f2, state)
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("bad", [-1, 37])
def test_cross_entropy_and_the_embedding_gradient_in_c_refuse_out_of_range_ids(bad):
    rng = np.random.default_rng(9)
    n, v, dim = 64, 37, 8
    g, (loss, dx, _) = _lm_head_graph(n, v, dim)
    state = {"table": rng.standard_normal((v, dim)).astype(np.float32)}
    good = {"x": rng.standard_normal((n, dim)).astype(np.float32), "ids": rng.integers(0, v, n),
            "targets": rng.integers(0, v, n)}
    g2, dt = _embedding_gradient_graph(n, v, dim)
    good2 = {"ids": good["ids"], "u": rng.standard_normal((n, dim)).astype(np.float32)}
    for graph, outputs, fed, key, op, what in ((g, [loss], good, "targets", "cross_entropy", "target"),
                                               (g, [dx], good, "targets", "cross_entropy_backward", "target"),
                                               (g2, [dt], good2, "ids", "embedding_backward", "token id")):
        prog = NATIVE.compile(graph, outputs)
        assert op in prog.native_ops(state)
        feeds = dict(fed, **{key: np.where(np.arange(n) == 5, bad, fed[key])})
        before = state["table"].copy()
        with pytest.raises(ValueError, match=rf"{op} \({op}#\d+ in .*\): {what} {bad} is out of range \[0, {v}\)"):
            prog.run(feeds, state)
        np.testing.assert_array_equal(state["table"], before)


def _dropout_graph(shape, p):
    g = gl.Graph("dropout")
    x = g.input("x", shape, np.float32)
    key = g.input("key", (), np.int64)
    y = gl.dropout(x, p, key, stream=3)
    u = g.const(np.random.default_rng(5).standard_normal(shape).astype(np.float32))
    return g, [y] + gl.grad(gl.sum(y * u), [x])


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape,p", [((7, 9), 0.5), ((4, 300), 0.1), ((2, 2), 0.9)])
def test_dropout_is_bit_identical_to_numpy(small_pieces, shape, p, threads):
    g, outputs = _dropout_graph(shape, p)
    feeds = {"x": np.random.default_rng(6).standard_normal(shape).astype(np.float32),
             "key": np.asarray(77, np.int64)}
    _threads(threads)
    prog, got, mid, want = run_all(g, outputs, feeds)
    assert prog.native_ops() == {"dropout_keep", "dropout_apply"}
    compare(got, mid, True, "dropout vs numpy")
    compare(got, want, True, "dropout vs reference")


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_global_norm_in_c_gives_the_references_bits(threads):
    """The gradients' dots by NumPy's OpenBLAS sdot, shared out by size on the team, added in
    input order: the reference's norm bit for bit (a scalar, zeros, gradients of 5 to 2112
    elements); a transposed view, which the C kernel does not take, runs the numpy kernel."""
    rng = np.random.default_rng(33)
    shapes = [(40, 50), (7,), (), (64, 33), (5,), (30, 70), (1000,)]
    g = gl.Graph("norm")
    xs = [g.input(f"g{i}", s, np.float32) for i, s in enumerate(shapes)]
    feeds = {x.name: (rng.standard_normal(x.shape) * rng.uniform(0.1, 30)).astype(np.float32) for x in xs}
    feeds["g4"][:] = 0.0
    dots = np.array([np.dot(v.reshape(-1), v.reshape(-1)) for v in feeds.values()], np.float32)
    norm = np.sqrt(np.add.accumulate(dots)[-1])   # (depends on the order; float64 sums round otherwise)
    assert norm != np.sqrt(np.add.accumulate(dots[::-1])[-1]) and norm != np.sqrt(np.float32(dots.astype(np.float64).sum()))
    assert len(numpy_executor.tiling.size_groups([x.size for x in xs], threads)) == threads   # the team splits them
    _threads(threads)
    prog, got, _, want = run_all(g, [gl.ops.global_norm(xs)], feeds)
    assert prog.native_ops() == {"global_norm"}
    assert got[0].dtype == np.float32 and got[0].tobytes() == want[0].tobytes()
    assert got[0] == pytest.approx(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in feeds.values())), rel=1e-5)
    some = {k: feeds[k] for k in ("g0", "g3")}
    prog, got, _, want = run_all(g, [gl.ops.global_norm([gl.transpose(xs[0], (1, 0)), xs[3]])], some)
    assert "global_norm" not in prog.native_ops() and got[0].tobytes() == want[0].tobytes()


def _adamw_run(executor, shapes, steps=3):
    from graphlm.optim import AdamW
    rng = np.random.default_rng(7)
    g = gl.Graph("adamw")
    x = g.input("x", (4, shapes[0][0]), np.float32)
    params = [g.param(f"p{i}", s, np.float32) for i, s in enumerate(shapes)]
    h = x
    for p in params:
        h = gl.tanh(h @ p) if p.ndim == 2 else h + p
    loss = gl.mean(h * h)
    opt = AdamW(lr=1e-2, weight_decay=0.1, clip_norm=0.5)
    step = opt.minimize(loss)
    prog = executors.get(executor).compile(g, [loss, step.grad_norm, step.update])
    state = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in params}
    state.update(opt.init_state())
    feeds = {"x": rng.standard_normal((4, shapes[0][0])).astype(np.float32)}
    losses = [prog.run({**feeds, **opt.feeds(s)}, state)[0] for s in range(steps)]
    return losses, state, prog


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2])
def test_adamw_is_bit_identical_to_numpy(threads, monkeypatch):
    shapes = [(6, 5), (5,), (5, 5), (5,), (5, 6)]
    monkeypatch.setattr(native.products, "SMALL_ROWS", 0)   # the products in BLAS, as the numpy executor's
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", False)
    _threads(threads)
    la, sa, prog = _adamw_run("native", shapes)
    lb, sb, _ = _adamw_run("numpy", shapes)
    assert "adamw_update" in prog.native_ops()
    compare(la, lb, True, "losses")
    assert sa.keys() == sb.keys()
    assert [k for k in sa if sa[k].tobytes() != sb[k].tobytes()] == []


@pytest.mark.threads
@pytest.mark.skipif(not native.team.CALLS_BY_CLASS, reason="kernel call pieces need System V x86-64 or AAPCS64")
def test_kernel_calls_run_on_the_team_with_the_bits_of_one_call():
    """A kernel call as team pieces (team.c, kind 5) finds every argument where its C type
    puts it: layer norm's ten (three integer words past x86-64's six registers, then a float),
    the GELU backward's four floats, the dropout draw's 64-bit threshold past 2^63 and its run's
    stream start read through an address. Three pieces give the bits of one call."""
    import functools
    lib, rng = native.library(), np.random.default_rng(5)
    rows, cols = 37, 48
    ptr = lambda a: a.ctypes.data

    def same_bits(make, outputs, units):
        make(0, units)()
        whole = [o.copy() for o in outputs]
        for o in outputs:
            o[...] = np.nan
        cuts = [(0, 5), (5, units // 2), (units // 2, units)]
        pieces = [native.team.call_piece(make(lo, hi)) for lo, hi in cuts]
        assert None not in pieces and {p[0] for p in pieces} == {5}
        table = native.team.team_table(pieces)
        lib.gl_team_run(ptr(table), len(table))
        return all(a.tobytes() == b.tobytes() for a, b in zip(whole, outputs))

    x, w, b = (rng.standard_normal(n).astype(np.float32) for n in (rows * cols, cols, cols))
    y, xc, xhat = (np.empty(rows * cols, np.float32) for _ in range(3))
    sv = np.empty(rows, np.float32)
    at = lambda a, per, lo: ptr(a) + 4 * per * lo
    norm = lambda lo, hi: functools.partial(lib.gl_layer_norm, at(x, cols, lo), ptr(w), ptr(b), at(y, cols, lo),
                                            at(xc, cols, lo), at(sv, 1, lo), at(xhat, cols, lo), hi - lo, cols, 1e-5)
    assert same_bits(norm, [y, xc, sv, xhat], rows)
    n = rows * cols
    g, out = rng.standard_normal(n).astype(np.float32), np.empty(n, np.float32)
    gelu = lambda lo, hi: functools.partial(lib.gl_gelu_tanh_backward, at(x, 1, lo), at(g, 1, lo), None, at(out, 1, lo),
                                            hi - lo, gl.ops.GELU_A, gl.ops.GELU_B, gl.ops.GELU_DA, gl.ops.GELU_DB)
    assert same_bits(gelu, [out], n)
    mask, base = np.empty(n, np.bool_), np.array([0x9E3779B97F4A7C15], np.uint64)
    threshold = numpy_executor.dropout.keep_threshold(0.9)
    assert threshold >= 1 << 63
    draw = lambda lo, hi: functools.partial(lib.gl_dropout_draw, ptr(mask), ptr(x), ptr(out), lo, hi, ptr(base),
                                            threshold, 10.0)
    assert same_bits(draw, [mask, out], n) and 0.05 < mask.mean() < 0.15
    # what cannot be a piece: another argument type (AdamW's int, 9 floats), too many words, no partial
    assert native.team.call_piece(functools.partial(lib.gl_adamw, *[0] * 15)) is None
    assert native.team.call_piece(functools.partial(lib.gl_cached_attention, *[0] * 18)) is None
    assert native.team.call_piece(lambda: None) is None


@pytest.mark.threads
def test_a_training_steps_row_kernels_run_on_the_team(monkeypatch, small_pieces):
    """On 2 threads the split C kernels of a training step become team pieces (none of them
    is left to the Python pool), and the step gives the bits of 1 thread."""
    from graphlm.models import GPTConfig
    made, call_piece = [], native.team.call_piece

    def recording(part):   # (the C kernels' calls; a BLAS product's np.matmul is asked too, for a run of steps)
        piece, name = call_piece(part), getattr(getattr(part, "func", None), "__name__", "")
        if name.startswith("gl_"):
            made.append((name, piece is not None))
        return piece
    monkeypatch.setattr(native.team, "call_piece", recording)
    cfg = GPTConfig(vocab_size=256, context_length=64, channels=64, head_count=2, layer_count=1, dropout=0.1)
    g, outputs, feeds, params, _ = gpt_step(8, cfg)
    feeds = {**feeds, "dropout_key": np.asarray(3, np.int64)}
    prog = NATIVE.compile(g, outputs)
    _threads(1)
    one = prog.run(feeds, params)
    _threads(2)
    two = prog.run(feeds, params)
    assert {"gl_bias_gelu_tanh", "gl_bias_gelu_tanh_backward", "gl_layer_norm", "gl_layer_norm_backward",
            "gl_dropout_draw", "gl_dropout_apply", "gl_binary_rows", "gl_sum_rows"} <= {name for name, ok in made}
    assert all(ok for _, ok in made)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(one, two))


def test_float64_and_strided_inputs_take_the_numpy_kernels():
    """A float64 graph gives the numpy executor's results bit for bit, and a transposed (strided)
    input to a native op falls back to the numpy kernel."""
    rng = np.random.default_rng(8)
    g = gl.Graph("fallbacks")
    x = g.input("x", (5, 6), np.float32)
    z = g.input("z", (5, 6), np.float64)
    ys = [gl.exp(gl.transpose(x)), gl.gelu(gl.transpose(x), approximate="tanh"),
          gl.gelu(z, approximate="tanh"), gl.layer_norm(z), gl.gelu(x, approximate="none")]
    feeds = {"x": rng.standard_normal((5, 6)).astype(np.float32), "z": rng.standard_normal((5, 6))}
    prog, got, mid, want = run_all(g, ys, feeds)
    assert prog.native_ops() == set()
    compare(got[2:], mid[2:], True, "float64 and erf")
    close32(got[:2], want[:2], "strided")


# -- GPT training steps -----------------------------------------------------------------------------------------

@pytest.mark.threads
def test_gpt_training_step_matches_reference():
    from graphlm.models import GPTConfig
    cfg = GPTConfig(vocab_size=11, context_length=16, channels=32, head_count=2, layer_count=2)
    g, outputs, feeds, params, _ = gpt_step(3, cfg)
    params = {k: v.astype(np.float32) for k, v in params.items()}
    prog, got, _, want = run_all(g, outputs, feeds, params)
    assert not prog.rounds_like_reference
    assert {"causal_attention_keep", "causal_attention_backward_kept", "bias_gelu", "bias_gelu_backward",
            "layer_norm_keep", "layer_norm_backward_kept"} <= prog.native_ops()
    close32(got, want, "gpt step", rtol=1e-4, atol=1e-5)
    again = prog.run(feeds, params)
    for a, b in zip(got, again):
        np.testing.assert_array_equal(a, b)
    kept = KeepingSigmoid(g, outputs)   # recomputing the GELU's sigmoid changes no bit of the step
    assert all(a.tobytes() == b.tobytes() for a, b in zip(kept.run(feeds, params), got))
    assert kept.plan.arena_bytes > prog.plan.arena_bytes   # and holds no sigmoid


def _train(executor, threads):
    """Three steps with dropout 0.2 (tests/test_fast_kernels.train_steps): (losses, state)."""
    _threads(threads)
    losses, _, state = train_steps(0.2, executor, steps=3)
    return np.array(losses), state


@pytest.mark.threads
def test_training_with_dropout_follows_the_reference_and_threads_change_no_bit(small_pieces):
    ref_losses, ref_state = _train("reference", 1)
    one, state1 = _train("native", 1)
    two, state2 = _train("native", 2)
    np.testing.assert_array_equal(one, two)
    assert [k for k in state1 if state1[k].tobytes() != state2[k].tobytes()] == []
    assert_close(one, ref_losses, 1e-5, 1e-6, "losses")
    # AdamW divides by sqrt(v), so where a gradient is near 0 rounding moves a step by up to
    # lr: parameters are compared to 3 % of the 3 steps' lr (0.01 each). The key bias's gradient
    # is 0 up to rounding (softmax is blind to a shift shared by all keys): not compared.
    for k in ref_state:
        if "qkv_bias" not in k:
            assert_close(state1[k], ref_state[k], 1e-3, 1e-3, k)


@pytest.mark.threads
def test_a_tinylm_step_allocates_almost_nothing_on_one_or_two_threads():
    """The C kernels' calls are built once (raw addresses of planned arrays); a run allocates
    little beyond the outputs it returns, on 1 and on 2 threads."""
    from graphlm.models import GPTConfig
    cfg = GPTConfig(vocab_size=256, context_length=128, channels=192, head_count=6, layer_count=4)
    g, outputs, feeds, params, _ = gpt_step(2, cfg)
    prog = NATIVE.compile(g, outputs)
    for threads in (1, 2):
        _threads(threads)
        prog.run(feeds, params)   # builds the pieces
        allocated = _peak_allocation(lambda: prog.profile(feeds, params))
        assert allocated < 0.05 * prog.plan.arena_bytes, (threads, allocated, prog.plan.arena_bytes)


def test_bad_token_id_fails_clearly_and_leaves_state_alone():
    g, outputs, feeds, params, _ = gpt_step(2)
    prog = NATIVE.compile(g, outputs)
    before = {k: v.copy() for k, v in params.items()}
    bad = dict(feeds, tokens=np.where(feeds["tokens"] == feeds["tokens"][0, 0], 99, feeds["tokens"]))
    with pytest.raises(executors.base.ExecutionError, match="99 is out of range"):
        prog.run(bad, params)
    for k in params:
        np.testing.assert_array_equal(params[k], before[k])


# -- building -----------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A new cache folder and no loaded library (restored afterwards)."""
    monkeypatch.setenv("GRAPHLM_CACHE_DIR", str(tmp_path / "cache"))
    saved = dict(native.build._library)
    native.build._library.clear()
    yield tmp_path / "cache"
    native.build._library.clear()
    native.build._library.update(saved)


def test_the_library_is_built_once_into_the_cache_and_reused(fresh_build, monkeypatch):
    lib = native.library()
    built = list(fresh_build.glob("native-*.so"))
    record = [built[0].with_name(built[0].name + ".json")] if built else []   # its size + sha256
    assert len(built) == 1 and not [p for p in fresh_build.iterdir() if p not in built + record]
    assert isinstance(lib, ctypes.CDLL)
    native.build._library.clear()
    monkeypatch.setattr(native.build, "_compile", lambda *a: pytest.fail("rebuilt a cached library"))
    native.library()


def test_auto_picks_native_where_it_builds_and_numpy_where_not(fresh_build, monkeypatch):
    from graphlm.backends import default_executor, get_executor
    assert default_executor() == "native" and get_executor("auto") is NATIVE
    native.build._library.clear()
    monkeypatch.setenv("CC", "no-such-cc-graphlm")
    assert default_executor() == "numpy" and get_executor("auto") is NUMPY


def test_a_missing_compiler_is_named_and_numpy_still_runs(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-graphlm")
    g = gl.Graph("x")
    x = g.input("x", (2,), np.float32)
    with pytest.raises(native.NativeUnavailable, match="'no-such-cc-graphlm' was not found"):
        NATIVE.compile(g, [gl.exp(x)])
    assert not native.available()
    assert NUMPY.compile(g, [gl.exp(x)]).run({"x": np.zeros(2, np.float32)})[0].tolist() == [1.0, 1.0]


def test_a_failing_compiler_shows_its_command_and_leaves_no_file(fresh_build, monkeypatch, tmp_path):
    fake = tmp_path / "badcc"
    fake.write_text("#!/bin/sh\necho 'badcc: cannot compile today' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(native.NativeUnavailable, match="(?s)could not compile.*cannot compile today"):
        native.library()
    assert not list(fresh_build.glob("*"))


def test_host_flags_the_compiler_refuses_are_dropped_one_set_at_a_time(fresh_build, monkeypatch, tmp_path):
    """On an AVX-512 CPU the build asks for 512-bit vectors first; a compiler that refuses the
    flag builds with -march=native alone (and one that refuses that too, with neither)."""
    import shutil
    log = tmp_path / "calls"
    picky = tmp_path / "picky-cc"
    picky.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\ncase \"$*\" in *-mprefer-vector-width*) "
                     f"echo 'picky-cc: unknown flag' >&2; exit 1;; esac\nexec {shutil.which('cc')} \"$@\"\n")
    picky.chmod(0o755)
    monkeypatch.setenv("CC", str(picky))
    monkeypatch.setattr(native.build, "cpu_flags", lambda: {"avx512f"})
    assert native.build.host_flag_sets() == [("-march=native", "-mprefer-vector-width=512"), ("-march=native",), ()]
    lib = native.library()
    builds = [line for line in log.read_text().splitlines() if "-shared" in line]
    assert ["-mprefer-vector-width=512" in b for b in builds] == [True, False]
    assert "-march=native" in builds[1] and hasattr(lib, "gl_matmul_panels")
    monkeypatch.setattr(native.build, "cpu_flags", lambda: {"avx2"})
    assert native.build.host_flag_sets() == [("-march=native",), ()]


def _kernel_workload():
    """Bytes of what the products' and attention's register blocks compute: a training step's
    loss and gradients (large products in C, causal attention forward and backward; head size
    20, 37 positions: every ragged edge) and greedy decoding's logits at batch 8 and 1 (panel
    and small products, cached attention)."""
    from graphlm.models import GPT, GPTConfig
    from graphlm.sample import Generator
    model = GPT(GPTConfig(vocab_size=64, context_length=40, channels=40, head_count=2, layer_count=1, dropout=0.0))
    params = model.init(7)
    rng = np.random.default_rng(8)
    tokens, targets = rng.integers(0, 64, (3, 37)), rng.integers(0, 64, (3, 37))
    loss, grads = model.loss_and_grads(params, tokens, targets, executor="native")
    out = [np.float32(loss).tobytes()] + [grads[k].tobytes() for k in sorted(grads)]
    for batch in (8, 1):
        gen = Generator(model, params, batch_size=batch, executor="native")
        logits = gen.prefill(rng.integers(0, 64, (batch, 9)))
        for _ in range(5):
            out.append(logits.tobytes())
            logits = gen.decode(np.argmax(logits, axis=-1))
    return out


def test_the_register_blocks_choose_no_bits(fresh_build, monkeypatch):
    """The products' and attention's register blocks are sized for the machine's vectors
    (AVX-512's or AVX2's registers by name, products.c, attention.c); a block only chooses which
    accumulators live in registers together. A library compiled with FMA alone (the plain C
    blocks, as the compiler vectorises them) computes every bit the machine's own library does."""
    if "fma" not in native.build.cpu_flags():
        pytest.skip("the CPU has no FMA")
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", True)
    own = _kernel_workload()
    native.build._library.clear()
    monkeypatch.setattr(native.build, "host_flag_sets", lambda: [("-mfma",)])
    plain = _kernel_workload()
    assert len(own) == len(plain)
    assert [i for i, (a, b) in enumerate(zip(own, plain)) if a != b] == []


def test_a_damaged_cached_library_is_built_again(tmp_path):
    """In new processes (a process that loaded the library keeps it mapped under its name)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, GRAPHLM_CACHE_DIR=str(tmp_path))
    script = ("import numpy as np; from graphlm.executors import native; lib = native.library(); "
              "x = np.zeros(2, np.float32); y = np.empty_like(x); "
              "lib.gl_exp(x.ctypes.data, y.ctypes.data, 2); print(y.tolist())")
    run = lambda: subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run().stdout.strip() == "[1.0, 1.0]"
    (built,) = tmp_path.glob("native-*.so")
    built.write_bytes(b"not a shared library")
    again = run()
    assert again.stdout.strip() == "[1.0, 1.0]", again.stderr
    assert built.stat().st_size > 1000


def test_cc_with_a_wrapper_and_an_unwritable_cache_folder(fresh_build, monkeypatch, tmp_path):
    """CC="env gcc"-style commands work, and a cache path that cannot be a folder (here a file)
    makes the build go to a private temporary folder instead of failing."""
    import shutil
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("GRAPHLM_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("CC", f"env {shutil.which('cc') or 'cc'}")
    lib = native.library()
    x = np.array([0.0, 1.0], np.float32)
    y = np.empty_like(x)
    lib.gl_exp(x.ctypes.data, y.ctypes.data, 2)
    np.testing.assert_allclose(y, [1.0, np.e], rtol=1e-6)
    assert blocker.read_text().startswith("a file")
