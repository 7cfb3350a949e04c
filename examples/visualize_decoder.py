"""Build TinyLM's forward graph and draw it: the whole decoder at depth 1, and one block in full.

    python examples/visualize_decoder.py [--out-dir DIR] [--format svg|png] [--block 1]

Writes DIR/tinylm_forward_depth1.<fmt> (every top-level module a cluster, each sub-module one
box with its node and parameter counts) and DIR/tinylm_block<i>.<fmt> (every node of block i:
op, shape, dtype, parameters by name). Nothing is computed: the graph is only a description.
Needs Graphviz's `dot` for SVG/PNG; without it the .dot files are written and it says so.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import graphlm as gl
from graphlm.models import GPT, GPTConfig
from graphlm.tools.render import GraphvizNotFound, render
from graphlm.tools.stats import graph_stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=".", help="where to write the pictures (default: .)")
    ap.add_argument("--format", choices=("svg", "png"), default="svg")
    ap.add_argument("--block", type=int, default=1, help="the block drawn in full (default: 1)")
    args = ap.parse_args(argv)

    config = GPTConfig.preset("tinylm")
    model = GPT(config).eval()          # eval mode: no dropout nodes in the picture
    g = gl.Graph("tinylm_forward")
    tokens = g.input("tokens", (1, config.context_length), "int64")
    logits = model(tokens)
    stats = graph_stats(g)
    print(f"TinyLM forward graph: {stats['nodes']} nodes, {stats['params']} parameter tensors "
          f"({model.parameter_count():,} parameters), logits {list(logits.shape)}")

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        whole = render(g, out / f"tinylm_forward_depth1.{args.format}", depth=1)
        block = render(g, out / f"tinylm_block{args.block}.{args.format}", scope=f"blocks.{args.block}")
    except GraphvizNotFound as e:
        print(f"visualize_decoder: {e}", file=sys.stderr)
        return 3
    for path in (whole, block):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
