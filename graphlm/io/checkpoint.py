"""Training checkpoints in safetensors: tensors (params, optimizer moments) plus JSON metadata
(step, RNG and data-sampler position, model config, training options, and an `extra` record
such as the loss history). No pickle.

Writes are atomic: the bytes go to a temporary file in the same folder, which is flushed and
fsynced and then renamed over the old file, so a crash mid-write leaves the old checkpoint (and a
``.NAME.tmp-PID`` file that the next save into that folder removes once PID is dead). A tensor
holding NaN or inf is never written: saving it is a ValueError and the old file stays.

Loads are validators: the file must be a regular file (FIFOs and devices are refused before any
read); reads are bounded by its size and the header by `MAX_HEADER_BYTES`; the header must
declare exactly the bytes that follow it; the metadata is checked against the schema below
(types, ranges, nesting depth) before anything uses it; then checksum over tensors and metadata,
names, shapes, dtypes, finite values and config, all before any live array is touched. Any
problem is one ValueError naming the file and the field or tensor at fault.

Metadata schema (safetensors ``__metadata__``, every value a string): ``format`` and
``version``; ``step`` a decimal integer in [0, 2**53]; ``config``, ``options``, ``rng``,
``sampler`` and ``extra`` JSON objects nested at most `MAX_JSON_DEPTH` deep; ``checksum``.
What the fields mean for a training run (options, history, data identity) is checked by
graphlm.train.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping

import numpy as np

from .files import read_regular
from .runfolder import remove_dead_temporaries

FORMAT = "graphlm-checkpoint"
VERSION = 1
_ALLOWED_DTYPES = {np.dtype(t) for t in ("float32", "float64", "float16", "int64", "int32", "uint8")}
MAX_HEADER_BYTES = 64 << 20   # the safetensors header (tensor table + metadata JSON)
MAX_JSON_DEPTH = 16           # nesting of a metadata section
MAX_STEP = 1 << 53
SECTIONS = ("config", "options", "rng", "sampler", "extra")


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


def _non_finite(obj, where: str = "") -> str | None:
    """The path of the first non-finite float in a JSON-like value, or None."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return where or "(the value)"
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        bad = _non_finite(v, f"{where}.{k}" if where else str(k))
        if bad:
            return bad
    return None


def _json_depth(obj) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit to hit)."""
    depth, todo = 0, [(obj, 1)]
    while todo:
        value, d = todo.pop()
        if isinstance(value, (dict, list)):
            depth = max(depth, d)
            if d <= MAX_JSON_DEPTH:
                todo.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return depth


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
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ValueError(f"checkpoint {path}: not written: tensor '{name}' holds NaN or inf "
                             "values (the previous file, if any, is kept)")
        arrays[name] = np.ascontiguousarray(a)
    sections = {"config": config, "options": options, "rng": rng, "sampler": sampler, "extra": extra}
    for key, value in sections.items():
        bad = _non_finite(dict(value or {}))
        if bad:
            raise ValueError(f"checkpoint {path}: not written: metadata field {key}.{bad} is NaN or "
                             "infinite")
    try:
        meta = {"format": FORMAT, "version": str(VERSION), "step": str(int(step)),
                **{k: _canonical(dict(v or {})) for k, v in sections.items()}}
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: metadata is not plain JSON ({e})") from None
    meta["checksum"] = _digest(meta, arrays)
    payload = safetensors.numpy.save(arrays, metadata=meta)

    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path.parent, f".{path.name}.tmp-")
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
    raw = read_regular(path, "checkpoint")
    if len(raw) < 8:
        raise ValueError(f"{where}: truncated ({len(raw)} bytes; not even a safetensors header length)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > len(raw) - 8:
        raise ValueError(f"{where}: truncated or corrupted (the header claims {header_len} bytes, "
                         f"the file has {len(raw) - 8} after the length)")
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"{where}: header of {header_len:,} bytes, more than the "
                         f"{MAX_HEADER_BYTES:,} a checkpoint may have")
    try:
        header = json.loads(raw[8:8 + header_len].decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        meta = header.get("__metadata__")
        if not isinstance(meta, dict):
            raise ValueError("no metadata")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{where}: corrupted header ({e})") from None
    _check_tensor_table(where, header, len(raw) - 8 - header_len)
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
    step, parsed = _parse_metadata(where, meta)
    for name, a in tensors.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ValueError(f"{where}: tensor '{name}' holds NaN or inf values")
    return Checkpoint(dict(tensors), step, parsed["config"], parsed["options"], parsed["rng"],
                      parsed["sampler"], parsed["extra"], str(path))


def _check_tensor_table(where: str, header: dict, data_bytes: int) -> None:
    """The header's tensor entries must tile exactly the `data_bytes` after it."""
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                or offsets[0] > offsets[1]):
            raise ValueError(f"{where}: corrupted header: tensor '{name}' has no valid data_offsets")
        end = max(end, offsets[1])
    if end != data_bytes:
        raise ValueError(f"{where}: truncated or corrupted: the header declares {end:,} bytes of "
                         f"tensor data, the file holds {data_bytes:,}")


def _parse_metadata(where: str, meta: Mapping[str, Any]) -> tuple[int, dict]:
    """(step, {section: parsed JSON object}) after the schema checks of the module docstring."""
    for key, value in meta.items():
        if not isinstance(value, str):
            raise ValueError(f"{where}: metadata field '{key}' must be a string, got "
                             f"{type(value).__name__}")
    for key in ("step", "checksum", *SECTIONS):
        if key not in meta:
            raise ValueError(f"{where}: metadata field '{key}' is missing")
    text = meta["step"]
    if not (text.isascii() and text.isdigit()) or len(text) > 20 or int(text) > MAX_STEP:
        raise ValueError(f"{where}: metadata field 'step' must be an integer in [0, {MAX_STEP}], "
                         f"got {text[:40]!r}")
    parsed = {}
    for key in SECTIONS:
        try:
            value = json.loads(meta[key])
        except RecursionError:
            raise ValueError(f"{where}: metadata field '{key}' is nested deeper than "
                             f"{MAX_JSON_DEPTH} levels") from None
        except ValueError as e:
            raise ValueError(f"{where}: metadata field '{key}' is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: metadata field '{key}' must be a JSON object, got "
                             f"{type(value).__name__}")
        if _json_depth(value) > MAX_JSON_DEPTH:
            raise ValueError(f"{where}: metadata field '{key}' is nested deeper than "
                             f"{MAX_JSON_DEPTH} levels")
        parsed[key] = value
    return int(text), parsed


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Make `dst` hold the same bytes as the checkpoint `src`, atomically (a hard link renamed
    into place, or a copy where links are not possible)."""
    src, dst = Path(src), Path(dst)
    remove_dead_temporaries(dst.parent, f".{dst.name}.tmp-")
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


def load_checkpoint(path: str | os.PathLike, state: MutableMapping[str, np.ndarray] | None = None,
                    *, config: Mapping[str, Any] | None = None,
                    upgrade_config: Callable[[dict], dict] | None = None,
                    read: Checkpoint | None = None) -> Checkpoint:
    """Read and verify `path`; with `state`, copy the tensors into its arrays in place.
    `read`: the `read_checkpoint(path)` the caller already has (the file is not read again).

    Everything is checked before any array of `state` changes: the file's tensor names must
    be exactly `state`'s, with the same shapes and dtypes; with `config`, the saved model
    config must equal it, after `upgrade_config` (e.g. ``GPTConfig.upgrade_dict``, which fills
    fields added since the file was written) has been applied to the saved one. On any problem a
    ValueError names the file and `state` is untouched.
    """
    ckpt = read if read is not None else read_checkpoint(path)
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


__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "read_checkpoint", "copy_checkpoint"]
