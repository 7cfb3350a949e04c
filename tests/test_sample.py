"""KV-cache sampling: cached decode equals full recompute, the sliding window past the context,
token choice (greedy, temperature, top-k, top-p) and its determinism."""
import numpy as np
import pytest

import graphlm as gl
from graphlm import executors
from graphlm.models import GPT, GPTConfig
from graphlm.random import SplitMix64
from graphlm.sample import Generator, choose_token, generate_full_recompute

EXECUTORS = ["reference"] + (["numpy"] if "numpy" in executors.available_executors() else [])
if "native" in executors.available_executors() and executors.get("native").available():
    EXECUTORS.append("native")
CFG = GPTConfig(vocab_size=32, context_length=8, channels=16, head_count=2, layer_count=2, dropout=0.1)


@pytest.fixture(scope="module")
def model():
    m = GPT(CFG)
    params = m.init(3)
    # sharpen the logits so greedy choices are far from ties
    params["language_model_head.weight"] *= 8
    return m, params


@pytest.mark.parametrize("executor", EXECUTORS)
def test_cached_logits_equal_full_forward(model, executor):
    m, params = model
    gen = Generator(m, params, executor=executor)
    seq = np.array([[5, 1, 30, 7, 7, 2, 19, 4]])
    full = m.logits(params, seq, executor="reference")[0]
    got = [gen.prefill(seq[:, :3])[0]] + [gen.decode(seq[:, k])[0] for k in range(3, 8)]
    for k, row in enumerate(got, start=2):
        np.testing.assert_allclose(row, full[k], rtol=1e-5, atol=2e-5)
    with pytest.raises(ValueError, match="cache is full"):
        gen.decode([1])
    # params are shared, not copied
    assert all(gen.state[k] is v for k, v in params.items())


@pytest.mark.parametrize("executor", EXECUTORS)
def test_greedy_equals_full_recompute_within_and_past_context(model, executor):
    m, params = model
    prompt = [3, 9, 27]
    gen = Generator(m, params, executor=executor)
    cached = gen.generate(prompt, 14, temperature=0)          # 3 + 14 tokens > T = 8
    full = generate_full_recompute(m, params, prompt, 14, executor="reference")
    assert cached == full
    # within the context only one prefill ran; past it the window slid once per token
    assert gen.prefill_count == 1 + (len(prompt) + 14 - 1 - CFG.context_length)


def test_short_keep_window_and_long_prompt(model):
    m, params = model
    gen = Generator(m, params, executor="reference", keep=3)
    out = gen.generate(list(range(20)), 12, temperature=0)   # prompt longer than T: cropped
    assert len(out) == 12 and all(0 <= t < 32 for t in out)
    # the prompt fills the cache (prefill 1); each time it is full again the last 4 tokens are
    # re-encoded (after new tokens 1, 6 and 11) and decoding resumes at position 4
    assert gen.prefill_count == 4
    with pytest.raises(ValueError, match="keep"):
        Generator(m, params, executor="reference", keep=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([40], 2)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([], 2)


def test_position_past_table_is_an_error_not_a_read(model):
    m, params = model
    g, logits, writes = __import__("graphlm.sample", fromlist=["build_graph"]).build_graph(m, 1, None)
    prog = executors.compile(g, [logits] + writes)
    state = dict(Generator(m, params, executor="reference").state)
    with pytest.raises(ValueError, match="out of range"):
        prog.run({"tokens": np.array([[1]]), "position": np.asarray(8, np.int64)}, state)


def test_choose_token_rules():
    logits = np.array([1.0, 3.0, 2.0, -1.0, 2.9], np.float32)
    assert choose_token(logits, temperature=0) == 1
    draws = lambda **kw: [choose_token(logits, rng=rng, **kw) for rng in [SplitMix64(7)] for _ in range(400)]
    assert set(draws(temperature=1.0, top_k=1)) == {1}
    assert set(draws(temperature=1.0, top_k=2)) == {1, 4}
    assert set(draws(temperature=1.0, top_k=0)) == {0, 1, 2, 3, 4}
    # top_p: p = softmax -> [0.05, 0.38, 0.14, 0.02, 0.35]: 0.5 keeps {1, 4}, 0.8 adds 2
    assert set(draws(temperature=1.0, top_p=0.5)) == {1, 4}
    assert set(draws(temperature=1.0, top_p=0.8)) == {1, 2, 4}
    # a tiny temperature is (nearly) greedy; a large one flattens the distribution
    assert set(draws(temperature=0.01)) == {1}
    counts = np.bincount(draws(temperature=100.0), minlength=5)
    assert counts.min() > 40
    # frequencies follow softmax at temperature 1
    freq = np.bincount([choose_token(logits, rng=r) for r in [SplitMix64(1)] for _ in range(4000)],
                       minlength=5) / 4000
    p = np.exp(logits - logits.max()); p /= p.sum()
    assert np.abs(freq - p).max() < 0.03
    with pytest.raises(ValueError, match="needs an rng"):
        choose_token(logits, temperature=1.0)


def test_sampling_is_deterministic_per_seed(model):
    m, params = model
    gen = Generator(m, params, executor="reference")
    a = gen.generate([1, 2], 10, temperature=1.0, top_k=10, top_p=0.9, seed=5)
    b = gen.generate([1, 2], 10, temperature=1.0, top_k=10, top_p=0.9, seed=5)
    c = gen.generate([1, 2], 10, temperature=1.0, top_k=10, top_p=0.9, seed=6)
    assert a == b and a != c
    with pytest.raises(ValueError, match="temperature"):
        gen.generate([1], 3, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate([1], 3, top_p=0.0)
