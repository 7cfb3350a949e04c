"""The complete GPT of the decoder-only chapter (section 26.5, 137_Gpt.c), built from its numbers.

    python examples/book_gpt.py [--seed 0] [--executor numpy]

`GPTConfig.preset("book-gpt")`: vocabulary 8, 6 positions, d_model 8, 2 heads, 2 blocks, pre-norm
RMSNorm (eps 1e-5), causal self-attention without biases, a GELU (tanh) MLP of width 16 = 2 x
d_model without biases, a final RMSNorm, and the output head tied to the token embedding. The
weights are drawn at the chapter's scales (token embedding U(+-0.3), positions U(+-0.1), every
block weight U(+-0.1); norm gains 1), from graphlm's own generator rather than the C library's.

The untrained model predicts the current token at every position (3 1 4 1 5 2 -> 3 1 4 1 5 2),
as the chapter explains: near-zero blocks let the residual stream carry the token's embedding
to the tied head, which scores it against every embedding, and a vector's largest dot product
is (here) with itself. The parameter line is the chapter's 112 embedding + 1056 blocks, plus the
8 gains of the final RMSNorm, which the chapter's code does not have (its rmsnorm has no
weights; its count includes the blocks' two norms per block, 2 x d_model, but not the final one).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from graphlm import executors  # noqa: F401  (registers the executors)
from graphlm import init
from graphlm.models import GPT, GPTConfig
from graphlm.tools.params import parameter_table

TOKENS = [3, 1, 4, 1, 5, 2]          # the chapter's input sequence
EMBEDDING_SCALE, POSITION_SCALE, BLOCK_SCALE = 0.3, 0.1, 0.1   # its (randf()*2-1) * scale


def book_model() -> GPT:
    """The chapter's GPT with its initialisation scales as the parameters' init policies."""
    model = GPT(GPTConfig.preset("book-gpt"))
    for name, p in model.parameters().items():
        if name == "token_embedding.weight":
            p.init = init.uniform(EMBEDDING_SCALE)
        elif name == "positional_embedding.table.weight":
            p.init = init.uniform(POSITION_SCALE)
        elif name.startswith("blocks.") and not name.endswith("norm.weight"):
            p.init = init.uniform(BLOCK_SCALE)
    return model


def parameter_line(model: GPT) -> str:
    """The chapter's parameter line, from graphlm's parameter table of the model."""
    table = parameter_table(model)
    count = lambda *modules: sum(table.module(m).params for m in modules)  # noqa: E731
    embedding = count("token_embedding", "positional_embedding")
    blocks = count(*(f"blocks.{i}" for i in range(model.config.layer_count)))
    final = count("final_norm")
    return (f"Parameters: {embedding} embedding + {blocks} blocks + {final} final norm = "
            f"{embedding + blocks + final}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    ap.add_argument("--executor", default="numpy", help="executor (default: numpy)")
    args = ap.parse_args(argv)

    model = book_model()
    c = model.config
    params = model.init(args.seed)
    print("GPT-style Decoder-Only Transformer (graphlm, GPTConfig.preset('book-gpt'))")
    print(f"  vocab={c.vocab_size}  d_model={c.channels}  heads={c.head_count}  "
          f"layers={c.layer_count}  mlp={c.mlp_width}\n")
    print(f"Input tokens: {TOKENS}\n")
    logits = model.logits(params, np.array([TOKENS]), executor=args.executor)[0]
    predicted = logits.argmax(-1)
    print("Next-token predictions:\n")
    print("  Position  Context          Predicted  Actual")
    print("  --------  ---------------  ---------  ------")
    for i in range(len(TOKENS) - 1):
        print(f"  {i:4d}      tokens[0..{i}]    {predicted[i]:5d}      {TOKENS[i + 1]:5d}")
    copies = bool((predicted == np.array(TOKENS)).all())
    print(f"\nPredicts the current token at every position: {copies}")
    print(f"\n{parameter_line(model)}")
    print("  The tied output head adds 0.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
