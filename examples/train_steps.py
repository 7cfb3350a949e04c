"""A few AdamW training steps of a small GPT on tiny Shakespeare, through the NumPy executor.

    python examples/train_steps.py [--steps 8] [--executor numpy]

One training step is one compiled graph: forward, cross-entropy, backward, gradient clipping
and the AdamW update nodes, which write the parameters and moments in place in `state`. The
learning rate and step count are fed per step, so the schedule never recompiles. The loss on
the same batch is printed before and after, and must go down.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from graphlm import executors
import graphlm as gl
from graphlm.data import BatchSampler, load_corpus
from graphlm.models import GPT, GPTConfig
from graphlm.optim import AdamW


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--executor", default="numpy", choices=("numpy", "reference"))
    args = ap.parse_args(argv)

    # TinyLM's shape, made smaller so that a step takes milliseconds
    config = GPTConfig.preset("tinylm", context_length=32, channels=64, head_count=4,
                              layer_count=2, dropout=0.0)
    model = GPT(config)
    B, T = args.batch_size, config.context_length

    g = gl.Graph("train_step")
    tokens = g.input("tokens", (B, T), "int64")
    targets = g.input("targets", (B, T), "int64")
    loss = model.loss(tokens, targets)
    optimizer = AdamW(lr=3e-3, weight_decay=0.0, clip_norm=1.0)
    step = optimizer.minimize(loss)
    program = executors.get(args.executor).compile(g, [loss, step.grad_norm, step.update])
    evaluate = executors.get(args.executor).compile(g, [loss])
    print(f"{model.parameter_count():,} parameters; train-step graph of {len(g.nodes)} nodes "
          f"({sum(n.is_backward for n in g.nodes)} backward) on the {args.executor} executor")
    if hasattr(program, "plan"):
        print(f"  {program.plan}")

    state = {**model.init(seed=0), **optimizer.init_state()}
    sampler = BatchSampler(load_corpus(context_length=T).train, B, T, seed=0)
    x, y = sampler.batch(0)
    feeds0 = {"tokens": x.astype(np.int64), "targets": y.astype(np.int64)}
    (before,) = evaluate.run(feeds0, state)
    start = time.perf_counter()
    for s in range(args.steps):
        x, y = sampler.batch(s % 2)          # two batches, so the loss can fall fast
        feeds = {"tokens": x.astype(np.int64), "targets": y.astype(np.int64), **optimizer.feeds(s)}
        loss_value, norm, _ = program.run(feeds, state)
        print(f"step {s}: loss {float(loss_value):.4f}  grad norm {float(norm):.3f}")
    took = time.perf_counter() - start
    (after,) = evaluate.run(feeds0, state)
    print(f"loss on batch 0: {float(before):.4f} -> {float(after):.4f} after {args.steps} steps "
          f"({took / args.steps * 1e3:.1f} ms per step)")
    if not float(after) < float(before):
        print("train_steps: the loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
