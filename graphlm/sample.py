"""Sampling from a GPT with a KV cache held in `state`.

Two static-shape programs share one state (the model's params, the key and value caches of
every attention module, ``cache.<module>.{k,v}`` of shape ``[B, H, T, D]``, and the weights in
the layout the executor reads best, taken once: ``W.T``, the transpose of each weight a product
reads transposed (graphlm/passes/transposed_weights.py), or on the native executor ``W.panels``,
each product's weight in column panels (graphlm/passes/panel_weights.py); so a Generator
samples the weights it was given). Both are the model's own forward, called with an
`nn.KVCache` that each attention module reads and writes
(`MultiheadAttention.attend_cached`), so any model whose blocks pass the cache along samples
with it (every `GPTConfig` variant does):

- *prefill* (one program per prompt length L): the forward over ``[B, L]`` tokens at positions
  ``0..L-1``; writes keys and values of every position into the caches and returns the logits of
  the last position (``logits_to_keep=1``);
- *decode*: one token ``[B, 1]`` at a fed position ``pos``; its query attends to the cached keys
  at positions ``< pos`` and to its own key; the caches are updated in place at ``pos`` by
  `cache_write` update nodes, which run last.

Past the context (a sequence of more than T = context_length tokens), the window slides: when
the cache is full, the last `keep` tokens (default T - 1) plus the new one are re-encoded by a
prefill at positions ``0..keep``. With the default every token is conditioned on exactly the
last T tokens, as a full forward over the cropped window ``tokens[-T:]`` would; no position
beyond the table is ever read. A prompt longer than T is cropped to its last T tokens.

A batch of B samples of one prompt is one batch through both programs (`generate_batch`):
row i draws from its own SplitMix64 stream seeded ``seed + i``, so it is the sample that
``seed + i`` gives alone.

Token choice (`choose_token`), in Hugging Face's order: ids at or past `token_limit` are never
chosen (a tokenizer smaller than the vocabulary: bytes for a 50257-row model); the repetition
penalty divides the positive logits and multiplies the negative ones of ids already in the
context; temperature 0 is greedy (argmax); otherwise the logits are divided by the temperature,
restricted to the `top_k` largest and to the smallest set whose probability reaches `top_p`, and
one token is drawn. A temperature too small for float32 is greedy, one too large is uniform:
the limits, never NaN.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from . import ops
from .backends import get_executor
from .ir import Graph, Tensor, fmt_shape
from .nn import KVCache
from .passes.rewrite import rewrite
from .passes.panel_weights import panel_params
from .passes.transposed_weights import TRANSPOSED_WEIGHTS, transposed_params
from .random import SplitMix64

CACHE_PREFIX = "cache"
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# ================================================================================================
# graphs
# ================================================================================================

def build_graph(model, batch_size: int, length: int | None,
                weights_pass=TRANSPOSED_WEIGHTS) -> tuple[Graph, Tensor, list[Tensor]]:
    """The prefill graph (length L) or, with length None, the decode graph. Returns
    (graph, logits [B, V], cache-write nodes). Inputs: ``tokens`` [B, L or 1] and, for decode,
    ``position`` (int64 scalar); params: the model's, its weights in the layout `weights_pass`
    gives them (default: a weight read transposed as ``W.T``; `fixed_weight_params` makes them).
    The model is built in eval mode (no dropout); its modes are restored afterwards."""
    modes = [(m, m.training) for _, m in model.named_modules()]
    model.eval()
    try:
        g = Graph("gpt_decode" if length is None else f"gpt_prefill_{length}")
        tokens = g.input("tokens", (batch_size, 1 if length is None else length), np.int64)
        position = g.input("position", (), np.int64) if length is None else None
        cache = KVCache(g, model.config.context_length, position, prefix=CACHE_PREFIX)
        logits = model(tokens, cache=cache, logits_to_keep=1)              # [B, 1, V]
        outputs = [ops.reshape(logits, (batch_size, logits.shape[-1]))] + cache.writes
        done = rewrite(g, outputs, weights_pass)
        return done.graph, done.outputs[0], done.outputs[1:]
    finally:
        for m, mode in modes:
            object.__setattr__(m, "training", mode)


def fixed_weight_params(graph: Graph, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of the weight params a `build_graph` graph reads that `params` lacks (``W.T``,
    ``W.panels``), each taken from its W in `params`."""
    return {**transposed_params(graph, params), **panel_params(graph, params)}


# ================================================================================================
# choosing tokens
# ================================================================================================

def check_sampling_options(temperature: float, top_k: int | None, top_p: float | None,
                           repetition_penalty: float = 1.0) -> None:
    """ValueError naming the first option out of range."""
    def number(x):
        return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

    if not (number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if top_p is not None and not (number(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not (number(repetition_penalty) and math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {repetition_penalty!r}")


def apply_repetition_penalty(logits: np.ndarray, seen, penalty: float) -> np.ndarray:
    """Hugging Face's repetition penalty (Keskar et al. 2019): for every id in `seen` (ids
    already in the context; repeats count once), a positive logit is divided by `penalty` and a
    negative one multiplied by it. Returns a new array; ids outside `logits` are ignored."""
    z = np.array(logits, dtype=np.float32).reshape(1, -1)
    return _penalise(z, _seen_mask(seen, z.shape[1]), penalty).reshape(np.shape(logits))


def _seen_mask(ids, width: int) -> np.ndarray:
    """[1, width] bool: True at the ids in `ids` that are in [0, width)."""
    mask = np.zeros((1, width), bool)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    mask[0, ids[(ids >= 0) & (ids < width)]] = True
    return mask


def _penalise(z: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    return np.where(seen, np.where(z < 0, z * np.float32(penalty), z / np.float32(penalty)), z)


def _nonfinite_rows(z: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(z, top) for logits z [B, V] some of whose row maxima `top` [B, 1] are not finite: NaN
    and a row of -inf are errors; the +inf logits of a row share all its mass (they become 0,
    the others -inf)."""
    if np.isnan(top).any():
        raise ValueError("choose_token: the logits hold NaN (is the model diverged?)")
    if (top == -np.inf).any():
        raise ValueError("choose_token: every allowed logit is -inf")
    infinite = top == np.inf
    z = np.where(infinite, np.where(z == np.inf, np.float32(0), np.float32(-np.inf)), z)
    return z, np.where(infinite, np.float32(0), top)


def choose_token(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, rng: SplitMix64 | None = None, *,
                 repetition_penalty: float = 1.0, seen=None, token_limit: int | None = None) -> int:
    """One token id from logits [V] (the module docstring gives the order of the rules).

    `seen`: ids already in the context, for the repetition penalty. `token_limit`: only ids
    below it are chosen. A draw needs `rng` (temperature > 0). The one-row case of
    `choose_tokens`."""
    z = np.asarray(logits, dtype=np.float32).reshape(1, -1)
    mask = None
    if repetition_penalty != 1.0 and seen is not None:
        mask = _seen_mask(seen, z.shape[1])
    return int(choose_tokens(z, temperature, top_k, top_p, None if rng is None else [rng],
                             repetition_penalty=repetition_penalty, seen=mask,
                             token_limit=token_limit)[0])


def descending_order(z: np.ndarray) -> np.ndarray:
    """Per row of z [B, V] (no NaN), its indices from the largest value to the smallest, ties in
    index order: exactly ``np.argsort(-z, axis=1, kind="stable")``, by `_sorted_keys` (the
    value's order-preserving bits, flipped so the largest comes first)."""
    if z.shape[0] == 1 or z.shape[1] >= 1 << 31:
        return np.argsort(-z, axis=1, kind="stable")
    bits = (-z + np.float32(0)).view(np.int32)                      # (+ 0: -0.0 ties with 0.0)
    key = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)               # float order as integer order
    return _sorted_keys(key)[:, 1 - _HIGH::2].astype(np.intp)


_HIGH = 1 if sys.byteorder == "little" else 0   # the int32 word that is an int64's high half


def _sorted_keys(key: np.ndarray) -> np.ndarray:
    """Per row of key [B, V] (4-byte values, int32 or float32 read as its int32 bits; V < 2**31),
    its keys in ascending order, ties in index order, as int32 words [B, 2V]: key
    ``words[:, _HIGH::2]``, its index ``words[:, 1 - _HIGH::2]``. Each key and its index are one
    unique int64 (the key its high half), so one vectorised NumPy sort does every row: ~4x
    faster at 8 rows of 256 than the stable argsort (7 us a row here)."""
    b, v = key.shape
    packed = np.empty((b, v), np.int64)
    words = packed.view(np.int32)
    words[:, 1 - _HIGH::2] = np.arange(v, dtype=np.int32)
    words[:, _HIGH::2] = key.view(np.int32)
    packed.sort(axis=1)
    return words


def choose_tokens(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, rngs: Sequence[SplitMix64] | None = None, *,
                  repetition_penalty: float = 1.0, seen: np.ndarray | None = None,
                  token_limit: int | None = None) -> np.ndarray:
    """One token id per row of logits [B, V], row i drawing from ``rngs[i]``; each row is
    chosen exactly as `choose_token` chooses it alone, with the array work done once for the
    batch (a dozen NumPy calls whatever B: at TinyLM's V = 256 their fixed cost is most of the
    time). `seen`: [B, V] bool, the ids already in each row's context. `logits` is not written."""
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 2:
        raise ValueError(f"choose_tokens: logits must be [B, V], got shape {fmt_shape(z.shape)}")
    if token_limit is not None:
        z = z[:, :int(token_limit)]
    if z.shape[1] == 0:
        raise ValueError("choose_token: no token to choose from (empty logits or token_limit 0)")
    if repetition_penalty != 1.0 and seen is not None:
        z = _penalise(z, np.asarray(seen, bool)[:, :z.shape[1]], repetition_penalty)
    top = z.max(axis=1, keepdims=True)   # (NaN in a row makes its max NaN)
    if not np.isfinite(top).all():
        z, top = _nonfinite_rows(z, top)
    t = np.float32(temperature) if temperature <= _FLOAT32_MAX else np.float32(np.inf)
    if t == 0:           # greedy; also the limit of a temperature that float32 cannot hold
        return np.argmax(z, axis=1)
    if rngs is None or len(rngs) != z.shape[0]:
        raise ValueError("choose_token: sampling at temperature > 0 needs an rng per row")
    if t == np.inf:      # the limit of a huge temperature: uniform over the allowed logits
        z = np.where(z > -np.inf, np.float32(0), np.float32(-np.inf))
    else:
        with np.errstate(over="ignore"):   # a tiny temperature sends the others to -inf: their limit
            z = z - top                    # <= 0, each row's largest exactly 0
            z /= t
    # z <= 0, so its descending order is the ascending order of |z|, whose float32 bits order
    # like integers (and -0.0 ties with 0.0); -|z| sorted is z sorted (0.0 for -0.0: the same exp)
    k = top_k if top_k is not None and 0 < top_k < z.shape[1] else None
    words = _sorted_keys(np.abs(z))
    order = words[:, 1 - _HIGH::2][:, :k]
    zs = np.negative(words.view(np.float32)[:, _HIGH::2][:, :k])
    p = np.exp(zs)                                      # p[:, 0] = 1; underflow to 0 is a limit too
    cut = top_p is not None and top_p < 1.0
    valid = np.count_nonzero(p, axis=1) if cut else None   # descending: the nonzero ones are a prefix
    p /= p.sum(axis=1, keepdims=True)
    if cut:                                             # the smallest prefix reaching top_p
        valid = np.minimum(valid, np.count_nonzero(np.add.accumulate(p, axis=1) < np.float32(top_p), axis=1) + 1)
        p = np.where(np.arange(p.shape[1]) < valid[:, None], p, np.float32(0))
        p /= p.sum(axis=1, keepdims=True)
    u = np.array([r.unit() for r in rngs], np.float32).reshape(-1, 1)
    i = (np.add.accumulate(p, axis=1) <= u).sum(axis=1)
    # the draw: the first token whose cumulative probability passes u. Rounding can leave u at or
    # past the last one (every count true, i = p's width; past the last nonzero p the sum stops
    # growing, so in no other case): then the last token of nonzero probability
    if p.shape[1] in i.tolist():
        if valid is None:
            valid = np.count_nonzero(np.exp(zs), axis=1)
        i = np.minimum(i, valid - 1)
    return order[np.arange(len(i)), i].astype(np.intp)


# ================================================================================================
# the generator
# ================================================================================================

@dataclass
class Sample:
    """One generated continuation. `tokens`: the new ids (with the one that completed a stop
    string or was a stop token). `text`: their text when a tokenizer was given, cut right after
    the stop string. `finish_reason`: "length" (max_new_tokens reached), "stop" (stop string
    `stop`) or "stop_token" (an id of stop_token_ids)."""
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"
    stop: str | None = None


class _Row:
    """The running state of one row of a batch: context, output, its random stream, and its
    text cut at the first stop string."""

    def __init__(self, prompt: list[int], seed: int, tokenizer, stop: tuple[str, ...]):
        self.context = list(prompt)
        self.sample = Sample(text="" if tokenizer is not None else None)
        self.rng = SplitMix64(seed)
        self.stream = tokenizer.stream() if tokenizer is not None else None
        self.stop, self._longest = stop, max((len(x) for x in stop), default=0)
        self._scan = 0
        self.done = False

    def push(self, token: int, stop_token_ids) -> str:
        """Append `token`; returns the text it adds (cut at a stop string)."""
        self.context.append(token)
        self.sample.tokens.append(token)
        if token in stop_token_ids:
            self.done, self.sample.finish_reason = True, "stop_token"
            return ""
        return self._add(self.stream.push(token)) if self.stream is not None else ""

    def finish(self) -> str:
        if self.done or self.stream is None:
            return ""
        self.done = True
        return self._add(self.stream.flush())

    def _add(self, piece: str) -> str:
        if not piece:
            return ""
        old = self.sample.text
        text = old + piece
        hits = [(i + len(s), s) for s in self.stop for i in [text.find(s, self._scan)] if i >= 0]
        if hits:
            end, s = min(hits)
            text, piece = text[:end], text[len(old):end]
            self.done, self.sample.finish_reason, self.sample.stop = True, "stop", s
        self._scan = max(0, len(text) - self._longest + 1)
        self.sample.text = text
        return piece


def _prompt_ids(prompt, what: str = "prompt") -> list[int]:
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"generate: {what} must be token ids, got {type(prompt).__name__} "
                         "(encode text with a tokenizer first)")
    try:
        arr = np.asarray(prompt)
    except ValueError:
        raise ValueError(f"generate: {what} must be a 1-d sequence of token ids, got a ragged "
                         "nested sequence") from None
    if arr.ndim != 1:
        raise ValueError(f"generate: {what} must be a 1-d sequence of token ids, got shape "
                         f"{fmt_shape(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"generate: {what} is empty; give at least one token")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"generate: {what} must hold integer token ids, got {arr.dtype} values")
    return [int(t) for t in arr]


def _count(n, what: str, where: str = "generate") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{where}: {what} must be an integer >= 0, got {n!r}")
    return int(n)


class Generator:
    """Autoregressive decoding of `model` with a KV cache (module docstring). `params` are
    shared, not copied: the programs read them from the same `state` dict as the caches, and
    the weights' other layouts (``W.T``, ``W.panels``) taken from them here (after changing a
    weight, make a new Generator). The batch size is fixed: `generate` samples one
    continuation, `generate_batch` `batch_size` continuations of one prompt, decoded together."""

    def __init__(self, model, params: Mapping[str, np.ndarray], batch_size: int = 1,
                 executor: str = "numpy", keep: int | None = None):
        c = model.config
        self.batch_size = _count(batch_size, "batch_size", "Generator")
        if self.batch_size == 0:
            raise ValueError("Generator: batch_size must be >= 1, got 0")
        self.model, self.executor = model, executor
        self.context_length, self.vocab_size = c.context_length, c.vocab_size
        self.keep = c.context_length - 1 if keep is None else int(keep)
        if not 0 <= self.keep <= c.context_length - 1:
            raise ValueError(f"keep must be in [0, context_length - 1 = {c.context_length - 1}], "
                             f"got {keep}")
        # the executor's layout of weights that stay fixed (the native one's: column panels)
        self._weights_pass = getattr(get_executor(executor), "fixed_weights_pass", TRANSPOSED_WEIGHTS)
        self._graphs = {None: build_graph(model, self.batch_size, None, self._weights_pass)}
        self.state: dict[str, np.ndarray] = dict(params)
        self.state.update(fixed_weight_params(self._graphs[None][0], params))
        caches = self._graphs[None][0].states       # the attention modules' caches
        self.cache_names = list(caches)
        for name, leaf in caches.items():
            self.state[name] = np.zeros(leaf.shape, leaf.dtype)
        self._programs: dict[int | None, object] = {}
        self.length = 0   # positions of the cache in use
        self.prefill_count = self.decode_count = 0
        self.prefill_seconds = self.decode_seconds = self.compile_seconds = 0.0   # run, not compile

    def _program(self, length: int | None):
        prog = self._programs.get(length)
        if prog is None:
            t0 = time.perf_counter()
            g, logits, writes = (self._graphs.pop(length, None)
                                 or build_graph(self.model, self.batch_size, length, self._weights_pass))
            self.state.update(fixed_weight_params(g, self.state))   # (the decode graph's: taken in __init__)
            prog = get_executor(self.executor).compile(g, [logits] + writes)
            self._programs[length] = prog
            self.compile_seconds += time.perf_counter() - t0
        return prog

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Encode ``tokens [B, L]`` (L <= T) at positions 0..L-1; logits [B, V] of the last."""
        tokens = self.model.validate_tokens(tokens)
        if tokens.shape[0] != self.batch_size:
            raise ValueError(f"prefill: batch {tokens.shape[0]} differs from the generator's {self.batch_size}")
        prog = self._program(tokens.shape[1])
        t0 = time.perf_counter()
        out = prog.run({"tokens": tokens}, self.state)[0]
        self.prefill_seconds += time.perf_counter() - t0
        self.length = tokens.shape[1]
        self.prefill_count += 1
        return out

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """Append one token per row ``[B]`` at the next position; logits [B, V]."""
        tokens = np.asarray(tokens)
        if tokens.size != self.batch_size:
            raise ValueError(f"decode: expected {self.batch_size} token(s), one per row, got shape "
                             f"{fmt_shape(tokens.shape)}")
        return self._decode(self.model.validate_tokens(tokens.reshape(self.batch_size, 1)))

    def _decode(self, tokens: np.ndarray) -> np.ndarray:
        """`decode` of checked ids ``[B, 1]`` int64."""
        if self.length >= self.context_length:
            raise ValueError(f"decode: the cache is full ({self.context_length} positions); "
                             "slide the window with prefill")
        prog = self._program(None)
        t0 = time.perf_counter()
        out = prog.run({"tokens": tokens, "position": np.asarray(self.length, np.int64)}, self.state)[0]
        self.decode_seconds += time.perf_counter() - t0
        self.length += 1
        self.decode_count += 1
        return out

    def generate(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, on_token: Callable[[int], None] | None = None, **options) -> list[int]:
        """Continue `prompt` (a 1-d sequence of token ids) by up to `max_new_tokens` tokens;
        returns the new ids. `on_token(id)` is called as each one is chosen (streaming).
        `options` are `generate_batch`'s keyword options (repetition_penalty, stop, ...)."""
        if self.batch_size != 1:
            raise ValueError(f"generate: this generator decodes batches of {self.batch_size}; "
                             "use generate_batch")
        hook = None if on_token is None else (lambda row, token: on_token(token))
        return self.generate_batch(prompt, max_new_tokens, temperature, top_k, top_p, seed,
                                   on_token=hook, **options)[0].tokens

    def generate_batch(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int,
                       temperature: float = 1.0, top_k: int | None = None,
                       top_p: float | None = None, seed: int = 0, *,
                       repetition_penalty: float = 1.0, stop: Sequence[str] = (),
                       stop_token_ids: Sequence[int] = (), tokenizer=None,
                       token_limit: int | None = None,
                       on_token: Callable[[int, int], None] | None = None,
                       on_text: Callable[[int, str], None] | None = None) -> list[Sample]:
        """`batch_size` continuations of one `prompt`, decoded as one batch; row i draws from
        the stream seeded ``seed + i``. A row ends at `max_new_tokens`, at a stop string (text,
        needs `tokenizer`) or at an id of `stop_token_ids`; decoding ends when every row has.

        `tokenizer` (graphlm.tokenizer): decodes each row's text (`Sample.text`) and bounds
        the ids (`token_limit` defaults to its vocab_size). Streaming: ``on_token(row, id)`` for
        every id chosen, ``on_text(row, piece)`` for the text it completes (needs a tokenizer);
        a finished row calls neither again."""
        check_sampling_options(temperature, top_k, top_p, repetition_penalty)
        seq = _prompt_ids(prompt)
        n = _count(max_new_tokens, "max_new_tokens")
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"generate: stop must be non-empty strings, got {stop!r}")
        if (stop or on_text is not None) and tokenizer is None:
            raise ValueError("generate: stop strings and on_text need a tokenizer (to decode the text)")
        stop_ids = frozenset(_prompt_ids(stop_token_ids, "stop_token_ids")) if len(stop_token_ids) else frozenset()
        v = self.vocab_size
        if token_limit is None and tokenizer is not None:
            token_limit = min(int(tokenizer.vocab_size), v)
        if token_limit is not None and not 1 <= _count(token_limit, "token_limit") <= v:
            raise ValueError(f"generate: token_limit must be in [1, {v}], got {token_limit}")
        if token_limit is not None and token_limit >= v:
            token_limit = None
        bad = [(i, x) for i, x in enumerate(seq) if not 0 <= x < v]
        if bad:
            raise ValueError(f"generate: prompt id {bad[0][1]} at position {bad[0][0]} is outside "
                             f"the vocabulary [0, {v})")
        rows = [_Row(seq, seed + i, tokenizer, stop) for i in range(self.batch_size)]
        if n == 0:
            return [r.sample for r in rows]
        seen = None                                     # ids in each row's context (the penalty)
        if repetition_penalty != 1.0:
            seen = np.zeros((self.batch_size, v), bool)
            seen[:, seq] = True
        t = self.context_length
        logits = self.prefill(np.asarray([r.context[-t:] for r in rows]))
        last = np.empty(self.batch_size, np.int64)      # each row's last token: the next decode's feed
        active, rngs, ended = list(range(self.batch_size)), [r.rng for r in rows], []
        for step in range(n):
            for i in ended:
                rows[i].context.append(rows[i].context[-1])   # keeps the batch aligned; not output
            every = not ended
            chosen = choose_tokens(logits if every else logits[active], temperature, top_k, top_p, rngs,
                                   repetition_penalty=repetition_penalty, token_limit=token_limit,
                                   seen=seen if seen is None or every else seen[active])
            last[active] = chosen
            if seen is not None:
                seen[active, chosen] = True
            finished = False
            for i, token in zip(active, chosen.tolist()):
                row = rows[i]
                piece = row.push(token, stop_ids)
                finished = finished or row.done
                if on_token is not None:
                    on_token(i, token)
                if piece and on_text is not None:
                    on_text(i, piece)
            if finished:
                ended = [i for i, r in enumerate(rows) if r.done]
                active = [i for i, r in enumerate(rows) if not r.done]
                rngs = [rows[i].rng for i in active]
            if step == n - 1 or not active:
                break
            if self.length < t:   # (ids the generator chose or was given checked: no validate_tokens)
                logits = self._decode(last.reshape(self.batch_size, 1))
            else:  # the cache is full: slide the window, re-encoding the last keep + 1 tokens
                logits = self.prefill(np.asarray([r.context[-(self.keep + 1):] for r in rows]))
        for i, row in enumerate(rows):
            piece = row.finish()
            if piece and on_text is not None:
                on_text(i, piece)
        return [r.sample for r in rows]


def generate_full_recompute(model, params: Mapping[str, np.ndarray], prompt, max_new_tokens: int,
                            executor: str = "numpy", temperature: float = 0.0, top_k=None,
                            top_p=None, seed: int = 0, repetition_penalty: float = 1.0,
                            token_limit: int | None = None) -> list[int]:
    """Decoding without a cache: each step runs the full forward over the last T tokens
    (``model.logits``). The oracle the cached path is tested against."""
    check_sampling_options(temperature, top_k, top_p, repetition_penalty)
    seq = _prompt_ids(prompt)
    rng = SplitMix64(seed)
    new = []
    for _ in range(max_new_tokens):
        window = np.asarray([seq[-model.config.context_length:]])
        logits = model.logits(params, window, executor=executor)[0, -1]
        token = choose_token(logits, temperature, top_k, top_p, rng,
                             repetition_penalty=repetition_penalty, seen=seq, token_limit=token_limit)
        seq.append(token)
        new.append(token)
    return new


__all__ = ["Generator", "Sample", "build_graph", "choose_token", "choose_tokens", "descending_order", "apply_repetition_penalty",
           "check_sampling_options", "generate_full_recompute", "CACHE_PREFIX"]
