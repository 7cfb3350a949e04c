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
    with a double border, views dashed with the node whose memory they share.

DOT node ids are plain ``n<id>`` (module boxes ``m<k>``, clusters ``cluster_<k>``), never
names: Graphviz reads ``a:b`` in an id as node ``a``, port ``b``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from graphlm.ir import Graph, Tensor, fmt_shape

from .stats import KINDS, all_scopes, home_scope, module_levels, node_kind

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
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _is_folded_const(node: Tensor) -> bool:
    return node.op == "const" and node.shape == ()


def _const_text(node: Tensor) -> str:
    value = node.attrs["value"].item()
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _attr_text(node: Tensor) -> str:
    """The op attributes worth a glance (axis, eps, exponent ...), short."""
    parts = []
    for key, value in node.attrs.items():
        if key in ("value", "writes") or key.startswith("_"):
            continue
        if isinstance(value, float):
            text = f"{value:.3g}"
        elif isinstance(value, (int, bool, str)):
            text = str(value)
        elif isinstance(value, tuple) and len(value) <= 6 and all(isinstance(v, (int, type(None))) for v in value):
            text = ",".join("_" if v is None else str(v) for v in value) or "()"
        else:
            continue
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
        head = f"{node.op} {node.name}"
    elif node.is_leaf:
        head = node.op
    else:
        head = node.op
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
                lines.append(f"view of n{base}" + (f" @{offset:,}" if offset is not None else ""))
                style["style"] = "filled,dashed" if kind != "forward" and kind != "backward" \
                    else "rounded,filled,dashed"
            elif where == "arena":
                lines.append(f"arena @{offset:,} ({fmt_bytes(nbytes)})")
            elif where == "fused":
                lines.append(f"fused into n{_entry_base(entry)} (no buffer)")
                style["style"] = "rounded,filled,dotted"
            elif where == "output":
                lines.append(f"output buffer ({fmt_bytes(nbytes)})")
    return "\n".join(lines), style


class _Cluster:
    __slots__ = ("path", "children", "items")

    def __init__(self, path: str):
        self.path = path
        self.children: dict[str, _Cluster] = {}
        self.items: list[str] = []


def to_dot(graph: Graph, depth: int | None = None, scope: str | None = None, plan=None,
           title: str | None = None, legend: bool = True, fast: bool | None = None) -> str:
    """The DOT text of `graph` (see the module docstring for what it shows).

    depth: module levels drawn as clusters (None: all, nothing collapsed); scope: a module path
    (``blocks.1``) to draw alone; plan: a NumPy executor plan (``program.plan``) to annotate
    with; fast: use the fast layout settings (default: when more than 400 items are drawn).
    """
    if not isinstance(graph, Graph):
        raise RenderError(f"render: expected a graphlm.Graph, got {type(graph).__name__}")
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 0):
        raise RenderError(f"render: depth must be a non-negative integer or None, got {depth!r}")
    scopes = all_scopes(graph)
    base_levels: list[str] = []
    if scope:
        if scope not in scopes:
            top = sorted(s for s in scopes if len(module_levels(s)) <= 1)
            raise RenderError(f"render: graph '{graph.name}' has no module scope '{scope}' "
                              f"(top-level modules: {', '.join(top) or 'none'})")
        base_levels = module_levels(scope)

    homes = {n.id: home_scope(n, scopes) for n in graph.nodes}

    def inside(node: Tensor) -> bool:
        h = homes[node.id]
        return not scope or h == scope or h.startswith(scope + ".")

    in_scope = [n for n in graph.nodes if inside(n)]
    shown = [n for n in in_scope if not _is_folded_const(n)]
    # with a scope, the module itself is the outer cluster and depth counts from it
    root_levels = [scope] if scope else []
    rel_levels = {n.id: module_levels(homes[n.id])[len(base_levels):] for n in in_scope}

    def collapsed(n: Tensor) -> bool:
        return depth is not None and len(rel_levels[n.id]) > depth

    # An optimizer update reads every parameter and both its moments: hundreds of edges from the
    # top of the picture to the bottom, which make dot slow and the picture a hairball. The
    # param/state inputs of such a node are drawn as one summary node per kind, and states that
    # nothing else reads are drawn only there.
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

    def cluster_for(levels: list[str]) -> _Cluster:
        c = top_cluster
        for path in levels:
            if path not in c.children:
                c.children[path] = _Cluster(path)
            c = c.children[path]
        return c

    for n in in_scope:
        if n.id in hidden:
            continue
        levels = rel_levels[n.id]
        if collapsed(n):   # counted in its module's box (scalar constants too)
            path = levels[depth]
            box = boxes.get(path)
            if box is None:
                parent = levels[depth - 1] if depth else (scope or "")
                box = boxes[path] = {"id": f"m{len(boxes)}", "nodes": 0, "kinds": defaultdict(int),
                                     "params": 0, "short": path[len(parent) + 1:] if parent else path}
                cluster_for(root_levels + levels[:depth]).items.append(box["id"])
            box["nodes"] += 1
            box["kinds"][node_kind(n)] += 1
            if n.op == "param":
                box["params"] += n.size
            rep[n.id] = box["id"]
        elif _is_folded_const(n):
            continue
        else:
            rep[n.id] = f"n{n.id}"
            cluster = cluster_for(root_levels + levels)
            cluster.items.append(rep[n.id])
            for kind in groups.get(n.id, {}):
                cluster.items.append(f"g{n.id}_{kind}")

    # edges between drawn items; scalar constants fold into their reader's label
    edges: dict[tuple[str, str], int] = {}
    folded: dict[int, list[Tensor]] = defaultdict(list)
    stubs: dict[int, Tensor] = {}
    for n in shown:
        grouped = {i.id: kind for kind, ins in groups.get(n.id, {}).items() for i in ins}
        for src in n.inputs:
            if src.id in grouped:
                edges[(f"g{n.id}_{grouped[src.id]}", rep[n.id])] = 1
                continue
            if _is_folded_const(src):
                if rep[n.id] == f"n{n.id}" and src not in folded[n.id]:
                    folded[n.id].append(src)
                continue
            if src.id in shown_ids:
                a = rep[src.id]
            else:
                stubs[src.id] = src
                a = f"x{src.id}"
            b = rep[n.id]
            if a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1

    drawn = len([r for r in rep.values() if r.startswith("n")]) + len(boxes) + len(stubs) \
        + sum(len(g) for g in groups.values())
    if fast is None:
        fast = drawn > FAST_LAYOUT_ABOVE

    out: list[str] = [f"digraph {quote(graph.name)} {{"]
    gattrs = {"rankdir": "TB", "newrank": "true", "compound": "false", "fontname": "Helvetica",
              "fontsize": "12", "nodesep": "0.25", "ranksep": "0.35", "labeljust": "l",
              "outputorder": "edgesfirst"}
    if fast:
        gattrs.update(FAST_LAYOUT)
    caption = title or _default_title(graph, depth, scope, plan, len(in_scope))
    gattrs["label"] = caption
    gattrs["labelloc"] = "t"
    out.append("  graph [" + ", ".join(f"{k}={quote(v)}" for k, v in gattrs.items()) + "];")
    out.append('  node [fontname="Helvetica", fontsize="10", style="filled", penwidth="1"];')
    out.append('  edge [color="#777777", arrowsize="0.6", penwidth="0.8"];')

    node_by_id = {n.id: n for n in shown}

    def emit_item(item: str, indent: str):
        if item.startswith("g"):
            nid, kind = item[1:].split("_", 1)
            ins = groups[int(nid)][kind]
            n_hidden = sum(i.id in hidden for i in ins)
            lines = [f"{len(ins)} {kind}s read and written in place",
                     f"{sum(i.size for i in ins):,} elements, {fmt_bytes(sum(i.nbytes for i in ins))}"]
            if n_hidden:
                lines.append(f"({n_hidden} drawn only here)")
            fill, border, _ = STYLE[kind]
            out.append(f"{indent}{item} [label={quote(chr(10).join(lines))}, shape=folder, "
                       f"style=\"filled\", fillcolor={quote(fill)}, color={quote(border)}];")
            return
        if item.startswith("m"):
            path, box = next((p, b) for p, b in boxes.items() if b["id"] == item)
            kinds = ", ".join(f"{c} {k}" for k, c in box["kinds"].items())
            lines = [box["short"], f"{box['nodes']:,} nodes: {kinds}",
                     f"{box['params']:,} parameters" if box["params"] else "no parameters"]
            fill, border, _ = STYLE["module"]
            out.append(f"{indent}{item} [label={quote(chr(10).join(lines))}, shape=box, "
                       f"style=\"filled,bold\", fillcolor={quote(fill)}, color={quote(border)}, "
                       f"tooltip={quote(path)}];")
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
        out.append(f"{indent}{item} [" + ", ".join(f"{k}={quote(v)}" for k, v in attrs.items()) + "];")

    counter = [0]

    def emit_cluster(c: _Cluster, level: int, indent: str):
        for item in c.items:
            emit_item(item, indent)
        for path, child in sorted(c.children.items(), key=lambda kv: _natural_key(kv[0])):
            cid = f"cluster_{counter[0]}"
            counter[0] += 1
            fill = CLUSTER_FILLS[min(level, len(CLUSTER_FILLS) - 1)]
            out.append(f"{indent}subgraph {cid} {{")
            out.append(f"{indent}  graph [label={quote(path)}, tooltip={quote(path)}, "
                       f"style=\"rounded,filled\", fillcolor={quote(fill)}, color=\"#9aa5b1\", "
                       f"fontsize=\"11\"];")
            emit_cluster(child, level + 1, indent + "  ")
            out.append(f"{indent}}}")

    emit_cluster(top_cluster, 0, "  ")
    for sid, src in sorted(stubs.items()):
        where = homes[src.id] or "<root>"
        out.append(f"  x{sid} [label={quote(f'from {src.label}  ({where})' + chr(10) + fmt_shape(src.shape) + ' ' + short_dtype(src.dtype))}, "
                   f"shape=box, style=\"dashed,filled\", fillcolor=\"#f4f4f4\", color=\"#aaaaaa\", "
                   f"fontcolor=\"#555555\"];")
    for (a, b), count in edges.items():
        extra = f" [penwidth={quote(min(0.8 + 0.3 * (count - 1), 3.0))}]" if count > 1 else ""
        out.append(f"  {a} -> {b}{extra};")
    if legend:
        out.append(_legend(graph, [n for n in shown if rep[n.id] == f"n{n.id}"] +
                           [i for g in groups.values() for ins in g.values() for i in ins],
                           boxes, plan))
    out.append("}")
    return "\n".join(out) + "\n"


def _natural_key(path: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def _default_title(graph: Graph, depth, scope, plan, count) -> str:
    parts = [f"{graph.name}: {count:,} nodes"]
    if scope:
        parts.append(f"scope {scope}")
    if depth is not None:
        parts.append(f"depth {depth}")
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
    table = ('<<TABLE BORDER="1" COLOR="#9aa5b1" CELLBORDER="0" CELLSPACING="3" CELLPADDING="2">'
             '<TR><TD COLSPAN="2"><B>legend</B></TD></TR>' + "".join(rows) + "</TABLE>>")
    return f"  legend [shape=plaintext, style=\"\", label={table}];"


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
    """Run Graphviz `dot` on DOT text; the rendered bytes. Raises GraphvizNotFound/RenderError."""
    exe = find_dot()
    if exe is None:
        raise GraphvizNotFound(f"Graphviz 'dot' was not found on PATH; {INSTALL_HINT}")
    try:
        proc = subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RenderError(f"Graphviz 'dot' took longer than {timeout:g} s; draw less of the graph "
                          "(depth=1, or scope=a module)") from None
    except OSError as e:
        raise GraphvizNotFound(f"Graphviz 'dot' could not be run ({e.strerror}); {INSTALL_HINT}") from None
    if proc.returncode != 0 or not proc.stdout:
        msg = proc.stderr.decode(errors="replace").strip().splitlines()
        raise RenderError(f"Graphviz 'dot' failed (exit {proc.returncode}): "
                          f"{msg[0] if msg else 'no output'}")
    return proc.stdout


def render(graph: Graph, path, format: str | None = None, depth: int | None = None,
           scope: str | None = None, plan=None, title: str | None = None,
           timeout: float | None = 120.0, fast: bool | None = None) -> Path:
    """Draw `graph` into `path` (.svg, .png, .pdf, or .dot/.gv for the DOT text); the path.

    When Graphviz is missing, the DOT text is written next to `path` (``.dot``) and
    `GraphvizNotFound` says where it is and how to install Graphviz.
    """
    path = Path(path)
    fmt = output_format(path, format)
    check_writable(path)
    text = to_dot(graph, depth=depth, scope=scope, plan=plan, title=title, fast=fast)
    if fmt == "dot":
        write_atomic(path, text.encode())
        return path
    try:
        data = dot_to(text, fmt, timeout=timeout)
    except RenderError as e:
        dot_path = path.with_suffix(".dot")
        write_atomic(dot_path, text.encode())
        raise type(e)(f"{e}; the DOT text was written to {dot_path}") from None
    write_atomic(path, data)
    return path


__all__ = ["to_dot", "render", "RenderError", "GraphvizNotFound", "quote", "dot_to", "STYLE",
           "FAST_LAYOUT", "check_writable", "write_atomic", "output_format"]
