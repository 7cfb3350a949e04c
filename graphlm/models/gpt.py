"""GPT: the decoder-only transformer of the TensorLib documents and its common variants.

    token_embedding -> positional_embedding -> blocks.0 .. blocks.{N-1} (pre-norm) ->
    final_norm -> language_model_head  =>  logits [B, T, V]

Variants through `GPTConfig`: LayerNorm or RMSNorm, GELU (tanh or erf) or SwiGLU MLP of any hidden
width, biases on or off, a head tied to the token embedding (GPT-2). Parameter names follow
design.md section 7. Presets: "tinylm", "tinylm-small" (graphlm train's default), "tinylm-gpt2",
"gpt2-small" and "book-gpt" (the complete GPT of the decoder-only chapter, section 26.5: V=8 T=6
C=8 H=2 N=2, RMSNorm, GELU MLP of width 16, tied).

`GPT(config)(tokens)` builds nodes in a graph; `logits` and `loss_and_grads` are conveniences that
build, compile (cached per token shape and executor) and run a graph in eval mode.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .. import nn, ops
from ..autodiff import grad
from ..backends import get_executor
from ..ir import Graph, ShapeError, Tensor, fmt_shape


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of a GPT decoder. Invalid values raise ValueError naming the field."""

    vocab_size: int
    context_length: int
    channels: int
    head_count: int
    layer_count: int
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    norm: str = "layernorm"          # "layernorm" | "rmsnorm"
    mlp: str = "gelu"                # "gelu" | "swiglu"
    gelu_approximate: str = "tanh"   # "tanh" (GPT-2) | "none" (erf)
    attention_bias: bool = True
    mlp_bias: bool = True
    tie_weights: bool = False
    lm_head_bias: bool = True
    mlp_hidden: int | None = None    # the MLP's hidden width; None = 4C (GELU) or 2C (SwiGLU)

    def __post_init__(self):
        for f in ("vocab_size", "context_length", "channels", "head_count", "layer_count"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"GPTConfig.{f} must be a positive integer, got {v!r}")
            object.__setattr__(self, f, int(v))
        if self.channels % self.head_count:
            raise ValueError(f"GPTConfig.channels ({self.channels}) must be divisible by "
                             f"head_count ({self.head_count})")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float, np.floating)) or not 0.0 <= d < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {d!r}")
        object.__setattr__(self, "dropout", float(d))
        e = self.layer_norm_epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float, np.floating)) \
                or not math.isfinite(e) or e <= 0:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be finite and positive, got {e!r}")
        object.__setattr__(self, "layer_norm_epsilon", float(e))
        for f, allowed in (("norm", ("layernorm", "rmsnorm")), ("mlp", ("gelu", "swiglu")),
                           ("gelu_approximate", ("tanh", "none"))):
            if getattr(self, f) not in allowed:
                raise ValueError(f"GPTConfig.{f} must be one of {', '.join(map(repr, allowed))}, "
                                 f"got {getattr(self, f)!r}")
        for f in ("attention_bias", "mlp_bias", "tie_weights", "lm_head_bias"):
            if not isinstance(getattr(self, f), (bool, np.bool_)):
                raise ValueError(f"GPTConfig.{f} must be True or False, got {getattr(self, f)!r}")
            object.__setattr__(self, f, bool(getattr(self, f)))
        h = self.mlp_hidden
        if h is not None:
            if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h <= 0:
                raise ValueError(f"GPTConfig.mlp_hidden must be a positive integer or None "
                                 f"(the default width), got {h!r}")
            # one config per architecture: the default width, given explicitly, is stored as None
            # (so configs compare equal and `replace(channels=...)` keeps following the default)
            object.__setattr__(self, "mlp_hidden", None if h == self.default_mlp_hidden else int(h))

    @property
    def default_mlp_hidden(self) -> int:
        """The MLP width when `mlp_hidden` is None (`nn.default_mlp_hidden`: 4C GELU, 2C SwiGLU)."""
        return nn.default_mlp_hidden(self.mlp, self.channels)

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: `mlp_hidden`, or the default for `mlp` when it is None."""
        return self.default_mlp_hidden if self.mlp_hidden is None else self.mlp_hidden

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named configuration ("tinylm", "gpt2-small"), with optional field overrides."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; known: {', '.join(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Every field, with `mlp_hidden` as the actual width (what checkpoints record)."""
        return {**dataclasses.asdict(self), "mlp_hidden": self.mlp_width}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTConfig":
        """The inverse of `to_dict`; unknown keys are an error (they would be silently lost).
        Missing keys take their defaults, so dicts written before a field existed still load
        (a checkpoint without `mlp_hidden` has the default width); a field without a default
        must be there."""
        if not isinstance(d, Mapping):
            raise ValueError(f"GPTConfig: expected a mapping of fields, got {type(d).__name__}")
        fields = dataclasses.fields(cls)
        unknown = sorted(set(d) - {f.name for f in fields})
        if unknown:
            raise ValueError(f"GPTConfig: unknown field(s) {', '.join(map(str, unknown))}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ValueError(f"GPTConfig: missing field(s) {', '.join(missing)}")
        return cls(**d)

    @classmethod
    def upgrade_dict(cls, d: Mapping[str, Any]) -> dict[str, Any]:
        """A saved config dict in today's form (``from_dict(d).to_dict()``): the fields added
        since it was written get their values (`mlp_hidden` its default width)."""
        return cls.from_dict(d).to_dict()

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


_PRESETS: dict[str, dict[str, Any]] = {
    "tinylm": dict(vocab_size=256, context_length=128, channels=192, head_count=6, layer_count=4,
                   dropout=0.1),
    # TinyLM at width 128 (4 heads of 32): what `graphlm train` trains by default, since half the
    # cost per token buys twice the tokens in the main job's 6 minutes (docs/training.md)
    "tinylm-small": dict(vocab_size=256, context_length=128, channels=128, head_count=4,
                         layer_count=4, dropout=0.1),
    # TinyLM in GPT-2's exact layout (no LM-head bias): exports to Hugging Face and GGUF as is
    "tinylm-gpt2": dict(vocab_size=256, context_length=128, channels=192, head_count=6,
                        layer_count=4, dropout=0.1, lm_head_bias=False),
    "gpt2-small": dict(vocab_size=50257, context_length=1024, channels=768, head_count=12,
                       layer_count=12, tie_weights=True, lm_head_bias=False),
    # the book's chapter 26.5 (137_Gpt.c): VOCAB 8, SL 6, DM 8, NH 2, DF 16, N_BLOCKS 2; pre-norm
    # RMSNorm (eps 1e-5), bias-free attention and GELU (tanh) MLP, final RMSNorm, tied head
    "book-gpt": dict(vocab_size=8, context_length=6, channels=8, head_count=2, layer_count=2,
                     norm="rmsnorm", mlp="gelu", gelu_approximate="tanh", mlp_hidden=16,
                     attention_bias=False, mlp_bias=False, tie_weights=True, lm_head_bias=False),
}


class GPT(nn.Module):
    """A GPT decoder built from `GPTConfig`. Call it on an integer ``[B, T]`` tensor of a graph to
    get the logits tensor ``[B, T, V]``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        c = config
        self.config = c
        self.token_embedding = nn.Embedding(c.vocab_size, c.channels)
        self.positional_embedding = nn.PositionalEmbedding(c.context_length, c.channels)
        self.blocks = nn.ModuleList([
            nn.DecoderBlock(c.channels, c.head_count, c.dropout, c.layer_norm_epsilon, c.norm,
                            c.mlp, c.gelu_approximate, c.attention_bias, c.mlp_bias, c.mlp_width)
            for _ in range(c.layer_count)])
        self.final_norm = nn.make_norm(c.norm, c.channels, c.layer_norm_epsilon)
        self.language_model_head = nn.Linear(c.channels, c.vocab_size, bias=c.lm_head_bias)
        if c.tie_weights:
            # one Parameter in two modules: listed and bound once, as token_embedding.weight
            self.language_model_head.weight = self.token_embedding.weight
        self._programs: dict[tuple, Any] = {}

    @classmethod
    def from_checkpoint(cls, path) -> tuple["GPT", dict[str, np.ndarray]]:
        """The model of a training checkpoint and its parameter arrays, read and verified by
        `graphlm.io.checkpoint.read_checkpoint` and validated by `graphlm.train.checkpoint_model`
        (the config, its agreement with the training options, every parameter's shape and
        dtype); a ValueError names the file and the field or tensor at fault."""
        from ..io.checkpoint import read_checkpoint
        from ..train import checkpoint_model
        config, params = checkpoint_model(read_checkpoint(path))
        return cls(config), params

    def extra_repr(self):
        return repr(self.config)

    # -- graph building --------------------------------------------------------------------------
    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                cache: nn.KVCache | None = None, logits_to_keep: int | None = None) -> Tensor:
        """Logits ``[B, T, V]`` for integer tokens ``[B, T]`` (positions 0..T-1 by default).

        With `cache` (an `nn.KVCache`) every block's attention reads and writes it and the
        positions come from it (graphlm.sample). `logits_to_keep` = k computes the logits of
        the last k positions only, ``[B, k, V]`` (as Hugging Face's; sampling needs one)."""
        c = self.config
        if tokens.dtype.kind not in "iu" or tokens.ndim != 2:
            raise ShapeError(f"GPT: tokens must be an integer [B, T] tensor, got "
                             f"{fmt_shape(tokens.shape)} {tokens.dtype}")
        if cache is not None and positions is None:
            positions = cache.positions(tokens.shape[1])
        if positions is None and tokens.shape[1] > c.context_length:
            raise ShapeError(f"GPT: sequence length {tokens.shape[1]} exceeds context_length "
                             f"{c.context_length}")
        x = self.positional_embedding(self.token_embedding(tokens), positions)
        for block in self.blocks:
            x = block(x, cache=cache)
        if logits_to_keep is not None:
            t = tokens.shape[1]
            if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, np.integer)) \
                    or not 1 <= logits_to_keep <= t:
                raise ShapeError(f"GPT: logits_to_keep must be an int in [1, {t}], got {logits_to_keep!r}")
            x = x[:, t - int(logits_to_keep):, :]
        return self.language_model_head(self.final_norm(x))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy (a scalar tensor) of integer targets ``[B, T]``."""
        if targets.shape != tokens.shape or targets.dtype.kind not in "iu":
            raise ShapeError(f"GPT.loss: targets must be an integer tensor shaped like tokens "
                             f"{fmt_shape(tokens.shape)}, got {fmt_shape(targets.shape)} {targets.dtype}")
        logits = self(tokens)
        b, t, v = logits.shape
        return ops.cross_entropy(ops.reshape(logits, (b * t, v)), ops.reshape(targets, (b * t,)))

    def loss_graph(self, batch_size: int, seq_len: int | None = None,
                   name: str = "gpt_loss") -> tuple[Graph, Tensor]:
        """A new graph with int64 inputs ``tokens`` and ``targets`` ``[B, T]`` and the model's
        mean loss node, built in the model's current mode (T defaults to context_length)."""
        t = self.config.context_length if seq_len is None else int(seq_len)
        g = Graph(name)
        tokens = g.input("tokens", (batch_size, t), "int64")
        return g, self.loss(tokens, g.input("targets", (batch_size, t), "int64"))

    # -- conveniences that run a graph --------------------------------------------------------------
    def validate_tokens(self, tokens, what: str = "tokens") -> np.ndarray:
        """Check a ``[B, T]`` integer array of ids in ``[0, V)`` with T <= context_length;
        returns it as int64. Raises ValueError naming the problem."""
        c = self.config
        if isinstance(tokens, Tensor):
            raise ValueError(f"{what}: expected a NumPy array of token ids, got a graph tensor "
                             "(call the model on graph tensors instead)")
        arr = np.asarray(tokens)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what} must be an integer array, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"{what} must be a non-empty 2-d [B, T] array, got shape {fmt_shape(arr.shape)}")
        if arr.shape[1] > c.context_length:
            raise ValueError(f"{what}: sequence length {arr.shape[1]} exceeds context_length "
                             f"{c.context_length}")
        bad = (arr < 0) | (arr >= c.vocab_size)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{what}: id {int(arr[where])} at position {list(where)} is outside "
                             f"the vocabulary [0, {c.vocab_size})")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def _program(self, kind: str, shape: tuple, executor: str):
        key = (kind, shape, executor, tuple(p.dtype.str for p in self.parameters().values()))
        prog = self._programs.get(key)
        if prog is None:
            modes = [(m, m.training) for _, m in self.named_modules()]
            self.eval()
            try:
                if kind == "logits":
                    g = Graph("gpt_logits")
                    outputs = [self(g.input("tokens", shape, "int64"))]
                elif kind == "attention":
                    g = Graph("gpt_attention")
                    with nn.capture_attention(self) as probs:
                        logits = self(g.input("tokens", shape, "int64"))
                    names = [k for k, ps in probs.items() for _ in ps]
                    outputs = [logits] + [p for ps in probs.values() for p in ps]
                else:
                    g, loss = self.loss_graph(*shape, name="gpt_loss_and_grads")
                    outputs = [loss] + grad(loss, list(g.params.values()))
            finally:
                for m, mode in modes:
                    object.__setattr__(m, "training", mode)
            # with the names of the extra outputs: gradients (params) or attention probabilities
            prog = (get_executor(executor).compile(g, outputs),
                    names if kind == "attention" else list(g.params))
            self._programs[key] = prog
        return prog

    def clear_cache(self) -> None:
        """Forget compiled programs (after changing the module tree by hand)."""
        self._programs.clear()

    def logits(self, params: Mapping[str, np.ndarray], tokens, executor: str = "numpy") -> np.ndarray:
        """Run the model in eval mode: float32 logits ``[B, T, V]``."""
        tokens = self.validate_tokens(tokens)
        program, _ = self._program("logits", tokens.shape, executor)
        (out,) = program.run({"tokens": tokens}, state=params)
        return out

    def attention(self, params: Mapping[str, np.ndarray], tokens,
                  executor: str = "numpy") -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run the model in eval mode with every layer's attention probabilities as outputs of
        the program (`nn.capture_attention`): ``(logits [B, T, V], {"blocks.i.attention":
        probabilities [B, H, T, T]})``, row i of a head being what position i attends to."""
        tokens = self.validate_tokens(tokens)
        program, names = self._program("attention", tokens.shape, executor)
        logits, *probs = program.run({"tokens": tokens}, state=params)
        return logits, dict(zip(names, probs))

    def loss_and_grads(self, params: Mapping[str, np.ndarray], tokens, targets,
                       executor: str = "numpy") -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy and its gradient for every parameter (eval mode, no dropout)."""
        tokens = self.validate_tokens(tokens)
        targets = self.validate_tokens(targets, "targets")
        if targets.shape != tokens.shape:
            raise ValueError(f"targets shape {fmt_shape(targets.shape)} differs from tokens "
                             f"{fmt_shape(tokens.shape)}")
        program, names = self._program("loss", tokens.shape, executor)
        loss, *grads = program.run({"tokens": tokens, "targets": targets}, state=params)
        return float(loss), dict(zip(names, grads))


__all__ = ["GPTConfig", "GPT"]
