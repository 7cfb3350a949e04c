"""Graph statistics: what a graph is made of, counted from its nodes and its networkx export.

    from graphlm.tools.stats import graph_stats, format_stats
    print(format_stats(graph_stats(g)))

The helpers that classify nodes (`node_kind`) and split scopes into module levels
(`module_levels`, `home_scope`) live here because the renderer, the parameter table and the
plan view all use the same definitions.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from graphlm.ir import Graph, Tensor
from graphlm.registry import REGISTRY

#: Node kinds, in the order tables and legends show them.
KINDS = ("input", "param", "state", "const", "forward", "backward", "update")


def node_kind(node: Tensor) -> str:
    """One of `KINDS`: the leaf kind for leaves; ``update`` for optimizer steps (ops that write
    state in place); ``backward`` for nodes made by the differentiation pass; else ``forward``."""
    if node.is_leaf:
        return node.op
    op = REGISTRY.get(node.op)
    if op is not None and op.updates_state:
        return "update"
    return "backward" if node.is_backward else "forward"


def module_levels(scope: str) -> list[str]:
    """The module path of a scope, one entry per module level, as prefixes.

    A list index belongs to its container's level, so ``blocks.0.attention`` is two levels,
    ``["blocks.0", "blocks.0.attention"]``: a `ModuleList` is not a module worth its own box.
    """
    if not scope:
        return []
    levels: list[str] = []
    current = ""
    for part in scope.split("."):
        if current and part.isdigit() and levels:
            current = f"{current}.{part}"
            levels[-1] = current
            continue
        current = f"{current}.{part}" if current else part
        levels.append(current)
    return levels


def all_scopes(graph: Graph) -> set[str]:
    """Every module path that owns a node, with all its ancestors."""
    scopes: set[str] = set()
    for scope in {n.scope for n in graph.nodes}:
        scopes.update(module_levels(scope))
    return scopes


def home_scope(node: Tensor, scopes: set[str] | None = None) -> str:
    """The module a node is drawn in: its scope, except that a parameter or state made at the
    root whose dotted name starts with an existing module path (``blocks.0.mlp_input.weight``)
    lives in that module."""
    if node.scope or node.op not in ("param", "state") or not node.name or "." not in node.name:
        return node.scope
    scopes = all_scopes(node.graph) if scopes is None else scopes
    prefix = node.name.rsplit(".", 1)[0]
    while prefix:
        if prefix in scopes:
            return prefix
        prefix = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    return ""


def is_cotangent_sum(node: Tensor) -> bool:
    """A backward ``add`` the differentiation pass made to total the cotangents of a forward
    node X with several consumers (autodiff's `_total` chain): its partner is X, its inputs are
    distinct, and each is either a term made by another node's VJP (a consumer of X's) or an
    earlier sum of X's terms. X's own VJP rule cannot make such an add: the only backward
    tensor it reads from elsewhere is the one cotangent it is given."""
    if node.op != "add" or not node.is_backward or len({i.id for i in node.inputs}) < 2:
        return False
    partner = node.graph.forward_partner
    x = partner.get(node)
    if x is None:
        return False
    for i in node.inputs:
        c = partner.get(i)
        if c is None:
            return False
        if c is x and not is_cotangent_sum(i):
            return False
    return True


def _common_module(scopes) -> str:
    """The deepest module path every scope of `scopes` lies in ("" for the root)."""
    levels = [module_levels(s) for s in scopes]
    common = ""
    for at_level in zip(*levels):
        if any(p != at_level[0] for p in at_level):
            break
        common = at_level[0]
    return common


def graph_homes(graph: Graph) -> dict[int, str]:
    """Node id -> the module it is drawn in (`home_scope`), except that a sum of cotangents
    (`is_cotangent_sum`) of X lives where X is read: the deepest module holding X's forward
    readers. The pass scopes it under X, but the fan-out it undoes belongs to the readers: a
    block's input read by its norm and its residual add is summed inside that block, so every
    block of a stack holds one such sum (the last block's output, read once, has none) and
    identical blocks stay identical."""
    scopes = all_scopes(graph)
    homes = {n.id: home_scope(n, scopes) for n in graph.nodes}
    readers: dict[int, list[int]] = {}
    for n in graph.nodes:
        if not n.is_backward:
            for i in n.inputs:
                readers.setdefault(i.id, []).append(n.id)
    partner = graph.forward_partner
    for n in graph.nodes:
        if is_cotangent_sum(n):
            where = [homes[r] for r in readers.get(partner[n].id, ())]
            if where:
                homes[n.id] = _common_module(where)
    return homes


def param_users(graph: Graph) -> dict[str, set[str]]:
    """Parameter name -> the top-level modules whose forward nodes read it."""
    users: dict[str, set[str]] = {name: set() for name in graph.params}
    for n in graph.nodes:
        if node_kind(n) != "forward":
            continue
        for src in n.inputs:
            if src.op == "param":
                levels = module_levels(n.scope)
                users[src.name].add(levels[0] if levels else "")
    return users


def shared_params(graph: Graph) -> dict[str, list[str]]:
    """Parameters read by more than one top-level module (a tied embedding/head), with them."""
    return {name: sorted(u) for name, u in param_users(graph).items() if len(u) > 1}


def graph_stats(graph: Graph) -> dict[str, Any]:
    """Counts by op and kind, bytes by kind, edges, depth (longest path) and module counts.

    Depth and width come from ``graph.to_networkx()``: depth is the number of nodes on the
    longest dependency chain, width the most nodes at one distance from the leaves (how much
    could run at once).
    """
    import networkx as nx

    dg = graph.to_networkx()
    by_op = Counter(n.op for n in graph.nodes)
    by_kind = Counter(node_kind(n) for n in graph.nodes)
    bytes_by_kind: Counter = Counter()
    for n in graph.nodes:
        bytes_by_kind[node_kind(n)] += n.nbytes
    level: dict[int, int] = {}
    for nid in nx.topological_sort(dg):
        preds = list(dg.predecessors(nid))
        level[nid] = 1 + max((level[p] for p in preds), default=0)
    depth = max(level.values(), default=0)
    width = max(Counter(level.values()).values(), default=0)
    scopes = all_scopes(graph)
    top = {s for s in scopes if len(module_levels(s)) == 1}
    return {
        "graph": graph.name,
        "nodes": len(graph.nodes),
        "edges": dg.number_of_edges(),
        "depth": depth,
        "width": width,
        "weakly_connected_components": nx.number_weakly_connected_components(dg) if len(dg) else 0,
        "inputs": len(graph.inputs),
        "params": len(graph.params),
        "parameter_elements": sum(p.size for p in graph.params.values()),
        "states": len(graph.states),
        "modules": len(scopes),
        "top_level_modules": sorted(top),
        "by_kind": {k: by_kind[k] for k in KINDS if by_kind[k]},
        "bytes_by_kind": {k: bytes_by_kind[k] for k in KINDS if by_kind[k]},
        "by_op": dict(sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def fmt_bytes(n: int, digits: int = 2) -> str:
    """A byte count in the largest binary unit it reaches: 1.50 MiB (the tools' one formatter)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


def format_stats(stats: dict[str, Any], top: int | None = None) -> str:
    """A readable report of `graph_stats` (ops sorted by count; `top` keeps the first few)."""
    lines = [
        f"graph {stats['graph']}: {stats['nodes']:,} nodes, {stats['edges']:,} edges",
        f"  depth (longest chain) {stats['depth']:,}, width (most nodes at one level) "
        f"{stats['width']:,}, {stats['weakly_connected_components']} connected component(s)",
        f"  leaves: {stats['inputs']} inputs, {stats['params']} params "
        f"({stats['parameter_elements']:,} elements), {stats['states']} states",
        f"  modules: {stats['modules']} ({len(stats['top_level_modules'])} top level)",
        "",
        "nodes by kind:",
    ]
    for kind, count in stats["by_kind"].items():
        lines.append(f"  {kind:<10} {count:>7,}  {fmt_bytes(stats['bytes_by_kind'][kind]):>11}")
    ops = list(stats["by_op"].items())
    shown = ops if top is None else ops[:top]
    lines += ["", f"nodes by op ({len(ops)} ops):"]
    width = max((len(op) for op, _ in shown), default=4)
    for op, count in shown:
        lines.append(f"  {op:<{width}} {count:>7,}")
    if len(shown) < len(ops):
        lines.append(f"  ... {len(ops) - len(shown)} more ops")
    return "\n".join(lines)


__all__ = ["KINDS", "node_kind", "module_levels", "all_scopes", "home_scope", "graph_homes",
           "is_cotangent_sum", "param_users",
           "shared_params", "graph_stats", "format_stats"]
