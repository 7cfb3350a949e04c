"""Sampling from a GPT with a KV cache held in `state`.

Two static-shape programs share one state (the model's params plus, per block, a key and a
value cache ``cache.blocks.{i}.{k,v}`` of shape ``[B, H, T, D]``):

- *prefill* (one program per prompt length L): the model's forward over ``[B, L]`` tokens at
  positions ``0..L-1``; writes keys and values of every position into the caches and returns
  the logits of the last position;
- *decode*: one token ``[B, 1]`` at a fed position ``pos``; its query attends to the cached keys
  at positions ``< pos`` (a mask built in the graph from ``arange(T) < pos``) and to its own key;
  the caches are updated in place at ``pos`` by `cache_write` update nodes, which run last.

Past the context (a sequence of more than T = context_length tokens), the window slides: when
the cache is full, the last `keep` tokens (default T - 1) plus the new one are re-encoded by a
prefill at positions ``0..keep``. With the default every token is conditioned on exactly the
last T tokens, as a full forward over the cropped window ``tokens[-T:]`` would; no position
beyond the table is ever read. A prompt longer than T is cropped to its last T tokens.

Token choice (`choose_token`): temperature 0 is greedy (argmax); otherwise the logits are
divided by the temperature, restricted to the `top_k` largest and to the smallest set whose
probability reaches `top_p`, and one token is drawn from a SplitMix64 stream seeded by `seed`.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from . import ops
from .backends import get_executor
from .ir import Graph, Tensor
from .random import SplitMix64

CACHE_PREFIX = "cache"


def cache_names(layer_count: int) -> list[str]:
    return [f"{CACHE_PREFIX}.blocks.{i}.{kv}" for i in range(layer_count) for kv in ("k", "v")]


# ================================================================================================
# graphs
# ================================================================================================

def _embed(model, tokens: Tensor, positions: Tensor | None) -> Tensor:
    return model.positional_embedding(model.token_embedding(tokens), positions)


def _block_cached(block, x: Tensor, cache_k: Tensor, cache_v: Tensor, pos: Tensor | None,
                  writes: list, mask: Tensor | None = None) -> Tensor:
    """`DecoderBlock.forward` with the attention split open to read and write the caches.

    pos None: prefill (causal attention over the L positions of x, written at 0).
    pos a scalar tensor: decode one position against the cache."""
    g = x.graph
    attn = block.attention
    with g.scope(block.name):
        h = block.attention_norm(x)
        with g.scope(attn.name):
            q, k, v = attn.project_qkv(h)
            qh, kh, vh = attn.split_heads(q), attn.split_heads(k), attn.split_heads(v)
            if pos is None:
                zero = g.const(np.int64(0))
                writes += [ops.cache_write(cache_k, kh, zero, axis=2), ops.cache_write(cache_v, vh, zero, axis=2)]
                context = attn.attend(qh, kh, vh, causal=True)
            else:
                context = _attend_to_cache(attn, qh, kh, vh, cache_k, cache_v, pos, mask)
                writes += [ops.cache_write(cache_k, kh, pos, axis=2), ops.cache_write(cache_v, vh, pos, axis=2)]
            out = attn.project_output(attn.merge_heads(context))
        r = x + out
        return r + block.mlp(r)


def _cache_mask(pos: Tensor, t: int) -> Tensor:
    """[T]: 0 where cached position j < pos, -inf elsewhere (built once, shared by the blocks)."""
    visible = ops.less(pos.graph.const(np.arange(t, dtype=np.int64)), pos)   # [T]: j < pos
    return ops.where(visible, 0.0, -math.inf)


def _attend_to_cache(attn, q, k, v, cache_k, cache_v, pos, mask=None):
    """softmax over [cached keys < pos | own key] of q·k/sqrt(D), then the matching values."""
    t = cache_k.shape[2]
    scale = 1.0 / math.sqrt(attn.head_width)
    s_cache = (q @ ops.swapaxes(cache_k, -1, -2)) * scale            # [B, H, 1, T]
    s_self = ops.sum(q * k, axis=-1, keepdims=True) * scale          # [B, H, 1, 1]
    s_cache = s_cache + (mask if mask is not None else _cache_mask(pos, t))
    p = ops.softmax(ops.concat([s_cache, s_self], axis=-1), -1)       # [B, H, 1, T+1]
    return p[..., :t] @ cache_v + p[..., t:] * v


def _head(model, x: Tensor) -> Tensor:
    """Logits [B, V] of the last position of x [B, L, C]."""
    last = x[:, x.shape[1] - 1:, :]
    logits = model.language_model_head(model.final_norm(last))
    return ops.reshape(logits, (logits.shape[0], logits.shape[2]))


def build_graph(model, batch_size: int, length: int | None) -> tuple[Graph, Tensor, list[Tensor]]:
    """The prefill graph (length L) or, with length None, the decode graph. Returns
    (graph, logits [B, V], cache-write nodes). Inputs: ``tokens`` [B, L or 1] and, for decode,
    ``position`` (int64 scalar). The model is built in eval mode (no dropout); its modes are
    restored afterwards."""
    modes = [(m, m.training) for _, m in model.named_modules()]
    model.eval()
    try:
        return _build_graph(model, batch_size, length)
    finally:
        for m, mode in modes:
            object.__setattr__(m, "training", mode)


def _build_graph(model, batch_size, length):
    c = model.config
    g = Graph(f"gpt_decode" if length is None else f"gpt_prefill_{length}")
    n = 1 if length is None else length
    tokens = g.input("tokens", (batch_size, n), np.int64)
    pos = g.input("position", (), np.int64) if length is None else None
    shape = (batch_size, c.head_count, c.context_length, c.channels // c.head_count)
    caches = [g.state(name, shape, np.float32) for name in cache_names(c.layer_count)]
    positions = ops.reshape(pos, (1,)) if pos is not None else None
    x = _embed(model, tokens, positions)
    writes: list[Tensor] = []
    mask = _cache_mask(pos, c.context_length) if pos is not None else None
    for i, block in enumerate(model.blocks):
        x = _block_cached(block, x, caches[2 * i], caches[2 * i + 1], pos, writes, mask)
    return g, _head(model, x), writes


# ================================================================================================
# choosing tokens
# ================================================================================================

def choose_token(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, rng: SplitMix64 | None = None) -> int:
    """One token id from logits [V]: greedy at temperature 0, else a draw after temperature,
    top-k and top-p (nucleus) filtering."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if temperature == 0:
        return int(np.argmax(logits))
    if rng is None:
        raise ValueError("choose_token: sampling at temperature > 0 needs an rng")
    z = logits / np.float32(temperature)
    order = np.argsort(-z, kind="stable")
    if top_k is not None and top_k > 0:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(p), np.float32(top_p))) + 1
        order, p = order[:cut], p[:cut] / p[:cut].sum()
    u = np.float32(rng.unit())
    i = min(int(np.searchsorted(np.cumsum(p), u, side="right")), len(order) - 1)
    return int(order[i])


def check_sampling_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


# ================================================================================================
# the generator
# ================================================================================================

class Generator:
    """Autoregressive decoding of `model` with a KV cache (module docstring). `params` are
    shared, not copied: the programs read them from the same `state` dict as the caches."""

    def __init__(self, model, params: Mapping[str, np.ndarray], batch_size: int = 1,
                 executor: str = "numpy", keep: int | None = None):
        c = model.config
        self.model, self.batch_size, self.executor = model, int(batch_size), executor
        self.context_length = c.context_length
        self.keep = c.context_length - 1 if keep is None else int(keep)
        if not 0 <= self.keep <= c.context_length - 1:
            raise ValueError(f"keep must be in [0, context_length - 1 = {c.context_length - 1}], "
                             f"got {keep}")
        shape = (self.batch_size, c.head_count, c.context_length, c.channels // c.head_count)
        self.state: dict[str, np.ndarray] = dict(params)
        for name in cache_names(c.layer_count):
            self.state[name] = np.zeros(shape, np.float32)
        self._programs: dict[int | None, object] = {}
        self.length = 0   # positions of the cache in use
        self.prefill_count = 0

    def _program(self, length: int | None):
        prog = self._programs.get(length)
        if prog is None:
            g, logits, writes = build_graph(self.model, self.batch_size, length)
            prog = get_executor(self.executor).compile(g, [logits] + writes)
            self._programs[length] = prog
        return prog

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Encode ``tokens [B, L]`` (L <= T) at positions 0..L-1; logits [B, V] of the last."""
        tokens = self.model.validate_tokens(tokens)
        if tokens.shape[0] != self.batch_size:
            raise ValueError(f"prefill: batch {tokens.shape[0]} differs from the generator's {self.batch_size}")
        out = self._program(tokens.shape[1]).run({"tokens": tokens}, self.state)[0]
        self.length = tokens.shape[1]
        self.prefill_count += 1
        return out

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """Append one token per row ``[B]`` at the next position; logits [B, V]."""
        if self.length >= self.context_length:
            raise ValueError(f"decode: the cache is full ({self.context_length} positions); "
                             "slide the window with prefill")
        tokens = self.model.validate_tokens(np.asarray(tokens).reshape(self.batch_size, 1))
        out = self._program(None).run({"tokens": tokens, "position": np.asarray(self.length, np.int64)},
                                      self.state)[0]
        self.length += 1
        return out

    def generate(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, on_token: Callable[[int], None] | None = None) -> list[int]:
        """Continue `prompt` (token ids, batch 1) by `max_new_tokens` tokens; returns the new
        ids. `on_token(id)` is called as each one is chosen (streaming)."""
        check_sampling_options(temperature, top_k, top_p)
        if self.batch_size != 1:
            raise ValueError("generate: batch size must be 1 (use prefill/decode for batches)")
        seq = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not seq:
            raise ValueError("generate: the prompt is empty; give at least one token")
        rng = SplitMix64(seed)
        t = self.context_length
        logits = self.prefill(np.asarray([seq[-t:]]))
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = choose_token(logits[0], temperature, top_k, top_p, rng)
            seq.append(token)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if len(new) == max_new_tokens:
                break
            if self.length < t:
                logits = self.decode(np.asarray([token]))
            else:  # the cache is full: slide the window, re-encoding the last keep + 1 tokens
                logits = self.prefill(np.asarray([seq[-(self.keep + 1):]]))
        return new


def generate_full_recompute(model, params: Mapping[str, np.ndarray], prompt, max_new_tokens: int,
                            executor: str = "numpy", temperature: float = 0.0, top_k=None,
                            top_p=None, seed: int = 0) -> list[int]:
    """Decoding without a cache: each step runs the full forward over the last T tokens
    (``model.logits``). The oracle the cached path is tested against."""
    check_sampling_options(temperature, top_k, top_p)
    seq = [int(t) for t in np.asarray(prompt).reshape(-1)]
    rng = SplitMix64(seed)
    new = []
    for _ in range(max_new_tokens):
        window = np.asarray([seq[-model.config.context_length:]])
        logits = model.logits(params, window, executor=executor)[0, -1]
        token = choose_token(logits, temperature, top_k, top_p, rng)
        seq.append(token)
        new.append(token)
    return new


__all__ = ["Generator", "build_graph", "choose_token", "check_sampling_options",
           "generate_full_recompute", "cache_names"]
