"""Random numbers: the splitmix64 generator of the TensorLib documents, and the counter-based
stream that dropout draws from.

`SplitMix64` is sequential (used for initialisation). `counter_uniform(key, stream, shape)` is
stateless: element i of the result depends only on (key, stream, i), so a dropout mask can be
recomputed in the backward pass and a resumed run draws exactly the masks it would have drawn.
"""
from __future__ import annotations

import math

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """The splitmix64 finaliser on one Python int."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


class SplitMix64:
    """splitmix64: state += golden ratio; output = mix(state). Floats from the top 24 bits."""

    def __init__(self, seed: int = 0):
        self.state = int(seed) & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + GOLDEN) & MASK64
        return mix64(self.state)

    def unit(self) -> float:
        """A float32 in [0, 1) from the top 24 bits."""
        return (self.next_u64() >> 40) * (1.0 / 16777216.0)   # exact: a float32 value

    def uniform(self, lo: float, hi: float) -> float:
        return float(np.float32(lo) + np.float32(hi - lo) * np.float32(self.unit()))

    def normal(self, mean: float = 0.0, std: float = 1.0) -> float:
        """Box-Muller with u1 in (0, 1] so the log is safe, as the TensorLib document does."""
        u1 = np.float32((self.next_u64() >> 40) + 1.0) / np.float32(16777217.0)
        u2 = self.unit()
        return float(np.float32(mean) + np.float32(std) * np.float32(
            math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)))

    # -- vectorised draws: exactly the same numbers as calling the scalar methods n times ------
    def _next_u64_array(self, n: int) -> np.ndarray:
        steps = np.arange(1, n + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            states = np.uint64(self.state) + steps * np.uint64(GOLDEN)
        self.state = (self.state + n * GOLDEN) & MASK64
        return mix64_array(states)

    def unit_array(self, n: int) -> np.ndarray:
        return (self._next_u64_array(n) >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)

    def uniform_array(self, shape, lo: float, hi: float) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        u = self.unit_array(n)
        return (np.float32(lo) + np.float32(hi - lo) * u).reshape(shape)

    def normal_array(self, shape, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        raw = self._next_u64_array(2 * n).reshape(n, 2)
        u1 = ((raw[:, 0] >> np.uint64(40)).astype(np.float32) + np.float32(1.0)) / np.float32(16777217.0)
        u2 = (raw[:, 1] >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
        z = np.sqrt(-2.0 * np.log(u1.astype(np.float64))) * np.cos(2.0 * np.pi * u2.astype(np.float64))
        return (np.float32(mean) + np.float32(std) * z.astype(np.float32)).reshape(shape)


def mix64_array(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = z.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(MIX1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(MIX2)
        z ^= z >> np.uint64(31)
    return z


def stream_base(key: int, stream: int) -> int:
    """The 64-bit start of stream `stream` under `key`."""
    return mix64((int(key) & MASK64) ^ mix64((int(stream) + 1) * GOLDEN))


def counter_uniform(key: int, stream: int, shape) -> np.ndarray:
    """float32 uniforms in [0, 1): element i is mix64(base + (i+1)*golden) >> 40, scaled."""
    n = int(np.prod(shape, dtype=np.int64))
    base = np.uint64(stream_base(key, stream))
    with np.errstate(over="ignore"):
        z = base + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GOLDEN)
    u = (mix64_array(z) >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return u.reshape(shape)


def dropout_keep_scale(key: int, stream: int, shape, p: float, dtype) -> np.ndarray:
    """The inverted-dropout multiplier: 1/(1-p) where kept, 0 where dropped."""
    keep = counter_uniform(key, stream, shape) >= np.float32(p)
    return keep.astype(dtype) * np.asarray(1.0 / (1.0 - p), dtype=dtype)
