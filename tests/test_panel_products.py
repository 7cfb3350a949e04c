"""The native executor's panel products (gl_matmul_panels: graphlm.ops.panel_matmul, a product
whose B is held in column panels, with its bias added as each value is stored) and what they
guarantee:

- every element has the bits of the small products' NN chain (gl_matmul_small) and then of the
  bias add, at every row count, column count (ragged last panels), batch and broadcast layout;
- a row's bits do not depend on the rows around it, the thread count or the cut;
- more rows than the small products take (a long prefill) against float64;
- layouts it does not take run the reference kernel, and give the same values;
- shapes that do not fit are refused when the node is made, with a message naming them;
- a Generator's decode on the native executor gives the bits it gives with W.T in rows.
"""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors
from graphlm.executors import native
from graphlm.executors import numpy as numpy_executor
from graphlm.ir import Graph
from graphlm.models import GPT, GPTConfig
from graphlm.ops import panel_matmul, to_panels
from graphlm.sample import Generator
from tests.test_batched_decode import greedy, small_product

pytestmark = pytest.mark.usefixtures("native")   # skipped without a C compiler (failed in CI)


def panel_product(x, b, bias=None, panels=None):
    """x @ b (+ bias) by the native panel kernel, b given as it is (packed here) or as `panels`."""
    panels = to_panels(b, 32) if panels is None else panels
    batch = np.broadcast_shapes(x.shape[:-2], panels.shape[:-3])
    out = np.full(batch + (x.shape[-2], b.shape[-1]), np.nan, np.float32)
    run = native.products.panel_matmul_closure(x, panels, bias, out)
    assert run is not None, f"the panel kernel did not take {x.shape} @ {b.shape}"
    run()
    return out


def operands(rng, shape_x, shape_b, bias_shape=None):
    x = rng.standard_normal(shape_x).astype(np.float32)
    b = rng.standard_normal(shape_b).astype(np.float32)
    bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
    return x, b, bias


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 14, 15, 16])
@pytest.mark.parametrize("k,n", [(192, 576), (768, 192), (17, 33), (1, 31), (64, 32), (40, 300), (5, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_products_have_the_small_products_bits_then_the_bias_adds(m, k, n, with_bias):
    x, b, bias = operands(np.random.default_rng(m * 7919 + k * 31 + n), (m, k), (k, n), (n,) if with_bias else None)
    want = small_product(x, b)
    if with_bias:
        want = want + bias   # (NumPy's float32 add: one rounding)
    assert panel_product(x, b, bias).tobytes() == want.tobytes()


@pytest.mark.parametrize("shapes", [
    ((1, 8, 192), (3, 192, 192), (3, 1, 192)),    # a decode step's qkv: x broadcast over the weights
    ((3, 5, 64), (64, 40), (40,)),               # the weight broadcast over x's batch
    ((2, 3, 4, 16), (3, 16, 70), (2, 3, 1, 70)),  # two batch axes, one of them broadcast
])
def test_batched_and_broadcast_panel_products(shapes):
    sx, sb, sbias = shapes
    x, b, bias = operands(np.random.default_rng(len(sx) + sb[-1]), sx, sb, sbias)
    want = small_product(x, b) + bias
    assert panel_product(x, b, bias).tobytes() == want.tobytes()


def test_non_contiguous_rows_of_x_and_out():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 50)).astype(np.float32)[:, 3:43]   # rows 50 floats apart
    b = rng.standard_normal((40, 70)).astype(np.float32)
    wide = np.full((6, 90), np.nan, np.float32)
    out = wide[:, 10:80]
    run = native.products.panel_matmul_closure(x, to_panels(b, 32), None, out)
    assert run is not None
    run()
    assert out.tobytes() == small_product(np.ascontiguousarray(x), b).tobytes()
    assert np.isnan(wide[:, :10]).all() and np.isnan(wide[:, 80:]).all()   # nothing written past out


@pytest.mark.parametrize("m,k,n", [(17, 192, 576), (70, 768, 192), (130, 40, 33), (64, 1, 5)])
def test_long_panel_products_match_float64(m, k, n):
    x, b, bias = operands(np.random.default_rng(m + k + n), (m, k), (k, n), (n,))
    got = panel_product(x, b, bias)
    want = x.astype(np.float64) @ b.astype(np.float64) + bias
    scale = np.abs(x).astype(np.float64) @ np.abs(b).astype(np.float64) + np.abs(bias)
    assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-30), (m, k, n)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_bits_do_not_depend_on_the_other_rows_the_threads_or_the_cut(monkeypatch, threads):
    """Row i of a product of m rows (any m, on any number of threads: the team cuts rows or
    panels) has the bits of that row computed alone on one thread."""
    rng = np.random.default_rng(threads)
    x, b, bias = operands(rng, (130, 96), (96, 200), (200,))
    alone = np.concatenate([panel_product(x[i:i + 1], b, bias) for i in range(130)])
    monkeypatch.setattr(native.products, "TEAM_MIN_FLOPS", 0)   # cut even the small ones
    numpy_executor.set_threads(threads)
    for m in (1, 3, 8, 16, 130):
        got = panel_product(x[:m], b, bias)
        assert got.tobytes() == alone[:m].tobytes(), (m, threads)
    q, wq, qb = operands(rng, (1, 8, 64), (3, 64, 64), (3, 1, 64))   # entries cut, not panels
    want = np.stack([panel_product(q[0], wq[e], qb[e]) for e in range(3)])
    assert panel_product(q, wq, qb).tobytes() == want.tobytes()


def test_panels_it_does_not_take_run_the_reference_kernel():
    """Panels 16 wide, panels in a strided view, a float64 product: not gl_matmul_panels'
    layouts; the program runs the reference kernel for them, with the same values."""
    rng = np.random.default_rng(9)
    b = rng.standard_normal((24, 40)).astype(np.float32)
    x = rng.standard_normal((4, 24)).astype(np.float32)
    for panels in (to_panels(b, 16), to_panels(np.concatenate([b, b]), 32)[:, ::2]):
        assert native.products.panel_matmul_closure(x, panels, None, np.empty((4, 40), np.float32)) is None
    for dtype, panels in (("float32", to_panels(b, 16)), ("float64", to_panels(b, 32).astype(np.float64))):
        g = Graph("p")
        xi = g.input("x", (4, 24), dtype)
        y = panel_matmul(xi, g.param("p", panels.shape, dtype), 40)
        prog = executors.get("native").compile(g, [y])
        got = prog.run({"x": x.astype(dtype)}, {"p": panels})[0]
        assert "panel_matmul" not in prog.native_ops()
        np.testing.assert_allclose(got, x.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape,panels_shape,columns,bias_shape,message", [
    ((4, 24), (2, 20, 32), 40, None, r"cannot multiply \[4,24\] by panels \[2,20,32\]"),
    ((4, 24), (2, 24, 32), 65, None, r"2 panels of 32 columns cannot hold 65 columns"),
    ((4, 24), (2, 24, 32), 32, None, r"2 panels of 32 columns cannot hold 32 columns"),
    ((2, 4, 24), (3, 2, 24, 32), 40, None, r"cannot multiply .* \(batch dimensions do not broadcast\)"),
    ((4, 24), (2, 24, 32), 40, (4, 40), r"bias \[4,40\] is not one row of 40"),
    ((4, 24), (2, 24, 32), 40, (41,), r"bias \[41\] is not one row of 40"),
    ((3, 4, 24), (2, 24, 32), 40, (2, 1, 40), r"bias \[2,1,40\] is not one row of 40"),   # batch 2 vs 3
    ((4, 24), (2, 24, 32), 40, (2, 1, 40), r"bias \[2,1,40\] is not one row of 40"),      # would widen it
])
def test_a_panel_product_of_shapes_that_do_not_fit_is_refused_naming_them(x_shape, panels_shape, columns,
                                                                           bias_shape, message):
    from graphlm.ir import ShapeError
    g = Graph("bad")
    x, panels = g.input("x", x_shape, np.float32), g.param("p", panels_shape, np.float32)
    bias = None if bias_shape is None else g.param("b", bias_shape, np.float32)
    with pytest.raises(ShapeError, match=r"panel_matmul in <root>: " + message):
        panel_matmul(x, panels, columns, bias)
    assert [n.op for n in g.nodes if n.op == "panel_matmul"] == []   # nothing half-built


@pytest.fixture(scope="module")
def model_and_params():
    model = GPT(GPTConfig(vocab_size=64, context_length=24, channels=48, head_count=4, layer_count=2,
                          dropout=0.0, mlp_hidden=100))   # 100: a ragged last panel
    return model, model.init(seed=4)


def test_a_decode_in_panels_has_the_bits_of_the_decode_in_rows(model_and_params, monkeypatch):
    """The native Generator's programs read W.panels (and add each bias in the product); its
    prefill and decode logits are the bits the same programs give with W.T read in rows (the
    prefill's 40-row products in rows by gl_matmul_large: the same chains; OpenBLAS's differ)."""
    from graphlm.passes.transposed_weights import TRANSPOSED_WEIGHTS
    model, params = model_and_params
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", True)
    prompts = np.random.default_rng(1).integers(0, 64, (8, 5))
    panels = Generator(model, params, batch_size=8, executor="native")
    monkeypatch.setattr(native.NativeExecutor, "fixed_weights_pass", TRANSPOSED_WEIGHTS)
    rows = Generator(model, params, batch_size=8, executor="native")
    assert any(k.endswith(".panels") for k in panels.state) and not any(k.endswith(".panels") for k in rows.state)
    got, got_logits = greedy(panels, prompts, 6)
    want, want_logits = greedy(rows, prompts, 6)
    assert got.tolist() == want.tolist()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got_logits, want_logits))
