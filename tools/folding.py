"""Repeated modules (``blocks.0`` ... ``blocks.11``) found and folded into one, for pictures and tables.

    from graphlm.tools.folding import graph_repeats, name_repeats
    for r in graph_repeats(graph):           # runs of identical sibling modules in a graph
        r.label, r.members, r.node_map       # "blocks.0-11 x12", [...], {node id -> id in members[0]}
    name_repeats(param_names_and_specs)      # the same over parameter names (the params table)

Two sibling modules ``X.i`` and ``X.j`` (list entries of one container) repeat each other when
their nodes, taken in creation order, have the same ops, shapes, dtypes, kinds and relative
scopes, and read each other's nodes in the same pattern; inputs from outside a module (the
previous block's output) may differ. Attribute values (a dropout stream id) may differ too. Only
runs of consecutive members fold, so ``blocks.0-3`` and ``blocks.5-7`` fold apart when
``blocks.4`` differs. The renderer, the HTML page and the parameter table all fold with this.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

from graphlm.ir import Graph

from .stats import all_scopes, graph_homes, module_levels, node_kind

_MEMBER = re.compile(r"^(.*)\.(\d+)$")


def is_scalar_const(node) -> bool:
    """A scalar constant: drawn inside its reader's label, shared across modules."""
    return node.op == "const" and node.shape == ()


def _shared_leaf(node) -> bool:
    """Nodes left out of a module's signature: scalar constants (cached per graph, so the first
    block that used one owns it) and inputs (a dropout key made in the first block's scope is
    fed once and read by all)."""
    return is_scalar_const(node) or node.op == "input"


@dataclass
class Repeat:
    """A run of identical sibling modules, drawn or printed as its first member."""

    container: str                 # "blocks"
    members: list[str]             # ["blocks.0", ..., "blocks.11"], consecutive indices
    node_map: dict[int, int] = field(default_factory=dict)   # node id -> its twin in members[0]

    @property
    def first(self) -> str:
        return self.members[0]

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def label(self) -> str:
        """``blocks.0-11 x12``: the container, the index range and the count."""
        lo, hi = self.members[0].rsplit(".", 1)[1], self.members[-1].rsplit(".", 1)[1]
        return f"{self.container}.{lo}-{hi} x{self.count}"

    def member_of(self, path: str) -> str | None:
        """The member module `path` lies in (``blocks.3`` for ``blocks.3.mlp``), or None."""
        for m in self.members:
            if path == m or path.startswith(m + "."):
                return m
        return None

    def to_first(self, path: str) -> str:
        """`path` moved into the first member: ``blocks.3.mlp`` -> ``blocks.0.mlp``."""
        m = self.member_of(path)
        return path if m is None else self.first + path[len(m):]


def sibling_groups(paths: Iterable[str]) -> dict[str, list[str]]:
    """Container -> its numbered members among `paths`, in index order (``blocks`` -> blocks.0...)."""
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for p in set(paths):
        m = _MEMBER.match(p)
        if m:
            groups[m.group(1)].append((int(m.group(2)), p))
    return {c: [p for _, p in sorted(ms)] for c, ms in groups.items() if len(ms) > 1}


def consecutive_runs(members: Sequence[str], signatures: Sequence[Hashable]) -> list[list[str]]:
    """Maximal runs (two or more) of members with consecutive indices and equal signatures."""
    runs: list[list[str]] = []
    current: list[str] = []
    for i, (m, sig) in enumerate(zip(members, signatures)):
        idx = int(m.rsplit(".", 1)[1])
        if current and sig == signatures[i - 1] and idx == int(members[i - 1].rsplit(".", 1)[1]) + 1:
            current.append(m)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [m]
    if len(current) > 1:
        runs.append(current)
    return runs


def graph_repeats(graph: Graph) -> list[Repeat]:
    """Runs of identical sibling modules of `graph`, outermost first (a repeat inside a
    repeated block is not reported: folding the outer one already shows it once)."""
    scopes = all_scopes(graph)
    homes = graph_homes(graph)
    by_module: dict[str, list] = defaultdict(list)
    for n in graph.nodes:
        if _shared_leaf(n):
            continue
        for level in module_levels(homes[n.id]):
            by_module[level].append(n)

    def signature(member: str):
        nodes = by_module[member]
        index = {n.id: i for i, n in enumerate(nodes)}
        sig = []
        for n in nodes:
            rel = homes[n.id][len(member):]
            ins = tuple(index.get(i.id, -1) for i in n.inputs)     # -1: from outside
            sig.append((n.op, n.shape, str(n.dtype), node_kind(n), rel, ins))
        return tuple(sig)

    repeats: list[Repeat] = []
    for container, members in sorted(sibling_groups(scopes).items(), key=lambda kv: kv[0].count(".")):
        if any(r.member_of(container) for r in repeats):
            continue
        sigs = [signature(m) for m in members]
        for run in consecutive_runs(members, sigs):
            rep = Repeat(container, run)
            first = by_module[run[0]]
            for m in run[1:]:
                rep.node_map.update({n.id: t.id for n, t in zip(by_module[m], first)})
            repeats.append(rep)
    return repeats


def name_repeats(specs: Iterable[tuple[str, Hashable]]) -> list[Repeat]:
    """Runs of identical sibling modules among parameter names: `specs` is (name, what must
    match, e.g. (shape, dtype)); members match when they hold the same relative names with the
    same specs."""
    specs = list(specs)
    modules = {lv for name, _ in specs for lv in module_levels(name.rsplit(".", 1)[0] if "." in name else "")}
    repeats: list[Repeat] = []
    for container, members in sorted(sibling_groups(modules).items(), key=lambda kv: kv[0].count(".")):
        if any(r.member_of(container) for r in repeats):
            continue
        sigs = [tuple(sorted((n[len(m):], s) for n, s in specs if n.startswith(m + "."))) for m in members]
        repeats.extend(Repeat(container, run) for run in consecutive_runs(members, sigs))
    return repeats


__all__ = ["Repeat", "graph_repeats", "name_repeats", "sibling_groups", "consecutive_runs"]
