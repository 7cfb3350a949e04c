"""Optimizers as graph ops (as ggml's OPT_STEP_ADAMW): they add their update nodes to the graph.

    opt = AdamW(lr=WarmupCosine(1e-3, warmup_steps=100, total_steps=2000), clip_norm=1.0)
    step = opt.minimize(loss)                  # grads, global norm, clipping, one update node
    program = executor.compile(g, [loss, step.grad_norm, step.update])
    state.update(opt.init_state(params))       # moments, zeros, in `state` next to the params
    program.run({**batch, **opt.feeds(s)}, state)   # s = 0, 1, 2, ...: lr and t fed per step

The learning rate and the step count t are graph inputs, so a schedule never recompiles. The
gradients are clipped by ``clip_norm / max(norm, clip_norm)`` (1 when the global norm is
already within `clip_norm`). The moments are `state` leaves named ``optimizer.m.<param>`` and
``optimizer.v.<param>``; `init_state` lays them out as views of one flat buffer per kind, so an
executor may update all parameters in a few passes over that buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import numpy as np

from . import ops
from .autodiff import grad
from .ir import GraphError, Tensor

LR_INPUT = "optimizer.lr"
STEP_INPUT = "optimizer.step"

Schedule = Callable[[int], float]


class WarmupCosine:
    """Linear warmup from 0 to `peak_lr` over `warmup_steps`, then cosine decay to
    ``min_ratio * peak_lr`` at `total_steps` (and flat after). Called with the 0-based step."""

    def __init__(self, peak_lr: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
        if not (math.isfinite(peak_lr) and peak_lr > 0):
            raise ValueError(f"WarmupCosine: peak_lr must be a positive number, got {peak_lr}")
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(f"WarmupCosine: need warmup_steps >= 0 and total_steps >= 1, got "
                             f"{warmup_steps} and {total_steps}")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"WarmupCosine: min_ratio must be in [0, 1], got {min_ratio}")
        self.peak_lr, self.warmup_steps, self.total_steps = float(peak_lr), int(warmup_steps), int(total_steps)
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * cosine)

    def __repr__(self):
        return (f"WarmupCosine(peak_lr={self.peak_lr}, warmup_steps={self.warmup_steps}, "
                f"total_steps={self.total_steps}, min_ratio={self.min_ratio})")


def default_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Weight decay for matrices and embedding tables; none for biases and norm gains (1-d)."""
    return len(shape) >= 2


@dataclass
class OptimizerStep:
    """The nodes `Optimizer.minimize` added: compile `update` (and whatever else you want)."""

    loss: Tensor
    params: list[Tensor]
    grads: list[Tensor]
    grad_norm: Tensor      # the global L2 norm of the gradients, before clipping
    clip_coef: Tensor      # clip_norm / max(norm, clip_norm), or 1
    update: Tensor         # the in-place update node (a scalar token)
    lr: Tensor             # the fed learning-rate input
    step: Tensor | None    # the fed step-count input (AdamW's bias correction)


class Optimizer:
    """Shared parts: lr (a float or a schedule of the 0-based step), clipping, decay policy."""

    buffer_kinds: tuple[str, ...] = ()
    uses_step = False   # whether the update reads the step count (AdamW's bias correction)

    def __init__(self, lr: Union[float, Schedule], weight_decay: float, clip_norm: float | None,
                 decay: Callable[[str, tuple], bool] = default_decay):
        if not callable(lr) and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"{type(self).__name__}: lr must be a non-negative number or a "
                             f"schedule, got {lr!r}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"{type(self).__name__}: weight_decay must be >= 0, got {weight_decay}")
        if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"{type(self).__name__}: clip_norm must be positive or None, got {clip_norm}")
        self.lr, self.weight_decay, self.clip_norm, self.decay = lr, float(weight_decay), clip_norm, decay
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}

    # -- per step ------------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based step `step`."""
        return float(self.lr(step)) if callable(self.lr) else float(self.lr)

    def feeds(self, step: int) -> dict[str, np.ndarray]:
        """The inputs of 0-based step `step`: its learning rate and the step count t = step+1."""
        out = {LR_INPUT: np.asarray(self.lr_at(step), np.float32)}
        if self.uses_step:
            out[STEP_INPUT] = np.asarray(step + 1, np.int64)
        return out

    # -- graph building ------------------------------------------------------------------------------
    def minimize(self, loss: Tensor, params: Sequence[Tensor] | None = None) -> OptimizerStep:
        """Add gradients, the global norm, clipping and the update node for `params` (default:
        every param of the loss's graph) to the loss's graph."""
        graph = loss.graph
        params = list(graph.params.values()) if params is None else list(params)
        if not params:
            raise GraphError(f"{type(self).__name__}.minimize: the graph '{graph.name}' has no params")
        for p in params:
            if not isinstance(p, Tensor) or p.op != "param" or p.graph is not graph:
                raise GraphError(f"{type(self).__name__}.minimize: {p!r} is not a param of graph "
                                 f"'{graph.name}'")
        grads = grad(loss, params)
        with graph.scope("optimizer"):
            lr = graph.input(LR_INPUT, (), np.float32)
            step = graph.input(STEP_INPUT, (), np.int64) if self.uses_step else None
            norm = ops.global_norm(grads)
            if self.clip_norm is None:
                coef = graph.const(np.float32(1.0))
            else:
                c = np.float32(self.clip_norm)
                coef = ops.div(c, ops.maximum(norm, c))
            buffers = {}
            for kind in self.buffer_kinds:
                buffers[kind] = [graph.state(self.buffer_name(kind, p.name), p.shape, p.dtype) for p in params]
            wd = [self.weight_decay if self.decay(p.name, p.shape) else 0.0 for p in params]
            update = self._update(lr, step, coef, params, grads, buffers, wd)
        self._shapes = {p.name: (p.shape, p.dtype) for p in params}
        return OptimizerStep(loss, params, grads, norm, coef, update, lr, step)

    @staticmethod
    def buffer_name(kind: str, param: str) -> str:
        return f"optimizer.{kind}.{param}"

    def state_names(self) -> list[str]:
        """Names of the optimizer's state leaves, in a fixed order (kind, then param order)."""
        return [self.buffer_name(k, p) for k in self.buffer_kinds for p in self._shapes]

    def init_state(self, params: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Zeroed optimizer state for the params `minimize` saw: per buffer kind, one flat
        buffer and a C-contiguous view of it per param."""
        if not self._shapes:
            raise GraphError(f"{type(self).__name__}.init_state: call minimize first")
        out: dict[str, np.ndarray] = {}
        for kind in self.buffer_kinds:
            by_dtype: dict[np.dtype, list[str]] = {}
            for name, (shape, dtype) in self._shapes.items():
                by_dtype.setdefault(np.dtype(dtype), []).append(name)
            for dtype, names in by_dtype.items():
                total = sum(int(np.prod(self._shapes[n][0], dtype=np.int64)) for n in names)
                flat = np.zeros(total, dtype)
                offset = 0
                for n in names:
                    shape = self._shapes[n][0]
                    size = int(np.prod(shape, dtype=np.int64))
                    out[self.buffer_name(kind, n)] = flat[offset:offset + size].reshape(shape)
                    offset += size
        return out

    def _update(self, lr, step, coef, params, grads, buffers, wd) -> Tensor:
        raise NotImplementedError

    def options(self) -> dict:
        """The hyperparameters as plain JSON-able values (saved in checkpoints)."""
        lr = repr(self.lr) if callable(self.lr) else self.lr
        return {"optimizer": type(self).__name__, "lr": lr, "weight_decay": self.weight_decay,
                "clip_norm": self.clip_norm}


class SGD(Optimizer):
    """SGD with optional momentum (torch.optim.SGD's form: coupled decay, buffer from zeros)."""

    def __init__(self, lr: Union[float, Schedule] = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, clip_norm: float | None = None,
                 decay: Callable[[str, tuple], bool] = default_decay):
        super().__init__(lr, weight_decay, clip_norm, decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"SGD: momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)
        self.buffer_kinds = ("momentum",) if momentum else ()

    def _update(self, lr, step, coef, params, grads, buffers, wd):
        bufs = buffers.get("momentum")
        groups = [(p, g) + ((bufs[i],) if bufs else ()) for i, (p, g) in enumerate(zip(params, grads))]
        return ops.sgd_update(lr, coef, groups, momentum=self.momentum, weight_decay=wd)

    def options(self):
        return {**super().options(), "momentum": self.momentum}


class AdamW(Optimizer):
    """AdamW (Loshchilov & Hutter) exactly as torch.optim.AdamW: bias-corrected moments,
    decoupled weight decay ``p *= 1 - lr*wd`` (for params where `decay(name, shape)` holds)."""

    buffer_kinds = ("m", "v")
    uses_step = True

    def __init__(self, lr: Union[float, Schedule] = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, clip_norm: float | None = 1.0,
                 decay: Callable[[str, tuple], bool] = default_decay):
        super().__init__(lr, weight_decay, clip_norm, decay)
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"AdamW: eps must be positive, got {eps}")
        self.betas, self.eps = (b1, b2), float(eps)

    def _update(self, lr, step, coef, params, grads, buffers, wd):
        groups = list(zip(params, grads, buffers["m"], buffers["v"]))
        return ops.adamw_update(lr, step, coef, groups, betas=self.betas, eps=self.eps, weight_decay=wd)

    def options(self):
        return {**super().options(), "betas": list(self.betas), "eps": self.eps}


__all__ = ["SGD", "AdamW", "Optimizer", "OptimizerStep", "WarmupCosine", "default_decay",
           "LR_INPUT", "STEP_INPUT"]
