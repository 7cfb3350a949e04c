"""A training run never loses good work and no input gets a traceback: the run-folder lock,
best/last checkpoints and divergence, resume on the same data, validating loaders, the native
library's verification, and refused nonsense. Tiny models, a few steps each (issue 19)."""
import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest

from graphlm import executors  # noqa: F401  (registers the executors)
from graphlm.data import BUNDLED_CORPUS
from graphlm.io.checkpoint import read_checkpoint
from graphlm.io.runfolder import RunLock
from graphlm.tools.cli import main as cli_main
from graphlm.train import Diverged, Trainer, TrainOptions, checkpoint_model
from tests.test_checkpoint import craft
from tests.test_train import ROOT, TINY_FLAGS

TINY = [*TINY_FLAGS, "--executor", "numpy"]   # 


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_bytes(BUNDLED_CORPUS.read_bytes()[:6000])
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("run") / "r"
    assert cli_main(["train", *TINY, "--data", str(text), "--steps", "3", "--eval-every", "3",
                     "--out", str(out)]) == 0
    return out


def train(*args):
    return cli_main(["train", *TINY, *args])


# -- the run folder belongs to one run ----------------------------------------------------------------
def test_a_second_run_into_a_held_folder_fails_at_once_naming_the_holder(tmp_path, text, capsys):
    out = tmp_path / "run"
    with RunLock(out):                         # (an flock: a second open of the file conflicts)
        assert train("--data", str(text), "--steps", "2", "--out", str(out)) != 0
        err = capsys.readouterr().err
        assert f"run folder {out} is in use by pid {os.getpid()}" in err
        assert not (out / "checkpoint.safetensors").exists() and not (out / "log.jsonl").exists()
    # the lock file of a dead holder is stale: the next run takes the folder over
    (out / "run.lock").write_text(json.dumps({"pid": 2 ** 22 + 12345, "host": "x", "since": 0}))
    assert train("--data", str(text), "--steps", "2", "--out", str(out)) == 0
    assert "no longer running; taking it over" in capsys.readouterr().err


def test_the_lock_is_held_by_a_live_process_until_it_ends(tmp_path, text):
    out = tmp_path / "run"
    code = f"from graphlm.io.runfolder import RunLock; l = RunLock({str(out)!r}).acquire(); print('held', flush=True); input()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by pid {holder.pid}"):
            RunLock(out).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(out).acquire().release()            # the kernel dropped the dead holder's lock


# -- never replace good with bad ----------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("lr", 1e39, "finite as a float32"), ("lr", 1e-50, "rounds to 0"), ("eps", 1e-46, "rounds to 0"),
    ("beta2", 1.0, "in [0, 1)"), ("weight_decay", -0.1, "in [0, inf)"), ("clip_norm", 0.0, "(0, inf)"),
    ("steps", "abc", "an integer >= 1"), ("batch_size", 2.5, "an integer >= 1"), ("preset", "", "non-empty"),
])
def test_options_are_checked_in_the_dtype_they_are_used_in(field, value, message):
    with pytest.raises(ValueError, match=rf"TrainOptions.{field} must be .*{re.escape(message)}"):
        TrainOptions(**{field: value})


def test_a_nan_state_is_never_saved_and_the_good_checkpoint_stays(tmp_path, text):
    tr = Trainer(TrainOptions(steps=4, batch_size=4, warmup=1, eval_batches=1, data=str(text), executor="numpy",
                              model={"context_length": 16, "channels": 16, "head_count": 2, "layer_count": 1}))
    tr.train_step()
    path = tr.save(tmp_path / "checkpoint.safetensors")
    before = path.read_bytes()
    tr.train_step()
    tr.state["final_norm.weight"][0] = np.nan
    with pytest.raises(Diverged, match="'final_norm.weight' holds NaN"):
        tr.save(path)
    assert path.read_bytes() == before and read_checkpoint(path).step == 1


def test_divergence_stops_the_run_and_keeps_the_best_checkpoint(tmp_path, text, capsys):
    out = tmp_path / "run"
    blow_up = ["--lr", "1e3", "--warmup", "0", "--clip-norm", "1e30"]   # finite, but huge losses
    assert train("--data", str(text), *blow_up, "--steps", "12", "--eval-every", "1", "--out", str(out)) != 0
    err = capsys.readouterr().err
    assert "training diverged at step 1: validation loss" in err and "uniform guessing" in err
    assert "no checkpoint written" in err and not (out / "checkpoint.safetensors").exists()

    out = tmp_path / "run2"
    assert train("--data", str(text), "--steps", "4", "--eval-every", "1", "--out", str(out)) == 0
    before = {name: (out / name).read_bytes() for name in ("checkpoint.safetensors", "best.safetensors")}
    capsys.readouterr()
    assert cli_main(["train", "--resume", *blow_up, "--steps", "12", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "training diverged at step 5" in err and "stopped without saving this state" in err
    assert "is far above the best" in err and "Traceback" not in err
    best = read_checkpoint(out / "best.safetensors")
    assert f"last checkpoint {out / 'checkpoint.safetensors'} (step 4)" in err
    assert f"best checkpoint {out / 'best.safetensors'} (step {best.step}" in err
    assert before == {name: (out / name).read_bytes() for name in before}
    vals = {h["step"]: h["val_loss"] for h in best.extra["history"]}
    assert min(vals, key=vals.get) == best.step and best.extra["best_val_loss"] == pytest.approx(vals[best.step], abs=1e-5)


def test_the_final_line_says_which_file_holds_what(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert train("--data", str(text), "--steps", "4", "--eval-every", "2", "--out", str(out)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    best = read_checkpoint(out / "best.safetensors")
    assert f"last checkpoint {out / 'checkpoint.safetensors'} (step 4)" in last
    assert f"best checkpoint {out / 'best.safetensors'} (step {best.step}" in last
    assert read_checkpoint(out / "checkpoint.safetensors").step == 4


# -- resume means the same run ------------------------------------------------------------------------
def test_resume_refuses_other_data_unless_allowed(tmp_path, text, capsys, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "data.txt").write_bytes(text.read_bytes())
    (b / "data.txt").write_bytes(text.read_bytes()[::-1] + text.read_bytes()[:3000])
    out = tmp_path / "run"
    monkeypatch.chdir(a)
    assert train("--data", "data.txt", "--steps", "2", "--out", str(out)) == 0
    ck = read_checkpoint(out / "checkpoint.safetensors")
    assert ck.sampler["data"]["path"] == str(a / "data.txt") and ck.sampler["data"]["bytes"] == 6000
    monkeypatch.chdir(b)                      # the relative path now names another file
    capsys.readouterr()
    assert cli_main(["train", "--resume", "--steps", "3", "--data", "data.txt", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "--resume on other data" in err and str(a / "data.txt") in err and str(b / "data.txt") in err
    assert read_checkpoint(out / "checkpoint.safetensors").step == 2
    # without --data the recorded absolute path is used, from any folder
    assert cli_main(["train", "--resume", "--steps", "3", "--out", str(out)]) == 0
    assert cli_main(["train", "--resume", "--steps", "4", "--data", "data.txt", "--allow-other-data",
                     "--out", str(out)]) == 0
    assert "continuing on other data" in capsys.readouterr().err


def test_resume_checks_steps_and_states_the_schedule_horizon(run_dir, capsys):
    assert cli_main(["train", "--resume", "--steps", "2", "--out", str(run_dir)]) != 0
    assert "--steps 2 is below the step of the checkpoint" in capsys.readouterr().err
    assert cli_main(["train", "--resume", "--layers", "2", "--out", str(run_dir)]) != 0
    err = capsys.readouterr().err
    assert "(--layers)" in err and "layer-count" not in err


def test_resume_notes_the_kept_horizon_and_auto_is_not_a_changed_executor(tmp_path, text, capsys):
    from graphlm.backends import default_executor
    out = tmp_path / "run"
    assert cli_main(["train", *TINY_FLAGS, "--data", str(text), "--steps", "2", "--out", str(out)]) == 0
    assert read_checkpoint(out / "checkpoint.safetensors").options["executor"] == default_executor()
    capsys.readouterr()
    assert cli_main(["train", "--resume", "--steps", "3", "--executor", "auto", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "changed executor" not in err
    assert "keeps its cosine horizon of 2 steps" in err
    assert cli_main(["train", "--resume", "--steps", "4", "--decay-steps", "4", "--out", str(out)]) == 0
    assert "cosine horizon changes from 2 to 4 steps" in capsys.readouterr().err


# -- data and memory are checked before training --------------------------------------------------------
def test_data_too_small_for_one_validation_batch_fails_before_training(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_bytes(BUNDLED_CORPUS.read_bytes()[:400])   # val 40 bytes: > 17, < 4 windows of 16
    out = tmp_path / "run"
    assert train("--data", str(small), "--steps", "50", "--out", str(out)) != 0
    err = capsys.readouterr().err
    assert "small.txt: its validation part (40 bytes" in err and "one batch of 4 windows" in err
    assert not (out / "checkpoint.safetensors").exists()


def test_memory_hungry_configs_are_refused_with_the_bytes(tmp_path, capsys):
    assert cli_main(["train", "--context-length", "100000", "--out", str(tmp_path / "r")]) != 0
    err = capsys.readouterr().err
    assert "needs at least" in err and "GiB" in err and "attention scores" in err
    assert "MemoryError" not in err


def test_non_regular_data_files_are_refused(tmp_path, capsys):
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    assert train("--data", str(fifo), "--out", str(tmp_path / "r")) != 0   # (main: hangs here)
    assert "fifo.txt: is a FIFO" in capsys.readouterr().err


# -- crafted training checkpoints -------------------------------------------------------------------------
def _crafted(tmp_path, run_dir, **changes):
    ck = read_checkpoint(run_dir / "checkpoint.safetensors")
    meta = {"step": str(ck.step)}
    for section in ("config", "options", "rng", "sampler", "extra"):
        value = changes.pop(section, getattr(ck, section))
        meta[section] = json.dumps(value)
    path = tmp_path / "crafted" / "checkpoint.safetensors"
    path.parent.mkdir(exist_ok=True)
    return craft(path, changes.pop("tensors", ck.tensors), **meta)


@pytest.mark.parametrize("what, message", [
    ("config-empty", "field config: GPTConfig: missing field(s) vocab_size"),
    ("config-list", "field 'config' must be a JSON object"),
    ("head-count", "field config does not match its options"),
    ("steps-abc", "field options: TrainOptions.steps must be an integer"),
    ("batch-2.5", "field options: TrainOptions.batch_size must be an integer"),
    ("history", "field extra.history[0] must be an object"),
    ("context-1e9", "tensor 'positional_embedding.table.weight' is [16, 16] float32, the model of its config needs [1000000000, 16]"),
])
def test_crafted_training_metadata_is_one_error_naming_file_and_field(tmp_path, run_dir, capsys, what, message):
    ck = read_checkpoint(run_dir / "checkpoint.safetensors")
    config, options, extra = dict(ck.config), dict(ck.options), dict(ck.extra)
    change = {"config-empty": {"config": {}}, "config-list": {"config": [1, 2]},
              "head-count": {"config": {**config, "head_count": 4}},
              "steps-abc": {"options": {**options, "steps": "abc"}},
              "batch-2.5": {"options": {**options, "batch_size": 2.5}},
              "history": {"extra": {**extra, "history": [1, 2]}},
              "context-1e9": {"config": {**config, "context_length": 10 ** 9}, "options": {}}}[what]
    path = _crafted(tmp_path, run_dir, **change)
    for argv in (["generate", "--checkpoint", str(path), "--max-new-tokens", "2", "--executor", "numpy"],
                 ["train", "--resume", "--out", str(path.parent)]):
        assert cli_main(argv) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err, err
        if argv[0] == "generate" or what != "context-1e9":
            assert message in err, (argv[0], err)


def test_generate_names_the_file_for_wrong_shapes_and_the_flag_for_a_bad_prompt(tmp_path, run_dir, capsys):
    ck = read_checkpoint(run_dir / "checkpoint.safetensors")
    tensors = dict(ck.tensors)
    tensors["final_norm.bias"] = np.zeros(5, np.float32)
    path = _crafted(tmp_path, run_dir, tensors=tensors)
    assert cli_main(["generate", "--checkpoint", str(path)]) != 0
    assert f"checkpoint {path}: tensor 'final_norm.bias' is [5] float32" in capsys.readouterr().err
    bad_utf8 = os.fsdecode(b"caf\xe9")        # how Python passes an invalid-UTF-8 argv
    assert cli_main(["generate", "--checkpoint", str(run_dir / "checkpoint.safetensors"),
                     "--prompt", bad_utf8, "--executor", "numpy"]) != 0
    assert "--prompt is not valid UTF-8" in capsys.readouterr().err


def test_checkpoint_model_returns_the_validated_parameters(run_dir):
    config, params = checkpoint_model(read_checkpoint(run_dir / "checkpoint.safetensors"))
    assert config.channels == 16 and "token_embedding.weight" in params
    assert not any(k.startswith("optimizer.") for k in params)


# -- graph building refuses what would fail later ------------------------------------------------------------
def test_integer_true_division_and_float_shapes_are_refused_at_build():
    import graphlm as gl
    g = gl.Graph("g")
    i = g.input("i", (3,), "int64")
    with pytest.raises(gl.ShapeError, match="true division needs floating-point inputs, got int64"):
        gl.div(i, i)
    for shape in ((2.7,), ("3",), (True,), "ab"):
        with pytest.raises(gl.ShapeError, match="shape must be a sequence of ints"):
            g.input(f"x{len(g.inputs)}", shape)
    f = g.input("f", (3,))
    assert (f / 2).shape == (3,) and g.input("n", (np.int64(2),)).shape == (2,)


@pytest.mark.parametrize("argv, flag", [
    (["train", "--max-minutes", "-1"], "--max-minutes"), (["train", "--preset", ""], "--preset"),
    (["params", "--seq-len", "-5"], "--seq-len"), (["params", "--depth", "-3"], "--depth"),
    (["stats", "--top", "-2"], "--top"), (["render", "--timeout", "-1"], "--timeout"),
    (["params", "--preset", " "], "--preset"),
])
def test_nonsense_values_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    assert f"argument {flag}: must" in capsys.readouterr().err


# -- the native library -----------------------------------------------------------------------------
def _native_run(env, code="from graphlm.executors import native; native.library(); print('loaded')"):
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path, native):
    env = {"GRAPHLM_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    assert _native_run(env).stdout.strip() == "loaded"
    (so,) = (tmp_path / "cache").glob("native-*.so")
    good = so.read_bytes()
    record = json.loads(so.with_name(so.name + ".json").read_text())
    assert record["bytes"] == len(good)
    so.write_bytes(good[: len(good) // 3])   # truncated: mapping it would SIGBUS (main: rc -7)
    r = _native_run(env)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr
    assert so.read_bytes() == good
    # a library lacking the kernels, with a matching record (main: AttributeError)
    src = tmp_path / "empty.c"
    src.write_text("void unrelated(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    import hashlib
    data = so.read_bytes()
    so.with_name(so.name + ".json").write_text(json.dumps({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    r = _native_run(env)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr
    assert so.read_bytes() == good
    assert not list(tmp_path.glob("graphlm-native-*"))


def test_a_folder_others_can_write_is_never_loaded_from(tmp_path, native):
    cache = tmp_path / "cache"
    env = {"GRAPHLM_CACHE_DIR": str(cache), "TMPDIR": str(tmp_path)}
    assert _native_run(env).returncode == 0
    cache.chmod(0o777)
    (so,) = cache.glob("native-*.so")
    so.write_bytes(b"planted by another user")   # (would be loaded, or crash, if trusted)
    r = _native_run(env)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr
    assert so.read_bytes() == b"planted by another user"        # built elsewhere, not here
    assert "other users can write there" in r.stderr
    assert not list(tmp_path.glob("graphlm-native-*"))           # and its temporary folder removed


@pytest.mark.parametrize("cc, message", [("/nonexistent/cc", "needs a C compiler: '/nonexistent/cc' was not found"),
                                         ('"unterminated', "not a valid command line")])
def test_native_unavailable_is_one_line_in_the_cli(tmp_path, text, cc, message):
    env = {"GRAPHLM_CACHE_DIR": str(tmp_path / "cache"), "CC": cc}
    r = subprocess.run([sys.executable, "-m", "graphlm", "train", *TINY_FLAGS, "--executor", "native", "--data", str(text),
                        "--steps", "1", "--out", str(tmp_path / "r")], env={**os.environ, **env},
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_the_default_cache_made_group_writable_by_a_umask_is_made_private_again(tmp_path, native):
    cache = tmp_path / "xdg" / "graphlm"
    cache.mkdir(parents=True)
    cache.chmod(0o775)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "GRAPHLM_CACHE_DIR": "", "TMPDIR": str(tmp_path)}
    r = _native_run(env)
    assert r.returncode == 0 and "other users can write" not in r.stderr, r.stderr
    assert cache.stat().st_mode & 0o777 == 0o700 and list(cache.glob("native-*.so"))
