"""Batched decoding: the native executor's kernel for products of few rows (gl_matmul_small and
its transposed-operand form) and what it guarantees, and batch-N sampling against N batch-1 runs.

- the kernel against float64 products, over the layouts decoding makes (x @ W^T with W [out, in],
  a query against a transposed key cache, a broadcast batch of QKV weights, ragged edges);
- a row's bits do not depend on the rows around it (m), the thread count or the cut;
- a batch-8 decode gives each row the bits batch-1 decodes give it; greedy rows of a batch equal
  batch-1 greedy runs (both executors); seeded batch sampling gives row i the sample of seed + i;
- the native softmax over the decode attention's masked scores.
"""
from __future__ import annotations

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors
from graphlm.executors import native
from graphlm.executors import numpy as numpy_executor
from graphlm.models import GPT, GPTConfig
from graphlm.sample import Generator, descending_order

pytestmark = pytest.mark.usefixtures("native")   # skipped without a C compiler (failed in CI)


def product_by(closure, a, b):
    """a @ b by a native product kernel's closure (asserting that it takes the operands)."""
    out = np.full(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), np.nan, np.float32)
    run = closure(a, b, out)
    assert run is not None, f"{closure.__name__} did not take {a.shape} @ {b.shape}"
    run()
    return out


def small_product(a, b):
    """a @ b by the native small-product kernel."""
    return product_by(native.products.small_matmul_closure, a, b)


def operands(rng, m, k, n, layout, batch=()):
    a = rng.standard_normal(batch + (m, k)).astype(np.float32)
    if layout == "nn":
        b = rng.standard_normal(batch + (k, n)).astype(np.float32)
    else:   # a transposed view: Linear's W^T, a key cache read by a query
        b = np.swapaxes(rng.standard_normal(batch + (n, k)).astype(np.float32), -1, -2)
    return a, b


@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize("m,k,n", [(1, 192, 768), (8, 768, 192), (3, 31, 19), (5, 1, 4), (16, 17, 130),
                                   (7, 200, 33), (2, 16, 16), (4, 0, 5)])
def test_small_products_match_float64(layout, m, k, n):
    a, b = operands(np.random.default_rng(m * 1000 + k + n), m, k, n, layout)
    got = small_product(a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)   # the sum of |terms|
    assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-30), (layout, m, k, n)


def test_batched_and_broadcast_operands_and_non_contiguous_rows():
    rng = np.random.default_rng(1)
    q, kt = operands(rng, 1, 32, 128, "nt", batch=(8, 6))            # scores over a key cache
    x = rng.standard_normal((1, 8, 192)).astype(np.float32)           # one input, three weights
    w = rng.standard_normal((3, 192, 96)).astype(np.float32)
    wide = rng.standard_normal((8, 400)).astype(np.float32)[:, 7:7 + 192]   # rows 400 apart
    for a, b in [(q, kt), (x, w), (wide, w[0])]:
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(small_product(a, b), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_a_rows_bits_do_not_depend_on_the_other_rows(layout):
    """Row i of an m-row product is the one-row product of a's row i, bit for bit, for every m
    (register blocks of 8, 4, 2 and 1 rows and the ragged columns compute the same sums)."""
    rng = np.random.default_rng(2)
    for k, n in [(192, 70), (37, 129)]:
        a, b = operands(rng, 16, k, n, layout)
        rows = np.concatenate([small_product(a[i:i + 1], b) for i in range(16)])
        for m in (16, 9, 8, 5, 3, 2):
            assert small_product(a[:m], b).tobytes() == rows[:m].tobytes(), (layout, k, n, m)


@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize("k,n", [(128, 32), (40, 45), (7, 130)])
def test_a_batch_entrys_bits_do_not_depend_on_the_other_entries(layout, k, n):
    """Entry e of a batched product (a query against its head's value or key cache; one-row
    entries are interleaved four at a time) is the product of entry e alone, bit for bit."""
    a, b = operands(np.random.default_rng(k + n), 1, k, n, layout, batch=(3, 6))
    got = small_product(a, b)
    for e in np.ndindex(3, 6):
        assert small_product(a[e], b[e]).tobytes() == got[e].tobytes(), e


@pytest.mark.threads
@pytest.mark.parametrize("threads", [2, 3])
def test_small_products_do_not_depend_on_the_thread_count(monkeypatch, threads):
    monkeypatch.setattr(native.products, "TEAM_MIN_FLOPS", 1)
    rng = np.random.default_rng(3)
    cases = [operands(rng, 8, 192, 768, "nt"), operands(rng, 1, 32, 128, "nt", batch=(3, 6)),
             operands(rng, 4, 64, 40, "nn", batch=(3,))]
    one = [small_product(a, b) for a, b in cases]
    numpy_executor.set_threads(threads)
    for (a, b), want in zip(cases, one):
        out = np.empty_like(want)
        run = native.products.small_matmul_closure(a, b, out)
        assert len(run.pieces(threads)) >= 2   # (it is cut)
        run()
        assert out.tobytes() == want.tobytes()


@pytest.mark.threads
def test_the_worker_team_serves_concurrent_callers_and_a_forked_child(monkeypatch):
    """Two user threads running split products at once (one runs its pieces itself), and a
    child forked after the team started (it has none of the parent's worker threads) get the
    one-thread bits and do not hang."""
    import os
    import threading
    monkeypatch.setattr(native.products, "TEAM_MIN_FLOPS", 1)
    rng = np.random.default_rng(5)
    cases = [operands(rng, 8, 192, 768, "nn"), operands(rng, 1, 768, 192, "nt")]
    want = [small_product(a, b) for a, b in cases]
    numpy_executor.set_threads(2)
    outs = [[np.empty_like(w) for w in want] for _ in range(2)]
    runs = [[native.products.small_matmul_closure(a, b, out) for (a, b), out in zip(cases, row)] for row in outs]
    errors = []

    def hammer(row):
        try:
            for _ in range(300):
                for run in runs[row]:
                    run()
        except BaseException as e:   # (reported below)
            errors.append(e)
    threads = [threading.Thread(target=hammer, args=(row,)) for row in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for row in outs:
        assert [o.tobytes() for o in row] == [w.tobytes() for w in want]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: a split product on its own new team, the result to the parent
        try:
            os.close(read)
            out = np.empty_like(want[0])
            native.products.small_matmul_closure(*cases[0], out)()
            os.write(write, out.tobytes())
        finally:
            os._exit(0)
    os.close(write)
    got = b""
    while chunk := os.read(read, 1 << 16):
        got += chunk
    os.close(read)
    os.waitpid(pid, 0)
    assert got == want[0].tobytes()


def test_layouts_it_does_not_take_fall_back_to_numpy():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((4, 8)).astype(np.float32)
    b = rng.standard_normal((8, 12)).astype(np.float32)
    out = np.empty((4, 6), np.float32)
    assert native.products.small_product_layout(a, b[:, ::2], out) is None              # no unit stride
    assert native.products.small_product_layout(a.astype(np.float64), b, out) is None   # not float32
    tall = rng.standard_normal((native.products.SMALL_ROWS + 1, 8)).astype(np.float32)
    assert native.products.small_product_layout(tall, b, np.empty((len(tall), 12), np.float32)) is None


# -- decoding a batch --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_and_params():
    config = GPTConfig(vocab_size=64, context_length=24, channels=32, head_count=4, layer_count=2, dropout=0.0)
    model = GPT(config)
    return model, model.init(3)


def greedy(gen, prompts, steps):
    """(tokens [B, steps], logits of every step) of greedy decoding after prefilling `prompts`."""
    logits = gen.prefill(np.asarray(prompts))
    tokens, seen = [], [logits]
    for _ in range(steps):
        tokens.append(np.argmax(logits, axis=-1))
        logits = gen.decode(tokens[-1])
        seen.append(logits)
    return np.stack(tokens, axis=1), seen


@pytest.mark.parametrize("executor", ["native", "numpy"])
def test_batch8_greedy_rows_equal_eight_batch1_runs(model_and_params, executor):
    """Eight different prompts decoded as one batch choose, row for row, the tokens eight batch-1
    runs choose."""
    model, params = model_and_params
    prompts = np.random.default_rng(5).integers(0, 64, (8, 3))
    batch, _ = greedy(Generator(model, params, batch_size=8, executor=executor), prompts, 12)
    for i in range(8):
        alone, _ = greedy(Generator(model, params, executor=executor), prompts[i:i + 1], 12)
        assert batch[i].tolist() == alone[0].tolist(), f"row {i}"


def test_a_batch8_decode_step_gives_each_row_its_batch1_bits(model_and_params):
    """From the same cache, a native decode step of 8 rows gives row i the logits (and cache
    entries) a batch-1 step gives it, bit for bit: every product of the step computes a row as it
    computes it alone, and the other kernels work row by row."""
    model, params = model_and_params
    prompts = np.random.default_rng(6).integers(0, 64, (8, 5))
    batch = Generator(model, params, batch_size=8, executor="native")
    tokens, _ = greedy(batch, prompts, 3)
    alone = [Generator(model, params, executor="native") for _ in range(8)]
    for i, gen in enumerate(alone):   # row i's cache, as the batch left it
        gen._program(None)
        for name in gen.cache_names:
            gen.state[name][...] = batch.state[name][i:i + 1]
        gen.length = batch.length
    for step in range(4):
        logits = batch.decode(tokens[:, step % 3])
        for i, gen in enumerate(alone):
            assert gen.decode(tokens[i:i + 1, step % 3]).tobytes() == logits[i:i + 1].tobytes(), (step, i)
    for i, gen in enumerate(alone):
        assert all(gen.state[n].tobytes() == batch.state[n][i:i + 1].tobytes() for n in gen.cache_names)


def test_seeded_batch_sampling_is_reproducible_and_row_i_is_seed_plus_i(model_and_params):
    model, params = model_and_params
    options = dict(temperature=0.8, top_k=20, seed=11)
    gen = Generator(model, params, batch_size=8, executor="native")
    first = [s.tokens for s in gen.generate_batch([1, 2, 3], 10, **options)]
    assert [s.tokens for s in gen.generate_batch([1, 2, 3], 10, **options)] == first
    alone = Generator(model, params, executor="native")
    for i in (0, 5, 7):
        assert alone.generate([1, 2, 3], 10, **{**options, "seed": 11 + i}) == first[i]
    assert len({tuple(t) for t in first}) > 1   # the rows draw from their own streams


def test_decode_products_read_their_weights_in_panels_with_the_bias_added(model_and_params):
    """On the native executor every product of a decode step is a panel product in C
    (graphlm/passes/panel_weights.py), each Linear's bias added in it: no plain matmul, and no
    add left but the residuals and the embeddings'."""
    model, params = model_and_params
    gen = Generator(model, params, batch_size=8, executor="native")
    greedy(gen, np.zeros((8, 2), np.int64), 1)
    prog = gen._program(None)
    steps = list(zip(prog._step_nodes, prog._steps))
    products = [s for n, s in steps if n.op == "panel_matmul"]
    assert products and all(getattr(s, "panel_product", False) for s in products)
    assert not [n for n, _ in steps if n.op == "matmul"]
    with_bias = [n for n, _ in steps if n.op == "panel_matmul" and len(n.inputs) == 3]
    c = model.config
    assert len(with_bias) == 4 * c.layer_count + c.lm_head_bias   # qkv, output, MLP in and out; the head
    adds = [n for n, _ in steps if n.op == "add"]
    assert len(adds) == 2 * model.config.layer_count + 1    # the residuals, token + position


# -- the softmax of the decode attention (one pass per row in C) -------------------------------------

@pytest.mark.threads
@pytest.mark.parametrize("threads", [1, 2])
def test_native_softmax_matches_the_reference_with_masked_keys(monkeypatch, threads):
    monkeypatch.setattr(native.team, "MIN_SPLIT", 1)
    numpy_executor.set_threads(threads)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8, 6, 1, 129)) * 5).astype(np.float32)
    x[..., 40:128] = -np.inf                      # the cache slots past the position
    g = gl.Graph("softmax")
    y = gl.softmax(g.input("x", x.shape, np.float32), axis=-1)
    prog = native.NativeExecutor().compile(g, [y])
    got = prog.run({"x": x})[0]
    assert "softmax" in prog.native_ops()
    want = executors.get("reference").compile(g, [y]).run({"x": x})[0]
    assert np.all(got[..., 40:128] == 0) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    numpy_executor.set_threads(1)
    assert prog.run({"x": x})[0].tobytes() == got.tobytes()   # the thread count changes nothing


def test_descending_order_is_the_stable_argsort_with_ties_zeros_and_infinities():
    rng = np.random.default_rng(8)
    z = rng.integers(-3, 4, (8, 300)).astype(np.float32) / 2     # many ties
    z[0, :5] = [np.inf, -np.inf, -0.0, 0.0, np.inf]
    z[1] = -np.inf
    z[2, ::2] = -0.0
    z[3] = rng.standard_normal(300).astype(np.float32) * 1e30
    z[4, :3] = [np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny, np.float32(1e-45)]
    for rows in (z, z[:1], z[5:7]):
        assert descending_order(rows).tolist() == np.argsort(-rows, axis=1, kind="stable").tolist()


@pytest.mark.threads
@pytest.mark.parametrize("threads", [2, 3])
def test_blas_products_on_the_team_are_numpys_bits(threads):
    """A training-sized product split over the C worker team as NumPy's own cblas_sgemm calls
    gives np.matmul's bytes, for a plain, a transposed (x @ W^T) and a batched product, and the
    team really runs it (where NumPy's BLAS is an OpenBLAS the executor finds)."""
    if native.team.blas_sgemm() is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS with cblas_sgemm")
    rng = np.random.default_rng(6)
    cases = [(rng.standard_normal((128, 192)), rng.standard_normal((192, 768))),
             (rng.standard_normal((256, 768)), rng.standard_normal((96, 768)).T),
             (rng.standard_normal((4, 128, 96)), rng.standard_normal((4, 96, 128)))]
    numpy_executor.set_threads(threads)
    for a, b in cases:
        a, b = a.astype(np.float32), b.astype(np.float32)
        out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), np.float32)
        run = native.products.blas_matmul_closure(a, b, out)
        run()
        assert run.tables.get(threads) is not None, (a.shape, b.shape)   # (it ran on the team)
        assert out.tobytes() == np.matmul(a, b).tobytes(), (a.shape, b.shape)


def test_sgemm_calls_refuse_what_numpy_would_not_hand_to_gemm():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    assert native.products.sgemm_calls(x, x.T, np.empty((64, 64), np.float32)) is None   # a @ a.T: NumPy's syrk
    assert native.products.sgemm_calls(x[:1], x.T[:, :8], np.empty((1, 8), np.float32)) is None   # one row: gemv
    assert native.products.sgemm_calls(x.astype(np.float64), x.T.astype(np.float64), np.empty((64, 64))) is None
    out_t = np.empty((32, 64), np.float32).T   # an output NumPy would write transposed
    assert native.products.sgemm_calls(x, x.T.copy(), out_t) is None
    (call,) = native.products.sgemm_calls(x, np.ascontiguousarray(x.T), np.empty((64, 64), np.float32))
    assert call[:5] == (0, 0, 64, 64, 32) and call[6] == 32 and call[8] == 64 and call[10] == 64
