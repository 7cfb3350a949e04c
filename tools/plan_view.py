"""The NumPy executor's memory plan as numbers and as a picture of the arena over time.

    program = executors.get("numpy").compile(graph, outputs)
    print(format_plan(plan_report(program)))
    write_arena_picture(program, "arena.svg")      # or .png / .pdf (matplotlib, one drawing)

The picture puts the schedule step on the x axis and the byte offset in the arena on the y
axis: every buffer is a rectangle from the step that writes it to the last step that reads it,
over the bytes it occupies, coloured by the kind of node that owns it (forward, backward,
optimizer update; kernel scratch in grey). Nodes that ran in place are drawn with a dark edge
where they take over their input's rectangle. Kept values (what a forward keeps for its
backward, tensors a graph pass marked ``attrs["kept"]``) are hatched over the bytes they take,
from the step that makes them to their last reader. A line shows the bytes live at each step, whose
peak is the plan's lower bound, so the gap between that line and the top of the arena is what
the placement wasted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .render import RenderError, check_writable, fmt_bytes
from .stats import node_kind

DRAWN_KINDS = ("arena", "inplace")
COLOURS = {"forward": "#8fb3de", "backward": "#e59a8c", "update": "#8cc98a", "input": "#c9c9c9",
           "state": "#b9a6dc", "param": "#ffd86b", "const": "#dddddd", "scratch": "#bdbdbd"}
KEPT_EDGE = "#5a2a82"   # the hatching over kept values


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
    counts, kept values, buffers and steps."""
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
        "kept_bytes": int(getattr(plan, "kept_bytes", 0)),
        "kept_count": len(getattr(plan, "kept", {})),
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
        f"kept values       {mib(report['kept_bytes']):>12}  ({report['kept_count']:,} tensors a forward keeps "
        f"for its backward, inside the arena)",
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
    for nid in getattr(plan, "kept", {}):
        e = plan.entries.get(nid)
        if e is None or e.offset is None or e.kind not in DRAWN_KINDS + ("view",):
            continue   # (an output's kept value lives in its own buffer, outside the arena)
        node = nodes.get(nid)
        label = f"kept n{nid} {node.op} {node.label}" if node is not None else f"kept n{nid}"
        rects.append({"first": int(e.first), "last": int(e.last), "offset": int(e.offset),
                      "nbytes": int(e.nbytes), "kind": "kept", "inplace": False, "label": label})
    for b in getattr(plan, "blocks", []):
        if getattr(b, "scratch", False) and b.offset is not None and b.nbytes:
            rects.append({"first": int(b.first), "last": int(b.last), "offset": int(b.offset),
                          "nbytes": int(b.nbytes), "kind": "scratch", "inplace": False,
                          "label": f"scratch of n{b.owner}"})
    return rects


def live_profile(rects: list[dict[str, Any]], steps: int) -> list[int]:
    """Bytes live at each step: the sizes of the buffers (plan blocks, or rectangles) whose
    lifetime covers it; each buffer counted once (`plan_live_profile`)."""
    delta = [0] * (steps + 2)
    for r in rects:
        delta[r["first"]] += r["nbytes"]
        delta[min(r["last"], steps) + 1] -= r["nbytes"]
    out, live = [], 0
    for k in range(steps):
        live += delta[k]
        out.append(live)
    return out


def plan_live_profile(plan, rects: list[dict[str, Any]], steps: int) -> list[int]:
    """The plan's bytes-live line: from its arena blocks where it has them (a dedicated block
    lies outside the arena), else from `rects` less the kept values' rectangles, which lie over
    bytes another rectangle already counts. Its peak is the plan's lower bound."""
    blocks = [b for b in getattr(plan, "blocks", []) if not getattr(b, "dedicated", False)]
    if blocks:
        return live_profile([{"first": b.first, "last": b.last, "nbytes": b.nbytes} for b in blocks], steps)
    return live_profile([r for r in rects if r["kind"] != "kept"], steps)


def _byte_unit(top: int) -> tuple[int, str]:
    """The largest of GiB, MiB, KiB, B of which `top` holds at least two."""
    return next(((size, unit) for size, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
                 if top >= 2 * size), (1, "B"))


LEGEND = (("forward", "forward buffer"), ("backward", "backward buffer"),
          ("update", "optimizer update buffer"), ("input", "input buffer"), ("state", "state buffer"),
          ("param", "parameter buffer"), ("const", "constant buffer"), ("scratch", "kernel scratch"))


def draw_arena(program_or_plan, graph=None, title: str | None = None):
    """The arena-over-time picture as a matplotlib figure (see the module docstring): one
    rectangle per buffer (the collection with gid "buffers"), the bytes-live line, a legend of
    the kinds that occur."""
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    from .figure import pyplot

    plt = pyplot()
    plan, graph = _plan_and_graph(program_or_plan, graph)
    rects = arena_rectangles(plan, graph)
    steps = max(len(plan.schedule), 1)
    arena = max(int(plan.arena_bytes), max((r["offset"] + r["nbytes"] for r in rects), default=1), 1)
    unit, unit_name = _byte_unit(arena)
    fig, ax = plt.subplots(figsize=(11, 5.6))
    polys = []
    for r in rects:
        x0, x1 = r["first"], r["last"] + 1
        y0, y1 = r["offset"] / unit, (r["offset"] + r["nbytes"]) / unit
        polys.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
    kept = [r["kind"] == "kept" for r in rects]
    faces = [COLOURS.get(r["kind"], "#999999") for r, k in zip(rects, kept) if not k]
    edges = ["#222222" if r["inplace"] else "#ffffff" for r, k in zip(rects, kept) if not k]
    widths = [0.8 if r["inplace"] else 0.2 for r, k in zip(rects, kept) if not k]
    buffers = PolyCollection([p for p, k in zip(polys, kept) if not k], facecolors=faces, edgecolors=edges,
                             linewidths=widths)
    buffers.set_gid("buffers")
    ax.add_collection(buffers)
    if any(kept):   # hatched over the buffers that hold them
        hatched = PolyCollection([p for p, k in zip(polys, kept) if k], facecolors="none",
                                 edgecolors=KEPT_EDGE, linewidths=0.6, hatch="////")
        hatched.set_gid("kept")
        ax.add_collection(hatched)
    profile = plan_live_profile(plan, rects, steps)
    if profile:
        ax.step(range(len(profile) + 1), [v / unit for v in profile] + [profile[-1] / unit],
                where="post", color="#111111", lw=1.1, gid="live")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, arena / unit * 1.02)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g} {unit_name}" if v else "0"))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.set_xlabel("schedule step")
    ax.set_ylabel("arena byte offset")
    ax.grid(True, axis="y", color="#e4e4e4", lw=0.6)
    ax.set_axisbelow(True)
    ax.set_facecolor("#fafafa")
    report = plan_report(plan)
    ax.set_title(title or (f"arena {fmt_bytes(report['arena_bytes'])} over {report['steps']:,} steps: "
                           f"lower bound {fmt_bytes(report['lower_bound_bytes'])} "
                           f"(x{report['arena_over_lower_bound']:.3f}), naive "
                           f"{fmt_bytes(report['naive_bytes'])} (x{report['naive_over_arena']:.2f}), "
                           f"kept values {fmt_bytes(report['kept_bytes'])}"),
                 fontsize=11, loc="left")
    present = {r["kind"] for r in rects}
    handles = [Patch(facecolor=COLOURS[k], label=text) for k, text in LEGEND if k in present]
    if "kept" in present:
        handles.append(Patch(facecolor="none", edgecolor=KEPT_EDGE, hatch="////",
                             label=f"kept value ({fmt_bytes(report['kept_bytes'])})"))
    if any(r["inplace"] for r in rects):
        handles.append(Patch(facecolor="#dddddd", edgecolor="#222222", lw=0.8, label="ran in place"))
    if profile:
        handles.append(Line2D([], [], color="#111111", lw=1.1, label="bytes live"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    return fig


def write_arena_picture(program_or_plan, path, format: str | None = None, graph=None) -> Path:
    """Write the arena picture to `path`: .png, .svg or .pdf (matplotlib; one drawing for all)."""
    from .figure import FigureError, figure_format, save_figure

    path = Path(path)
    try:
        fmt = figure_format(path, format)
    except FigureError as e:
        raise RenderError(f"plan picture: {e}") from None
    check_writable(path)
    return save_figure(draw_arena(program_or_plan, graph), path, fmt)


__all__ = ["plan_report", "format_plan", "arena_rectangles", "live_profile", "plan_live_profile", "draw_arena",
           "write_arena_picture"]
