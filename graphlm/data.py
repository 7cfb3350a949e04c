"""Training data: the byte-level tokenizer, the bundled tiny Shakespeare corpus, a 90/10 split,
and a batch sampler whose draws depend only on (seed, step).

Every byte is a token (vocabulary 256), so any text round-trips through `encode`/`decode`.
"""
from __future__ import annotations

import codecs
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .io.files import read_regular
from .random import mix64_array, stream_base

VOCAB_SIZE = 256
TOKEN_DTYPE = np.int64
BUNDLED_CORPUS = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


# -- the tokenizer -------------------------------------------------------------------------------
def encode(text: str | bytes) -> np.ndarray:
    """UTF-8 bytes of `text` as int64 token ids in [0, 256)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPE)


def decode_bytes(ids) -> bytes:
    """Token ids back to raw bytes (each id must be in [0, 256))."""
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"decode: token ids must be integers in [0, {VOCAB_SIZE}), got "
                         f"{arr.dtype} values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes()


def decode(ids) -> str:
    """Token ids to text; byte sequences that are not valid UTF-8 become U+FFFD."""
    return decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Decodes tokens one at a time for streaming output: a multi-byte character is held back
    until its last byte arrives."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(decode_bytes([token]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


# -- corpora -------------------------------------------------------------------------------------
@dataclass
class Corpus:
    """A tokenized text split into train and validation token arrays (90/10 by default).

    `source` is the path as given, `path` the resolved absolute one, `sha256` the hash of the
    bytes read: `identity()` is what a checkpoint records so that a resume can tell whether it
    trains on the same data."""

    train: np.ndarray
    val: np.ndarray
    source: str
    path: str = ""
    sha256: str = ""

    @property
    def size(self) -> int:
        return self.train.size + self.val.size

    def identity(self) -> dict:
        """{"path", "bytes", "sha256"}: which data this is (the hash decides; the path says where)."""
        return {"path": self.path or self.source, "bytes": int(self.size), "sha256": self.sha256}


def same_data(a: dict, b: dict) -> bool:
    """Whether two `Corpus.identity()` records name the same bytes (size and hash)."""
    return a.get("bytes") == b.get("bytes") and a.get("sha256") == b.get("sha256")


def load_corpus(path: str | os.PathLike | None = None, context_length: int = 128,
                val_fraction: float = 0.1) -> Corpus:
    """Read `path` (default: the bundled tiny Shakespeare) and split it: the first 90% of the
    bytes train, the last 10% validate. Both parts must hold at least ``context_length + 1``
    bytes (one window and its next-token targets); otherwise a ValueError names the file."""
    path = Path(path) if path is not None else BUNDLED_CORPUS
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    data = read_regular(path, "data file")   # (FIFOs and devices refused; the read is bounded)
    need = context_length + 1
    if not data:
        raise ValueError(f"data file {path} is empty; it needs at least {need} bytes "
                         f"(context_length {context_length} + 1) for training and as many for validation")
    tokens = np.frombuffer(data, dtype=np.uint8)
    n_val = int(round(len(tokens) * val_fraction))
    n_train = len(tokens) - n_val
    if n_train < need or n_val < need:
        raise ValueError(f"data file {path} is too short: {len(tokens)} bytes split "
                         f"{n_train}/{n_val} (train/validation), but each part needs at least "
                         f"{need} bytes (context_length {context_length} + 1); the file needs at "
                         f"least {int(np.ceil(need / min(val_fraction, 1 - val_fraction)))} bytes")
    return Corpus(tokens[:n_train], tokens[n_train:], str(path), str(path.resolve()),
                  hashlib.sha256(data).hexdigest())


# -- batches -------------------------------------------------------------------------------------
class BatchSampler:
    """Random windows of a token array. Batch `step` depends only on (seed, step): the window
    starts are a counter-based hash of (seed, step, row), so a resumed run draws the same
    batches without replaying earlier ones, and the sampler's only state is the step number."""

    def __init__(self, tokens: np.ndarray, batch_size: int, context_length: int, seed: int = 0):
        if batch_size < 1 or context_length < 1:
            raise ValueError(f"BatchSampler: batch_size and context_length must be >= 1, got "
                             f"{batch_size} and {context_length}")
        if tokens.size < context_length + 1:
            raise ValueError(f"BatchSampler: {tokens.size} tokens cannot fill one window of "
                             f"{context_length} + 1")
        self.tokens = np.ascontiguousarray(tokens, dtype=np.uint8)
        self.batch_size, self.context_length, self.seed = int(batch_size), int(context_length), int(seed)
        self.windows = tokens.size - context_length  # valid start positions
        self._offsets = np.arange(context_length + 1)

    def starts(self, step: int) -> np.ndarray:
        """The window start of each row of batch `step`."""
        base = np.uint64(stream_base(self.seed, int(step)))
        with np.errstate(over="ignore"):
            z = base + np.arange(1, self.batch_size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return (mix64_array(z) % np.uint64(self.windows)).astype(np.int64)

    def batch(self, step: int, part: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each [batch_size, context_length] int64; targets are inputs
        shifted by one token. `part` reads only those rows of the batch (one process's share)."""
        rows = self.tokens[self.starts(step)[part, None] + self._offsets].astype(TOKEN_DTYPE)
        return rows[:, :-1], rows[:, 1:]


def eval_batch_count(tokens: np.ndarray, batch_size: int, context_length: int) -> int:
    """How many batches `eval_batches` makes of the whole of `tokens`."""
    return (tokens.size - 1) // context_length // batch_size


def eval_batches(tokens: np.ndarray, batch_size: int, context_length: int, max_batches: int | None = None):
    """Deterministic evaluation batches: consecutive non-overlapping windows from the start
    (at most `max_batches` batches; the last partial batch is dropped)."""
    n_batches = eval_batch_count(tokens, batch_size, context_length)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    if n_batches == 0:
        raise ValueError(f"eval_batches: {tokens.size} tokens make no full batch of "
                         f"{batch_size} windows of {context_length} + 1")
    span = np.arange(context_length + 1)
    for b in range(n_batches):
        starts = (b * batch_size + np.arange(batch_size)) * context_length
        rows = tokens[starts[:, None] + span].astype(TOKEN_DTYPE)
        yield rows[:, :-1], rows[:, 1:]


__all__ = ["VOCAB_SIZE", "BUNDLED_CORPUS", "encode", "decode", "decode_bytes", "StreamDecoder",
           "Corpus", "load_corpus", "same_data", "BatchSampler", "eval_batch_count", "eval_batches"]
