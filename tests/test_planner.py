"""The memory planner on small graphs whose right plan can be worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors
import graphlm as gl
from graphlm.executors.planner import ALIGN, Block, _lower_bound, _place, aligned

NUMPY = executors.get("numpy")


def plan_of(outputs):
    return NUMPY.compile(outputs[0].graph, outputs).plan


def test_elementwise_chain_runs_in_place_in_one_block():
    g = gl.Graph("chain")
    x = g.input("x", (8, 16))
    m = x * 2.0                   # reads the feed: a new block
    t = gl.tanh(m)                # in place over the dying product
    e = gl.exp(t)                 # in place again
    s = gl.sigmoid(e)             # and again
    y = gl.sum(s)
    plan = plan_of([y])
    assert plan.entries[m.id].kind == "arena"
    assert [plan.entries[n.id].kind for n in (t, e, s)] == ["inplace"] * 3
    assert all(plan.entries[n.id].base == m.id for n in (t, e, s))
    assert plan.buffer_of(s) == plan.buffer_of(m)
    assert plan.entries[m.id].last == plan.entries[t.id].first
    assert plan.entries[x.id].kind == "leaf" and plan.entries[y.id].kind == "output"


def test_no_in_place_over_a_value_still_needed():
    g = gl.Graph("fanout")
    x = g.input("x", (4, 4))
    a = gl.tanh(x)
    b = gl.exp(a)                 # a is read again below: b must not overwrite it
    c = b + a
    plan = plan_of([gl.sum(c)])
    assert plan.entries[b.id].kind == "arena"
    assert plan.entries[c.id].kind == "inplace"  # both inputs die at c
    ob, nb = plan.buffer_of(b)
    oa, na = plan.buffer_of(a)
    assert ob >= oa + na or oa >= ob + nb


def test_views_share_their_base_and_extend_its_life():
    g = gl.Graph("views")
    x = g.input("x", (4, 6))
    a = gl.tanh(x)
    t = gl.transpose(a)           # a view of a
    r = gl.reshape(t, (24,))      # a reshape of transposed data needs a copy
    s = a[1:3]                    # a view of a
    y = gl.sum(gl.exp(r)) + gl.sum(s)
    plan = plan_of([y])
    assert plan.entries[t.id].kind == "view" and plan.entries[t.id].base == a.id
    assert plan.entries[s.id].kind == "view" and plan.entries[s.id].base == a.id
    assert plan.entries[r.id].kind == "arena"
    assert plan.entries[a.id].last >= plan.entries[s.id].last
    off, nbytes = plan.buffer_of(s)
    assert off == plan.buffer_of(a)[0] + 6 * 4 and nbytes == 2 * 6 * 4


def test_outputs_and_their_view_roots_are_never_in_the_arena():
    g = gl.Graph("outs")
    x = g.input("x", (4, 4))
    a = gl.tanh(x)
    v = gl.reshape(a, (16,))
    b = gl.exp(gl.sum(a, axis=0))
    plan = plan_of([v, b])
    assert plan.entries[a.id].kind == "output" and plan.entries[a.id].offset is None
    assert plan.entries[v.id].kind == "view" and plan.entries[v.id].base == a.id
    assert plan.entries[b.id].kind == "output"


def test_placement_reuses_freed_space_and_reaches_the_lower_bound():
    # three blocks: 0 and 1 live together, 2 lives after 0 dies and fits in 0's bytes
    blocks = [Block(0, 1024, 0, 1, 0), Block(1, 512, 0, 3, 1), Block(2, 1024, 2, 3, 2)]
    offsets = _place(blocks, sorted(blocks, key=lambda b: -b.nbytes))
    assert offsets[2] == offsets[0]
    top = max(offsets[b.id] + b.nbytes for b in blocks)
    assert top == _lower_bound(blocks, 4) == 1536


def test_placement_never_overlaps_live_blocks():
    rng = np.random.default_rng(0)
    blocks = []
    for i in range(60):
        first = int(rng.integers(0, 40))
        blocks.append(Block(i, aligned(int(rng.integers(1, 5000))), first, first + int(rng.integers(0, 10)), i))
    offsets = _place(blocks, sorted(blocks, key=lambda b: (-b.nbytes, b.id)))
    for a in blocks:
        assert offsets[a.id] % ALIGN == 0
        for b in blocks:
            if a.id < b.id and a.first <= b.last and b.first <= a.last:
                assert offsets[a.id] + a.nbytes <= offsets[b.id] or offsets[b.id] + b.nbytes <= offsets[a.id]


def test_plan_report_fields():
    g = gl.Graph("report")
    x = g.input("x", (32, 32))
    w = g.param("w", (32, 32))
    h = x
    for _ in range(4):
        h = gl.tanh(h @ w)
    loss = gl.mean(h * h)
    (dw,) = gl.grad(loss, [w])
    plan = plan_of([loss, dw])
    assert plan.arena_bytes >= plan.lower_bound_bytes > 0
    assert plan.naive_bytes > plan.arena_bytes
    assert plan.schedule and all(nid in plan.entries for nid in plan.schedule)
    assert all(e.first <= e.last for e in plan.entries.values())
    assert plan.arena_bytes % ALIGN == 0 and not plan.overlapping_pairs()
    text = str(plan)
    assert "arena" in text and "lower bound" in text and "in place" in text
    with pytest.raises(KeyError):
        plan.buffer_of(g.input("unused", (1,)))
