"""llama.cpp as a benchmark peer: graphlm's weights exported to GGUF and run by llama-cpp-python.

Shared by benchmarks/generate.py (TinyLM, in its own process) and benchmarks/gpt2_small.py (GPT-2
small, in a child process of its own). The weights go through graphlm's exporter
(graphlm.io.export.export_gguf: llama.cpp's gpt2 layout, float32), so a model with an LM-head bias
cannot be run (the gpt2 layout has none). llama.cpp is no dependency of graphlm: nothing imports
this module unless a benchmark is asked for llama.cpp (benchmarks/README.md says how to build it).

    if why := llama_unavailable(): ...              # one line: what is missing
    export_weights(config, params, path)            # the GGUF file
    llama = LlamaCpp(path, config, threads)         # or LlamaCpp.from_params(config, params, threads, path)
    tokens, seconds = llama.decode(prompt, 16)      # greedy: argmax of llama.cpp's last logits
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np


def llama_unavailable() -> str | None:
    """Why --llama cannot run here (None: it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ("--llama needs llama-cpp-python (not a graphlm dependency); build it as "
                "benchmarks/README.md says")
    try:
        from graphlm.io.export import export_gguf  # noqa: F401
    except ImportError:
        return "--llama needs graphlm's GGUF exporter (graphlm.io.export.export_gguf)"
    return None


def export_weights(config, params: dict, path: Path) -> Path:
    """`params` of a GPT of `config` as a float32 GGUF file at `path` (replaced if there)."""
    from graphlm.io.export import export_gguf
    return export_gguf(config, params, path, overwrite=True)


class LlamaCpp:
    """A GGUF file of graphlm's exporter, run by llama.cpp on `threads` threads with a context of
    the model's length; greedy from llama.cpp's logits of the last evaluated token. `clock` times
    each call (the caller's clock; wall time by default)."""

    def __init__(self, path: Path, config, threads: int, clock: Callable[[], float] = time.perf_counter):
        import llama_cpp
        self.lib, self.vocab, self.clock = llama_cpp, config.vocab_size, clock
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=config.context_length, n_batch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)

    @classmethod
    def from_params(cls, config, params: dict, threads: int, path: Path,
                    clock: Callable[[], float] = time.perf_counter) -> "LlamaCpp":
        """Export `params` to `path`, then load it."""
        return cls(export_weights(config, params, path), config, threads, clock)

    def logits(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy()

    def prefill(self, prompt) -> float:
        """Seconds to evaluate `prompt` from an empty cache."""
        self.llm.reset()
        t0 = self.clock()
        self.llm.eval(list(prompt))
        return self.clock() - t0

    def decode(self, prompt, n):
        """The `n` greedy tokens after `prompt` and the seconds of each one-token step."""
        seq = [int(t) for t in prompt]
        self.prefill(seq)
        times = []
        for _ in range(n):
            seq.append(int(np.argmax(self.logits())))
            t0 = self.clock()
            self.llm.eval([seq[-1]])
            times.append(self.clock() - t0)
        return seq[len(prompt):], times
