"""GPT-2 small (124M parameters, random init) on a CPU: graphlm vs PyTorch eager (and llama.cpp), with TinyLM beside it.

Per framework and task, one subprocess (so each peak resident set, VmHWM, is its own; the
graphlm child never imports torch), run alternately graphlm, torch, graphlm, torch ...:

- ``decode``: KV-cache greedy decode at batch 1 after a 16-token prompt (`--new-tokens`, default
  16), median ms per token; both children report their tokens, which must be the same.
- ``train`` at each `--batches` (default 1 and 4), T = the model's context (1024): the full
  training step (forward, mean cross-entropy, backward, global-norm clip 1.0, AdamW) with
  dropout 0, one untimed step (graphlm compiles in it) then `--steps` timed ones back to back,
  median ms per step. The first two losses of both (same weights, same batch) must agree
  within 1e-3.

``--llama`` adds llama.cpp to the decode: the parent exports the same weights through graphlm's
GGUF exporter (benchmarks/llama_peer.py: llama.cpp's gpt2 layout, float32) into a temporary
folder, removed afterwards, and a third child loads that file into llama-cpp-python on
`--threads` threads and decodes the same prompt greedily; its tokens must equal graphlm's and
torch's. The gpt2 layout has no LM-head bias, so with ``--llama`` every model is built without one
(GPT-2 small has none anyway; TinyLM becomes its ``tinylm-gpt2`` layout). ``--tasks decode``
skips the training steps (seconds instead of minutes).

The same tasks run for TinyLM (T = 128) in the same invocation, so the growth of the time per
token from TinyLM to GPT-2 small is a same-run figure for each framework. PyTorch's attention is
its fused ``F.scaled_dot_product_attention`` (the spelled-out form would keep 12 x [B, 12, 1024,
1024] score tensors, several GB at batch 4); its decode reuses benchmarks/generate.py's model and
its training step benchmarks/train_step.py's, with the same weights (graphlm's initialisation).

    python benchmarks/gpt2_small.py [--threads 2] [--batches 1 4] [--steps 2] [--new-tokens 16]
        [--models tinylm gpt2-small] [--tasks decode train] [--llama] [--json benchmarks/gpt2_small.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from graphlm.executors.native.products import large_products_by  # noqa: E402
from graphlm.executors.numpy.pool import blas_core  # noqa: E402
from graphlm.models import GPT, GPTConfig  # noqa: E402
from graphlm.tools.params import flops_per_token  # noqa: E402
import generate as gen_bench  # noqa: E402   benchmarks/generate.py: both decoders (no torch import)
import train_step as ts_bench  # noqa: E402  benchmarks/train_step.py: both training steps
from train_step import _rss_kib  # noqa: E402
from llama_peer import LlamaCpp, export_weights, llama_unavailable  # noqa: E402  (llama_cpp: with --llama only)

FRAMEWORKS = ("graphlm", "torch")     # both tasks
LLAMA = "llama_cpp"                    # decode only, with --llama
TASKS = ("decode", "train")
LOSS_TOLERANCE = 1e-3   # absolute, on losses near ln(50257) = 10.8 summed over 1024 positions


def label(framework: str) -> str:
    """A framework's name in the table and messages (the JSON keys have no dot)."""
    return "llama.cpp" if framework == LLAMA else framework


def model_config(name: str, llama: bool = False) -> GPTConfig:
    """The preset with dropout 0; for llama.cpp (`llama`) without the LM-head bias GGUF's gpt2 lacks."""
    return GPTConfig.preset(name, dropout=0.0, **({"lm_head_bias": False} if llama else {}))


def decode_prompt() -> list[int]:
    """The 16 printable-byte token ids every decode child starts from."""
    return [int(t) for t in np.random.default_rng(0).integers(32, 127, 16)]


# == children: one framework, one task =================================================================

def child_decode(framework: str, config: GPTConfig, new_tokens: int, threads: int, gguf: str | None = None) -> dict:
    prompt = decode_prompt()
    if framework == LLAMA:     # the parent's GGUF export of the same weights
        import llama_cpp  # noqa: F401  (its library in the baseline, as torch's is in torch's)
        base = _rss_kib("VmRSS")
        tokens, times = LlamaCpp(Path(gguf), config, threads).decode(prompt, new_tokens)
    elif framework == "torch":
        import torch
        torch.set_num_threads(threads)
        base = _rss_kib("VmRSS")
        params = GPT(config).init(0)
        tm = gen_bench.TorchGPT(config, params, torch)
        tokens, times = gen_bench.torch_decode(tm, torch, prompt, new_tokens, True)
    else:
        from graphlm.executors import numpy_executor
        numpy_executor.set_threads(threads)
        base = _rss_kib("VmRSS")
        model = GPT(config)
        params = model.init(0)
        tokens, times = gen_bench.graphlm_cached(model, params, prompt, new_tokens)
    return {"tokens": tokens, "ms_per_token": round(statistics.median(times) * 1e3, 3),
            "times_ms": [round(t * 1e3, 3) for t in times],
            "baseline_rss_mib": round(base / 1024, 1), "peak_rss_mib": round(_rss_kib("VmHWM") / 1024, 1)}


def child_train(framework: str, config: GPTConfig, batch: int, steps: int, threads: int) -> dict:
    x, y = ts_bench.batch_data(config, batch)
    if framework == "torch":
        import torch
        torch.set_num_threads(threads)
        base = _rss_kib("VmRSS")
        params = GPT(config).init(0)
        ts = ts_bench.TorchStep(config, params, torch, sdpa=True)
        del params
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        step = lambda: ts.step(xt, yt)  # noqa: E731
    else:
        from graphlm.executors import numpy_executor
        numpy_executor.set_threads(threads)
        base = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        gs = ts_bench.GraphlmStep(config, batch)
        build_s = time.perf_counter() - t0
        step = lambda: gs.step(x, y, 0)  # noqa: E731
    losses, times, cpu = [], [], []
    for i in range(1 + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    out = {"batch": batch, "losses": losses[:2], "ms_per_step": round(statistics.median(times) * 1e3, 1),
           "times_ms": [round(t * 1e3, 1) for t in times],
           # process CPU time: on a machine shared with other jobs the steadier figure at 1 thread
           "cpu_ms_per_step": round(statistics.median(cpu) * 1e3, 1),
           "baseline_rss_mib": round(base / 1024, 1), "peak_rss_mib": round(_rss_kib("VmHWM") / 1024, 1)}
    if framework == "graphlm":
        out["build_s"] = round(build_s, 2)
        out["arena_mib"] = round(gs.program.plan.arena_bytes / 2 ** 20, 1)
    return out


# == parent ============================================================================================

def run_child(args, framework: str, model: str, task: str, batch: int = 1, gguf: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", framework, "--task", task, "--models", model,
           "--batches", str(batch), "--steps", str(args.steps), "--new-tokens", str(args.new_tokens),
           "--threads", str(args.threads), "--executor", args.executor]
    cmd += ["--llama"] * args.llama + ["--gguf", str(gguf)] * (gguf is not None)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"gpt2_small: the {framework} {task} child for {model} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_model(args, model: str, out: dict, checkpoint) -> None:
    """Fill `out` with the model's figures; `checkpoint()` after each child (a run stopped part
    way keeps what it measured)."""
    config = model_config(model, args.llama)
    t = config.context_length
    out.update({"config": config.to_dict(), "parameters": GPT(config).parameter_count(), "decode": {}, "train": []})
    if "decode" in args.tasks:
        measure_decode(args, model, config, out["decode"], checkpoint)
    flops = flops_per_token(config)["train_step"]
    for b in args.batches if "train" in args.tasks else ():
        row = {"batch": b, "tokens_per_step": b * t}
        out.setdefault("partial_train", []).append(row)
        for fw in FRAMEWORKS:
            row[fw] = r = run_child(args, fw, model, "train", b)
            r["us_per_token"] = round(r["ms_per_step"] * 1e3 / (b * t), 2)
            r["gflop_per_s"] = round(flops * b * t / (r["ms_per_step"] / 1e3) / 1e9, 1)
            checkpoint()
        out["partial_train"].pop()
        diff = max(abs(a - c) for a, c in zip(row["graphlm"]["losses"], row["torch"]["losses"]))
        row["loss_max_abs_diff"] = diff
        row["losses_agree"] = diff <= LOSS_TOLERANCE
        row["ratio_graphlm_over_torch"] = round(row["graphlm"]["ms_per_step"] / row["torch"]["ms_per_step"], 3)
        if all("cpu_ms_per_step" in row[fw] for fw in FRAMEWORKS):
            row["cpu_ratio_graphlm_over_torch"] = round(
                row["graphlm"]["cpu_ms_per_step"] / row["torch"]["cpu_ms_per_step"], 3)
        out["train"].append(row)
        checkpoint()
    out.pop("partial_train", None)


def measure_decode(args, model: str, config: GPTConfig, d: dict, checkpoint) -> None:
    """graphlm's, torch's (and with --llama llama.cpp's) decode children, their token check and ratios."""
    for fw in FRAMEWORKS:
        d[fw] = run_child(args, fw, model, "decode")
        checkpoint()
    if args.llama:
        with tempfile.TemporaryDirectory(prefix="gpt2_small_gguf_") as tmp:
            t0 = time.perf_counter()
            path = export_weights(config, GPT(config).init(0), Path(tmp) / f"{model}.gguf")
            export = {"export_s": round(time.perf_counter() - t0, 2),
                      "gguf_mib": round(path.stat().st_size / 2 ** 20, 1)}
            d[LLAMA] = {**run_child(args, LLAMA, model, "decode", gguf=path), **export}
        checkpoint()
    peers = [fw for fw in (*FRAMEWORKS, LLAMA) if fw in d]
    d["same_greedy_tokens"] = all(d[fw]["tokens"] == d["graphlm"]["tokens"] for fw in peers)
    for fw in peers:
        if d[fw]["tokens"] != d["graphlm"]["tokens"]:
            print(f"gpt2_small: {model} decode: {label(fw)} chose other greedy tokens than graphlm: "
                  f"{d[fw]['tokens']} vs {d['graphlm']['tokens']}", file=sys.stderr)
    for fw in peers[1:]:
        d[f"ratio_graphlm_over_{fw}"] = round(d["graphlm"]["ms_per_token"] / d[fw]["ms_per_token"], 3)


def growth(result: dict) -> dict:
    """GPT-2 small over TinyLM, per framework: decode ms/token and training us/token per batch."""
    small, big = result["models"].get("tinylm"), result["models"].get("gpt2-small")
    if not (small and big):
        return {}
    flops = {m: flops_per_token(GPTConfig.from_dict(r["config"]))["train_step"] for m, r in (("tinylm", small),
                                                                                             ("gpt2-small", big))}
    out = {"train_flops_per_token": round(flops["gpt2-small"] / flops["tinylm"], 1),
           "decode": {fw: round(big["decode"][fw]["ms_per_token"] / small["decode"][fw]["ms_per_token"], 1)
                      for fw in (*FRAMEWORKS, LLAMA) if fw in big["decode"] and fw in small["decode"]},
           "train": {}}
    rows = {r["batch"]: r for r in small["train"]}
    for r in big["train"]:
        if r["batch"] in rows:
            out["train"][str(r["batch"])] = {fw: round(r[fw]["us_per_token"] / rows[r["batch"]][fw]["us_per_token"], 1)
                                            for fw in FRAMEWORKS}
    return out


def markdown(result: dict) -> str:
    """The printed table; llama.cpp's columns (decode only) when the run has it."""
    llama = any(LLAMA in m.get("decode", {}) for m in result["models"].values())
    names = ["graphlm", "torch"] + ["llama.cpp"] * llama
    cols = ["model", "task", *names, "graphlm / torch"] + ["graphlm / llama.cpp"] * llama + [
        f"peak MiB {' / '.join(names)}", "check"]
    lines = [f"graphlm ({result['executor']} executor) vs torch eager (sdpa){' and llama.cpp' * llama}, "
             f"{result['threads']} thread(s); median ms; peak RSS (VmHWM) of each child in MiB", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    row = lambda cells: lines.append("| " + " | ".join(str(c) for c in cells) + " |")  # noqa: E731
    for name, m in result["models"].items():
        d = m["decode"]
        if d:
            fws = [*FRAMEWORKS] + [LLAMA] * llama
            row([name, "KV decode ms/token", *(d[fw]["ms_per_token"] if fw in d else "-" for fw in fws),
                 d["ratio_graphlm_over_torch"], *[d.get(f"ratio_graphlm_over_{LLAMA}", "-")] * llama,
                 " / ".join(str(d[fw]["peak_rss_mib"]) if fw in d else "-" for fw in fws),
                 f"same tokens: {d['same_greedy_tokens']}"])
        for r in m["train"]:
            row([name, f"train step b{r['batch']} ms (us/token)",
                 *(f"{r[fw]['ms_per_step']} ({r[fw]['us_per_token']})" for fw in FRAMEWORKS), *["-"] * llama,
                 f"{r['ratio_graphlm_over_torch']} (CPU time {r.get('cpu_ratio_graphlm_over_torch', '-')})",
                 *["-"] * llama, " / ".join([*(str(r[fw]["peak_rss_mib"]) for fw in FRAMEWORKS), *["-"] * llama]),
                 f"losses within {r['loss_max_abs_diff']:.1e}: {r['losses_agree']}"])
    g = result.get("growth")
    if g:
        parts = ["decode ms/token " + ", ".join(f"{label(fw)} x{v}" for fw, v in g["decode"].items())]
        if g["train"]:
            parts.append("training time per token " + "; ".join(
                f"b{b}: graphlm x{v['graphlm']}, torch x{v['torch']}" for b, v in g["train"].items()))
        lines += ["", f"GPT-2 small / TinyLM (training FLOPs per token x{g['train_flops_per_token']}): "
                  + "; ".join(parts)]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tinylm", "gpt2-small"], choices=["tinylm", "gpt2-small"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=2, help="timed training steps per child (after one untimed)")
    ap.add_argument("--new-tokens", type=int, default=16, help="decoded tokens per child")
    ap.add_argument("--threads", type=int, default=2,
                    help="graphlm executor threads (BLAS on one) and torch's intra-op threads")
    ap.add_argument("--executor", choices=["native", "numpy"], default="native")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS),
                    help="what to time (default both; 'decode' alone skips the minutes of training steps)")
    ap.add_argument("--llama", action="store_true",
                    help="also llama.cpp's decode (llama-cpp-python) on the same weights exported to GGUF; "
                         "every model then has no LM-head bias (GGUF's gpt2 has none)")
    ap.add_argument("--json", default="benchmarks/gpt2_small.json", help="JSON output ('-': stdout)")
    ap.add_argument("--child", choices=(*FRAMEWORKS, LLAMA), help=argparse.SUPPRESS)
    ap.add_argument("--task", choices=TASKS, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llama and not args.child and (why := llama_unavailable()):
        ap.error(why)         # (the children do not import llama_cpp: only llama.cpp's own child does)

    if args.child:
        ts_bench.EXECUTOR = gen_bench.EXECUTOR = args.executor
        config = model_config(args.models[0], args.llama)
        if args.task == "decode":
            r = child_decode(args.child, config, args.new_tokens, args.threads, args.gguf)
        else:
            r = child_train(args.child, config, args.batches[0], args.steps, args.threads)
        print(json.dumps(r))
        return 0

    import torch
    result = {"benchmark": "gpt2_small", "executor": args.executor, "threads": args.threads,
              "tasks": args.tasks, "steps_timed": args.steps, "new_tokens": args.new_tokens,
              "machine": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                          "cpus": len(os.sched_getaffinity(0)), "numpy_blas_core": blas_core(),
                          "large_products_by": large_products_by(),
                          "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")},
              "models": {}}
    if args.llama:
        import llama_cpp
        result["machine"]["llama_cpp_python"] = llama_cpp.__version__

    def checkpoint():
        if args.json != "-":
            Path(args.json).write_text(json.dumps({**result, "complete": False}, indent=2) + "\n")

    for m in args.models:
        measure_model(args, m, result["models"].setdefault(m, {}), checkpoint)
    result["growth"] = growth(result)
    result["complete"] = True
    ts_bench.report(markdown(result), result, args.json)
    ok = all(m["decode"].get("same_greedy_tokens", True) and all(r["losses_agree"] for r in m["train"])
             for m in result["models"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
