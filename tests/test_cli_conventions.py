"""Command-line conventions of `graphlm`: help for every subcommand and flag, exit statuses (2 bad
input, 1 failure, 130 Ctrl-C, quiet on a broken pipe), --config for every command and train."""
import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from graphlm.data import BUNDLED_CORPUS
from graphlm.io.checkpoint import read_checkpoint
from graphlm.train import TrainOptions
from graphlm.tools import cli

ROOT = Path(__file__).resolve().parents[1]


def subcommands():
    return cli.build_parser().commands


@pytest.mark.parametrize("name", sorted(cli.build_parser().commands))
def test_every_subcommand_and_flag_has_a_description_and_help(name):
    p = subcommands()[name]
    assert p.description and len(p.description) > 20, name
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings}"
    top = {a.dest: a.help for a in cli.build_parser()._subparsers._group_actions[0]._choices_actions}
    assert top[name], name


@pytest.mark.parametrize("argv", [["params"], ["stats", "--graph", "train"], ["plan"],
                                  ["render", "--out", "OUT"]])
def test_config_json_alone_starts_from_the_default_preset(argv, capsys, tmp_path):
    argv = [str(tmp_path / "g.dot") if a == "OUT" else a for a in argv]
    assert cli.main([*argv, "--config", '{"layer_count": 2, "context_length": 8}']) == 0
    out = capsys.readouterr().out
    if argv[0] in ("params", "plan"):
        assert "N=2" in out and "T=8" in out


def test_train_config_takes_model_and_training_options_and_flags_win(tmp_path, capsys):
    data = tmp_path / "small.txt"
    data.write_bytes(BUNDLED_CORPUS.read_bytes()[:5000])
    conf = tmp_path / "run.json"
    conf.write_text(json.dumps({"layer_count": 1, "channels": 16, "head_count": 2,
                                "context_length": 8, "steps": 3, "batch_size": 2, "lr": 0.005,
                                "warmup": 1, "eval_batches": 1, "model": {"dropout": 0.2}}))
    out = tmp_path / "r"
    assert cli.main(["train", "--config", str(conf), "--steps", "2", "--data", str(data),
                     "--no-plot", "--out", str(out)]) == 0
    ckpt = read_checkpoint(out / "checkpoint.safetensors")
    assert ckpt.step == 2                                         # the flag beat the file
    assert ckpt.options["preset"] == TrainOptions().preset        # a config naming none: train's
    assert ckpt.options["lr"] == 0.005 and ckpt.options["batch_size"] == 2
    assert ckpt.config["layer_count"] == 1 and ckpt.config["channels"] == 16
    assert ckpt.config["dropout"] == 0.2
    assert "dropout=0.2" in capsys.readouterr().err
    # --preset is the base the config starts from
    assert cli.main(["train", "--preset", "tinylm-gpt2", "--config", str(conf), "--data", str(data),
                     "--no-plot", "--steps", "1", "--out", str(tmp_path / "s")]) == 0
    c = read_checkpoint(tmp_path / "s" / "checkpoint.safetensors")
    assert c.options["preset"] == "tinylm-gpt2" and c.config["lm_head_bias"] is False
    # and so is a preset the config names
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "preset": "tinylm-gpt2"}))
    assert cli.main(["train", "--config", str(conf), "--data", str(data), "--no-plot", "--steps", "1",
                     "--out", str(tmp_path / "n")]) == 0
    assert read_checkpoint(tmp_path / "n" / "checkpoint.safetensors").options["preset"] == "tinylm-gpt2"


def run_shell(command: str, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120, **kw)


def test_a_broken_pipe_exits_quietly():
    proc = run_shell(f"{sys.executable} -m graphlm params --preset gpt2-small | head -n 2")
    assert len(proc.stdout.splitlines()) == 2
    assert proc.stderr == ""                                      # no "BrokenPipeError"
    assert proc.returncode in (0, cli.EXIT_BROKEN_PIPE)           # 0: it all fit in the pipe
    # a reader that is gone before the first write: always a broken pipe
    proc = run_shell(f"{sys.executable} -m graphlm params --preset gpt2-small | true")
    assert proc.stderr == "" and proc.returncode == cli.EXIT_BROKEN_PIPE


def test_ctrl_c_exits_130_and_a_failure_exits_1(tmp_path, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    def failed(args):
        raise OSError(5, "Input/output error", str(tmp_path / "f"))

    for func, code, text in ((interrupted, 130, "interrupted"), (failed, 1, "input/output error")):
        monkeypatch.setattr(cli, "cmd_stats", func)
        assert cli.main(["stats"]) == code
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and text in err and "Error:" not in err


def test_sigint_to_a_running_command_gives_130(tmp_path):
    # (the child takes Ctrl-C as a terminal's Python does even where its launcher ignores SIGINT,
    # as a shell's `cmd &` without job control makes every child do)
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time, sys\n"
                             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                             "from graphlm.tools import cli\n"
                             "cli.cmd_stats = lambda args: (print('ready', flush=True), time.sleep(60))\n"
                             "sys.exit(cli.main(['stats']))"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "graphlm stats: interrupted"


def test_render_and_stats_of_the_train_graph_use_trains_defaults(tmp_path, capsys):
    dot = tmp_path / "t.dot"
    small = '{"layer_count": 1, "context_length": 8}'
    assert cli.main(["render", "--config", small, "--graph", "train", "--out", str(dot)]) == 0
    assert "dropout" not in dot.read_text()                       # train runs dropout 0.0
    assert cli.main(["render", "--config", '{"layer_count": 1, "context_length": 8, "dropout": 0.1}',
                     "--graph", "train", "--out", str(dot)]) == 0
    assert "dropout" in dot.read_text()                           # unless told otherwise
    capsys.readouterr()
    assert cli.main(["stats", "--config", small, "--graph", "train", "--json"]) == 0
    assert "dropout" not in json.loads(capsys.readouterr().out)["by_op"]
