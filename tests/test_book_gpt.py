"""The book's complete GPT (decoder-only chapter, section 26.5): built from its numbers, counted
by the closed formula, and behaving as the chapter says: untrained and tied, it predicts the
current token. The chapter's C program itself (tests/data/book_137_gpt.c, as printed) is the
outside reference where a C compiler works: graphlm's logits on the C program's own weights
match the C logits, and both print the chapter's 3 1 4 1 5."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphlm import executors  # noqa: F401  (registers the executors)
from graphlm.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
_spec = importlib.util.spec_from_file_location("book_gpt", ROOT / "examples" / "book_gpt.py")
book_gpt = importlib.util.module_from_spec(_spec)   # the example: the chapter's init scales and
_spec.loader.exec_module(book_gpt)                  # its parameter line

TOKENS = [3, 1, 4, 1, 5, 2]


def book_params_count(V, T, C, L, F) -> dict[str, int]:
    """The chapter's closed formula (137_Gpt.c): embeddings V*C + T*C; per block 4C^2
    (Q, K, V, O), 2*C*F (the MLP) and 2C (two norm gains); plus C for graphlm's final RMSNorm
    gain, which the chapter's parameterless rmsnorm does not have."""
    return {"embedding": V * C + T * C, "blocks": L * (4 * C * C + 2 * C * F + 2 * C),
            "final_norm": C}


def test_the_preset_is_the_chapters_model():
    c = GPTConfig.preset("book-gpt")
    assert (c.vocab_size, c.context_length, c.channels, c.head_count, c.layer_count) == (8, 6, 8, 2, 2)
    assert (c.norm, c.layer_norm_epsilon, c.mlp, c.gelu_approximate, c.mlp_width) == \
        ("rmsnorm", 1e-5, "gelu", "tanh", 16)
    assert c.tie_weights and not (c.attention_bias or c.mlp_bias or c.lm_head_bias) and c.dropout == 0
    shapes = {k: p.shape for k, p in GPT(c).parameters().items()}
    assert shapes == {
        "token_embedding.weight": (8, 8), "positional_embedding.table.weight": (6, 8),
        **{f"blocks.{i}.{n}": s for i in range(2) for n, s in (
            ("attention_norm.weight", (8,)), ("attention.qkv_weight", (3, 8, 8)),
            ("attention.output.weight", (8, 8)), ("mlp_norm.weight", (8,)),
            ("mlp_input.weight", (16, 8)), ("mlp_output.weight", (8, 16)))},
        "final_norm.weight": (8,)}


@pytest.mark.parametrize("numbers", [dict(V=8, T=6, C=8, H=2, L=2, F=16),      # the chapter's
                                     dict(V=11, T=5, C=12, H=3, L=3, F=20)])
def test_parameter_count_is_the_closed_formula(numbers):
    n = numbers
    cfg = GPTConfig.preset("book-gpt", vocab_size=n["V"], context_length=n["T"], channels=n["C"],
                           head_count=n["H"], layer_count=n["L"], mlp_hidden=n["F"])
    model = GPT(cfg)
    expect = book_params_count(n["V"], n["T"], n["C"], n["L"], n["F"])
    assert model.parameter_count() == sum(expect.values())
    line = book_gpt.parameter_line(model)
    assert line == (f"Parameters: {expect['embedding']} embedding + {expect['blocks']} blocks + "
                    f"{expect['final_norm']} final norm = {sum(expect.values())}")
    if n["V"] == 8:   # the chapter prints "112 embedding + 1056 blocks = 1168"
        assert (expect["embedding"], expect["blocks"]) == (112, 1056)
        assert sum(expect.values()) - expect["final_norm"] == 1168


def test_graphlm_params_counts_the_book_gpt_and_its_mlp_flops(capsys):
    from graphlm.tools import cli
    assert cli.main(["params", "--preset", "book-gpt", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["mlp_hidden"] == 16
    assert report["total_parameters"] == 1176
    # per layer and token: the GELU MLP's two products are 2 * (C*F) multiply-adds each
    assert report["flops_per_token"]["per_layer"]["mlp"] == 4 * 8 * 16
    assert cli.main(["params", "--preset", "book-gpt"]) == 0
    assert capsys.readouterr().out.startswith("GPT: V=8 T=6 C=8 H=2 N=2 MLP=16, tied head")


def test_with_identity_blocks_the_residual_carries_the_embedding_to_the_tied_head():
    """Blocks whose sublayers output zero are the identity: the head sees rmsnorm(e_t + p_i)
    and scores it against every embedding (the tied matrix)."""
    model = book_gpt.book_model()
    p = model.init(0)
    for k in p:
        if k.startswith("blocks.") and not k.endswith("norm.weight"):
            p[k] = np.zeros_like(p[k])
    logits = model.logits(p, np.array([TOKENS]), executor="numpy")[0]
    E, P = p["token_embedding.weight"], p["positional_embedding.table.weight"]
    h = E[TOKENS] + P[:6]
    h = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(logits, h @ E.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_untrained_tied_model_with_near_zero_blocks_predicts_the_current_token(seed):
    """The chapter's mechanism: with near-zero blocks (and positions) the prediction at every
    position is the token whose embedding has the largest dot product with the current token's,
    which is the current token itself whenever no other embedding outscores it (true for 19 of
    these 20 draws; seed 10 draws two short embeddings that token 1 outscores)."""
    model = book_gpt.book_model()
    p = model.init(seed)
    for k in p:   # the chapter's scales are 0.1; near zero: 0.001
        if k.startswith("positional") or (k.startswith("blocks.") and not k.endswith("norm.weight")):
            p[k] = p[k] * np.float32(0.01)
    predicted = model.logits(p, np.array([TOKENS]), executor="numpy")[0].argmax(-1)
    E = p["token_embedding.weight"]
    closest = (E @ E.T).argmax(-1)            # for each token, its largest dot product
    np.testing.assert_array_equal(predicted, closest[TOKENS])
    assert (closest[TOKENS] == TOKENS).all() == (seed != 10)


def test_the_example_prints_the_chapters_table():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "book_gpt.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\s+(\d)\s+tokens\[0\.\.\d\]\s+(\d)\s+(\d)$", proc.stdout, re.M)
    assert [(int(i), int(p), int(a)) for i, p, a in rows] == \
        [(i, TOKENS[i], TOKENS[i + 1]) for i in range(5)]          # 3 1 4 1 5 against 1 4 1 5 2
    assert "Predicts the current token at every position: True" in proc.stdout
    assert "Parameters: 112 embedding + 1056 blocks + 8 final norm = 1176" in proc.stdout


# -- the chapter's own C program as the outside reference --------------------------------------------
def _compile(tmp_path: Path, source: str) -> Path:
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    why = "no C compiler (cc, gcc, clang) found"
    if cc is not None:
        exe = tmp_path / Path(source).stem
        proc = subprocess.run([cc, "-std=c99", "-O2", "-o", str(exe), str(DATA / source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return exe
        why = f"{cc} could not compile {source}: {proc.stderr.strip()[:200]}"
    if os.environ.get("GRAPHLM_REQUIRE_NATIVE"):
        pytest.fail(f"GRAPHLM_REQUIRE_NATIVE is set but {why}")
    pytest.skip(why)


def _c_weights_as_graphlm_params(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """137_Gpt.c's arrays in graphlm's layout: WQ[h][k][d] is query feature h*DH+k of input d, so
    graphlm's ``x @ qkv_weight[0]`` needs WQ as [out, in] transposed; W1, W2 and WO are already
    [out, in] like graphlm's Linear weights. The C rmsnorm has no gain: graphlm's gains are 1."""
    C = 8
    p = {"token_embedding.weight": arrays["embed"].reshape(8, C),
         "positional_embedding.table.weight": arrays["pos_embed"].reshape(6, C),
         "final_norm.weight": np.ones(C, np.float32)}
    for b in range(2):
        a = lambda n: arrays[f"block{b}.{n}"]  # noqa: E731
        g = f"blocks.{b}."
        p[g + "attention.qkv_weight"] = np.stack([a(n).reshape(C, C).T for n in ("WQ", "WK", "WV")])
        p[g + "attention.output.weight"] = a("WO").reshape(C, C)
        p[g + "mlp_input.weight"] = a("W1").reshape(16, C)
        p[g + "mlp_output.weight"] = a("W2").reshape(C, 16)
        p[g + "attention_norm.weight"] = p[g + "mlp_norm.weight"] = np.ones(C, np.float32)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in p.items()}


@pytest.mark.parametrize("executor", ["reference", "numpy"])
def test_logits_match_the_chapters_c_program_on_its_own_weights(tmp_path, executor):
    book = subprocess.run([str(_compile(tmp_path, "book_137_gpt.c"))], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    dump = subprocess.run([str(_compile(tmp_path, "book_137_dump.c"))], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    arrays = {line.split()[0]: np.array(line.split()[1:], dtype=np.float32)
              for line in dump.splitlines() if line.strip()}
    c_logits = np.stack([arrays[f"logits{i}"] for i in range(6)])

    # the printed program's table is the chapter's, and the dump's weights give the same one
    printed = [int(m) for m in re.findall(r"tokens\[0\.\.\d\]\s+(\d)", book)]
    assert printed == [3, 1, 4, 1, 5] == list(c_logits.argmax(-1)[:5])
    assert "Parameters: 112 embedding + 1056 blocks = 1168" in book

    model = GPT(GPTConfig.preset("book-gpt"))
    params = _c_weights_as_graphlm_params(arrays)
    assert sorted(params) == sorted(model.parameters())
    logits = model.logits(params, np.array([TOKENS]), executor=executor)[0]
    np.testing.assert_allclose(logits, c_logits, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(logits.argmax(-1), TOKENS)
