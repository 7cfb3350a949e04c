"""Sampling speed at batch 1: graphlm (native or numpy executor) vs PyTorch eager (and llama.cpp with
``--llama``), with and without a KV cache, and the prefill of a 16- and a 128-token prompt, on the same
TinyLM weights; and graphlm's batched sampling (``--batch N``, `graphlm generate --num-samples N`)
against its batch 1. Prints a table and writes JSON (``--json PATH``, default stdout only).

    python benchmarks/generate.py [--checkpoint runs/tinylm/checkpoint.safetensors]
        [--prompt-length 16] [--new-tokens 100] [--threads 1] [--repeats 3] [--batch 8]
        [--prefill-lengths 16 128] [--llama]

``--llama`` exports the same weights with graphlm.io.export.export_gguf (llama.cpp's gpt2
layout, float32) and times llama-cpp-python's one-token decode and prefill in the same turns;
the model then has no LM-head bias (the gpt2 layout has none) for all frameworks. llama.cpp is
no dependency of graphlm: build it as benchmarks/README.md says. Prefill: the best of
PREFILL_BEST prefills per turn, median over the turns.

Batched: "graphlm_kv_cache_batchN" is the decode step of N rows (tokens/s = N / step time);
"sampling" times `Generator.generate_batch` at batch 1 and N step by step (temperature 0.8, top-k 40:
token choice and bookkeeping included; median step), tokens/s over all rows; the ratio of the two
is what `--num-samples N` gains over N runs. Medians of the steps, and (`p10_steps`) their 10th
percentile: on a loaded machine most longer steps get preempted, which biases medians against
the larger batch. "outside_decode_ms_per_step" is a step's mean time outside the decode
program's run (choosing the tokens, the rows' bookkeeping; median over the repeats).

Both frameworks decode greedily from the same prompt; the script checks that they choose the
same tokens (so both do the same work) before it reports (exit 1 if any differs). "KV cache" is per-token decode after
the prompt's prefill; "no cache" recomputes the forward over the whole sequence for each token
(graphlm: one static program over a [1, T] window read at the last real position, which the
causal mask makes exact; PyTorch: the growing sequence).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphlm import executors  # noqa: E402,F401  (registers the executors)
from graphlm.backends import get_executor  # noqa: E402
from graphlm.executors.numpy.pool import blas_core  # noqa: E402
from graphlm.ir import Graph  # noqa: E402
from graphlm.models import GPT, GPTConfig  # noqa: E402
from graphlm.sample import Generator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_peer import LlamaCpp, llama_unavailable  # noqa: E402  llama.cpp, imported only with --llama


# -- PyTorch eager: the same model, with a KV cache ------------------------------------------------
class TorchGPT:
    def __init__(self, config: GPTConfig, params: dict, torch):
        self.t, self.c = torch, config
        self.p = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}

    def ln(self, x, name):
        F = self.t.nn.functional
        return F.layer_norm(x, (self.c.channels,), self.p[f"{name}.weight"], self.p[f"{name}.bias"],
                            self.c.layer_norm_epsilon)

    def forward(self, tokens, start: int, cache: list | None):
        """tokens [1, L] at positions start..start+L-1; cache: per block [k, v] or None."""
        torch, F, c, p = self.t, self.t.nn.functional, self.c, self.p
        b, length = tokens.shape
        h, d = c.head_count, c.channels // c.head_count
        x = p["token_embedding.weight"][tokens] + p["positional_embedding.table.weight"][start:start + length]
        for i in range(c.layer_count):
            pre = f"blocks.{i}"
            a = self.ln(x, f"{pre}.attention_norm")
            w, bias = p[f"{pre}.attention.qkv_weight"], p[f"{pre}.attention.qkv_bias"]
            q, k, v = ((a @ w[j] + bias[j]).view(b, length, h, d).transpose(1, 2) for j in range(3))
            if cache is not None:
                if cache[i] is not None:
                    k = torch.cat([cache[i][0], k], dim=2)
                    v = torch.cat([cache[i][1], v], dim=2)
                cache[i] = [k, v]
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
            if length > 1:
                total = k.shape[2]
                mask = torch.ones(length, total, dtype=torch.bool).tril(total - length)
                scores = scores.masked_fill(~mask, float("-inf"))
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, c.channels)
            x = x + F.linear(ctx, p[f"{pre}.attention.output.weight"], p[f"{pre}.attention.output.bias"])
            m = self.ln(x, f"{pre}.mlp_norm")
            m = F.gelu(F.linear(m, p[f"{pre}.mlp_input.weight"], p[f"{pre}.mlp_input.bias"]), approximate="tanh")
            x = x + F.linear(m, p[f"{pre}.mlp_output.weight"], p[f"{pre}.mlp_output.bias"])
        x = self.ln(x[:, -1:], "final_norm")
        return F.linear(x, p.get("language_model_head.weight", p["token_embedding.weight"]), p.get("language_model_head.bias"))[:, -1]


def torch_decode(tm, torch, prompt, n, cached: bool):
    seq = list(prompt)
    times = []
    with torch.no_grad():
        cache = [None] * tm.c.layer_count if cached else None
        logits = tm.forward(torch.tensor([seq]), 0, cache)
        for _ in range(n):
            seq.append(int(logits.argmax(-1)))
            t0 = clock()
            if cached:
                logits = tm.forward(torch.tensor([[seq[-1]]]), len(seq) - 1, cache)
            else:
                logits = tm.forward(torch.tensor([seq]), 0, None)
            times.append(clock() - t0)
    return seq[len(prompt):], times


# -- graphlm ----------------------------------------------------------------------------------------
def graphlm_cached(model, params, prompt, n, batch=1):
    gen = Generator(model, params, batch_size=batch, executor=EXECUTOR)
    seq = list(prompt)
    times = []
    logits = gen.prefill(np.tile(np.asarray([seq]), (batch, 1)))
    for _ in range(n):
        row = np.argmax(logits, axis=-1)
        seq.append(int(row[0]))
        t0 = clock()
        logits = gen.decode(row)
        times.append(clock() - t0)
    return seq[len(prompt):], times


def graphlm_sampling(gen, prompt, n):
    """The rows' tokens, the seconds of each step of one `generate_batch` (token choice,
    bookkeeping and the decode step: the interval between row 0's successive tokens, so
    compiling and the prefill are out) and the mean seconds per step outside the decode
    program's run (`Generator.decode_seconds`: one decode per interval; `gen` has compiled)."""
    stamps = []
    decode_s, decodes = gen.decode_seconds, gen.decode_count
    samples = gen.generate_batch(prompt, n, temperature=0.8, top_k=40, seed=1,
                                 on_token=lambda row, token: row == 0 and stamps.append(clock()))
    steps = np.diff(stamps)
    assert gen.decode_count - decodes == len(steps), "one decode per step"
    return [s.tokens for s in samples], steps, (steps.sum() - (gen.decode_seconds - decode_s)) / len(steps)


def graphlm_no_cache(model, params, prompt, n):
    t = model.config.context_length
    model.eval()
    g = Graph("forward_window")
    logits_node = model(g.input("tokens", (1, t), np.int64))
    prog = get_executor(EXECUTOR).compile(g, [logits_node])
    window = np.zeros((1, t), np.int64)
    seq = list(prompt)
    window[0, :len(seq)] = seq
    logits = prog.run({"tokens": window}, params)[0][0, len(seq) - 1]
    times = []
    for _ in range(n):
        seq.append(int(np.argmax(logits)))
        window[0, len(seq) - 1] = seq[-1]
        t0 = clock()
        logits = prog.run({"tokens": window}, params)[0][0, len(seq) - 1]
        times.append(clock() - t0)
    return seq[len(prompt):], times


def graphlm_prefill(model, params, prompt) -> float:
    """Seconds of one prefill of `prompt` (its program compiled by an untimed prefill before)."""
    gen = Generator(model, params, executor=EXECUTOR)
    gen.prefill(np.asarray([prompt]))
    t0 = clock()
    gen.prefill(np.asarray([prompt]))
    return clock() - t0


def torch_prefill(tm, torch, prompt) -> float:
    with torch.no_grad():
        t0 = clock()
        tm.forward(torch.tensor([prompt]), 0, [None] * tm.c.layer_count)
        return clock() - t0


EXECUTOR = "native"   # graphlm's executor (--executor)
PREFILL_BEST = 5      # prefills per turn, the fastest kept: a slice of a loaded machine hides a 2 ms one


def clock() -> float:
    """The benchmark's clock (--clock): wall time, or this thread's CPU time."""
    return CLOCK()


CLOCK = time.perf_counter


def main(argv=None) -> int:
    global EXECUTOR, CLOCK
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", help="weights from a training checkpoint (default: TinyLM init, seed 0)")
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1,
                    help="graphlm executor threads (BLAS on one) and torch threads (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant; the median per-token time is kept")
    ap.add_argument("--executor", choices=["native", "numpy"], default="native",
                    help="graphlm's executor (default native: numpy's plan with C kernels)")
    ap.add_argument("--batch", type=int, default=8,
                    help="also time graphlm's batched decode and sampling of this many rows against batch 1 "
                         "(default 8; 1 = off)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time steps by the wall clock (default) or by the CPU time of the calling thread "
                         "(with --threads 1 only: everything then runs in that thread; on a loaded machine "
                         "it leaves out the time the process waits for a core)")
    ap.add_argument("--llama", action="store_true",
                    help="also llama.cpp (llama-cpp-python) on the same weights exported to GGUF; the "
                         "model then has no LM-head bias (GGUF's gpt2 has none), for all three")
    ap.add_argument("--prefill-lengths", type=int, nargs="*", default=[16, 128],
                    help="prompt lengths whose one-shot prefill is timed (default 16 128)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    EXECUTOR = args.executor
    if args.llama and (why := llama_unavailable()):
        ap.error(why)
    if args.llama and args.clock == "cpu":
        ap.error("--clock cpu cannot count llama.cpp's own threads; use the wall clock with --llama")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (the CPU time of other threads is not counted)")
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter

    import torch
    from graphlm.executors import numpy as numpy_executor
    numpy_executor.set_threads(args.threads)
    torch.set_num_threads(args.threads)

    if args.checkpoint:
        from graphlm.io.checkpoint import read_checkpoint
        ck = read_checkpoint(args.checkpoint)
        config = GPTConfig.from_dict(ck.config)
        model = GPT(config)
        params = {k: ck.tensors[k] for k in model.parameters()}
        if args.llama and config.lm_head_bias:
            ap.error(f"--llama: {args.checkpoint} has an LM-head bias, which GGUF's gpt2 cannot hold; "
                     "train with --preset tinylm-gpt2")
    else:   # TinyLM's init; with --llama without the head bias (GGUF's gpt2 layout)
        config = GPTConfig.preset("tinylm", lm_head_bias=not args.llama)
        model = GPT(config)
        params = model.init(0)
    if max(args.prefill_lengths, default=0) > config.context_length:
        ap.error(f"--prefill-lengths must be at most the context ({config.context_length})")
    if args.prompt_length + args.new_tokens > config.context_length:
        ap.error(f"prompt + new tokens must fit the context ({config.context_length})")
    prompt = list(np.random.default_rng(0).integers(32, 127, args.prompt_length))
    tm = TorchGPT(config, params, torch)

    variants = {
        "graphlm_kv_cache": lambda: graphlm_cached(model, params, prompt, args.new_tokens),
        "torch_kv_cache": lambda: torch_decode(tm, torch, prompt, args.new_tokens, True),
        "graphlm_no_cache": lambda: graphlm_no_cache(model, params, prompt, args.new_tokens),
        "torch_no_cache": lambda: torch_decode(tm, torch, prompt, args.new_tokens, False),
    }
    long_prompt = list(np.random.default_rng(1).integers(32, 127, max(args.prefill_lengths, default=0)))
    prefills = {"graphlm": lambda p: graphlm_prefill(model, params, p),
                "torch": lambda p: torch_prefill(tm, torch, p)}
    if args.llama:
        import tempfile
        tmp = tempfile.TemporaryDirectory()
        llama = LlamaCpp.from_params(config, params, args.threads, Path(tmp.name) / "model.gguf", clock)
        variants["llama_cpp_kv_cache"] = lambda: llama.decode(prompt, args.new_tokens)
        prefills["llama_cpp"] = llama.prefill
        llama.prefill(long_prompt)   # llama.cpp's first call allocates its graph and buffers
    b = args.batch
    if b > 1:
        variants[f"graphlm_kv_cache_batch{b}"] = lambda: graphlm_cached(model, params, prompt, args.new_tokens, b)
    gens = {k: Generator(model, params, batch_size=k, executor=EXECUTOR) for k in ((1, b) if b > 1 else ())}
    for gen in gens.values():   # compile the prefill and decode programs outside the timed steps
        gen.generate_batch(prompt, 2)
    tokens, per_token, sampling = {}, {k: [] for k in variants}, {k: [] for k in gens}
    fast = {k: [] for k in variants}      # 10th percentile of the steps: a loaded machine's clean ones
    for _ in range(args.repeats):             # alternate the variants so load hits them alike
        for name, fn in variants.items():
            toks, times = fn()
            tokens[name] = toks
            per_token[name].append(statistics.median(times))
            fast[name].append(np.percentile(times, 10))
        for k, gen in gens.items():
            rows, steps, outside = graphlm_sampling(gen, prompt, args.new_tokens)
            sampling[k].append((len(rows) / statistics.median(steps), len(rows) / np.percentile(steps, 10), outside))
    prefill_s = {(who, n): [] for who in prefills for n in args.prefill_lengths}
    for _ in range(args.repeats):   # per turn the best of PREFILL_BEST (a 16-token prefill is ~1-2 ms)
        for (who, n), got in prefill_s.items():
            got.append(min(prefills[who](long_prompt[:n]) for _ in range(PREFILL_BEST)))
    agree = {k: tokens[k] == tokens["torch_kv_cache"] for k in tokens}
    result = {"executor": EXECUTOR, "clock": args.clock, "config": config.to_dict(), "prompt_length": args.prompt_length,
              "new_tokens": args.new_tokens, "threads": args.threads, "repeats": args.repeats,
              "same_greedy_tokens_as_torch": agree, "numpy_blas_core": blas_core(), "variants": {}}
    for name in variants:
        ms = statistics.median(per_token[name]) * 1e3
        rows = b if name.endswith(f"_batch{b}") else 1
        result["variants"][name] = {"ms_per_token": round(ms, 3), "tokens_per_s": round(rows * 1e3 / ms, 1),
                                    "batch": rows}
    result["prefill"] = {f"{who}_{n}": {"ms": round(statistics.median(t) * 1e3, 3),
                                        "tokens_per_s": round(n / statistics.median(t), 1)}
                         for (who, n), t in prefill_s.items()}
    v = result["variants"]
    if args.llama:
        result["graphlm_over_llama_cpp_ms_per_token"] = round(
            v["graphlm_kv_cache"]["ms_per_token"] / v["llama_cpp_kv_cache"]["ms_per_token"], 3)
        result["prefill_graphlm_over_llama_cpp_tokens_per_s"] = {
            str(n): round(result["prefill"][f"graphlm_{n}"]["tokens_per_s"]
                          / result["prefill"][f"llama_cpp_{n}"]["tokens_per_s"], 3) for n in args.prefill_lengths}
    if gens:
        rate = {k: statistics.median(r[0] for r in rs) for k, rs in sampling.items()}
        rate_fast = {k: statistics.median(r[1] for r in rs) for k, rs in sampling.items()}
        step_fast = {k: statistics.median(fast[name]) for k, name in ((1, "graphlm_kv_cache"),
                                                                      (b, f"graphlm_kv_cache_batch{b}"))}
        result["batched"] = {
            "batch": b,
            "decode_tokens_per_s_vs_batch1": round(v[f"graphlm_kv_cache_batch{b}"]["tokens_per_s"]
                                                   / v["graphlm_kv_cache"]["tokens_per_s"], 2),
            "sampling_tokens_per_s": {f"batch{k}": round(r, 1) for k, r in rate.items()},
            "sampling_tokens_per_s_vs_batch1": round(rate[b] / rate[1], 2),
            "outside_decode_ms_per_step": {f"batch{k}": round(statistics.median(r[2] for r in rs) * 1e3, 4)
                                           for k, rs in sampling.items()},
            "p10_steps": {"decode_ms_per_step": {f"batch{k}": round(t * 1e3, 3) for k, t in step_fast.items()},
                          "decode_tokens_per_s_vs_batch1": round(b * step_fast[1] / step_fast[b], 2),
                          "sampling_tokens_per_s_vs_batch1": round(rate_fast[b] / rate_fast[1], 2)},
            "sampling_options": {"temperature": 0.8, "top_k": 40, "seed": 1}}
    result["speedup_kv_cache_vs_torch"] = round(v["graphlm_kv_cache"]["tokens_per_s"] / v["torch_kv_cache"]["tokens_per_s"], 3)
    result["speedup_no_cache_vs_torch"] = round(v["graphlm_no_cache"]["tokens_per_s"] / v["torch_no_cache"]["tokens_per_s"], 3)

    print(f"{'variant':<20} {'ms/token':>9} {'tokens/s':>9}  same tokens as torch")
    for name, r in v.items():
        print(f"{name:<20} {r['ms_per_token']:>9.3f} {r['tokens_per_s']:>9.1f}  {agree[name]}")
    print(f"graphlm / torch tokens/s: KV cache {result['speedup_kv_cache_vs_torch']}x, "
          f"no cache {result['speedup_no_cache_vs_torch']}x")
    for name, r in result["prefill"].items():
        print(f"prefill {name:<20} {r['ms']:>9.3f} ms {r['tokens_per_s']:>9.1f} tokens/s")
    if args.llama:
        print(f"graphlm / llama.cpp: decode ms/token {result['graphlm_over_llama_cpp_ms_per_token']}, prefill "
              f"tokens/s {result['prefill_graphlm_over_llama_cpp_tokens_per_s']}")
    if gens:
        r = result["batched"]
        print(f"batch {b} vs 1, tokens/s: decode step {r['decode_tokens_per_s_vs_batch1']}x; sampling "
              f"(generate_batch) {r['sampling_tokens_per_s'][f'batch{b}']} vs {r['sampling_tokens_per_s']['batch1']}"
              f" = {r['sampling_tokens_per_s_vs_batch1']}x; on the fastest tenth of the steps: decode "
              f"{r['p10_steps']['decode_tokens_per_s_vs_batch1']}x, sampling {r['p10_steps']['sampling_tokens_per_s_vs_batch1']}x; "
              f"ms per step outside the decode run (token choice, bookkeeping): "
              f"{r['outside_decode_ms_per_step']['batch1']} at batch 1, {r['outside_decode_ms_per_step'][f'batch{b}']} at {b}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(agree.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
