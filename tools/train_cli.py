"""`graphlm train`: train a GPT (TinyLM at width 128 on the bundled tiny Shakespeare by default).

    graphlm train                                   # tinylm-small, defaults below, into runs/tinylm
    graphlm train --steps 2000 --batch-size 32 --lr 2e-3 --out runs/big
    graphlm train --out runs/tinylm --resume        # continue, bit for bit

A progress bar (loss, tokens/s, learning rate) when stderr is a terminal, plain log lines
otherwise; the validation loss every --eval-every steps and at the end, each time with a
checkpoint in --out; a final line with the best validation loss, the time and the checkpoint.
Ctrl-C finishes the current step, saves a checkpoint and exits (status 130); a second Ctrl-C
stops at once. --max-minutes (14.5 by default) stops a run that would overrun, after a final
validation and checkpoint. On --resume, options not given on the command line come from the checkpoint.

The run folder belongs to this run: ``--out/run.lock`` is locked before anything is read or
written and until the end, so a second run into it fails at once naming the holder. It holds
``checkpoint.safetensors`` (the last state: what --resume continues) and ``best.safetensors``
(the lowest validation loss so far). A diverged run (non-finite loss, or validation far above
the best) stops with status 1 without saving that state; both files stay good.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from graphlm.data import eval_batch_count
from graphlm.executors import numpy as numpy_executor
from graphlm.io.runfolder import RunLock
from graphlm.train import BEST_NAME, CHECKPOINT_NAME, Diverged, Trainer, TrainOptions, resume_options

from . import train_feedback
from .argtypes import float_at_least, int_at_least, nonempty
from .run_log import LOG_NAME, RunLogger

# command-line flag -> TrainOptions field (model fields go to TrainOptions.model)
_OPTION_FLAGS = {"preset": "preset", "steps": "steps", "batch_size": "batch_size", "lr": "lr",
                 "warmup": "warmup", "decay_steps": "decay_steps", "min_lr_ratio": "min_lr_ratio",
                 "weight_decay": "weight_decay", "clip_norm": "clip_norm", "seed": "seed",
                 "eval_every": "eval_every", "eval_batches": "eval_batches", "data": "data",
                 "executor": "executor", "devices": "devices"}
_MODEL_FLAGS = {"context_length": "context_length", "channels": "channels", "heads": "head_count",
                "layers": "layer_count", "dropout": "dropout", "mlp_hidden": "mlp_hidden"}
DEFAULTS = TrainOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--preset", type=nonempty, help=f"model preset: tinylm-small (C=128), tinylm "
                   f"(C=192), tinylm-gpt2 (tinylm without the LM-head bias: exports to Hugging Face "
                   f"and GGUF) or gpt2-small (default: {d.preset})")
    p.add_argument("--config", metavar="FILE|JSON",
                   help="a JSON file or object of training options (steps, lr, batch_size, ...) "
                        "and GPTConfig fields (layer_count, channels, ...) on top of --preset, "
                        "e.g. '{\"layer_count\": 2, \"steps\": 300}'; flags given on the command "
                        "line win (default: none)")
    p.add_argument("--steps", type=int, help=f"total optimizer steps (default: {d.steps})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default: {d.batch_size})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--warmup", type=int, help=f"linear warmup steps (default: {d.warmup})")
    p.add_argument("--decay-steps", type=int,
                   help="cosine decay horizon in steps (default: --steps)")
    p.add_argument("--min-lr-ratio", type=float,
                   help=f"final lr as a fraction of the peak (default: {d.min_lr_ratio})")
    p.add_argument("--weight-decay", type=float, help=f"AdamW decoupled decay (default: {d.weight_decay})")
    p.add_argument("--clip-norm", type=float, help=f"global gradient-norm clip (default: {d.clip_norm})")
    p.add_argument("--seed", type=int, help=f"seed of init, batches and dropout (default: {d.seed})")
    p.add_argument("--out", default="runs/tinylm", help="run folder for checkpoints and the log "
                   "(default: runs/tinylm)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--allow-other-data", action="store_true",
                   help="with --resume: continue even though the data differs from the checkpoint's "
                        "(default: refused, naming both)")
    p.add_argument("--eval-every", type=int, help=f"validate and checkpoint every K steps "
                   f"(default: {d.eval_every})")
    p.add_argument("--eval-batches", type=int,
                   help=f"validation batches per evaluation (default: {d.eval_batches})")
    p.add_argument("--data", help="train on this text file (default: bundled tiny Shakespeare)")
    p.add_argument("--executor", help=f"native, numpy, reference or jax (default: {d.executor}, the native "
                   "executor where a C compiler works, else numpy)")
    j = p.add_argument_group("many devices and processes (--executor jax)")
    j.add_argument("--devices", type=int, help="data-parallel devices (on a CPU, simulated ones; "
                   "default 1, or every device of a multi-process run)")
    j.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, to join a "
                   "multi-process run (with --num-processes and --process-id)")
    j.add_argument("--num-processes", type=int, help="processes of the run")
    j.add_argument("--process-id", type=int, help="this process's id, 0 to --num-processes - 1")
    g = p.add_argument_group("model overrides of the preset")
    c = d.config()
    g.add_argument("--context-length", type=int, help=f"tokens per sequence T (default: the "
                   f"preset's, {c.context_length})")
    g.add_argument("--channels", type=int, help="embedding width C, a multiple of --heads "
                   f"(default: the preset's, {c.channels})")
    g.add_argument("--heads", type=int, help=f"attention heads H (default: the preset's, {c.head_count})")
    g.add_argument("--layers", type=int, help=f"transformer blocks N (default: the preset's, {c.layer_count})")
    g.add_argument("--dropout", type=float, help=f"dropout probability (default: "
                   f"{d.model.get('dropout', 'the preset')}; the preset says 0.1, but the default "
                   "run underfits)")
    g.add_argument("--mlp-hidden", type=int, help="the MLP's hidden width (default: 4 x channels)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="threads of the numpy and native executors, which split large kernels themselves and run "
                        "BLAS on one thread (default: the available cores, at most 4; results do "
                        "not depend on it; 0 = leave threading to OpenBLAS)")
    p.add_argument("--max-minutes", type=float_at_least(0.0), default=14.5,
                   help="stop (validate, save) after this much wall time (default: 14.5; 0 = no limit)")
    p.add_argument("--log-every", type=int_at_least(0), default=0,
                   help="plain log line every N steps (default: about 50 lines per run)")
    p.add_argument("--progress", choices=("auto", "bar", "log"), default="auto",
                   help="tqdm bar, plain log lines, or bar only on a terminal (default: auto)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="the FLOP/s peak that MFU is a fraction of, in GFLOP/s (default: measured "
                        "at start, float32 matmul on one thread times --threads)")
    p.add_argument("--no-plot", action="store_true",
                   help="do not redraw RUN_DIR/loss.png at each evaluation (default: redraw it)")


def default_threads() -> int:
    """The available cores, at most 4 (the executor's splitting was measured on 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def use_threads(n: int) -> None:
    """--threads: n > 0 runs the numpy executor on n threads (BLAS on one); 0 leaves both alone."""
    if n < 0:
        raise ValueError(f"--threads must be >= 0, got {n}")
    if n > 0:
        numpy_executor.set_threads(n)


def _model_option_name(field: str) -> str:
    """How the user gave a GPTConfig field: its flag (--heads) or a --config key."""
    flags = {f: "--" + flag.replace("_", "-") for flag, f in _MODEL_FLAGS.items()}
    return flags.get(field, f"--config field {field}")


def _explicit(args) -> dict:
    """The options given on the command line (argparse defaults are None), on top of --config's
    (training options and model fields) when there is one."""
    out = {field: getattr(args, flag) for flag, field in _OPTION_FLAGS.items()
           if getattr(args, flag) is not None}
    model = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items()
             if getattr(args, flag) is not None}
    if getattr(args, "config", None) is not None:
        from .cli import read_config_json, split_config

        obj, source = read_config_json(args.config)
        named = obj.get("preset")
        from_config = split_config(obj, source, preset=args.preset)
        if "preset" not in out and named is not None:   # else train's default preset
            out["preset"] = from_config["preset"]
        model = {**from_config.pop("model"), **model}
        from_config.pop("preset")
        out = {**from_config, **out}
    if model:
        out["model"] = model
    return out


def run(args) -> int:
    use_threads(args.threads)
    if args.allow_other_data and not args.resume:
        raise ValueError("--allow-other-data only applies with --resume")
    with RunLock(args.out) as lock:   # held until the run ends: one run per folder
        if lock.stale:
            print(f"note: {Path(args.out)} was locked by pid {lock.stale.get('pid')}, which is no "
                  "longer running; taking it over", file=sys.stderr)
        return _run_locked(args)


def _run_locked(args) -> int:
    out_dir = Path(args.out)
    ckpt_path = out_dir / CHECKPOINT_NAME
    best_path = out_dir / BEST_NAME
    explicit = _explicit(args)
    log = sys.stderr

    if args.resume:
        if not ckpt_path.exists():
            raise ValueError(f"--resume: no checkpoint at {ckpt_path}")
        if "model" in explicit:
            raise ValueError("--resume: the model comes from the checkpoint; drop the model options "
                             f"({', '.join(_model_option_name(k) for k in explicit['model'])})")
        notes: list[str] = []
        options, changed = resume_options(ckpt_path, explicit, notes)
        if changed:
            print(f"warning: resuming with changed {', '.join(changed)}: the run will not match "
                  "an uninterrupted one", file=log)
        for note in notes:
            print(f"note: {note}", file=log)
    else:
        if ckpt_path.exists():
            raise ValueError(f"{ckpt_path} already exists; pass --resume to continue that run or "
                             "choose another --out")
        if "model" in explicit:
            explicit["model"] = {**DEFAULTS.model, **explicit["model"]}
        options = TrainOptions(**explicit)

    if options.executor != "jax" and "devices" not in explicit:
        options = dataclasses.replace(options, devices=None)   # a jax run resumed elsewhere
    processes = (args.coordinator, args.num_processes, args.process_id)
    if options.devices is not None or any(v is not None for v in processes):
        if options.executor != "jax":
            raise ValueError("--devices, --coordinator, --num-processes and --process-id need "
                             f"--executor jax (got {options.executor})")
        from graphlm.executors.jax_executor.launch import configure
        configure(options.devices, *processes)
    trainer = Trainer(options)
    if args.resume:
        for note in trainer.load(ckpt_path, allow_other_data=args.allow_other_data):
            print(f"warning: {note}", file=log)
        trainer.sync_best(out_dir)
    o, cfg = trainer.options, trainer.config
    # over several processes only process 0 writes checkpoints
    saved_to = f"checkpoint {ckpt_path}" if trainer.writes_checkpoints else "checkpoint written by process 0"
    tokens_per_step = o.batch_size * cfg.context_length
    n_val_batches = eval_batch_count(trainer.corpus.val, o.batch_size, cfg.context_length)
    print(f"graphlm train: {o.preset} ({trainer.model.parameter_count():,} params, T={cfg.context_length}, "
          f"C={cfg.channels}, H={cfg.head_count}, N={cfg.layer_count}, dropout={cfg.dropout}) on "
          f"{trainer.corpus.source} ({trainer.corpus.train.size:,} train / {trainer.corpus.val.size:,} "
          f"val bytes); {o.steps} steps x {o.batch_size} x {cfg.context_length} tokens, lr {o.lr} "
          f"(warmup {o.warmup}, cosine to {o.horizon}), executor {o.executor}"
          + (f", resuming at step {trainer.step}" if args.resume else ""), file=log, flush=True)
    for warning in train_feedback.option_warnings(o):
        print(f"warning: {warning}", file=log, flush=True)
    memory = train_feedback.memory_report(trainer)
    print(train_feedback.format_memory(memory), file=log, flush=True)
    peak = train_feedback.peak(args.peak_gflops, args.threads)
    print(f"MFU is measured against {peak.describe()}", file=log, flush=True)

    use_bar = args.progress == "bar" or (args.progress == "auto" and sys.stderr.isatty())
    log_every = args.log_every or max(1, o.steps // 50)
    interrupted = {"flag": False}

    def on_sigint(signum, frame):
        interrupted["flag"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    bar = None
    if use_bar:
        from tqdm import tqdm
        bar = tqdm(total=o.steps, initial=trainer.step, file=sys.stderr, unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    train_losses: list[float] = []
    rate = None
    out_dir.mkdir(parents=True, exist_ok=True)
    run_log = RunLogger(out_dir / LOG_NAME)
    run_log.start(options=o.to_dict(), parameters=trainer.model.parameter_count(),
                  flops_per_token=train_feedback.train_flops_per_token(cfg),
                  tokens_per_step=tokens_per_step, peak=peak, step=trainer.step, memory=memory)
    plotter = None if args.no_plot else train_feedback.LossPlotRefresher(out_dir, warn=lambda m: print(
        f"warning: {m}", file=log, flush=True))

    def diverged(why: str) -> Diverged:
        return Diverged(f"training diverged at step {trainer.step}: {why}; stopped without saving "
                        f"this state. {_files_line(trainer, ckpt_path, best_path)}; lower --lr "
                        "(or raise --warmup) and start again")

    def evaluate_and_save(final: bool = False):
        # the last evaluation of a session covers the whole split (one pass: its first
        # eval_batches batches give the figure the history and the best compare)
        val, full = trainer.evaluate_whole() if final and o.eval_batches is not None \
            else (trainer.evaluate(), None)
        why = trainer.divergence(val_loss=val if full is None else max(val, full))
        if why:
            raise diverged(why)
        is_best = trainer.record_eval(val)
        train_loss = sum(train_losses) / len(train_losses) if train_losses else None
        entry = run_log.eval(trainer.step, val, train_loss, time.perf_counter() - start,
                             val_loss_full=full)
        trainer.history[-1].update({k: entry[k] for k in ("train_loss", "elapsed_s")})  # val_loss unrounded
        if full is not None:
            trainer.history[-1]["val_loss_full"] = full
        train_losses.clear()
        try:
            trainer.save_run(out_dir, is_best=is_best)
        except Diverged as e:
            raise diverged(str(e).split(": ", 1)[-1]) from None
        if plotter is not None:
            plotter.refresh()
        whole = "" if full is None else (f"  val loss on the whole split {full:.4f} ({n_val_batches} "
                                         f"batches; the {o.eval_batches} of each evaluation: {val:.4f})")
        msg = (f"step {trainer.step}/{o.steps}" + (whole or f"  val loss {val:.4f}")
               + f"  (best {trainer.best_val_loss:.4f})  {saved_to}" + (f" (and {best_path.name})" if is_best and trainer.writes_checkpoints else ""))
        (bar.write(msg) if bar else print(msg, file=log, flush=True))

    try:
        while trainer.step < o.steps and not interrupted["flag"]:
            if args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
                msg = (f"time limit of {args.max_minutes} minutes reached at step {trainer.step}; "
                       "validating and saving (continue with --resume)")
                (bar.write(msg) if bar else print(msg, file=log, flush=True))
                if not trainer.history or trainer.history[-1]["step"] != trainer.step:
                    evaluate_and_save(final=True)
                break
            r = trainer.train_step()
            why = trainer.divergence(loss=r.loss, grad_norm=r.grad_norm)
            if why:
                raise diverged(why)
            train_losses.append(r.loss)
            tps = run_log.train(r, time.perf_counter() - start)["tokens_per_s"]
            rate = tps if rate is None else 0.9 * rate + 0.1 * tps
            speed = run_log.throughput(tokens_per_step / rate)    # GFLOP/s and MFU at the smoothed rate
            if bar:
                bar.set_postfix({"loss": f"{r.loss:.4f}", "tok/s": f"{rate:,.0f}", "lr": f"{r.lr:.2e}",
                                 "GFLOP/s": f"{speed['gflops']:.1f}", "MFU": f"{speed['mfu']:.0%}"},
                                refresh=False)
                bar.update(1)
            elif r.step % log_every == 0 or r.step == 1:
                print(f"step {r.step}/{o.steps}  loss {r.loss:.4f}  grad norm {r.grad_norm:.3f}  "
                      f"lr {r.lr:.3e}  {rate:,.0f} tokens/s  {speed['gflops']:.1f} GFLOP/s  "
                      f"MFU {speed['mfu']:.1%}", file=log, flush=True)
            if r.step % o.eval_every == 0 or r.step == o.steps:
                evaluate_and_save(final=r.step == o.steps)
        if interrupted["flag"] and trainer.step < o.steps:
            try:
                trainer.save(ckpt_path)
            except Diverged as e:
                raise diverged(str(e).split(": ", 1)[-1]) from None
            if bar:
                bar.close()
            print(f"interrupted at step {trainer.step}; checkpoint saved to {ckpt_path} "
                  f"(continue with --resume --out {out_dir}); {_files_line(trainer, ckpt_path, best_path)}",
                  file=log, flush=True)
            return 130
    finally:
        signal.signal(signal.SIGINT, old_handler)
        if bar:
            bar.close()
        run_log.close()
    elapsed = time.perf_counter() - start
    best = min(trainer.history, key=lambda h: h["val_loss"]) if trainer.history else None
    best_txt = f"best val loss {best['val_loss']:.4f} at step {best['step']}" if best else "no validation"
    last = trainer.history[-1] if trainer.history else {}
    if "val_loss_full" in last:   # the figure docs/training.md compares recipes by
        best_txt = (f"val loss on the whole validation split {last['val_loss_full']:.4f} at step "
                    f"{last['step']}; {best_txt} (first {o.eval_batches} batches)")
    print(f"done: {best_txt}; {trainer.step} of {o.steps} steps, {elapsed:.1f} s this session; "
          f"{_files_line(trainer, ckpt_path, best_path) if trainer.writes_checkpoints else saved_to}",
          flush=True)
    return 0


def _files_line(trainer: Trainer, last: Path, best: Path) -> str:
    """Which file holds what: 'last checkpoint X (step N); best checkpoint Y (step M, val loss V)'."""
    parts = []
    if trainer.saved_step is not None and last.exists():
        parts.append(f"last checkpoint {last} (step {trainer.saved_step})")
    if trainer.best_step is not None and best.exists():
        parts.append(f"best checkpoint {best} (step {trainer.best_step}, val loss {trainer.best_val_loss:.5g})")
    return "; ".join(parts) if parts else "no checkpoint written"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="graphlm train", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
