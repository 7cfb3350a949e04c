"""Check a gradient at graph level: `graphlm.grad` against float64 central differences.

    python examples/gradient_check.py [--executor reference|numpy]

The graph is a small network in float64 (embedding, layer norm, GELU MLP, softmax
cross-entropy); `grad` adds its backward nodes to the same graph and one program computes the
loss and every parameter gradient. Along a random direction d, the directional derivative
<grad, d> must match (L(p + eps d) - L(p - eps d)) / (2 eps), the check JAX's `check_grads` makes.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from graphlm import executors
import graphlm as gl


def build(vocab=7, width=6, hidden=10, tokens=5):
    g = gl.Graph("gradient_check")
    f64 = "float64"
    ids = g.input("ids", (tokens,), "int64")
    targets = g.input("targets", (tokens,), "int64")
    table = g.param("embedding.weight", (vocab, width), f64)
    gain = g.param("norm.weight", (width,), f64)
    shift = g.param("norm.bias", (width,), f64)
    w1 = g.param("mlp.input.weight", (width, hidden), f64)
    b1 = g.param("mlp.input.bias", (hidden,), f64)
    w2 = g.param("mlp.output.weight", (hidden, vocab), f64)
    x = gl.embedding(table, ids)
    with g.scope("norm"):
        x = gl.layer_norm(x, gain, shift)
    with g.scope("mlp"):
        logits = gl.gelu(x @ w1 + b1) @ w2
    loss = gl.cross_entropy(logits, targets)
    return g, loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="reference", choices=("reference", "numpy"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    g, loss = build()
    params = list(g.params.values())
    grads = gl.grad(loss, params)
    run_all = executors.get(args.executor).compile(g, [loss, *grads])
    run_loss = executors.get(args.executor).compile(g, [loss])

    rng = np.random.default_rng(args.seed)
    feeds = {"ids": rng.integers(0, 7, 5), "targets": rng.integers(0, 7, 5)}
    state = {p.name: rng.standard_normal(p.shape) for p in params}
    value, *analytic = run_all.run(feeds, state)
    print(f"loss {float(value):.6f}; {len(g.nodes)} nodes ({sum(n.is_backward for n in g.nodes)} "
          f"backward) on the {args.executor} executor")

    worst = 0.0
    for p, ga in zip(params, analytic):
        d = rng.standard_normal(p.shape)
        eps = 1e-4

        def at(sign):
            shifted = dict(state, **{p.name: state[p.name] + sign * eps * d})
            return float(run_loss.run(feeds, shifted)[0])

        numeric = (at(+1) - at(-1)) / (2 * eps)
        exact = float(np.sum(ga * d))
        rel = abs(numeric - exact) / max(abs(numeric), abs(exact), 1e-12)
        worst = max(worst, rel)
        print(f"  {p.name:<20} <grad, d> {exact:+.8f}  central difference {numeric:+.8f}  "
              f"relative error {rel:.1e}")
    ok = worst < 1e-6
    print(f"worst relative error {worst:.1e}: {'ok' if ok else 'FAILED'} (tolerance 1e-6)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
