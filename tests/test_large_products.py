"""The native executor's large products (gl_matmul_large: every float32 matmul of more rows than
the small-product kernel takes) and what they guarantee.

- the kernel against float64 products over the layouts a training step makes (x @ W^T, g @ W,
  g^T @ x, batched and broadcast operands), ragged edges, and k past a tile's run of p;
- every element is the small-product kernel's NN chain over k (so its bits do not depend on the
  tiles, the packing of a transposed operand, the rows around it, the cut or the thread count);
- a training step's products take it, and the flag puts them back on NumPy's BLAS (oneMKL's
  products off: tests/test_mkl_products.py has theirs).
"""
from __future__ import annotations

import numpy as np
import pytest

from graphlm.executors import native
from graphlm.executors import numpy as numpy_executor

from tests.test_batched_decode import product_by

pytestmark = pytest.mark.usefixtures("native")   # skipped without a C compiler (failed in CI)


@pytest.fixture(autouse=True)
def large_products_on(monkeypatch):
    """The kernel whatever this machine's choice (products.large_products_in_c); where it is
    off, NumPy's OpenBLAS, not oneMKL."""
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", True)
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", False)


def large_product(a, b):
    """a @ b by the native large-product kernel."""
    return product_by(native.products.large_matmul_closure, a, b)


def small_nn_row(a_row, b):
    """One row's product by the small-product kernel's NN chain (b's rows made contiguous)."""
    return product_by(native.products.small_matmul_closure, np.ascontiguousarray(a_row), np.ascontiguousarray(b))


def operands(rng, m, k, n, layout, batch=()):
    """a [.., m, k] and b [.., k, n] in `layout`: "nn" (both rows contiguous), "nt" (b a
    transposed view: x @ W^T), "tn" (a a transposed view: g^T @ x), "tt"."""
    a = rng.standard_normal(batch + ((k, m) if layout[0] == "t" else (m, k))).astype(np.float32)
    b = rng.standard_normal(batch + ((n, k) if layout[1] == "t" else (k, n))).astype(np.float32)
    return (np.swapaxes(a, -1, -2) if layout[0] == "t" else a), (np.swapaxes(b, -1, -2) if layout[1] == "t" else b)


SHAPES = [(64, 192, 768), (37, 70, 33), (17, 1100, 70), (200, 5, 300), (24, 1, 40), (19, 0, 9), (33, 600, 1)]


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_large_products_match_float64(layout, m, k, n):
    a, b = operands(np.random.default_rng(m * 1000 + k + n), m, k, n, layout)
    got = large_product(a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)   # the sum of |terms|
    # one chain of k fused multiply-adds errs by at most about k roundings of the running sum
    assert np.all(np.abs(got - want) <= max(k, 1) * 2.0 ** -24 * scale + 1e-30), (layout, m, k, n)


def test_batched_and_broadcast_operands():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 40, 24)).astype(np.float32)            # one input, three weights (QKV)
    w = rng.standard_normal((3, 24, 20)).astype(np.float32)
    g = np.swapaxes(rng.standard_normal((3, 40, 20)).astype(np.float32), -1, -2)   # [3, 20, 40] views
    wide = rng.standard_normal((48, 100)).astype(np.float32)[:, 7:7 + 24]         # rows 100 apart
    for a, b in [(x, w), (g, x), (wide, w[1]), (x[0], w)]:
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(large_product(a, b), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", [(40, 1100, 70), (29, 192, 130), (17, 513, 33)])
def test_every_element_is_the_small_kernels_chain_over_k(layout, m, k, n):
    """Row i of a large product is, bit for bit, the small-product kernel's NN product of a's row
    i: one chain of fused multiply-adds over k in order, carried across the tiles of k (k past
    512 and 1024: the tile boundaries), through the packing of a transposed b, whatever the rows
    around it."""
    a, b = operands(np.random.default_rng(k + n), m, k, n, layout)
    got = large_product(a, b)
    rows = np.concatenate([small_nn_row(a[i:i + 1], b) for i in range(m)])
    assert got.tobytes() == rows.tobytes()
    for lo, hi in [(0, 9), (3, 20), (m - 8, m)]:   # other row counts and starts: other blocks
        assert large_product(a[lo:hi], b).tobytes() == rows[lo:hi].tobytes(), (lo, hi)


@pytest.mark.threads
@pytest.mark.parametrize("threads", [2, 3])
def test_large_products_do_not_depend_on_the_thread_count(monkeypatch, threads):
    """Cut along the rows (at least as many rows as columns) or the columns, on the C worker team:
    the one-thread bits."""
    monkeypatch.setattr(native.products, "TEAM_MIN_FLOPS", 1)
    rng = np.random.default_rng(3)
    cases = [operands(rng, 300, 192, 96, "nt"), operands(rng, 40, 700, 400, "tn"),
             operands(rng, 64, 50, 64, "nn", batch=(3,))]
    one = [large_product(a, b) for a, b in cases]
    numpy_executor.set_threads(threads)
    for (a, b), want in zip(cases, one):
        out = np.empty_like(want)
        run = native.products.large_matmul_closure(a, b, out)
        run()
        assert run.tables.get(threads) is not None, (a.shape, b.shape)   # (it ran on the team)
        assert out.tobytes() == want.tobytes(), (a.shape, b.shape)


def test_layouts_it_refuses():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((40, 30)).astype(np.float32), rng.standard_normal((30, 50)).astype(np.float32)
    out = np.zeros((40, 50), np.float32)
    plan = native.products.large_product_plan
    assert plan(a, b, out) is not None
    assert plan(a.astype(np.float64), b.astype(np.float64), out.astype(np.float64)) is None   # not float32
    assert plan(a[:, ::2], b[:15], out) is None          # a's rows and columns both strided
    assert plan(a, b[:, ::2], out[:, :25]) is None       # b's too
    assert plan(a[::-1], b, out) is None                  # a negative stride
    assert plan(a, b, np.empty((50, 40), np.float32).T) is None   # out's rows not contiguous
    assert plan(a[:0], b, out[:0]) is None                # empty


def test_a_training_step_takes_the_large_kernel_and_the_flag_puts_back_blas(monkeypatch):
    import graphlm as gl
    from graphlm import executors
    from graphlm.models import GPT, GPTConfig

    config = GPTConfig.preset("tinylm").replace(channels=32, head_count=2, layer_count=1, context_length=16,
                                                dropout=0.0)
    model = GPT(config)
    g = gl.Graph("step")
    loss = model.loss(g.input("tokens", (4, 16), np.int64), g.input("targets", (4, 16), np.int64))
    grads = gl.grad(loss, [g.params[name] for name in sorted(g.params)])
    for flag in (True, False):
        monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", flag)
        prog = executors.get("native").compile(g, [loss, *grads])
        prog.native_ops(model.init(0))   # (binds: the kernels' closures are built then)
        products = [s for s, n in zip(prog._steps, prog._step_nodes) if n.op in ("matmul", "matmul_sum")]
        assert products and all(getattr(s, "large_product", False) == flag for s in products)
        assert all(prog.rounds_own_way(n) == flag for n in prog._step_nodes if n.op in ("matmul", "matmul_sum"))


@pytest.mark.parametrize("flags,core,want", [({"avx2", "avx512f"}, "Haswell", True), ({"avx512f"}, "Zen", True),
                                             ({"avx512f"}, "SkylakeX", False), ({"avx512f"}, "COOPERLAKE", False),
                                             ({"avx2"}, "Haswell", False), ({"avx512f"}, None, True)])
@pytest.mark.parametrize("mkl", [False, True])
def test_the_choice_between_c_and_openblas(monkeypatch, flags, core, want, mkl):
    """Left to itself (LARGE_PRODUCTS_IN_C None) the executor takes the C kernel where the CPU
    has AVX-512, NumPy's OpenBLAS does not run its AVX-512 kernels and the products are not
    oneMKL's; True or False force it."""
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", None)
    monkeypatch.setattr(native.products, "mkl_products", lambda: mkl)
    monkeypatch.setattr(native.products, "cpu_flags", lambda: flags)
    monkeypatch.setattr(native.products, "blas_core", lambda: core)
    native.products._c_beats_blas.cache_clear()
    try:
        assert native.products.large_products_in_c() is (want and not mkl)
        for forced in (True, False):
            monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", forced)
            assert native.products.large_products_in_c() is forced
    finally:
        native.products._c_beats_blas.cache_clear()   # (the machine's own answer again)
