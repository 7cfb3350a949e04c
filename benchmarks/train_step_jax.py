"""TinyLM training step on JAX: graphlm's jax executor vs a hand-written jax.jit step vs PyTorch
eager, side by side in one process, at batch 1, 8, 32.

The same architecture, initial weights and step in all three (forward with dropout 0.1, mean
cross-entropy, backward, global-norm clipping at 1.0, AdamW with decay on matrices only, as in
benchmarks/train_step.py, whose PyTorch model this reuses). The hand-written JAX step is what a
JAX user would write: the model as a jnp function, `jax.value_and_grad`, AdamW in jnp, one
`jax.jit` with the params and moments donated. It runs twice: "hand_jax" draws its dropout masks
from graphlm's counter-based stream (the same mask arithmetic as graphlm's step, so the ratio
measures the lowering alone), "hand_jax_threefry" from `jax.random` (JAX's default threefry
generator, what a JAX user gets by default). graphlm's step is the graph of graphlm.models.GPT
lowered by the jax executor (no pass pipeline).

Honesty check first: graphlm-on-JAX and the hand-written step run two steps from the same
weights with the same dropout masks (graphlm's) and must agree on both losses within 1e-4.
Then per batch, after warm-up, the three steps are timed in rotating turns (median ms/step);
compile times (trace + XLA compile of the step) are reported separately. Besides the wall-clock
medians, the process CPU time per step (all threads) is reported: on a machine loaded by other
jobs it tracks the work each step does better than the wall clock does.

    python benchmarks/train_step_jax.py [--batches 1 8 32] [--steps 10] [--threads 2]
        [--json benchmarks/train_step_jax.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import train_step as common  # noqa: E402  (benchmarks/train_step.py: TorchStep, batch_data, ...)
from graphlm.executors.jax_executor.rules import dropout_keep_scale  # noqa: E402  (the stream in jnp)
from graphlm.models import GPTConfig  # noqa: E402

LR, WEIGHT_DECAY, CLIP = common.LR, common.WEIGHT_DECAY, common.CLIP


# == hand-written JAX =================================================================================

def _layer_norm(x, w, b, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    xc = x - mu
    return xc * jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + eps) * w + b


def tinylm_loss(p, tokens, targets, c: GPTConfig, drop):
    """TinyLM's loss as a jnp function; drop(x, i) applies the i-th dropout."""
    b, t = tokens.shape
    h, d, C = c.head_count, c.channels // c.head_count, c.channels
    x = p["token_embedding.weight"][tokens] + p["positional_embedding.table.weight"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    k_drop = 0
    for i in range(c.layer_count):
        pre = f"blocks.{i}"
        a = _layer_norm(x, p[f"{pre}.attention_norm.weight"], p[f"{pre}.attention_norm.bias"],
                        c.layer_norm_epsilon).reshape(b * t, C)
        qkv = jnp.einsum("nc,jcd->jnd", a, p[f"{pre}.attention.qkv_weight"]) + p[f"{pre}.attention.qkv_bias"][:, None]
        q, k, v = (qkv[j].reshape(b, t, h, d).transpose(0, 2, 1, 3) for j in range(3))
        s = jnp.where(causal, (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d)), -jnp.inf)
        ctx = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, C)
        x = x + drop(ctx @ p[f"{pre}.attention.output.weight"].T + p[f"{pre}.attention.output.bias"], k_drop)
        m = _layer_norm(x, p[f"{pre}.mlp_norm.weight"], p[f"{pre}.mlp_norm.bias"], c.layer_norm_epsilon)
        m = jax.nn.gelu(m @ p[f"{pre}.mlp_input.weight"].T + p[f"{pre}.mlp_input.bias"], approximate=True)
        x = x + drop(m @ p[f"{pre}.mlp_output.weight"].T + p[f"{pre}.mlp_output.bias"], k_drop + 1)
        k_drop += 2
    x = _layer_norm(x, p["final_norm.weight"], p["final_norm.bias"], c.layer_norm_epsilon)
    logits = (x @ p["language_model_head.weight"].T).reshape(b * t, -1)
    if "language_model_head.bias" in p:
        logits = logits + p["language_model_head.bias"]
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=1))


class HandJaxStep:
    """The hand-written step: value_and_grad, clipping, AdamW, one jax.jit, state donated."""

    def __init__(self, config: GPTConfig, params: dict, rng: str = "stream"):
        self.c, self.rng = config, rng
        self.p = {k: jnp.asarray(v) for k, v in params.items()}
        self.m = {k: jnp.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: jnp.zeros_like(v) for k, v in self.p.items()}
        self.count = 0
        self._step = jax.jit(self._update, donate_argnums=(0, 1, 2))
        self._compiled = None   # the AOT-compiled step without fixed masks (compile_seconds)

    def _update(self, p, m, v, t, tokens, targets, key, masks):
        rate = self.c.dropout

        def drop(x, i):
            if masks is not None:
                return x * masks[i]
            if self.rng == "stream":   # graphlm's stream: key, stream i (its streams are 0, 1, ...)
                return x * dropout_keep_scale(key, i, x.shape, rate, x.dtype)
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate, x.shape)
            return jnp.where(keep, x / (1.0 - rate), 0.0)

        loss, g = jax.value_and_grad(tinylm_loss)(p, tokens, targets, self.c, drop)
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
        coef = CLIP / jnp.maximum(norm, CLIP)
        b1, b2, eps = 0.9, 0.999, 1e-8
        step_size = LR / (1 - b1 ** t)
        bc2 = jnp.sqrt(1 - b2 ** t)
        new_p, new_m, new_v = {}, {}, {}
        for k in p:
            gk = g[k] * coef
            pk = p[k] * (1 - LR * WEIGHT_DECAY) if p[k].ndim >= 2 else p[k]
            new_m[k] = b1 * m[k] + (1 - b1) * gk
            new_v[k] = b2 * v[k] + (1 - b2) * gk * gk
            new_p[k] = pk - step_size * new_m[k] / (jnp.sqrt(new_v[k]) / bc2 + eps)
        return new_p, new_m, new_v, loss

    def args(self, tokens, targets, key, masks):
        key = jax.random.key(key) if self.rng == "threefry" else jnp.asarray(key, jnp.int64)
        return (self.p, self.m, self.v, jnp.float32(self.count + 1), tokens, targets, key, masks)

    def compile_seconds(self, tokens, targets) -> float:
        start = time.perf_counter()
        with jax.enable_x64(self.rng == "stream"):   # the stream's counters are uint64
            self._compiled = self._step.lower(*self.args(tokens, targets, 0, None)).compile()
        return time.perf_counter() - start

    def step(self, tokens, targets, key: int, masks=None) -> float:
        fn = self._compiled if masks is None and self._compiled is not None else self._step
        with jax.enable_x64(self.rng == "stream"):
            self.p, self.m, self.v, loss = fn(*self.args(tokens, targets, key, masks))
        self.count += 1
        return float(loss)


# == measurements =====================================================================================

def make_steps(config, batch, torch):
    common.EXECUTOR = "jax"
    gs = common.GraphlmStep(config, batch)
    hands = {rng: HandJaxStep(config, gs.state, rng) for rng in ("stream", "threefry")}
    ts = common.TorchStep(config, gs.state, torch)
    return gs, hands, ts


def loss_check(config, batch, torch) -> dict:
    gs, hands, _ = make_steps(config, batch, torch)
    hand = hands["stream"]
    x, y = common.batch_data(config, batch)
    shape = (batch, config.context_length, config.channels)
    losses = []
    for key in (11, 12):
        masks = [jnp.asarray(m) for m in gs.masks(key, shape)]
        losses.append((gs.step(x, y, key), hand.step(x, y, key, masks)))
    diff = max(abs(a - b) for a, b in losses)
    return {"graphlm_jax_losses": [a for a, _ in losses], "hand_jax_losses": [b for _, b in losses],
            "max_abs_diff": diff, "ok": diff <= common.LOSS_TOLERANCE}


def time_batch(config, batch, steps, warmup, torch, gap) -> dict:
    gs, hands, ts = make_steps(config, batch, torch)
    x, y = common.batch_data(config, batch)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    compile_s = {"graphlm_jax": round(gs.program.compile_seconds, 3),
                 **{HAND[rng]: round(h.compile_seconds(x, y), 3) for rng, h in hands.items()}}
    keys = itertools.count(1000)
    run = {"graphlm_jax": lambda: gs.step(x, y, next(keys)),
           **{HAND[rng]: (lambda h: lambda: h.step(x, y, next(keys)))(h) for rng, h in hands.items()},
           "torch": lambda: ts.step(xt, yt)}
    for _ in range(warmup):
        for fn in run.values():
            fn()
    order = list(run)
    times = {who: [] for who in order}
    cpu = {who: [] for who in order}     # process CPU time per step, all threads: the work done,
    for r in range(steps):               # which a loaded machine's waiting does not inflate
        for who in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(gap)
            run[who]()                       # untimed: caches back after the other's turn
            c0 = time.process_time()
            times[who].append(common._timed(run[who]))
            cpu[who].append(time.process_time() - c0)
    ms = {who: statistics.median(t) * 1e3 for who, t in times.items()}
    cpu_ms = {who: statistics.median(t) * 1e3 for who, t in cpu.items()}
    tokens = batch * config.context_length
    return {"batch": batch, "tokens_per_step": tokens, "steps_timed": steps,
            **{f"{who}_ms": round(ms[who], 2) for who in order},
            **{f"{who}_tokens_per_s": round(tokens / ms[who] * 1e3, 1) for who in order},
            **{f"ratio_graphlm_jax_over_{who}": round(ms["graphlm_jax"] / ms[who], 3) for who in order[1:]},
            **{f"{who}_cpu_ms": round(cpu_ms[who], 2) for who in order},
            **{f"cpu_ratio_graphlm_jax_over_{who}": round(cpu_ms["graphlm_jax"] / cpu_ms[who], 3)
               for who in order[1:]},
            "compile_s": compile_s}


HAND = {"stream": "hand_jax", "threefry": "hand_jax_threefry"}


def markdown(result) -> str:
    lines = [f"TinyLM training step on JAX {result['machine']['jax']} ({result['machine']['device']}), "
             f"torch on {result['threads']} thread(s), dropout {result['config']['dropout']}",
             "", "| batch | graphlm-on-JAX ms | hand JAX ms (same stream) | hand JAX ms (threefry) "
             "| torch eager ms | graphlm / hand JAX | graphlm / hand JAX threefry | graphlm / torch "
             "| compile s graphlm / hand / hand threefry |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["compile_s"]
        lines.append(f"| {r['batch']} | {r['graphlm_jax_ms']} | {r['hand_jax_ms']} | {r['hand_jax_threefry_ms']} "
                     f"| {r['torch_ms']} | {r['ratio_graphlm_jax_over_hand_jax']} "
                     f"| {r['ratio_graphlm_jax_over_hand_jax_threefry']} | {r['ratio_graphlm_jax_over_torch']} "
                     f"| {c['graphlm_jax']} / {c['hand_jax']} / {c['hand_jax_threefry']} |")
    chk = result["loss_check"]
    lines += ["", "process CPU time per step (ms, all threads; graphlm / hand JAX): " + ", ".join(
        f"batch {r['batch']}: {r['graphlm_jax_cpu_ms']} / {r['hand_jax_cpu_ms']} = "
        f"{r['cpu_ratio_graphlm_jax_over_hand_jax']}" for r in result["rows"])]
    lines += ["", f"first two losses (same weights and dropout masks): graphlm {chk['graphlm_jax_losses']}, "
              f"hand-written {chk['hand_jax_losses']}, max |diff| {chk['max_abs_diff']:.2e} "
              f"({'ok' if chk['ok'] else 'MISMATCH'})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per framework and batch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (XLA uses its own pool)")
    ap.add_argument("--gap", type=float, default=0.1, help="seconds of sleep before each timed step")
    ap.add_argument("--json", default="benchmarks/train_step_jax.json", help="JSON output ('-': stdout)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    config = GPTConfig.preset("tinylm")
    check = loss_check(config, min(args.batches), torch)
    rows = [time_batch(config, b, args.steps, args.warmup, torch, args.gap) for b in args.batches]
    dev = jax.devices()[0]
    result = {"benchmark": "train_step_jax", "config": config.to_dict(), "threads": args.threads,
              "loss_check": check, "rows": rows,
              "machine": {"python": platform.python_version(), "jax": jax.__version__,
                          "device": f"{dev.platform}: {dev.device_kind}", "torch": torch.__version__}}
    md = markdown(result)
    print(md)
    text = json.dumps(result, indent=2)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")
        print(f"wrote {args.json}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
