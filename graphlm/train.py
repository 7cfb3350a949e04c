"""Training a GPT: one compiled program per training step, checkpoints, bit-exact resume.

`Trainer` builds three things over one `state` dict (the params and the AdamW moments; no copies
of the weights anywhere):

- the training step: forward (train mode, dropout), loss, backward, global-norm clipping and the
  AdamW update, all one graph compiled once; per step it is fed the batch, the learning rate
  and step count (so the warmup + cosine schedule never recompiles) and the dropout key;
- the evaluation program: the same model in eval mode, loss only;
- `generator()`: the KV-cache sampler of graphlm.sample, sharing the same params.

Determinism: batch s is drawn from (seed, s) (graphlm.data.BatchSampler) and the dropout key of
step s is a hash of (seed, s), so the whole run is a function of the seed and the options, and
a run resumed from a checkpoint continues bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from . import data as data_mod
from .backends import default_executor, get_executor
from .io.checkpoint import load_checkpoint, save_checkpoint
from .ir import Graph
from .models import GPT, GPTConfig
from .nn import DROPOUT_KEY
from .optim import AdamW, WarmupCosine
from .random import MASK64, stream_base

CHECKPOINT_NAME = "checkpoint.safetensors"
_DROPOUT_SALT = 0xD0D0_5EED_0000_0001


@dataclass
class TrainOptions:
    """Everything that decides a training run (saved in checkpoints, compared on resume)."""

    preset: str = "tinylm"
    steps: int = 1800                 # total optimizer steps of the run
    batch_size: int = 8               # small batches: more steps for the same tokens
    lr: float = 2e-3                  # peak learning rate
    min_lr_ratio: float = 0.1         # cosine decays to lr * min_lr_ratio
    warmup: int = 50                  # linear warmup steps
    decay_steps: int | None = None    # cosine horizon (default: steps)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99              # 1k tokens per batch: noisy gradients, a longer v average
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_batches: int | None = 16     # validation batches per evaluation (None: the whole split)
    data: str | None = None           # a text file; None = the bundled tiny Shakespeare
    executor: str = "auto"            # "auto": native where a C compiler works, else numpy
    # GPTConfig field overrides of the preset. Dropout is off by default: the default run sees
    # the corpus about once in its 15 minutes, so it underfits and dropout would only slow it.
    model: dict = field(default_factory=lambda: {"dropout": 0.0})

    # options that decide the numbers of the run (a resume must keep them for bit-exactness)
    EXACT = ("preset", "batch_size", "lr", "min_lr_ratio", "warmup", "decay_steps", "weight_decay",
             "beta1", "beta2", "eps", "clip_norm", "seed", "data", "model", "executor")

    def __post_init__(self):
        def check(ok, what):
            if not ok:
                raise ValueError(f"TrainOptions.{what}")
        check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(math.isfinite(self.lr) and self.lr > 0, f"lr must be positive, got {self.lr}")
        check(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        check(self.decay_steps is None or self.decay_steps >= 1,
              f"decay_steps must be >= 1, got {self.decay_steps}")
        check(self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}")
        check(self.eval_batches is None or self.eval_batches >= 1,
              f"eval_batches must be >= 1, got {self.eval_batches}")

    @property
    def horizon(self) -> int:
        return self.decay_steps if self.decay_steps is not None else self.steps

    def config(self) -> GPTConfig:
        return GPTConfig.preset(self.preset, **self.model)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["decay_steps"] = self.horizon
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def dropout_key(seed: int, step: int) -> np.ndarray:
    """The dropout key of step `step`: a 63-bit hash of (seed, step)."""
    return np.asarray(stream_base((int(seed) ^ _DROPOUT_SALT) & MASK64, step) >> 1, np.int64)


@dataclass
class StepResult:
    step: int          # the step number just completed (1-based count of steps done)
    loss: float
    grad_norm: float
    lr: float
    seconds: float


class Trainer:
    """A GPT, its AdamW optimizer and data, with the compiled train and eval programs."""

    def __init__(self, options: TrainOptions, corpus: data_mod.Corpus | None = None):
        self.options = o = options
        self.config = config = options.config()
        if config.vocab_size < data_mod.VOCAB_SIZE:
            raise ValueError(f"the byte-level data needs vocab_size >= {data_mod.VOCAB_SIZE}, "
                             f"got {config.vocab_size}")
        self.corpus = corpus or data_mod.load_corpus(o.data, config.context_length)
        self.model = GPT(config)
        t = config.context_length
        self.sampler = data_mod.BatchSampler(self.corpus.train, o.batch_size, t, seed=o.seed)
        self.schedule = WarmupCosine(o.lr, o.warmup, o.horizon, o.min_lr_ratio)
        self.optimizer = AdamW(lr=self.schedule, betas=(o.beta1, o.beta2), eps=o.eps,
                               weight_decay=o.weight_decay, clip_norm=o.clip_norm)
        if o.executor == "auto":   # the checkpoint records the executor that ran
            self.options = o = dataclasses.replace(o, executor=default_executor())
        executor = get_executor(o.executor)

        # the training step: forward + loss + backward + clip + update, one program
        g = Graph("train_step")
        tokens = g.input("tokens", (o.batch_size, t), np.int64)
        targets = g.input("targets", (o.batch_size, t), np.int64)
        self.model.train()
        loss = self.model.loss(tokens, targets)
        step = self.optimizer.minimize(loss)
        self.train_graph = g
        self.train_program = executor.compile(g, [loss, step.grad_norm, step.update])
        self.uses_dropout = DROPOUT_KEY in g.inputs

        # evaluation: eval mode, loss only, reading the same params
        self.model.eval()
        ge = Graph("eval_step")
        et = ge.input("tokens", (o.batch_size, t), np.int64)
        self.eval_program = executor.compile(ge, [self.model.loss(et, ge.input("targets", (o.batch_size, t), np.int64))])
        self.model.train()

        self.state: dict[str, np.ndarray] = self.model.init(o.seed)
        self.state.update(self.optimizer.init_state())
        self.step = 0
        self.history: list[dict] = []      # {"step", "val_loss"} per evaluation
        self.best_val_loss = math.inf

    # -- running -------------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """Run optimizer step `self.step` (0-based) and advance."""
        start = time.perf_counter()
        s = self.step
        x, y = self.sampler.batch(s)
        feeds = {"tokens": x, "targets": y, **self.optimizer.feeds(s)}
        if self.uses_dropout:
            feeds[DROPOUT_KEY] = dropout_key(self.options.seed, s)
        loss, norm, _ = self.train_program.run(feeds, self.state)
        self.step = s + 1
        return StepResult(self.step, float(loss), float(norm), self.optimizer.lr_at(s),
                          time.perf_counter() - start)

    def evaluate(self, max_batches: int | None = -1) -> float:
        """Mean validation loss (nats per token) over the first `max_batches` batches of the
        validation split (default: the options' eval_batches; None: all of it)."""
        if max_batches == -1:
            max_batches = self.options.eval_batches
        losses = [float(self.eval_program.run({"tokens": x, "targets": y}, self.state)[0])
                  for x, y in data_mod.eval_batches(self.corpus.val, self.options.batch_size,
                                                    self.config.context_length, max_batches)]
        return float(np.mean(losses))

    def record_eval(self, val_loss: float) -> None:
        self.history.append({"step": self.step, "val_loss": val_loss})
        self.best_val_loss = min(self.best_val_loss, val_loss)

    def params(self) -> dict[str, np.ndarray]:
        return {k: self.state[k] for k in self.model.parameters()}

    def generator(self, executor: str | None = None):
        from .sample import Generator
        return Generator(self.model, self.params(), executor=executor or self.options.executor)

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        o = self.options
        return save_checkpoint(
            path, self.state, step=self.step, config=self.config.to_dict(), options=o.to_dict(),
            rng={"seed": o.seed, "init": "splitmix64(seed)",
                 "dropout": "counter-based, key = hash(seed, step)"},
            sampler={"seed": o.seed, "step": self.step, "batch_size": o.batch_size,
                     "context_length": self.config.context_length, "source": self.corpus.source,
                     "train_tokens": int(self.corpus.train.size)},
            extra={"history": self.history,
                   "best_val_loss": None if math.isinf(self.best_val_loss) else self.best_val_loss})

    def load(self, path: str | Path) -> None:
        """Restore params, moments, step and history from `path` (validated before anything
        changes)."""
        ckpt = load_checkpoint(path, self.state, config=self.config.to_dict(),
                               upgrade_config=GPTConfig.upgrade_dict)
        self.step = ckpt.step
        self.history = list(ckpt.extra.get("history", []))
        best = ckpt.extra.get("best_val_loss")
        self.best_val_loss = math.inf if best is None else float(best)


def resume_options(path: str | Path, overrides: Mapping[str, Any]) -> tuple[TrainOptions, list[str]]:
    """The options of the checkpoint at `path` with `overrides` (the ones given explicitly) on
    top; also the names of overridden options that change the run's numbers (a resumed run then
    no longer matches an uninterrupted one)."""
    from .io.checkpoint import read_checkpoint
    saved = read_checkpoint(path).options
    merged = {**saved, **overrides}
    changed = [k for k in TrainOptions.EXACT if k in overrides and k in saved and overrides[k] != saved[k]]
    return TrainOptions.from_dict(merged), changed


__all__ = ["Trainer", "TrainOptions", "StepResult", "dropout_key", "resume_options", "CHECKPOINT_NAME"]
