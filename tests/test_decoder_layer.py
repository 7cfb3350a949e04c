"""The C decoder layer's test suite (c-decoder-layer.md, tests/test_decoder_layer.c) as properties
of graphlm's post-norm `TransformerDecoderLayer`, one test per C test, named after it.

The C suite's demo layer: d_model 8, 2 heads, d_ff 32 (1,112 parameters), a 3-position decoder
input and a 5-position encoder output. Each test asserts the behaviour the C test's name
promises, not only a shape; the layer runs on the reference executor (the oracle) and the numpy
executor must agree with it (test_forward_shape). The layer against PyTorch's is in test_nn.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm import nn

D, H, FF = 8, 2, 32
B, T_DEC, T_ENC = 2, 3, 5


def run_layer(layer, x, memory, params, executor="reference", taps=False):
    """The layer's output for decoder input `x` and encoder output `memory`; with `taps`, also
    {name: array} of its attention probabilities and the three post-norm outputs, read from the
    same graph (the probabilities through `nn.capture_attention`, the norms by their nodes)."""
    g = gl.Graph("decoder_layer")
    xin, min_ = g.input("x", x.shape), g.input("memory", memory.shape)
    with nn.capture_attention(layer) as probs:
        y = layer(xin, min_)
    extra = {}
    if taps:
        extra = {f"{k}.probabilities": v for k, vs in probs.items() for v in vs}
        for n in g.nodes:
            if n.op == "layer_norm":
                extra[n.scope] = n
    names = list(extra)
    out = executors.compile(g, [y, *extra.values()], executor=executor).run(
        {"x": x, "memory": memory}, params)
    return (out[0], dict(zip(names, out[1:]))) if taps else out[0]


@pytest.fixture
def layer():
    return nn.TransformerDecoderLayer(D, H, FF).eval()


@pytest.fixture
def data():
    r = np.random.default_rng(5)
    return (r.standard_normal((B, T_DEC, D)).astype(np.float32),
            r.standard_normal((B, T_ENC, D)).astype(np.float32))


def test_decoder_create(layer):
    """The layer holds a causal (masked) self-attention, a non-causal cross-attention, three
    LayerNorms and a d_model -> d_ff -> d_model feed-forward, with the sizes it was made with."""
    assert (layer.d_model, layer.head_count, layer.d_ff) == (D, H, FF)
    assert list(layer.children()) == ["self_attention", "self_attention_norm", "cross_attention",
                                      "cross_attention_norm", "feed_forward",
                                      "feed_forward_dropout", "feed_forward_norm"]
    assert layer.self_attention.causal and not layer.cross_attention.causal
    for attn in (layer.self_attention, layer.cross_attention):
        assert (attn.channels, attn.head_count, attn.head_width) == (D, H, D // H)
    norms = [layer.self_attention_norm, layer.cross_attention_norm, layer.feed_forward_norm]
    assert all(isinstance(n, nn.LayerNorm) and n.width == D for n in norms)
    assert len({id(n.weight) for n in norms}) == 3          # three norms, not one shared
    ff = layer.feed_forward.layers
    assert [(lin.in_features, lin.out_features) for lin in ff] == [(D, FF), (FF, D)]
    assert "d_model=8, heads=2, d_ff=32" in repr(layer)


def test_forward_shape(layer, data):
    """[B, T_dec, d_model] out for any decoder and encoder lengths, finite float32, and the
    numpy executor computes what the reference executor does."""
    x, memory = data
    params = layer.init(0)
    y = run_layer(layer, x, memory, params)
    assert y.shape == (B, T_DEC, D) and y.dtype == np.float32 and np.isfinite(y).all()
    np.testing.assert_allclose(run_layer(layer, x, memory, params, "numpy"), y, rtol=1e-5, atol=1e-6)
    for t_dec, t_enc in ((1, 1), (7, 2), (2, 9)):
        y2 = run_layer(layer, x[:, :1].repeat(t_dec, 1), memory[:, :1].repeat(t_enc, 1), params)
        assert y2.shape == (B, t_dec, D)


def test_masked_attention_shape(layer, data):
    """The masked self-attention is [B, H, T_dec, T_dec]: each decoder position distributes one
    unit of attention over the decoder positions."""
    x, memory = data
    _, taps = run_layer(layer, x, memory, layer.init(0), taps=True)
    p = taps["self_attention.probabilities"]
    assert p.shape == (B, H, T_DEC, T_DEC)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert (p >= 0).all()


def test_cross_attention_shape(layer, data):
    """Cross-attention is [B, H, T_dec, T_enc]: queries from the decoder, keys from the encoder;
    not masked, so every decoder position gives every encoder position some weight."""
    x, memory = data
    _, taps = run_layer(layer, x, memory, layer.init(0), taps=True)
    p = taps["cross_attention.probabilities"]
    assert p.shape == (B, H, T_DEC, T_ENC)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert (p > 0).all()


def test_mask_correctness_and_diagonal(layer):
    """Above the diagonal the self-attention probabilities are exactly 0 (the C code's -1e9
    before the softmax; graphlm's -inf); the diagonal is positive; position 0 sees only itself."""
    r = np.random.default_rng(0)
    x = r.standard_normal((B, 6, D)).astype(np.float32)
    _, taps = run_layer(layer, x, r.standard_normal((B, 4, D)).astype(np.float32),
                        layer.init(1), taps=True)
    p = taps["self_attention.probabilities"]
    upper = np.triu(np.ones((6, 6), bool), k=1)
    assert (p[..., upper] == 0).all()
    assert (np.diagonal(p, axis1=-2, axis2=-1) > 0).all()
    assert (p[..., ~upper] > 0).all()
    np.testing.assert_array_equal(p[..., 0, 0], 1.0)


def test_residual_connection(layer, data):
    """Each sublayer adds to its input: with every sublayer's weights zero the input alone goes
    through, normalised three times; with them the sublayers add something."""
    x, memory = data
    p = layer.init(0)
    zero = {k: (np.zeros_like(v) if "norm" not in k else v) for k, v in p.items()}
    y = run_layer(layer, x, memory, zero)

    def ln(a):
        mu = a.mean(-1, keepdims=True)
        return (a - mu) / np.sqrt(((a - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    np.testing.assert_allclose(y, ln(ln(ln(x))), rtol=1e-5, atol=1e-5)
    assert np.abs(run_layer(layer, x, memory, p) - y).max() > 1e-2


def test_layernorm_statistics(layer, data):
    """All three post-norm outputs have mean 0 and variance 1 over d_model in every row, up to
    the norm's affine parameters: (y - bias) / weight is standardised."""
    x, memory = data
    p = layer.init(0)
    r = np.random.default_rng(3)
    for k in p:
        if "norm" in k:   # move the affine parameters off (1, 0) so they are part of the test
            p[k] = (p[k] + 0.3 * r.standard_normal(p[k].shape)).astype(np.float32)
    y, taps = run_layer(layer, x, memory, p, taps=True)
    names = ["self_attention_norm", "cross_attention_norm", "feed_forward_norm"]
    assert sorted(n for n in taps if not n.endswith("probabilities")) == sorted(names)
    np.testing.assert_array_equal(taps["feed_forward_norm"], y)       # the last one is the output
    for name in names:
        z = (taps[name] - p[f"{name}.bias"]) / p[f"{name}.weight"]
        np.testing.assert_allclose(z.mean(-1), 0.0, atol=1e-5)
        np.testing.assert_allclose(z.var(-1), 1.0, rtol=1e-3)  # var / (var + eps), eps = 1e-5


def test_parameter_count(layer):
    """1,112 for (8, 2, 32) as the C demo prints it: masked and cross MHA 256 each (4 d^2, no
    biases), three LayerNorms 16 each, feed-forward 552 (2 d d_ff + d_ff + d); and the same
    closed formula for other sizes."""
    def count(module):
        return module.parameter_count()

    assert [count(layer.self_attention), count(layer.cross_attention),
            count(layer.self_attention_norm), count(layer.cross_attention_norm),
            count(layer.feed_forward_norm), count(layer.feed_forward)] == [256, 256, 16, 16, 16, 552]
    assert count(layer) == 1112
    for d, h, ff in ((12, 3, 20), (16, 4, 64), (6, 1, 7)):
        assert count(nn.TransformerDecoderLayer(d, h, ff)) == 8 * d * d + 3 * 2 * d + 2 * d * ff + ff + d


@pytest.mark.parametrize("args,message", [
    ((0, 2, 32), "d_model must be a positive integer"),
    ((8, 0, 32), "head_count must be a positive integer"),
    ((8, 2, 0), "d_ff must be a positive integer"),
    ((8, 3, 32), r"d_model \(8\) must be divisible by head_count \(3\)"),
])
def test_invalid_configuration(args, message):
    """The C suite's four refusals (three zero dimensions, d_model not divisible by the heads):
    a ValueError that names the layer and the field."""
    with pytest.raises(ValueError, match=f"^TransformerDecoderLayer: {message}"):
        nn.TransformerDecoderLayer(*args)


def test_cross_attention_dependency(layer, data):
    """The output depends on the encoder output at every decoder position, through
    cross-attention alone: changing the encoder output changes every row; permuting its
    positions does not (cross-attention has no notion of encoder order)."""
    x, memory = data
    p = layer.init(0)
    y = run_layer(layer, x, memory, p)
    changed = memory.copy()
    changed[:, 2] += 1.0                        # one encoder position
    moved = np.abs(run_layer(layer, x, changed, p) - y).max(-1)
    assert (moved > 1e-4).all()                 # every batch row, every decoder position
    permuted = memory[:, [4, 2, 0, 3, 1]]
    np.testing.assert_allclose(run_layer(layer, x, permuted, p), y, rtol=1e-5, atol=1e-6)
    # and with the cross-attention's output projection zero the encoder output has no effect
    cut = dict(p, **{"cross_attention.output.weight": np.zeros_like(p["cross_attention.output.weight"])})
    np.testing.assert_array_equal(run_layer(layer, x, changed, cut), run_layer(layer, x, memory, cut))


@pytest.mark.parametrize("executor", ["reference", "numpy"])
def test_causal_property(layer, executor):
    """Changing decoder position t leaves every earlier output bit-identical and changes
    position t's, for every t."""
    r = np.random.default_rng(1)
    x = r.standard_normal((B, 6, D)).astype(np.float32)
    memory = r.standard_normal((B, 4, D)).astype(np.float32)
    p = layer.init(2)
    y = run_layer(layer, x, memory, p, executor)
    for t in range(6):
        x2 = x.copy()
        x2[:, t] = -x2[:, t]
        y2 = run_layer(layer, x2, memory, p, executor)
        assert y2[:, :t].tobytes() == y[:, :t].tobytes(), f"position {t} reached earlier ones"
        assert (np.abs(y2[:, t] - y[:, t]).max(-1) > 1e-3).all()


def test_component_reuse(layer, data):
    """One layer object called twice is one set of parameters and one function: twice on the
    same input gives the same output; stacked (layer(layer(x))) equals running the layer's
    program on its own output."""
    x, memory = data
    p = layer.init(0)
    g = gl.Graph("reuse")
    xin, min_ = g.input("x", x.shape), g.input("memory", memory.shape)
    a, b = layer(xin, min_), layer(xin, min_)
    stacked = layer(a, min_)
    assert sorted(g.params) == sorted(layer.parameters())            # bound once
    ya, yb, ys = executors.compile(g, [a, b, stacked], executor="reference").run(
        {"x": x, "memory": memory}, p)
    assert ya.tobytes() == yb.tobytes()
    np.testing.assert_array_equal(ya, run_layer(layer, x, memory, p))
    np.testing.assert_allclose(ys, run_layer(layer, ya, memory, p), rtol=1e-6, atol=1e-6)
