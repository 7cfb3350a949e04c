"""Kernels of the numpy executor: causal attention in query blocks, forward and backward, with
and without the kept scores E and row sums l (``causal_attention_keep`` and
``causal_attention_backward_kept``, tensors of the graph made by graphlm/passes/kept_values.py;
their layout is graphlm.ops.causal_attention_keep_layout); and a decode step's attention against
the KV cache (``cached_attention``), which reads only the cache positions in use."""
from __future__ import annotations

import numpy as np

from graphlm.ops import attention_query_blocks, attention_score_size, causal_attention_keep_layout, heads_merged_swap

from . import pool
from ..reference import check_cached_position
from .table import kernel, scalar
from .tiling import run_blocks


# == causal attention ==================================================================================
# softmax(causal_mask(q @ k^T * scale)) @ v and its gradient, in query blocks of about
# graphlm.ops.ATTENTION_QUERY_BLOCK rows (graphlm.ops.attention_query_blocks; a kept-scores node
# names its own in attrs["query_block"]): query block [r0, r1) needs keys [0, r1) only, so the scores above the
# block diagonal (a quarter of them with two blocks) are never computed, exponentiated or
# multiplied, nor stored: the scores are kept block after block, block b of all matrices as one
# contiguous [..., r1 - r0, r1] array (strided sub-blocks would make NumPy's broadcasting passes
# buffer every operand and run 2.5x slower per element). Per run of matrices (ATTENTION_CHUNK
# score elements, so a block's passes stay in cache) the forward keeps E = exp(s - rowmax)
# unnormalised and l = rowsum(E); the output is (E @ v) / l, and the backward works from E and g/l:
#   ds = E * ((g/l) @ v^T - rowsum(g*o)/l)   (= P * (dP - rowsum(P*dP)), the softmax gradient)
#   dq = ds @ k * scale,  dk = ds^T @ q * scale,  dv = E^T @ (g/l)
# (dk and dv summed over the query blocks). The scale multiplies q (forward) and dq, dk (backward)
# instead of the T x T scores. This rounds differently from the reference's plain form (so the
# kernels say rounds_own_way=True; tests compare within 1e-6 relative); the results do not depend
# on the thread count.

ATTENTION_CHUNK = 1 << 17   # score elements per run of matrices (512 KiB of float32)


def _score_blocks(e, lead, blocks) -> list[np.ndarray]:
    """Views ``[*lead, r1 - r0, r1]`` of the query blocks in a score buffer of ``S * prod(lead)``
    elements, block after block (so a run of matrices of one block is contiguous)."""
    flat, m = e.reshape(-1), int(np.prod(lead, dtype=np.int64))
    views, at = [], 0
    for r0, r1 in blocks:
        size = (r1 - r0) * r1 * m
        views.append(flat[at:at + size].reshape(tuple(lead) + (r1 - r0, r1)))
        at += size
    return views


def _attention_chunks(lead, t: int, pieces: int = 1) -> list[tuple]:
    """Index tuples that select runs of matrices along the last leading axis (at most
    ATTENTION_CHUNK score elements each, and at least `pieces` runs where there are enough
    matrices). Leading shape () gives one run: the matrix with a new axis in front."""
    if not lead:
        return [(None,)]
    inner = lead[-1]
    per = max(1, min(inner, ATTENTION_CHUNK // max(1, t * t)))
    outer = int(np.prod(lead[:-1], dtype=np.int64))
    while per > 1 and outer * -(-inner // per) < pieces:
        per = -(-per // 2)
    return [tuple(o) + (slice(h, min(h + per, inner)),)
            for o in np.ndindex(*lead[:-1]) for h in range(0, inner, per)]


def _attention_closure(body, arrays, lead, t: int, flops: int):
    """A closure running `body` over runs of matrices of `arrays` (each indexed by the run), the
    runs cut finer and split over the executor's threads when the work is large."""
    def runs(pieces):
        return [tuple(a[idx] for a in arrays) for idx in _attention_chunks(lead, t, pieces)]
    return run_blocks(body, runs(1), runs if flops >= pool.MIN_SPLIT_ATTENTION_FLOPS else lambda n: [])


def attention_flops(shape) -> int:
    """The forward's product FLOPs with the masked quarter skipped (a split threshold only)."""
    t, d = shape[-2:]
    return 4 * int(np.prod(shape[:-2], dtype=np.int64)) * t * t * d * 3 // 4


def softmax_block(x, lb, r0, up):
    """One query block's scores x ``[m, r1 - r0, r1]`` (query rows from r0) to E = exp(x - rowmax)
    in place, the diagonal block's upper triangle `up` masked to 0; lb ``[m, r1 - r0, 1]`` gets
    rowsum(E)."""
    np.copyto(x[..., r0:], -np.inf, where=up)
    np.maximum.reduce(x, axis=-1, keepdims=True, out=lb)
    np.subtract(x, lb, x)
    np.exp(x, x)
    np.add.reduce(x, axis=-1, keepdims=True, out=lb)


def softmax_ds_block(s, x, ddb):
    """One query block of the softmax gradient, in place: s = (s - ddb) * E (E in x)."""
    np.subtract(s, ddb, s)
    np.multiply(s, x, s)   # E is 0 above the diagonal


# the attention kernels' two block steps; an executor deriving from this one may pass its own
ATTENTION_BLOCK_STEPS = (softmax_block, softmax_ds_block)


def _attention_scores(q, k, v, o, l, qs, e, scale, blocks, above, steps=ATTENTION_BLOCK_STEPS):
    """E (blocks `e`) and l of one run of matrices; and, when `o` is given, o = (E @ v) / l."""
    np.multiply(q, scale, qs)
    for (r0, r1), up, x in zip(blocks, above, e):
        lb = l[..., r0:r1, :]
        np.matmul(qs[..., r0:r1, :], np.swapaxes(k[..., :r1, :], -1, -2), x)
        steps[0](x, lb, r0, up)
        if o is not None:
            np.matmul(x, v[..., :r1, :], o[..., r0:r1, :])
    if o is not None:
        np.divide(o, l, o)


def _attention_gradients(q, k, v, o, g, l, dq, dk, dv, gs, dd, tmp, e, ds, scale, blocks,
                         steps=ATTENTION_BLOCK_STEPS):
    np.multiply(g, o, gs)
    np.add.reduce(gs, axis=-1, keepdims=True, out=dd)   # rowsum(g*o) = rowsum(P*dP)
    np.divide(dd, l, dd)
    np.divide(g, l, gs)
    for (r0, r1), x, s in zip(blocks, e, ds):
        np.matmul(gs[..., r0:r1, :], np.swapaxes(v[..., :r1, :], -1, -2), s)
        steps[1](s, x, dd[..., r0:r1, :])
        np.matmul(s, k[..., :r1, :], dq[..., r0:r1, :])
    # dk, dv: sums over the query blocks of ds_b^T @ q_b and E_b^T @ (g/l)_b, which reach keys
    # [0, r1): the last block (all keys) writes, the others add
    for i in reversed(range(len(blocks))):
        r0, r1 = blocks[i]
        last = i == len(blocks) - 1
        for a, b, out in ((ds[i], q, dk), (e[i], gs, dv)):
            target = out if last else tmp[..., :r1, :]
            np.matmul(np.swapaxes(a, -1, -2), b[..., r0:r1, :], target)
            if not last:
                np.add(out[..., :r1, :], target, out[..., :r1, :])
    np.multiply(dq, scale, dq)
    np.multiply(dk, scale, dk)


def attention_plan(node, shape):
    """(query blocks, the diagonal blocks' masks, scale) of an attention node on q of `shape`."""
    blocks = attention_query_blocks(shape[-2], node.attrs.get("query_block"))
    above = [~np.tri(r1 - r0, r1 - r0, dtype=bool) for r0, r1 in blocks]
    return blocks, above, scalar(node.attrs["scale"], node.dtype)


def _scores_specs(shape, dtype, query_block=None):
    """Scratch specs of E ``[*lead, S]`` and l ``[*lead, T, 1]`` for attention of `shape`."""
    lead, t = shape[:-2], shape[-2]
    return [(lead + (attention_score_size(t, query_block),), dtype), (lead + (t, 1), dtype)]


def keep_views(out, node) -> dict:
    """The parts y ([..., H, T, D], a view), e (flat) and l of a causal_attention_keep node's flat
    output, as views."""
    parts = {name: out[a:b].reshape(shape) for name, a, b, shape in
             causal_attention_keep_layout(node.inputs[0].shape, node.attrs["query_block"],
                                          node.attrs.get("heads_merged", False))}
    parts["y"] = heads_merged_swap(parts["y"], node.attrs)
    return parts


def _attention_scratch(node, pos):
    """q * scale, and (unless the node keeps them in its output) E and l."""
    shape = node.inputs[0].shape
    return [(shape, node.dtype)] + ([] if node.op == "causal_attention_keep" else _scores_specs(shape, node.dtype))


@kernel("causal_attention", "causal_attention_keep", scratch=_attention_scratch, rounds_own_way=True)
def build_causal_attention(node, out, ins, scratch, steps=ATTENTION_BLOCK_STEPS):
    q, k, v = ins
    if node.op == "causal_attention_keep":   # E and l are parts of the output (kept for the backward)
        (qs,), parts = scratch, keep_views(out, node)
        out, e, l = parts["y"], parts["e"], parts["l"]
    else:
        (qs, e, l), out = scratch, heads_merged_swap(out, node.attrs)
    blocks, above, scale = attention_plan(node, q.shape)
    lead, t = q.shape[:-2], q.shape[-2]
    body = lambda q, k, v, o, l, qs, *e: _attention_scores(q, k, v, o, l, qs, e, scale, blocks, above, steps)
    return _attention_closure(body, [q, k, v, out, l, qs, *_score_blocks(e, lead, blocks)], lead, t,
                              attention_flops(q.shape))


def _attention_backward_scratch(node, pos):
    shape, dt = node.inputs[0].shape, node.dtype
    qb = node.attrs.get("query_block")
    own = [_scores_specs(shape, dt, qb)[0], (shape, dt), (shape[:-1] + (1,), dt), (shape, dt)]  # ds, g/l, dd, tmp
    if node.op == "causal_attention_backward":   # without kept scores: E and l recomputed here
        own += _scores_specs(shape, dt)
    return own


@kernel("causal_attention_backward", "causal_attention_backward_kept", scratch=_attention_backward_scratch,
        rounds_own_way=True)
def build_causal_attention_backward(node, out, ins, scratch, steps=ATTENTION_BLOCK_STEPS):
    kept = node.op == "causal_attention_backward_kept"
    if kept:   # inputs q, k, v, o, E, l, g
        q, k, v, o, e, l, g = ins
        ds, gs, dd, tmp = scratch
    else:
        q, k, v, o, g = ins
        ds, gs, dd, tmp, e, l = scratch
    out = heads_merged_swap(out, node.attrs)   # [3, ..., H, T, D]
    shape = out.shape[1:]
    blocks, above, scale = attention_plan(node, shape)
    lead, t = shape[:-2], shape[-2]
    nb = len(blocks)

    def body(q, k, v, o, g, l, dq, dk, dv, gs, dd, tmp, *blocks_e_ds):
        e, ds = blocks_e_ds[:nb], blocks_e_ds[nb:]
        if not kept:   # the forward's E and l first (gs holds q * scale meanwhile)
            _attention_scores(q, k, None, None, l, gs, e, scale, blocks, above, steps)
        _attention_gradients(q, k, v, o, g, l, dq, dk, dv, gs, dd, tmp, e, ds, scale, blocks, steps)
    arrays = [q, k, v, o, g, l, out[0], out[1], out[2], gs, dd, tmp,
              *_score_blocks(e, lead, blocks), *_score_blocks(ds, lead, blocks)]
    return _attention_closure(body, arrays, lead, t, 2 * attention_flops(shape))


# == cached attention: one decode step against the KV cache ===========================================
# graphlm.ops.cached_attention reads only the `position` cached slots in use (NumPy views cut at
# the position fed this run) and its own key: e = exp(s - rowmax) over the position + 1 scores
# s = [q @ cache_k[:p]^T, sum(q*k)] * scale, then (e[:p] @ cache_v[:p] + e[p] * v) / rowsum(e).
# Fewer terms and the division last: it rounds its own way (rounds_own_way=True). Each (row, head)
# is its own product, so a row's values do not depend on the batch around it.

def _cached_attention_scratch(node, pos):
    """The scores [..., 1, T + 1], the row max / sum [..., 1, 1] and e[p] * v [..., 1, D]."""
    q, t = node.inputs[0], node.inputs[3].shape[-2]
    return [(q.shape[:-1] + (t + 1,), node.dtype), (q.shape[:-1] + (1,), node.dtype), (q.shape, node.dtype)]


@kernel("cached_attention", scratch=_cached_attention_scratch, rounds_own_way=True)
def build_cached_attention(node, out, ins, scratch):
    q, k, v, cache_k, cache_v, position = ins
    scores, l, tmp = scratch
    t, scale = cache_k.shape[-2], scalar(node.attrs["scale"], node.dtype)

    def run():
        p = check_cached_position(node, position, t)
        e = scores[..., :p + 1]
        np.matmul(q, np.swapaxes(cache_k[..., :p, :], -1, -2), out=e[..., :p])
        np.multiply(q, k, tmp)
        np.add.reduce(tmp, axis=-1, keepdims=True, out=e[..., p:])
        np.multiply(e, scale, e)
        np.maximum.reduce(e, axis=-1, keepdims=True, out=l)
        np.subtract(e, l, e)
        np.exp(e, e)
        np.add.reduce(e, axis=-1, keepdims=True, out=l)
        np.matmul(e[..., :p], cache_v[..., :p, :], out=out)
        np.multiply(e[..., p:], v, tmp)
        np.add(out, tmp, out)
        np.divide(out, l, out)
    return run
