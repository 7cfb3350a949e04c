"""Check a network's gradients at graph level with `graphlm.testing`.

    python examples/gradient_check.py [--executor reference|numpy|native]

The network is small (embedding, layer norm, GELU MLP, softmax cross-entropy) and float32, as a
model is: `check_grads` checks it on the float64 copy of its graph. Along a random direction d
per parameter, <grad, d> from `graphlm.grad` must match the central difference
(L(p + eps d) - L(p - eps d)) / (2 eps), the check JAX's `check_grads` makes. Then `check_vjps`
checks every node's VJP rule on its own, the check that names a wrong node in a large model.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import graphlm as gl
from graphlm.testing import check_grads, check_vjps

VOCAB, WIDTH, HIDDEN, TOKENS = 7, 6, 10, 5


def network(ids, targets):
    """The loss of a tiny network; its parameters are param leaves of the ids' graph."""
    g = ids.graph
    table = g.param("embedding.weight", (VOCAB, WIDTH))
    x = gl.embedding(table, ids)
    with g.scope("norm"):
        x = gl.layer_norm(x, g.param("norm.weight", (WIDTH,)), g.param("norm.bias", (WIDTH,)))
    with g.scope("mlp"):
        h = gl.gelu(x @ g.param("mlp.input.weight", (WIDTH, HIDDEN)) + g.param("mlp.input.bias", (HIDDEN,)))
        logits = h @ g.param("mlp.output.weight", (HIDDEN, VOCAB))
    return gl.cross_entropy(logits, targets)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="reference", choices=("reference", "numpy", "native"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    ids, targets = rng.integers(0, VOCAB, TOKENS), rng.integers(0, VOCAB, TOKENS)
    shapes = {"embedding.weight": (VOCAB, WIDTH), "norm.weight": (WIDTH,), "norm.bias": (WIDTH,),
              "mlp.input.weight": (WIDTH, HIDDEN), "mlp.input.bias": (HIDDEN,),
              "mlp.output.weight": (HIDDEN, VOCAB)}
    params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}

    result = check_grads(network, [ids, targets], params=params, executor=args.executor, seed=args.seed)
    print(f"loss {float(result.output):.6f}; every parameter's gradient (float64 copy of the graph):")
    for line in result.checks:
        print(f"  {line}")

    g = gl.Graph("network")
    loss = network(g.input("ids", (TOKENS,), "int64"), g.input("targets", (TOKENS,), "int64"))
    report = check_vjps([loss], {"ids": ids, "targets": targets}, params, executor=args.executor)
    ops = sorted({n.op for n in report.checked})
    print(f"check_vjps: the VJP rules of all {len(report.checked)} nodes hold ({', '.join(ops)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
