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

What a run guarantees (docs/training.md, "What a run guarantees"):

- options are checked in the dtype they are used in (the learning rate, betas, eps, decay and
  clip norm are float32 in the graph: ``lr=1e39`` is inf there and refused);
- a run refuses, before allocating, a model whose training needs more memory than is available
  (`training_memory_bytes`), and data too short for one validation batch;
- `divergence` says when a run has blown up (non-finite loss or gradient norm, a non-finite
  validation loss, or one far above the best): the caller stops without saving that state;
- a checkpoint records the data's identity (resolved path, size, sha256), and `load` refuses a
  checkpoint of other data unless asked to; `validate_training_metadata` checks every field a
  training checkpoint carries (options, history, data) and names the one at fault.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from . import data as data_mod
from .backends import default_executor, get_executor
from .io.checkpoint import copy_checkpoint, load_checkpoint, read_checkpoint, save_checkpoint
from .ir import Graph
from .models import GPT, GPTConfig
from .nn import DROPOUT_KEY
from .optim import AdamW, WarmupCosine
from .random import MASK64, stream_base

CHECKPOINT_NAME = "checkpoint.safetensors"   # the last state of the run: what --resume continues
BEST_NAME = "best.safetensors"               # the state with the lowest validation loss so far
# a validation loss this many times the best (and at least 1 nat above it) means the run diverged;
# before a best below ln(vocab_size) exists, that uniform-guessing loss is the reference
DIVERGED_VAL_RATIO = 2.0


class Diverged(ValueError):
    """Training blew up (the state is not saved; the checkpoints on disk are the good ones)."""
_DROPOUT_SALT = 0xD0D0_5EED_0000_0001


@dataclass
class TrainOptions:
    """Everything that decides a training run (saved in checkpoints, compared on resume)."""

    preset: str = "tinylm-small"      # TinyLM at width 128: twice the tokens of width 192 in the time
    steps: int = 4200                 # total optimizer steps: under 5 minutes on 2 idle cores (docs/training.md)
    batch_size: int = 8               # small batches: more steps for the same tokens
    lr: float = 3e-3                  # peak learning rate
    min_lr_ratio: float = 0.1         # cosine decays to lr * min_lr_ratio
    warmup: int = 100                 # linear warmup steps
    decay_steps: int | None = None    # cosine horizon (default: steps)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99              # 1k tokens per batch: noisy gradients, a longer v average
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    seed: int = 0
    eval_every: int = 400
    eval_batches: int | None = 16     # validation batches per evaluation (None: the whole split)
    data: str | None = None           # a text file; None = the bundled tiny Shakespeare
    executor: str = "auto"            # "auto": native where a C compiler works, else numpy
    devices: int | None = None        # data-parallel devices (jax executor; None: its default)
    # GPTConfig field overrides of the preset. Dropout is off by default: the default run sees
    # the corpus about five times in its minutes and still underfits; dropout would only slow it.
    model: dict = field(default_factory=lambda: {"dropout": 0.0})

    # options that decide the numbers of the run (a resume must keep them for bit-exactness)
    EXACT = ("preset", "batch_size", "lr", "min_lr_ratio", "warmup", "decay_steps", "weight_decay",
             "beta1", "beta2", "eps", "clip_norm", "seed", "data", "model", "executor")

    def __post_init__(self):
        def fail(name, what, value):
            raise ValueError(f"TrainOptions.{name} must be {what}, got {value!r}")

        for name, low, optional in (("steps", 1, False), ("batch_size", 1, False), ("warmup", 0, False),
                                    ("decay_steps", 1, True), ("eval_every", 1, False),
                                    ("eval_batches", 1, True), ("seed", -(1 << 63), False),
                                    ("devices", 1, True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                    or not low <= v < (1 << 63):
                fail(name, f"an integer >= {low}" + (" or None" if optional else ""), v)
            object.__setattr__(self, name, int(v))
        # float options are float32 in the graph (lr, betas, eps, decay, clip): checked as such
        for name, lo, hi, lo_open, hi_open in (("lr", 0.0, None, True, False),
                                               ("min_lr_ratio", 0.0, 1.0, False, False),
                                               ("weight_decay", 0.0, None, False, False),
                                               ("beta1", 0.0, 1.0, False, True),
                                               ("beta2", 0.0, 1.0, False, True),
                                               ("eps", 0.0, None, True, False),
                                               ("clip_norm", 0.0, None, True, False)):
            v = getattr(self, name)
            if v is None and name == "clip_norm":
                continue
            rng = (("(" if lo_open else "[") + f"{lo:g}, " + ("inf)" if hi is None else f"{hi:g}"
                   + (")" if hi_open else "]")))
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                fail(name, f"a number in {rng}", v)
            with np.errstate(over="ignore"):
                v32 = float(np.float32(v))
            if not math.isfinite(v32):
                fail(name, f"finite as a float32 (the dtype training uses; at most {float(np.finfo(np.float32).max):.4g})", v)
            if (v32 <= lo if lo_open else v32 < lo) or (hi is not None and (v32 >= hi if hi_open else v32 > hi)):
                fail(name, f"in {rng} as a float32" + (" (it rounds to 0)" if v32 == 0 and v != 0 else ""), v)
            object.__setattr__(self, name, float(v))
        for name, optional in (("preset", False), ("data", True), ("executor", False)):
            v = getattr(self, name)
            if not (v is None and optional) and (not isinstance(v, str) or not v.strip()):
                fail(name, "a non-empty string" + (" or None" if optional else ""), v)
        if not isinstance(self.model, dict):
            fail("model", "a dict of GPTConfig fields", self.model)

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
        if not isinstance(d, Mapping):
            raise ValueError(f"TrainOptions: expected a mapping of options, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def training_memory_bytes(config: GPTConfig, batch_size: int) -> dict[str, int]:
    """A lower bound of the float32 bytes one training step of `config` holds at once:
    parameters with their gradients and two AdamW moments; the attention scores and their
    probabilities, kept for the backward pass, in every layer; the logits with their softmax and
    gradient; the block activations kept for backward (about 16 values per channel and token)."""
    b, t, c, v = batch_size, config.context_length, config.channels, config.vocab_size
    layers, heads = config.layer_count, config.head_count
    params = GPT(config).parameter_count()
    parts = {"parameters, gradients and AdamW moments": 4 * 4 * params,
             "attention scores and probabilities": 4 * 2 * layers * b * heads * t * t,
             "logits, softmax and its gradient": 4 * 3 * b * t * v,
             "block activations": 4 * 16 * layers * b * t * c}
    parts["total"] = sum(parts.values())
    return parts


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (or physical memory), None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):,.1f} MiB"


def check_memory(config: GPTConfig, batch_size: int) -> None:
    """Refuse (ValueError with the bytes) a run that cannot fit in the available memory."""
    need = training_memory_bytes(config, batch_size)
    have = available_memory_bytes()
    if have is not None and need["total"] > have:
        biggest = max((k for k in need if k != "total"), key=need.get)
        raise ValueError(f"training this model needs at least {_gib(need['total'])} "
                         f"({biggest}: {_gib(need[biggest])}; context_length {config.context_length}, "
                         f"batch_size {batch_size}) but {_gib(have)} is available; lower "
                         "--context-length or --batch-size")


def train_step_graph(model: GPT, options: TrainOptions, seq_len: int | None = None):
    """The graph of one training step of `model` under `options`: forward in train mode, loss,
    backward, clipping and the AdamW update (warmup + cosine schedule fed per step). Returns
    (graph, [loss, grad_norm, update], optimizer); `graphlm plan` draws this same graph."""
    o = options
    t = model.config.context_length if seq_len is None else int(seq_len)
    optimizer = AdamW(lr=WarmupCosine(o.lr, o.warmup, o.horizon, o.min_lr_ratio),
                      betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                      clip_norm=o.clip_norm)
    g = Graph("train_step")
    tokens = g.input("tokens", (o.batch_size, t), np.int64)
    targets = g.input("targets", (o.batch_size, t), np.int64)
    model.train()
    step = optimizer.minimize(model.loss(tokens, targets))
    return g, [step.loss, step.grad_norm, step.update], optimizer


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
        check_memory(config, o.batch_size)
        self.corpus = corpus or data_mod.load_corpus(o.data, config.context_length)
        if o.data is not None and self.corpus.path:   # a resume finds it from any folder
            self.options = o = dataclasses.replace(o, data=self.corpus.path)
        t = config.context_length
        if (self.corpus.val.size - 1) // t < o.batch_size:
            need = o.batch_size * t + 1
            raise ValueError(f"data file {self.corpus.source}: its validation part ({self.corpus.val.size:,} "
                             f"bytes, the last 10%) is shorter than one batch of {o.batch_size} windows "
                             f"of {t} + 1 bytes ({need:,} bytes); use a file of at least "
                             f"{10 * need:,} bytes or a smaller --batch-size / --context-length")
        self.model = GPT(config)
        self.sampler = data_mod.BatchSampler(self.corpus.train, o.batch_size, t, seed=o.seed)
        if o.executor == "auto":   # the checkpoint records the executor that ran
            self.options = o = dataclasses.replace(o, executor=default_executor())
        executor = get_executor(o.executor)
        compile_options = {} if o.devices is None else {"devices": o.devices}
        if compile_options and not getattr(executor, "multi_device", False):
            raise ValueError(f"devices={o.devices} needs an executor that runs on many devices "
                             f"(jax), not {o.executor}")
        try:
            self._compile(o, executor, t, compile_options)
        except MemoryError:
            raise ValueError(f"out of memory compiling the training step (it needs at least "
                             f"{_gib(training_memory_bytes(config, o.batch_size)['total'])}); lower "
                             "--context-length or --batch-size") from None
        self.step = 0
        self.history: list[dict] = []      # {"step", "val_loss"} per evaluation
        self.best_val_loss = math.inf
        self.best_step: int | None = None
        self.saved_step: int | None = None   # the step of the last checkpoint written or loaded

    def _compile(self, o: TrainOptions, executor, t: int, compile_options: dict) -> None:
        """The train and eval programs, and the state (params + moments) they share;
        `compile_options` go to the executor (the jax executor's devices)."""
        # the training step: forward + loss + backward + clip + update, one program
        g, outputs, self.optimizer = train_step_graph(self.model, o)
        self.schedule = self.optimizer.lr
        self.train_graph = g
        self.train_program = executor.compile(g, outputs, **compile_options)
        self.uses_dropout = DROPOUT_KEY in g.inputs

        # evaluation: eval mode, loss only, reading the same params
        self.model.eval()
        ge = Graph("eval_step")
        et = ge.input("tokens", (o.batch_size, t), np.int64)
        self.eval_program = executor.compile(
            ge, [self.model.loss(et, ge.input("targets", (o.batch_size, t), np.int64))], **compile_options)
        # over several processes each feeds only its rows of every batch (None: all of them)
        self.rows = getattr(self.train_program, "local_rows", None) or slice(None)
        self.model.train()

        self.state: dict[str, np.ndarray] = self.model.init(o.seed)
        self.state.update(self.optimizer.init_state())

    # -- running -------------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """Run optimizer step `self.step` (0-based) and advance."""
        start = time.perf_counter()
        s = self.step
        x, y = self.sampler.batch(s, self.rows)
        feeds = {"tokens": x, "targets": y, **self.optimizer.feeds(s)}
        if self.uses_dropout:
            feeds[DROPOUT_KEY] = dropout_key(self.options.seed, s)
        loss, norm, _ = self.train_program.run(feeds, self.state)
        self.step = s + 1
        return StepResult(self.step, float(loss), float(norm), self.optimizer.lr_at(s),
                          time.perf_counter() - start)

    def validation_losses(self, max_batches: int | None = -1) -> list[float]:
        """The mean loss (nats per token) of each of the first `max_batches` batches of the
        validation split (default: the options' eval_batches; None: all of it)."""
        if max_batches == -1:
            max_batches = self.options.eval_batches
        return [float(self.eval_program.run({"tokens": x[self.rows], "targets": y[self.rows]},
                                            self.state)[0])
                for x, y in data_mod.eval_batches(self.corpus.val, self.options.batch_size,
                                                  self.config.context_length, max_batches)]

    def evaluate(self, max_batches: int | None = -1) -> float:
        """Mean validation loss (nats per token) over the first `max_batches` batches of the
        validation split (default: the options' eval_batches; None: all of it)."""
        return float(np.mean(self.validation_losses(max_batches)))

    def evaluate_whole(self) -> tuple[float, float]:
        """(the loss on the first eval_batches batches, the loss on the whole validation split),
        both from one pass over the whole split. The first is what every periodic evaluation
        measures (what the history and the best checkpoint compare); the second is the run's
        quality, the figure a final evaluation reports (the split's start is easier than its
        rest, so the two differ)."""
        losses = self.validation_losses(None)
        first = losses if self.options.eval_batches is None else losses[:self.options.eval_batches]
        return float(np.mean(first)), float(np.mean(losses))

    def record_eval(self, val_loss: float) -> bool:
        """Append to the history; True when this is the best validation loss so far."""
        self.history.append({"step": self.step, "val_loss": val_loss})
        if val_loss < self.best_val_loss:
            self.best_val_loss, self.best_step = val_loss, self.step
            return True
        return False

    def divergence(self, loss: float | None = None, grad_norm: float | None = None,
                   val_loss: float | None = None) -> str | None:
        """Why the run has diverged, or None: a non-finite training loss or gradient norm, a
        non-finite validation loss, or one DIVERGED_VAL_RATIO times the best (and 1 nat above);
        before any best below it, the reference is ln(vocab_size), uniform guessing."""
        for what, v in (("training loss", loss), ("gradient norm", grad_norm), ("validation loss", val_loss)):
            if v is not None and not math.isfinite(v):
                return f"{what} {v}"
        if val_loss is None:
            return None
        uniform = math.log(self.config.vocab_size)   # the loss of guessing uniformly (a fresh model's)
        best = self.best_val_loss
        ref, what = (best, f"the best {best:.5g} (step {self.best_step})") if best < uniform else \
            (uniform, f"ln(vocab_size) = {uniform:.5g}, the loss of uniform guessing")
        if val_loss > max(DIVERGED_VAL_RATIO * ref, ref + 1.0):
            return f"validation loss {val_loss:.5g} is far above {what}"
        return None

    def params(self) -> dict[str, np.ndarray]:
        return {k: self.state[k] for k in self.model.parameters()}

    def host_state(self, tensors: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """NumPy copies of `tensors` (default: the whole state), wherever the executor keeps
        them (the jax executor: on its devices)."""
        tensors = self.state if tensors is None else tensors
        host = getattr(self.train_program, "host_state", None)
        return host(tensors) if host else dict(tensors)

    @property
    def writes_checkpoints(self) -> bool:
        """False on every process but process 0 of a multi-process run."""
        return getattr(self.train_program, "is_primary", True)

    def generator(self, executor: str | None = None):
        from .sample import Generator
        return Generator(self.model, self.host_state(self.params()),
                         executor=executor or self.options.executor)

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the state to `path` atomically. A state holding NaN or inf is never written:
        that raises `Diverged` and the file on disk stays as it was. Over several processes every
        process calls this (gathering sharded state is collective) and only process 0 writes."""
        o = self.options
        tensors = self.host_state()
        if not all(np.isfinite(a).all() for a in tensors.values() if a.dtype.kind == "f"):
            bad = next(k for k, a in tensors.items() if a.dtype.kind == "f" and not np.isfinite(a).all())
            raise Diverged(f"training diverged by step {self.step}: '{bad}' holds NaN or inf values; "
                           f"not saved, {path} keeps its previous contents")
        if not self.writes_checkpoints:
            self.saved_step = self.step
            return Path(path)
        written = save_checkpoint(
            path, tensors, step=self.step, config=self.config.to_dict(), options=o.to_dict(),
            rng={"seed": o.seed, "init": "splitmix64(seed)",
                 "dropout": "counter-based, key = hash(seed, step)"},
            sampler={"seed": o.seed, "step": self.step, "batch_size": o.batch_size,
                     "context_length": self.config.context_length, "source": self.corpus.source,
                     "train_tokens": int(self.corpus.train.size), "data": self.corpus.identity()},
            extra={"history": self.history,
                   "best_val_loss": None if math.isinf(self.best_val_loss) else self.best_val_loss,
                   "best_step": self.best_step})
        self.saved_step = self.step
        return written

    def save_run(self, folder: str | Path, is_best: bool = False) -> dict[str, Path]:
        """Save the last state as folder/CHECKPOINT_NAME and, when `is_best`, the same file as
        folder/BEST_NAME; returns {"last": path[, "best": path]}."""
        folder = Path(folder)
        out = {"last": self.save(folder / CHECKPOINT_NAME)}
        if is_best and self.writes_checkpoints:
            out["best"] = copy_checkpoint(out["last"], folder / BEST_NAME)
        return out

    def sync_best(self, folder: str | Path) -> bool:
        """After a resume: when the last checkpoint is also the best one but folder/BEST_NAME does
        not hold it (the run was killed between writing the two), copy it; True when copied."""
        folder = Path(folder)
        last, best = folder / CHECKPOINT_NAME, folder / BEST_NAME
        if self.best_step is None or self.best_step != self.saved_step or not last.exists():
            return False
        try:
            if read_checkpoint(best).step == self.best_step:
                return False
        except ValueError:   # missing or damaged
            pass
        copy_checkpoint(last, best)
        return True

    def load(self, path: str | Path, allow_other_data: bool = False) -> list[str]:
        """Restore params, moments, step and history from `path` (validated before anything
        changes). The checkpoint's data must be this trainer's (same size and hash) unless
        `allow_other_data`; returns notes for the user (e.g. the data differs but was allowed)."""
        ckpt = read_checkpoint(path)
        validate_training_metadata(ckpt)
        notes = []
        saved = ckpt.sampler.get("data")
        here = self.corpus.identity()
        if saved is None:
            notes.append(f"checkpoint {path} records no data identity (an older graphlm wrote it): "
                         "cannot check that the resume trains on the same data")
        elif not data_mod.same_data(saved, here):
            what = (f"the checkpoint {path} was trained on {saved['path']} ({saved['bytes']:,} bytes, "
                    f"sha256 {saved['sha256'][:12]}), this run reads {here['path']} ({here['bytes']:,} "
                    f"bytes, sha256 {here['sha256'][:12]})")
            if not allow_other_data:
                raise ValueError(f"--resume on other data: {what}; pass --data with the original "
                                 "file, or --allow-other-data to continue on this one (validation "
                                 "losses before and after are then not comparable)")
            notes.append(f"continuing on other data: {what}")
        # (in place, into host arrays: state an executor moved onto its devices comes back first)
        self.state.update({k: np.array(v) for k, v in self.host_state().items()
                           if not isinstance(self.state[k], np.ndarray)})
        load_checkpoint(path, self.state, config=self.config.to_dict(),
                        upgrade_config=GPTConfig.upgrade_dict, read=ckpt)
        self.step = self.saved_step = ckpt.step
        self.history = list(ckpt.extra.get("history", []))
        best = ckpt.extra.get("best_val_loss")
        self.best_val_loss = math.inf if best is None else float(best)
        self.best_step = ckpt.extra.get("best_step")
        if self.best_step is None and self.history:
            self.best_step = min(self.history, key=lambda h: h["val_loss"])["step"]
        return notes


def _field_error(path, field: str, what: str, value) -> ValueError:
    return ValueError(f"checkpoint {path}: field {field} must be {what}, got {str(repr(value))[:80]}")


def validate_training_metadata(ckpt) -> None:
    """Check the fields a training checkpoint carries beyond the tensors (options, the model
    config they imply, the history, the best loss, the data identity); one ValueError naming the
    file and the field."""
    where = ckpt.path
    try:
        config = GPTConfig.upgrade_dict(ckpt.config)   # (fields added since: their defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"checkpoint {where}: field config: {e}") from None
    if ckpt.options:
        try:
            options = TrainOptions.from_dict(ckpt.options)
            implied = options.config().to_dict()
        except (ValueError, TypeError) as e:
            raise ValueError(f"checkpoint {where}: field options: {e}") from None
        if implied != config:
            diff = sorted(k for k in config if implied.get(k) != config.get(k))
            raise ValueError(f"checkpoint {where}: field config does not match its options "
                             f"(preset {options.preset!r} with overrides gives "
                             + ", ".join(f"{k}={implied.get(k)!r}" for k in diff[:4])
                             + ", the config says " + ", ".join(f"{k}={config.get(k)!r}" for k in diff[:4]) + ")")
    history = ckpt.extra.get("history", [])
    if not isinstance(history, list):
        raise _field_error(where, "extra.history", "a list of evaluations", history)
    for i, h in enumerate(history):
        if not isinstance(h, dict):
            raise _field_error(where, f"extra.history[{i}]", "an object with step and val_loss", h)
        step, val = h.get("step"), h.get("val_loss")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= ckpt.step:
            raise _field_error(where, f"extra.history[{i}].step", f"an integer in [0, {ckpt.step}]", step)
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise _field_error(where, f"extra.history[{i}].val_loss", "a finite number", val)
        full = h.get("val_loss_full")   # a final evaluation's loss on the whole split
        if full is not None and (isinstance(full, bool) or not isinstance(full, (int, float))
                                 or not math.isfinite(full)):
            raise _field_error(where, f"extra.history[{i}].val_loss_full", "a finite number or absent", full)
    best = ckpt.extra.get("best_val_loss")
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float)) or not math.isfinite(best)):
        raise _field_error(where, "extra.best_val_loss", "a finite number or null", best)
    best_step = ckpt.extra.get("best_step")
    if best_step is not None and (isinstance(best_step, bool) or not isinstance(best_step, int)
                                  or not 0 <= best_step <= ckpt.step):
        raise _field_error(where, "extra.best_step", f"an integer in [0, {ckpt.step}] or null", best_step)
    data = ckpt.sampler.get("data")
    if data is not None:
        if not (isinstance(data, dict) and isinstance(data.get("path"), str)
                and isinstance(data.get("bytes"), int) and not isinstance(data.get("bytes"), bool)
                and data["bytes"] >= 0 and isinstance(data.get("sha256"), str)
                and len(data["sha256"]) == 64):
            raise _field_error(where, "sampler.data", "{path: str, bytes: int >= 0, sha256: 64 hex digits}", data)


def checkpoint_model(ckpt) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """The model config and parameter arrays of a checkpoint, validated: the config is a valid
    GPTConfig (and the one its training options imply), every parameter is there with the
    model's shape and dtype. One ValueError naming the file and the field or tensor."""
    where = ckpt.path
    validate_training_metadata(ckpt)
    config = GPTConfig.from_dict(ckpt.config)
    params = {}
    for name, p in GPT(config).parameters().items():
        a = ckpt.tensors.get(name)
        if a is None:
            raise ValueError(f"checkpoint {where}: missing parameter '{name}'")
        if a.shape != tuple(p.shape) or a.dtype != p.dtype:
            raise ValueError(f"checkpoint {where}: tensor '{name}' is {list(a.shape)} {a.dtype}, "
                             f"the model of its config needs {list(p.shape)} {np.dtype(p.dtype)}")
        params[name] = a
    return config, params


def _lr_at(saved: Mapping[str, Any], step: int, fallback: TrainOptions) -> float:
    """The learning rate the checkpoint's own schedule gives at `step`."""
    get = lambda k: saved.get(k, getattr(fallback, k))   # noqa: E731
    return WarmupCosine(get("lr"), get("warmup"), int(saved.get("decay_steps") or get("steps")),
                        get("min_lr_ratio"))(step)


def resume_options(path: str | Path, overrides: Mapping[str, Any],
                   notes: list[str] | None = None) -> tuple[TrainOptions, list[str]]:
    """The options of the checkpoint at `path` with `overrides` (the ones given explicitly) on
    top; also the names of overridden options that change the run's numbers (a resumed run then
    no longer matches an uninterrupted one). `notes` (when given) receives what the user should
    be told: a changed or kept schedule horizon. --steps below the checkpoint's step is an error;
    the data is compared by identity in `Trainer.load`, not by its path here."""
    ckpt = read_checkpoint(path)
    validate_training_metadata(ckpt)
    saved = ckpt.options
    overrides = dict(overrides)
    if overrides.get("executor") == "auto":
        overrides["executor"] = default_executor()   # "auto" is whatever it resolves to
    steps = overrides.get("steps", saved.get("steps"))
    if isinstance(steps, int) and steps < ckpt.step:
        raise ValueError(f"--resume: --steps {steps} is below the step of the checkpoint {path} "
                         f"({ckpt.step}); give --steps of at least {ckpt.step}")
    merged = {**saved, **overrides}
    changed = [k for k in TrainOptions.EXACT if k != "data" and k in overrides and k in saved
               and overrides[k] != saved[k]]
    try:
        options = TrainOptions.from_dict(merged)
    except (ValueError, TypeError) as e:
        raise ValueError(f"checkpoint {path}: field options: {e}") from None
    if notes is not None:
        old = saved.get("decay_steps")
        if "decay_steps" in changed:
            before = _lr_at(saved, ckpt.step, options)
            after = WarmupCosine(options.lr, options.warmup, options.horizon, options.min_lr_ratio)(ckpt.step)
            notes.append(f"the learning-rate schedule's cosine horizon changes from {old} to "
                         f"{options.horizon} steps: at step {ckpt.step} the lr moves from "
                         f"{before:.3e} to {after:.3e}")
        elif "steps" in overrides and old is not None and overrides["steps"] != old:
            steps = overrides["steps"]
            past = (f": the last {steps - old} steps train at the final lr "
                    f"{options.lr * options.min_lr_ratio:.3e}; pass --decay-steps {steps} to stretch "
                    "the schedule (the lr then changes from the resume step on)") if steps > old else \
                "; pass --decay-steps to change it"
            notes.append(f"the learning-rate schedule keeps its cosine horizon of {old} steps from the "
                         f"checkpoint (--steps is now {steps}){past}")
    return options, changed


__all__ = ["Trainer", "TrainOptions", "StepResult", "Diverged", "dropout_key", "resume_options",
           "validate_training_metadata", "checkpoint_model", "training_memory_bytes", "check_memory",
           "train_step_graph", "CHECKPOINT_NAME", "BEST_NAME", "DIVERGED_VAL_RATIO"]
