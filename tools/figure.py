"""matplotlib for the tools: the Agg backend (no display needed), and writing a figure to PNG,
SVG or PDF by its file suffix, atomically (never a half-written picture).

    fig, plt = new_figure(figsize=(8, 5))
    ...
    save_figure(fig, Path("loss.png"))
"""
from __future__ import annotations

import io
from pathlib import Path

FIGURE_FORMATS = ("png", "svg", "pdf")


class FigureError(ValueError):
    """A picture that cannot be drawn or written (named with its path)."""


def pyplot():
    """matplotlib.pyplot on the Agg backend; a clear error when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise FigureError("drawing pictures needs matplotlib (python -m pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    matplotlib.rcParams["svg.fonttype"] = "none"      # SVG text stays text (searchable, small)
    import matplotlib.pyplot as plt
    return plt


def figure_format(path: Path, fmt: str | None = None) -> str:
    """The format named by `fmt` or by the suffix of `path`: png, svg or pdf."""
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt not in FIGURE_FORMATS:
        raise FigureError(f"cannot draw '{path}': give a .png, .svg or .pdf file "
                          f"(got {'no suffix' if not fmt else '.' + fmt})")
    return fmt


def save_figure(fig, path: str | Path, fmt: str | None = None, dpi: int = 100,
                tight: bool = True) -> Path:
    """Write `fig` to `path` (format from `fmt` or the suffix) through a temporary file, then
    close it. `tight` crops to the drawn area (a second layout pass; a figure with its own layout
    engine does not need it)."""
    from .render import write_atomic

    path = Path(path)
    fmt = figure_format(path, fmt)
    buf = io.BytesIO()
    # metadata: no creation date, so the same figure writes the same bytes
    metadata = {"png": {"Software": None}, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
    try:
        fig.savefig(buf, format=fmt, dpi=dpi, bbox_inches="tight" if tight else None,
                    metadata=metadata)
    finally:
        pyplot().close(fig)
    write_atomic(path, buf.getvalue())
    return path


__all__ = ["FIGURE_FORMATS", "FigureError", "pyplot", "figure_format", "save_figure"]
