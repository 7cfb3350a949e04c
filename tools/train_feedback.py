"""What `graphlm train` tells its user besides the loss: memory, FLOP rate, warnings, loss.png.

    memory_report(trainer)          # bytes of parameters, AdamW moments and the executors' arenas
    option_warnings(options)        # e.g. warmup >= steps (a resume's horizon: graphlm.train.resume_options)
    peak(gflops_or_None, threads)   # the Peak MFU is a fraction of
    LossPlotRefresher(run_dir)      # redraws RUN_DIR/loss.png from the log after each eval

Nothing here changes the run: these read the trainer, its options and its checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .params import flops_per_token, fmt_bytes
from .run_log import LOG_NAME, Peak, measure_peak_gflops


def train_flops_per_token(config) -> float:
    """Analytic matmul FLOPs of one training step per token (forward + backward)."""
    return float(flops_per_token(config)["train_step"])


def peak(gflops: float | None, threads: int) -> Peak:
    """--peak-gflops when given, else the measured float32 matmul rate of one thread times the
    executor threads (the executors run BLAS on one thread each)."""
    if gflops is not None:
        if not gflops > 0:
            raise ValueError(f"--peak-gflops must be positive, got {gflops}")
        return Peak(float(gflops), "--peak-gflops")
    n = max(1, int(threads or 1))
    return Peak(measure_peak_gflops(n), f"measured float32 matmul, 1 thread x {n}")


# -- memory ----------------------------------------------------------------------------------------
def memory_report(trainer) -> dict[str, int]:
    """Bytes held for training: parameters, optimizer state (AdamW moments) and the arenas the
    executor planned for the training step and the evaluation program (0 for an executor without
    a memory plan, such as the reference one, which allocates as it goes)."""
    names = set(trainer.model.parameters())
    params = sum(int(a.nbytes) for k, a in trainer.state.items() if k in names)
    moments = sum(int(a.nbytes) for k, a in trainer.state.items() if k not in names)
    arenas = {}
    for what, program in (("train_arena", trainer.train_program), ("eval_arena", trainer.eval_program)):
        plan = getattr(program, "plan", None)
        arenas[what] = int(getattr(plan, "arena_bytes", 0) or 0)
    report = {"parameters": params, "moments": moments, **arenas}
    report["total"] = sum(report.values())
    return report


def format_memory(report: dict[str, int]) -> str:
    return (f"memory: {fmt_bytes(report['total'])} = parameters {fmt_bytes(report['parameters'])} "
            f"+ AdamW moments {fmt_bytes(report['moments'])} + training-step arena "
            f"{fmt_bytes(report['train_arena'])} + eval arena {fmt_bytes(report['eval_arena'])}")


# -- warnings --------------------------------------------------------------------------------------
def option_warnings(options) -> list[str]:
    """Options that are legal but almost certainly not what was meant."""
    out = []
    if options.warmup >= options.steps:
        out.append(f"warmup ({options.warmup} steps) >= steps ({options.steps}): the learning rate "
                   f"never reaches its peak {options.lr} and never decays (lower --warmup)")
    elif options.warmup >= options.horizon:
        out.append(f"warmup ({options.warmup} steps) >= the cosine horizon ({options.horizon} "
                   "steps): there is no decay phase")
    return out


def saved_options(checkpoint_path: str | Path) -> tuple[dict, int]:
    """The options and step stored in a checkpoint's header (no tensors are read)."""
    from safetensors import safe_open

    with safe_open(str(checkpoint_path), "np") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get("options", "{}")), int(meta.get("step", 0))


# -- the loss picture ------------------------------------------------------------------------------
class LossPlotRefresher:
    """Redraws RUN_DIR/loss.png from RUN_DIR/log.jsonl. A failure (matplotlib missing, a
    disk error) is reported once through `warn` and never stops training."""

    def __init__(self, run_dir: str | Path, warn: Callable[[str], None], name: str = "loss.png"):
        self.run_dir, self.warn, self.out = Path(run_dir), warn, Path(run_dir) / name
        self.failed = False

    def refresh(self) -> None:
        if self.failed:
            return
        try:
            from .plot import plot_run
            plot_run(self.run_dir / LOG_NAME, self.out)
        except Exception as e:            # the picture is a convenience; the run goes on
            self.failed = True
            self.warn(f"could not draw {self.out} ({e}); training continues, see "
                      f"'graphlm plot {self.run_dir}'")


__all__ = ["memory_report", "format_memory", "option_warnings", "saved_options", "peak", "train_flops_per_token", "LossPlotRefresher"]
