"""Build TinyLM's forward graph and look at it: node counts by op, parameters by module.

    python examples/decoder_graph.py [--eval] [--batch 2] [--seq 128]

Nothing is computed and no parameter array is allocated: the graph is a description.
"""
from __future__ import annotations

import argparse
from collections import Counter

import graphlm as gl
from graphlm.models import GPT, GPTConfig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--eval", action="store_true", help="eval mode: no dropout nodes")
    args = ap.parse_args(argv)

    config = GPTConfig.preset("tinylm")
    model = GPT(config)
    if args.eval:
        model.eval()
    g = gl.Graph("tinylm_forward")
    tokens = g.input("tokens", (args.batch, args.seq), "int64")
    logits = model(tokens)
    print(f"TinyLM {config}")
    print(f"logits {list(logits.shape)} {logits.dtype}; {len(g.nodes)} nodes, inputs: {', '.join(g.inputs)}")

    print("\nnodes by op")
    for op, n in Counter(node.op for node in g.nodes).most_common():
        print(f"  {op:<14}{n:>5}")

    print("\nparameters by module")
    by_module: Counter = Counter()
    for name, p in model.parameters().items():
        parts = name.split(".")
        top = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        by_module[top] += p.size
    total = model.parameter_count()
    for module, n in by_module.items():
        print(f"  {module:<22}{n:>10,}  {100 * n / total:5.1f}%")
    print(f"  {'total':<22}{total:>10,}  in {len(model.parameters())} tensors")


if __name__ == "__main__":
    main()
