"""The native executor's oneMKL products (products.py, mkl.py) and what they guarantee.

- oneMKL is found where the `mkl` dependency installs it (x86-64 Linux) and loads on its
  sequential layer;
- its products match float64 over the layouts a training step makes (x @ W^T, g @ W, g^T @ x,
  batched and broadcast operands);
- their bits do not depend on the thread count: the pieces of each cut give the whole call's
  bits, for single products and a whole training step (with the products on oneMKL and on
  NumPy's OpenBLAS);
- a training step's products take them and round their own way; MKL_PRODUCTS False and
  GRAPHLM_BLAS=openblas put NumPy's OpenBLAS back (np.matmul's bits); a bad GRAPHLM_BLAS is a
  one-line error naming it.
"""
from __future__ import annotations

import platform
import sys

import numpy as np
import pytest

import graphlm as gl
from graphlm.executors import native
from graphlm.executors import numpy as numpy_executor
from graphlm.executors.native.mkl import mkl_sgemm

from tests.test_batched_decode import product_by
from tests.test_large_products import operands

ON_X86_LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
pytestmark = [pytest.mark.usefixtures("native"),
              pytest.mark.skipif(not ON_X86_LINUX, reason="the mkl wheel is a dependency on x86-64 Linux only")]


@pytest.fixture
def mkl_on(monkeypatch):
    """oneMKL's products whatever this machine's choice (its CPU's vendor)."""
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", True)
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", None)


def mkl_product(a, b):
    return product_by(native.products.mkl_matmul_closure, a, b)


def test_onemkl_is_installed_and_loads():
    found = mkl_sgemm()
    assert found is not None, "the mkl dependency did not load (pip install mkl)"
    assert found[0] > 0 and "Math Kernel Library" in found[1]


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", [(64, 192, 768), (37, 70, 33), (17, 1100, 70), (200, 5, 300)])
def test_mkl_products_match_float64(mkl_on, layout, m, k, n):
    a, b = operands(np.random.default_rng(m * 1000 + k + n), m, k, n, layout)
    got = mkl_product(a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)   # the sum of |terms|
    assert np.all(np.abs(got - want) <= k * 2.0 ** -24 * scale + 1e-30), (layout, m, k, n)


def test_batched_and_broadcast_operands(mkl_on):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 40, 24)).astype(np.float32)            # one input, three weights (QKV)
    w = rng.standard_normal((3, 24, 20)).astype(np.float32)
    g = np.swapaxes(rng.standard_normal((3, 40, 20)).astype(np.float32), -1, -2)   # [3, 20, 40] views
    for a, b in [(x, w), (g, x), (x[0], w)]:
        np.testing.assert_allclose(mkl_product(a, b), a.astype(np.float64) @ b.astype(np.float64),
                                   rtol=1e-5, atol=1e-5)


def test_a_product_made_of_no_gemm_is_not_taken(mkl_on):
    """A vector or a @ a.T (NumPy's gemv and syrk paths) stays with NumPy's BLAS."""
    a = np.ones((40, 30), np.float32)
    out = np.empty((40, 40), np.float32)
    assert native.products.mkl_matmul_closure(a, a.T, out) is None
    assert native.products.mkl_matmul_closure(a, np.ones((30, 1), np.float32), np.empty((40, 1), np.float32)) is None


@pytest.mark.threads
@pytest.mark.parametrize("layout,m,k,n", [("nn", 4096, 192, 768), ("tn", 192, 4096, 768), ("nt", 1000, 768, 192),
                                          ("nn", 1200, 96, 72)])
def test_the_bits_do_not_depend_on_the_thread_count(mkl_on, layout, m, k, n):
    """One thread runs the whole call; 2 and 3 run the cut the product found exact (it must
    find one for these training shapes, or the threads would not help)."""
    a, b = operands(np.random.default_rng(7), m, k, n, layout)
    out = np.full((m, n), np.nan, np.float32)
    run = native.products.mkl_matmul_closure(a, b, out)
    results = {}
    for threads in (1, 2, 3, 1):
        numpy_executor.set_threads(threads)
        out[...] = np.nan
        run()
        results.setdefault(threads, []).append(out.copy())
    numpy_executor.set_threads(1)
    whole = results[1][0]
    assert all(np.array_equal(r.view(np.int32), whole.view(np.int32)) for rs in results.values() for r in rs)
    assert run.tables[2] is not None and run.tables[3] is not None


def _training_step(batch=4):
    from graphlm.models import GPT, GPTConfig
    config = GPTConfig.preset("tinylm").replace(channels=64, head_count=2, layer_count=1, context_length=32,
                                                dropout=0.0)
    model = GPT(config)
    g = gl.Graph("step")
    loss = model.loss(g.input("tokens", (batch, 32), np.int64), g.input("targets", (batch, 32), np.int64))
    grads = gl.grad(loss, [g.params[name] for name in sorted(g.params)])
    rng = np.random.default_rng(3)
    feeds = {"tokens": rng.integers(0, 256, (batch, 32)), "targets": rng.integers(0, 256, (batch, 32))}
    return g, [loss, *grads], feeds, model.init(0)


@pytest.mark.parametrize("mkl", [True, False])
def test_a_training_step_takes_mkl_products_and_the_flag_puts_back_openblas(monkeypatch, mkl):
    from graphlm import executors
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", mkl)
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", None)
    g, outputs, feeds, state = _training_step()
    prog = executors.get("native").compile(g, outputs)
    got = prog.run(feeds, state)
    large = [(s, n) for s, n in zip(prog._steps, prog._step_nodes)
             if n.op in ("matmul", "matmul_sum", "matmul_accumulate") and n.shape[-2] > native.products.SMALL_ROWS]
    assert large and all(getattr(s, "mkl_product", False) == mkl for s, _ in large)
    assert all(prog.rounds_own_way(n) for _, n in large) == (mkl or native.products.large_products_in_c())
    want = executors.get("reference").compile(g, outputs).run(feeds, state)
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6)


@pytest.mark.threads
@pytest.mark.parametrize("mkl", [True, False])
def test_a_training_step_gives_the_same_bits_on_1_2_and_3_threads(monkeypatch, mkl):
    from graphlm import executors
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", mkl)
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", None)
    monkeypatch.setattr(numpy_executor.pool, "MIN_SPLIT_FLOPS", 1 << 12)   # (split this small model's products)
    monkeypatch.setattr(native.products, "MIN_SPLIT_FLOPS", 1 << 12)
    g, outputs, feeds, state = _training_step(batch=32)   # (weight gradients over 1024 rows: where
    # oneMKL's bits part from OpenBLAS's, so a whole call on another BLAS than the pieces shows)
    prog = executors.get("native").compile(g, outputs)
    runs = []
    for threads in (1, 2, 3, 2):
        numpy_executor.set_threads(threads)
        runs.append(prog.run(feeds, state))
    numpy_executor.set_threads(1)
    for other in runs[1:]:
        for a, e in zip(other, runs[0]):
            assert np.array_equal(np.asarray(a).view(np.int32), np.asarray(e).view(np.int32))


@pytest.mark.threads
@pytest.mark.parametrize("mkl", [True, False])
def test_the_accumulated_qkv_input_gradient_has_the_bits_of_its_products_and_their_sum(monkeypatch, mkl):
    """The matmul_accumulate pass changes no bit: a training step with it (the QKV input gradient's
    products added as oneMKL stores them, or computed alone and added without oneMKL) against the
    same step without it, on 1, 2 and 3 threads (its cut chain on 2 and 3)."""
    from graphlm import executors
    from graphlm.passes import pipelines
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", mkl)
    monkeypatch.setattr(native.products, "LARGE_PRODUCTS_IN_C", None)
    monkeypatch.setattr(numpy_executor.pool, "MIN_SPLIT_FLOPS", 1 << 12)
    monkeypatch.setattr(native.products, "MIN_SPLIT_FLOPS", 1 << 12)
    g, outputs, feeds, state = _training_step(batch=32)
    with_pass = executors.get("native").compile(g, outputs)
    native_passes = tuple(p for p in pipelines.PIPELINES["native"] if p.name != "matmul_accumulate")
    monkeypatch.setitem(pipelines.PIPELINES, "native", native_passes)
    without = executors.get("native").compile(g, outputs)
    try:
        for threads in (1, 2, 3):
            numpy_executor.set_threads(threads)
            for a, e in zip(with_pass.run(feeds, state), without.run(feeds, state)):
                assert np.array_equal(np.asarray(a).view(np.int32), np.asarray(e).view(np.int32)), threads
    finally:
        numpy_executor.set_threads(1)
    assert "matmul_accumulate" not in [n.op for n in without._step_nodes]
    steps = [s for s, n in zip(with_pass._steps, with_pass._step_nodes) if n.op == "matmul_accumulate"]
    assert len(steps) == 1 and getattr(steps[0], "mkl_product", False) == mkl
    assert not mkl or (steps[0].tables[2] is not None and steps[0].tables[3] is not None)   # (cut on the team)


@pytest.mark.parametrize("value,want", [("openblas", False), ("OpenBLAS", False), ("mkl", True), ("", None)])
def test_graphlm_blas_chooses(monkeypatch, value, want):
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", None)
    monkeypatch.setenv("GRAPHLM_BLAS", value)
    native.products._mkl_by_default.cache_clear()
    try:
        vendor = native.build.cpu_vendor()
        expected = (vendor == "GenuineIntel") if want is None else want
        assert native.products.mkl_products() is expected
    finally:
        monkeypatch.delenv("GRAPHLM_BLAS")
        native.products._mkl_by_default.cache_clear()   # (the machine's own answer again)


def test_a_bad_graphlm_blas_is_a_one_line_error_naming_it(monkeypatch):
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", None)
    monkeypatch.setenv("GRAPHLM_BLAS", "atlas")
    native.products._mkl_by_default.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"^GRAPHLM_BLAS='atlas' is not one of mkl, openblas \(unset: "):
            native.products.mkl_products()
        with pytest.raises(ValueError, match="GRAPHLM_BLAS='atlas'"):   # at compile, before any run
            from graphlm import executors
            g, outputs, _, _ = _training_step()
            executors.get("native").compile(g, outputs)
    finally:
        monkeypatch.delenv("GRAPHLM_BLAS")
        native.products._mkl_by_default.cache_clear()


def test_without_onemkl_the_products_stay_on_openblas_and_asking_for_it_is_an_error(monkeypatch):
    """A machine where the mkl wheel is missing (or does not load): OpenBLAS, whatever the CPU;
    GRAPHLM_BLAS=mkl there is a one-line error saying what to install."""
    monkeypatch.setattr(native.products, "MKL_PRODUCTS", None)
    monkeypatch.setattr(native.products, "mkl_sgemm", lambda: None)
    monkeypatch.setattr(native.products, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.delenv("GRAPHLM_BLAS", raising=False)
    native.products._mkl_by_default.cache_clear()
    try:
        assert native.products.mkl_products() is False
        monkeypatch.setattr(native.products, "MKL_PRODUCTS", True)
        assert native.products.mkl_products() is False   # (forcing needs it installed)
        monkeypatch.setattr(native.products, "MKL_PRODUCTS", None)
        monkeypatch.setenv("GRAPHLM_BLAS", "mkl")
        native.products._mkl_by_default.cache_clear()
        with pytest.raises(ValueError, match=r"^GRAPHLM_BLAS=mkl, but oneMKL is not installed here \(pip install mkl\)$"):
            native.products.mkl_products()
    finally:
        monkeypatch.delenv("GRAPHLM_BLAS", raising=False)
        native.products._mkl_by_default.cache_clear()


def test_the_mkl_rt_search_finds_nothing_without_the_distribution(monkeypatch):
    import importlib.metadata

    from graphlm.executors.native import mkl

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "files", missing)
    assert mkl.mkl_rt_paths() == []
