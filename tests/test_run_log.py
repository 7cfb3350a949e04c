"""`graphlm train`'s run log (every step and eval in log.jsonl), its feedback lines (memory, FLOP
rate, warnings), `graphlm plot` and the loss.png that train refreshes."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from graphlm.data import BUNDLED_CORPUS
from graphlm.models import GPTConfig
from graphlm.tools.cli import main as cli_main
from graphlm.tools.params import flops_per_token
from graphlm.tools.run_log import RunLogError, read_log

pytest.importorskip("matplotlib")

TINY = ["--context-length", "16", "--channels", "16", "--heads", "2", "--layers", "1",
        "--batch-size", "4", "--warmup", "2", "--eval-batches", "2", "--lr", "0.01"]
PNG, PDF = b"\x89PNG", b"%PDF"


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_bytes(BUNDLED_CORPUS.read_bytes()[:6000])
    return str(path)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_text):
    out = tmp_path_factory.mktemp("run") / "r"
    assert cli_main(["train", *TINY, "--data", small_text, "--steps", "6", "--eval-every", "3",
                     "--peak-gflops", "50", "--out", str(out)]) == 0
    return out


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_step_and_eval_is_logged_with_its_throughput(run_dir):
    log = rows(run_dir / "log.jsonl")
    assert [r["kind"] for r in log] == ["start"] + ["train"] * 3 + ["eval"] + ["train"] * 3 + ["eval"]
    start, train = log[0], [r for r in log if r["kind"] == "train"]
    cfg = GPTConfig.preset("tinylm", context_length=16, channels=16, head_count=2, layer_count=1)
    assert start["flops_per_token"] == flops_per_token(cfg)["train_step"]
    assert start["tokens_per_step"] == 4 * 16 and start["peak_gflops"] == 50
    assert start["peak_source"] == "--peak-gflops"
    mem = start["memory"]
    assert mem["total"] == mem["parameters"] + mem["moments"] + mem["train_arena"] + mem["eval_arena"]
    assert mem["moments"] == 2 * mem["parameters"]          # AdamW: m and v per parameter
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert r["tokens"] == r["step"] * 64
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("loss", "lr", "grad_norm", "seconds"))
        assert r["tokens_per_s"] == pytest.approx(64 / r["seconds"], rel=1e-3)
        assert r["gflops"] == pytest.approx(start["flops_per_token"] * 64 / r["seconds"] / 1e9, rel=1e-3)
        assert r["mfu"] == pytest.approx(r["gflops"] / 50, rel=1e-3)
    assert train[0]["lr"] == pytest.approx(0.005) and train[1]["lr"] == pytest.approx(0.01)
    evals = [r for r in log if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6]
    assert evals[0]["train_loss"] == pytest.approx(np.mean([r["loss"] for r in train[:3]]), abs=1e-5)
    # only the run's final evaluation covers the whole validation split
    assert "val_loss_full" not in evals[0] and math.isfinite(evals[1]["val_loss_full"])
    assert evals[1]["val_loss_full"] != evals[1]["val_loss"]


def test_train_prints_memory_flop_rate_and_refreshes_loss_png(tmp_path, small_text, capsys):
    out = tmp_path / "r"
    assert cli_main(["train", *TINY, "--data", small_text, "--steps", "2", "--eval-every", "1",
                     "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "memory: " in err and "AdamW moments" in err and "training-step arena" in err
    assert "MFU is measured against" in err and "measured float32 matmul, 1 thread x" in err
    assert "GFLOP/s  MFU " in err
    assert (out / "loss.png").read_bytes()[:4] == PNG
    assert cli_main(["train", *TINY, "--data", small_text, "--steps", "2", "--no-plot",
                     "--out", str(tmp_path / "q")]) == 0
    assert not (tmp_path / "q" / "loss.png").exists()


def test_warnings_for_warmup_and_a_moved_or_overrun_horizon(tmp_path, small_text, capsys):
    out = tmp_path / "r"
    args = [*TINY[:-4], "--lr", "0.002", "--data", small_text, "--eval-batches", "1", "--out", str(out)]
    assert cli_main(["train", *args[:-1], str(tmp_path / "w"), "--steps", "2", "--warmup", "5"]) == 0
    assert "warning: warmup (5 steps) >= steps (2)" in capsys.readouterr().err
    assert cli_main(["train", *args, "--steps", "3", "--warmup", "1"]) == 0
    assert "warning: warmup" not in capsys.readouterr().err
    assert cli_main(["train", "--resume", "--steps", "5", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "keeps its cosine horizon of 3 steps from the checkpoint (--steps is now 5): the last 2 " \
           "steps train at the final lr 2.000e-04; pass --decay-steps 5" in err
    assert cli_main(["train", "--resume", "--steps", "6", "--decay-steps", "6", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "cosine horizon changes from 3 to 6 steps: at step 5 the lr moves from 2.000e-04 to 3.719e-04" in err
    # a resumed run whose horizon is unchanged says nothing about it
    assert cli_main(["train", "--resume", "--steps", "6", "--out", str(out)]) == 0
    assert "horizon" not in capsys.readouterr().err


def test_the_reader_drops_rows_a_resume_replays(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [{"kind": "start", "step": 0}] + [{"kind": "train", "step": s, "loss": 10 - s, "lr": 1}
                                              for s in (1, 2, 3)]
    lines += [{"kind": "start", "step": 1}, {"kind": "train", "step": 2, "loss": 0.5, "lr": 1}]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "tra')   # cut short
    record = read_log(tmp_path)
    assert [(r["step"], r["loss"]) for r in record.train] == [(1, 9), (2, 0.5)]
    log.write_text('{"step": 4, "val_loss": 2.0}\n')           # an older log: eval rows only
    assert [r["val_loss"] for r in read_log(log).evals] == [2.0]
    log.write_text("not json\n")
    with pytest.raises(RunLogError, match=r"log.jsonl:1: not JSON"):
        read_log(log)


def test_plot_writes_png_svg_and_pdf(run_dir, tmp_path, capsys):
    assert cli_main(["plot", str(run_dir)]) == 0
    assert f"wrote {run_dir / 'loss.png'}" in capsys.readouterr().out
    assert (run_dir / "loss.png").read_bytes()[:4] == PNG
    svg = tmp_path / "loss.svg"
    assert cli_main(["plot", str(run_dir / "log.jsonl"), "--out", str(svg)]) == 0
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "validation loss" in text and "learning rate" in text
    assert "tokens seen" in text
    final = rows(run_dir / "log.jsonl")[-1]
    assert f"whole validation split ({final['val_loss_full']:.3f} at step 6)" in text
    assert cli_main(["plot", str(run_dir), "--out", str(tmp_path / "loss.pdf")]) == 0
    assert (tmp_path / "loss.pdf").read_bytes()[:4] == PDF


@pytest.mark.parametrize("argv, message", [
    (["plot", "/no/such/run"], "no run log at /no/such/run"),
    (["plot", "RUN", "--out", "loss.bmp"], "give a .png, .svg or .pdf file"),
])
def test_plot_errors_are_one_line_with_exit_2(run_dir, capsys, argv, message):
    argv = [str(run_dir) if a == "RUN" else a for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Error" not in err


def test_an_older_log_with_eval_rows_only_still_plots(tmp_path, capsys):
    run = tmp_path / "old"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps({"step": s, "val_loss": v, "train_loss": v + 0.1})
                                           + "\n" for s, v in ((200, 2.5), (400, 2.4))))
    assert cli_main(["plot", str(run)]) == 0
    assert "0 steps, 2 evaluations" in capsys.readouterr().out
    assert (run / "loss.png").read_bytes()[:4] == PNG
    (run / "log.jsonl").write_text("")
    assert cli_main(["plot", str(run)]) == 2
    assert "no training or evaluation rows" in capsys.readouterr().err
