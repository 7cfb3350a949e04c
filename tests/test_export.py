"""graphlm.io.export and `graphlm export`: Hugging Face GPT-2 folders (read back with safetensors,
graphlm's importer and, when installed, transformers) and GGUF files in llama.cpp's gpt2 layout
(read back with gguf's reader and run by a small NumPy transcription of llama.cpp's gpt2 graph)."""
import json

import numpy as np
import pytest

from graphlm.data import BUNDLED_CORPUS
from graphlm.io import load_hf_gpt2
from graphlm.io.export import (CLEAN_PRESET, ExportError, bytes_to_unicode, export_gguf, export_hf,
                               unsupported)
from graphlm.models import GPT, GPTConfig
from graphlm.tools.cli import main as cli_main

SMALL = dict(context_length=8, channels=16, head_count=2, layer_count=2)
TOKENS = np.array([[72, 101, 108, 108, 111, 32, 0, 255]])


def model_and_params(seed=0, **overrides):
    config = GPTConfig.preset(CLEAN_PRESET, **{**SMALL, "dropout": 0.0, **overrides})
    model = GPT(config)
    rng = np.random.default_rng(seed)
    # every parameter away from its init (zero biases, unit gains) so a misplaced one shows
    params = {k: (v + rng.normal(0, 0.2, v.shape)).astype(np.float32)
              for k, v in model.init(seed).items()}
    return config, model, params


def reference_logits(model, params):
    return model.logits(params, TOKENS, executor="reference")


# -- Hugging Face -------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"tie_weights": True}, {"attention_bias": False, "mlp_bias": False},
                                       {"gelu_approximate": "none"}])
def test_hf_round_trip_through_the_importer_gives_the_same_logits(tmp_path, overrides):
    config, model, params = model_and_params(**overrides)
    out = export_hf(config, params, tmp_path / "hf")
    from safetensors.numpy import load_file

    tensors = load_file(out / "model.safetensors")
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "gpt2" and hf["n_layer"] == 2 and hf["n_embd"] == 16
    assert hf["tie_word_embeddings"] == config.tie_weights
    assert ("lm_head.weight" in tensors) == (not config.tie_weights)
    assert tensors["transformer.h.1.attn.c_attn.weight"].shape == (16, 48)      # Conv1D [in, out]
    assert all(a.dtype == np.float32 for a in tensors.values())
    if not config.attention_bias:
        assert not tensors["transformer.h.0.attn.c_attn.bias"].any()           # exact zeros
    back_config, back = load_hf_gpt2(out)
    assert back_config.tie_weights == config.tie_weights
    assert back_config.gelu_approximate == config.gelu_approximate
    for name in params:
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)
    np.testing.assert_allclose(GPT(back_config).logits(back, TOKENS, executor="reference"),
                               reference_logits(model, params), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_gpt2_loads_the_export_and_agrees(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config, model, params = model_and_params(seed=1, tie_weights=tie)
    export_hf(config, params, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    hf.eval()
    with torch.no_grad():
        logits = hf(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(logits, reference_logits(model, params), rtol=1e-4, atol=1e-4)
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(tmp_path / "hf")
    text = "Hello, world!\nRoméo"
    assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))   # graphlm's byte ids
    assert tokenizer.decode(list(text.encode("utf-8"))) == text


# -- GGUF ---------------------------------------------------------------------------------------
def llama_cpp_gpt2_logits(reader, tokens):
    """llama.cpp's gpt2 graph (llm_build_gpt2) in NumPy float64, on the tensors of a GGUF file."""
    t = {x.name: np.asarray(x.data, dtype=np.float64) for x in reader.tensors}
    kv = lambda key: reader.fields[key].contents()        # noqa: E731
    C, H, L = kv("gpt2.embedding_length"), kv("gpt2.attention.head_count"), kv("gpt2.block_count")
    eps = kv("gpt2.attention.layer_norm_epsilon")

    def norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def linear(x, name):                                   # ggml_mul_mat: weight rows are outputs
        return x @ t[name + ".weight"].T + t[name + ".bias"]

    T, D = tokens.size, C // H
    x = t["token_embd.weight"][tokens] + t["position_embd.weight"][:T]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        b = f"blk.{i}."
        qkv = linear(norm(x, b + "attn_norm"), b + "attn_qkv")
        q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(T, H, D).transpose(1, 0, 2) for j in range(3))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(D) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + linear((p @ v).transpose(1, 0, 2).reshape(T, C), b + "attn_output")
        h = linear(norm(x, b + "ffn_norm"), b + "ffn_up")
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + linear(h, b + "ffn_down")
    x = norm(x, "output_norm")
    head = t.get("output.weight", t["token_embd.weight"])
    return x @ head.T


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_in_llama_cpp_gpt2_layout_gives_graphlms_logits(tmp_path, tie):
    gguf = pytest.importorskip("gguf")
    config, model, params = model_and_params(seed=2, tie_weights=tie)
    path = export_gguf(config, params, tmp_path / "m.gguf", name="tiny")
    reader = gguf.GGUFReader(path)
    kv = lambda key: reader.fields[key].contents()        # noqa: E731
    assert kv("general.architecture") == "gpt2" and kv("general.name") == "tiny"
    assert (kv("gpt2.context_length"), kv("gpt2.embedding_length"), kv("gpt2.block_count"),
            kv("gpt2.attention.head_count"), kv("gpt2.feed_forward_length")) == (8, 16, 2, 2, 64)
    names = {x.name for x in reader.tensors}
    assert "blk.1.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    assert ("output.weight" in names) == (not tie) and "output.bias" not in names
    qkv = next(x for x in reader.tensors if x.name == "blk.0.attn_qkv.weight")
    assert tuple(qkv.data.shape) == (48, 16) and qkv.data.dtype == np.float32
    tokens = kv("tokenizer.ggml.tokens")
    assert kv("tokenizer.ggml.model") == "gpt2" and len(tokens) == 256
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "\u0120" and tokens[ord("\n")] == "\u010a"
    assert len(set(tokens)) == 256
    assert kv("tokenizer.ggml.merges") == ["\u00fe \u00ff"]                 # bytes 0xFE 0xFF
    got = llama_cpp_gpt2_logits(reader, TOKENS[0])
    np.testing.assert_allclose(got, reference_logits(model, params)[0], rtol=2e-4, atol=2e-4)


def test_gguf_of_gpt2_smalls_layout_pads_the_vocabulary_and_ties_the_head(tmp_path):
    """GPT-2 small's layout (tied head, no head bias: what benchmarks/gpt2_small.py --llama
    exports) at a tiny width and a padded vocabulary (512 here, 50257 there; gguf's reader takes a
    second over 50257 names): ids past the 256 bytes are unused placeholders, and the head is
    token_embd, so the logits over every id are graphlm's."""
    gguf = pytest.importorskip("gguf")
    config = GPTConfig.preset("gpt2-small", **{**SMALL, "vocab_size": 512, "channels": 8, "dropout": 0.0})
    model = GPT(config)
    rng = np.random.default_rng(4)
    params = {k: (v + rng.normal(0, 0.2, v.shape)).astype(np.float32) for k, v in model.init(4).items()}
    reader = gguf.GGUFReader(export_gguf(config, params, tmp_path / "g.gguf"))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == 512 and len(set(tokens)) == 512
    assert tokens[255] == "\u00ff" and tokens[256] == "<unused256>" and tokens[-1] == "<unused511>"
    assert set(types[:256]) == {int(gguf.TokenType.NORMAL)} and set(types[256:]) == {int(gguf.TokenType.UNUSED)}
    assert "output.weight" not in {x.name for x in reader.tensors}
    tokens_in = np.array([[511, 0, 300, 7, 256, 255]])
    got = llama_cpp_gpt2_logits(reader, tokens_in[0])
    np.testing.assert_allclose(got, model.logits(params, tokens_in, executor="reference")[0], rtol=2e-4, atol=2e-4)


def test_bytes_to_unicode_is_gpt2s_map():
    m = bytes_to_unicode()
    assert len(set(m.values())) == 256
    assert m[ord("!")] == "!" and m[0] == "\u0100" and m[ord(" ")] == "\u0120" and m[255] == "\u00ff"


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, target, named", [
    ({"lm_head_bias": True}, "gguf", ["LM-head bias"]),
    ({"lm_head_bias": True}, "hf", ["LM-head bias"]),
    ({"norm": "rmsnorm", "mlp": "swiglu"}, "hf", ["'rmsnorm'", "SwiGLU"]),
    ({"gelu_approximate": "none"}, "gguf", ["gelu_approximate 'none'"]),
])
def test_what_the_target_cannot_represent_is_refused_by_name(tmp_path, overrides, target, named):
    config, _, params = model_and_params(**overrides)
    assert unsupported(config, target)
    write = export_hf if target == "hf" else export_gguf
    dest = tmp_path / "out"
    with pytest.raises(ExportError) as e:
        write(config, params, dest)
    for word in named:
        assert word in str(e.value)
    assert CLEAN_PRESET in str(e.value)
    assert not dest.exists()                                  # nothing half-written
    assert unsupported(GPTConfig.preset(CLEAN_PRESET), target) == []


def test_an_existing_destination_is_kept_unless_forced(tmp_path):
    pytest.importorskip("gguf")
    config, _, params = model_and_params()
    dest = tmp_path / "m.gguf"
    dest.write_bytes(b"keep")
    with pytest.raises(ExportError, match="already exists; .* --force"):
        export_gguf(config, params, dest)
    assert dest.read_bytes() == b"keep"
    export_gguf(config, params, dest, overwrite=True)
    assert dest.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]     # no temporary file left


# -- the command --------------------------------------------------------------------------------
def test_export_command_from_a_training_checkpoint(tmp_path, capsys):
    pytest.importorskip("gguf")
    data = tmp_path / "small.txt"
    data.write_bytes(BUNDLED_CORPUS.read_bytes()[:5000])
    run = tmp_path / "run"
    assert cli_main(["train", "--preset", CLEAN_PRESET, "--config", json.dumps(
        {**SMALL, "steps": 2, "batch_size": 2, "eval_batches": 1, "warmup": 1}),
        "--data", str(data), "--no-plot", "--out", str(run)]) == 0
    ckpt = str(run / "checkpoint.safetensors")
    capsys.readouterr()
    assert cli_main(["export", ckpt, "--to", "hf", str(tmp_path / "out" / "hf")]) == 0   # makes out/
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["export", ckpt, "--to", "gguf", str(tmp_path / "m.gguf")]) == 0
    config, params = load_hf_gpt2(tmp_path / "out" / "hf")
    assert config.layer_count == 2 and not config.tie_weights
    # a TinyLM with the head bias is refused with exit 2 and the way out
    plain = tmp_path / "plain"
    assert cli_main(["train", "--config", json.dumps({**SMALL, "steps": 1, "batch_size": 2,
                                                      "eval_batches": 1, "warmup": 1}),
                     "--data", str(data), "--no-plot", "--out", str(plain)]) == 0
    capsys.readouterr()
    assert cli_main(["export", str(plain / "checkpoint.safetensors"), "--to", "gguf",
                     str(tmp_path / "p.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "LM-head bias" in err and f"--preset {CLEAN_PRESET}" in err
    assert not (tmp_path / "p.gguf").exists()


def test_llama_cpp_loads_the_gguf_and_agrees(tmp_path):
    """Where llama-cpp-python is installed (it builds llama.cpp itself): llama.cpp's own loader,
    tokenizer and gpt2 graph on the exported file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    config, model, params = model_and_params(seed=3)
    path = export_gguf(config, params, tmp_path / "m.gguf")
    f32 = 0                                  # GGML_TYPE_F32: keep the KV cache in float32 too
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=config.context_length, logits_all=True,
                          verbose=False, n_threads=1, type_k=f32, type_v=f32)
    text = b"Hello, w"
    assert llm.tokenize(text, add_bos=False, special=False) == list(text)   # byte ids
    llm.eval(list(TOKENS[0]))
    got = np.asarray(llm.scores[:TOKENS.shape[1]], np.float64)
    ref = reference_logits(model, params)[0].astype(np.float64)
    # ggml's CPU GELU reads a float16 table, so elementwise agreement is ~1e-3, not 1e-5
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3
    np.testing.assert_allclose(got, ref, atol=3e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
