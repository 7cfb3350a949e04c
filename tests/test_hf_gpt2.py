"""graphlm.io.load_hf_gpt2 on small GPT-2-layout directories that the tests write themselves."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from graphlm import executors  # noqa: F401
from graphlm.io import load_hf_gpt2
from graphlm.models import GPT

EX = "reference"
V, T, C, H, N = 13, 8, 16, 4, 2
HF_CONFIG = {"model_type": "gpt2", "vocab_size": V, "n_positions": T, "n_ctx": T, "n_embd": C,
             "n_head": H, "n_layer": N, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}


def hf_tensors(seed=0, prefix="transformer.", inner=4 * C):
    """Random weights in Hugging Face GPT-2 layout (Conv1D weights are [in, out]); `inner` is
    the MLP width (n_inner, 4 * n_embd when null)."""
    r = np.random.default_rng(seed)
    f = lambda *s: (0.2 * r.standard_normal(s)).astype(np.float32)  # noqa: E731
    t = {"wte.weight": f(V, C), "wpe.weight": f(T, C), "ln_f.weight": 1 + f(C), "ln_f.bias": f(C)}
    for i in range(N):
        h = f"h.{i}."
        t.update({h + "ln_1.weight": 1 + f(C), h + "ln_1.bias": f(C),
                  h + "attn.c_attn.weight": f(C, 3 * C), h + "attn.c_attn.bias": f(3 * C),
                  h + "attn.c_proj.weight": f(C, C), h + "attn.c_proj.bias": f(C),
                  h + "ln_2.weight": 1 + f(C), h + "ln_2.bias": f(C),
                  h + "mlp.c_fc.weight": f(C, inner), h + "mlp.c_fc.bias": f(inner),
                  h + "mlp.c_proj.weight": f(inner, C), h + "mlp.c_proj.bias": f(C),
                  h + "attn.bias": np.tril(np.ones((1, 1, T, T), np.float32))})  # HF's mask buffer
    return {prefix + k: v for k, v in t.items()}


def write_dir(path, tensors, config=HF_CONFIG):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def hf_gpt2_forward_numpy(t, tokens, prefix="transformer."):
    """GPT-2 as Hugging Face computes it, written against the HF layout (x @ W + b for Conv1D,
    q|k|v = split(x @ c_attn), tanh GELU, tied head), in float64."""
    t = {k[len(prefix):]: v.astype(np.float64) for k, v in t.items()}

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * t[p + ".weight"] + t[p + ".bias"]

    B, S = tokens.shape
    x = t["wte.weight"][tokens] + t["wpe.weight"][:S]
    for i in range(N):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ t[h + "attn.c_attn.weight"] + t[h + "attn.c_attn.bias"]
        q, k, v = (a.reshape(B, S, H, C // H).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, axis=-1))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // H) + np.triu(np.full((S, S), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(0, 2, 1, 3).reshape(B, S, C)
        x = x + ctx @ t[h + "attn.c_proj.weight"] + t[h + "attn.c_proj.bias"]
        m = ln(x, h + "ln_2") @ t[h + "mlp.c_fc.weight"] + t[h + "mlp.c_fc.bias"]
        m = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m ** 3)))
        x = x + m @ t[h + "mlp.c_proj.weight"] + t[h + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ t["wte.weight"].T


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_import_matches_hugging_face_computation(tmp_path, prefix):
    tensors = hf_tensors(1, prefix)
    config, params = load_hf_gpt2(write_dir(tmp_path / "gpt2", tensors))
    assert (config.vocab_size, config.context_length, config.channels, config.head_count,
            config.layer_count) == (V, T, C, H, N)
    assert config.tie_weights and not config.lm_head_bias and config.gelu_approximate == "tanh"
    model = GPT(config)
    assert sorted(params) == sorted(model.parameters())
    assert all(params[k].dtype == np.float32 and params[k].shape == p.shape
               for k, p in model.parameters().items())
    # the fused QKV split, spelled out: W[j] = c_attn[:, j*C:(j+1)*C]
    c_attn = tensors[prefix + "h.1.attn.c_attn.weight"]
    np.testing.assert_array_equal(params["blocks.1.attention.qkv_weight"][2], c_attn[:, 2 * C:])
    np.testing.assert_array_equal(params["blocks.0.mlp_input.weight"], tensors[prefix + "h.0.mlp.c_fc.weight"].T)

    tokens = np.array([[1, 5, 12, 0, 3, 3], [7, 7, 2, 9, 11, 4]])
    logits = model.logits(params, tokens, executor=EX)
    np.testing.assert_allclose(logits, hf_gpt2_forward_numpy(tensors, tokens, prefix), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_inner", [None, 4 * C, 40])
def test_n_inner_is_the_mlp_width(tmp_path, n_inner):
    inner = 4 * C if n_inner is None else n_inner
    tensors = hf_tensors(2, inner=inner)
    config, params = load_hf_gpt2(write_dir(tmp_path / "gpt2", tensors, {**HF_CONFIG, "n_inner": n_inner}))
    assert config.mlp_width == inner and config.mlp_hidden == (None if inner == 4 * C else inner)
    assert params["blocks.1.mlp_output.weight"].shape == (C, inner)
    tokens = np.array([[1, 5, 12, 0, 3, 3]])
    np.testing.assert_allclose(GPT(config).logits(params, tokens, executor=EX),
                               hf_gpt2_forward_numpy(tensors, tokens), rtol=1e-4, atol=1e-4)


def test_round_trip_graphlm_params_through_gpt2_layout(tmp_path):
    config, _ = load_hf_gpt2(write_dir(tmp_path / "a", hf_tensors(0)))
    params = GPT(config).init(9)
    # graphlm -> HF layout, written independently of the loader's mapping
    t = {"transformer.wte.weight": params["token_embedding.weight"],
         "transformer.wpe.weight": params["positional_embedding.table.weight"],
         "transformer.ln_f.weight": params["final_norm.weight"], "transformer.ln_f.bias": params["final_norm.bias"]}
    for i in range(N):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        t.update({h + "ln_1.weight": params[b + "attention_norm.weight"], h + "ln_1.bias": params[b + "attention_norm.bias"],
                  h + "attn.c_attn.weight": np.concatenate(list(params[b + "attention.qkv_weight"]), axis=1),
                  h + "attn.c_attn.bias": params[b + "attention.qkv_bias"].reshape(-1),
                  h + "attn.c_proj.weight": params[b + "attention.output.weight"].T.copy(),
                  h + "attn.c_proj.bias": params[b + "attention.output.bias"],
                  h + "ln_2.weight": params[b + "mlp_norm.weight"], h + "ln_2.bias": params[b + "mlp_norm.bias"],
                  h + "mlp.c_fc.weight": params[b + "mlp_input.weight"].T.copy(), h + "mlp.c_fc.bias": params[b + "mlp_input.bias"],
                  h + "mlp.c_proj.weight": params[b + "mlp_output.weight"].T.copy(), h + "mlp.c_proj.bias": params[b + "mlp_output.bias"]})
    _, back = load_hf_gpt2(write_dir(tmp_path / "b", t))
    assert sorted(back) == sorted(params)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])


def test_bad_directories_raise_value_errors_naming_file_and_key(tmp_path):
    good = hf_tensors(2)
    with pytest.raises(ValueError, match=r"nowhere.config.json: file not found"):
        load_hf_gpt2(tmp_path / "nowhere")

    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(ValueError, match=r"noweights.model.safetensors: file not found"):
        load_hf_gpt2(d)

    d = write_dir(tmp_path / "truncated", good)
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"truncated.model.safetensors"):
        load_hf_gpt2(d)
    (d / "model.safetensors").write_bytes(raw[:5])
    with pytest.raises(ValueError, match=r"truncated.model.safetensors"):
        load_hf_gpt2(d)

    bad = dict(good)
    bad["transformer.h.1.mlp.c_fc.weight"] = np.zeros((C, 3 * C), np.float32)
    with pytest.raises(ValueError, match=r"wrongshape.model.safetensors: tensor "
                                         r"'transformer.h.1.mlp.c_fc.weight' has shape \[16,48\], expected \[16,64\]"):
        load_hf_gpt2(write_dir(tmp_path / "wrongshape", bad))

    missing = {k: v for k, v in good.items() if k != "transformer.h.0.ln_2.bias"}
    with pytest.raises(ValueError, match=r"missing.model.safetensors: missing tensor 'transformer.h.0.ln_2.bias'"):
        load_hf_gpt2(write_dir(tmp_path / "missing", missing))

    with pytest.raises(ValueError, match=r"badconfig.config.json: GPTConfig.channels \(16\) must be divisible by head_count \(3\)"):
        load_hf_gpt2(write_dir(tmp_path / "badconfig", good, {**HF_CONFIG, "n_head": 3}))
    with pytest.raises(ValueError, match=r"noembd.config.json: missing key 'n_embd'"):
        load_hf_gpt2(write_dir(tmp_path / "noembd", good, {k: v for k, v in HF_CONFIG.items() if k != "n_embd"}))
    d = write_dir(tmp_path / "notjson", good)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"notjson.config.json: cannot read"):
        load_hf_gpt2(d)
