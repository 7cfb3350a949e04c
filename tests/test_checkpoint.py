"""Checkpoints: round trip, atomic writes, and corrupted/truncated/mismatched files that raise a
ValueError naming the file while the live state stays byte-identical."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from graphlm.io.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint

CONFIG = {"vocab_size": 16, "context_length": 8, "channels": 4, "head_count": 2, "layer_count": 1}


def make_state(seed=0):
    rng = np.random.default_rng(seed)
    return {"token_embedding.weight": rng.standard_normal((16, 4)).astype(np.float32),
            "final_norm.bias": rng.standard_normal(4).astype(np.float32),
            "optimizer.m.token_embedding.weight": rng.standard_normal((16, 4)).astype(np.float32),
            "optimizer.v.final_norm.bias": rng.random(4).astype(np.float32)}


def save(path, state, step=7, config=CONFIG):
    return save_checkpoint(path, state, step=step, config=config,
                           options={"lr": 1e-3, "batch_size": 4},
                           rng={"seed": 3}, sampler={"seed": 3, "step": step})


def craft(path, tensors, **meta):
    """A file a hostile or buggy writer could make: any metadata, with a valid checksum."""
    import safetensors.numpy

    from graphlm.io.checkpoint import FORMAT, VERSION, _digest
    full = {"format": FORMAT, "version": str(VERSION), "step": "7", "config": json.dumps(CONFIG),
            "options": "{}", "rng": "{}", "sampler": "{}", "extra": "{}"}
    full.update(meta)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    full["checksum"] = _digest(full, arrays)
    Path(path).write_bytes(safetensors.numpy.save(arrays, metadata=full))
    return path


def snapshot(state):
    return {k: v.tobytes() for k, v in state.items()}


def test_round_trip(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    src = make_state(0)
    save(path, src)
    live = make_state(1)
    ids = {k: id(v) for k, v in live.items()}
    ck = load_checkpoint(path, live, config=CONFIG)
    assert ck.step == 7 and ck.config == CONFIG and ck.options["batch_size"] == 4
    assert ck.rng == {"seed": 3} and ck.sampler == {"seed": 3, "step": 7}
    for k in src:
        assert live[k].tobytes() == src[k].tobytes()
        assert id(live[k]) == ids[k]          # loaded in place: programs keep their arrays
    fresh = read_checkpoint(path)
    assert sorted(fresh.tensors) == sorted(src)
    raw = path.read_bytes()
    assert b"pickle" not in raw and raw[8:9] == b"{"   # a plain safetensors header


def test_failure_during_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    save(path, make_state(0), step=1)
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="simulated"):
        save(path, make_state(1), step=2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]   # no temp file left behind
    assert read_checkpoint(path).step == 1
    save(path, make_state(1), step=2)
    assert read_checkpoint(path).step == 2


def test_corrupted_bytes_anywhere_are_rejected_and_live_state_untouched(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save(path, make_state(0))
    raw = path.read_bytes()
    live = make_state(1)
    before = snapshot(live)
    bad = tmp_path / "bad.safetensors"
    offsets = sorted(set(np.linspace(0, len(raw) - 1, 97).astype(int)) | {0, 3, 8, 9, len(raw) - 1})
    for off in offsets:
        data = bytearray(raw)
        data[off] ^= 0xFF
        bad.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="bad.safetensors") as e:
            load_checkpoint(bad, live, config=CONFIG)
        assert snapshot(live) == before, f"live state changed by a file corrupted at byte {off}"
        assert str(e.value)


def test_truncated_files_are_rejected(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save(path, make_state(0))
    raw = path.read_bytes()
    live = make_state(1)
    before = snapshot(live)
    for n in sorted(set(np.linspace(0, len(raw) - 1, 60).astype(int)) | {0, 1, 7, 8, len(raw) - 1}):
        (tmp_path / "cut.safetensors").write_bytes(raw[:n])
        with pytest.raises(ValueError, match=r"cut\.safetensors.*(truncated|corrupted)"):
            load_checkpoint(tmp_path / "cut.safetensors", live)
        assert snapshot(live) == before


def test_mismatches_are_named(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save(path, make_state(0))
    live = make_state(1)
    before = snapshot(live)
    with pytest.raises(ValueError, match=r"config does not match.*channels: file 4 vs model 8"):
        load_checkpoint(path, live, config={**CONFIG, "channels": 8})
    extra = {**live, "blocks.0.mlp.weight": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): blocks.0.mlp.weight"):
        load_checkpoint(path, extra)
    fewer = {k: v for k, v in live.items() if k != "final_norm.bias"}
    with pytest.raises(ValueError, match=r"unexpected 1 tensor\(s\): final_norm.bias"):
        load_checkpoint(path, fewer)
    wrong = dict(live)
    wrong["final_norm.bias"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"'final_norm.bias' is \[4\] float32 in the file but \[5\]"):
        load_checkpoint(path, wrong)
    wrong["final_norm.bias"] = np.zeros(4, np.float64)
    with pytest.raises(ValueError, match="float64 in the model"):
        load_checkpoint(path, wrong)
    assert snapshot(live) == before
    with pytest.raises(ValueError, match="no such file"):
        load_checkpoint(tmp_path / "nope.safetensors", live)


def test_non_finite_values_and_foreign_files(tmp_path):
    import safetensors.numpy

    state = make_state(0)
    state["final_norm.bias"][1] = np.nan
    craft(tmp_path / "nan.safetensors", state)   # (save_checkpoint itself refuses to write it)
    with pytest.raises(ValueError, match="'final_norm.bias' holds NaN"):
        read_checkpoint(tmp_path / "nan.safetensors")
    safetensors.numpy.save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="plain.safetensors.*(not a graphlm checkpoint|metadata)"):
        read_checkpoint(tmp_path / "plain.safetensors")


def test_a_non_finite_tensor_or_metadata_value_is_never_written(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save(path, make_state(0), step=2)
    before = path.read_bytes()
    state = make_state(1)
    state["optimizer.m.token_embedding.weight"][0, 0] = np.inf
    with pytest.raises(ValueError, match=r"not written: tensor 'optimizer.m.token_embedding.weight' holds NaN"):
        save(path, state, step=3)
    with pytest.raises(ValueError, match=r"not written: metadata field extra.history.0.val_loss is NaN"):
        save_checkpoint(path, make_state(1), step=3, config=CONFIG,
                        extra={"history": [{"val_loss": float("nan")}]})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_non_regular_files_are_refused_without_reading(tmp_path):
    import threading

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    result = {}

    def read():
        try:
            read_checkpoint(fifo)
        except ValueError as e:
            result["error"] = str(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert "pipe.safetensors: is a FIFO" in result["error"]
    with pytest.raises(ValueError, match="/dev/zero: is a character device"):
        read_checkpoint("/dev/zero")
    with pytest.raises(ValueError, match="is a directory"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("meta, message", [
    ({"config": json.dumps([1, 2])}, "field 'config' must be a JSON object, got list"),
    ({"extra": "[" * 5000 + "]" * 5000}, "field 'extra' is nested deeper than 16"),
    ({"extra": json.dumps({"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]})}, "'extra' is nested deeper"),
    ({"step": "-3"}, "field 'step' must be an integer"),
    ({"step": "1e9"}, "field 'step' must be an integer"),
    ({"options": "{bad json"}, "field 'options' is not valid JSON"),
])
def test_crafted_metadata_with_a_valid_checksum_is_one_named_error(tmp_path, meta, message):
    path = craft(tmp_path / "crafted.safetensors", make_state(0), **meta)
    with pytest.raises(ValueError, match="crafted.safetensors") as e:
        read_checkpoint(path)
    assert message in str(e.value)


def test_the_header_must_declare_exactly_the_bytes_that_follow(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save(path, make_state(0))
    (tmp_path / "long.safetensors").write_bytes(path.read_bytes() + b"\0" * 64)
    with pytest.raises(ValueError, match=r"long.safetensors: truncated or corrupted: the header declares"):
        read_checkpoint(tmp_path / "long.safetensors")


def test_a_save_removes_temporaries_of_dead_writers(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    leftover = tmp_path / f".ckpt.safetensors.tmp-{dead}"
    leftover.write_bytes(b"x" * 1000)          # what kill -9 during a save leaves
    mine = tmp_path / f".ckpt.safetensors.tmp-{os.getppid()}"   # a live process's: kept
    mine.write_bytes(b"y")
    save(tmp_path / "ckpt.safetensors", make_state(0))
    assert not leftover.exists() and mine.exists()
