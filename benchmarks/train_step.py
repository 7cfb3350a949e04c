"""TinyLM training step: graphlm (native or numpy executor) vs PyTorch eager, side by side in one process.

The same architecture, the same initial weights and the same step (forward with dropout, mean
cross-entropy, backward, global-norm clipping at 1.0, AdamW with decay on matrices only) in both
frameworks. PyTorch runs in two forms: "torch" spells attention out (matmul, masked_fill,
softmax, matmul), and "torch_sdpa" uses its fused ``F.scaled_dot_product_attention(is_causal=True)``
(flash attention on CPU), the counterpart of graphlm's fused ``causal_attention`` op. Per batch
size: after warm-up, the three step functions are timed in turns (so load from other processes
hits all alike); the median ms/step, tokens/s, the ratios graphlm / PyTorch and the MFU
(analytic matmul FLOPs of tools.params.flops_per_token over the measured ``np.matmul`` 2048^3
rate of the same run: the best of one measurement before the timing and one in every rotation
of turns, so that a slow spell at the start cannot lower the peak and raise every MFU) are
reported. The ratios come twice: of the medians over all timed steps,
and "per turn" (the median over rotations of each rotation's graphlm turn over the other's, turns
a few seconds apart), which a slow spell of a shared machine lasting a few turns moves less.

Honesty check: before timing, both run two steps from the same weights with the *same* dropout
masks (graphlm's counter-based masks, multiplied in by the PyTorch models) and must agree on both
losses within 1e-4 (the second loss checks clipping and AdamW too), in both PyTorch forms.

Peak memory: each framework trains in its own subprocess (a few steps at each batch size) and
reports its peak resident set (VmHWM) and the peak over its resident set right after imports;
the graphlm child never imports torch.

    python benchmarks/train_step.py [--batches 1 8 32] [--steps 15] [--threads 2] [--quick]
        [--executor native|numpy] [--json benchmarks/train_step.json] [--markdown PATH]
        [--no-memory] [--profile [--profile-nodes N]]

graphlm runs on the native executor (the numpy executor with its hot float32 kernels in C) by
default; ``--executor numpy`` measures the pure-NumPy one.

`--profile` instead prints where graphlm's step time goes (per op kind; forward, backward and
optimizer) from `NumpyProgram.profile`; `--profile-nodes N` adds its N slowest nodes, with their
scopes and shapes.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphlm import executors  # noqa: E402
from graphlm.executors import numpy as numpy_executor  # noqa: E402
from graphlm.executors.native.products import large_products_by  # noqa: E402
from graphlm.executors.numpy.pool import blas_core  # noqa: E402
from graphlm.ir import fmt_shape  # noqa: E402
import graphlm as gl  # noqa: E402
from graphlm.models import GPT, GPTConfig  # noqa: E402
from graphlm.nn import DROPOUT_KEY  # noqa: E402
from graphlm.optim import AdamW  # noqa: E402
from graphlm.random import dropout_keep_scale  # noqa: E402
from graphlm.tools.params import flops_per_token  # noqa: E402

LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
LOSS_TOLERANCE = 1e-4
EXECUTOR = "native"   # graphlm's executor (--executor)
THREADS = 1


# == graphlm ==========================================================================================

class GraphlmStep:
    """The compiled training step (forward, loss, backward, clip, AdamW) and its state."""

    def __init__(self, config: GPTConfig, batch: int, seed: int = 0):
        self.config, self.batch = config, batch
        t = config.context_length
        self.model = model = GPT(config)
        g = gl.Graph(f"tinylm_train_b{batch}")
        tokens = g.input("tokens", (batch, t), np.int64)
        targets = g.input("targets", (batch, t), np.int64)
        model.train()
        loss = model.loss(tokens, targets)
        self.optimizer = AdamW(lr=LR, weight_decay=WEIGHT_DECAY, clip_norm=CLIP)
        step = self.optimizer.minimize(loss)
        self.graph = g
        self.program = executors.get(EXECUTOR).compile(g, [loss, step.grad_norm, step.update])
        self.state = model.init(seed)
        self.state.update(self.optimizer.init_state())
        self.uses_dropout = DROPOUT_KEY in g.inputs
        # forward dropout nodes in build order: attention output, then MLP, per block
        self.dropout_streams = [n.attrs["stream"] for n in g.nodes if n.op == "dropout" and not n.is_backward]
        self.count = 0

    def feeds(self, tokens, targets, key: int) -> dict:
        f = {"tokens": tokens, "targets": targets, **self.optimizer.feeds(self.count)}
        if self.uses_dropout:
            f[DROPOUT_KEY] = np.asarray(key, np.int64)
        return f

    def step(self, tokens, targets, key: int) -> float:
        loss, _, _ = self.program.run(self.feeds(tokens, targets, key), self.state)
        self.count += 1
        return float(loss)

    def masks(self, key: int, shape) -> list[np.ndarray]:
        p = self.config.dropout
        return [dropout_keep_scale(key, s, shape, p, np.float32) for s in self.dropout_streams]


# == PyTorch eager: the same model ====================================================================

class TorchStep:
    """TinyLM in PyTorch eager, parameters copied from graphlm's initialisation; `sdpa` selects
    torch's fused attention instead of the spelled-out form."""

    def __init__(self, config: GPTConfig, params: dict, torch, sdpa: bool = False):
        self.t, self.c, self.sdpa = torch, config, sdpa
        self.p = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in params.items()}
        decay = [v for v in self.p.values() if v.ndim >= 2]
        no_decay = [v for v in self.p.values() if v.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR, betas=(0.9, 0.999), eps=1e-8)
        t = config.context_length
        self.causal = torch.ones(t, t, dtype=torch.bool).triu(1)

    def ln(self, x, name):
        return self.t.nn.functional.layer_norm(x, (self.c.channels,), self.p[f"{name}.weight"],
                                               self.p[f"{name}.bias"], self.c.layer_norm_epsilon)

    def drop(self, x, masks):
        if masks is not None:
            return x * masks.pop(0)
        return self.t.nn.functional.dropout(x, self.c.dropout, training=True)

    def loss(self, tokens, targets, masks=None):
        F, c, p = self.t.nn.functional, self.c, self.p
        b, t = tokens.shape
        h, d = c.head_count, c.channels // c.head_count
        x = p["token_embedding.weight"][tokens] + p["positional_embedding.table.weight"][:t]
        for i in range(c.layer_count):
            pre = f"blocks.{i}"
            a = self.ln(x, f"{pre}.attention_norm").reshape(1, b * t, c.channels)
            qkv = a @ p[f"{pre}.attention.qkv_weight"] + p[f"{pre}.attention.qkv_bias"].reshape(3, 1, c.channels)
            q, k, v = (qkv[j].reshape(b, t, h, d).transpose(1, 2) for j in range(3))
            if self.sdpa:   # torch's fused attention (flash attention on CPU)
                ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
                scores = scores.masked_fill(self.causal[:t, :t], float("-inf"))
                ctx = scores.softmax(-1) @ v
            ctx = ctx.transpose(1, 2).reshape(b, t, c.channels)
            x = x + self.drop(F.linear(ctx, p[f"{pre}.attention.output.weight"],
                                       p[f"{pre}.attention.output.bias"]), masks)
            m = self.ln(x, f"{pre}.mlp_norm")
            m = F.gelu(F.linear(m, p[f"{pre}.mlp_input.weight"], p[f"{pre}.mlp_input.bias"]), approximate="tanh")
            x = x + self.drop(F.linear(m, p[f"{pre}.mlp_output.weight"], p[f"{pre}.mlp_output.bias"]), masks)
        logits = F.linear(self.ln(x, "final_norm"), p.get("language_model_head.weight", p["token_embedding.weight"]),
                          p.get("language_model_head.bias"))
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))

    def step(self, tokens, targets, masks=None) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(tokens, targets, masks)
        loss.backward()
        self.t.nn.utils.clip_grad_norm_(self.p.values(), CLIP)
        self.optimizer.step()
        return float(loss.detach())


# == measurements =====================================================================================

def batch_data(config, batch, seed=0):
    rng = np.random.default_rng(seed)
    t = config.context_length
    return (rng.integers(0, config.vocab_size, (batch, t)).astype(np.int64),
            rng.integers(0, config.vocab_size, (batch, t)).astype(np.int64))


def matmul_peak(repeats: int = 5) -> float:
    """GFLOP/s of np.matmul on float32 2048^3 on THREADS threads of NumPy's BLAS (best of
    `repeats`); BLAS goes back to one thread after (the executor's setting)."""
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    out = np.empty_like(a)
    numpy_executor.set_blas_threads(THREADS)   # the peak: one np.matmul on all the threads
    np.matmul(a, a, out=out)
    best = min(_timed(lambda: np.matmul(a, a, out=out)) for _ in range(repeats))
    numpy_executor.set_threads(THREADS)        # graphlm: the executor's threads, BLAS on one
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def loss_check(config, batch, torch) -> dict:
    """Two steps of both frameworks from the same weights and the same dropout masks."""
    gs = GraphlmStep(config, batch)
    ts = TorchStep(config, gs.state, torch)
    tf = TorchStep(config, gs.state, torch, sdpa=True)
    x, y = batch_data(config, batch)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    shape = (batch, config.context_length, config.channels)
    losses = []
    for key in (11, 12):
        masks = (lambda: [torch.from_numpy(m) for m in gs.masks(key, shape)] if gs.uses_dropout else None)
        losses.append((gs.step(x, y, key), ts.step(xt, yt, masks()), tf.step(xt, yt, masks())))
    diffs = [max(abs(a - b), abs(a - c)) for a, b, c in losses]
    return {"graphlm_losses": [a for a, _, _ in losses], "torch_losses": [b for _, b, _ in losses],
            "torch_sdpa_losses": [c for _, _, c in losses],
            "max_abs_diff": max(diffs), "ok": max(diffs) <= LOSS_TOLERANCE}


def time_batch(config, batch, steps, warmup, torch, peaks: list, gap: float, block: int) -> dict:
    """Median ms per step of each framework. The frameworks take turns (rotating who goes
    first) in blocks: `gap` seconds of sleep (the other's idle threads stop spinning), one
    untimed step (caches and clocks come back after the switch), then `block` timed steps back
    to back, as in training. block 1 with no untimed step was the protocol before (see
    docs/performance.md: every step then starts cold). Every rotation ends with a measurement of
    the matmul peak, appended to `peaks` (GFLOP/s); the MFU fields are filled in by `add_mfu`
    once the run's best peak is known."""
    gs = GraphlmStep(config, batch)
    ts = TorchStep(config, gs.state, torch)
    tf = TorchStep(config, gs.state, torch, sdpa=True)
    x, y = batch_data(config, batch)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for s in range(warmup):
        gs.step(x, y, 100 + s)
        ts.step(xt, yt)
        tf.step(xt, yt)
    times = {"graphlm": [], "torch": [], "torch_sdpa": []}
    keys = itertools.count(1000)   # a new dropout key per graphlm step
    run = {"graphlm": lambda: gs.step(x, y, next(keys)), "torch": lambda: ts.step(xt, yt),
           "torch_sdpa": lambda: tf.step(xt, yt)}
    order = list(run)
    turns = {who: [] for who in order}   # the median of each turn: one per rotation
    for r in range(-(-steps // block)):
        for who in order[r % 3:] + order[:r % 3]:
            time.sleep(gap)
            if block > 1:
                run[who]()
            turn = [_timed(run[who]) for _ in range(min(block, steps - r * block))]
            times[who] += turn
            turns[who].append(statistics.median(turn))
        time.sleep(gap)
        peaks.append(matmul_peak(repeats=2))
    tokens = batch * config.context_length
    flops = flops_per_token(config)["train_step"] * tokens
    ms = {who: statistics.median(t) * 1e3 for who, t in times.items()}
    row = {"batch": batch, "tokens_per_step": tokens, "steps_timed": steps}
    for who in order:
        row[f"{who}_ms"] = round(ms[who], 2)
        row[f"{who}_min_ms"] = round(min(times[who]) * 1e3, 2)
        row[f"{who}_tokens_per_s"] = round(tokens / ms[who] * 1e3, 1)
    return {
        **row,
        **{f"ratio_graphlm_over_{other}": round(ms["graphlm"] / ms[other], 3) for other in order[1:]},
        # the same ratios from each rotation's adjacent turns (a few seconds apart), median over
        # the rotations: a slow spell of the machine (docs/performance.md) covering a turn mostly
        # covers its neighbours too
        **{f"turn_ratio_graphlm_over_{other}": round(statistics.median(
            g / o for g, o in zip(turns["graphlm"], turns[other])), 3) for other in order[1:]},
        "matmul_gflop_per_step": round(flops / 1e9, 3),
        "arena_mib": round(gs.program.plan.arena_bytes / 2 ** 20, 2),
        "kept_mib": round(gs.program.kept_bytes() / 2 ** 20, 2),
    }


def add_mfu(row: dict, peak_gflops: float) -> dict:
    """`row` with its matmul lower bound and each framework's MFU against `peak_gflops`."""
    flops = row["matmul_gflop_per_step"] * 1e9
    row["matmul_lower_bound_ms"] = round(flops / peak_gflops / 1e6, 2)
    for who in ("graphlm", "torch", "torch_sdpa"):
        row[f"{who}_mfu"] = round(flops / (row[f"{who}_ms"] / 1e3) / (peak_gflops * 1e9), 4)
    return row


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def memory_child(framework: str, batch: int, steps: int) -> dict:
    """Runs in a subprocess: a few training steps of one framework; peak RSS in MiB."""
    config = GPTConfig.preset("tinylm")
    x, y = batch_data(config, batch)
    if framework.startswith("torch"):
        import torch
        torch.set_num_threads(THREADS)
        base = _rss_kib("VmRSS")
        params = GPT(config).init(0)
        ts = TorchStep(config, params, torch, sdpa=framework == "torch_sdpa")
        del params
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        for _ in range(steps):
            ts.step(xt, yt)
    else:
        base = _rss_kib("VmRSS")
        gs = GraphlmStep(config, batch)
        for s in range(steps):
            gs.step(x, y, s)
    peak = _rss_kib("VmHWM")
    return {"framework": framework, "batch": batch, "baseline_rss_mib": round(base / 1024, 1),
            "peak_rss_mib": round(peak / 1024, 1), "peak_over_baseline_mib": round((peak - base) / 1024, 1)}


def measure_memory(batch: int, threads: int) -> dict:
    out = {}
    for fw in ("graphlm", "torch", "torch_sdpa"):
        r = subprocess.run([sys.executable, __file__, "--child", fw, "--batches", str(batch),
                            "--threads", str(threads), "--executor", EXECUTOR],
                           capture_output=True, text=True, check=True)
        out[fw] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


# == profile ==========================================================================================

def phase_of(node) -> str:
    if (node.scope or "").startswith("optimizer"):
        return "optimizer"
    return "backward" if node.is_backward else "forward"


def profile(config, batch: int, repeats: int, nodes: int = 0) -> dict:
    """Median seconds per (phase, op kind) over `repeats` profiled steps, after a warm-up; with
    `nodes`, also the `nodes` slowest nodes of the compiled graph (median seconds each, with their
    op, phase, scope and shapes)."""
    gs = GraphlmStep(config, batch)
    x, y = batch_data(config, batch)
    for s in range(2):
        gs.step(x, y, s)
    samples = collections.defaultdict(list)
    per_node, node_of = collections.defaultdict(list), {}
    for s in range(repeats):
        acc = collections.defaultdict(float)
        for node, sec in gs.program.profile(gs.feeds(x, y, 50 + s), gs.state):
            acc[(phase_of(node), node.op)] += sec
            per_node[node.id].append(sec)
            node_of[node.id] = node
        for k, v in acc.items():
            samples[k].append(v)
    rows = sorted(((statistics.median(v), k) for k, v in samples.items()), reverse=True)
    total = sum(r[0] for r in rows)
    phases = collections.defaultdict(float)
    for sec, (phase, _) in rows:
        phases[phase] += sec
    slowest = sorted(((statistics.median(v), i) for i, v in per_node.items()), reverse=True)[:nodes]
    return {"batch": batch, "total_ms": round(total * 1e3, 2),
            "phases_ms": {k: round(v * 1e3, 2) for k, v in phases.items()},
            "ops_ms": [{"phase": p, "op": op, "ms": round(sec * 1e3, 2),
                        "share": round(sec / total, 4)} for sec, (p, op) in rows],
            "nodes_ms": [node_row(node_of[i], sec) for sec, i in slowest]}


def node_row(node, sec: float) -> dict:
    """One profiled node: its median ms, op, phase, scope and the shapes it reads (the first four)
    and writes."""
    reads = [list(i.shape) for i in node.inputs]
    return {"ms": round(sec * 1e3, 3), "op": node.op, "phase": phase_of(node), "scope": node.scope or "",
            "inputs": reads[:4], "more_inputs": len(reads[4:]), "shape": list(node.shape)}


def profile_table(prof: dict) -> str:
    lines = [f"batch {prof['batch']}: {prof['total_ms']} ms in kernels; "
             + ", ".join(f"{k} {v} ms" for k, v in prof["phases_ms"].items()),
             "", "| phase | op | ms | share |", "|---|---|---|---|"]
    for r in prof["ops_ms"]:
        if r["share"] >= 0.005:
            lines.append(f"| {r['phase']} | {r['op']} | {r['ms']} | {100 * r['share']:.1f}% |")
    if prof["nodes_ms"]:
        lines += ["", "| ms | phase | op | scope | reads -> writes |", "|---|---|---|---|---|"]
        for r in prof["nodes_ms"]:
            reads = ", ".join(map(fmt_shape, r["inputs"])) + (f" and {r['more_inputs']} more" if r["more_inputs"] else "")
            lines.append(f"| {r['ms']} | {r['phase']} | {r['op']} | {r['scope']} | {reads} -> {fmt_shape(r['shape'])} |")
    return "\n".join(lines)


# == report ===========================================================================================

def markdown(result: dict) -> str:
    lines = [f"TinyLM training step, graphlm's {result.get('executor', 'numpy')} executor, {result['threads']} thread(s), turns of {result.get('block', 1)} steps, np.matmul 2048^3 peak "
             f"{result['matmul_peak_gflops']} GFLOP/s (best of {result.get('matmul_peak_measurements', 1)}, the first "
             f"{result.get('matmul_peak_first_gflops', '-')}; OpenBLAS kernels "
             f"{result.get('machine', {}).get('numpy_blas_core', '-')}; graphlm's large products: "
             f"{result.get('machine', {}).get('large_products_by', '-')}), dropout {result['config']['dropout']}. "
             "torch: attention spelled out; torch_sdpa: F.scaled_dot_product_attention",
             "",
             "| batch | graphlm ms | torch ms | torch_sdpa ms | graphlm / torch | graphlm / torch_sdpa "
             "| per turn: / torch, / torch_sdpa "
             "| graphlm tok/s | graphlm MFU | torch MFU | torch_sdpa MFU | matmul bound ms "
             "| peak MiB graphlm / torch / torch_sdpa |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mem = result.get("memory", {}).get(str(r["batch"]), {})
        peaks = " / ".join(str(mem.get(fw, {}).get("peak_rss_mib", "-")) for fw in ("graphlm", "torch", "torch_sdpa"))
        lines.append(f"| {r['batch']} | {r['graphlm_ms']} | {r['torch_ms']} | {r.get('torch_sdpa_ms', '-')} "
                     f"| {r['ratio_graphlm_over_torch']} | {r.get('ratio_graphlm_over_torch_sdpa', '-')} "
                     f"| {r.get('turn_ratio_graphlm_over_torch', '-')}, {r.get('turn_ratio_graphlm_over_torch_sdpa', '-')} "
                     f"| {r['graphlm_tokens_per_s']} | {100 * r['graphlm_mfu']:.1f}% | {100 * r['torch_mfu']:.1f}% "
                     f"| {100 * r.get('torch_sdpa_mfu', float('nan')):.1f}% | {r['matmul_lower_bound_ms']} | {peaks} |")
    chk = result["loss_check"]
    lines += ["", f"first two losses (same weights, same dropout masks): graphlm {chk['graphlm_losses']}, "
              f"torch {chk['torch_losses']}, torch_sdpa {chk.get('torch_sdpa_losses')}, "
              f"max |diff| {chk['max_abs_diff']:.2e} ({'ok' if chk['ok'] else 'MISMATCH'}, tolerance {LOSS_TOLERANCE})"]
    return "\n".join(lines)




def report(md: str, result: dict, json_path: str) -> None:
    """Print the table; write the JSON to `json_path` ('-': print it too)."""
    print(md)
    text = json.dumps(result, indent=2)
    if json_path == "-":
        print(text)
    else:
        Path(json_path).write_text(text + "\n")
        print(f"wrote {json_path}")


def main(argv=None) -> int:
    global THREADS, EXECUTOR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per framework and batch")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for each framework: the numpy executor's (it splits large kernels "
                         "itself, BLAS on one thread), torch's intra-op pool (default 1)")
    ap.add_argument("--gap", type=float, default=0.25,
                    help="seconds of sleep before each framework's turn: idle BLAS/OpenMP threads "
                         "spin for a while after a call and would steal the other's cores")
    ap.add_argument("--block", type=int, default=3,
                    help="timed steps per turn, back to back after one untimed step (default 3; "
                         "1 = every timed step alone after the gap, the protocol before)")
    ap.add_argument("--executor", choices=["native", "numpy"], default="native",
                    help="graphlm's executor (default native: numpy's plan with C kernels)")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, 4 timed steps, no memory")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--profile", action="store_true", help="print graphlm's time per op kind instead")
    ap.add_argument("--profile-nodes", type=int, default=0, metavar="N",
                    help="with --profile, also the N slowest nodes (op, scope, shapes)")
    ap.add_argument("--json", default="benchmarks/train_step.json", help="JSON output ('-': stdout)")
    ap.add_argument("--markdown", help="also write the markdown table here")
    ap.add_argument("--child", choices=["graphlm", "torch", "torch_sdpa"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.profile_nodes < 0:
        ap.error(f"--profile-nodes must be 0 or more, got {args.profile_nodes}")
    if args.profile_nodes and not args.profile:
        ap.error("--profile-nodes lists the slowest nodes of a profile: add --profile")
    THREADS, EXECUTOR = args.threads, args.executor
    numpy_executor.set_threads(args.threads)   # graphlm: the executor's threads, BLAS on one
    config = GPTConfig.preset("tinylm")

    if args.child:
        print(json.dumps(memory_child(args.child, args.batches[0], 3)))
        return 0
    if args.profile:
        for b in args.batches if not args.quick else [8]:
            prof = profile(config, b, 3 if args.quick else 7, args.profile_nodes)
            print(profile_table(prof))
            print(json.dumps(prof))
        return 0
    if args.quick:
        args.batches, args.steps, args.warmup, args.no_memory = [1, 8], 4, 1, True

    import torch
    torch.set_num_threads(args.threads)
    peaks = [matmul_peak()]   # then one per rotation of turns (time_batch)
    check = loss_check(config, min(args.batches), torch)
    rows = [time_batch(config, b, args.steps, args.warmup, torch, peaks, args.gap, args.block)
            for b in args.batches]
    peak = max(peaks)
    rows = [add_mfu(row, peak) for row in rows]
    result = {"benchmark": "train_step", "executor": EXECUTOR, "config": config.to_dict(), "threads": args.threads,
              "gap_s": args.gap, "block": args.block,
              "matmul_peak_gflops": round(peak, 1), "matmul_peak_first_gflops": round(peaks[0], 1),
              "matmul_peak_measurements": len(peaks), "loss_check": check, "rows": rows,
              "peak_memory_method": "peak RSS (VmHWM) of a subprocess per framework and batch, 3 steps",
              "machine": {"python": platform.python_version(), "numpy": np.__version__,
                          "torch": torch.__version__, "numpy_blas_core": blas_core(),
                          "large_products_by": large_products_by(),
                          "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}}
    if not args.no_memory:
        result["memory"] = {str(b): measure_memory(b, args.threads) for b in args.batches}
    md = markdown(result)
    report(md, result, args.json)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
