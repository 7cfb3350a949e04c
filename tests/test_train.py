"""The training step, bit-exact resume, and `graphlm train` / `graphlm generate` end to end at a
tiny size (seconds)."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphlm import executors  # registers the executors
from graphlm.data import BUNDLED_CORPUS
from graphlm.io.checkpoint import read_checkpoint
from graphlm.train import Trainer, TrainOptions, dropout_key
from graphlm.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = {"context_length": 16, "channels": 16, "head_count": 2, "layer_count": 1, "dropout": 0.1}
TINY_FLAGS = ["--context-length", "16", "--channels", "16", "--heads", "2", "--layers", "1",
              "--batch-size", "4", "--warmup", "3", "--eval-batches", "2", "--lr", "0.01"]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_bytes(BUNDLED_CORPUS.read_bytes()[:8000])
    return str(path)


def tiny_options(small_text, **kw):
    base = dict(steps=6, batch_size=4, warmup=2, eval_batches=2, data=small_text, model=dict(TINY_MODEL))
    base.update(kw)
    return TrainOptions(**base)


@pytest.mark.parametrize("executor", ["numpy", "native"])
def test_training_steps_match_reference(small_text, executor, request):
    if executor == "native":
        request.getfixturevalue("native")
    runs = {}
    for ex in ("reference", executor):
        tr = Trainer(tiny_options(small_text, executor=ex))
        assert tr.options.executor == ex
        losses = [tr.train_step().loss for _ in range(4)]
        runs[ex] = (losses, tr.state, tr.evaluate())
    (lr_, sr, vr), (ln, sn, vn) = runs["reference"], runs[executor]
    np.testing.assert_allclose(ln, lr_, rtol=1e-5)
    assert vn == pytest.approx(vr, rel=1e-5)
    for k in sr:
        if "qkv_bias" in k:
            # the key bias has an exactly-zero true gradient (softmax ignores a per-row shift), so
            # AdamW turns float rounding noise into steps of size ~lr: compare rows q and v only
            sn_k, sr_k = sn[k][[0, 2]], sr[k][[0, 2]]
        else:
            sn_k, sr_k = sn[k], sr[k]
        np.testing.assert_allclose(sn_k, sr_k, rtol=1e-4, atol=1e-6, err_msg=k)
    assert ln[-1] < ln[0]


def test_programs_share_one_state_and_dropout_is_keyed_by_seed_and_step(small_text):
    tr = Trainer(tiny_options(small_text))
    assert tr.uses_dropout
    gen = tr.generator()
    assert all(gen.state[k] is tr.state[k] for k in tr.params())
    assert sorted(tr.state) == sorted(list(tr.params()) + tr.optimizer.state_names())
    assert dropout_key(0, 5) == dropout_key(0, 5)
    assert len({int(dropout_key(s, k)) for s in range(3) for k in range(50)}) == 150
    # the same (seed, step) gives the same loss from the same state; dropout makes it differ
    # from the eval-mode loss of the same batch
    a = Trainer(tiny_options(small_text)).train_step().loss
    b = Trainer(tiny_options(small_text)).train_step().loss
    nodrop = Trainer(tiny_options(small_text, model={**TINY_MODEL, "dropout": 0.0})).train_step().loss
    assert a == b and a != nodrop
    # training changes what the eval and sampling programs see (they read the same arrays)
    before = tr.evaluate()
    for _ in range(5):
        tr.train_step()
    assert tr.evaluate() != before


def test_the_checkpoint_records_the_executor_and_a_resume_on_another_is_flagged(tmp_path, small_text, capsys):
    from graphlm.backends import default_executor
    common = TINY_FLAGS + ["--data", small_text, "--eval-every", "5"]
    assert cli_main(["train", *common, "--steps", "5", "--out", str(tmp_path)]) == 0
    ran = read_checkpoint(tmp_path / "checkpoint.safetensors").options["executor"]
    assert ran == default_executor() != "auto"
    capsys.readouterr()
    other = "reference" if ran == "numpy" else "numpy"
    assert cli_main(["train", "--resume", "--steps", "7", "--executor", other, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "resuming with changed executor" in out.out + out.err
    assert read_checkpoint(tmp_path / "checkpoint.safetensors").options["executor"] == other


def test_resume_is_bit_exact(tmp_path, small_text):
    common = TINY_FLAGS + ["--data", small_text, "--eval-every", "5", "--seed", "3"]
    assert cli_main(["train", *common, "--steps", "20", "--out", str(tmp_path / "a")]) == 0
    assert cli_main(["train", *common, "--steps", "10", "--decay-steps", "20",
                     "--out", str(tmp_path / "b")]) == 0
    assert read_checkpoint(tmp_path / "b" / "checkpoint.safetensors").step == 10
    assert cli_main(["train", "--resume", "--steps", "20", "--out", str(tmp_path / "b")]) == 0
    a = read_checkpoint(tmp_path / "a" / "checkpoint.safetensors")
    b = read_checkpoint(tmp_path / "b" / "checkpoint.safetensors")
    assert a.step == b.step == 20
    assert sorted(a.tensors) == sorted(b.tensors)
    assert any(k.startswith("optimizer.m.") for k in a.tensors)
    for k in a.tensors:
        assert a.tensors[k].tobytes() == b.tensors[k].tobytes(), k
    assert [h["val_loss"] for h in a.extra["history"]] == [h["val_loss"] for h in b.extra["history"]]
    # and the run really trained: a different seed gives different weights
    c = tmp_path / "c"
    assert cli_main(["train", *common[:-1], "4", "--steps", "20", "--out", str(c)]) == 0
    w = "token_embedding.weight"
    assert read_checkpoint(c / "checkpoint.safetensors").tensors[w].tobytes() != a.tensors[w].tobytes()


def test_train_then_generate_end_to_end(tmp_path, small_text, capsys):
    out = tmp_path / "run"
    assert cli_main(["train", *TINY_FLAGS, "--data", small_text, "--steps", "8", "--eval-every", "4",
                     "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "step 4/8  val loss" in captured.err and "tokens/s" in captured.err
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith("done: val loss on the whole validation split ")
    assert str(out / "checkpoint.safetensors") in last
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("train") == 8 and kinds.count("eval") == 2   # every step, every eval
    evals = [r for r in rows if r["kind"] == "eval"]
    assert "val_loss_full" not in evals[0]
    ckpt = out / "checkpoint.safetensors"
    # the final evaluation covers the whole validation split, not only its first --eval-batches,
    # and its line says so (with the first batches' figure, which the history compares)
    final = [line for line in captured.err.splitlines() if "whole split" in line]
    assert len(final) == 1 and final[0].startswith("step 8/8  val loss on the whole split "), final
    m = re.search(r"whole split (\S+) \((\d+) batches; the 2 of each evaluation: (\S+)\)", final[0])
    whole, n_batches, first = float(m[1]), int(m[2]), float(m[3])
    trained = Trainer(tiny_options(small_text, steps=8, lr=0.01, warmup=3, eval_every=4,
                                   model={**TINY_MODEL, "dropout": 0.0}))
    trained.load(ckpt)
    assert n_batches == len(trained.validation_losses(None)) > trained.options.eval_batches
    assert whole == pytest.approx(trained.evaluate(None), abs=1e-4)
    assert first == pytest.approx(trained.evaluate(), abs=1e-4)
    assert trained.evaluate(None) != pytest.approx(trained.evaluate(), abs=1e-4)
    assert evals[1]["val_loss_full"] == pytest.approx(whole, abs=1e-4)
    assert evals[1]["val_loss"] == pytest.approx(first, abs=1e-4)
    assert trained.history[-1]["val_loss_full"] == pytest.approx(whole, abs=1e-4)
    assert f"{whole:.4f} at step 8" in last
    args = ["generate", "--checkpoint", str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "40",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "2"]
    assert cli_main(args) == 0
    first = capsys.readouterr().out
    assert cli_main(args) == 0
    assert capsys.readouterr().out == first           # same seed, same text
    assert first.startswith("ROMEO:")
    assert 1 <= len(first.encode()) - len("ROMEO:") - 1 <= 40 * 3
    assert cli_main(["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-new-tokens", "30",
                     "--temperature", "0"]) == 0     # 30 new tokens > context 16: the window slides
    assert capsys.readouterr().out.startswith("A")


def test_cli_errors_are_clean(tmp_path, small_text, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli_main(["train", *TINY_FLAGS, "--data", str(empty), "--out", str(tmp_path / "x")]) != 0
    assert "empty.txt is empty" in capsys.readouterr().err
    assert cli_main(["train", "--resume", "--out", str(tmp_path / "nothing")]) != 0
    assert "no checkpoint" in capsys.readouterr().err
    run = tmp_path / "r"
    assert cli_main(["train", *TINY_FLAGS, "--data", small_text, "--steps", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert cli_main(["train", *TINY_FLAGS, "--data", small_text, "--steps", "2", "--out", str(run)]) != 0
    assert "already exists; pass --resume" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((run / "checkpoint.safetensors").read_bytes()[:1000])
    assert cli_main(["generate", "--checkpoint", str(bad)]) != 0
    assert "bad.safetensors" in capsys.readouterr().err


def test_ctrl_c_saves_and_exits_cleanly(tmp_path, small_text):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "graphlm", "train", *TINY_FLAGS, "--data", small_text,
           "--steps", "100000", "--eval-every", "100000", "--log-every", "1", "--out", str(out)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:              # wait until training is under way
            if line.startswith("step 3/"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "interrupted at step" in err
    ck = read_checkpoint(out / "checkpoint.safetensors")
    assert 3 <= ck.step < 100000
    assert cli_main(["train", "--resume", "--steps", str(ck.step + 2), "--out", str(out)]) == 0
    assert read_checkpoint(out / "checkpoint.safetensors").step == ck.step + 2


def test_train_mlp_hidden_flag_builds_and_records_that_width(tmp_path, small_text):
    assert cli_main(["train", *TINY_FLAGS, "--data", small_text, "--steps", "2", "--eval-every", "2",
                     "--mlp-hidden", "24", "--out", str(tmp_path)]) == 0
    ck = read_checkpoint(tmp_path / "checkpoint.safetensors")
    assert ck.config["mlp_hidden"] == 24 and ck.tensors["blocks.0.mlp_input.weight"].shape == (24, 16)


def test_a_checkpoint_written_before_mlp_hidden_existed_still_resumes(tmp_path, small_text):
    """Old checkpoints have no `mlp_hidden` in their config: they are the default width."""
    from graphlm.io.checkpoint import save_checkpoint
    tr = Trainer(tiny_options(small_text))
    tr.train_step()
    new = tr.save(tmp_path / "new.safetensors")
    ck = read_checkpoint(new)
    assert ck.config["mlp_hidden"] == 4 * TINY_MODEL["channels"]   # recorded: the actual width
    old_config = {k: v for k, v in ck.config.items() if k != "mlp_hidden"}
    old = save_checkpoint(tmp_path / "old.safetensors", ck.tensors, step=ck.step, config=old_config,
                          options=ck.options, rng=ck.rng, sampler=ck.sampler, extra=ck.extra)
    from graphlm.models import GPT
    model, _ = GPT.from_checkpoint(old)                                # as `graphlm generate` reads it
    assert model.config == tr.config and model.blocks[0].mlp_hidden == 4 * TINY_MODEL["channels"]
    fresh = Trainer(tiny_options(small_text))
    fresh.load(old)
    assert fresh.step == 1
    for k in ck.tensors:
        assert fresh.state[k].tobytes() == ck.tensors[k].tobytes(), k
    # another width is a different model: named in the one-line error, nothing loaded
    wide = Trainer(tiny_options(small_text, model={**TINY_MODEL, "mlp_hidden": 24}))
    before = {k: v.copy() for k, v in wide.state.items()}
    with pytest.raises(ValueError, match=r"model config does not match \(mlp_hidden: file 64 vs model 24\)"):
        wide.load(old)
    assert all(np.array_equal(wide.state[k], before[k]) for k in before)
