"""`graphlm plot RUN_DIR`: the loss curve of a training run, drawn from its log.jsonl.

    graphlm plot runs/tinylm                     # writes runs/tinylm/loss.png
    graphlm plot runs/tinylm --out loss.svg      # or .pdf
    plot_run("runs/tinylm/log.jsonl", "loss.png")

Top panel: the training loss of every step (thin), its running mean (bold), the validation
loss at each evaluation (dots) and a final one on the whole split (a diamond), against steps
(bottom axis) and tokens seen (top axis).
Bottom panel: the learning rate. Nats per token on the y axis.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from .figure import figure_format, pyplot, save_figure
from .run_log import LOG_NAME, RunLogError, RunRecord, read_log

TRAIN_COLOUR, SMOOTH_COLOUR, VAL_COLOUR, LR_COLOUR = "#9ab8d8", "#1f5a96", "#d1495b", "#3a7d44"
WHOLE_COLOUR = "#7a2e8c"   # the final evaluation on the whole validation split


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _tokens_label(n: float, _pos=None) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


def draw_run(record: RunRecord, title: str | None = None):
    """A matplotlib figure of the run's losses and learning rate (not yet saved)."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    if not record.train and not record.evals:
        raise RunLogError(f"{record.path}: no training or evaluation rows to plot yet")
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True, layout="constrained",
                                    gridspec_kw={"height_ratios": [3, 1]})
    steps = [r["step"] for r in record.train]
    losses = [r["loss"] for r in record.train]
    if steps:
        window = max(1, len(steps) // 40)
        if window > 1:
            ax.plot(steps, losses, color=TRAIN_COLOUR, lw=0.6, label="train loss (each step)")
            ax.plot(steps, running_mean(losses, window), color=SMOOTH_COLOUR, lw=1.8,
                    label=f"train loss (mean of the last {window} steps)")
        else:
            ax.plot(steps, losses, color=SMOOTH_COLOUR, lw=1.4, label="train loss")
    elif any(r.get("train_loss") is not None for r in record.evals):
        ev = [r for r in record.evals if r.get("train_loss") is not None]
        ax.plot([r["step"] for r in ev], [r["train_loss"] for r in ev], color=SMOOTH_COLOUR,
                lw=1.8, marker=".", label="train loss (mean since the last eval)")
    if record.evals:
        vs, vl = [r["step"] for r in record.evals], [r["val_loss"] for r in record.evals]
        best = min(record.evals, key=lambda r: r["val_loss"])
        batches = next((row.get("options", {}).get("eval_batches") for row in reversed(record.starts)), None)
        of = f"{batches} batches, " if batches else ""
        ax.plot(vs, vl, color=VAL_COLOUR, lw=1.2, marker="o", ms=4,
                label=f"validation loss ({of}best {best['val_loss']:.3f} at step {best['step']:,})")
    whole = [r for r in record.evals if r.get("val_loss_full") is not None]
    if whole:   # a final evaluation's loss on the whole split
        ax.plot([r["step"] for r in whole], [r["val_loss_full"] for r in whole], ls="none",
                marker="D", ms=6, color=WHOLE_COLOUR,
                label=f"whole validation split ({whole[-1]['val_loss_full']:.3f} at step {whole[-1]['step']:,})")
    every = losses + [r["val_loss"] for r in record.evals] + [r["val_loss_full"] for r in whole]
    finite = sorted(v for v in every if math.isfinite(v))
    if finite:   # the first steps' loss (~ln V) would flatten everything after it
        top = finite[min(len(finite) - 1, int(0.98 * len(finite)))]
        lo = finite[0]
        ax.set_ylim(lo - 0.05 * (top - lo + 1e-9), top + 0.08 * (top - lo + 1e-9))
    ax.set_ylabel("loss (nats per token)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    tps = record.tokens_per_step
    if tps:
        top_axis = ax.secondary_xaxis("top", functions=(lambda s: s * tps, lambda t: t / tps))
        top_axis.set_xlabel(f"tokens seen ({tps:,} per step)", fontsize=9)
        top_axis.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    if title:
        fig.suptitle(title, fontsize=10)

    if record.train:
        ax_lr.plot(steps, [r["lr"] for r in record.train], color=LR_COLOUR, lw=1.4)
    else:
        ax_lr.text(0.5, 0.5, "no per-step rows in this log (an older graphlm)", ha="center",
                   va="center", transform=ax_lr.transAxes, fontsize=8, color="#666666")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.1e}" if v else "0"))
    ax_lr.grid(True, alpha=0.3)
    ax_lr.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    return fig


def _title(record: RunRecord) -> str:
    name = record.path.parent.name or str(record.path.parent)
    start = record.starts[-1] if record.starts else {}
    opts = start.get("options", {})
    bits = [f"run {name}"]
    if start.get("parameters"):
        bits.append(f"{start['parameters']:,} parameters")
    if opts:
        bits.append(f"{opts.get('preset', '?')}, batch {opts.get('batch_size')}, lr {opts.get('lr')}")
    if record.evals:
        last = record.evals[-1]
        bits.append(f"whole-split val loss {last['val_loss_full']:.3f} at step {last['step']:,}"
                    if last.get("val_loss_full") is not None else
                    f"last val loss {last['val_loss']:.3f} at step {last['step']:,}")
    return "; ".join(bits)


def plot_run(log: str | Path, out: str | Path, fmt: str | None = None) -> Path:
    """Draw the run log `log` (a log.jsonl or its folder) into `out` (.png, .svg or .pdf)."""
    out = Path(out)
    figure_format(out, fmt)              # a bad suffix fails before the log is read
    record = read_log(log)
    return save_figure(draw_run(record, _title(record)), out, fmt, tight=False)


# -- command line ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help=f"a run folder written by 'graphlm train' (or its {LOG_NAME})")
    p.add_argument("--out", default=None,
                   help="picture to write: .png, .svg or .pdf (default: RUN_DIR/loss.png)")


def run(args) -> int:
    from .cli import CLIError, check_out
    from .figure import FigureError

    src = Path(args.run_dir)
    out = Path(args.out) if args.out else (src if src.is_dir() else src.parent) / "loss.png"
    try:
        figure_format(out)
        if not (src / LOG_NAME if src.is_dir() else src).is_file():
            hint = " (is this the folder given to 'graphlm train --out'? the default is runs/tinylm)"
            raise CLIError(f"no run log at {src / LOG_NAME if src.is_dir() else src}{hint}")
        check_out(str(out))
        record = read_log(src)
        path = save_figure(draw_run(record, _title(record)), out, tight=False)
    except (FigureError, RunLogError) as e:
        raise CLIError(str(e)) from None
    print(f"wrote {path} ({path.stat().st_size:,} bytes): {len(record.train):,} steps, "
          f"{len(record.evals)} evaluations")
    return 0


__all__ = ["plot_run", "draw_run", "running_mean"]
