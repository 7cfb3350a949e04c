"""The NumPy executor's memory plan as numbers and as a picture of the arena over time.

    program = executors.get("numpy").compile(graph, outputs)
    print(format_plan(plan_report(program)))
    write_arena_picture(program, "arena.svg")      # or .png (drawn by Graphviz)

The picture puts the schedule step on the x axis and the byte offset in the arena on the y
axis: every buffer is a rectangle from the step that writes it to the last step that reads it,
over the bytes it occupies, coloured by the kind of node that owns it (forward, backward,
optimizer update; kernel scratch in grey). Nodes that ran in place are drawn with a dark edge
where they take over their input's rectangle. A line shows the bytes live at each step, whose
peak is the plan's lower bound, so the gap between that line and the top of the arena is what
the placement wasted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .render import (GraphvizNotFound, RenderError, check_writable, find_dot,
                     fmt_bytes, quote, write_atomic)
from .stats import node_kind

DRAWN_KINDS = ("arena", "inplace")
COLOURS = {"forward": "#8fb3de", "backward": "#e59a8c", "update": "#8cc98a", "input": "#c9c9c9",
           "state": "#b9a6dc", "param": "#ffd86b", "const": "#dddddd", "scratch": "#bdbdbd"}


def _plan_and_graph(program_or_plan, graph=None):
    plan = getattr(program_or_plan, "plan", program_or_plan)
    graph = graph if graph is not None else getattr(program_or_plan, "graph", None)
    for attr in ("arena_bytes", "lower_bound_bytes", "naive_bytes", "entries", "schedule"):
        if not hasattr(plan, attr):
            raise RenderError(f"plan view: {type(program_or_plan).__name__} has no memory plan "
                              f"(missing '{attr}'); compile with the numpy executor")
    return plan, graph


def plan_report(program_or_plan) -> dict[str, Any]:
    """The plan's numbers: arena, lower bound, naive bytes, their ratios, in-place and view
    counts, buffers and steps."""
    plan, graph = _plan_and_graph(program_or_plan)
    arena, lower, naive = int(plan.arena_bytes), int(plan.lower_bound_bytes), int(plan.naive_bytes)
    entries = plan.entries.values()
    kinds: dict[str, int] = {}
    for e in entries:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    blocks = getattr(plan, "blocks", [])
    return {
        "steps": len(plan.schedule),
        "arena_bytes": arena,
        "lower_bound_bytes": lower,
        "naive_bytes": naive,
        "output_bytes": int(getattr(plan, "output_bytes", 0) or 0),
        "arena_over_lower_bound": arena / lower if lower else 1.0,
        "naive_over_arena": naive / arena if arena else float("inf"),
        "inplace_count": int(plan.inplace_count),
        "view_count": int(plan.view_count),
        "arena_buffers": sum(1 for b in blocks if not getattr(b, "scratch", False)
                             and not getattr(b, "dedicated", False)),
        "scratch_buffers": sum(1 for b in blocks if getattr(b, "scratch", False)),
        "entries_by_kind": dict(sorted(kinds.items())),
        "strategy": getattr(plan, "strategy", None),
    }


def format_plan(report: dict[str, Any]) -> str:
    mib = lambda n: f"{n / 2**20:,.2f} MiB"
    lines = [
        f"schedule          {report['steps']:,} steps",
        f"arena             {mib(report['arena_bytes']):>12}  ({report['arena_bytes']:,} bytes)",
        f"lower bound       {mib(report['lower_bound_bytes']):>12}  (most bytes live at one step)",
        f"naive             {mib(report['naive_bytes']):>12}  (every intermediate its own buffer)",
        f"arena/lower bound {report['arena_over_lower_bound']:>12.3f}  (1.000 is the best any placement can do)",
        f"naive/arena       {report['naive_over_arena']:>12.2f}  (memory saved by reuse)",
        f"in place          {report['inplace_count']:>12,}  nodes wrote over a dying input",
        f"views             {report['view_count']:>12,}  nodes share their base's memory",
        f"buffers           {report['arena_buffers']:>12,}  arena blocks, "
        f"{report['scratch_buffers']:,} kernel scratch blocks",
    ]
    if report.get("output_bytes"):
        lines.append(f"outputs           {fmt_bytes(report['output_bytes']):>12}  (own buffers, outside the arena)")
    if report.get("strategy"):
        lines.append(f"placement         {report['strategy']:>12}")
    return "\n".join(lines)


# -- the picture ----------------------------------------------------------------------------------------
def arena_rectangles(program_or_plan, graph=None) -> list[dict[str, Any]]:
    """One rectangle per arena buffer use: step range, byte range, owner kind, a label."""
    plan, graph = _plan_and_graph(program_or_plan, graph)
    nodes = {n.id: n for n in graph.nodes} if graph is not None else {}
    rects = []
    for e in plan.entries.values():
        if e.kind not in DRAWN_KINDS or e.offset is None:
            continue
        node = nodes.get(e.node_id)
        kind = node_kind(node) if node is not None else "forward"
        label = (f"n{e.node_id} {node.op} {node.label}" if node is not None else f"n{e.node_id}")
        if node is not None and node.scope:
            label += f" in {node.scope}"
        rects.append({"first": int(e.first), "last": int(e.last), "offset": int(e.offset),
                      "nbytes": int(e.nbytes), "kind": kind, "inplace": e.kind == "inplace",
                      "label": label})
    for b in getattr(plan, "blocks", []):
        if getattr(b, "scratch", False) and b.offset is not None and b.nbytes:
            rects.append({"first": int(b.first), "last": int(b.last), "offset": int(b.offset),
                          "nbytes": int(b.nbytes), "kind": "scratch", "inplace": False,
                          "label": f"scratch of n{b.owner}"})
    return rects


def live_profile(rects: list[dict[str, Any]], steps: int) -> list[int]:
    """Bytes live at each step: the sizes of the buffers (plan blocks, or rectangles) whose
    lifetime covers it. Its peak is the plan's lower bound."""
    delta = [0] * (steps + 2)
    for r in rects:
        delta[r["first"]] += r["nbytes"]
        delta[min(r["last"], steps) + 1] -= r["nbytes"]
    out, live = [], 0
    for k in range(steps):
        live += delta[k]
        out.append(live)
    return out


W, H = 1100, 560            # plot area, pixels
ML, MR, MT, MB = 90, 190, 48, 56


def _byte_ticks(top: int, count: int = 6) -> list[float]:
    """Round tick values for a byte axis: whole KiB/MiB/GiB steps."""
    unit = next((u for u in (1 << 30, 1 << 20, 1 << 10) if top >= 2 * u), 1)
    return [t * unit for t in _ticks(top / unit, count)]


def _ticks(top: float, count: int = 6) -> list[float]:
    if top <= 0:
        return [0.0]
    raw = top / count
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    ticks, t = [], 0.0
    while t <= top * 1.0001:
        ticks.append(t)
        t += step
    return ticks


def arena_svg(program_or_plan, graph=None, title: str | None = None) -> str:
    """The arena-over-time picture as SVG text (see the module docstring)."""
    plan, graph = _plan_and_graph(program_or_plan, graph)
    rects = arena_rectangles(plan, graph)
    steps = max(len(plan.schedule), 1)
    arena = max(int(plan.arena_bytes), max((r["offset"] + r["nbytes"] for r in rects), default=1), 1)
    sx, sy = W / steps, H / arena
    y = lambda off: MT + H - off * sy
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + ML + MR}" height="{H + MT + MB}" '
           f'viewBox="0 0 {W + ML + MR} {H + MT + MB}" font-family="Helvetica, Arial, sans-serif" '
           f'font-size="12">',
           f'<rect x="0" y="0" width="{W + ML + MR}" height="{H + MT + MB}" fill="white"/>']
    report = plan_report(plan)
    head = title or (f"arena {fmt_bytes(report['arena_bytes'])} over {report['steps']} steps: "
                     f"lower bound {fmt_bytes(report['lower_bound_bytes'])} "
                     f"(x{report['arena_over_lower_bound']:.3f}), naive "
                     f"{fmt_bytes(report['naive_bytes'])} (x{report['naive_over_arena']:.2f})")
    out.append(f'<text x="{ML}" y="24" font-size="15">{_x(head)}</text>')
    out.append(f'<rect x="{ML}" y="{MT}" width="{W}" height="{H}" fill="#fafafa" stroke="#888"/>')
    for t in _byte_ticks(arena):
        yy = y(t)
        out.append(f'<line x1="{ML - 5}" y1="{yy:.1f}" x2="{ML + W}" y2="{yy:.1f}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{ML - 8}" y="{yy + 4:.1f}" text-anchor="end">{_x(fmt_bytes(int(t)))}</text>')
    for t in _ticks(steps, 10):
        xx = ML + t * sx
        out.append(f'<line x1="{xx:.1f}" y1="{MT + H}" x2="{xx:.1f}" y2="{MT + H + 5}" stroke="#888"/>')
        out.append(f'<text x="{xx:.1f}" y="{MT + H + 19}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<text x="{ML + W / 2}" y="{MT + H + 42}" text-anchor="middle">schedule step</text>')
    out.append(f'<text x="22" y="{MT + H / 2}" text-anchor="middle" transform="rotate(-90 22 '
               f'{MT + H / 2})">arena byte offset</text>')
    out.append('<g class="buffers">')
    for r in rects:
        x0 = ML + r["first"] * sx
        w = max((r["last"] - r["first"] + 1) * sx, 0.8)
        h = max(r["nbytes"] * sy, 0.6)
        stroke = ' stroke="#222" stroke-width="0.8"' if r["inplace"] else ' stroke="#ffffff" stroke-width="0.3"'
        out.append(f'<rect class="buffer {r["kind"]}" x="{x0:.2f}" y="{y(r["offset"] + r["nbytes"]):.2f}" '
                   f'width="{w:.2f}" height="{h:.2f}" fill="{COLOURS.get(r["kind"], "#999")}"{stroke}>'
                   f'<title>{_x(r["label"])}: {r["nbytes"]:,} bytes at {r["offset"]:,}, steps '
                   f'{r["first"]}-{r["last"]}{" (in place)" if r["inplace"] else ""}</title></rect>')
    out.append('</g>')
    blocks = [b for b in getattr(plan, "blocks", []) if not getattr(b, "dedicated", False)]
    profile = live_profile([{"first": b.first, "last": b.last, "nbytes": b.nbytes} for b in blocks]
                           if blocks else rects, steps)
    if profile:
        pts = " ".join(f"{ML + k * sx:.1f},{y(v):.1f} {ML + (k + 1) * sx:.1f},{y(v):.1f}"
                       for k, v in enumerate(profile))
        out.append(f'<polyline class="live" points="{pts}" fill="none" stroke="#111" stroke-width="1.2"/>')
    lx, ly = ML + W + 16, MT + 6
    legend = [(k, COLOURS[k], text) for k, text in
              (("forward", "forward"), ("backward", "backward"), ("update", "optimizer update"),
               ("scratch", "kernel scratch"))]
    for i, (k, colour, text) in enumerate(legend):
        out.append(f'<rect x="{lx}" y="{ly + i * 20}" width="14" height="14" fill="{colour}"/>')
        out.append(f'<text x="{lx + 20}" y="{ly + i * 20 + 11}">{_x(text)} buffer</text>')
    i = len(legend)
    out.append(f'<rect x="{lx}" y="{ly + i * 20}" width="14" height="14" fill="#ddd" stroke="#222"/>')
    out.append(f'<text x="{lx + 20}" y="{ly + i * 20 + 11}">ran in place</text>')
    i += 1
    out.append(f'<line x1="{lx}" y1="{ly + i * 20 + 7}" x2="{lx + 14}" y2="{ly + i * 20 + 7}" stroke="#111" stroke-width="1.2"/>')
    out.append(f'<text x="{lx + 20}" y="{ly + i * 20 + 11}">bytes live</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _x(text: str) -> str:
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def arena_dot(program_or_plan, graph=None) -> str:
    """The same picture as a pinned-position Graphviz graph (``neato -n2``), for PNG output."""
    plan, graph = _plan_and_graph(program_or_plan, graph)
    rects = arena_rectangles(plan, graph)
    steps = max(len(plan.schedule), 1)
    arena = max(int(plan.arena_bytes), max((r["offset"] + r["nbytes"] for r in rects), default=1), 1)
    sx, sy = W / steps, H / arena       # points: 1 px of the SVG = 1 pt here
    top = MT + H + MB
    lines = ['digraph arena {', '  graph [splines=false, bgcolor="white", pad="0.2"];',
             '  node [shape=box, style="filled", label="", fixedsize=true, penwidth=0.3, color="white", fontname="Helvetica"];']
    fy = lambda yy: top - yy                # Graphviz's y axis points up
    lines.append(f'  frame [pos="{ML + W / 2:.1f},{fy(MT + H / 2):.1f}!", width={W / 72:.3f}, '
                 f'height={H / 72:.3f}, fillcolor="#fafafa", color="#888888", penwidth=1];')
    for i, r in enumerate(rects):
        w = max((r["last"] - r["first"] + 1) * sx, 0.8)
        h = max(r["nbytes"] * sy, 0.6)
        cx = ML + r["first"] * sx + w / 2
        cy = MT + H - (r["offset"] + r["nbytes"] / 2) * sy
        edge = ', color="#222222", penwidth=0.8' if r["inplace"] else ""
        lines.append(f'  r{i} [pos="{cx:.2f},{fy(cy):.2f}!", width={w / 72:.4f}, height={h / 72:.4f}, '
                     f'fillcolor="{COLOURS.get(r["kind"], "#999999")}"{edge}];')
    report = plan_report(plan)
    text = (f"arena {fmt_bytes(report['arena_bytes'])} over {report['steps']} steps: lower bound "
            f"{fmt_bytes(report['lower_bound_bytes'])} (x{report['arena_over_lower_bound']:.3f}), "
            f"naive {fmt_bytes(report['naive_bytes'])} (x{report['naive_over_arena']:.2f})")
    lines.append(f'  title [shape=plaintext, style="", fixedsize=false, label={quote(text)}, '
                 f'fontsize=15, pos="{ML + W / 2:.1f},{fy(22):.1f}!"];')
    for t in _byte_ticks(arena):
        lines.append(f'  ty{int(t)} [shape=plaintext, style="", fixedsize=false, fontsize=11, '
                     f'label={quote(fmt_bytes(int(t)))}, pos="{ML - 36:.1f},{fy(MT + H - t * sy):.1f}!"];')
    for t in _ticks(steps, 10):
        lines.append(f'  tx{int(t)} [shape=plaintext, style="", fixedsize=false, fontsize=11, '
                     f'label="{int(t)}", pos="{ML + t * sx:.1f},{fy(MT + H + 16):.1f}!"];')
    lines.append(f'  xl [shape=plaintext, style="", fixedsize=false, label="schedule step -> ;  '
                 f'y: arena byte offset", pos="{ML + W / 2:.1f},{fy(MT + H + 40):.1f}!"];')
    for i, (k, text) in enumerate((("forward", "forward"), ("backward", "backward"),
                                   ("update", "optimizer update"), ("scratch", "kernel scratch"))):
        lines.append(f'  lg{i} [pos="{ML + W + 24:.1f},{fy(MT + 12 + 20 * i):.1f}!", width=0.2, '
                     f'height=0.2, fillcolor="{COLOURS[k]}"];')
        lines.append(f'  lt{i} [shape=plaintext, style="", fixedsize=false, fontsize=11, '
                     f'label={quote(text + " buffer")}, pos="{ML + W + 100:.1f},{fy(MT + 12 + 20 * i):.1f}!"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_arena_picture(program_or_plan, path, format: str | None = None, graph=None,
                        timeout: float | None = 60.0) -> Path:
    """Write the arena picture to `path`: SVG (written directly) or PNG (via Graphviz)."""
    path = Path(path)
    fmt = (format or path.suffix.lstrip(".")).lower()
    if fmt not in ("svg", "png"):
        raise RenderError(f"plan picture: cannot write '{path}': use a .svg or .png file")
    check_writable(path)
    if fmt == "svg":
        write_atomic(path, arena_svg(program_or_plan, graph).encode())
        return path
    text = arena_dot(program_or_plan, graph)
    if find_dot() is None:
        svg = path.with_suffix(".svg")
        write_atomic(svg, arena_svg(program_or_plan, graph).encode())
        raise GraphvizNotFound(f"Graphviz is not installed, so no PNG; wrote the picture as {svg} "
                               "instead; install Graphviz: apt-get install -y graphviz")
    write_atomic(path, _neato(text, timeout))
    return path


def _neato(text: str, timeout) -> bytes:
    import shutil
    import subprocess

    exe = shutil.which("neato") or shutil.which("dot")
    args = [exe, "-n2", "-Tpng"] if exe.endswith("neato") else [exe, "-Kneato", "-n2", "-Tpng"]
    try:
        proc = subprocess.run(args, input=text.encode(), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RenderError(f"Graphviz took longer than {timeout:g} s to draw the arena picture") from None
    if proc.returncode != 0 or not proc.stdout:
        msg = proc.stderr.decode(errors="replace").strip().splitlines()
        raise RenderError(f"Graphviz failed drawing the arena picture: {msg[0] if msg else 'no output'}")
    return proc.stdout


__all__ = ["plan_report", "format_plan", "arena_rectangles", "live_profile", "arena_svg",
           "arena_dot", "write_arena_picture"]
