"""GPTConfig and GPT: topology, counts, validation, init, causality, modes, overfit, gradients."""
from __future__ import annotations

import math

import numpy as np
import pytest

from graphlm import executors  # noqa: F401  (registers the reference executor)
import graphlm as gl
from graphlm.models import GPT, GPTConfig

EX = "reference"
TINY = dict(vocab_size=5, context_length=4, channels=8, head_count=2, layer_count=2)


def block_names(i):
    b = f"blocks.{i}."
    return [b + n for n in ("attention_norm.weight", "attention_norm.bias", "attention.qkv_weight",
                            "attention.qkv_bias", "attention.output.weight", "attention.output.bias",
                            "mlp_norm.weight", "mlp_norm.bias", "mlp_input.weight", "mlp_input.bias",
                            "mlp_output.weight", "mlp_output.bias")]


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,message", [
    ("vocab_size", 0, "vocab_size must be a positive integer"),
    ("context_length", -1, "context_length must be a positive integer"),
    ("channels", 2.5, "channels must be a positive integer"),
    ("head_count", 0, "head_count must be a positive integer"),
    ("layer_count", 0, "layer_count must be a positive integer"),
    ("layer_count", True, "layer_count must be a positive integer"),
    ("head_count", 3, r"channels \(8\) must be divisible by head_count \(3\)"),
    ("dropout", 1.0, r"dropout must be in \[0, 1\)"),
    ("dropout", -0.1, r"dropout must be in \[0, 1\)"),
    ("layer_norm_epsilon", 0.0, "layer_norm_epsilon must be finite and positive"),
    ("layer_norm_epsilon", float("inf"), "layer_norm_epsilon must be finite and positive"),
    ("layer_norm_epsilon", float("nan"), "layer_norm_epsilon must be finite and positive"),
    ("norm", "batchnorm", "norm must be one of"),
    ("mlp", "relu", "mlp must be one of"),
    ("gelu_approximate", "erf", "gelu_approximate must be one of"),
    ("tie_weights", "yes", "tie_weights must be True or False"),
    ("mlp_hidden", 0, "mlp_hidden must be a positive integer or None"),
    ("mlp_hidden", 16.0, "mlp_hidden must be a positive integer or None"),
    ("mlp_hidden", True, "mlp_hidden must be a positive integer or None"),
])
def test_config_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=f"GPTConfig.{message}"):
        GPTConfig(**{**TINY, field: value})


def test_presets_and_config_round_trip():
    t = GPTConfig.preset("tinylm")
    assert (t.vocab_size, t.context_length, t.channels, t.head_count, t.layer_count, t.dropout) == \
        (256, 128, 192, 6, 4, 0.1)
    g2 = GPTConfig.preset("gpt2-small")
    assert (g2.vocab_size, g2.context_length, g2.channels, g2.head_count, g2.layer_count) == \
        (50257, 1024, 768, 12, 12)
    assert g2.tie_weights and not g2.lm_head_bias
    assert GPTConfig.preset("tinylm", dropout=0.0).dropout == 0.0
    assert GPTConfig.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="unknown GPTConfig preset 'gpt5'"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ValueError, match="unknown field"):
        GPTConfig.from_dict({**t.to_dict(), "heads": 3})


def test_mlp_hidden_defaults_keep_todays_shapes_and_an_explicit_width_is_recorded():
    # the default width is 4C for GELU and 2C for SwiGLU: the shapes every checkpoint has
    for mlp, default, rows in (("gelu", 32, 32), ("swiglu", 16, 32)):
        cfg = GPTConfig(**TINY, mlp=mlp)
        assert cfg.mlp_hidden is None and cfg.mlp_width == default
        shapes = {k: p.shape for k, p in GPT(cfg).parameters().items()}
        assert shapes["blocks.0.mlp_input.weight"] == (rows, 8)
        assert shapes["blocks.0.mlp_output.weight"] == (8, default)
        # the default given explicitly is the same architecture, so the same config
        assert GPTConfig(**TINY, mlp=mlp, mlp_hidden=default) == cfg
        # a config's dict records the actual width; one written before the field existed loads
        assert cfg.to_dict()["mlp_hidden"] == default
        old = {k: v for k, v in cfg.to_dict().items() if k != "mlp_hidden"}
        assert GPTConfig.from_dict(old) == cfg == GPTConfig.from_dict(cfg.to_dict())
        assert GPTConfig.upgrade_dict(old) == cfg.to_dict()
    # another width changes exactly the MLP's shapes and counts
    for mlp, rows in (("gelu", 12), ("swiglu", 24)):
        cfg = GPTConfig(**TINY, mlp=mlp, mlp_hidden=12, mlp_bias=False)
        m = GPT(cfg)
        shapes = {k: p.shape for k, p in m.parameters().items()}
        assert shapes["blocks.1.mlp_input.weight"] == (rows, 8)
        assert shapes["blocks.1.mlp_output.weight"] == (8, 12)
        assert m.blocks[0].mlp_hidden == 12
        base = GPT(GPTConfig(**TINY, mlp=mlp, mlp_bias=False))
        per_block_change = 8 * (rows + 12) - 8 * (base.blocks[0].mlp_input.out_features
                                                 + base.blocks[0].mlp_hidden)
        assert m.parameter_count() - base.parameter_count() == 2 * per_block_change
        assert GPTConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["mlp_hidden"] == 12
    # a default width follows the channels under replace(); an explicit one stays
    t = GPTConfig(**TINY)
    assert t.replace(channels=16).mlp_width == 64
    assert GPTConfig(**TINY, mlp_hidden=12).replace(channels=16).mlp_width == 12


# ------------------------------------------------------------------------------------------------
# topology and counts
# ------------------------------------------------------------------------------------------------

def test_parameter_counts():
    assert GPT(GPTConfig.preset("tinylm")).parameter_count() == 1_902_976
    # counted from declarations: no 124M-float arrays are built
    assert GPT(GPTConfig.preset("gpt2-small")).parameter_count() == 124_439_808
    c = 192
    assert GPT(GPTConfig.preset("tinylm")).blocks[0].parameter_count() == 12 * c * c + 13 * c


def test_topology_names_and_tensor_counts():
    for n, tensors in ((2, 30), (3, 42)):
        m = GPT(GPTConfig(**{**TINY, "layer_count": n}))
        names = list(m.parameters())
        assert len(names) == tensors
        assert names == (["token_embedding.weight", "positional_embedding.table.weight"]
                         + [x for i in range(n) for x in block_names(i)]
                         + ["final_norm.weight", "final_norm.bias",
                            "language_model_head.weight", "language_model_head.bias"])
    m = GPT(GPTConfig(**TINY))
    shapes = {k: p.shape for k, p in m.parameters().items()}
    assert shapes["blocks.0.attention.qkv_weight"] == (3, 8, 8)
    assert shapes["blocks.0.attention.qkv_bias"] == (3, 8)
    assert shapes["blocks.1.mlp_input.weight"] == (32, 8) and shapes["blocks.1.mlp_output.weight"] == (8, 32)
    assert shapes["language_model_head.weight"] == (5, 8)
    assert list(m.children()) == ["token_embedding", "positional_embedding", "blocks", "final_norm",
                                  "language_model_head"]
    g = gl.Graph()
    logits = m(g.input("tokens", (2, 4), "int64"))
    assert logits.shape == (2, 4, 5) and logits.dtype == np.float32
    assert list(g.params) == list(m.parameters())


def test_tied_rmsnorm_swiglu_variant_topology():
    cfg = GPTConfig(**TINY, norm="rmsnorm", mlp="swiglu", tie_weights=True, lm_head_bias=False,
                    attention_bias=False, mlp_bias=False)
    m = GPT(cfg)
    names = list(m.parameters())
    assert "language_model_head.weight" not in names and "language_model_head.bias" not in names
    assert not any(n.endswith(".bias") for n in names)
    c, v, t = 8, 5, 4
    per_block = c + 3 * c * c + c * c + c + 4 * c * c + 2 * c * c
    assert m.parameter_count() == v * c + t * c + 2 * per_block + c
    g = gl.Graph()
    m(g.input("tokens", (1, 3), "int64"))
    assert len(g.params) == len(names)  # the tied weight is one leaf
    head_matmul = [n for n in g.nodes if n.op == "matmul" and n.scope == "language_model_head"]
    assert head_matmul[0].inputs[1].inputs[0] is g.params["token_embedding.weight"]


# ------------------------------------------------------------------------------------------------
# init
# ------------------------------------------------------------------------------------------------

def test_init_is_deterministic_float32_and_follows_policies():
    m = GPT(GPTConfig(**TINY))
    a, b, c = m.init(0), m.init(0), m.init(1)
    assert list(a) == list(m.parameters())
    for k in a:
        assert a[k].dtype == np.float32 and a[k].shape == m.parameters()[k].shape
        np.testing.assert_array_equal(a[k], b[k])
    assert all(not np.array_equal(a[k], c[k]) for k in a if a[k].std() > 0)
    assert np.all(a["blocks.0.attention_norm.weight"] == 1) and np.all(a["blocks.1.mlp_input.bias"] == 0)
    assert np.all(a["blocks.0.attention.qkv_bias"] == 0)
    assert 0.9 * math.sqrt(3 / 8) < np.abs(a["blocks.0.attention.qkv_weight"]).max() <= math.sqrt(3 / 8)
    bound = math.sqrt(6 / (5 + 8))  # Xavier uniform on [V, C]
    assert np.abs(a["token_embedding.weight"]).max() <= bound


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------

def test_token_validation_before_anything_runs():
    m = GPT(GPTConfig(**TINY))
    p = m.init(0)
    ok = np.array([[0, 1, 2, 3]])
    cases = [
        (np.array([[0.0, 1.0]]), "tokens must be an integer array, got dtype float64"),
        (np.array([0, 1, 2]), r"tokens must be a non-empty 2-d \[B, T\] array, got shape \[3\]"),
        (np.zeros((1, 5), np.int64), "sequence length 5 exceeds context_length 4"),
        (np.array([[0, 5]]), r"id 5 at position \[0, 1\] is outside the vocabulary \[0, 5\)"),
        (np.array([[0, -1]]), r"id -1 at position \[0, 1\] is outside the vocabulary"),
    ]
    for tokens, message in cases:
        with pytest.raises(ValueError, match=message):
            m.logits(p, tokens, executor=EX)
        with pytest.raises(ValueError, match=message):
            m.loss_and_grads(p, tokens, ok[:, :np.asarray(tokens).shape[-1]] if np.asarray(tokens).ndim == 2 else ok, executor=EX)
    assert m._programs == {}  # nothing was built or compiled
    with pytest.raises(ValueError, match=r"targets: id 7 .* outside"):
        m.loss_and_grads(p, ok, np.array([[1, 2, 3, 7]]), executor=EX)
    with pytest.raises(ValueError, match=r"targets shape \[1,3\] differs from tokens \[1,4\]"):
        m.loss_and_grads(p, ok, np.array([[1, 2, 3]]), executor=EX)
    bad = dict(p)
    bad["final_norm.bias"] = np.zeros(7, np.float32)
    with pytest.raises(ValueError, match=r"final_norm.bias.*expected \[8\] float32, got \[7\]"):
        m.logits(bad, ok, executor=EX)


def test_logits_match_a_hand_built_graph_and_programs_are_cached():
    m = GPT(GPTConfig(**TINY))
    p = m.init(2)
    tokens = np.array([[1, 2, 3], [4, 0, 1]], dtype=np.int32)
    out = m.logits(p, tokens, executor=EX)
    g = gl.Graph()
    y = m(g.input("tokens", (2, 3), "int32"))
    (expect,) = executors.compile(g, [y], EX).run({"tokens": tokens}, p)
    np.testing.assert_array_equal(out, expect)
    m.logits(p, tokens.astype(np.int64), executor=EX)
    m.loss_and_grads(p, tokens, tokens, executor=EX)
    assert len(m._programs) == 2


def test_causality_measured():
    cfg = GPTConfig(vocab_size=7, context_length=6, channels=8, head_count=2, layer_count=2)
    m = GPT(cfg)
    p = m.init(5)
    a = np.array([[1, 2, 3, 4, 5, 6], [0, 6, 5, 4, 3, 2]])
    b = a.copy()
    b[:, -1] = [3, 0]
    la, lb = m.logits(p, a, executor=EX), m.logits(p, b, executor=EX)
    np.testing.assert_array_equal(la[:, :-1], lb[:, :-1])  # bit-identical
    assert np.abs(la[:, -1] - lb[:, -1]).max() > 1e-3
    # the same model without the mask would let the last token move every earlier position
    for block in m.blocks:
        block.attention.causal = False
    m.clear_cache()
    ua, ub = m.logits(p, a, executor=EX), m.logits(p, b, executor=EX)
    assert np.abs(ua[:, :-1] - ub[:, :-1]).max(axis=(0, 2)).min() > 1e-5


def test_train_mode_adds_dropout_and_conveniences_run_in_eval_mode():
    m = GPT(GPTConfig(**TINY, dropout=0.2))
    assert m.training
    g = gl.Graph()
    logits = m(g.input("tokens", (2, 4), "int64"))
    drops = [n for n in g.nodes if n.op == "dropout"]
    assert len(drops) == 2 * 2 and g.inputs["dropout_key"].dtype == np.int64
    assert len({n.attrs["stream"] for n in drops}) == 4
    p = m.init(0)
    tokens = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    run = executors.compile(g, [logits], EX)
    t1 = run.run({"tokens": tokens, "dropout_key": np.int64(1)}, p)[0]
    t2 = run.run({"tokens": tokens, "dropout_key": np.int64(2)}, p)[0]
    assert not np.array_equal(t1, t2)

    ev = m.logits(p, tokens, executor=EX)  # eval mode: no dropout, no key
    assert m.training and all(mod.training for _, mod in m.named_modules())  # mode restored
    g2 = gl.Graph()
    m.eval()
    y = m(g2.input("tokens", (2, 4), "int64"))
    assert "dropout_key" not in g2.inputs and not any(n.op == "dropout" for n in g2.nodes)
    np.testing.assert_array_equal(ev, executors.compile(g2, [y], EX).run({"tokens": tokens}, p)[0])
    m0 = GPT(GPTConfig(**TINY, dropout=0.0))  # train mode, p = 0: no dropout nodes either
    g3 = gl.Graph()
    m0(g3.input("tokens", (2, 4), "int64"))
    assert "dropout_key" not in g3.inputs


def test_tied_gradient_sums_embedding_and_head_uses():
    cfg = GPTConfig(**TINY)
    untied, tied = GPT(cfg), GPT(cfg.replace(tie_weights=True))
    p = untied.init(3)
    p["language_model_head.weight"] = p["token_embedding.weight"].copy()
    pt = {k: v for k, v in p.items() if k != "language_model_head.weight"}
    tokens, targets = np.array([[0, 1, 2, 3]]), np.array([[1, 2, 3, 4]])
    lu, gu = untied.loss_and_grads(p, tokens, targets, executor=EX)
    lt, gt = tied.loss_and_grads(pt, tokens, targets, executor=EX)
    assert sorted(gt) == sorted(pt)
    assert abs(lu - lt) < 1e-6
    np.testing.assert_allclose(gt["token_embedding.weight"],
                               gu["token_embedding.weight"] + gu["language_model_head.weight"],
                               rtol=1e-5, atol=1e-7)


def test_gradients_against_float64_central_differences():
    cfg = GPTConfig(vocab_size=6, context_length=4, channels=8, head_count=2, layer_count=1,
                    norm="rmsnorm", mlp="swiglu", tie_weights=True)
    for config in (GPTConfig(vocab_size=6, context_length=4, channels=8, head_count=2, layer_count=1), cfg):
        m = GPT(config).astype("float64")
        p = {k: v.astype(np.float64) for k, v in m.init(4).items()}
        r = np.random.default_rng(0)
        for k in p:  # non-trivial norms and biases
            p[k] = p[k] + 0.1 * r.standard_normal(p[k].shape)
        tokens, targets = np.array([[0, 1, 2, 5]]), np.array([[1, 2, 3, 4]])
        loss, grads = m.loss_and_grads(p, tokens, targets, executor=EX)
        assert grads["token_embedding.weight"].dtype == np.float64
        for name in p:
            v = r.standard_normal(p[name].shape)
            eps = 1e-5
            lp = m.loss_and_grads({**p, name: p[name] + eps * v}, tokens, targets, executor=EX)[0]
            lm = m.loss_and_grads({**p, name: p[name] - eps * v}, tokens, targets, executor=EX)[0]
            fd = (lp - lm) / (2 * eps)
            ad = float(np.sum(grads[name] * v))
            assert abs(fd - ad) <= 1e-6 + 1e-5 * abs(fd), (config, name, fd, ad)


def test_tiny_overfit_with_loss_and_grads():
    m = GPT(GPTConfig(vocab_size=5, context_length=4, channels=16, head_count=2, layer_count=2))
    p = m.init(0)
    tokens, targets = np.array([[0, 1, 2, 3]]), np.array([[1, 2, 3, 4]])
    mom = {k: np.zeros_like(v) for k, v in p.items()}
    sq = {k: np.zeros_like(v) for k, v in p.items()}
    lr, b1, b2, wd = 1e-2, 0.9, 0.999, 0.01
    losses = []
    for step in range(1, 301):  # AdamW, written out
        loss, grads = m.loss_and_grads(p, tokens, targets, executor=EX)
        losses.append(loss)
        if loss < 0.05:
            break
        for k in p:
            mom[k] = b1 * mom[k] + (1 - b1) * grads[k]
            sq[k] = b2 * sq[k] + (1 - b2) * grads[k] ** 2
            upd = (mom[k] / (1 - b1 ** step)) / (np.sqrt(sq[k] / (1 - b2 ** step)) + 1e-8)
            p[k] = (p[k] * (1 - lr * wd) - lr * upd).astype(np.float32)
    assert losses[0] > 1.0 and losses[-1] < 0.05, losses[-5:]
    assert np.argmax(m.logits(p, tokens, executor=EX), -1).tolist() == targets.tolist()


def test_default_executor_matches_reference():
    from graphlm.backends import available_executors
    if "numpy" not in available_executors():
        pytest.skip("the numpy executor is not registered yet")
    for kw in ({}, dict(norm="rmsnorm", mlp="swiglu", tie_weights=True, lm_head_bias=False)):
        m = GPT(GPTConfig(**TINY, **kw))
        p = m.init(6)
        r = np.random.default_rng(1)
        tokens, targets = r.integers(0, 5, (3, 4)), r.integers(0, 5, (3, 4))
        np.testing.assert_allclose(m.logits(p, tokens), m.logits(p, tokens, executor=EX), rtol=1e-6, atol=1e-6)
        loss, grads = m.loss_and_grads(p, tokens, targets)
        loss_ref, grads_ref = m.loss_and_grads(p, tokens, targets, executor=EX)
        assert abs(loss - loss_ref) <= 1e-6
        for k in grads_ref:
            np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
