"""Kernels of the numpy executor: dropout's keep mask (counter-based, drawn in cache-sized chunks),
its application, a dropout node left whole, and the dropout mask op."""
from __future__ import annotations

import functools
import math

import numpy as np

from graphlm.random import GOLDEN, MASK64, MIX1, MIX2, dropout_keep_scale, stream_base

from . import pool
from .pool import parallel
from .table import kernel
from .tiling import blocked, even_cuts


_MASK_CHUNK = 1 << 15   # elements per pass when drawing a mask (uint64 temporaries stay in cache)


def keep_threshold(p: float) -> int:
    """The 64-bit threshold of the keep test: mix64(...) >= this  <=>  the uniform >= float32(p)
    (see keep_mask_drawer)."""
    return math.ceil(float(np.float32(p)) * 2 ** 24) << 40


def keep_mask_drawer(shape, stream: int, p: float):
    """A function ``draw(key, mask)`` filling the boolean `mask` (of `shape`) with exactly
    ``graphlm.random.counter_uniform(key, stream, shape) >= float32(p)``, in cache-sized chunks
    with preallocated temporaries (nothing allocated per call); on n executor threads, n
    element ranges at once (each element's value depends only on its index).

    ``u = (mix64(base + (i+1)*golden) >> 40) * 2^-24 >= p`` is the integer test
    ``mix64(...) >= ceil(float32(p) * 2^24) << 40`` (u is k * 2^-24 exactly, k < 2^24). The test
    reads only bits 40-63, which mix64's last step ``z ^= z >> 31`` leaves as they are (z >> 31
    is zero from bit 33 up), so the drawer skips that step: 8 passes per chunk, not 10."""
    n = int(np.prod(shape, dtype=np.int64))
    c = min(n, _MASK_CHUNK)
    with np.errstate(over="ignore"):
        steps = np.arange(1, c + 1, dtype=np.uint64) * np.uint64(GOLDEN)
    threshold = np.uint64(keep_threshold(p))
    m1, m2 = np.uint64(MIX1), np.uint64(MIX2)
    s30, s27 = np.uint64(30), np.uint64(27)

    def draw_range(base, flat, lo, hi, z, t):
        for start in range(lo, hi, c):
            k = min(c, hi - start)
            zk, tk = z[:k], t[:k]
            np.add(steps[:k], np.uint64((base + start * GOLDEN) & MASK64), out=zk)
            np.right_shift(zk, s30, out=tk)
            np.bitwise_xor(zk, tk, out=zk)
            np.multiply(zk, m1, out=zk)
            np.right_shift(zk, s27, out=tk)
            np.bitwise_xor(zk, tk, out=zk)
            np.multiply(zk, m2, out=zk)   # (mix64's last step, z ^= z >> 31, keeps bits 33-63)
            np.greater_equal(zk, threshold, out=flat[start:start + k])

    ranges: dict[int, list] = {}   # threads -> [(lo, hi, z, t)], temporaries per range

    def draw(key: int, mask: np.ndarray) -> None:
        flat, base = mask.reshape(-1), stream_base(key, stream)
        threads = pool.get_threads()
        if n < pool.MIN_BLOCKS_PER_THREAD * threads * c:
            threads = 1
        if threads not in ranges:
            ranges[threads] = [(lo, hi, np.empty(c, np.uint64), np.empty(c, np.uint64))
                               for lo, hi in even_cuts(n, threads, c)]
        parts = [functools.partial(draw_range, base, flat, *r) for r in ranges[threads]]
        if len(parts) == 1:
            parts[0]()
        else:
            parallel(parts)
    return draw


def _apply_mask(x, mask, out, p: float, dtype):
    """A closure computing out = (x * mask) * (1/(1-p)) block by block."""
    scale = np.asarray(1.0 / (1.0 - p), dtype=dtype)

    def body(x, mask, out):  # x * keep * scale == x * (keep * scale) bit for bit (keep is 0 or 1)
        np.multiply(x, mask, out=out)
        np.multiply(out, scale, out=out)
    return blocked(body, [x, mask, out])


@kernel("dropout_keep")
def _dropout_keep(node, out, ins, scratch):
    (key,) = ins
    draw = keep_mask_drawer(node.shape, node.attrs["stream"], node.attrs["p"])
    return lambda: draw(int(key), out)


@kernel("dropout_apply", inplace=(0,))
def _dropout_apply(node, out, ins, scratch):
    x, mask = ins
    return _apply_mask(x, mask, out, node.attrs["p"], node.dtype)


@kernel("dropout", inplace=(0,), scratch=lambda node, pos: [(node.shape, np.bool_)])
def _dropout(node, out, ins, scratch):
    """A dropout node left as it is (the dropout_masks pass normally rewrites it): the mask drawn
    into scratch, then applied."""
    x, key = ins
    (mask,) = scratch
    draw = keep_mask_drawer(node.shape, node.attrs["stream"], node.attrs["p"])
    apply = _apply_mask(x, mask, out, node.attrs["p"], node.dtype)

    def run():
        draw(int(key), mask)
        apply()
    return run


@kernel("dropout_mask")
def _dropout_mask(node, out, ins, scratch):
    (key,) = ins
    stream, p = node.attrs["stream"], node.attrs["p"]
    return lambda: np.copyto(out, dropout_keep_scale(int(key), stream, node.shape, p, node.dtype))
