"""Memory plan and step time of the numpy executor on GPT training steps.

For TinyLM (V=256 T=128 C=192 H=6 N=4; dropout 0: forward, loss, backward) at each batch size:
arena, lower bound, naive bytes, arena / lower bound, naive / arena, in-place and view counts,
and the time per training step of `numpy` and `reference` (best of several runs, wall clock and
process CPU time; the CPU time is steadier on a shared machine).

    python benchmarks/memory_plan.py [--batches 1 8 32] [--repeats 5] [--json out.json]

Prints a table and writes the JSON (to stdout with --json -).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from graphlm import executors
import graphlm as gl
from graphlm.models import GPT, GPTConfig

TINYLM = dict(vocab_size=256, context_length=128, channels=192, head_count=6, layer_count=4, dropout=0.0)


def training_step(batch: int, seed: int = 0):
    cfg = GPTConfig(**TINYLM)
    model = GPT(cfg)
    g, loss = model.loss_graph(batch, name=f"tinylm_train_b{batch}")
    t = cfg.context_length
    outputs = [loss] + gl.grad(loss, list(g.params.values()))
    rng = np.random.default_rng(seed)
    feeds = {"tokens": rng.integers(0, cfg.vocab_size, (batch, t)),
             "targets": rng.integers(0, cfg.vocab_size, (batch, t))}
    return g, outputs, feeds, model.init(seed=seed)


def best_time(program, feeds, state, repeats: int) -> tuple[float, float]:
    program.run(feeds, state)  # warm up (binds the numpy program)
    wall = cpu = float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        program.run(feeds, state)
        wall = min(wall, time.perf_counter() - w)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


def measure(batch: int, repeats: int, time_reference: bool) -> dict:
    g, outputs, feeds, params = training_step(batch)
    t0 = time.perf_counter()
    prog = executors.get("numpy").compile(g, outputs)
    compile_s = time.perf_counter() - t0
    plan = prog.plan
    row = dict(batch=batch, nodes=len(plan.schedule), compile_s=round(compile_s, 3),
               arena_bytes=plan.arena_bytes, lower_bound_bytes=plan.lower_bound_bytes,
               naive_bytes=plan.naive_bytes, output_bytes=plan.output_bytes,
               arena_over_lower_bound=round(plan.arena_bytes / plan.lower_bound_bytes, 4),
               naive_over_arena=round(plan.naive_bytes / plan.arena_bytes, 3),
               inplace_count=plan.inplace_count, view_count=plan.view_count,
               kept_bytes=plan.kept_bytes, kept_count=len(plan.kept), placement=plan.strategy)
    wall, cpu = best_time(prog, feeds, params, repeats)
    row.update(numpy_step_s=round(wall, 4), numpy_step_cpu_s=round(cpu, 4))
    if time_reference:
        ref = executors.get("reference").compile(g, outputs)
        rwall, rcpu = best_time(ref, feeds, params, repeats)
        row.update(reference_step_s=round(rwall, 4), reference_step_cpu_s=round(rcpu, 4),
                   speedup_wall=round(rwall / wall, 3), speedup_cpu=round(rcpu / cpu, 3))
    return row


def table(rows) -> str:
    mib = lambda b: f"{b / 2**20:8.2f}"
    head = (f"{'batch':>5} {'arena MiB':>9} {'lower MiB':>9} {'naive MiB':>9} {'a/lb':>6} {'naive/a':>7} "
            f"{'kept MiB':>8} {'inpl':>4} {'views':>5} {'numpy s':>8} {'ref s':>8} {'x wall':>6} {'x cpu':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['batch']:>5} {mib(r['arena_bytes']):>9} {mib(r['lower_bound_bytes']):>9} "
                     f"{mib(r['naive_bytes']):>9} {r['arena_over_lower_bound']:>6.3f} "
                     f"{r['naive_over_arena']:>7.2f} {mib(r['kept_bytes'])} {r['inplace_count']:>4} {r['view_count']:>5} "
                     f"{r['numpy_step_s']:>8.3f} {r.get('reference_step_s', float('nan')):>8.3f} "
                     f"{r.get('speedup_wall', float('nan')):>6.2f} {r.get('speedup_cpu', float('nan')):>6.2f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true", help="skip timing the reference executor")
    ap.add_argument("--json", default="benchmarks/memory_plan.json",
                    help="where to write the JSON ('-' for stdout)")
    args = ap.parse_args(argv)
    rows = [measure(b, args.repeats, not args.no_reference) for b in args.batches]
    result = dict(benchmark="memory_plan", model="TinyLM training step (dropout 0)", config=TINYLM,
                  machine=dict(python=platform.python_version(), numpy=np.__version__,
                               processor=platform.processor() or platform.machine()),
                  rows=rows)
    print(table(rows))
    text = json.dumps(result, indent=2)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
