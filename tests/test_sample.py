"""KV-cache sampling: cached decode equals full recompute (every GPT variant, any block that passes
the cache along, batches), the sliding window past the context, token choice (greedy, temperature
and its limits, top-k, top-p, repetition penalty, token limit), stop strings and stop tokens,
batched samples, and the prompt checks."""
from collections import Counter

import numpy as np
import pytest

import graphlm as gl
from graphlm import executors, nn
from graphlm.models import GPT, GPTConfig
from graphlm.passes import rewrite
from graphlm.passes.transposed_weights import TRANSPOSED_WEIGHTS
from graphlm.random import SplitMix64
from graphlm.sample import (Generator, apply_repetition_penalty, build_graph, choose_token,
                            generate_full_recompute)
from graphlm.tokenizer import ByteTokenizer

EXECUTORS = ["reference"] + (["numpy"] if "numpy" in executors.available_executors() else [])
if "native" in executors.available_executors() and executors.get("native").available():
    EXECUTORS.append("native")
CFG = GPTConfig(vocab_size=32, context_length=8, channels=16, head_count=2, layer_count=2, dropout=0.1)
# the RMSNorm / SwiGLU / tied-head variant, without biases (LLaMA-like)
VARIANT = CFG.replace(norm="rmsnorm", mlp="swiglu", tie_weights=True, lm_head_bias=False,
                      attention_bias=False, mlp_bias=False)


class ParallelBlock(nn.DecoderBlock):
    """A block sample.py has never seen: attention and MLP in parallel on one norm (GPT-J)."""

    def forward(self, x, cache=None):
        h = self.attention_norm(x)
        return x + self.attention(h, cache=cache) + self.mlp(x)


def make_model(kind):
    cfg = VARIANT if kind == "variant" else CFG
    m = GPT(cfg)
    if kind == "parallel":
        m.blocks = nn.ModuleList([ParallelBlock(cfg.channels, cfg.head_count) for _ in range(cfg.layer_count)])
    params = m.init(3)
    params["final_norm.weight"] *= 8   # sharpen the logits so greedy choices are far from ties
    return m, params


MODELS = {kind: make_model(kind) for kind in ("gpt", "variant", "parallel")}


@pytest.fixture(scope="module")
def model():
    return MODELS["gpt"]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("executor", EXECUTORS)
def test_cached_logits_equal_full_forward(kind, executor):
    m, params = MODELS[kind]
    gen = Generator(m, params, batch_size=2, executor=executor)
    seq = np.array([[5, 1, 30, 7, 7, 2, 19, 4], [9, 9, 0, 31, 3, 12, 6, 1]])   # rows must not mix
    full = m.logits(params, seq, executor="reference")
    got = [gen.prefill(seq[:, :3])] + [gen.decode(seq[:, k]) for k in range(3, 8)]
    for k, rows in enumerate(got, start=2):
        np.testing.assert_allclose(rows, full[:, k], rtol=1e-5, atol=2e-5)
    with pytest.raises(ValueError, match="cache is full"):
        gen.decode([1, 1])
    # params are shared, not copied; the caches are the attention modules' own
    assert all(gen.state[k] is v for k, v in params.items())
    assert gen.cache_names == [f"cache.blocks.{i}.attention.{kv}" for i in range(2) for kv in "kv"]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("executor", EXECUTORS)
def test_greedy_equals_full_recompute_within_and_past_context(kind, executor):
    m, params = MODELS[kind]
    prompt = [3, 9, 27]
    gen = Generator(m, params, executor=executor)
    cached = gen.generate(prompt, 14, temperature=0)          # 3 + 14 tokens > T = 8
    full = generate_full_recompute(m, params, prompt, 14, executor="reference")
    assert cached == full
    # within the context only one prefill ran; past it the window slid once per token
    assert gen.prefill_count == 1 + (len(prompt) + 14 - 1 - CFG.context_length)


def test_the_cache_path_is_the_models_forward():
    """The prefill graph is the model's forward with a cache: the same ops as the plain forward
    (plus the cache writes), the head over the last position only; both read the weights of
    their products transposed (the pass transposed_weights)."""
    m, _ = MODELS["variant"]
    g = gl.Graph("plain")
    m.eval()
    forward = rewrite(g, [m(g.input("tokens", (1, 5), np.int64))], TRANSPOSED_WEIGHTS).graph
    prefill, logits, writes = build_graph(m, 1, 5)
    assert not any(n.op == "transpose" and n.inputs[0].op == "param" for n in prefill.nodes)
    plain, cached = (Counter(n.op for n in graph.nodes) for graph in (forward, prefill))
    n = VARIANT.layer_count
    # extra: the caches and their writes (at the constant position 0), the last position's
    # slice before the head and the [B, V] reshape of its logits; nothing missing
    assert cached - plain == Counter({"state": 2 * n, "cache_write": 2 * n, "const": 1, "slice": 1,
                                      "reshape": 1})
    assert not plain - cached and len(writes) == 2 * n and logits.shape == (1, VARIANT.vocab_size)
    with pytest.raises(gl.GraphError, match="cross-attention"):
        h = gl.Graph("x")
        attn = nn.MultiheadAttention(16, 2)
        x = h.input("x", (1, 1, 16))
        attn(x, x, cache=nn.KVCache(h, 4))


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


# -- the limits of temperature, the token limit, the prompt checks ----------------------------------

def test_tiny_and_huge_temperatures_are_their_limits():
    """A temperature float32 cannot divide by is greedy, one past float32's range is uniform;
    no NaN and no RuntimeWarning (pytest turns those into errors) on the way."""
    logits = np.array([1.0, 3.0, 2.0, -1.0, 2.9, -np.inf], np.float32)
    for t in (1e-40, 1e-46, 1e-300):
        assert {choose_token(logits, t, rng=SplitMix64(s)) for s in range(50)} == {1}
    for t in (1e39, 1e300):
        r = SplitMix64(4)
        counts = np.bincount([choose_token(logits, t, rng=r) for _ in range(2000)], minlength=6)
        assert counts[5] == 0 and counts[:5].min() > 300       # uniform over the finite logits
    m, params = MODELS["gpt"]
    gen = Generator(m, params, executor="reference")
    greedy = gen.generate([3, 9], 6, temperature=0)
    assert gen.generate([3, 9], 6, temperature=1e-40, seed=1) == greedy
    assert len(set(gen.generate([3, 9], 40, temperature=1e300, seed=1))) > 10


def test_token_limit_keeps_ids_the_tokenizer_can_decode():
    """A byte-trained model with a larger vocabulary (gpt2-small's 50257) samples bytes only."""
    cfg = CFG.replace(vocab_size=300)
    m = GPT(cfg)
    params = m.init(0)
    gen = Generator(m, params, executor="numpy" if "numpy" in EXECUTORS else "reference")
    free = gen.generate([1, 2], 60, temperature=3.0, seed=0)
    assert max(free) >= 256                                   # without the limit, ids past bytes come
    for kw in ({"token_limit": 256}, {"tokenizer": ByteTokenizer()}):
        out = gen.generate([1, 2], 60, temperature=3.0, seed=0, **kw)
        assert max(out) < 256
    assert max(generate_full_recompute(m, params, [1, 2], 8, temperature=3.0, token_limit=256,
                                       executor="reference")) < 256
    full = m.logits(params, np.array([[1, 2]]), executor="reference")[0, -1]
    assert choose_token(full, 0, token_limit=256) == int(np.argmax(full[:256]))
    with pytest.raises(ValueError, match="token_limit must be in"):
        gen.generate([1], 2, token_limit=301)


@pytest.mark.parametrize("prompt,message", [
    ([1.7, 2.2], "prompt must hold integer token ids, got float64"),
    ([[1, 2], [3, 4]], r"prompt must be a 1-d sequence of token ids, got shape \[2,2\]"),
    ([[1, 2]], r"got shape \[1,2\]"),
    ([[1, 2], [3]], "ragged"),
    ("ROMEO", "got str"),
    ([True, False], "got bool"),
    ([], "prompt is empty"),
])
def test_generate_refuses_what_is_not_a_1d_int_prompt(model, prompt, message):
    m, params = model
    gen = Generator(m, params, executor="reference")
    with pytest.raises(ValueError, match=message):
        gen.generate(prompt, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        gen.generate([1], 2.5)


# -- the repetition penalty against Hugging Face's -----------------------------------------------------

def test_repetition_penalty_is_hugging_faces():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    r = np.random.default_rng(0)
    logits = r.standard_normal((3, 40)).astype(np.float32) * 3
    context = r.integers(0, 40, (3, 12))
    for penalty in (1.3, 0.7):
        hf = transformers.RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(context),
                                                                  torch.from_numpy(logits.copy()))
        ours = np.stack([apply_repetition_penalty(logits[i], context[i], penalty) for i in range(3)])
        np.testing.assert_array_equal(ours, hf.numpy())
        assert not np.array_equal(ours, logits)


def test_repetition_penalty_breaks_a_greedy_loop(model):
    m, params = model
    gen = Generator(m, params, executor="reference")
    plain = gen.generate([3], 30, temperature=0)
    penalised = gen.generate([3], 30, temperature=0, repetition_penalty=2.0)
    assert penalised == generate_full_recompute(m, params, [3], 30, executor="reference",
                                                repetition_penalty=2.0)
    assert len(set(penalised)) > len(set(plain))


# -- stop strings, stop tokens, batches -----------------------------------------------------------------

class Letters:
    """A tokenizer for the 32-id test model: id i is the letter chr(ord('a') + i) (or a symbol)."""
    vocab_size = 32
    name = "letters"
    alphabet = "abcdefghijklmnopqrstuvwxyz .,;!?"

    def encode(self, text):
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)

    def stream(self):
        tok = self

        class S:
            def push(self, i):
                return tok.decode([i])

            def flush(self):
                return ""
        return S()


def test_stop_strings_cut_the_text_and_stop_tokens_end_a_row(model):
    m, params = model
    gen = Generator(m, params, executor="reference")
    tok = Letters()
    (free,) = gen.generate_batch([3, 9], 30, temperature=0, tokenizer=tok)
    assert free.finish_reason == "length" and free.text == tok.decode(free.tokens)
    stop = free.text[5:7]                               # a stop string that occurs in the text
    end = free.text.index(stop) + len(stop)
    pieces = []
    (cut,) = gen.generate_batch([3, 9], 30, temperature=0, tokenizer=tok, stop=["#never", stop],
                                on_text=lambda row, piece: pieces.append(piece))
    assert (cut.text, cut.finish_reason, cut.stop) == (free.text[:end], "stop", stop)
    assert "".join(pieces) == cut.text and cut.tokens == free.tokens[:end]
    first = free.tokens[4]
    (eos,) = gen.generate_batch([3, 9], 30, temperature=0, stop_token_ids=[first])
    assert eos.finish_reason == "stop_token" and eos.tokens == free.tokens[:free.tokens.index(first) + 1]
    with pytest.raises(ValueError, match="need a tokenizer"):
        gen.generate([3], 4, stop=["a"])


@pytest.mark.parametrize("executor", EXECUTORS[:2])
def test_a_batch_of_samples_is_the_samples_of_seed_plus_i(model, executor):
    """Generator(batch_size=3).generate_batch is one batch through the cache; row i is what seed
    + i gives alone, past the context too (the window slides for the whole batch)."""
    m, params = model
    one = Generator(m, params, executor=executor)
    opts = dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.2)
    alone = [one.generate([3, 9, 27], 12, seed=7 + i, **opts) for i in range(3)]
    batch = Generator(m, params, batch_size=3, executor=executor)
    samples = batch.generate_batch([3, 9, 27], 12, seed=7, **opts)
    assert [s.tokens for s in samples] == alone and len({tuple(a) for a in alone}) == 3
    # one prefill for the prompt plus one per slide, one decode per step: not three runs
    assert batch.prefill_count == one.prefill_count // 3 and batch.decode_count == one.decode_count // 3
    with pytest.raises(ValueError, match="use generate_batch"):
        batch.generate([1], 2)


def test_generator_and_cache_arguments_are_checked(model):
    m, params = model
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="Generator: batch_size must be"):
            Generator(m, params, batch_size=bad)
    g = gl.Graph("c")
    with pytest.raises(gl.GraphError, match="position must be a scalar integer tensor"):
        nn.KVCache(g, 8, g.input("p", (2,), np.int64))
    with pytest.raises(gl.ShapeError, match="a decode step takes one token per row, got 2"):
        cache = nn.KVCache(g, 8, g.input("position", (), np.int64))
        m(g.input("tokens", (1, 2), np.int64), cache=cache)
    with pytest.raises(gl.ShapeError, match="a prefill of 9 tokens exceeds the cache's 8 positions"):
        m(g.input("long", (1, 9), np.int64), cache=nn.KVCache(g, 8))
