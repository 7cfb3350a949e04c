"""The interactive graph page: one self-contained HTML file that works with no network.

    from graphlm.tools.html_page import write_page, page_data
    write_page(graph, "graph.html", plan=program.plan)     # or: graphlm render ... --out graph.html

The page lays the graph out with Graphviz itself, compiled to WebAssembly (hpcc-js's
`@hpcc-js/wasm-graphviz`, vendored in page_assets/vendor/ with its licence): the same engine and
the same DOT styles as the static pictures, re-run in the browser on every expand or collapse.
Everything it needs is inlined: the layout engine, page_assets/page.js and page.css, and the graph
as JSON (`page_data`). What the page does is described in page.js's header.

This file only gathers the data (nodes, modules, repeats, the memory plan) and writes the file;
labels and colours come from tools/render.py, folding from tools/folding.py, the arena
rectangles from tools/plan_view.py, so the page and the static pictures say the same thing.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from graphlm.ir import Graph, Tensor, fmt_shape
from graphlm.registry import REGISTRY

from .folding import graph_repeats, is_scalar_const
from .render import (BUNDLE_COLOUR, CLUSTER_FILLS, FANIN_GROUP_ABOVE, LEAF_SHAPE, STYLE, RenderError,
                     _attr_text, _const_text, check_writable, fmt_bytes, node_label, write_atomic)
from .stats import all_scopes, graph_homes, module_levels, node_kind

ASSETS = Path(__file__).with_name("page_assets")
VENDOR_GRAPHVIZ = ASSETS / "vendor" / "hpcc-js-wasm-graphviz" / "index.js"
#: attrs a graph pass may set on the nodes it makes to say which pass it was
PASS_ATTRS = ("pass", "made_by", "fused_by", "_pass")


def section_of(node: Tensor, optimizer_scopes: set[str], only_update: bool) -> str:
    """The toggle a node belongs to: ``optimizer`` (update nodes, the nodes of the update's
    top-level module, moments only the update reads), ``backward`` or ``forward``."""
    kind = node_kind(node)
    levels = module_levels(node.scope)
    if kind == "update" or (levels and levels[0] in optimizer_scopes) or only_update:
        return "optimizer"
    return "backward" if kind == "backward" else "forward"


def made_by(node: Tensor) -> str:
    """Which part of graphlm made a node: a graph pass (named by the node's attrs), the
    differentiation pass, the optimizer, or the model."""
    for key in PASS_ATTRS:
        if node.attrs.get(key):
            return f"pass {node.attrs[key]}"
    kind = node_kind(node)
    if kind == "update":
        return "optimizer (update)"
    if kind == "backward":
        return "differentiation pass (graphlm.autodiff)"
    return "leaf" if node.is_leaf else "model code"


def _attrs_full(node: Tensor) -> dict[str, str]:
    out = {}
    for key, value in node.attrs.items():
        if key == "value" and hasattr(value, "shape"):
            text = _const_text(node) if value.shape == () else f"array {fmt_shape(value.shape)}"
        elif key == "writes" and isinstance(value, (list, tuple)):
            text = f"{len(value)} tensors"
        else:
            text = repr(value)
        out[key] = text if len(text) <= 200 else text[:197] + "..."
    return out


def page_data(graph: Graph, plan=None, title: str | None = None) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data."""
    if not isinstance(graph, Graph):
        raise RenderError(f"page: expected a graphlm.Graph, got {type(graph).__name__}")
    scopes = all_scopes(graph)
    homes = graph_homes(graph)
    consumers: dict[int, list[Tensor]] = defaultdict(list)
    for n in graph.nodes:
        for i in n.inputs:
            consumers[i.id].append(n)
    optimizer_scopes = {module_levels(n.scope)[0] for n in graph.nodes
                        if node_kind(n) == "update" and module_levels(n.scope)}
    partner = {t.id: f.id for t, f in graph.forward_partner.items() if t.id >= 0 and f.id >= 0}
    entries = getattr(plan, "entries", None) or {}
    nodes = []
    for n in graph.nodes:
        if is_scalar_const(n):
            continue
        only_update = (n.op in ("param", "state") and bool(consumers[n.id])
                       and all(node_kind(c) == "update" for c in consumers[n.id]))
        folded = [c for c in n.inputs if is_scalar_const(c)]
        label, extra = node_label(n, list(dict.fromkeys(folded)), plan)
        op = REGISTRY.get(n.op)
        e = entries.get(n.id)
        item = {
            "id": n.id, "op": n.op, "name": n.name, "scope": homes[n.id], "kind": node_kind(n),
            "levels": module_levels(homes[n.id]), "size": n.size,
            "section": section_of(n, optimizer_scopes, only_update and n.op == "state"),
            "shape": fmt_shape(n.shape), "dtype": str(n.dtype), "bytes": n.nbytes,
            "label": label, "style": extra, "shape_kind": LEAF_SHAPE.get(n.op, "box"),
            "attrs": _attrs_full(n), "attrs_short": _attr_text(n),
            "inputs": [i.id for i in n.inputs if not is_scalar_const(i)],
            "consts": [_const_text(c) for c in folded],
            "partner": partner.get(n.id), "made_by": made_by(n),
            "fused": bool(op is not None and op.decompose is not None and not n.is_leaf),
            "doc": (op.doc if op is not None else "") or "",
            "only_update": only_update,
        }
        if e is not None:
            item["plan"] = {"kind": e.kind, "offset": e.offset, "nbytes": int(e.nbytes),
                            "first": int(e.first), "last": int(e.last),
                            "base": getattr(e, "base", None)}
        nodes.append(item)
    modules = []
    for path in sorted(scopes):
        levels = module_levels(path)
        parent = levels[-2] if len(levels) > 1 else ""
        modules.append({"path": path, "parent": parent, "depth": len(levels) - 1,
                        "short": path[len(parent) + 1:] if parent else path})
    repeats = [{"label": r.label, "container": r.container, "members": r.members,
                "node_map": {str(k): v for k, v in r.node_map.items()}}
               for r in graph_repeats(graph)]
    data: dict[str, Any] = {
        "title": title or graph.name, "graph": graph.name, "node_count": len(graph.nodes),
        "style": {k: list(v) for k, v in STYLE.items()}, "cluster_fills": list(CLUSTER_FILLS),
        "fanin_group_above": FANIN_GROUP_ABOVE, "bundle_colour": BUNDLE_COLOUR,
        "nodes": nodes, "modules": modules, "repeats": repeats, "plan": None,
    }
    if plan is not None:
        data["plan"] = _plan_data(plan, graph)
    return data


def _plan_data(plan, graph: Graph) -> dict[str, Any]:
    from .plan_view import COLOURS, arena_rectangles, plan_live_profile, plan_report

    rects = arena_rectangles(plan, graph)
    report = plan_report(plan)
    steps = len(plan.schedule)
    owner = re.compile(r"^n(\d+)")
    for r in rects:      # the node a rectangle belongs to (scratch: the node using it)
        m = owner.match(r["label"]) or re.search(r"of n(\d+)", r["label"])
        r["node"] = int(m.group(1)) if m else None
    return {"arena_bytes": report["arena_bytes"], "lower_bound_bytes": report["lower_bound_bytes"],
            "naive_bytes": report["naive_bytes"], "steps": steps, "rects": rects,
            "live": plan_live_profile(plan, rects, steps), "arena_text": fmt_bytes(report["arena_bytes"]),
            "schedule": [int(i) for i in plan.schedule], "colours": COLOURS}


def _vendored_graphviz() -> str:
    """The vendored ES module, turned into a classic script that sets ``window.GraphvizWasm``
    (a page opened from a file cannot import a module from next to it)."""
    text = VENDOR_GRAPHVIZ.read_text(encoding="utf-8")
    text = re.sub(r"\n//# sourceMappingURL=.*$", "", text.rstrip())
    m = re.search(r"export\s*\{([^}]*)\}\s*;?\s*$", text)
    if m is None:
        raise RenderError(f"page: {VENDOR_GRAPHVIZ} does not end in an export list")
    names = []
    for part in m.group(1).split(","):
        local, _, public = part.strip().partition(" as ")
        names.append(f"{(public or local).strip()}: {local.strip()}")
    return ("(function () {\n" + text[:m.start()] + "\nwindow.GraphvizWasm = {"
            + ", ".join(names) + "};\n})();")


def _script(text: str) -> str:
    return text.replace("</script", "<\\/script")


def page_html(graph: Graph, plan=None, title: str | None = None) -> str:
    """The page's HTML text."""
    data = json.dumps(page_data(graph, plan, title), separators=(",", ":"))
    css = (ASSETS / "page.css").read_text(encoding="utf-8")
    js = (ASSETS / "page.js").read_text(encoding="utf-8")
    name = title or graph.name
    esc = name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{esc} - graphlm</title>\n<style>\n{css}\n</style>\n</head>\n<body>\n"
        f"<script id=\"graph-data\" type=\"application/json\">{_script(data)}</script>\n"
        f"<script>\n{_script(_vendored_graphviz())}\n</script>\n"
        f"<script>\n{_script(js)}\n</script>\n</body>\n</html>\n")


def write_page(graph: Graph, path, plan=None, title: str | None = None) -> Path:
    """Write the page of `graph` (annotated with `plan`, a numpy executor plan) to `path`."""
    path = Path(path)
    check_writable(path)
    write_atomic(path, page_html(graph, plan, title).encode("utf-8"))
    return path


__all__ = ["write_page", "page_html", "page_data", "section_of", "made_by", "PASS_ATTRS"]
