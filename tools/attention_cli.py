"""`graphlm attention`: the attention probabilities of every layer and head for a prompt.

    graphlm attention --checkpoint runs/tinylm \\
        --prompt "ROMEO: The cat sat on the" --out attn.png --top 3

Runs the checkpoint's model once over the prompt's bytes with every attention layer's
probabilities as outputs of the forward program, draws them as a grid of heatmaps (a row per
layer, a column per head; tokens on both axes; the causal triangle grey) and prints, for each
layer and head, the positions the last token attends to most.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphlm import data
from graphlm.models import GPT

from .attention import (PICTURE_FORMATS, attention_maps, format_top, token_labels, top_attended,
                        write_attention_picture)
from .cli import CLIError, _check_out, resolve_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint file, or a run folder of `graphlm train`: its best.safetensors, "
                        "else its checkpoint.safetensors (default: runs/tinylm)")
    p.add_argument("--prompt", default="ROMEO: The cat sat on the",
                   help="the text to look at, at most the model's context length in bytes "
                        "(default: %(default)r)")
    p.add_argument("--out", default="attn.png",
                   help="the picture: .png, .svg or .pdf (default: %(default)s)")
    p.add_argument("--top", type=int, default=3,
                   help="how many most-attended positions of the last token to print per head "
                        "(default: %(default)s)")
    p.add_argument("--executor", default="auto",
                   help="executor that runs the forward program (default: auto, the native one "
                        "where a C compiler works, else numpy)")


def run(args) -> int:
    out = Path(args.out)
    if out.suffix.lower().lstrip(".") not in PICTURE_FORMATS:
        raise CLIError(f"--out {args.out}: use a .png, .svg or .pdf file")
    _check_out(args.out)
    if args.top < 1:
        raise CLIError(f"--top must be at least 1, got {args.top}")
    checkpoint = resolve_checkpoint(args.checkpoint, "--checkpoint")
    model, params = GPT.from_checkpoint(checkpoint)
    config = model.config
    tokens = data.encode(args.prompt)
    if tokens.size == 0:
        raise CLIError("--prompt is empty; give at least one character")
    if tokens.size > config.context_length:
        raise CLIError(f"--prompt is {tokens.size} bytes, more than the model's context length "
                       f"{config.context_length}")
    if tokens.max() >= config.vocab_size:
        raise CLIError(f"--prompt has byte {int(tokens.max())} outside the model's vocabulary "
                       f"[0, {config.vocab_size})")
    maps = attention_maps(model, params, tokens, executor=args.executor)
    labels = token_labels(tokens)
    print(format_top(top_attended(maps, k=min(args.top, tokens.size)), labels))
    try:
        write_attention_picture(maps, labels, out, title=(
            f"attention probabilities for {args.prompt!r}: {config.layer_count} layers x "
            f"{config.head_count} heads of {checkpoint}"))
    except RuntimeError as e:   # matplotlib is missing
        raise CLIError(str(e), code=1) from None
    heads = sum(p.shape[0] for p in maps.values())
    print(f"wrote {out} ({out.stat().st_size:,} bytes): {len(maps)} layers x "
          f"{heads // max(len(maps), 1)} heads over {tokens.size} tokens")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="graphlm attention", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
