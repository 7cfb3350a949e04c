"""Batched sampling's per-step time outside the decode program, this checkout against another
revision's sampling code, in one process: calls of `Generator.generate_batch` alternate between
the two so that load hits both alike (benchmarks/generate.py's batched part runs one revision at
a time, and on a shared machine its figures move by more than the difference).

    git archive REV | tar -x -C /tmp/base      # the other revision's files
    python benchmarks/sampling_ab.py --base /tmp/base [--calls 60] [--threads 1] [--clock cpu]
        [--json PATH]

Only graphlm/sample.py and graphlm/random.py come from --base (the token choice, the decode loop
and the random stream); the model, the executors and their kernels are this checkout's for both.
Each call: TinyLM init weights, a 16-token prompt, 100 new tokens at temperature 0.8, top-k 40,
seed 1, native executor (generate.py's batched sampling), at batch 1 and at --batch. Per call:
ms per step (the interval between row 0's tokens), the decode step (`Generator.decode_seconds`
per decode) and their difference, the time outside the decode run; medians over the calls.
Exit 1 if the two revisions chose different tokens.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphlm import executors  # noqa: E402,F401  (registers the executors)
from graphlm import sample  # noqa: E402
from graphlm.models import GPT, GPTConfig  # noqa: E402


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def base_sample(base: Path):
    """The other revision's graphlm.sample, drawing from its own SplitMix64."""
    random = load("graphlm._base_random", base / "graphlm" / "random.py")
    module = load("graphlm._base_sample", base / "graphlm" / "sample.py")
    module.SplitMix64 = random.SplitMix64
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="a folder holding the other revision's files")
    ap.add_argument("--calls", type=int, default=60, help="timed calls of each (revision, batch)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1; leaves out waiting for a core)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if not (args.base / "graphlm" / "sample.py").is_file():
        ap.error(f"--base {args.base}: no graphlm/sample.py there (git archive REV | tar -x -C DIR)")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1")
    if args.calls < 1 or args.batch < 2:
        ap.error("--calls must be >= 1 and --batch >= 2")
    if args.clock == "cpu":   # every timer of both revisions' generators, and the stamps below
        time.perf_counter = time.thread_time
    from graphlm.executors import numpy as numpy_executor
    numpy_executor.set_threads(args.threads)

    model = GPT(GPTConfig.preset("tinylm"))
    params = model.init(0)
    prompt = list(np.random.default_rng(0).integers(32, 127, 16))
    revisions = {"base": base_sample(args.base), "this": sample}
    gens = {(who, b): mod.Generator(model, params, batch_size=b, executor="native")
            for who, mod in revisions.items() for b in (1, args.batch)}
    steps = {k: [] for k in gens}
    decodes = {k: [] for k in gens}
    tokens = {}
    for call in range(args.calls + 1):          # call 0 compiles the programs: not timed
        for key, gen in gens.items():
            stamps = []
            gen.decode_seconds, gen.decode_count = 0.0, 0
            samples = gen.generate_batch(prompt, 100, temperature=0.8, top_k=40, seed=1,
                                         on_token=lambda row, token: row == 0 and stamps.append(time.perf_counter()))
            tokens[key] = [s.tokens for s in samples]
            if call:
                steps[key].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                decodes[key].append(gen.decode_seconds / gen.decode_count)
    same = all(tokens[("base", b)] == tokens[("this", b)] for b in (1, args.batch))
    result = {"base": str(args.base), "calls": args.calls, "threads": args.threads, "clock": args.clock,
              "batch": args.batch, "same_tokens": same, "runs": {}}
    for (who, b), s in steps.items():
        step, decode = statistics.median(s), statistics.median(decodes[(who, b)])
        result["runs"][f"{who}_batch{b}"] = {"ms_per_step": round(step * 1e3, 4), "decode_ms": round(decode * 1e3, 4),
                                             "outside_decode_ms": round((step - decode) * 1e3, 4),
                                             "tokens_per_s": round(b / step, 1)}
    r = result["runs"]
    for who in revisions:
        result[f"{who}_batch{args.batch}_vs_batch1"] = round(
            r[f"{who}_batch{args.batch}"]["tokens_per_s"] / r[f"{who}_batch1"]["tokens_per_s"], 3)
    for name, x in r.items():
        print(f"{name:<14} {x['ms_per_step']:.4f} ms/step = decode {x['decode_ms']:.4f} + outside "
              f"{x['outside_decode_ms']:.4f}; {x['tokens_per_s']:.1f} tokens/s")
    print(f"batch {args.batch} vs 1: base {result[f'base_batch{args.batch}_vs_batch1']}x, "
          f"this {result[f'this_batch{args.batch}_vs_batch1']}x; same tokens: {same}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
