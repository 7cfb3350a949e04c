"""The attention picture: every layer's and head's attention probabilities for one prompt.

    from graphlm.tools.attention import attention_maps, token_labels, write_attention_picture
    maps = attention_maps(model, params, tokens)          # {"blocks.0.attention": [H, T, T], ...}
    write_attention_picture(maps, token_labels(tokens), "attn.png")
    print(format_top(top_attended(maps, k=3), token_labels(tokens)))

The probabilities are outputs of the model's own forward program (`GPT.attention`, through
`nn.capture_attention`), not a second implementation. The picture is a grid of heatmaps, a row
per layer and a column per head; in each, row i is what position i attends to, the tokens label
both axes, and the cells above the diagonal (future positions, probability exactly 0) are drawn
as the grey causal triangle. Drawing needs matplotlib (the ``plot`` extra); it uses the Agg
back end, so no display is needed.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .render import write_atomic

PICTURE_FORMATS = ("png", "svg", "pdf")
CAUSAL_GREY = "#d9d9d9"   # the cells above the diagonal: the causal triangle


def attention_maps(model, params: Mapping[str, np.ndarray], tokens: Sequence[int],
                   executor: str = "numpy") -> dict[str, np.ndarray]:
    """{attention module path: probabilities [H, T, T]} of one token sequence."""
    _, probs = model.attention(params, np.asarray(tokens, dtype=np.int64)[None, :], executor=executor)
    return {name: p[0] for name, p in probs.items()}


def token_labels(tokens: Sequence[int]) -> list[str]:
    """A short printable label per byte token: ``␣`` for a space, ``\\n`` for a newline,
    ``\\xNN`` for other unprintable bytes."""
    out = []
    for t in tokens:
        c = chr(int(t)) if int(t) < 128 else ""
        out.append("␣" if c == " " else "\\n" if c == "\n" else c if c.isprintable() and c
                   else f"\\x{int(t):02x}")
    return out


def top_attended(maps: Mapping[str, np.ndarray], position: int = -1, k: int = 3) -> list[dict]:
    """For each layer and head, the `k` positions that `position` (default: the last) attends
    to most: ``[{"layer": name, "head": h, "top": [(position, probability), ...]}, ...]``."""
    rows = []
    for name, p in maps.items():
        for h in range(p.shape[0]):
            row = p[h, position]
            order = np.argsort(-row, kind="stable")[:k]
            rows.append({"layer": name, "head": h,
                         "top": [(int(j), float(row[j])) for j in order]})
    return rows


def format_top(rows: Sequence[dict], labels: Sequence[str], position: int = -1) -> str:
    """The `top_attended` rows as text, a line per head: ``layer head: 'c'@pos 0.42 ...``."""
    at = position % len(labels)
    lines = [f"position {at} ({labels[at]!r}) attends most to:"]
    for r in rows:
        cells = "  ".join(f"{labels[j]!r}@{j} {w:.2f}" for j, w in r["top"])
        lines.append(f"  {r['layer']} head {r['head']}: {cells}")
    return "\n".join(lines)


def write_attention_picture(maps: Mapping[str, np.ndarray], labels: Sequence[str],
                            out: str | Path, title: str | None = None, dpi: int = 80) -> Path:
    """Draw the grid of heatmaps to `out` (.png, .svg or .pdf, in an existing folder); returns
    the path."""
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in PICTURE_FORMATS:
        raise ValueError(f"{out}: the picture format comes from the suffix; use one of "
                         f".{', .'.join(PICTURE_FORMATS)}")
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("drawing the attention picture needs matplotlib "
                           "(pip install matplotlib, or graphlm's 'plot' extra)") from None
    matplotlib.use("Agg")
    from matplotlib import colors, pyplot as plt

    names = list(maps)
    heads = max(p.shape[0] for p in maps.values())
    t = len(labels)
    cell = min(4.5, max(1.9, 0.15 * t + 0.6))     # inches per heatmap
    step = max(1, -(-t // 32))                       # label every token up to 32, then every step-th
    ticks = list(range(0, t, step))
    fig, axes = plt.subplots(len(names), heads, figsize=(cell * heads + 1.2, cell * len(names) + 0.8),
                             squeeze=False, constrained_layout=True)
    fig.get_layout_engine().set(h_pad=0.12, w_pad=0.04)
    cmap = plt.get_cmap("viridis").with_extremes(bad=CAUSAL_GREY)   # the masked (future) cells
    norm = colors.PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    future = np.triu(np.ones((t, t), bool), k=1)
    font = 8 if t <= 16 else 7
    image = None
    for r, name in enumerate(names):
        for h in range(heads):
            ax = axes[r, h]
            if h >= maps[name].shape[0]:
                ax.axis("off")
                continue
            p = maps[name][h]
            shown = np.ma.masked_where(future, p) if np.all(p[future] == 0) else p
            image = ax.imshow(shown, cmap=cmap, norm=norm, interpolation="nearest")
            ax.set_xticks(ticks, [labels[i] for i in ticks], fontsize=font, family="monospace")
            ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=font, family="monospace")
            ax.tick_params(length=0, pad=1)
            ax.set_title(f"{name.removesuffix('.attention')} head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel("query position", fontsize=7)
            if r == len(names) - 1:
                ax.set_xlabel("attended position", fontsize=7)
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.6, pad=0.01)
        bar.set_label("attention probability (square-root scale)", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi)
    plt.close(fig)
    write_atomic(out, buffer.getvalue())         # never a half-written picture
    return out


__all__ = ["attention_maps", "token_labels", "top_attended", "format_top",
           "write_attention_picture", "PICTURE_FORMATS", "CAUSAL_GREY"]
