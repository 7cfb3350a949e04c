"""`graphlm export`: write a training checkpoint as a Hugging Face GPT-2 folder or a GGUF file.

    graphlm export runs/tinylm --to hf out/tinylm-hf
    graphlm export runs/tinylm --to gguf tinylm.gguf

`--to hf DIR` writes DIR/config.json and DIR/model.safetensors, which transformers'
GPT2LMHeadModel.from_pretrained(DIR) loads (and, for the byte vocabulary, vocab.json and
merges.txt for GPT2TokenizerFast); `--to gguf FILE` writes llama.cpp's gpt2 layout with
graphlm's byte tokenizer (llama-cli -m FILE). A model the target cannot represent (an LM-head
bias, RMSNorm, SwiGLU) is refused with the differences named; train with --preset tinylm-gpt2
for a model that exports as is. The conversion itself is graphlm.io.export.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from graphlm.io.export import TARGETS, export_gguf, export_hf
from graphlm.models import GPT



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint file, or a run folder of 'graphlm train' (e.g. runs/tinylm): "
                        "its best.safetensors, else its checkpoint.safetensors")
    p.add_argument("--to", nargs=2, metavar=("FORMAT", "DEST"), required=True,
                   help="'hf DIR': a Hugging Face GPT-2 folder (config.json + model.safetensors); "
                        "'gguf FILE': a GGUF file for llama.cpp (required)")
    p.add_argument("--name", default=None,
                   help="model name stored in the GGUF metadata (default: the run folder's name)")
    p.add_argument("--force", action="store_true",
                   help="overwrite existing output files (default: refuse)")


def read_checkpoint_step(path) -> int | None:
    """The training step in a checkpoint's header (no tensors read)."""
    from .train_feedback import saved_options
    return saved_options(path)[1]


def run(args) -> int:
    from .cli import CLIError, resolve_checkpoint

    target, dest = args.to
    if target not in TARGETS:
        raise CLIError(f"--to: unknown format '{target}'; give one of {', '.join(TARGETS)}")
    path = resolve_checkpoint(args.checkpoint, "CHECKPOINT")
    model, params = GPT.from_checkpoint(path)      # (validated, naming the file)
    config = model.config
    step = read_checkpoint_step(path)
    if target == "hf":
        out = export_hf(config, params, dest, overwrite=args.force)
        files = [out / name for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt")
                 if (out / name).exists()]
    else:
        name = args.name or (Path(path).resolve().parent.name or "graphlm-gpt")
        out = export_gguf(config, params, dest, name=name, overwrite=args.force)
        files = [out]
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {', '.join(map(str, files))} ({size:,} bytes): {sum(a.size for a in params.values()):,} "
          f"parameters at step {step}, {target} layout")
    return 0
