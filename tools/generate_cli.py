"""`graphlm generate`: sample text from a training checkpoint or a Hugging Face GPT-2 directory.

    graphlm generate --checkpoint runs/tinylm --prompt "ROMEO:" \\
        --max-new-tokens 300 --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1
    graphlm generate --hf-dir gpt2/ --prompt-file prompt.txt --repetition-penalty 1.3 \\
        --stop "\\n\\n" --num-samples 4 --json

Temperature 0 is greedy decoding. Decoding uses the KV cache of graphlm.sample; past the
model's context the window slides (the last context_length - 1 tokens are re-encoded). A
checkpoint's text is bytes (what `graphlm train` trains on; ids the bytes cannot spell are never
sampled); an --hf-dir model uses the directory's own tokenizer (Hugging Face `tokenizers`) and
stops at its end-of-text token. One sample is streamed to stdout as it is generated (the prompt
first); --num-samples N decodes N samples as one batch (sample i is what --seed S+i gives alone)
and prints them one after another; --json prints one JSON object instead. The speed goes to
stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from graphlm.models import GPT
from graphlm.sample import Generator, check_sampling_options
from graphlm.tokenizer import ByteTokenizer, HFTokenizer

from .train_cli import default_threads, use_threads

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", default=None,
                     help="a checkpoint file, or a run folder of `graphlm train`: its best.safetensors "
                          "(lowest validation loss), else its checkpoint.safetensors (default: runs/tinylm)")
    src.add_argument("--hf-dir", default=None, metavar="DIR",
                     help="a Hugging Face GPT-2 directory (config.json, model.safetensors and "
                          "tokenizer.json or vocab.json + merges.txt) instead of a checkpoint")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    text.add_argument("--prompt-file", default=None, metavar="FILE",
                      help="read the prompt from FILE (UTF-8); '-' reads standard input")
    p.add_argument("--max-new-tokens", type=int, default=300, help="tokens to generate per sample (default: 300)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the positive logits and multiply the negative ones of tokens already in "
                        "the context by this, as Hugging Face's (default 1.0: off; 1.1-1.3 is usual)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop a sample when its text contains TEXT (kept in the output; repeat for "
                        "several; \\n, \\t and \\\\ are understood)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="samples of the prompt, decoded together as one batch (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; sample i uses seed + i (default: 0)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (prompt, samples with text, token ids and finish "
                        "reason, timing) instead of the text (default: off)")
    p.add_argument("--executor", default="auto",
                   help="executor (default: auto, the native one where a C compiler works, else numpy)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="threads of the numpy and native executors, BLAS on one (default: the available cores, "
                        "at most 4; 0 = leave threading to OpenBLAS)")


def unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r``, ``\\0`` and ``\\\\`` in a command-line string; other backslashes stay."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def read_prompt(args) -> str:
    if args.prompt_file is None:
        text = "\n" if args.prompt is None else args.prompt
        try:
            text.encode("utf-8")   # argv bytes that are not UTF-8 arrive as lone surrogates
        except UnicodeEncodeError as e:
            raise ValueError(f"--prompt is not valid UTF-8 text (character {e.start})") from None
        return text
    where = "standard input" if args.prompt_file == "-" else args.prompt_file
    try:
        if args.prompt_file == "-":
            raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        else:
            with open(args.prompt_file, "rb") as f:
                raw = f.read()
    except OSError as e:
        raise ValueError(f"--prompt-file {where}: cannot read ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {where}: not UTF-8 text (byte {e.start})") from None


def load_model(args):
    """(model, params, tokenizer, stop token ids, source) for --checkpoint or --hf-dir."""
    if args.hf_dir is not None:
        from graphlm.io import load_hf_gpt2
        config, params = load_hf_gpt2(args.hf_dir)
        tokenizer = HFTokenizer.from_dir(args.hf_dir)
        eos = _eos_token_id(args.hf_dir, config.vocab_size)
        return GPT(config), params, tokenizer, ([eos] if eos is not None else []), args.hf_dir
    from .cli import resolve_checkpoint
    path = str(resolve_checkpoint(args.checkpoint, "--checkpoint"))
    model, params = GPT.from_checkpoint(path)   # (validated, naming the file)
    return model, params, ByteTokenizer(), [], path


def _eos_token_id(directory: str, vocab_size: int) -> int | None:
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < vocab_size else None


def run(args) -> int:
    use_threads(args.threads)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    try:
        check_sampling_options(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-')}") from None
    stop = [unescape(s) for s in args.stop]
    if any(not s for s in stop):
        raise ValueError("--stop must not be empty")
    prompt_text = read_prompt(args)
    model, params, tokenizer, stop_ids, source = load_model(args)
    prompt = tokenizer.encode(prompt_text)
    what = "--prompt-file" if args.prompt_file is not None else "--prompt"
    if not prompt:
        raise ValueError(f"{what} is empty; give at least one character")
    v = model.config.vocab_size
    if max(prompt) >= v:
        raise ValueError(f"{what} has token {max(prompt)} outside the model's vocabulary [0, {v})")
    gen = Generator(model, params, batch_size=args.num_samples, executor=args.executor)
    out = sys.stdout
    stream = args.num_samples == 1 and not args.json
    if stream:
        out.write(prompt_text)
        out.flush()

    def emit(row: int, piece: str) -> None:
        out.write(piece)
        out.flush()

    t0 = time.perf_counter()
    samples = gen.generate_batch(prompt, args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k or None, top_p=args.top_p, seed=args.seed,
                                 repetition_penalty=args.repetition_penalty, stop=stop,
                                 stop_token_ids=stop_ids, tokenizer=tokenizer,
                                 on_text=emit if stream else None)
    seconds = time.perf_counter() - t0 - gen.compile_seconds     # sampling, not compiling
    new_tokens = sum(len(s.tokens) for s in samples)
    timing = {"seconds": round(seconds, 4), "new_tokens": new_tokens,
              "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
              "prefill_seconds": round(gen.prefill_seconds, 4), "prefills": gen.prefill_count,
              "decode_seconds": round(gen.decode_seconds, 4), "decode_steps": gen.decode_count,
              "compile_seconds": round(gen.compile_seconds, 4), "batch_size": args.num_samples}
    if args.json:
        doc = {"source": source, "prompt": prompt_text, "prompt_tokens": len(prompt),
               "tokenizer": tokenizer.name,
               "options": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                           "top_k": args.top_k, "top_p": args.top_p,
                           "repetition_penalty": args.repetition_penalty, "stop": stop,
                           "num_samples": args.num_samples, "seed": args.seed},
               "samples": [{"seed": args.seed + i, "text": s.text, "tokens": s.tokens,
                            "finish_reason": s.finish_reason, "stop": s.stop}
                           for i, s in enumerate(samples)],
               "timing": timing}
        out.write(json.dumps(doc, ensure_ascii=False) + "\n")
    elif stream:
        out.write("\n")
    else:
        for i, s in enumerate(samples):
            out.write(f"--- sample {i + 1} of {len(samples)} (seed {args.seed + i}) ---\n")
            out.write(prompt_text + s.text + "\n")
    out.flush()
    rate = f"{timing['tokens_per_s']:.1f} tokens/s" if timing["tokens_per_s"] else "- tokens/s"
    print(f"generated {new_tokens} token(s) at {rate} (batch {args.num_samples}; {seconds:.2f} s: "
          f"prefill {1e3 * gen.prefill_seconds:.1f} ms of {len(prompt)} prompt token(s) and "
          f"{gen.prefill_count - 1} window slide(s), {gen.decode_count} decode step(s); plus "
          f"{gen.compile_seconds:.2f} s compiling)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="graphlm generate", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
