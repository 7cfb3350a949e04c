"""Byte tokenizer, bundled corpus and split, (seed, step)-determined batch sampler."""
import numpy as np
import pytest

from graphlm import data


@pytest.mark.parametrize("text", ["", "hello", "Ünïcödé ✓ 日本語 🎭\n\t\x00", "ROMEO:\nBut soft!"])
def test_encode_decode_round_trip(text):
    ids = data.encode(text)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.size == len(text.encode("utf-8"))
    assert (ids >= 0).all() and (ids < 256).all()
    assert data.decode(ids) == text


def test_every_byte_is_a_token_and_streaming_matches_whole_decode():
    every = np.arange(256)
    assert data.decode_bytes(every) == bytes(range(256))
    text = "a✓b🎭c"
    dec = data.StreamDecoder()
    pieces = [dec.push(int(t)) for t in data.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    assert pieces[1] == "" and pieces[2] == ""          # a 3-byte character is held back ...
    assert pieces[3] == "✓"                              # ... until its last byte
    bad = data.StreamDecoder()
    assert bad.push(0xFF) == "\ufffd"                   # invalid UTF-8 never raises
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        data.decode([1, 300])


def test_bundled_corpus_and_split():
    c = data.load_corpus()
    raw = data.BUNDLED_CORPUS.read_bytes()
    assert c.size == len(raw) > 1_000_000
    assert c.val.size == round(len(raw) * 0.1)
    assert c.train.tobytes() + c.val.tobytes() == raw
    assert raw.startswith(b"First Citizen:")


def test_sampler_depends_only_on_seed_and_step():
    tokens = np.frombuffer(bytes(range(256)) * 40, np.uint8)
    s = data.BatchSampler(tokens, batch_size=5, context_length=16, seed=7)
    forward = [s.batch(k) for k in range(6)]
    again = data.BatchSampler(tokens, batch_size=5, context_length=16, seed=7)
    for k in reversed(range(6)):               # any order, a fresh sampler: the same batches
        x, y = again.batch(k)
        assert np.array_equal(x, forward[k][0]) and np.array_equal(y, forward[k][1])
    x, y = forward[0]
    assert x.shape == y.shape == (5, 16) and x.dtype == np.int64
    assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    starts = s.starts(0)
    assert np.array_equal(x[:, 0], tokens[starts])
    assert not np.array_equal(s.starts(0), s.starts(1))
    other = data.BatchSampler(tokens, batch_size=5, context_length=16, seed=8)
    assert not np.array_equal(other.starts(0), s.starts(0))
    # starts cover the valid range and stay in it
    all_starts = np.concatenate([s.starts(k) for k in range(400)])
    assert all_starts.min() >= 0 and all_starts.max() <= tokens.size - 17
    small = data.BatchSampler(tokens[:116], batch_size=5, context_length=16, seed=7)
    hits = np.bincount(np.concatenate([small.starts(k) for k in range(400)]), minlength=100)
    assert hits.size == 100 and hits.min() > 0 and hits.max() < 50  # every start, roughly uniform


def test_eval_batches_are_consecutive_windows():
    tokens = np.arange(100, dtype=np.uint8)
    batches = list(data.eval_batches(tokens, batch_size=2, context_length=10))
    assert len(batches) == 4
    x, y = batches[1]
    assert x[0, 0] == 20 and x[1, 0] == 30 and y[1, -1] == 40
    assert len(list(data.eval_batches(tokens, 2, 10, max_batches=2))) == 2


def test_bad_data_files_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        data.load_corpus(empty, context_length=8)
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 50)
    with pytest.raises(ValueError, match=r"short\.txt is too short.*context_length 8"):
        data.load_corpus(short, context_length=8)
    ok = tmp_path / "ok.txt"
    ok.write_bytes(b"y" * 90)
    assert data.load_corpus(ok, context_length=8).val.size == 9
    with pytest.raises(ValueError, match="no such file"):
        data.load_corpus(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="is a directory"):
        data.load_corpus(tmp_path)
