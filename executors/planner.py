"""Static memory planning for the numpy executor: schedule, liveness, aliasing, arena offsets.

Given the nodes a program runs (in run order), the planner decides where every value lives:

- leaves (`input`, `param`, `state`) and `const` values live outside the arena;
- a view op (reshape of data whose strides allow it, transpose, broadcast_to, slice) shares the
  buffer of its input's *root* and stretches that buffer's lifetime to its own last use;
- a graph output, and the root of any output that is a view, gets a dedicated buffer outside the
  arena that nothing else ever writes (the program copies outputs out at the end of a run);
- a node whose kernel may write over one of its inputs does so when that input is the full
  buffer of a dying intermediate of the same shape and dtype ("in place");
- every other node, and every scratch array a kernel asks for, gets a block of the arena;
- a kept value (a tensor marked ``attrs["kept"]`` by a graph pass: what a forward keeps for its
  backward) is planned like any other value; the plan counts its bytes (`kept_bytes`, and per
  block `kept_in`) so the reports and the arena picture can show them.

Blocks are placed by TFLite's greedy-by-size rule (largest first, into the smallest gap between
blocks whose lifetimes overlap); a couple of other orderings are tried and the smallest arena is
kept. Offsets and sizes are multiples of `ALIGN` bytes. Steps are positions in `schedule`; a
block is live on the closed interval [first, last], and two blocks may share bytes only when
their intervals are disjoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from graphlm.ir import Tensor
from graphlm.layout import apply_view, layouts
from graphlm.layout import address as _address, stand_in as _proto
from graphlm.registry import REGISTRY

ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` uninitialised bytes starting on an ALIGN boundary (the arena's, and its stand-ins')."""
    raw = np.empty(int(nbytes) + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + int(nbytes)]


@dataclass
class Entry:
    """Where one node's value lives.

    kind: "arena" (its own arena block), "inplace" (shares the block of `base`, an input it
    overwrote), "view" (a view of `base`'s buffer), "leaf" (input/param/state), "const", or
    "output" (a dedicated buffer outside the arena that survives to the end of the run).
    offset/nbytes: the byte range in the arena (offset None outside the arena; for a view, the
    range the view spans). first: the step that produces it; last: the last step that reads it.
    """

    node_id: int
    kind: str
    offset: int | None
    nbytes: int
    base: int | None
    first: int
    last: int


@dataclass
class Block:
    """A byte range of the arena (or a dedicated output buffer) and who uses it when."""

    id: int
    nbytes: int          # aligned size
    first: int
    last: int
    owner: int           # node id of the root that owns it (for scratch: the node using it)
    members: list[int] = field(default_factory=list)
    scratch: bool = False
    dedicated: bool = False
    offset: int | None = None


@dataclass
class Scratch:
    """A temporary array a kernel uses during its step."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: np.dtype


class Plan:
    """The memory plan of one program; see the module docstring."""

    def __init__(self, schedule, entries, blocks, scratch, storage, view_offset, inplace_input,
                 arena_bytes, lower_bound_bytes, naive_bytes, output_bytes, strategy, kept=None):
        self.schedule: list[int] = schedule
        self.entries: dict[int, Entry] = entries
        self.blocks: list[Block] = blocks
        self.scratch: dict[int, list[Scratch]] = scratch
        self.storage: dict[int, int] = storage  # node id -> node id owning its memory
        self.view_offset: dict[int, int] = view_offset   # view node -> byte offset from root start
        self.inplace_input: dict[int, int] = inplace_input  # node id -> input position it overwrote
        self.arena_bytes = arena_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.naive_bytes = naive_bytes
        self.output_bytes = output_bytes
        self.strategy = strategy
        self.kept: dict[int, int] = dict(kept or {})   # kept-value node id -> its bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes of the kept values (inside the arena, or in output buffers where one is an output)."""
        return sum(self.kept.values())

    def kept_in(self, block: Block) -> int:
        """Bytes of kept values stored in `block` (its own value, or views of it)."""
        return sum(nbytes for nid, nbytes in self.kept.items() if self.storage.get(nid) == block.owner
                   and not block.scratch)

    @property
    def inplace_count(self) -> int:
        return sum(e.kind == "inplace" for e in self.entries.values())

    @property
    def view_count(self) -> int:
        return sum(e.kind == "view" for e in self.entries.values())

    def buffer_of(self, tensor) -> tuple[int | None, int]:
        """(arena byte offset, nbytes) of a tensor's storage; offset None outside the arena."""
        nid = tensor.id if isinstance(tensor, Tensor) else int(tensor)
        if nid not in self.entries:
            raise KeyError(f"node {getattr(tensor, 'label', nid)} is not part of this program")
        e = self.entries[nid]
        return e.offset, e.nbytes

    def overlapping_pairs(self) -> list[tuple[int, int]]:
        """Pairs of arena blocks whose lifetimes overlap and whose bytes overlap (must be empty)."""
        arena = sorted((b for b in self.blocks if not b.dedicated and b.nbytes), key=lambda b: b.offset)
        bad = []
        for i, a in enumerate(arena):
            for b in arena[i + 1:]:
                if b.offset >= a.offset + a.nbytes:
                    break
                if a.first <= b.last and b.first <= a.last:
                    bad.append((a.id, b.id))
        return bad

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"
        ratio = self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0
        saving = self.naive_bytes / self.arena_bytes if self.arena_bytes else float("inf")
        return (f"memory plan: {len(self.schedule)} steps, arena {mib(self.arena_bytes)} "
                f"(lower bound {mib(self.lower_bound_bytes)}, x{ratio:.3f}), naive "
                f"{mib(self.naive_bytes)} (x{saving:.2f} saved), outputs {mib(self.output_bytes)}, "
                f"{self.inplace_count} in place, {self.view_count} views, "
                f"{sum(len(s) for s in self.scratch.values())} scratch, kept values "
                f"{mib(self.kept_bytes)} ({len(self.kept)} tensors), placement {self.strategy}")

    __repr__ = __str__


# Signature of the executor's answers about a node's kernel:
#   inplace_positions(node) -> input positions the kernel can overwrite with its output
#   scratch(node, inplace_pos | None) -> [(shape, dtype), ...] temporaries for one step
InplaceFn = Callable[[Tensor], Sequence[int]]
ScratchFn = Callable[[Tensor, "int | None"], Sequence[tuple]]


def _byte_span(arr: np.ndarray) -> tuple[int, int]:
    """(lowest byte, one past the highest byte) an array touches, relative to its data pointer."""
    if arr.size == 0:
        return 0, 0
    lo = hi = 0
    for d, s in zip(arr.shape, arr.strides):
        if s >= 0:
            hi += (d - 1) * s
        else:
            lo += (d - 1) * s
    return lo, hi + arr.itemsize


def make_plan(nodes: Sequence[Tensor], outputs: Sequence[Tensor], inplace_positions: InplaceFn,
              scratch: ScratchFn) -> Plan:
    """Plan memory for `nodes` run in the given order (leaves included) producing `outputs`."""
    schedule = [n.id for n in nodes]
    step = {n.id: k for k, n in enumerate(nodes)}
    end = len(nodes) - 1
    output_ids = {o.id for o in outputs}

    # -- which view nodes really are views (a reshape of strided data is not) -----------------------
    protos, root_of, view_offset, is_view = layouts(nodes)

    # -- liveness: the last step that reads each node (a view's reads count for its input) ----------
    last = {n.id: step[n.id] for n in nodes}
    for n in nodes:
        for i in n.inputs:
            last[i.id] = max(last[i.id], step[n.id])
    for o in outputs:
        last[o.id] = end
    for n in reversed(nodes):
        if n.id in is_view:
            src = n.inputs[0].id
            last[src] = max(last[src], last[n.id])

    # -- outputs and the roots of output views keep dedicated buffers ------------------------------
    pinned = {root_of[o] for o in output_ids}

    kinds: dict[int, str] = {}
    storage: dict[int, int] = {}   # node -> the node owning the memory it lives in
    block_of: dict[int, Block] = {}
    blocks: list[Block] = []
    inplace_input: dict[int, int] = {}
    scratch_blocks: dict[int, list[tuple[Block, tuple, np.dtype]]] = {}

    def new_block(owner, nbytes, first, last_, **kw) -> Block:
        b = Block(len(blocks), aligned(nbytes), first, last_, owner, [owner], **kw)
        blocks.append(b)
        return b

    for n in nodes:
        k = step[n.id]
        storage[n.id] = n.id
        if n.op in ("input", "param", "state"):
            kinds[n.id] = "leaf"
            continue
        if n.op == "const":
            kinds[n.id] = "const"
            continue
        if n.id in is_view:
            kinds[n.id] = "view"
            storage[n.id] = storage[n.inputs[0].id]
            continue
        if n.id in pinned:
            kinds[n.id] = "output"
            block_of[n.id] = new_block(n.id, n.nbytes, k, end, dedicated=True)
        else:
            pos = _inplace_choice(n, k, inplace_positions(n), kinds, last, storage)
            if pos is not None:
                src = n.inputs[pos]
                storage[n.id] = storage[src.id]
                b = block_of[storage[src.id]]
                b.members.append(n.id)
                b.last = max(b.last, last[n.id])
                block_of[n.id] = b
                kinds[n.id] = "inplace"
                inplace_input[n.id] = pos
            else:
                kinds[n.id] = "arena"
                block_of[n.id] = new_block(n.id, n.nbytes, k, last[n.id])
        pos = inplace_input.get(n.id)
        for shape, dtype in scratch(n, pos):
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            scratch_blocks.setdefault(n.id, []).append(
                (new_block(n.id, nbytes, k, k, scratch=True), tuple(shape), dtype))

    arena_blocks = [b for b in blocks if not b.dedicated]
    offsets, strategy = _best_placement(arena_blocks)
    for b in arena_blocks:
        b.offset = offsets[b.id]
    arena_bytes = max((b.offset + b.nbytes for b in arena_blocks), default=0)
    lower = _lower_bound(arena_blocks, len(nodes))
    # naive: every intermediate its own buffer, kernel scratch included (scratch blocks are arena
    # blocks too, so the ratio compares like with like)
    naive = sum(aligned(n.nbytes) for n in nodes if kinds[n.id] in ("arena", "inplace")) + \
        sum(b.nbytes for lst in scratch_blocks.values() for b, _, _ in lst)
    output_bytes = sum(b.nbytes for b in blocks if b.dedicated)

    entries: dict[int, Entry] = {}
    for n in nodes:
        kind = kinds[n.id]
        k = step[n.id]
        if kind in ("leaf", "const"):
            entries[n.id] = Entry(n.id, kind, None, n.nbytes, None, k, last[n.id])
        elif kind == "view":
            root = storage[n.id]
            b = block_of.get(root)
            lo, hi = _byte_span(protos[n.id])
            off = None
            if b is not None and not b.dedicated:
                off = b.offset + view_offset[n.id] + lo
            entries[n.id] = Entry(n.id, "view", off, hi - lo, root, k, last[n.id])
        else:
            b = block_of[n.id]
            entries[n.id] = Entry(n.id, kind, b.offset, n.nbytes,
                                  b.owner if kind == "inplace" else None, k, last[n.id])
    scratch_out = {nid: [Scratch(b.offset, b.nbytes, shape, dtype) for b, shape, dtype in lst]
                   for nid, lst in scratch_blocks.items()}
    kept = {n.id: n.nbytes for n in nodes if n.attrs.get("kept")}
    return Plan(schedule, entries, blocks, scratch_out, storage, view_offset, inplace_input,
                arena_bytes, lower, naive, output_bytes, strategy, kept)


def _inplace_choice(n: Tensor, k: int, positions, kinds, last, storage) -> int | None:
    """The input position `n` may overwrite, or None."""
    op = REGISTRY.get(n.op)
    elementwise = op is not None and op.elementwise
    for p in positions:
        src = n.inputs[p]
        if kinds.get(src.id) not in ("arena", "inplace"):
            continue  # leaves, consts, views and outputs are never overwritten
        if src.shape != n.shape or src.dtype != n.dtype or last[src.id] != k:
            continue
        clash = False
        for j, other in enumerate(n.inputs):
            if j == p:
                continue
            if other.id == src.id and elementwise:
                continue  # an elementwise kernel reads and writes the same element
            if storage[other.id] == storage[src.id]:
                clash = True
                break
        if not clash:
            return p
    return None


def _lower_bound(blocks: Sequence[Block], nsteps: int) -> int:
    """The most arena bytes live at any one step: no placement can use fewer."""
    if not blocks:
        return 0
    delta = np.zeros(nsteps + 1, dtype=np.int64)
    for b in blocks:
        delta[b.first] += b.nbytes
        delta[b.last + 1] -= b.nbytes
    return int(np.cumsum(delta).max())


def _place(blocks: Sequence[Block], order: Sequence[Block]) -> dict[int, int]:
    """Place blocks in `order`: each goes into the smallest gap, between already placed blocks
    whose lifetimes overlap its own, that fits it (else above them all)."""
    placed: list[Block] = []
    offsets: dict[int, int] = {}
    for b in order:
        if b.nbytes == 0:
            offsets[b.id] = 0
            continue
        live = sorted((p for p in placed if p.first <= b.last and b.first <= p.last),
                      key=lambda p: offsets[p.id])
        best, best_gap, top = None, None, 0
        for p in live:
            gap = offsets[p.id] - top
            if gap >= b.nbytes and (best_gap is None or gap < best_gap):
                best, best_gap = top, gap
            top = max(top, offsets[p.id] + p.nbytes)
        offsets[b.id] = top if best is None else best
        placed.append(b)
    return offsets


def _best_placement(blocks: Sequence[Block]) -> tuple[dict[int, int], str]:
    orders = {
        "greedy-by-size": sorted(blocks, key=lambda b: (-b.nbytes, b.first, b.id)),
        "greedy-by-size-late": sorted(blocks, key=lambda b: (-b.nbytes, -b.last, b.id)),
        "greedy-by-area": sorted(blocks, key=lambda b: (-b.nbytes * (b.last - b.first + 1), b.id)),
    }
    best = None
    for name, order in orders.items():
        offsets = _place(blocks, order)
        top = max((offsets[b.id] + b.nbytes for b in blocks), default=0)
        if best is None or top < best[0]:
            best = (top, offsets, name)
    return best[1], best[2]
