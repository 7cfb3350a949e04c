"""Draw a graphlm `Graph` with Graphviz: DOT text, then SVG, PNG or the DOT file itself.

    from graphlm.tools.render import to_dot, render
    render(graph, "decoder.svg", depth=1)           # one box per block's sub-module
    render(graph, "block1.png", scope="blocks.1")   # only that module, at full depth
    text = to_dot(graph, plan=program.plan)          # arena offsets, in-place nodes, views

What a picture shows:
  - every node labelled with its op, shape and dtype; parameters, inputs and states with their
    names; scalar constants folded into the label of the node that reads them;
  - colours by kind (leaf inputs/states/constants, parameters, forward, backward, optimizer
    update, collapsed module), with a legend;
  - module scopes as nested clusters (``blocks.0.attention`` inside ``blocks.0``; a list index
    belongs to its container's level, see `tools.stats.module_levels`);
  - ``depth=K``: modules down to level K are clusters, each module at level K+1 is one box with
    its node and parameter counts (``depth=0``: every top-level module is one box);
  - ``scope="blocks.1"``: only that module's nodes (its inputs from elsewhere as grey stubs);
    depth then counts from that module;
  - ``plan=``: the NumPy executor's plan: arena offset and size per node, in-place nodes drawn
    with a double border, views dashed (and smaller) with the node whose memory they share;
  - with backward nodes (``phases``): collapsed modules as a forward and a backward box, each
    module's backward nodes in a cluster of their own, the backward pass laid out climbing back
    up beside the forward one (cotangent edges reversed, ``dir=back``);
  - the gradients (and parameters) the optimizer reads bundled through one counting box;
  - runs of identical blocks drawn once (`tools.folding`);
  - ``render_drawing`` measures the drawn picture and warns above `READABLE_PX`, and its
    ``depth="auto"`` takes the deepest depth that fits.

DOT node ids are plain ``n<id>`` (module boxes ``m<k>``, clusters ``cluster_<k>``), never
names: Graphviz reads ``a:b`` in an id as node ``a``, port ``b``.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import graphviz

from graphlm.ir import Graph, Tensor, fmt_shape

from .folding import Repeat, graph_repeats, is_scalar_const
from .stats import KINDS, all_scopes, graph_homes, module_levels, node_kind
from .stats import fmt_bytes as _fmt_bytes

FORMATS = ("svg", "png", "dot", "pdf")
INSTALL_HINT = ("install Graphviz to draw it: apt-get install -y graphviz "
                "(macOS: brew install graphviz)")

# kind -> (fill, border, legend text)
STYLE = {
    "input": ("#dbe9f7", "#3f6fa8", "input (fed each run)"),
    "state": ("#e6dcf5", "#6b4fa0", "state (persistent, not trained)"),
    "const": ("#eeeeee", "#888888", "constant"),
    "param": ("#ffe9a8", "#a67c00", "parameter (trained)"),
    "forward": ("#ffffff", "#4d4d4d", "forward op"),
    "backward": ("#fbd9d3", "#b0453a", "backward op (gradient)"),
    "update": ("#d5efcf", "#2f7d32", "optimizer update (writes state)"),
    "module": ("#e9eef2", "#5b6770", "collapsed module"),
}
LEAF_SHAPE = {"input": "ellipse", "state": "ellipse", "const": "ellipse", "param": "ellipse"}
# nested clusters get darker as they nest, so the nesting reads at a glance
CLUSTER_FILLS = ("#f7f9fb", "#eef2f6", "#e4eaf0", "#dae2ea", "#d0dae4")

# Layout settings that keep `dot` fast on graphs of hundreds to thousands of nodes (the full
# TinyLM training graph). Long edges (activations kept for the backward pass) become chains of
# tens of thousands of virtual nodes; the x-coordinate network simplex over them is what costs
# (12 s of 17 s here), so nslimit bounds its iterations (to 0.05 x the node count). The ranking
# pass (nslimit1) is left alone: a worse ranking makes more virtual nodes. mclimit shortens
# crossing minimisation, splines=line skips spline routing, and newrank ranks the clusters in
# one pass.
FAST_LAYOUT = {"splines": "line", "nslimit": "0.05", "mclimit": "0.1", "searchsize": "30",
               "remincross": "false"}
# below this many drawn items the default (curved, crossing-minimised) layout is cheap
FAST_LAYOUT_ABOVE = 400
# an update node with more param/state inputs than this gets them as one summary node per kind
FANIN_GROUP_ABOVE = 8
# edges into the optimizer from the model, bundled through one junction box per kind of
# source: the gradients, and (where the update is collapsed into a box) the parameters
BUNDLE_COLOUR = "#8cc98a"
JUNCTIONS = {"j_grad": ("backward",), "j_param": ("param",)}
# the font of what needs only a glance: views (no memory of their own) and outside inputs
SMALL_FONT = "8"
# more boxes than this do not read at screen size: warn, and depth="auto" stays below it
READABLE_ITEMS = 300
# a drawn picture longer than this many pixels (at 96 dpi) does not read when shown at about
# 1600-2000 px wide: warn, and render's depth="auto" draws less until it fits
READABLE_PX = 2500
# render's depth="auto" lays out only depths with at most this many boxes: with labels of
# three or four lines no larger picture was seen to fit READABLE_PX (TinyLM's: 53 boxes drew
# 1816 px long, 61 drew 3550, 106 drew 3932), and each layout costs seconds
AUTO_MOST_ITEMS = 100


class RenderError(RuntimeError):
    """Drawing failed: Graphviz missing or failing, or a bad output path or option."""


class GraphvizNotFound(RenderError):
    """The `dot` program is not installed; the DOT file was written instead."""


# -- DOT text --------------------------------------------------------------------------------------
def quote(text: Any) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as ``\\n``."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    s = s.replace("\r", "").replace("\n", "\\n")
    return f'"{s}"'


def short_dtype(dtype) -> str:
    name = str(dtype)
    for long, short in (("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            return short + name[len(long):]
    return name


def fmt_bytes(n: int) -> str:
    """Byte counts on graph labels, one decimal (stats.fmt_bytes)."""
    return _fmt_bytes(n, digits=1)


_is_folded_const = is_scalar_const


def _const_text(node: Tensor) -> str:
    value = node.attrs["value"].item()
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# attrs left off node labels: the folded constant's value, the update's state list, and the
# marks graph passes leave (which pass made a node, a kept value), which the tooltip and the
# page show
NOT_ON_LABELS = ("value", "writes", "made_by", "pass", "fused_by", "kept")


def _attr_text(node: Tensor) -> str:
    """The op attributes worth a glance (axis, eps, exponent ...), short."""
    parts = []
    for key, value in node.attrs.items():
        if key in NOT_ON_LABELS or key.startswith("_"):
            continue
        if isinstance(value, float):
            text = f"{value:.3g}"
        elif isinstance(value, (int, bool, str)):
            text = str(value)
        elif isinstance(value, tuple) and len(value) <= 6 and all(isinstance(v, (int, type(None))) for v in value):
            text = ",".join("_" if v is None else str(v) for v in value) or "()"
        else:
            continue
        if isinstance(value, tuple) and tuple(value) == tuple(node.shape):
            continue            # a reshape's or broadcast's target: the shape line says it
        parts.append(f"{key}={text}")
    text = " ".join(parts)
    return text if len(text) <= 40 else text[:37] + "..."


def _plan_entry(plan, node: Tensor):
    entries = getattr(plan, "entries", None) or {}
    return entries.get(node.id)


def _entry_base(entry) -> int | None:
    base = getattr(entry, "base", None)
    if base is None:
        return None
    return getattr(base, "id", base)


def node_label(node: Tensor, folded: list[Tensor], plan=None) -> tuple[str, dict[str, str]]:
    """The label text of one node and any style overrides (plan markings)."""
    kind = node_kind(node)
    if node.is_leaf and node.name:
        head = f"n{node.id} {node.op} {node.name}"
    elif node.is_leaf:
        head = f"n{node.id} {node.op}"
    else:
        head = f"n{node.id} {node.op}"
        attrs = _attr_text(node)
        if attrs:
            head += f"  ({attrs})"
    lines = [head, f"{fmt_shape(node.shape)} {short_dtype(node.dtype)}"]
    if folded:
        lines.append("with " + ", ".join(_const_text(c) for c in folded))
    style: dict[str, str] = {}
    if plan is not None:
        entry = _plan_entry(plan, node)
        if entry is None:
            if not node.is_leaf:
                lines.append("(not scheduled)")
                style["style"] = "filled,dotted"
        else:
            where = getattr(entry, "kind", "arena")
            offset, nbytes = getattr(entry, "offset", None), getattr(entry, "nbytes", node.nbytes)
            if where == "inplace":
                base = _entry_base(entry)
                lines.append(f"in place of n{base} @{offset:,} ({fmt_bytes(nbytes)})")
                style["peripheries"] = "2"
                style["penwidth"] = "2"
            elif where == "view":
                base = _entry_base(entry)
                # a view costs nothing: smaller, its attrs left to the tooltip
                lines[0] = head.split("  (")[0]
                lines.append(f"view of n{base}" + (f" @{offset:,}" if offset is not None else ""))
                style["style"] = "filled,dashed" if kind != "forward" and kind != "backward" \
                    else "rounded,filled,dashed"
                style["fontsize"] = SMALL_FONT
            elif where == "arena":
                lines.append(f"arena @{offset:,} ({fmt_bytes(nbytes)})")
            elif where == "output":
                lines.append(f"output buffer ({fmt_bytes(nbytes)})")
    return "\n".join(lines), style


class _Cluster:
    __slots__ = ("path", "label", "children", "items", "side")

    def __init__(self, path: str):
        self.path = path
        self.label = path
        self.side = ""
        self.children: dict[str, _Cluster] = {}
        self.items: list[str] = []


@dataclass
class Drawing:
    """What `draw` made: the DOT source and what it shows.

    items: the boxes drawn (nodes, module boxes, stubs, optimizer summaries); nodes: the graph
    nodes they stand for (in the scope); drawn_nodes: graph nodes drawn as their own box;
    folded: the repeated modules drawn once; depth: the depth drawn (``auto`` resolved);
    warning: set when more items are drawn than a person can read.
    """

    source: str
    items: int
    nodes: int
    drawn_nodes: int
    folded: list[Repeat]
    depth: int | None
    warning: str | None = None
    path: Path | None = None
    stubs: int = 0
    tips: list[str] | None = None          # what to try when it does not read
    size: tuple[int, int] | None = None    # pixels, once drawn by `render_drawing`


    def summary(self) -> str:
        """``613 nodes drawn as 95 boxes (blocks.0-2 x3 folded)``: the figures of the title."""
        text = f"{self.nodes:,} nodes drawn as {self.items:,} boxes"
        if self.stubs:
            text += f" (and {self.stubs} input{'s' if self.stubs > 1 else ''} from outside)"
            text = text.replace(f"{self.items:,} boxes", f"{self.items - self.stubs:,} boxes")
        if self.folded:
            text += f" ({', '.join(r.label for r in self.folded)} folded)"
        return text


def readability_warning(items: int, scope: str | None, depth, size: tuple[int, int] | None = None,
                        tips: list[str] | None = None) -> str | None:
    """The warning for a picture of more than `READABLE_ITEMS` boxes or, once laid out, longer
    than `READABLE_PX` pixels, with what to try instead (`tips`, see `draw`)."""
    too_big = size is not None and max(size) > READABLE_PX
    if items <= READABLE_ITEMS and not too_big:
        return None
    if tips is None:
        tips = []
        if depth is None or depth > 0:
            tips.append(f"--depth {0 if depth in (None, 1) and scope else max(0, (depth or 2) - 1)}")
        if not scope:
            tips.append("--scope MODULE (e.g. blocks.0)")
        tips.append("--out graph.html (the interactive page)")
    what = (f"the picture is {size[0]:,}x{size[1]:,} px, more than reads at screen size (about "
            f"{READABLE_PX:,} px on the long side)" if too_big else
            f"{items:,} boxes drawn, more than a person can read at screen size (about {READABLE_ITEMS})")
    return f"{what}; try {', or '.join(tips)}"


def picture_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) in pixels (Graphviz's 96 dpi) of a drawn PNG or SVG; None for others."""
    if fmt == "png" and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if fmt == "svg":
        m = re.search(rb'<svg\b[^>]*?\bwidth="([\d.]+)pt"[^>]*?\bheight="([\d.]+)pt"', data)
        if m:
            return round(float(m.group(1)) * 96 / 72), round(float(m.group(2)) * 96 / 72)
    return None


def max_depth(graph: Graph, scope: str | None = None) -> int:
    """The deepest module level below `scope` (0 when there are no modules below it)."""
    base = len(module_levels(scope)) if scope else 0
    return max((len(module_levels(s)) - base for s in all_scopes(graph)
                if not scope or s == scope or s.startswith(scope + ".")), default=0)


def to_dot(graph: Graph, depth: int | str | None = None, scope: str | None = None, plan=None,
           title: str | None = None, legend: bool = True, fast: bool | None = None,
           fold: bool = True, phases: bool | None = None) -> str:
    """The DOT text of `graph` (see the module docstring for what it shows); `draw` also says
    what was drawn."""
    return draw(graph, depth=depth, scope=scope, plan=plan, title=title, legend=legend,
                fast=fast, fold=fold, phases=phases).source


def draw(graph: Graph, depth: int | str | None = None, scope: str | None = None, plan=None,
         title: str | None = None, legend: bool = True, fast: bool | None = None,
         fold: bool = True, phases: bool | None = None) -> Drawing:
    """The picture of `graph` as a `Drawing` (DOT source and counts).

    depth: module levels drawn as clusters (None: all, nothing collapsed; ``"auto"``: the
    deepest that draws at most `READABLE_ITEMS` boxes); scope: a module path (``blocks.1``) to
    draw alone; plan: a NumPy executor plan (``program.plan``) to annotate with; fast: use the
    fast layout settings (default: when more than 400 items are drawn); fold: draw each run of
    identical sibling modules once (``blocks.0-11 x12``); phases: a collapsed module is one box
    per phase (forward, backward, update) and the backward pass is laid out upwards beside the
    forward one (default: when the graph has backward nodes; see `PHASES`).
    """
    if not isinstance(graph, Graph):
        raise RenderError(f"render: expected a graphlm.Graph, got {type(graph).__name__}")
    if depth == "auto":
        deepest = max_depth(graph, scope)
        for d in range(deepest, -1, -1):
            drawing = draw(graph, d, scope, plan, title, legend, fast, fold, phases)
            if drawing.items <= READABLE_ITEMS or d == 0:
                return drawing
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 0):
        raise RenderError(f"render: depth must be a non-negative integer, 'auto' or None, got {depth!r}")
    scopes = all_scopes(graph)
    base_levels: list[str] = []
    if scope:
        if scope not in scopes:
            top = sorted(s for s in scopes if len(module_levels(s)) <= 1)
            raise RenderError(f"render: graph '{graph.name}' has no module scope '{scope}' "
                              f"(top-level modules: {', '.join(top) or 'none'})")
        base_levels = module_levels(scope)

    homes = graph_homes(graph)

    def inside(node: Tensor) -> bool:
        h = homes[node.id]
        return not scope or h == scope or h.startswith(scope + ".")

    in_scope = [n for n in graph.nodes if inside(n)]
    if phases is None:
        phases = any(n.is_backward for n in in_scope)
    # repeated sibling modules: every member but the first is drawn as the first one
    repeats = [r for r in graph_repeats(graph) if fold and (not scope or r.member_of(scope) is None)]
    repeats = [r for r in repeats if any(inside(graph.nodes[i]) for i in r.node_map)]
    twin: dict[int, int] = {}
    member_at: dict[int, tuple[int, str]] = {}     # node id -> (repeat index, member)
    for k, r in enumerate(repeats):
        twin.update(r.node_map)
        for n in in_scope:
            m = r.member_of(homes[n.id])
            if m is not None and not _is_folded_const(n):
                member_at[n.id] = (k, m)
    fold_label = {r.first: r.label for r in repeats}

    shown = [n for n in in_scope if not _is_folded_const(n) and n.id not in twin]
    # with a scope, the module itself is the outer cluster and depth counts from it
    root_levels = [scope] if scope else []
    rel_levels = {n.id: module_levels(homes[n.id])[len(base_levels):] for n in in_scope}

    def collapsed(n: Tensor) -> bool:
        return depth is not None and len(rel_levels[n.id]) > depth

    # An optimizer update reads every parameter and both its moments: hundreds of edges from the
    # top of the picture to the bottom, which make dot slow and the picture a hairball. The
    # param/state inputs of such a node are drawn as one summary node per kind, states that
    # nothing else reads are drawn only there, and the remaining edges into it (gradients) meet
    # at one point of its border (samehead), a bundle rather than a fan.
    consumers: dict[int, set[int]] = defaultdict(set)
    for n in graph.nodes:
        for i in n.inputs:
            consumers[i.id].add(n.id)
    groups: dict[int, dict[str, list[Tensor]]] = {}
    hidden: set[int] = set()
    for n in shown:
        if node_kind(n) != "update" or collapsed(n):
            continue
        leaves = list({i.id: i for i in n.inputs if i.op in ("param", "state")}.values())
        if len(leaves) <= FANIN_GROUP_ABOVE:
            continue
        by_kind: dict[str, list[Tensor]] = defaultdict(list)
        for i in leaves:
            by_kind[i.op].append(i)
        groups[n.id] = by_kind
        for i in by_kind.get("state", []):
            if all(node_kind(graph.nodes[c]) == "update" for c in consumers[i.id]):
                hidden.add(i.id)
    shown = [n for n in shown if n.id not in hidden]
    shown_ids = {n.id for n in shown}

    # which drawn item stands for each node: the node itself, or its collapsed module's box
    rep: dict[int, str] = {}
    boxes: dict[str, dict[str, Any]] = {}      # module path -> box info
    top_cluster = _Cluster("")

    def cluster_for(levels: list[str], side: str = "") -> _Cluster:
        """The cluster of a module path; with phases, a module's backward nodes get a cluster
        of their own (``side="backward"``) beside its forward one, so that the forward modules
        stack down one column and their backward passes up the next, instead of each module's
        cluster spanning from its forward rank to its backward one and the clusters nesting
        sideways."""
        c = top_cluster
        for path in levels:
            key = path + ("#" + side if side else "")
            if key not in c.children:
                c.children[key] = child = _Cluster(path)
                if path in fold_label:
                    child.label = f"{fold_label[path]} (one drawn; counts per block)"
                if side:
                    child.label = f"{fold_label.get(path, child.label)} ({side})"
                    child.side = side
            c = c.children[key]
        return c

    def side_of(n: Tensor) -> str:
        return "backward" if phases and node_kind(n) == "backward" else ""

    for n in in_scope:
        if n.id in hidden or n.id in twin:
            continue
        levels = rel_levels[n.id]
        if collapsed(n):   # counted in its module's box (scalar constants too)
            path = levels[depth]
            phase = node_phase(n) if phases else ""
            box = boxes.get((path, phase))
            if box is None:
                parent = levels[depth - 1] if depth else (scope or "")
                short = fold_label.get(path, path[len(parent) + 1:] if parent else path)
                box = boxes[(path, phase)] = {
                    "id": f"m{len(boxes)}", "nodes": 0, "kinds": defaultdict(int), "params": 0,
                    "path": path, "phase": phase,
                    "short": short if phase in ("", "forward") else f"{short} ({phase})"}
                cluster_for(root_levels + levels[:depth], side_of(n)).items.append(box["id"])
            box["nodes"] += 1
            box["kinds"][node_kind(n)] += 1
            if n.op == "param":
                box["params"] += n.size
            rep[n.id] = box["id"]
        elif _is_folded_const(n):
            continue
        else:
            rep[n.id] = f"n{n.id}"
            cluster = cluster_for(root_levels + levels, side_of(n))
            cluster.items.append(rep[n.id])
            for kind in groups.get(n.id, {}):
                cluster.items.append(f"g{n.id}_{kind}")
    for nid, t in twin.items():
        if t in rep:
            rep[nid] = rep[t]

    # edges between drawn items; scalar constants fold into their reader's label; an edge
    # between two members of one repeat (block i feeds block i+1) is left out: the folded
    # cluster stands for the chain
    edges: dict[tuple[str, str], int] = {}
    sources: dict[tuple[str, str], set[int]] = defaultdict(set)   # graph nodes behind an edge
    folded: dict[int, list[Tensor]] = defaultdict(list)
    stubs: dict[int, Tensor] = {}
    readers = [n for n in in_scope if not _is_folded_const(n) and n.id not in hidden]
    for n in readers:
        grouped = {i.id: kind for kind, ins in groups.get(n.id, {}).items() for i in ins}
        for src in n.inputs:
            if src.id in grouped:
                edges[(f"g{n.id}_{grouped[src.id]}", rep[n.id])] = 1
                continue
            if _is_folded_const(src):
                if n.id in shown_ids and rep[n.id] == f"n{n.id}" and src not in folded[n.id]:
                    folded[n.id].append(src)
                continue
            a_at, b_at = member_at.get(src.id), member_at.get(n.id)
            if a_at and b_at and a_at[0] == b_at[0] and a_at[1] != b_at[1]:
                continue
            if src.id in rep:
                a = rep[src.id]
            else:
                stubs[src.id] = src
                a = f"x{src.id}"
            b = rep[n.id]
            if a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
                sources[(a, b)].add(src.id)

    # gradients into the optimizer (its global norm and its update, both reading every one)
    # from elsewhere: one bundle through a junction box that counts them, one edge per drawn
    # source into it and one out to each optimizer node, instead of a fan across the picture
    opt_tops = {_top(homes[n.id]) for n in shown if node_kind(n) == "update"}
    opt_items = {rep[n.id] for n in in_scope if n.id in rep and _top(homes[n.id]) in opt_tops}
    item_top = {rep[n.id]: _top(homes[n.id]) for n in in_scope if n.id in rep}
    bundles: dict[str, list[Tensor]] = {}       # junction id -> the tensors it bundles
    for junction, kinds in JUNCTIONS.items():
        into_opt = [(a, b) for (a, b) in edges if b in opt_items and not a.startswith(("g", "j"))
                    and item_top.get(a) not in opt_tops
                    and all(node_kind(graph.nodes[i]) in kinds for i in sources[(a, b)])]
        if len({a for a, _ in into_opt}) < 2:
            continue
        bundle = bundles[junction] = [graph.nodes[i] for i in
                                      sorted({i for e in into_opt for i in sources[e]})]
        for a, b in into_opt:
            count = len(sources.pop((a, b)))
            edges.pop((a, b))
            edges[(a, junction)] = max(edges.get((a, junction), 0), count)
            edges[(junction, b)] = len(bundle)

    drawn_nodes = len([n for n in shown if rep.get(n.id) == f"n{n.id}"])
    drawn = drawn_nodes + len(boxes) + len(stubs) + sum(len(g) for g in groups.values()) + len(bundles)
    if fast is None:
        fast = drawn > FAST_LAYOUT_ABOVE
    drawing = Drawing("", drawn, len(in_scope), drawn_nodes, repeats, depth,
                      stubs=len(stubs), tips=_tips(graph, scope, depth, homes, in_scope, repeats))
    drawing.warning = readability_warning(drawn, scope, depth, tips=drawing.tips)

    gattrs = {"rankdir": "TB", "newrank": "true", "compound": "false", "fontname": "Helvetica",
              "fontsize": "12", "nodesep": "0.25", "ranksep": "0.3", "labeljust": "l",
              "outputorder": "edgesfirst"}
    if fast:
        gattrs.update(FAST_LAYOUT)
    gattrs["label"] = _text(title or _default_title(graph, drawing, scope, plan))
    gattrs["labelloc"] = "t"
    dg = graphviz.Digraph(graph.name, graph_attr=gattrs,
                          node_attr={"fontname": "Helvetica", "fontsize": "10", "style": "filled",
                                     "penwidth": "1"},
                          edge_attr={"color": "#777777", "arrowsize": "0.6", "penwidth": "0.8"})
    node_by_id = {n.id: n for n in shown}
    box_by_id = {b["id"]: b for b in boxes.values()}

    def emit_item(item: str, sub):
        if item.startswith("g"):
            nid, kind = item[1:].split("_", 1)
            ins = groups[int(nid)][kind]
            n_hidden = sum(i.id in hidden for i in ins)
            lines = [f"{len(ins)} {kind}s read and written in place",
                     f"{sum(i.size for i in ins):,} elements, {fmt_bytes(sum(i.nbytes for i in ins))}"]
            if n_hidden:
                lines.append(f"({n_hidden} drawn only here)")
            fill, border, _ = STYLE[kind]
            sub.node(item, label=_text(_esc("\n".join(lines))), shape="folder", style="filled",
                     fillcolor=fill, color=border)
            return
        if item.startswith("m"):
            box = box_by_id[item]
            kinds = ", ".join(f"{c} {k}" for k, c in box["kinds"].items())
            each = " each" if box["path"] in fold_label else ""     # a folded run: per member
            lines = [box["short"], f"{box['nodes']:,} node{'s' if box['nodes'] > 1 else ''}{each}: {kinds}"]
            if box["params"] or box["phase"] in ("", "forward"):
                lines.append(f"{box['params']:,} parameters{each}" if box["params"] else "no parameters")
            fill, border, _ = STYLE["module"]
            if box["phase"] in ("backward", "update"):   # the phase's colour as the border
                border = STYLE[box["phase"]][1]
            sub.node(item, label=_text(_esc("\n".join(lines))), shape="box",
                     style="filled,bold", fillcolor=fill, color=border,
                     tooltip=_text(_esc(box["path"] + (f" ({box['phase']})" if box["phase"] not in ("", "forward")
                                                         else ""))))
            return
        n = node_by_id[int(item[1:])]
        kind = node_kind(n)
        fill, border, _ = STYLE[kind]
        label, extra = node_label(n, folded.get(n.id, []), plan)
        shape = LEAF_SHAPE.get(n.op, "box")
        style = extra.pop("style", "filled" if n.is_leaf else "rounded,filled")
        attrs = {"label": label, "shape": shape, "style": style, "fillcolor": fill,
                 "color": border, "tooltip": f"n{n.id} {n!r}"}
        attrs.update(extra)
        sub.node(item, **{k: _text(_esc(v)) for k, v in attrs.items()})

    counter = [0]

    def emit_cluster(c: _Cluster, level: int, sub):
        for item in c.items:
            emit_item(item, sub)
        for _, child in sorted(c.children.items(), key=lambda kv: (_natural_key(kv[1].path), kv[1].side)):
            cid = f"cluster_{counter[0]}"
            counter[0] += 1
            fill = CLUSTER_FILLS[min(level, len(CLUSTER_FILLS) - 1)]
            border = STYLE["backward"][1] if child.side else "#9aa5b1"
            with sub.subgraph(name=cid) as inner:
                inner.attr(label=_text(_esc(child.label)), tooltip=_text(_esc(child.path)),
                           style="rounded,filled", fillcolor=fill, color=border, fontsize="11")
                emit_cluster(child, level + 1, inner)

    emit_cluster(top_cluster, 0, dg)
    for sid, src in sorted(stubs.items()):
        where = homes[src.id] or "<root>"
        label = f"from n{src.id} {src.label}  ({where})\n{fmt_shape(src.shape)} {short_dtype(src.dtype)}"
        dg.node(f"x{sid}", label=_text(_esc(label)), shape="box", style="dashed,filled",
                fillcolor="#f4f4f4", color="#aaaaaa", fontcolor="#555555", fontsize=SMALL_FONT)
    for junction, bundle in bundles.items():
        what = "gradients" if junction == "j_grad" else "parameters"
        lines = [f"{len(bundle)} {what}", f"{sum(t.size for t in bundle):,} elements, "
                 f"{fmt_bytes(sum(t.nbytes for t in bundle))}"]
        kind = "backward" if junction == "j_grad" else "param"
        dg.node(junction, label=_text(_esc("\n".join(lines))), shape="box", style="rounded,filled",
                fillcolor=STYLE[kind][0], color=BUNDLE_COLOUR, penwidth="2",
                tooltip=_text(_esc(f"the {what} the optimizer reads, bundled")))
    # the phase of each drawn item: with phases, an edge from backward to backward (a
    # cotangent flowing back) is laid out reversed and drawn pointing back (dir=back), so the
    # backward pass climbs beside the forward one, each backward node next to its forward node
    phase = {f"n{n.id}": node_phase(n) for n in shown}
    phase.update({b["id"]: b["phase"] for b in boxes.values()})
    phase.update({f"x{i}": node_phase(t) for i, t in stubs.items()})
    for (a, b), count in edges.items():
        extra: dict[str, str] = {}
        if count > 1:
            extra["penwidth"] = f"{min(0.8 + 0.3 * (count - 1), 3.0):g}"
            extra["tooltip"] = f"{count} edges"
        if a in bundles or b in bundles:
            extra["color"] = BUNDLE_COLOUR
            if count > 1:
                extra.update(label=str(count), fontsize="8", fontcolor="#2f7d32")
            dg.edge(a, b, **extra)
        elif phases and phase.get(a) == "backward" and phase.get(b) == "backward":
            dg.edge(b, a, dir="back", **extra)
        else:
            dg.edge(a, b, **extra)
    if legend:
        dg.node("legend", label=_legend(graph, [n for n in shown if rep[n.id] == f"n{n.id}"] +
                                        [i for g in groups.values() for ins in g.values() for i in ins],
                                        boxes, plan), shape="plaintext", style="")
    drawing.source = dg.source
    return drawing


def _tips(graph: Graph, scope: str | None, depth, homes: dict[int, str], in_scope: list[Tensor],
          repeats: list[Repeat]) -> list[str]:
    """What to try when a picture does not read: one level less, the biggest module one
    level down (a folded run's first member), the page."""
    tips = []
    deepest = max_depth(graph, scope)
    drawn_depth = deepest if depth is None else min(depth, deepest)
    if drawn_depth > 0:
        tips.append(f"--depth {drawn_depth - 1}")
    base = len(module_levels(scope)) if scope else 0
    sizes: dict[str, int] = defaultdict(int)
    for n in in_scope:
        levels = module_levels(homes[n.id])
        if len(levels) > base:
            child = levels[base]
            for r in repeats:
                child = r.to_first(child)
            sizes[child] += 1
    if sizes:
        tips.append(f"--scope {max(sorted(sizes, key=_natural_key), key=lambda c: sizes[c])}")
    tips.append("--out graph.html (the interactive page)")
    return tips


def node_phase(node: Tensor) -> str:
    """forward, backward or update: the box a collapsed module's node is counted in (leaves
    with the forward pass)."""
    kind = node_kind(node)
    return kind if kind in ("backward", "update") else "forward"


def _top(scope: str) -> str:
    levels = module_levels(scope)
    return levels[0] if levels else ""


def _esc(text: Any) -> str:
    """Backslashes of a name doubled and newlines as DOT's ``\\n`` escape; the graphviz
    package then quotes the string (it passes backslash escapes through)."""
    return str(text).replace("\\", "\\\\").replace("\r", "").replace("\n", "\\n")


def _text(text: str):
    """A plain-text attribute value (never read as an HTML-like label, even if it looks like one)."""
    return graphviz.nohtml(text)


def _natural_key(path: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def _default_title(graph: Graph, drawing: Drawing, scope, plan) -> str:
    parts = [f"{graph.name}: {drawing.summary()}"]
    if scope:
        parts.append(f"scope {scope}")
    if drawing.depth is not None:
        parts.append(f"depth {drawing.depth}")
    if plan is not None:
        arena = getattr(plan, "arena_bytes", None)
        if arena is not None:
            parts.append(f"arena {fmt_bytes(int(arena))}")
    return " | ".join(parts)


def _legend(graph: Graph, shown: list[Tensor], boxes: dict, plan) -> str:
    """One HTML-table node: a swatch per kind present (not a cluster, so cluster counts stay
    one per module)."""
    present = {node_kind(n) for n in shown}
    rows = []
    for kind in KINDS + ("module",):
        if kind == "module" and not boxes:
            continue
        if kind != "module" and kind not in present:
            continue
        fill, border, text = STYLE[kind]
        rows.append(f'<TR><TD BGCOLOR="{fill}" COLOR="{border}" BORDER="1" WIDTH="18"> </TD>'
                    f'<TD ALIGN="LEFT">{_html(text)}</TD></TR>')
    if plan is not None:
        rows.append('<TR><TD BORDER="1" STYLE="ROUNDED"> </TD><TD ALIGN="LEFT">double border: '
                    'ran in place</TD></TR>')
        rows.append('<TR><TD BORDER="0">- -</TD><TD ALIGN="LEFT">dashed: view (shares memory)'
                    '</TD></TR>')
    return ('<<TABLE BORDER="1" COLOR="#9aa5b1" CELLBORDER="0" CELLSPACING="3" CELLPADDING="2">'
            '<TR><TD COLSPAN="2"><B>legend</B></TD></TR>' + "".join(rows) + "</TABLE>>")


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- files --------------------------------------------------------------------------------------------
def output_format(path: Path, format: str | None) -> str:
    if format is not None:
        fmt = format.lower().lstrip(".")
    else:
        suffix = path.suffix.lower().lstrip(".")
        fmt = "dot" if suffix == "gv" else suffix
    if fmt not in FORMATS:
        raise RenderError(f"render: cannot tell the output format of '{path}' (use a file ending "
                          f"in {', '.join('.' + f for f in FORMATS)} or pass format=)")
    return fmt


def check_writable(path: Path) -> None:
    """Fail early, with the path, if `path` cannot be written (before any slow work)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise RenderError(f"cannot write '{path}': it is a directory")
    if not parent.is_dir():
        raise RenderError(f"cannot write '{path}': directory '{parent}' does not exist")
    if not os.access(parent, os.W_OK):
        raise RenderError(f"cannot write '{path}': directory '{parent}' is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise RenderError(f"cannot write '{path}': the file is not writable")


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file in the same folder and rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)     # mkstemp makes 0600; a picture is for everyone
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def find_dot() -> str | None:
    return shutil.which("dot")


def dot_to(dot_text: str, fmt: str, timeout: float | None = 120.0) -> bytes:
    """Lay out and draw DOT text with Graphviz `dot`, through the graphviz package; the drawn
    bytes. Raises GraphvizNotFound / RenderError (a failure, or longer than `timeout` s)."""
    if find_dot() is None:
        raise GraphvizNotFound(f"Graphviz 'dot' was not found on PATH; {INSTALL_HINT}")
    data = dot_text.encode()
    try:
        try:   # the package's runner, with a timeout (graphviz.pipe itself takes none)
            from graphviz.backend import dot_command, execute
            out = execute.run_check(dot_command.command("dot", fmt), input=data,
                                    capture_output=True, quiet=True, timeout=timeout).stdout
        except ImportError:      # pragma: no cover - another layout of the graphviz package
            out = graphviz.pipe("dot", fmt, data, quiet=True)
    except subprocess.TimeoutExpired:
        raise RenderError(f"Graphviz 'dot' took longer than {timeout:g} s; draw less of the graph "
                          "(depth=1, or scope=a module)") from None
    except graphviz.ExecutableNotFound:
        raise GraphvizNotFound(f"Graphviz 'dot' could not be run; {INSTALL_HINT}") from None
    except graphviz.CalledProcessError as e:
        msg = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        raise RenderError(f"Graphviz 'dot' failed (exit {e.returncode}): "
                          f"{msg[0] if msg else 'no output'}") from None
    except OSError as e:
        raise GraphvizNotFound(f"Graphviz 'dot' could not be run ({e.strerror}); {INSTALL_HINT}") from None
    if not out:
        raise RenderError("Graphviz 'dot' failed: no output")
    return out


def render_drawing(graph: Graph, path, format: str | None = None, depth: int | str | None = None,
                   scope: str | None = None, plan=None, title: str | None = None,
                   timeout: float | None = 120.0, fast: bool | None = None,
                   fold: bool = True) -> Drawing:
    """`render`, returning the `Drawing` (its `path`, counts, size and readability warning).

    ``depth="auto"`` here lays the picture out and takes the deepest depth whose picture is at
    most `READABLE_PX` pixels long (trying those of at most `AUTO_MOST_ITEMS` boxes); any picture
    longer than that gets a warning with what to try instead."""
    path = Path(path)
    fmt = output_format(path, format)
    check_writable(path)
    measure = fmt if fmt in ("png", "svg") else "svg"
    data = None
    if depth == "auto" and fmt != "dot" and find_dot() is not None:
        # the deepest depth whose picture, laid out, reads at screen size (few boxes is not
        # enough: long labels and wide fan-outs make a picture wide)
        for d in range(max_depth(graph, scope), -1, -1):
            drawing = draw(graph, d, scope, plan, title, fast=fast, fold=fold)
            if drawing.items > AUTO_MOST_ITEMS and d > 0:
                continue
            data = _drawn(drawing.source, measure, timeout, path)
            drawing.size = picture_size(data, measure)
            if drawing.size is None or max(drawing.size) <= READABLE_PX:
                break
        if measure != fmt:
            data = None
    else:
        drawing = draw(graph, depth=depth, scope=scope, plan=plan, title=title, fast=fast, fold=fold)
    drawing.path = path
    text = drawing.source
    if fmt == "dot":
        write_atomic(path, text.encode())
        return drawing
    if data is None:
        data = _drawn(text, fmt, timeout, path)
    if drawing.size is None:
        drawing.size = picture_size(data, fmt) or (
            picture_size(_drawn(text, "svg", timeout, path), "svg") if fmt == "pdf" else None)
    drawing.warning = readability_warning(drawing.items, scope, drawing.depth, drawing.size,
                                          drawing.tips)
    write_atomic(path, data)
    return drawing


def _drawn(text: str, fmt: str, timeout, path: Path) -> bytes:
    """`dot_to`; on failure the DOT text is written next to `path` and the error says where."""
    try:
        return dot_to(text, fmt, timeout=timeout)
    except RenderError as e:
        dot_path = path.with_suffix(".dot")
        write_atomic(dot_path, text.encode())
        raise type(e)(f"{e}; the DOT text was written to {dot_path}") from None


def render(graph: Graph, path, format: str | None = None, depth: int | str | None = None,
           scope: str | None = None, plan=None, title: str | None = None,
           timeout: float | None = 120.0, fast: bool | None = None, fold: bool = True) -> Path:
    """Draw `graph` into `path` (.svg, .png, .pdf, or .dot/.gv for the DOT text); the path.
    The options are `draw`'s.

    When Graphviz is missing, the DOT text is written next to `path` (``.dot``) and
    `GraphvizNotFound` says where it is and how to install Graphviz.
    """
    return render_drawing(graph, path, format, depth, scope, plan, title, timeout, fast, fold).path


__all__ = ["to_dot", "draw", "Drawing", "render", "render_drawing", "RenderError",
           "GraphvizNotFound", "quote", "dot_to", "STYLE", "FAST_LAYOUT", "READABLE_ITEMS",
           "READABLE_PX", "picture_size", "readability_warning", "node_phase",
           "check_writable", "write_atomic", "output_format", "max_depth"]
