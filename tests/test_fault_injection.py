"""Fault injection: a training run killed with SIGKILL at random moments (saves every step) always
leaves a loadable checkpoint, and resuming after each kill reaches the same final bytes as a run
never interrupted. The killed runs are forked from this process (no interpreter start per run),
so 24 kills of a tiny model take seconds."""
import json
import os
import random
import signal
import time

import numpy as np

from graphlm import executors  # noqa: F401  (registers the executors)
from graphlm.data import BUNDLED_CORPUS
from graphlm.io.checkpoint import read_checkpoint
from graphlm.tools.cli import main as cli_main

KILLS = 24
STEPS = 80
MODEL = ["--context-length", "8", "--channels", "8", "--heads", "2", "--layers", "1"]
FLAGS = ["--batch-size", "2", "--warmup", "2", "--eval-batches", "1", "--eval-every", "1", "--executor", "numpy", "--threads", "1",
         "--steps", str(STEPS), "--seed", "5"]


def _fork_train(argv):
    """Start `graphlm train argv` in a forked child; its pid."""
    pid = os.fork()
    if pid == 0:   # the child: quiet, and never back into pytest
        code = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = cli_main(["train", *argv])
        finally:
            os._exit(code)
    return pid


def _inode(path):
    try:
        return os.stat(path).st_ino   # (each save renames a new file into place)
    except FileNotFoundError:
        return None


def _wait_for_a_new_save(path, pid, timeout=10.0):
    before, end = _inode(path), time.monotonic() + timeout
    while _inode(path) == before and time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            raise AssertionError(f"the training child ended (status {status}) before it was killed")
        time.sleep(0.002)


def _step_time(run, fallback):
    """Seconds of one step and its save on this machine, from the run's log (its elapsed times
    start after compiling, so they leave out the start-up), else `fallback`."""
    try:
        times = [json.loads(line)["elapsed_s"] for line in (run / "log.jsonl").read_text().splitlines()]
        return min(fallback, (times[-1] - times[0]) / max(len(times) - 1, 1))
    except (OSError, KeyError, ValueError, IndexError, TypeError):
        return fallback


def _tensors(path):
    ck = read_checkpoint(path)
    return ck.step, {k: v.tobytes() for k, v in ck.tensors.items()}, [(h["step"], h["val_loss"]) for h in ck.extra["history"]]


def test_sigkill_at_random_moments_never_loses_the_run(tmp_path, fresh_process_if_jax_runs):
    if fresh_process_if_jax_runs:
        return
    data = tmp_path / "data.txt"
    data.write_bytes(BUNDLED_CORPUS.read_bytes()[:3000])
    common = [*FLAGS, "--data", str(data)]
    ref = tmp_path / "ref"
    start = time.perf_counter()
    assert cli_main(["train", *MODEL, *common, "--out", str(ref)]) == 0
    step_time = _step_time(ref, (time.perf_counter() - start) / STEPS)

    out = tmp_path / "killed"
    rng = random.Random(19)
    kills, loadable, steps_seen, mid_save = 0, 0, [], 0
    deadline = time.monotonic() + 60
    while kills < KILLS and time.monotonic() < deadline:
        resume = (out / "checkpoint.safetensors").exists()
        pid = _fork_train([*common, "--out", str(out), *(["--resume"] if resume else MODEL)])
        if rng.random() < 0.8:   # mostly: once it has saved a new step, at a random moment after
            _wait_for_a_new_save(out / "checkpoint.safetensors", pid)
        time.sleep(rng.uniform(0.0, 1.5 * step_time))   # anywhere in the next step or its save
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):   # finished before the kill: start over would not test anything
            assert os.WEXITSTATUS(status) == 0
            break
        kills += 1
        mid_save += any(".tmp-" in p.name for p in out.iterdir())   # killed while writing a file
        if (out / "checkpoint.safetensors").exists():
            step, _, _ = _tensors(out / "checkpoint.safetensors")   # loadable after every kill
            loadable += 1
            steps_seen.append(step)
            if (out / "best.safetensors").exists():
                read_checkpoint(out / "best.safetensors")
    assert kills >= 20, f"only {kills} kills before the run finished or time ran out"
    assert loadable >= 10 and len(set(steps_seen)) >= 5, steps_seen   # kills landed all along the run
    assert steps_seen == sorted(steps_seen)                            # never went back
    print(f"{kills} kills, {mid_save} of them during a save; checkpoint steps after each: {steps_seen}")

    if not (out / "checkpoint.safetensors").exists() or _tensors(out / "checkpoint.safetensors")[0] < STEPS:
        assert cli_main(["train", *common, "--out", str(out), "--resume"]) == 0
    for name in ("checkpoint.safetensors", "best.safetensors"):
        step_a, a, hist_a = _tensors(ref / name)
        step_b, b, hist_b = _tensors(out / name)
        assert step_a == step_b and sorted(a) == sorted(b) and hist_a == hist_b, name
        for k in a:
            assert a[k] == b[k], (name, k)
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]   # the dead writers' leftovers are gone
    assert np.isfinite(read_checkpoint(out / "checkpoint.safetensors").tensors["token_embedding.weight"]).all()
