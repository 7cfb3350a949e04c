"""Kernels of the numpy executor: the optimizer's update ops (global norm, AdamW), in place."""
from __future__ import annotations

import functools
import math

import numpy as np

from ..base import ExecutionError, node_where
from . import pool
from .pool import parallel, threaded
from .table import kernel, scalar
from .tiling import flat_view, size_groups


# == optimizer updates (graphlm/ops.py "optimizer ops"; owned with graphlm.optim) =====================
# The same arithmetic as the reference kernels, in the same order (bit-identical results), in
# place. AdamW walks every parameter in cache-sized chunks and does all its passes on a chunk
# while it is in cache (one trip through memory instead of a dozen); two chunk-sized scratch
# buffers hold the temporaries, so nothing is allocated per run.

@kernel("global_norm")
def _global_norm(node, out, ins, scratch):
    """sqrt(sum of every gradient's squares), as the reference adds them: a float dot (BLAS) per
    contiguous gradient into a running total of node.dtype, in input order. On n threads the
    dots of n runs of gradients (of about equal size) are computed at once, then added in order:
    the same total bit for bit."""
    flats = [flat_view(g, (-1,)) for g in ins]   # (None: reshaped, a copy, at each run as the reference does)
    dots: list = [None] * len(ins)

    def dot(a, b):
        for i in range(a, b):
            f = ins[i].reshape(-1) if flats[i] is None else flats[i]
            dots[i] = np.dot(f, f) if f.flags.c_contiguous and f.strides[0] else np.sum(ins[i] * ins[i])
    sizes = [g.size for g in ins]
    all_dots = functools.partial(dot, 0, len(ins))
    if sum(sizes) >= pool.MIN_SPLIT_ROWS:
        all_dots = threaded(all_dots, lambda n: [functools.partial(dot, a, b) for a, b in size_groups(sizes, n)])

    def run():
        all_dots()
        total = np.zeros((), dtype=node.dtype)
        for d in dots:
            total += d
        np.copyto(out, np.sqrt(total), casting="unsafe")
    return run


_ADAMW_CHUNK = 1 << 15


def adamw_schedule(node, lr_a, step_a) -> tuple[float, float, float]:
    """This run's (lr, lr / (1 - beta1^t), sqrt(1 - beta2^t)) of an adamw_update node, from its
    learning-rate and step-count inputs; a step count below 1 is an error naming the node."""
    t = int(step_a)
    if t < 1:
        raise ExecutionError(f"{node_where(node)}: the step count must be >= 1, got {t}")
    lr, a = float(lr_a), node.attrs
    return lr, lr / (1.0 - a["beta1"] ** t), math.sqrt(1.0 - a["beta2"] ** t)


def _adamw_scratch(node, pos):
    n = min(max(t.size for t in node.inputs[3::4]), _ADAMW_CHUNK)
    return [((n,), node.inputs[3].dtype), ((n,), node.inputs[3].dtype)]


def _flat_or_none(*arrays):
    flats = [flat_view(a, (-1,)) for a in arrays]
    return None if any(f is None for f in flats) else flats


@kernel("adamw_update", scratch=_adamw_scratch)
def _adamw_update(node, out, ins, scratch):
    lr_a, step_a, coef_a = ins[:3]
    a = node.attrs
    b1, b2, eps = a["beta1"], a["beta2"], a["eps"]
    buf1, buf2 = scratch
    pieces = []   # (p, grad, m, v, weight decay, dtype): 1-d chunks, or whole arrays if not flat
    for k, wd in enumerate(a["weight_decay"]):
        p, grad, m, v = ins[3 + 4 * k: 7 + 4 * k]
        flats = _flat_or_none(p, grad, m, v)
        if flats is None:
            pieces.append((p, grad, m, v, wd, p.dtype, None))
            continue
        for s0 in range(0, p.size, _ADAMW_CHUNK):
            sl = slice(s0, min(p.size, s0 + _ADAMW_CHUNK))
            pieces.append(tuple(f[sl] for f in flats) + (wd, p.dtype, sl.stop - sl.start))

    keys = sorted({(pc[5].str, pc[4]) for pc in pieces})
    groups: dict[int, list] = {}   # threads -> [(pieces, buf1, buf2)]: runs of about equal size

    def groups_for(n):
        if n not in groups:
            groups[n] = [(pieces[a:b], *((buf1, buf2) if k == 0 else (np.empty_like(buf1), np.empty_like(buf2))))
                         for k, (a, b) in enumerate(size_groups([pc[0].size for pc in pieces], n))]
        return groups[n]

    def update(part, buf1, buf2, consts):
        for p, grad, m, v, wd, dt, n in part:
            coef, decay, sb1, cb1, sb2, cb2, sbc2, seps, sstep = consts[(dt.str, wd)]
            if n is None:   # not flat-able: whole-array temporaries (allocates)
                g, tmp = np.empty(p.shape, dt), np.empty(p.shape, dt)
            else:
                g, tmp = buf1[:n], buf2[:n]
            np.multiply(grad, coef, out=g)
            if wd:
                p *= decay
            m *= sb1
            np.multiply(cb1, g, out=tmp)
            m += tmp
            v *= sb2
            np.multiply(cb2, g, out=tmp)
            tmp *= g
            v += tmp
            np.sqrt(v, out=tmp)
            tmp /= sbc2
            tmp += seps
            np.multiply(sstep, m, out=g)
            g /= tmp
            p -= g

    def run():
        lr, step_size, bc2_sqrt = adamw_schedule(node, lr_a, step_a)
        consts = {}
        for dts, wd in keys:
            dt = np.dtype(dts)
            consts[(dts, wd)] = (
                coef_a.astype(dt), scalar(1.0 - lr * wd, dt), scalar(b1, dt), scalar(1.0 - b1, dt),
                scalar(b2, dt), scalar(1.0 - b2, dt), scalar(bc2_sqrt, dt), scalar(eps, dt), scalar(step_size, dt))
        n = pool.get_threads()
        if n == 1 or len(pieces) < 2:
            update(pieces, buf1, buf2, consts)
        else:
            parallel([functools.partial(update, part, g1, g2, consts) for part, g1, g2 in groups_for(n)])
        out[...] = 0.0
    return run
