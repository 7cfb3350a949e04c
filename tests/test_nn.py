"""graphlm.nn and graphlm.init: module tree, naming, modes, layers against NumPy/PyTorch."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm import init, nn
from graphlm.random import SplitMix64


def run(g, outputs, feeds, state, executor="reference"):
    return executors.compile(g, outputs, executor=executor).run(feeds, state)


def call(module, *arrays, seed=0, params=None, executor="reference"):
    """Build ``module(*inputs)`` in a fresh graph and run it; returns (output, params, graph)."""
    g = gl.Graph("t")
    xs = [g.input(f"x{i}", a.shape, a.dtype) for i, a in enumerate(arrays)]
    y = module(*xs)
    params = module.init(seed) if params is None else params
    (out,) = run(g, [y], {f"x{i}": a for i, a in enumerate(arrays)}, params, executor)
    return out, params, g


def ref_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


# ------------------------------------------------------------------------------------------------
# RNG and init policies
# ------------------------------------------------------------------------------------------------

def test_splitmix64_matches_published_sequence():
    # splitmix64 seeded with 0: the first outputs of the reference C implementation (Vigna)
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                   0x06C45D188009454F]


@pytest.mark.parametrize("policy", list(init.POLICIES))
def test_init_policies_deterministic_and_seed_dependent(policy):
    f = init.get_policy(policy)
    a = f((16, 8), SplitMix64(1))
    b = f((16, 8), SplitMix64(1))
    c = f((16, 8), SplitMix64(2))
    assert a.dtype == np.float32 and a.shape == (16, 8)
    np.testing.assert_array_equal(a, b)
    if policy in ("zero", "one"):
        np.testing.assert_array_equal(a, np.full((16, 8), float(policy == "one"), np.float32))
    else:
        assert not np.array_equal(a, c)


def test_init_policy_scales_follow_fans():
    shape = (200, 100)  # fan_in 100, fan_out 200
    xu = init.xavier_uniform(shape, SplitMix64(3))
    hu = init.he_uniform(shape, SplitMix64(3))
    bx, bh = math.sqrt(6 / 300), math.sqrt(6 / 100)
    assert np.abs(xu).max() <= bx and np.abs(xu).max() > 0.99 * bx
    assert np.abs(hu).max() <= bh and np.abs(hu).max() > 0.99 * bh
    xn = init.xavier_normal(shape, SplitMix64(4))
    hn = init.he_normal(shape, SplitMix64(4))
    assert abs(xn.std() / math.sqrt(2 / 300) - 1) < 0.03
    assert abs(hn.std() / math.sqrt(2 / 100) - 1) < 0.03
    assert abs(xn.mean()) < 0.01 * math.sqrt(2 / 300) * 10
    assert init.fans((4, 3, 5)) == (15, 20)
    with pytest.raises(ValueError, match="unknown init policy 'bogus'"):
        init.get_policy("bogus")


# ------------------------------------------------------------------------------------------------
# the module tree
# ------------------------------------------------------------------------------------------------

class Pair(nn.Module):
    def __init__(self, shared: bool):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        if shared:
            self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(self.first(x))


def test_parameter_names_order_and_shared_parameter_counted_once():
    plain, tied = Pair(False), Pair(True)
    assert list(plain.parameters()) == ["first.weight", "first.bias", "second.weight", "second.bias"]
    assert list(tied.parameters()) == ["first.weight", "first.bias", "second.bias"]
    assert plain.parameter_count() == 24 and tied.parameter_count() == 15
    g = gl.Graph()
    x = g.input("x", (2, 3))
    y = tied(x)
    assert sorted(g.params) == ["first.bias", "first.weight", "second.bias"]
    # the one leaf is read by both matmuls, and its gradient sums both uses
    (gw,) = gl.grad(gl.sum(y), [g.params["first.weight"]])
    p = tied.init(0)
    xv = np.arange(6, dtype=np.float32).reshape(2, 3) / 6
    (got,) = run(g, [gw], {"x": xv}, p)
    w, b1 = p["first.weight"], p["first.bias"]
    h = xv @ w.T + b1
    ones = np.ones((2, 3), np.float32)
    expect = ones.T @ h + (ones @ w).T @ xv  # second use (h @ W^T) + first use (x @ W^T)
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)


def test_train_eval_propagates_to_every_descendant():
    m = gl.GPT(gl.GPTConfig(5, 4, 8, 2, 2, dropout=0.1))
    mods = [mod for _, mod in m.named_modules()]
    assert len(mods) > 20 and all(mod.training for mod in mods)
    assert m.eval() is m and not any(mod.training for mod in mods)
    m.train()
    assert all(mod.training for mod in mods)
    m.blocks[1].attention.output_dropout.eval()
    assert not m.blocks[1].attention.output_dropout.training and m.blocks[1].training


def test_scopes_equal_module_paths_and_param_leaves_bound_by_name():
    m = nn.DecoderBlock(8, 2)
    g = gl.Graph()
    x = g.input("x", (1, 3, 8))
    with g.scope("blocks.0"):
        m(x)
    assert list(g.params) == ["blocks.0." + n for n in m.parameters()]
    scopes = {n.scope for n in g.nodes if not n.is_leaf}
    assert {"blocks.0.attention", "blocks.0.attention.output", "blocks.0.mlp_input"} <= scopes
    # calling again in the same graph and scope reuses the leaves (no duplicate-name error)
    with g.scope("blocks.0"):
        m(x)
    assert len(g.params) == 12


def test_existing_param_with_wrong_shape_is_a_clear_error():
    g = gl.Graph()
    g.param("weight", (5, 5))
    with pytest.raises(gl.GraphError, match=r"param 'weight' as \[5,5\].*declares \[2,3\]"):
        nn.Linear(3, 2)(g.input("x", (1, 3)))


def test_wrong_input_width_names_module_and_shapes():
    g = gl.Graph()
    lin = nn.Linear(4, 2)
    with g.scope("blocks.0"), g.scope("mlp_input"):
        with pytest.raises(gl.ShapeError, match=r"Linear 'blocks.0.mlp_input': input \[2,3\] must have last dimension 4"):
            lin.forward(g.input("x", (2, 3)))
    with pytest.raises(ValueError, match="channels .10. must be divisible by head_count .3."):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="Dropout: dropout probability must be in"):
        nn.Dropout(1.0)
    with pytest.raises(ValueError, match="LayerNorm: eps"):
        nn.LayerNorm(4, eps=float("nan"))
    with pytest.raises(TypeError, match="expects a graphlm.Tensor"):
        lin(np.zeros((2, 4)))


# ------------------------------------------------------------------------------------------------
# layers against NumPy
# ------------------------------------------------------------------------------------------------

def test_linear_embedding_norms_against_numpy(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    lin = nn.Linear(4, 5)
    y, p, _ = call(lin, x)
    np.testing.assert_allclose(y, x @ p["weight"].T + p["bias"], rtol=1e-5, atol=1e-6)
    y, p, g = call(nn.Linear(4, 5, bias=False), x)
    assert list(p) == ["weight"] and list(g.params) == ["weight"]
    np.testing.assert_allclose(y, x @ p["weight"].T, rtol=1e-5, atol=1e-6)

    ids = np.array([[3, 0, 2], [1, 1, 4]], dtype=np.int64)
    y, p, _ = call(nn.Embedding(5, 4), ids)
    np.testing.assert_array_equal(y, p["weight"][ids])

    pe = nn.PositionalEmbedding(6, 4)
    y, p, _ = call(pe, x)
    assert list(p) == ["table.weight"]
    np.testing.assert_allclose(y, x + p["table.weight"][:3], rtol=1e-6)
    pos = np.array([4, 1, 0], dtype=np.int64)
    y, p, _ = call(pe, x, pos)
    np.testing.assert_allclose(y, x + p["table.weight"][pos], rtol=1e-6)

    ln = nn.LayerNorm(4, eps=1e-5)
    p = {"weight": rng.standard_normal(4).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32)}
    y, _, _ = call(ln, x, params=p)
    np.testing.assert_allclose(y, ref_layer_norm(x, p["weight"], p["bias"], 1e-5), rtol=1e-4, atol=1e-5)
    rms = nn.RMSNorm(4, eps=1e-6)
    p = {"weight": rng.standard_normal(4).astype(np.float32)}
    y, _, _ = call(rms, x, params=p)
    np.testing.assert_allclose(y, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p["weight"],
                               rtol=1e-4, atol=1e-5)
    assert nn.LayerNorm(4).init(0)["weight"].tolist() == [1, 1, 1, 1]


def test_linear_folds_leading_axes_into_one_product_and_its_weight_gradient_is_contiguous(rng):
    """x [2, 3, 4] runs as one [6, 4] @ [4, 5] product (not a batch of [3, 4] ones), and the
    weight's gradient is the product g^T @ x of shape [out, in] itself, not a transposed view of
    x^T @ g (the optimizer then reads it as one flat array)."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    gy = rng.standard_normal((2, 3, 5)).astype(np.float32)
    g = gl.Graph("t")
    xi, gi = g.input("x", x.shape), g.input("gy", gy.shape)
    lin = nn.Linear(4, 5)
    y = lin(xi)
    assert y.shape == (2, 3, 5)
    (mm,) = [n for n in g.nodes if n.op == "matmul"]
    assert mm.inputs[0].shape == (6, 4) and mm.shape == (6, 5)
    w = g.params["weight"]
    (dw,) = gl.grad(gl.sum(y * gi), [w])
    assert dw.op == "matmul" and dw.shape == (5, 4), (dw.op, dw.shape)
    p = lin.init(0)
    for ex in ("reference", "numpy"):
        out, got = executors.compile(g, [y, dw], executor=ex).run({"x": x, "gy": gy}, p)
        np.testing.assert_allclose(out, x @ p["weight"].T + p["bias"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, gy.reshape(6, 5).T @ x.reshape(6, 4), rtol=1e-5, atol=1e-5)


def test_mlp_and_swiglu_against_numpy(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    mlp = nn.MLP(4, [6, 5], 3, activation="relu")
    assert list(mlp.parameters()) == [f"layers.{i}.{w}" for i in range(3) for w in ("weight", "bias")]
    y, p, _ = call(mlp, x)
    h = x
    for i in range(3):
        h = h @ p[f"layers.{i}.weight"].T + p[f"layers.{i}.bias"]
        if i < 2:
            h = np.maximum(h, 0)
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)

    sw = nn.SwiGLU(4, 6)
    y, p, _ = call(sw, x)
    h = x @ p["input.weight"].T + p["input.bias"]
    gate, value = h[..., :6], h[..., 6:]
    expect = (gate / (1 + np.exp(-gate)) * value) @ p["output.weight"].T + p["output.bias"]
    np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="unknown activation 'nope'"):
        nn.MLP(4, [4], 4, activation="nope")


def np_attention(x, mem, p, heads, causal, prefix=""):
    c = x.shape[-1]
    d = c // heads
    w, b = p[prefix + "qkv_weight"], p.get(prefix + "qkv_bias", np.zeros((3, c), np.float32))
    q, k, v = x @ w[0] + b[0], mem @ w[1] + b[1], mem @ w[2] + b[2]
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, d).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    if causal:
        s = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    ctx = (a @ v).transpose(0, 2, 1, 3).reshape(x.shape)
    out = ctx @ p[prefix + "output.weight"].T
    if prefix + "output.bias" in p:
        out = out + p[prefix + "output.bias"]
    return out


def test_attention_self_and_cross_against_numpy(rng):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    mem = rng.standard_normal((2, 7, 8)).astype(np.float32)
    attn = nn.MultiheadAttention(8, 2)
    p = attn.init(1)
    p["qkv_bias"] = rng.standard_normal((3, 8)).astype(np.float32)
    assert abs(p["qkv_weight"]).max() <= math.sqrt(3 / 8)
    y, _, _ = call(attn, x, params=p)
    np.testing.assert_allclose(y, np_attention(x, x, p, 2, True), rtol=1e-4, atol=1e-5)

    cross = nn.MultiheadAttention(8, 2, bias=False, causal=False)
    assert list(cross.parameters()) == ["qkv_weight", "output.weight"]
    y, p, _ = call(cross, x, mem)
    assert y.shape == (2, 5, 8)
    np.testing.assert_allclose(y, np_attention(x, mem, p, 2, False), rtol=1e-4, atol=1e-5)


def test_dropout_modes_key_and_stable_streams():
    def build(order, training=True, p=0.5):
        g = gl.Graph()
        x = g.input("x", (4, 64))
        mods = {"a": nn.Dropout(p), "b": nn.Dropout(p)}
        outs = {}
        for name in order:
            mods[name].train(training)
            with g.scope(name):
                outs[name] = mods[name].forward(x)
        return g, outs

    g, outs = build("ab")
    assert g.inputs["dropout_key"].dtype == np.int64 and g.inputs["dropout_key"].shape == ()
    assert [n.attrs["stream"] for n in g.nodes if n.op == "dropout"] == [zlib.crc32(b"a"), zlib.crc32(b"b")]
    x = np.ones((4, 64), np.float32)
    a1, b1 = run(g, [outs["a"], outs["b"]], {"x": x, "dropout_key": np.int64(7)}, {})
    g2, outs2 = build("ba")
    a2, b2 = run(g2, [outs2["a"], outs2["b"]], {"x": x, "dropout_key": np.int64(7)}, {})
    np.testing.assert_array_equal(a1, a2)  # masks do not depend on build order
    np.testing.assert_array_equal(b1, b2)
    assert not np.array_equal(a1, b1)
    assert set(np.unique(a1)) <= {0.0, 2.0} and 0.3 < (a1 == 0).mean() < 0.7
    (a3,) = run(g, [outs["a"]], {"x": x, "dropout_key": np.int64(8)}, {})
    assert not np.array_equal(a1, a3)

    for training, p in ((False, 0.5), (True, 0.0)):
        g, outs = build("ab", training, p)
        assert outs["a"] is g.inputs["x"] and "dropout_key" not in g.inputs
        assert not any(n.op == "dropout" for n in g.nodes)

    # a training program may declare the key as state; the module uses it
    g = gl.Graph()
    key = g.state("dropout_key", (), "int64")
    y = nn.Dropout(0.1)(g.input("x", (3,)))
    assert y.inputs[1] is key and "dropout_key" not in g.inputs


# ------------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------------

def test_decoder_block_topology_and_zero_residual_identity(rng):
    c = 8
    block = nn.DecoderBlock(c, 2)
    assert list(block.children()) == ["attention_norm", "attention", "mlp_norm", "mlp_input",
                                      "mlp_output", "mlp_dropout"]
    assert len(block.parameters()) == 12 and block.parameter_count() == 12 * c * c + 13 * c
    x = rng.standard_normal((2, 5, c)).astype(np.float32)
    p = block.init(0)
    for name in p:
        if not name.endswith("norm.weight") and not name.endswith("norm.bias"):
            p[name] = np.zeros_like(p[name])
    y, _, _ = call(block, x, params=p)
    np.testing.assert_array_equal(y, x)
    # and with real weights the block does change its input
    y, _, _ = call(block, x)
    assert np.abs(y - x).max() > 1e-2

    sw = nn.DecoderBlock(c, 2, norm="rmsnorm", mlp="swiglu", attention_bias=False, mlp_bias=False)
    shapes = {n: p.shape for n, p in sw.parameters().items()}
    assert shapes["mlp_input.weight"] == (4 * c, c) and shapes["mlp_output.weight"] == (c, 2 * c)
    assert "attention.qkv_bias" not in shapes and "mlp_norm.bias" not in shapes


def test_transformer_decoder_layer_count_and_against_torch(torch, rng):
    layer = nn.TransformerDecoderLayer(8, 2, 32)
    assert layer.parameter_count() == 1112
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    mem = rng.standard_normal((2, 5, 8)).astype(np.float32)
    y, p, _ = call(layer, x, mem, seed=3)

    ref = torch.nn.TransformerDecoderLayer(8, 2, 32, dropout=0.0, batch_first=True, norm_first=False)
    t = lambda a: torch.tensor(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        for ours, theirs in (("self_attention", ref.self_attn), ("cross_attention", ref.multihead_attn)):
            theirs.in_proj_weight.copy_(t(np.concatenate([p[f"{ours}.qkv_weight"][j].T for j in range(3)])))
            theirs.in_proj_bias.zero_()
            theirs.out_proj.weight.copy_(t(p[f"{ours}.output.weight"]))
            theirs.out_proj.bias.zero_()
        for ours, theirs in (("self_attention_norm", ref.norm1), ("cross_attention_norm", ref.norm2),
                             ("feed_forward_norm", ref.norm3)):
            theirs.weight.copy_(t(p[f"{ours}.weight"]))
            theirs.bias.copy_(t(p[f"{ours}.bias"]))
        for i, lin in enumerate((ref.linear1, ref.linear2)):
            lin.weight.copy_(t(p[f"feed_forward.layers.{i}.weight"]))
            lin.bias.copy_(t(p[f"feed_forward.layers.{i}.bias"]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(3)
        expect = ref(t(x), t(mem), tgt_mask=mask, tgt_is_causal=True).numpy()
    np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-5)

    # causal in the decoder input, but every decoder position sees all of the memory
    x2, mem2 = x.copy(), mem.copy()
    x2[:, -1] += 1.0
    mem2[:, -1] += 1.0
    y2, _, _ = call(layer, x2, mem, params=p)
    y3, _, _ = call(layer, x, mem2, params=p)
    np.testing.assert_array_equal(y2[:, :-1], y[:, :-1])
    assert np.abs(y3 - y).max(axis=(0, 2)).min() > 1e-4
