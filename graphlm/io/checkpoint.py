"""Training checkpoints in safetensors: tensors (params, optimizer moments) plus JSON metadata
(step, RNG and data-sampler position, model config, training options, and an `extra` record
such as the loss history). No pickle.

Writes are atomic: the bytes go to a temporary file in the same folder, which is flushed and
fsynced and then renamed over the old file, so a crash mid-write leaves the old checkpoint.
Loads are transactional: the whole file is parsed and checked (format, checksum over tensors
and metadata, names, shapes, dtypes, finite values, config) before any live array is touched;
any problem is a ValueError that names the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping

import numpy as np

FORMAT = "graphlm-checkpoint"
VERSION = 1
_ALLOWED_DTYPES = {np.dtype(t) for t in ("float32", "float64", "float16", "int64", "int32", "uint8")}


@dataclass
class Checkpoint:
    """What a checkpoint holds. `tensors` are the file's arrays (or, when loaded into a live
    state, those live arrays)."""

    tensors: dict[str, np.ndarray]
    step: int
    config: dict
    options: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    sampler: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    path: str = ""


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _digest(meta: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    h.update(_canonical({k: v for k, v in meta.items() if k != "checksum"}).encode())
    for name in sorted(tensors):
        a = tensors[name]
        h.update(_canonical([name, a.dtype.str, list(a.shape)]).encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def save_checkpoint(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], *, step: int,
                    config: Mapping[str, Any], options: Mapping[str, Any] | None = None,
                    rng: Mapping[str, Any] | None = None,
                    sampler: Mapping[str, Any] | None = None,
                    extra: Mapping[str, Any] | None = None) -> Path:
    """Write `tensors` and the metadata to `path` atomically; returns the path."""
    import safetensors.numpy

    path = Path(path)
    arrays = {}
    for name, a in tensors.items():
        a = np.asarray(a)
        if a.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"checkpoint {path}: tensor '{name}' has unsupported dtype {a.dtype}")
        arrays[name] = np.ascontiguousarray(a)
    try:
        meta = {"format": FORMAT, "version": str(VERSION), "step": str(int(step)),
                "config": _canonical(dict(config)), "options": _canonical(dict(options or {})),
                "rng": _canonical(dict(rng or {})), "sampler": _canonical(dict(sampler or {})),
                "extra": _canonical(dict(extra or {}))}
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: metadata is not plain JSON ({e})") from None
    meta["checksum"] = _digest(meta, arrays)
    payload = safetensors.numpy.save(arrays, metadata=meta)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Parse and verify the file at `path` (format, checksum, finite values) into fresh arrays."""
    import safetensors.numpy

    path = Path(path)
    where = f"checkpoint {path}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    if len(raw) < 8:
        raise ValueError(f"{where}: truncated ({len(raw)} bytes; not even a safetensors header length)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > len(raw) - 8:
        raise ValueError(f"{where}: truncated or corrupted (the header claims {header_len} bytes, "
                         f"the file has {len(raw) - 8} after the length)")
    try:
        header = json.loads(raw[8:8 + header_len].decode("utf-8"))
        meta = header.get("__metadata__")
        if not isinstance(meta, dict):
            raise ValueError("no metadata")
    except (UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: corrupted header ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: not a graphlm checkpoint (metadata format is "
                         f"{meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("version") != str(VERSION):
        raise ValueError(f"{where}: unsupported checkpoint version {meta.get('version')!r} "
                         f"(this graphlm reads version {VERSION})")
    try:
        tensors = safetensors.numpy.load(raw)
    except Exception as e:  # the library's own parse errors (SafetensorError, ...)
        raise ValueError(f"{where}: truncated or corrupted tensor data ({e})") from None
    if _digest(meta, tensors) != meta.get("checksum"):
        raise ValueError(f"{where}: checksum mismatch: the tensor data or metadata is corrupted")
    try:
        step = int(meta["step"])
        parsed = {k: json.loads(meta[k]) for k in ("config", "options", "rng", "sampler", "extra")}
    except (KeyError, ValueError) as e:
        raise ValueError(f"{where}: bad metadata ({e})") from None
    for name, a in tensors.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ValueError(f"{where}: tensor '{name}' holds NaN or inf values")
    return Checkpoint(dict(tensors), step, parsed["config"], parsed["options"], parsed["rng"],
                      parsed["sampler"], parsed["extra"], str(path))


def load_checkpoint(path: str | os.PathLike, state: MutableMapping[str, np.ndarray] | None = None,
                    *, config: Mapping[str, Any] | None = None,
                    upgrade_config: Callable[[dict], dict] | None = None) -> Checkpoint:
    """Read and verify `path`; with `state`, copy the tensors into its arrays in place.

    Everything is checked before any array of `state` changes: the file's tensor names must
    be exactly `state`'s, with the same shapes and dtypes; with `config`, the saved model
    config must equal it, after `upgrade_config` (e.g. ``GPTConfig.upgrade_dict``, which fills
    fields added since the file was written) has been applied to the saved one. On any problem a
    ValueError names the file and `state` is untouched.
    """
    ckpt = read_checkpoint(path)
    where = f"checkpoint {path}"
    if upgrade_config is not None:
        try:
            ckpt.config = upgrade_config(ckpt.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad model config ({e})") from None
    if config is not None and dict(config) != ckpt.config:
        diff = sorted(k for k in set(config) | set(ckpt.config) if config.get(k) != ckpt.config.get(k))
        details = ", ".join(f"{k}: file {ckpt.config.get(k)!r} vs model {config.get(k)!r}" for k in diff[:6])
        raise ValueError(f"{where}: model config does not match ({details})")
    if state is None:
        return ckpt
    missing = sorted(set(state) - set(ckpt.tensors))
    unexpected = sorted(set(ckpt.tensors) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:5])}")
        raise ValueError(f"{where}: tensor names do not match the model and optimizer ({'; '.join(parts)})")
    for name, live in state.items():
        saved = ckpt.tensors[name]
        if saved.shape != live.shape or saved.dtype != live.dtype:
            raise ValueError(f"{where}: tensor '{name}' is {list(saved.shape)} {saved.dtype} in the "
                             f"file but {list(live.shape)} {live.dtype} in the model")
        if not live.flags.writeable:
            raise ValueError(f"{where}: live array '{name}' is read-only; cannot load into it")
    for name, live in state.items():
        np.copyto(live, ckpt.tensors[name])
    ckpt.tensors = dict(state)
    return ckpt


__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "read_checkpoint"]
