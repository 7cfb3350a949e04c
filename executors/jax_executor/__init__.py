"""The JAX executor: a graphlm graph lowered to one XLA program (CPU, GPU, TPU; many devices
and processes).

    program = executors.get("jax").compile(graph, outputs)             # one device
    program = executors.get("jax").compile(graph, outputs, devices=4)  # data parallel
    program.run(feeds, state)          # state stays on the device(s) between runs

Files: `rules.py` (one lowering rule per op, keyed by op name), `lowering.py` (rules or
registered decompositions -> one traced function), `program.py` (jit, donation, state on the
device, 64-bit scoping), `parallel.py` (mesh, shardings, ZeRO-1, host copies, processes).
"""
from __future__ import annotations

from .parallel import initialize, is_primary, to_host
from .program import JaxExecutor, JaxProgram
from .rules import RULES

__all__ = ["JaxExecutor", "JaxProgram", "RULES", "initialize", "is_primary", "to_host"]
