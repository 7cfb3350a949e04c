"""Attention probabilities as graph outputs (nn.capture_attention, GPT.attention) against PyTorch,
and `graphlm attention`: the printed top positions, the picture, the errors."""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors, nn  # noqa: F401  (executors: registers them)
import graphlm as gl
from graphlm.io.checkpoint import save_checkpoint
from graphlm.models import GPT, GPTConfig
from graphlm.tools import cli
from graphlm.tools.attention import CAUSAL_GREY, format_top, token_labels, top_attended
from tests.test_gpt_torch import torch_gpt_logits

SMALL = dict(vocab_size=256, context_length=8, channels=16, head_count=4, layer_count=2)


def torch_attention_probabilities(torch, cfg: GPTConfig, params: dict, tokens) -> list:
    """Each layer's softmax(q k^T / sqrt(D)) with the causal mask, recorded from the PyTorch GPT
    of test_gpt_torch.py (written from torch.nn.functional, independently of graphlm)."""
    probs = []

    def attend(q, k, v):
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        p = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        probs.append(p.numpy())
        return p @ v

    P = {k: torch.tensor(v) for k, v in params.items()}
    torch_gpt_logits(torch, cfg, P, torch.tensor(tokens), attend)
    return probs


@pytest.mark.parametrize("variant", [dict(), dict(norm="rmsnorm", mlp_hidden=24, attention_bias=False,
                                                  mlp_bias=False, tie_weights=True, lm_head_bias=False)])
@pytest.mark.parametrize("executor", ["reference", "numpy"])
def test_gpt_attention_probabilities_match_torch_and_the_logits_the_fused_model(torch, variant, executor):
    cfg = GPTConfig(**SMALL, **variant)
    model = GPT(cfg)
    params = model.init(3)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 7))
    logits, probs = model.attention(params, tokens, executor=executor)
    assert list(probs) == ["blocks.0.attention", "blocks.1.attention"]
    expect = torch_attention_probabilities(torch, cfg, params, tokens)
    for got, want in zip(probs.values(), expect):
        assert got.shape == (2, 4, 7, 7) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert (got[..., np.triu(np.ones((7, 7), bool), 1)] == 0).all()
    # the unfused program computes the same function as the fused one
    np.testing.assert_allclose(logits, model.logits(params, tokens, executor=executor), rtol=1e-5, atol=1e-5)


def test_native_executor_computes_the_same_probabilities(native):
    model = GPT(GPTConfig(**SMALL))
    params = model.init(4)
    tokens = np.random.default_rng(1).integers(0, 256, (1, 8))
    _, want = model.attention(params, tokens, executor="reference")
    _, got = model.attention(params, tokens, executor="native")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_capture_attention_unfuses_only_inside_the_block():
    model = GPT(GPTConfig(**SMALL)).eval()

    def ops_of(capture: bool):
        g = gl.Graph()
        tokens = g.input("tokens", (1, 5), "int64")
        if capture:
            with nn.capture_attention(model) as probs:
                model(tokens)
            assert [len(v) for v in probs.values()] == [1, 1]
            assert all(p[0].op == "softmax" and p[0].shape == (1, 4, 5, 5) for p in probs.values())
        else:
            model(tokens)
        return {n.op for n in g.nodes}

    assert "causal_attention" in ops_of(False)
    assert "causal_attention" not in ops_of(True) and "causal_mask" in ops_of(True)
    assert "causal_attention" in ops_of(False)            # the modules are left as they were


def test_token_labels_and_top_attended():
    assert token_labels([82, 32, 10, 7, 200]) == ["R", "␣", "\\n", "\\x07", "\\xc8"]
    p = np.zeros((2, 3, 3), np.float32)
    p[0, 2] = [0.2, 0.7, 0.1]
    p[1, 2] = [0.5, 0.0, 0.5]
    rows = top_attended({"blocks.0.attention": p}, k=2)
    assert rows == [{"layer": "blocks.0.attention", "head": 0, "top": [(1, pytest.approx(0.7)), (0, pytest.approx(0.2))]},
                    {"layer": "blocks.0.attention", "head": 1, "top": [(0, 0.5), (2, 0.5)]}]
    text = format_top(rows, ["a", "b", "c"])
    assert text.splitlines() == ["position 2 ('c') attends most to:",
                                 "  blocks.0.attention head 0: 'b'@1 0.70  'a'@0 0.20",
                                 "  blocks.0.attention head 1: 'a'@0 0.50  'c'@2 0.50"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = GPTConfig(**SMALL)
    params = GPT(cfg).init(5)
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.safetensors"
    save_checkpoint(path, params, step=0, config=cfg.to_dict())
    return path, cfg, params


def test_attention_command_prints_the_top_positions_and_draws_the_grid(capsys, tmp_path, checkpoint):
    pytest.importorskip("matplotlib")
    path, cfg, params = checkpoint
    out = tmp_path / "attn.png"
    code = cli.main(["attention", "--checkpoint", str(path), "--prompt", "ab ab", "--out", str(out),
                     "--top", "2"])
    text = capsys.readouterr().out
    assert code == 0
    _, probs = GPT(cfg).attention(params, np.array([[97, 98, 32, 97, 98]]))
    lines = text.splitlines()
    assert lines[0] == "position 4 ('b') attends most to:"
    labels = ["a", "b", "␣", "a", "b"]
    for i, (name, p) in enumerate((n, p) for n, ps in probs.items() for p in [ps[0]]):
        for h in range(cfg.head_count):
            top = np.argsort(-p[h, -1], kind="stable")[:2]
            cells = "  ".join(f"{labels[j]!r}@{j} {p[h, -1, j]:.2f}" for j in top)
            assert f"  {name} head {h}: {cells}" in lines
    assert f"wrote {out}" in lines[-1] and "2 layers x 4 heads over 5 tokens" in lines[-1]
    from matplotlib import image
    picture = image.imread(out)
    assert picture.ndim == 3 and picture.shape[0] > 200 and picture.shape[1] > picture.shape[0]
    # the causal triangle is drawn in its grey: present in the picture
    rgb = np.array([int(CAUSAL_GREY[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    grey = np.isclose(picture[..., :3], rgb, atol=1 / 255).all(-1)
    assert grey.sum() > 1000


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "123456789"], "--prompt is 9 bytes, more than the model's context length 8"),
    (["--out", "attn.bmp"], "--out attn.bmp: use a .png, .svg or .pdf file"),
    (["--top", "0"], "--top must be at least 1"),
    (["--out", "/no/such/dir/attn.png"], "directory '/no/such/dir' does not exist"),
])
def test_attention_command_errors_are_one_line(capsys, checkpoint, argv, message):
    path, _, _ = checkpoint
    code = cli.main(["attention", "--checkpoint", str(path), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("graphlm attention: error: ") and message in err, err


def test_attention_command_names_a_missing_checkpoint(capsys, tmp_path):
    code = cli.main(["attention", "--checkpoint", str(tmp_path / "none.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and f"--checkpoint: no such file or run folder '{tmp_path / 'none.safetensors'}'" in err
