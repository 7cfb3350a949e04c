"""Start-up of a JAX run from the trainer's flags: how many devices, and which process this is.

`configure` must run before anything asks JAX for its devices: on a CPU it makes JAX show the
requested number of (simulated) CPU devices, and it joins a multi-process run.
"""
from __future__ import annotations

import jax

from . import parallel


def configure(devices: int | None = None, coordinator: str | None = None,
              num_processes: int | None = None, process_id: int | None = None) -> int | None:
    """Set up devices and processes for ``graphlm train --executor jax``; returns the number of
    devices the training step runs on (None: the default, one device or every device of a
    multi-process run). Raises ValueError naming the flag at fault."""
    multi = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(multi) and not all(multi):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    if devices is not None and devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    processes = num_processes or 1
    if all(multi):
        if ":" not in coordinator:
            raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
        if processes < 1 or not 0 <= process_id < processes:
            raise ValueError(f"--process-id must be in [0, {processes}), got {process_id}")
    if devices is not None and devices % processes:
        raise ValueError(f"--devices {devices} does not divide over --num-processes {processes}")
    local = (devices // processes) if devices is not None else None
    if local is not None and local > 1:
        try:   # simulated CPU devices (where the platform is a GPU, its own devices are used)
            jax.config.update("jax_num_cpu_devices", local)
        except RuntimeError as e:  # pragma: no cover - JAX's backend already started
            raise ValueError(f"--devices {devices}: JAX has already started its devices ({e})") from None
    if all(multi):
        parallel.initialize(coordinator, processes, process_id)
    return devices
