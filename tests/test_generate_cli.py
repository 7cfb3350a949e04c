"""`graphlm generate` end to end: checkpoints with a byte tokenizer (also under a larger
vocabulary), batches of samples, stop strings, prompts from files and stdin, --json and the speed
line, and an imported GPT-2 sampled with its own tokenizer (a byte-level BPE the test trains, in
GPT-2's vocab.json + merges.txt layout or as tokenizer.json) against Hugging Face's own generate."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from graphlm import executors  # noqa: F401  (registers the executors)
from graphlm.io import load_hf_gpt2
from graphlm.io.hf_gpt2 import hf_gpt2_mapping
from graphlm.io.checkpoint import save_checkpoint
from graphlm.models import GPT, GPTConfig
from graphlm.sample import generate_full_recompute
from graphlm.tools import cli

# vocab 300 > 256 bytes: a byte-trained model with room for ids the bytes cannot spell
BYTE_CFG = GPTConfig(vocab_size=300, context_length=16, channels=16, head_count=2, layer_count=1)
TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? ") * 4


def run(capsys, *argv):
    code = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = GPT(BYTE_CFG)
    params = model.init(1)
    params["final_norm.weight"] *= 4
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.safetensors"
    save_checkpoint(path, params, step=1, config=BYTE_CFG.to_dict())
    return str(path)


def sample_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json", "--executor", "numpy")
    assert code == 0, err
    return json.loads(out), err


def test_a_byte_model_with_a_larger_vocab_samples_only_bytes(checkpoint, capsys):
    doc, err = sample_json(capsys, "--checkpoint", checkpoint, "--prompt", "ROMEO:",
                           "--max-new-tokens", "80", "--temperature", "3")
    (s,) = doc["samples"]
    assert len(s["tokens"]) == 80 and max(s["tokens"]) < 256 and s["finish_reason"] == "length"
    assert s["text"] == bytes(s["tokens"]).decode("utf-8", errors="replace")
    assert doc["tokenizer"] == "bytes" and doc["prompt_tokens"] == 6
    assert "tokens/s" in err and "generated 80 token(s)" in err
    # streamed, the text is the prompt, the same sample and a newline
    code, out, _ = run(capsys, "--checkpoint", checkpoint, "--prompt", "ROMEO:", "--max-new-tokens",
                       "80", "--temperature", "3", "--executor", "numpy")
    assert code == 0 and out == "ROMEO:" + s["text"] + "\n"


def test_num_samples_are_one_batch_and_sample_i_is_seed_plus_i(checkpoint, capsys):
    common = ("--checkpoint", checkpoint, "--prompt", "A", "--max-new-tokens", "20",
              "--temperature", "1.2", "--top-k", "50", "--repetition-penalty", "1.3")
    doc, err = sample_json(capsys, *common, "--num-samples", "3", "--seed", "5")
    t = doc["timing"]
    assert "(batch 3;" in err and t["decode_steps"] + t["prefills"] == 20 and t["new_tokens"] == 60
    texts = [s["text"] for s in doc["samples"]]
    assert len(set(texts)) == 3 and [s["seed"] for s in doc["samples"]] == [5, 6, 7]
    for i, text in enumerate(texts):
        alone, _ = sample_json(capsys, *common, "--seed", str(5 + i))
        assert alone["samples"][0]["text"] == text
    code, out, _ = run(capsys, *common, "--num-samples", "2", "--executor", "numpy")
    assert code == 0 and out.count("--- sample ") == 2 and "--- sample 2 of 2 (seed 1) ---" in out


def test_stop_strings_are_repeatable_and_cut_the_text(checkpoint, capsys):
    base = ("--checkpoint", checkpoint, "--prompt", "A", "--max-new-tokens", "60", "--temperature", "0")
    doc, _ = sample_json(capsys, *base)
    text = doc["samples"][0]["text"]
    first, later = text[8:10], text[20:23]
    assert first not in text[:8]
    doc, _ = sample_json(capsys, *base, "--stop", later, "--stop", first)
    s = doc["samples"][0]
    assert s["text"] == text[:10] and s["finish_reason"] == "stop" and s["stop"] == first
    assert doc["options"]["stop"] == [later, first]
    code, out, _ = run(capsys, *base, "--stop", first, "--executor", "numpy")
    assert code == 0 and out == "A" + text[:10] + "\n"


def test_prompt_from_a_file_and_from_stdin(checkpoint, capsys, monkeypatch, tmp_path):
    base = ("--checkpoint", checkpoint, "--max-new-tokens", "12", "--temperature", "0")
    want, _ = sample_json(capsys, *base, "--prompt", "ROMEO:\nO, she")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ROMEO:\nO, she", encoding="utf-8")
    from_file, _ = sample_json(capsys, *base, "--prompt-file", str(prompt))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ROMEO:\nO, she")))
    from_stdin, _ = sample_json(capsys, *base, "--prompt-file", "-")
    assert from_file["samples"] == from_stdin["samples"] == want["samples"]
    assert from_stdin["prompt"] == "ROMEO:\nO, she"


@pytest.mark.parametrize("argv,message", [
    (["--prompt-file", "{missing}"], "--prompt-file {missing}: cannot read"),
    (["--prompt-file", "{latin1}"], "--prompt-file {latin1}: not UTF-8 text (byte 1)"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    (["--stop", ""], "--stop must not be empty"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "A\udce9"], "--prompt is not valid UTF-8 text (character 1)"),   # argv byte 0xe9
])
def test_bad_options_are_one_line_errors(checkpoint, capsys, tmp_path, argv, message):
    (tmp_path / "latin1.txt").write_bytes(b"A\xe9t\xe9")
    paths = {"missing": str(tmp_path / "nope.txt"), "latin1": str(tmp_path / "latin1.txt")}
    argv = [a.format(**paths) for a in argv]
    code, out, err = run(capsys, "--checkpoint", checkpoint, *argv)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message.format(**paths) in err, err


def test_exclusive_sources_and_prompts(checkpoint, capsys, tmp_path):
    for argv in (["--prompt", "a", "--prompt-file", "-"], ["--checkpoint", checkpoint, "--hf-dir", "x"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", *argv])
        assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# -- an imported GPT-2 with its own tokenizer --------------------------------------------------------

def train_tokenizer(vocab_size=300):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


def write_gpt2_dir(path, vocab_size, layout, tok, seed=0):
    """A random GPT-2 in Hugging Face's layout, with the tokenizer in `layout`."""
    path.mkdir()
    cfg = GPTConfig(vocab_size=vocab_size, context_length=32, channels=16, head_count=2, layer_count=2,
                    tie_weights=True, lm_head_bias=False)
    r = np.random.default_rng(seed)
    tensors = {"transformer." + key: (0.3 * r.standard_normal(shape)).astype(np.float32)
               for key, _, shape in hf_gpt2_mapping(cfg).values()}
    tensors["transformer.ln_f.weight"] += 6      # sharp logits: greedy far from ties
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab_size,
              "n_positions": 32, "n_ctx": 32, "n_embd": 16, "n_head": 2, "n_layer": 2,
              "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    if layout == "gpt2-files":
        tok.model.save(str(path))              # vocab.json + merges.txt
        assert sorted(p.name for p in path.iterdir()) == ["config.json", "merges.txt", "model.safetensors",
                                                            "vocab.json"]
    else:
        tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("layout", ["gpt2-files", "tokenizer.json"])
def test_hf_dir_samples_with_its_own_tokenizer(tmp_path, capsys, layout):
    tok = train_tokenizer()
    v = tok.get_vocab_size()
    directory = write_gpt2_dir(tmp_path / "gpt2", v, layout, tok)
    prompt = "First Citizen: speak"
    ids = tok.encode(prompt).ids
    assert len(ids) < len(prompt.encode())          # merges were learned: not bytes
    doc, err = sample_json(capsys, "--hf-dir", str(directory), "--prompt", prompt,
                           "--max-new-tokens", "10", "--temperature", "0")
    (s,) = doc["samples"]
    config, params = load_hf_gpt2(directory)
    want = generate_full_recompute(GPT(config), params, ids, 10, executor="reference")
    assert s["tokens"] == want and s["text"] == tok.decode(want)
    assert doc["prompt_tokens"] == len(ids) and doc["tokenizer"].startswith(str(directory))


def test_hf_dir_greedy_with_repetition_penalty_is_hugging_faces(tmp_path, capsys):
    """transformers' GPT2LMHeadModel.generate on the same directory gives the same ids, with and
    without the repetition penalty, and stops at the config's end-of-text token as we do."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer()
    directory = write_gpt2_dir(tmp_path / "gpt2", tok.get_vocab_size(), "gpt2-files", tok, seed=3)
    prompt = "You are all resolved"
    ids = tok.encode(prompt).ids

    def both(penalty):
        doc, _ = sample_json(capsys, "--hf-dir", str(directory), "--prompt", prompt,
                             "--max-new-tokens", "8", "--temperature", "0", "--repetition-penalty", penalty)
        hf = transformers.GPT2LMHeadModel.from_pretrained(str(directory)).eval()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              repetition_penalty=float(penalty), pad_token_id=0)
        return doc["samples"][0], out[0, len(ids):].tolist()

    plain, theirs = both("1.0")
    assert plain["tokens"] == theirs and plain["finish_reason"] == "length"
    penalised, theirs = both("1.5")
    assert penalised["tokens"] == theirs and len(set(theirs)) > len(set(plain["tokens"]))
    # the end-of-text token of config.json ends the sample (the 4th token here), for both
    config = json.loads((directory / "config.json").read_text())
    eos = penalised["tokens"][3]
    assert eos not in penalised["tokens"][:3]
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    stopped, theirs = both("1.5")
    assert stopped["tokens"] == theirs == penalised["tokens"][:4] and stopped["finish_reason"] == "stop_token"


def test_hf_dir_errors_name_the_file(tmp_path, capsys):
    tok = train_tokenizer()
    directory = write_gpt2_dir(tmp_path / "gpt2", tok.get_vocab_size(), "gpt2-files", tok)
    (directory / "merges.txt").unlink()
    code, _, err = run(capsys, "--hf-dir", str(directory))
    assert code != 0 and "no tokenizer found" in err and str(directory) in err
    (directory / "tokenizer.json").write_text("{not json")
    code, _, err = run(capsys, "--hf-dir", str(directory))
    assert code != 0 and "tokenizer.json: not a readable tokenizer" in err



def test_a_tiny_temperature_is_greedy_and_a_huge_one_still_text(checkpoint, capsys):
    base = ("--checkpoint", checkpoint, "--prompt", "A", "--max-new-tokens", "40")
    greedy, _ = sample_json(capsys, *base, "--temperature", "0")
    tiny, err = sample_json(capsys, *base, "--temperature", "1e-40")      # no RuntimeWarning either
    assert tiny["samples"][0]["tokens"] == greedy["samples"][0]["tokens"] and "Warning" not in err
    huge, _ = sample_json(capsys, *base, "--temperature", "1e39")         # inf in float32: uniform
    tokens = huge["samples"][0]["tokens"]
    assert max(tokens) < 256 and len(set(tokens)) > 20


def test_a_run_folder_means_its_best_checkpoint_then_its_last(checkpoint, tmp_path, capsys):
    """--checkpoint FOLDER reads the folder's best.safetensors where there is one, else its
    checkpoint.safetensors; a folder with neither is a one-line error naming it."""
    import shutil
    from graphlm.tools.cli import resolve_checkpoint
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code, _, err = run(capsys, "--checkpoint", str(run_dir), "--max-new-tokens", "2")
    assert code == 2 and f"--checkpoint: the folder '{run_dir}' holds neither best.safetensors" in err
    assert "Traceback" not in err
    shutil.copy(checkpoint, run_dir / "checkpoint.safetensors")
    assert resolve_checkpoint(str(run_dir), "--checkpoint") == run_dir / "checkpoint.safetensors"
    best = GPT(BYTE_CFG).init(2)   # other weights: a different greedy continuation
    save_checkpoint(run_dir / "best.safetensors", best, step=1, config=BYTE_CFG.to_dict())
    assert resolve_checkpoint(str(run_dir), "--checkpoint") == run_dir / "best.safetensors"
    greedy = ("--prompt", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0")
    by_folder, _ = sample_json(capsys, "--checkpoint", str(run_dir), *greedy)
    by_file, _ = sample_json(capsys, "--checkpoint", str(run_dir / "best.safetensors"), *greedy)
    last, _ = sample_json(capsys, "--checkpoint", str(run_dir / "checkpoint.safetensors"), *greedy)
    assert by_folder["source"] == str(run_dir / "best.safetensors")
    assert by_folder["samples"] == by_file["samples"]
    assert by_folder["samples"][0]["tokens"] != last["samples"][0]["tokens"]
