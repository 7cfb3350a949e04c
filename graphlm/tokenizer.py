"""Tokenizers for sampling: bytes (what `graphlm train` trains on) and Hugging Face tokenizer files.

A tokenizer here has ``vocab_size`` (the ids it can decode are ``0 .. vocab_size - 1``),
``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``stream()``, an incremental decoder
whose ``push(id) -> str`` returns the text that id completes (a character split over several
tokens is held back until it is whole) and whose ``flush() -> str`` returns what is left.

    tok = HFTokenizer.from_dir("gpt2/")      # tokenizer.json, or GPT-2's vocab.json + merges.txt
    ids = tok.encode("Hello")

`HFTokenizer` needs Hugging Face's `tokenizers` package (``pip install tokenizers``).
"""
from __future__ import annotations

import os

from . import data


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (graphlm.data's tokenizer)."""

    vocab_size = data.VOCAB_SIZE
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return data.encode(text).tolist()

    def decode(self, ids) -> str:
        return data.decode(ids)

    def stream(self) -> data.StreamDecoder:
        return data.StreamDecoder()


TOKENIZER_FILE = "tokenizer.json"
GPT2_FILES = ("vocab.json", "merges.txt")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`: ids without added special tokens on encode;
    special tokens (GPT-2's ``<|endoftext|>``) are skipped on decode."""

    def __init__(self, tokenizer, name: str = "tokenizers"):
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "HFTokenizer":
        """The tokenizer of a Hugging Face model directory: ``tokenizer.json`` if present, else
        GPT-2's byte-level BPE files ``vocab.json`` + ``merges.txt``. A missing or unreadable
        file raises ValueError naming it."""
        try:
            import tokenizers
        except ImportError:
            raise ValueError("reading a Hugging Face tokenizer needs the `tokenizers` package "
                             "(python -m pip install tokenizers)") from None
        directory = os.fspath(directory)
        path = os.path.join(directory, TOKENIZER_FILE)
        vocab, merges = (os.path.join(directory, f) for f in GPT2_FILES)
        try:
            if os.path.isfile(path):
                return cls(tokenizers.Tokenizer.from_file(path), path)
            if os.path.isfile(vocab) and os.path.isfile(merges):
                path = f"{vocab} + {merges}"
                tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(vocab, merges))
                tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
                tok.decoder = tokenizers.decoders.ByteLevel()
                return cls(tok, path)
        except Exception as e:  # tokenizers raises plain Exception subclasses for bad files
            raise ValueError(f"{path}: not a readable tokenizer ({e})") from None
        raise ValueError(f"{directory}: no tokenizer found (expected {TOKENIZER_FILE}, or "
                         f"{' + '.join(GPT2_FILES)} as GPT-2 has them)")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def stream(self) -> "HFStreamDecoder":
        return HFStreamDecoder(self)


class HFStreamDecoder:
    """Incremental decoding with `tokenizers.decoders.DecodeStream`, which returns None while
    the bytes of a character are incomplete; `flush` decodes what is still held back."""

    def __init__(self, tok: HFTokenizer):
        from tokenizers.decoders import DecodeStream
        self._tok, self._ids, self._emitted = tok, [], ""
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        piece = self._stream.step(self._tok.tokenizer, int(token)) or ""
        self._emitted += piece
        return piece

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        rest = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted += rest
        return rest


__all__ = ["ByteTokenizer", "HFTokenizer", "HFStreamDecoder"]
