"""The six initialisation policies of the TensorLib documents, drawing from `SplitMix64`.

Each policy is a function ``policy(shape, rng) -> np.ndarray`` (float32) that draws its numbers
from the sequential splitmix64 generator in row-major order, so a model initialised with one
seed is the same on every machine:

    zero, one                         constants (biases, norm weights)
    xavier_uniform, xavier_normal     U(+-sqrt(6/(fan_in+fan_out))), N(0, sqrt(2/(fan_in+fan_out)))
    he_uniform, he_normal             U(+-sqrt(6/fan_in)),             N(0, sqrt(2/fan_in))

`uniform(bound)` and `normal(std)` make fixed-scale policies (the attention QKV weight uses
``uniform(sqrt(3/C))``; GPT-2 uses ``normal(0.02)``).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .random import SplitMix64

Policy = Callable[[tuple, SplitMix64], np.ndarray]


def fans(shape) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight: PyTorch's rule for a [out, in, *receptive] shape.

    Dimensions beyond the first two multiply both fans (a receptive field); a 1-d shape has
    fan_in = fan_out = its length.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def zero(shape, rng: SplitMix64 | None = None) -> np.ndarray:
    """All zeros (biases). Draws nothing."""
    return np.zeros(shape, dtype=np.float32)


def one(shape, rng: SplitMix64 | None = None) -> np.ndarray:
    """All ones (norm weights). Draws nothing."""
    return np.ones(shape, dtype=np.float32)


def xavier_uniform(shape, rng: SplitMix64) -> np.ndarray:
    fan_in, fan_out = fans(shape)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform_array(shape, -bound, bound)


def xavier_normal(shape, rng: SplitMix64) -> np.ndarray:
    fan_in, fan_out = fans(shape)
    return rng.normal_array(shape, 0.0, math.sqrt(2.0 / (fan_in + fan_out)))


def he_uniform(shape, rng: SplitMix64) -> np.ndarray:
    fan_in, _ = fans(shape)
    bound = math.sqrt(6.0 / fan_in)
    return rng.uniform_array(shape, -bound, bound)


def he_normal(shape, rng: SplitMix64) -> np.ndarray:
    fan_in, _ = fans(shape)
    return rng.normal_array(shape, 0.0, math.sqrt(2.0 / fan_in))


def uniform(bound: float) -> Policy:
    """A policy drawing U(-bound, bound)."""
    bound = float(bound)

    def policy(shape, rng: SplitMix64) -> np.ndarray:
        return rng.uniform_array(shape, -bound, bound)

    policy.__name__ = f"uniform({bound:.6g})"
    return policy


def normal(std: float, mean: float = 0.0) -> Policy:
    """A policy drawing N(mean, std)."""
    std, mean = float(std), float(mean)

    def policy(shape, rng: SplitMix64) -> np.ndarray:
        return rng.normal_array(shape, mean, std)

    policy.__name__ = f"normal({mean:.6g}, {std:.6g})"
    return policy


POLICIES: dict[str, Policy] = {
    "zero": zero, "one": one, "xavier_uniform": xavier_uniform, "xavier_normal": xavier_normal,
    "he_uniform": he_uniform, "he_normal": he_normal,
}


def get_policy(policy) -> Policy:
    """A policy by name ("xavier_uniform") or the callable itself."""
    if callable(policy):
        return policy
    try:
        return POLICIES[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown init policy {policy!r}; known: {', '.join(POLICIES)}") from None


__all__ = ["fans", "zero", "one", "xavier_uniform", "xavier_normal", "he_uniform", "he_normal",
           "uniform", "normal", "POLICIES", "get_policy"]
