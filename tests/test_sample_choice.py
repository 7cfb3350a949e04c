"""Token choice pinned to a plain statement of its rules: `choose_tokens` (the whole batch in one
vectorised pass) against `plain_choice` below, one row at a time, on random logits with ties,
signed zeros and infinities, every option, and draws at both ends of [0, 1); `generate_batch`
and `generate` against a plain decode loop that chooses every token with it (rows ending at
different steps on stop tokens, the window sliding past the context); SplitMix64's draws."""
import numpy as np
import pytest

from graphlm import executors
from graphlm.models import GPT, GPTConfig
from graphlm.random import SplitMix64
from graphlm.sample import Generator, choose_tokens

FLOAT32_MAX = float(np.finfo(np.float32).max)
LARGEST_DRAW = 1.0 - 2.0 ** -24          # the largest float32 below 1: SplitMix64.unit()'s largest


def plain_choice(logits, temperature, top_k=None, top_p=None, u=None, *, penalty=1.0, context=(),
                 token_limit=None) -> int:
    """One row's token by graphlm.sample's rules, written out step by step in float32; `u` is
    the row's uniform draw (unused when greedy)."""
    z = np.array(logits, np.float32)[:token_limit]
    for i in set(context):                               # the repetition penalty
        if penalty != 1.0 and 0 <= i < len(z):
            z[i] = z[i] * np.float32(penalty) if z[i] < 0 else z[i] / np.float32(penalty)
    if np.isnan(z).any():
        raise ValueError("the logits hold NaN")
    top = z.max()
    if top == -np.inf:
        raise ValueError("every allowed logit is -inf")
    if top == np.inf:                                    # the +inf logits share all the mass
        z = np.where(z == np.inf, np.float32(0), np.float32(-np.inf))
        top = np.float32(0)
    t = np.float32(temperature) if temperature <= FLOAT32_MAX else np.float32(np.inf)
    if t == 0:
        return int(np.argmax(z))
    if t == np.inf:
        z = np.where(z > -np.inf, np.float32(0), np.float32(-np.inf))
    else:
        with np.errstate(over="ignore"):
            z = (z - top) / t
    order = np.argsort(-z, kind="stable")               # largest first, ties by id
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order])
    nonzero = np.count_nonzero(p)
    p = p / p.sum()
    if top_p is not None and top_p < 1.0:
        nonzero = min(nonzero, np.count_nonzero(np.cumsum(p) < np.float32(top_p)) + 1)
        p[nonzero:] = 0
        p = p / p.sum()
    return int(order[min(np.count_nonzero(np.cumsum(p) <= np.float32(u)), nonzero - 1)])


class Draw:
    """An rng that always draws `u`."""

    def __init__(self, u):
        self.u = u

    def unit(self):
        return self.u


def random_logits(rng, b, v):
    z = (rng.standard_normal((b, v)) * rng.choice([0.01, 1.0, 8.0, 60.0, 1e30])).astype(np.float32)
    if rng.random() < 0.4:
        z = np.round(z * 2) / 2                          # ties
    for value, share in ((-np.inf, 0.3), (np.inf, 0.05), (-0.0, 0.2), (0.0, 0.1)):
        if rng.random() < 0.25:
            z[rng.random((b, v)) < share] = value
    return z


OPTIONS = [dict(temperature=t, top_k=k, top_p=p) for t in (1e-40, 0.05, 0.8, 1.0, 4.0, 1e39)
           for k in (None, 1, 3, 40) for p in (None, 0.5, 0.95)]


@pytest.mark.parametrize("seed", range(4))
def test_choose_tokens_is_the_plain_rules_row_by_row(seed):
    rng = np.random.default_rng(seed)
    for options in OPTIONS:
        b, v = int(rng.choice([1, 3, 8])), int(rng.choice([2, 7, 64, 300]))
        z = random_logits(rng, b, v)
        z[z[:, 0] == -np.inf, 0] = 0.0                   # (a row of -inf is an error, tested below)
        context = rng.integers(0, v, (b, 5))
        seen = np.zeros((b, v), bool)
        np.put_along_axis(seen, context, True, axis=1)
        extra = dict(repetition_penalty=1.3, seen=seen, token_limit=max(1, v - 1)) if rng.random() < 0.5 else {}
        draws = [[float(rng.random(dtype=np.float32)) for _ in range(b)],
                 [LARGEST_DRAW] * b, [0.0] * b]          # rounding can leave the largest past the sum
        for us in draws:
            got = choose_tokens(z, rngs=[Draw(u) for u in us], **options, **extra).tolist()
            want = [plain_choice(z[i], **options, u=us[i], penalty=extra.get("repetition_penalty", 1.0),
                                 context=context[i], token_limit=extra.get("token_limit")) for i in range(b)]
            assert got == want, (options, extra, us)
        streams = [SplitMix64(seed * 100 + i) for i in range(b)]
        got = choose_tokens(z, rngs=streams, **options, **extra).tolist()
        again = [SplitMix64(seed * 100 + i) for i in range(b)]
        want = [plain_choice(z[i], **options, u=again[i].unit(), penalty=extra.get("repetition_penalty", 1.0),
                             context=context[i], token_limit=extra.get("token_limit")) for i in range(b)]
        assert got == want and [s.state for s in streams] == [s.state for s in again]


def test_greedy_draws_nothing_and_bad_logits_are_named():
    z = np.array([[1.0, 3.0, 3.0], [-np.inf, 2.0, np.inf]], np.float32)
    streams = [SplitMix64(1), SplitMix64(2)]
    assert choose_tokens(z, 0.0, rngs=streams).tolist() == [1, 2]
    assert [s.state for s in streams] == [1, 2]
    for bad, message in (([[0.0, np.nan]], "hold NaN"), ([[-np.inf, -np.inf]], "every allowed logit is -inf"),
                         ([[0.0, 1.0]], "needs an rng per row")):
        with pytest.raises(ValueError, match=message):
            choose_tokens(np.array(bad, np.float32), 1.0, rngs=None if "rng" in message else [SplitMix64(0)])
    before = z.copy()
    choose_tokens(z, 0.7, 2, 0.9, [SplitMix64(3), SplitMix64(4)], repetition_penalty=2.0,
                  seen=np.ones((2, 3), bool))
    assert z.tobytes() == before.tobytes()               # the caller's logits are not written


# -- generate and generate_batch against a plain decode loop ------------------------------------------

CFG = GPTConfig(vocab_size=32, context_length=8, channels=16, head_count=2, layer_count=2)
EXECUTORS = [e for e in ("numpy", "native") if e in executors.available_executors()
             and getattr(executors.get(e), "available", lambda: True)()]


@pytest.fixture(scope="module")
def model():
    m = GPT(CFG)
    return m, m.init(5)


def plain_generate(gen, prompt, n, seed, temperature, top_k=None, top_p=None, repetition_penalty=1.0,
                   stop_token_ids=(), token_limit=None):
    """One row, token by token: prefill, choose with plain_choice, decode (or slide the window:
    re-encode the last keep + 1 tokens) until n tokens or a stop token."""
    rng, context, out = SplitMix64(seed), list(prompt), []
    logits = gen.prefill(np.array([context[-gen.context_length:]]))[0]
    while True:
        token = plain_choice(logits, temperature, top_k, top_p, rng.unit(), penalty=repetition_penalty,
                             context=context, token_limit=token_limit)
        context.append(token)
        out.append(token)
        if len(out) == n or token in stop_token_ids:
            return out
        if gen.length < gen.context_length:
            logits = gen.decode(np.array([token]))[0]
        else:
            logits = gen.prefill(np.array([context[-(gen.keep + 1):]]))[0]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("options", [dict(temperature=0.8, top_k=20), dict(temperature=1.2, top_p=0.9),
                                     dict(temperature=0.9, top_k=10, repetition_penalty=1.3, token_limit=30)])
def test_generate_batch_rows_are_the_plain_loops_tokens(model, executor, options):
    m, params = model
    one, batch = Generator(m, params, executor=executor), Generator(m, params, batch_size=5, executor=executor)
    prompt, n, seed = [3, 9, 27], 14, 40
    free = [s.tokens for s in batch.generate_batch(prompt, n, seed=seed, **options)]
    assert free == [plain_generate(one, prompt, n, seed + i, **options) for i in range(5)]
    stop = [free[0][2], free[1][6]]                      # rows then end at different steps
    rows = batch.generate_batch(prompt, n, seed=seed, stop_token_ids=stop, **options)
    want = [plain_generate(one, prompt, n, seed + i, stop_token_ids=stop, **options) for i in range(5)]
    assert [s.tokens for s in rows] == want
    assert len({len(t) for t in want}) > 1 and "stop_token" in {s.finish_reason for s in rows}
    assert one.generate(prompt, n, seed=seed + 2, stop_token_ids=stop, **options) == want[2]


def test_splitmix64_draws_are_the_reference_streams():
    """splitmix64's published first output for seed 0 (Vigna's reference code), and unit() as
    the float32 of the top 24 bits over 2**24, as the vectorised draws give it."""
    r = SplitMix64(0)
    assert r.next_u64() == 0xE220A8397B1DCDAF
    for seed in (0, 7, 2**64 - 1):
        a, b = SplitMix64(seed), SplitMix64(seed)
        draws = [a.unit() for _ in range(2000)]
        assert draws == b.unit_array(2000).tolist()
        assert all(np.float32(u) == u and 0.0 <= u < 1.0 for u in draws) and a.state == b.state
