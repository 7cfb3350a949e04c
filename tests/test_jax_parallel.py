"""The jax executor over many devices and processes, each run in fresh subprocesses (JAX reads
its device count once, before its first use):

- data parallel over 1, 2 and 4 simulated CPU devices, with and without ZeRO-1 sharding of the
  AdamW moments: the same losses and weights within float32 tolerance, fewer bytes per device;
- ``graphlm train --executor jax``: one process, ``--devices 2``, and 2 processes on 127.0.0.1
  (jax.distributed, gloo) on the same global batch: the same losses and checkpoint, and only
  process 0 writes one; the checkpoint resumes on the numpy executor with the usual warning;
- ``graphlm generate --executor jax`` and the KV-cache programs compiled once.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.test_jax_executor import jax  # noqa: F401  (skips, or fails in CI, without JAX)
from graphlm.io.checkpoint import read_checkpoint
from tests.gradcheck import assert_close

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def python(code: str, env_extra=None) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    env = {**os.environ, **(env_extra or {})}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


DATA_PARALLEL = """
    import json
    import numpy as np
    from graphlm import executors, optim
    from graphlm.models import GPT, GPTConfig
    from graphlm.nn import DROPOUT_KEY
    from graphlm.train import dropout_key

    cfg = GPTConfig(vocab_size=13, context_length=8, channels=16, head_count=2, layer_count=2,
                    dropout=0.1, attention_bias=False)
    model = GPT(cfg)
    model.train()
    g, loss = model.loss_graph(8)
    opt = optim.AdamW(lr=1e-2, clip_norm=1.0)
    step = opt.minimize(loss)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 13, (8, 8)), "targets": rng.integers(0, 13, (8, 8))}
               for _ in range(3)]
    out = {}
    for devices, zero in ((1, False), (2, False), (4, False), (4, True)):
        prog = executors.get("jax").compile(g, [loss, step.update], devices=devices,
                                            shard_optimizer_state=zero)
        state = {**model.init(0), **opt.init_state()}
        losses = [float(prog.run({**b, **opt.feeds(s), DROPOUT_KEY: dropout_key(0, s)}, state)[0])
                  for s, b in enumerate(batches)]
        weights = prog.host_state(state)
        out[f"{devices}{'z' if zero else ''}"] = {
            "losses": losses, "memory": prog.memory_report(),
            "shards": {k: len({d for d in v.sharding.device_set}) for k, v in state.items()},
            "spread": {k: v.addressable_shards[0].data.shape != v.shape for k, v in state.items()},
            "weights": {k: v.tolist() for k, v in weights.items()}}
    print(json.dumps(out))
"""


def test_data_parallel_over_1_2_4_devices_with_and_without_zero1():
    out = python(DATA_PARALLEL, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    one = out["1"]
    for key in ("2", "4", "4z"):
        run = out[key]
        assert_close(run["losses"], one["losses"], 1e-5, 1e-6, f"losses on {key} devices")
        for name, w in one["weights"].items():
            assert_close(np.array(run["weights"][name]), np.array(w), 1e-4, 1e-6, f"{name} on {key}")
        assert set(run["shards"].values()) == {int(key[0])}      # every array on every device
    plain, zero = out["4"], out["4z"]
    assert not any(plain["spread"].values())                     # replicated: whole on each device
    moments = [k for k in zero["spread"] if k.startswith("optimizer.")]
    splittable = [k for k in moments if any(d % 4 == 0 for d in np.shape(zero["weights"][k]))]
    assert splittable and all(zero["spread"][k] for k in splittable), \
        [k for k in splittable if not zero["spread"][k]]
    assert not any(zero["spread"][k] for k in zero["spread"] if not k.startswith("optimizer."))
    m = zero["memory"]
    params = m["replicated_state_bytes_per_device"] / 3           # params, m, v of one size
    assert m["state_bytes_per_device"] < params * 1.6 and plain["memory"]["sharded_state"] == 0
    assert m["replicated_state_bytes_per_device"] == plain["memory"]["state_bytes_per_device"]


# -- the trainer and the CLI ----------------------------------------------------------------------------

TRAIN = ["train", "--executor", "jax", "--context-length", "16", "--channels", "16", "--heads", "2",
         "--layers", "1", "--steps", "4", "--batch-size", "4", "--eval-every", "2", "--eval-batches",
         "1", "--dropout", "0.1", "--progress", "log", "--log-every", "1", "--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process; one process over 2 devices; 2 processes: all started at once."""
    tmp = tmp_path_factory.mktemp("jax_runs")
    port = free_port()
    cmd = [sys.executable, "-m", "graphlm"]
    jobs = {"single": TRAIN + ["--out", str(tmp / "single")],
            "devices2": TRAIN + ["--out", str(tmp / "devices2"), "--devices", "2"]}
    for i in range(2):
        jobs[f"process{i}"] = TRAIN + ["--out", str(tmp / f"process{i}"), "--coordinator",
                                       f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = {k: subprocess.Popen(cmd + a, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, a in jobs.items()}
    logs = {}
    try:
        for k, p in procs.items():
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"{k}: {err[-3000:]}"
            logs[k] = out + err
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return tmp, logs


def _losses(log: str) -> list[float]:
    return [float(line.split("loss ")[1].split()[0]) for line in log.splitlines()
            if line.startswith("step ") and "val loss" not in line]


def _val(path: Path) -> list[float]:
    entries = (json.loads(line) for line in (path / "log.jsonl").read_text().splitlines())
    return [e["val_loss"] for e in entries if "val_loss" in e]


def test_two_devices_and_two_processes_train_like_one(runs):
    tmp, logs = runs
    want = _losses(logs["single"])
    assert len(want) == 4 and len(_val(tmp / "single")) == 2     # evaluations at steps 2 and 4
    for k in ("devices2", "process0", "process1"):
        np.testing.assert_allclose(_losses(logs[k]), want, rtol=2e-4, err_msg=k)   # 4 printed digits
        np.testing.assert_allclose(_val(tmp / k), _val(tmp / "single"), rtol=1e-5, err_msg=k)
    ref = read_checkpoint(tmp / "single" / "checkpoint.safetensors")
    for k in ("devices2", "process0"):
        ckpt = read_checkpoint(tmp / k / "checkpoint.safetensors")
        assert ckpt.step == 4 and set(ckpt.tensors) == set(ref.tensors)
        for name, t in ref.tensors.items():
            # the key bias's gradient is exactly zero in theory (softmax ignores a per-row shift)
            # and rounding noise in practice, which AdamW scales up to lr-sized steps
            if not name.endswith("attention.qkv_bias"):
                assert_close(ckpt.tensors[name], t, 1e-4, 1e-6, f"{k}: {name}")
    assert not (tmp / "process1" / "checkpoint.safetensors").exists()
    assert "checkpoint written by process 0" in logs["process1"]


def test_a_jax_checkpoint_resumes_on_numpy_with_the_usual_warning(runs, tmp_path, capsys):
    import shutil
    from graphlm.tools import cli

    src, _ = runs
    shutil.copytree(src / "single", tmp_path / "run")
    code = cli.main(["train", "--out", str(tmp_path / "run"), "--resume", "--executor", "numpy",
                     "--steps", "5", "--progress", "log"])
    err = capsys.readouterr().err
    assert code == 0 and "resuming with changed executor" in err
    assert read_checkpoint(tmp_path / "run" / "checkpoint.safetensors").step == 5


def test_generate_on_jax_matches_numpy_and_compiles_the_decode_step_once(runs, capsys):
    from graphlm.models import GPT, GPTConfig
    from graphlm.sample import Generator
    from graphlm.tools import cli

    tmp, _ = runs
    path = tmp / "single" / "checkpoint.safetensors"
    ckpt = read_checkpoint(path)
    model = GPT(GPTConfig.from_dict(ckpt.config))
    params = {n: ckpt.tensors[n] for n in model.parameters()}
    gens = {ex: Generator(model, params, executor=ex) for ex in ("numpy", "jax")}
    prompt = np.array([[72, 101, 108, 108]])
    for ex, gen in gens.items():
        gen.logits = [gen.prefill(prompt)] + [gen.decode(np.array([t])) for t in (111, 32, 119)]
    for a, b in zip(gens["jax"].logits, gens["numpy"].logits):
        assert_close(a, b, 1e-5, 1e-6, "logits")
    assert sorted(gens["jax"]._programs, key=str) == [4, None]   # prefill [1,4], one decode step
    assert cli.main(["generate", "--checkpoint", str(path), "--executor", "jax", "--prompt", "RO",
                     "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("RO")


def test_bad_flags_are_one_line_errors(tmp_path):
    cmd = [sys.executable, "-m", "graphlm"] + TRAIN + ["--out", str(tmp_path / "x")]
    for extra, message in ((["--coordinator", "127.0.0.1:1"], "go together"),
                           (["--devices", "3"], "cannot be split along its first axis over 3 devices"),
                           (["--executor", "numpy", "--devices", "2"], "need --executor jax")):
        done = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr


def test_a_process_reads_just_its_rows_of_each_batch():
    from graphlm.data import BatchSampler

    sampler = BatchSampler(np.arange(500) % 256, batch_size=6, context_length=8, seed=3)
    x, y = sampler.batch(5)
    for part in (slice(0, 3), slice(3, 6), slice(2, 4)):
        xp, yp = sampler.batch(5, part)
        np.testing.assert_array_equal(xp, x[part])
        np.testing.assert_array_equal(yp, y[part])


BAD_INPUT_IN_ONE_PROCESS = """
    import sys
    import numpy as np
    from graphlm import executors
    from graphlm.executors.jax_executor import parallel
    from graphlm.ir import Graph
    from graphlm import ops

    port, pid = sys.argv[1], int(sys.argv[2])
    parallel.initialize(f"127.0.0.1:{port}", 2, pid)
    g = Graph("bad_input")
    table = g.param("table", (5, 3))
    tokens = g.input("tokens", (2, 4), np.int64)
    out = ops.sum(ops.embedding(table, tokens))
    prog = executors.get("jax").compile(g, [out])
    state = {"table": np.ones((5, 3), np.float32)}
    good = np.full((1, 4), pid, np.int64)            # this process's row of the batch
    print("first", float(prog.run({"tokens": good}, state)[0]), flush=True)
    bad = good.copy()
    if pid == 1:
        bad[0, 2] = 7                                 # out of the table's 5 rows
    try:
        prog.run({"tokens": bad}, state)
    except ValueError as e:
        print("error:", e, flush=True)
        sys.exit(2)
    print("ran", flush=True)
"""


def test_bad_input_in_one_process_stops_every_process_with_one_line_each():
    """Process 1 feeds a token id out of range: it stops with the executor's error naming the
    op and the id, and process 0 stops too, naming process 1, instead of waiting forever in the
    program's collective."""
    port = free_port()
    code = textwrap.dedent(BAD_INPUT_IN_ONE_PROCESS)
    env = {**os.environ, "XLA_FLAGS": ""}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(port), str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, (out, err[-2000:])
        assert "first 24.0" in out and "ran" not in out.splitlines()
    assert "token id 7" in outs[1][0] and "embedding" in outs[1][0], outs[1][0]
    assert "process 1 refused its inputs" in outs[0][0], outs[0][0]
