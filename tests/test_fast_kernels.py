"""The numpy executor's performance kernels (issue 7) against the reference executor and
graphlm.random: dropout masks drawn once per run and shared with the backward, ..."""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm.executors import numpy as numpy_executor
from graphlm.executors.numpy import attention, dropout, matmul, optimizer, pool, tiling
from graphlm.random import counter_uniform
from graphlm.testing import assert_close

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
    ((dropout._MASK_CHUNK + 1,), 0.999, 1, 9),     # a one-element last chunk
    ((7,), 0.0, 5, 1),                                    # p = 0 keeps everything
])
def test_keep_mask_drawer_is_counter_uniform_exactly(shape, p, key, stream):
    mask = np.empty(shape, bool)
    dropout.keep_mask_drawer(shape, stream, p)(key, mask)
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
    applied = [n for n in prog.run_nodes if n.op == "dropout_apply"]
    masks = [n for n in prog.run_nodes if n.op == "dropout_keep"]
    assert len(applied) == 4 and len(masks) == 2   # two streams, two draws, each mask read twice
    assert sorted(n.inputs[1].id for n in applied) == sorted(2 * [m.id for m in masks])
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((4, 33)).astype(dtype)
    xv[0, :3] = [np.inf, -np.inf, np.nan]
    for k in (3, 4, 3):    # a new key draws a new mask; the same key the same one
        feeds = {"x": xv, "key": np.asarray(k, np.int64)}
        got, want = run_both(g, [y, dx], feeds)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


# -- GELU: the backward reads the forward's sigmoid -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_backward_reuses_the_forward_sigmoid_float32_only(dtype):
    g = gl.Graph("gelu")
    x = g.input("x", (6, 50), dtype)
    w = g.param("w", (50, 50), dtype)
    h = x @ w
    y = gl.gelu(h)
    loss = gl.sum(y * y * 0.5)
    gx, gw = gl.grad(loss, [x, w])
    prog = NUMPY.compile(g, [y, gx, gw])
    ops = {n.op for n in prog.run_nodes}
    assert ("gelu_sigmoid" in ops and "gelu_backward_sigmoid" in ops) == (dtype == "float32")
    rng = np.random.default_rng(1)
    xv = (rng.standard_normal((6, 50)) * 3).astype(dtype)
    state = {"w": rng.standard_normal((50, 50)).astype(dtype) * 0.3}
    for scale in (1.0, 0.5):   # a second run with other data uses that run's sigmoid
        got, want = run_both(g, [y, gx, gw], {"x": xv * scale}, state)
        for a, b in zip(got, want):   # the same arithmetic in the same order: bit for bit
            np.testing.assert_array_equal(a, b)


# -- cache blocking: multi-pass kernels run block by block, bit for bit as on whole arrays ----------------

@pytest.fixture(params=[1, 2, 3], ids=["1thread", "2threads", "3threads"])
def threads(request):
    numpy_executor.set_threads(request.param)
    yield request.param
    numpy_executor.set_threads(1)


@pytest.mark.parametrize("block", [1000, 1 << 16])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_blocked_kernels_match_reference_bit_for_bit(monkeypatch, block, dtype, threads):
    """layer_norm (keeping xc, sv and xhat for its backward nodes), causal softmax, gelu, dropout
    forward and backward on arrays bigger than a
    block (with 1000: many blocks and a ragged last one); a softmax of a transposed (strided)
    input runs unblocked and matches within rounding (the reference's temporaries there follow
    the strided layout, so its sums add in another order)."""
    monkeypatch.setattr(tiling, "BLOCK", block)
    g = gl.Graph("blocks")
    x = g.input("x", (3, 37, 64), dtype)
    key = g.input("key", (), "int64")
    w, b = g.param("w", (64,), dtype), g.param("b", (64,), dtype)
    h = gl.layer_norm(x, w, b)
    a = gl.softmax(gl.causal_mask(h[:, :, :37] * 3.0), -1)          # [3, 37, 37], causal
    s0 = gl.softmax(gl.transpose(h, (0, 2, 1)), 1)                  # strided input, axis 1
    m = gl.gelu(gl.dropout(h * 2.0, 0.2, key, stream=1))
    loss = gl.sum(m * m) + gl.sum(a * a)
    grads = gl.grad(loss, [x, w, b])
    strided = gl.grad(gl.sum(s0 * s0 * gl.transpose(x, (0, 2, 1))), [x])[0]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((3, 37, 64)).astype(dtype), "key": np.asarray(9, np.int64)}
    state = {"w": rng.standard_normal(64).astype(dtype), "b": rng.standard_normal(64).astype(dtype)}
    ops = {n.op for n in NUMPY.compile(g, [loss, m, *grads, strided]).run_nodes}
    gelu = {"gelu", "gelu_backward"} if dtype == "float64" else {"gelu_sigmoid", "gelu_backward_sigmoid"}
    assert {"layer_norm_keep", "layer_norm_backward_kept", "dropout_apply",
            "dropout_keep"} | gelu <= ops
    got, want = run_both(g, [loss, m, *grads, strided], feeds, state)
    for a_, b_ in zip(got[:-1], want[:-1]):
        np.testing.assert_array_equal(a_, b_)
    tol = 1e-12 if dtype == "float64" else 1e-6
    assert_close(got[-1], want[-1], tol, tol)


# -- slice gradients assembled in place ---------------------------------------------------------------------

@pytest.mark.parametrize("parts", [(0, 1, 2), (2, 0)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_slice_gradients_are_assembled_like_the_reference(parts, dtype):
    """q, k, v sliced from one [3, N, C] product and reshaped into heads (as attention does): the
    gradient of the product is one node writing each slice's gradient into its window; with two
    of three slices the uncovered window is zero; -0.0 gradients become +0.0 as in the sum."""
    g = gl.Graph("qkv")
    x = g.input("x", (1, 8, 12), dtype)
    w = g.param("w", (3, 12, 12), dtype)
    c = g.input("c", (2, 3, 4, 4), dtype)                                  # fed -0.0
    qkv = x @ w                                                            # [3, 8, 12]
    heads = [gl.transpose(gl.reshape(gl.reshape(qkv[j], (2, 4, 12)), (2, 4, 3, 4)), (0, 2, 1, 3))
             for j in parts]
    loss = gl.sum(gl.relu(heads[0]) * heads[-1]) + gl.sum(heads[0] * 0.0)
    loss = loss + gl.sum(heads[len(heads) // 2] * c)   # with 3 parts: a window of -0.0 gradients
    gx, gw, gqkv = gl.grad(loss, [x, w, qkv])   # gqkv: the assembled node (in x @ w a zero's sign vanishes)
    prog = NUMPY.compile(g, [gx, gw, gqkv])
    assert [n.op for n in prog.run_nodes].count("slices_assemble") == 1
    assert not any(n.op == "slice_backward" for n in prog.run_nodes)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((1, 8, 12)).astype(dtype), "c": np.full((2, 3, 4, 4), -0.0, dtype)}
    state = {"w": rng.standard_normal((3, 12, 12)).astype(dtype)}
    got, want = run_both(g, [gx, gw, gqkv], feeds, state)
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()    # bit for bit, signs of zeros included


# -- attention softmax with its scale and causal mask folded in --------------------------------------------

@pytest.mark.parametrize("block", [1000, 1 << 16])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scaled_causal_softmax_is_fused_and_bit_identical(monkeypatch, block, dtype, threads):
    monkeypatch.setattr(tiling, "BLOCK", block)
    g = gl.Graph("attn")
    q = g.input("q", (2, 3, 24, 8), dtype)
    k = g.input("k", (2, 3, 24, 8), dtype)
    scores = (q @ gl.swapaxes(k, -1, -2)) * (1.0 / np.sqrt(8.0))
    p = gl.softmax(gl.causal_mask(scores), -1)
    loss = gl.sum(p * p * gl.tanh(scores))          # scores also feeds tanh: not fused away
    p2 = gl.softmax(gl.causal_mask(q @ gl.swapaxes(k, -1, -2) * 0.5, offset=2), -1)
    loss = loss + gl.sum(p2 * p2)
    grads = gl.grad(loss, [q, k])
    prog = NUMPY.compile(g, [loss, p, p2, *grads])
    ops = [n.op for n in prog.run_nodes]
    assert ops.count("softmax_fused") == 2 and ops.count("softmax_backward_fused") == 2, ops
    assert "mul" in ops          # the scores tanh reads are still computed
    rng = np.random.default_rng(5)
    feeds = {"q": rng.standard_normal((2, 3, 24, 8)).astype(dtype),
             "k": rng.standard_normal((2, 3, 24, 8)).astype(dtype)}
    got, want = run_both(g, [loss, p, p2, *grads], feeds)
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()


# -- causal attention in query blocks ---------------------------------------------------------------------

def _attention_graph(shape, dtype):
    """causal_attention and its gradients (paired: the backward keeps the forward's scores), and
    the backward op alone on a fed output (unpaired: it recomputes them)."""
    g = gl.Graph("causal_attention")
    q, k, v, u = (g.input(n, shape, dtype) for n in "qkvu")
    y = gl.causal_attention(q, k, v)
    grads = gl.grad(gl.sum(y * u), [q, k, v])
    o = g.input("o", shape, dtype)
    alone = gl.registry.apply("causal_attention_backward", (q, k, v, o, u), scale=y.attrs["scale"])
    return g, y, grads, alone


@pytest.mark.parametrize("query_block,chunk", [(64, 1 << 17), (16, 1 << 17), (5, 100)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_causal_attention_in_query_blocks_matches_reference(monkeypatch, query_block, chunk, dtype, threads):
    """One block, two (18 + 19 rows), seven uneven ones with a run per matrix, on 1-3 threads:
    the outputs and gradients match the reference's plain form within rounding (1e-6 relative in
    float32, 1e-12 in float64); the unpaired backward (recomputing E) equals the paired one
    bit for bit; the NaN-poisoned arena shows no masked score is read; only the blocks on and
    below the diagonal are kept from forward to backward."""
    from graphlm.passes import kept_values
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", query_block)
    monkeypatch.setattr(kept_values, "KEEP_SCORES_PER_OUTPUT", 10)   # T = 37 over D = 8 keeps 4.6x
    monkeypatch.setattr(attention, "ATTENTION_CHUNK", chunk)
    monkeypatch.setattr(pool, "MIN_SPLIT_FLOPS", 0)
    monkeypatch.setattr(pool, "MIN_SPLIT_ATTENTION_FLOPS", 0)
    shape = (2, 3, 37, 8)
    g, y, grads, alone = _attention_graph(shape, dtype)
    rng = np.random.default_rng(11)
    feeds = {n: rng.standard_normal(shape).astype(dtype) for n in "qkvu"}
    feeds["o"] = REF.compile(g, [y]).run({n: feeds[n] for n in "qkv"})[0]
    outputs = [y, *grads, alone]
    prog = NUMPY.compile(g, outputs, poison=True)
    ops = [n.op for n in prog.run_nodes]
    assert ops.count("causal_attention_keep") == 1 and ops.count("causal_attention_backward_kept") == 1
    assert ops.count("causal_attention_backward") == 1 and not prog.rounds_like_reference
    got = prog.run(feeds)
    want = REF.compile(g, outputs).run(feeds)
    tol = 1e-6 if dtype == "float32" else 1e-12
    for a, b, what in zip(got, want, ["y", "dq", "dk", "dv", "backward alone"]):
        assert_close(a, b, tol, tol, what)
    paired = np.stack(got[1:4])
    # the unpaired backward read the reference's o; on the numpy output it equals the paired one
    again = NUMPY.compile(g, [alone], poison=True).run(dict(feeds, o=got[0]))[0]
    assert again.tobytes() == paired.tobytes()
    blocks = gl.ops.attention_query_blocks(37)
    assert len(blocks) == max(1, round(37 / query_block))
    kept = sum((r1 - r0) * r1 for r0, r1 in blocks) + 37   # E's blocks and the row sums l
    assert prog.kept_bytes() == kept * 6 * np.dtype(dtype).itemsize


def test_kept_attention_scores_change_no_bit_of_a_training_step(monkeypatch):
    """Two AdamW steps of a small GPT with the attention's kept E and l (the numpy pipeline) and
    without (the same pipeline minus those two rules: the backward recomputes E and l): the
    losses, norms and every parameter and moment agree bit for bit; keeping E and l costs at
    most their bytes of arena."""
    from graphlm.models import GPT, GPTConfig
    from graphlm.optim import AdamW
    from graphlm.passes import PIPELINES, Pass
    from graphlm.passes.kept_values import KEPT_VALUES
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", 8)   # 4 query blocks at T = 32
    plain = Pass("kept_values", tuple(r for r in KEPT_VALUES.rules if "attention" not in r.name))

    class Recomputing(numpy_executor.NumpyProgram):
        pipeline = tuple(plain if p is KEPT_VALUES else p for p in PIPELINES["numpy"])

    cfg = GPTConfig(vocab_size=13, context_length=32, channels=32, head_count=2, layer_count=1, dropout=0.1)
    model = GPT(cfg)
    model.train()
    g, loss = model.loss_graph(2, name="kept_step")
    opt = AdamW(lr=1e-2, weight_decay=0.1, clip_norm=0.5)
    step = opt.minimize(loss)
    results = []
    for program in (numpy_executor.NumpyProgram, Recomputing):
        prog = program(g, [loss, step.grad_norm, step.update])
        ops = [n.op for n in prog.run_nodes]
        assert ops.count("causal_attention_keep") == (program is not Recomputing)
        state = {**model.init(seed=3), **opt.init_state()}
        rng = np.random.default_rng(8)
        out = []
        for s in range(2):
            feeds = {"tokens": rng.integers(0, 13, (2, 32)), "targets": rng.integers(0, 13, (2, 32)),
                     "dropout_key": np.asarray(100 + s, np.int64), **opt.feeds(s)}
            out += [a.tobytes() for a in prog.run(feeds, state)[:2]]
        results.append((out, {k: v.tobytes() for k, v in state.items()}, prog.plan.arena_bytes, prog.kept_bytes()))
    kept, recomputed = results
    assert kept[0] == recomputed[0] and kept[1] == recomputed[1]
    e_and_l = 2 * 2 * (8 * (8 + 16 + 24 + 32) + 32) * 4   # B * H * (the kept score blocks + l), float32
    assert kept[3] - recomputed[3] == e_and_l
    assert kept[2] <= recomputed[2] + e_and_l   # E and l outlive the forward: at most their bytes more


def test_rounds_like_reference_is_false_only_with_a_kernel_that_rounds_its_own_way():
    """The flag the executor tests use to choose bit-for-bit or tolerance comparison: the same
    attention spelled out (exact kernels) says True, the fused op says False."""
    g = gl.Graph("flag")
    q, k, v = (g.input(n, (2, 5, 4), "float64") for n in "qkv")
    spelled = gl.softmax(gl.causal_mask(q @ gl.swapaxes(k, -1, -2) * 0.5), -1) @ v
    fused = gl.causal_attention(q, k, v, scale=0.5)
    assert NUMPY.compile(g, [spelled]).rounds_like_reference
    assert not NUMPY.compile(g, [fused]).rounds_like_reference


def test_gpt_attention_is_one_fused_node_and_the_decode_path_is_not():
    """The model's training graph and the cached prefill use causal_attention; the KV-cache
    decode step (one query against the cache) keeps its own decomposed form."""
    from graphlm.models import GPT, GPTConfig
    from graphlm.sample import build_graph
    cfg = GPTConfig(vocab_size=13, context_length=16, channels=16, head_count=2, layer_count=2)
    model = GPT(cfg)
    g, _ = model.loss_graph(2)
    prefill, _, _ = build_graph(model, 1, 5)
    decode, _, _ = build_graph(model, 1, None)
    for graph in (g, prefill):
        ops = [n.op for n in graph.nodes]
        assert ops.count("causal_attention") == 2 and "causal_mask" not in ops and "softmax" not in ops
    assert "causal_attention" not in {n.op for n in decode.nodes}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_set_threads_rejects_what_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"threads must be a positive int, got {bad!r}"):
        numpy_executor.set_threads(bad)
    assert numpy_executor.get_threads() == 1


# -- threads: kernels split over n threads compute what one thread computes, bit for bit ------------------

@pytest.mark.parametrize("total,n,quantum", [(10, 2, 1), (10, 3, 1), (2, 3, 1), (128, 2, 48), (1000, 3, 48),
                                             (48, 2, 48), (7, 1, 1)])
@pytest.mark.threads
def test_cuts_are_contiguous_even_and_on_the_quantum(total, n, quantum):
    cuts = tiling.even_cuts(total, n, quantum)
    assert cuts[0][0] == 0 and cuts[-1][1] == total and len(cuts) <= n
    assert all(a < b for a, b in cuts) and all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))
    assert all(a % quantum == 0 for a, _ in cuts)
    sizes = [b - a for a, b in cuts]
    assert max(sizes) - min(sizes) <= quantum or len(cuts) == 1


@pytest.mark.parametrize("a_shape,b_shape", [
    ((8, 128, 192), (192, 96)),         # batch cut: every GEMM as it was
    ((1, 1000, 24), (3, 24, 40)),       # broadcast batch of 3 vs 1000 rows: rows cut (better balance)
    ((300, 20), (20, 50)),              # 2-d: row blocks (of row_quantum rows)
    ((2, 3, 100, 16), (2, 3, 16, 100)),
    ((5, 70, 8), (8, 9)),
])
@pytest.mark.threads
@pytest.mark.parametrize("n", [2, 3, 4])
def test_matmul_pieces_tile_the_output_and_round_as_the_whole(a_shape, b_shape, n):
    rng = np.random.default_rng(7)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    whole = np.matmul(a, b)
    out = np.full_like(whole, np.nan)
    pieces = matmul.matmul_parts(a, b, out, n)
    batched = any(d > 1 for d in whole.shape[:-2])   # a batch cut is exact on any BLAS; a row cut may not be
    assert 2 <= len(pieces) <= n or (not batched and pieces == [])
    if not pieces:
        return
    outs = [po for _, _, po in pieces]
    assert all(np.shares_memory(po, out) for po in outs)
    assert not any(np.shares_memory(p, q) for i, p in enumerate(outs) for q in outs[i + 1:])   # disjoint
    for pa, pb, po in pieces:
        np.matmul(pa, pb, po)
    assert out.tobytes() == whole.tobytes()    # covered (no NaN left) and rounded as the whole


@pytest.mark.threads
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_cuts_chosen_for_training_shapes_round_as_the_whole(dtype):
    """Whatever cut the executor picks for a product (long contractions, few columns, a ragged
    last tile, a product small enough for a BLAS's small-matrix path), its pieces give the whole
    product's bytes on this BLAS and kernel; a product with no exact cut stays whole."""
    numpy_executor.set_threads(2)   # (BLAS on one thread, as whenever the executor splits)
    try:
        rng = np.random.default_rng(2)
        for m, k, n in [(128, 192, 768), (128, 768, 192), (200, 1000, 50), (97, 3000, 33), (25, 500, 20),
                        (64, 16, 64), (300, 20, 50)]:
            a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
            whole = a @ b
            for parts in (2, 3):
                out = np.full_like(whole, np.nan)
                pieces = matmul.matmul_parts(a, b, out, parts)
                assert pieces == [] or 2 <= len(pieces) <= parts
                assert all(po.shape[0] >= 2 for _, _, po in pieces)   # no gemv piece
                for pa, pb, po in pieces:
                    np.matmul(pa, pb, po)
                assert pieces == [] or out.tobytes() == whole.tobytes(), (m, k, n, parts)
    finally:
        numpy_executor.set_threads(1)


@pytest.mark.threads
@pytest.mark.parametrize("m, n, axis", [(64, 256, 1), (256, 64, 0), (96, 96, 0)])
def test_a_product_is_cut_where_its_pieces_read_less_twice(monkeypatch, m, n, axis):
    """Every row block reads all of b and every column block all of a: where both cuts round as
    the whole, a product of few rows and many columns (a weight gradient x^T @ g) is cut into
    column blocks, a tall or square one into row blocks. On this BLAS, whatever cut it takes
    gives the whole product's bytes."""
    numpy_executor.set_threads(2)   # (BLAS on one thread, as whenever the executor splits)
    try:
        rng = np.random.default_rng(3)
        k = 512
        a = rng.standard_normal((k, m)).astype(np.float32).T   # (a transposed view, as x^T)
        b = rng.standard_normal((k, n)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)
        pieces = matmul.matmul_parts(a, b, out, 2)
        for pa, pb, po in pieces:
            np.matmul(pa, pb, po)
        assert pieces == [] or out.tobytes() == (a @ b).tobytes()
        monkeypatch.setattr(matmul, "_cuts_round_as_whole", lambda *args: True)   # every cut exact
        pieces = matmul.matmul_parts(a, b, out, 2)
        assert len(pieces) == 2
        assert all(po.shape == ((m // 2, n) if axis == 0 else (m, n // 2)) for _, _, po in pieces)
        assert all(pa.shape[0] == po.shape[0] and pb.shape[1] == po.shape[1] for pa, pb, po in pieces)
    finally:
        numpy_executor.set_threads(1)


def _exact_matmul(a, b, out):
    """A stand-in BLAS that adds every entry's k products in order, whatever the rows."""
    np.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2, out=out)


def _rounds_by_piece_height(a, b, out):
    """A stand-in BLAS whose products of fewer than 64 rows round otherwise (as a small-matrix
    kernel may): the last bit of every entry flipped."""
    _exact_matmul(a, b, out)
    if a.shape[-2] < 64:
        bits = out.view(np.uint32)
        bits ^= 1


@pytest.mark.threads
def test_a_cut_is_used_only_when_its_pieces_round_as_the_whole(monkeypatch):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((100, 30)).astype(np.float32), rng.standard_normal((30, 20)).astype(np.float32)
    out = np.empty((100, 20), np.float32)
    assert matmul.pieces_round_as_whole(a, b, out, 0, [(0, 48), (48, 100)], matmul=_exact_matmul)
    assert not matmul.pieces_round_as_whole(a, b, out, 0, [(0, 48), (48, 100)],
                                                    matmul=_rounds_by_piece_height)
    assert not matmul.pieces_round_as_whole(a, b, out, 0, [(0, 64), (64, 100)],
                                                    matmul=_rounds_by_piece_height)   # the second piece
    assert matmul.pieces_round_as_whole(a, b, out, 0, [(0, 100)], matmul=_rounds_by_piece_height)
    # the executor asks the check (for the product itself) and keeps a product whole when no cut passes
    asked = []
    monkeypatch.setattr(matmul, "_cuts_round_as_whole", lambda *args: asked.append(args[3:5]) or False)
    assert matmul.matmul_parts(a, b, out, 2) == []
    assert asked and asked[0][0] == 0 and {axis for axis, _ in asked} == {0, 1}   # rows first, then columns
    # a batched product falls back from a rejected cut to the next best
    batched = rng.standard_normal((4, 100, 30)).astype(np.float32)
    out3 = np.empty((4, 100, 20), np.float32)
    monkeypatch.setattr(matmul, "_cuts_round_as_whole", lambda a, b, out, axis, cuts, matmul: axis == 1)
    pieces = matmul.matmul_parts(batched, b, out3, 2)
    assert len(pieces) == 2 and all(po.shape[0] == 4 for _, _, po in pieces)


@pytest.mark.parametrize("shapes", [
    [(8, 128, 96), (96,)],              # a bias add: the bias stays whole
    [(3, 100, 24), (3, 1, 24)],         # the QKV bias: 3 batch entries vs 100 rows, rows cut
    [(5, 7), (5, 1)],                   # a row statistic broadcast along columns
    [(64,), ()],                        # a scalar operand
])
@pytest.mark.threads
@pytest.mark.parametrize("n", [2, 3])
def test_elementwise_pieces_tile_the_output(shapes, n):
    rng = np.random.default_rng(5)
    ins = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    whole = np.add(*ins)
    out = np.full_like(whole, np.nan)
    pieces = tiling.elementwise_parts(ins, out, n)
    assert 2 <= len(pieces) <= n
    outs = [po for _, po in pieces]
    assert not any(np.shares_memory(p, q) for i, p in enumerate(outs) for q in outs[i + 1:])   # disjoint
    for pi, po in pieces:
        assert np.shares_memory(po, out)
        np.add(*pi, out=po)
    assert out.tobytes() == whole.tobytes()


@pytest.mark.parametrize("sizes,n", [([5, 1, 1, 9, 2], 2), ([3], 2), ([1, 1, 1], 3), ([4, 4, 4, 4], 3)])
def test_size_groups_cover_every_item_once_in_order(sizes, n):
    groups = tiling.size_groups(sizes, n)
    assert groups[0][0] == 0 and groups[-1][1] == len(sizes) and len(groups) <= n
    assert all(a < b for a, b in groups) and all(b == c for (_, b), (c, _) in zip(groups, groups[1:]))


@pytest.fixture
def split_everything(monkeypatch):
    """Split every kernel that can be split, however small (the graphs of tests are small)."""
    monkeypatch.setattr(pool, "MIN_SPLIT_FLOPS", 0)
    monkeypatch.setattr(pool, "MIN_SPLIT_ATTENTION_FLOPS", 0)
    monkeypatch.setattr(pool, "MIN_SPLIT_ROWS", 0)
    monkeypatch.setattr(pool, "MIN_SPLIT_COPY", 0)
    monkeypatch.setattr(pool, "MIN_BLOCKS_PER_THREAD", 1)
    monkeypatch.setattr(dropout, "_MASK_CHUNK", 64)
    monkeypatch.setattr(optimizer, "_ADAMW_CHUNK", 100)
    monkeypatch.setattr(tiling, "BLOCK", 500)
    monkeypatch.setattr(gl.ops, "ATTENTION_QUERY_BLOCK", 8)   # 4 query blocks at T = 32
    monkeypatch.setattr(attention, "ATTENTION_CHUNK", 100)       # one matrix per run


def train_steps(dropout: float, executor: str = "numpy", steps: int = 2):
    """AdamW steps of a small GPT (dropout, clipping, weight decay) on `executor`:
    (losses, grad norms, final state) as arrays."""
    from graphlm.models import GPT, GPTConfig
    from graphlm.optim import AdamW
    cfg = GPTConfig(vocab_size=13, context_length=32, channels=48, head_count=2, layer_count=2, dropout=dropout)
    model = GPT(cfg)
    model.train()
    g, loss = model.loss_graph(4, name="threads_step")
    opt = AdamW(lr=1e-2, weight_decay=0.1, clip_norm=0.5)
    step = opt.minimize(loss)
    prog = executors.get(executor).compile(g, [loss, step.grad_norm, step.update])
    state = {**model.init(seed=3), **opt.init_state()}
    rng = np.random.default_rng(8)
    losses, norms = [], []
    for s in range(steps):
        feeds = {"tokens": rng.integers(0, 13, (4, 32)), "targets": rng.integers(0, 13, (4, 32)), **opt.feeds(s)}
        if "dropout_key" in g.inputs:
            feeds["dropout_key"] = np.asarray(100 + s, np.int64)
        loss_v, norm_v, _ = prog.run(feeds, state)
        losses.append(loss_v)
        norms.append(norm_v)
    return losses, norms, state


def _train_two_steps(dropout: float):
    """train_steps on the numpy executor, every result as bytes (for bit-for-bit comparison)."""
    losses, norms, state = train_steps(dropout)
    return [x.tobytes() for x in losses], [x.tobytes() for x in norms], {k: v.tobytes() for k, v in state.items()}


@pytest.mark.threads
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("n", [2, 3])
def test_training_steps_on_n_threads_are_bit_identical_to_one(split_everything, dropout, n):
    """Matmuls (batch and row cuts), layer norms, blocked GELU/softmax/dropout, the
    QKV gradient assembly, dropout masks drawn in ranges, the global norm's dots and AdamW in
    parameter groups, all split: the losses, norms and
    every parameter and moment after two steps equal the one-thread run's bit for bit."""
    numpy_executor.set_threads(1)
    want = _train_two_steps(dropout)
    try:
        numpy_executor.set_threads(n)
        got = _train_two_steps(dropout)
    finally:
        numpy_executor.set_threads(1)
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2].keys() == want[2].keys()
    assert [k for k in want[2] if got[2][k] != want[2][k]] == []


@pytest.mark.threads
def test_programs_run_from_two_user_threads_at_once_share_the_workers_safely(split_everything):
    """Two threads each running its own training program on a 2-thread executor: whoever finds
    the workers busy runs its pieces itself; both get the one-thread results bit for bit."""
    import threading
    numpy_executor.set_threads(1)
    want = _train_two_steps(0.2)
    got = []
    try:
        numpy_executor.set_threads(2)
        users = [threading.Thread(target=lambda: got.append(_train_two_steps(0.2))) for _ in range(2)]
        for u in users:
            u.start()
        for u in users:
            u.join()
    finally:
        numpy_executor.set_threads(1)
    assert len(got) == 2 and all(g == want for g in got)


@pytest.mark.threads
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_workers(split_everything, fresh_process_if_jax_runs):
    """After fork the child has no pool threads of its parent's; it must start its own rather
    than wait for ever on a piece nobody runs."""
    if fresh_process_if_jax_runs:
        return
    import os
    import signal
    numpy_executor.set_threads(2)
    try:
        want = _train_two_steps(0.0)
        pid = os.fork()
        if pid == 0:   # the child: exit 0 only if the threaded run finishes with the same results
            signal.alarm(60)
            code = 0 if _train_two_steps(0.0) == want else 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        numpy_executor.set_threads(1)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.mark.threads
def test_a_failing_piece_raises_after_every_piece_finished():
    numpy_executor.set_threads(2)
    done = []

    def fail():
        raise ValueError("piece failed")

    def slow():
        import time
        time.sleep(0.05)
        done.append(1)
    try:
        with pytest.raises(ValueError, match="piece failed"):
            pool.parallel([fail, slow])
        assert done == [1]
    finally:
        numpy_executor.set_threads(1)


# -- embedding backward: flat np.add.at ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_embedding_backward_matches_reference_with_repeats_and_negative_zeros(dtype):
    g = gl.Graph("emb")
    ids = g.input("ids", (6, 50), "int64")
    table = g.param("table", (7, 5), dtype)
    u = g.input("u", (6, 50, 5), dtype)
    loss = gl.sum(gl.embedding(table, ids) * u)
    (gt,) = gl.grad(loss, [table])
    rng = np.random.default_rng(6)
    uv = rng.standard_normal((6, 50, 5)).astype(dtype)
    uv[:, :, 0] = -0.0                        # a column summing only -0.0s must come out +0.0
    feeds = {"ids": rng.integers(0, 6, (6, 50)), "u": uv}   # id 6 never occurs: a zero row
    state = {"table": rng.standard_normal((7, 5)).astype(dtype)}
    got, want = run_both(g, [gt], feeds, state)
    assert got[0].tobytes() == want[0].tobytes()
    bad = dict(feeds, ids=np.full((6, 50), 7))
    with pytest.raises(ValueError, match="token id 7 is out of range"):
        NUMPY.compile(g, [gt]).run(bad, state)


def test_kept_bytes_counts_the_buffers_fused_kernels_keep():
    g = gl.Graph("kept")
    x = g.input("x", (4, 16), "float32")
    key = g.input("key", (), "int64")
    w = g.param("w", (16,), "float32")
    y = gl.gelu(gl.dropout(gl.layer_norm(x, w, None), 0.5, key, stream=0))
    (gx,) = gl.grad(gl.sum(y * y), [x])
    prog = NUMPY.compile(g, [gx])
    prog.run({"x": np.ones((4, 16), np.float32), "key": np.asarray(1, np.int64)}, {"w": np.ones(16, np.float32)})
    # dropout mask (bool) + gelu sigmoid + layer norm x - mean and sqrt(var + eps)
    assert prog.kept_bytes() == 64 + 64 * 4 + 64 * 4 + 4 * 4


@pytest.mark.threads
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_weight_gradient_summed_over_a_batch_is_one_folded_product(split_everything, n):
    """``x [4, 5, 6] @ w [6, 3]`` written directly (not through Linear, which folds the rows
    itself): w's gradient, sum over the batch of x^T @ g, runs as one ``matmul_sum`` product with
    the batch folded into the contraction. It adds in another order than the reference's batched
    products and sum (so within 1e-6 of it), and equals the one-thread result bit for bit on 2-3
    threads (row blocks of whole register tiles)."""
    rng = np.random.default_rng(3)
    g = gl.Graph("t")
    x, w, r = g.input("x", (4, 5, 6)), g.param("w", (6, 3)), g.input("r", (4, 5, 3))
    (dw,) = gl.grad(gl.sum((x @ w) * r), [w])
    feeds = {"x": rng.standard_normal((4, 5, 6)).astype(np.float32),
             "r": rng.standard_normal((4, 5, 3)).astype(np.float32)}
    state = {"w": rng.standard_normal((6, 3)).astype(np.float32)}
    (want,) = executors.compile(g, [dw], executor="reference").run(feeds, state)
    prog = executors.compile(g, [dw], executor="numpy")
    assert [m.op for m in prog.run_nodes if m.op.startswith("matmul")] == ["matmul_sum"]
    assert not prog.rounds_like_reference
    (one,) = prog.run(feeds, state)
    numpy_executor.set_threads(n)
    try:
        (got,) = executors.compile(g, [dw], executor="numpy").run(feeds, state)
    finally:
        numpy_executor.set_threads(1)
    np.testing.assert_allclose(want, np.einsum("bti,btj->ij", feeds["x"], feeds["r"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(one, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, one)


@pytest.mark.threads
def test_blocked_kernels_split_only_with_enough_blocks_per_thread():
    """A blocked kernel splits over n threads only with at least MIN_BLOCKS_PER_THREAD blocks
    per thread (a few short NumPy calls per thread lose more to the GIL hand-offs than they
    gain: measured 0.6x for dropout's 3 blocks at batch 8 on 2 threads)."""
    import threading
    per = pool.MIN_BLOCKS_PER_THREAD
    for count, threads_used in ((2 * per - 1, 1), (2 * per, 2)):
        seen = []
        run = tiling.run_blocks(lambda i: seen.append((i, threading.get_ident())),
                                         [(i,) for i in range(count)])
        numpy_executor.set_threads(2)
        try:
            run()
        finally:
            numpy_executor.set_threads(1)
        assert sorted(i for i, _ in seen) == list(range(count))
        assert len({t for _, t in seen}) == threads_used, (count, seen)
