"""The run log of `graphlm train`: RUN_DIR/log.jsonl, one JSON object per line, and its reader.

    log = RunLogger(run_dir / "log.jsonl")
    log.start(options=..., parameters=..., flops_per_token=..., tokens_per_step=..., peak=...)
    log.train(step_result, elapsed_s)      # every optimizer step
    log.eval(step, val_loss, train_loss, elapsed_s)
    rows = read_log(path)                  # RunRecord(starts, train, evals)

Row kinds (the "kind" key):
- ``start``: once per session (a resumed run appends another): the options, the parameter
  count, FLOPs per token of a training step, tokens per step and the peak MFU is taken against;
- ``train``: one per step: step, tokens seen, loss, lr, grad_norm, tokens_per_s, gflops (the
  matmul FLOP/s of that step, analytic count), mfu (gflops over the peak), seconds, elapsed_s;
- ``eval``: one per validation: step, tokens, val_loss, train_loss (mean over the steps since
  the last evaluation), elapsed_s; a session's final one also val_loss_full, the loss on the
  whole validation split (val_loss is on its first eval_batches batches, like every other row).
Rows of earlier versions (an eval row without "kind") read as eval rows. When a run is resumed
from a checkpoint older than the last logged step, the rows past the checkpoint are stale: the
reader drops them at the new session's start row.

The peak: `measure_peak_gflops` times float32 matrix products on one thread (the executors run
BLAS on one thread and split the work across their own threads) and multiplies by the thread
count, so MFU here is "fraction of this machine's measured sgemm rate", not of a datasheet peak.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

LOG_NAME = "log.jsonl"


def measure_peak_gflops(threads: int = 1, size: int = 512, repeats: int = 5) -> float:
    """The best float32 matmul rate (GFLOP/s) of `repeats` [size x size] @ [size x size]
    products, times `threads`: the peak that MFU is measured against."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)    # warm up BLAS
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2.0 * size ** 3 / max(best, 1e-9) / 1e9 * max(1, int(threads))


@dataclass
class Peak:
    """The FLOP/s rate MFU is a fraction of, and where it comes from (said in the log lines)."""

    gflops: float
    source: str       # e.g. "measured sgemm, 2 threads" or "--peak-gflops"

    def describe(self) -> str:
        return f"{self.gflops:,.1f} GFLOP/s ({self.source})"


def _round(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


class RunLogger:
    """Appends rows to a run's log.jsonl (flushed after every row, so a crash loses nothing
    that was logged)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: IO[str] = open(self.path, "a")
        self.flops_per_step = 0.0
        self.tokens_per_step = 0
        self.peak: Peak | None = None

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def start(self, *, options: dict, parameters: int, flops_per_token: float,
              tokens_per_step: int, peak: Peak, step: int, memory: dict | None = None) -> None:
        self.flops_per_step = float(flops_per_token) * tokens_per_step
        self.tokens_per_step = int(tokens_per_step)
        self.peak = peak
        self._write({"kind": "start", "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "parameters": parameters, "flops_per_token": flops_per_token,
                     "tokens_per_step": tokens_per_step, "peak_gflops": _round(peak.gflops, 4),
                     "peak_source": peak.source, "memory": memory or {}, "options": options})

    def throughput(self, seconds: float) -> dict[str, float]:
        """tokens/s, GFLOP/s and MFU of one step that took `seconds`."""
        seconds = max(seconds, 1e-9)
        gflops = self.flops_per_step / seconds / 1e9
        mfu = gflops / self.peak.gflops if self.peak and self.peak.gflops > 0 else float("nan")
        return {"tokens_per_s": self.tokens_per_step / seconds, "gflops": gflops, "mfu": mfu}

    def train(self, result, elapsed_s: float) -> dict[str, float]:
        """Log one step (a graphlm.train.StepResult); returns its throughput numbers."""
        t = self.throughput(result.seconds)
        self._write({"kind": "train", "step": result.step, "tokens": result.step * self.tokens_per_step,
                     "loss": _round(result.loss), "lr": _round(result.lr),
                     "grad_norm": _round(result.grad_norm),
                     "tokens_per_s": _round(t["tokens_per_s"], 4), "gflops": _round(t["gflops"], 4),
                     "mfu": _round(t["mfu"], 4), "seconds": _round(result.seconds, 4),
                     "elapsed_s": round(elapsed_s, 2)})
        return t

    def eval(self, step: int, val_loss: float, train_loss: float | None, elapsed_s: float,
             val_loss_full: float | None = None) -> dict:
        """An evaluation row; `val_loss_full`, the loss on the whole split, only in a final one."""
        row = {"kind": "eval", "step": step, "tokens": step * self.tokens_per_step,
               "val_loss": round(val_loss, 5),
               "train_loss": None if train_loss is None else round(train_loss, 5),
               "elapsed_s": round(elapsed_s, 1)}
        if val_loss_full is not None:
            row["val_loss_full"] = round(val_loss_full, 5)
        self._write(row)
        return row

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class RunRecord:
    """A run log read back: session starts, and train and eval rows by step (the last row
    written for a step wins)."""

    path: Path
    starts: list[dict] = field(default_factory=list)
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int | None:
        for row in reversed(self.starts):
            if row.get("tokens_per_step"):
                return int(row["tokens_per_step"])
        for row in self.train + self.evals:
            if row.get("tokens") and row.get("step"):
                return int(row["tokens"]) // int(row["step"])
        return None


class RunLogError(ValueError):
    """A log.jsonl that cannot be read (named with its line)."""


def read_log(path: str | Path) -> RunRecord:
    """Read a log.jsonl (a file, or a run folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG_NAME
    if not path.is_file():
        raise RunLogError(f"no run log at {path} (graphlm train writes RUN_DIR/{LOG_NAME})")
    starts: list[dict] = []
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if lineno > 1 and not line.endswith("\n"):
                    break            # a last line cut short by a crash: keep what came before
                raise RunLogError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "step" not in row:
                raise RunLogError(f"{path}:{lineno}: expected an object with a 'step'")
            kind = row.get("kind", "eval" if "val_loss" in row else None)
            if kind == "start":      # a session (re)starts at this step: later rows are stale
                starts.append(row)
                train = {k: v for k, v in train.items() if k <= int(row["step"])}
                evals = {k: v for k, v in evals.items() if k <= int(row["step"])}
            elif kind == "train":
                train[int(row["step"])] = row
            elif kind == "eval":
                evals[int(row["step"])] = row
            else:
                raise RunLogError(f"{path}:{lineno}: unknown row kind {kind!r}")
    return RunRecord(path, starts, [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)])


__all__ = ["LOG_NAME", "Peak", "RunLogger", "RunRecord", "RunLogError", "measure_peak_gflops",
           "read_log"]
