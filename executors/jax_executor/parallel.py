"""Where a program's arrays live: the device mesh, the data-parallel shardings, ZeRO-1 sharding
of optimizer moments, host copies, and the multi-process start-up.

Data parallel is SPMD: the program stays the whole global-batch graph; inputs with a batch axis
are sharded along the mesh's ``data`` axis, parameters and state are replicated, and XLA's
partitioner inserts the gradient all-reduce (the loss is the global-batch mean by construction).
With ``shard_optimizer_state=True`` the optimizer moments are sharded along ``data`` instead of
replicated (ZeRO stage 1): each device keeps 1/N of them and XLA gathers the update.

Many processes (``initialize``): each process runs the same program over the global mesh of all
processes' devices and feeds only its own rows of every batch.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from graphlm.ir import fmt_shape

from ..base import ExecutionError

DATA = "data"
# the update ops whose written `state` inputs are optimizer moments (what ZeRO-1 shards)
OPTIMIZER_UPDATES = ("adamw_update", "sgd_update")


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join a multi-process run (before any other JAX call in this process): the coordinator's
    HOST:PORT, the number of processes and this one's id. CPU collectives go through gloo."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # only the CPU client reads it
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def raise_if_any_process_failed(error: Exception | None) -> None:
    """In a multi-process run, every process calls this with its own check's error (None when
    its inputs passed) before the program runs: if any process failed, every process raises
    (the failing ones their own error, the others one naming the failing processes), so no
    process is left waiting in a collective for one that gave up. One small all-gather."""
    from jax.experimental import multihost_utils

    failed = multihost_utils.process_allgather(np.int32(error is not None))
    bad = [int(p) for p in np.flatnonzero(np.asarray(failed).reshape(-1))]
    if error is not None:
        raise error
    if bad:
        names = ", ".join(str(p) for p in bad)
        raise ExecutionError(f"process {names} refused its inputs (its error says why), so process "
                             f"{jax.process_index()} stops too, before running the program")


def make_mesh(devices=None, mesh: Mesh | None = None) -> Mesh:
    """The program's mesh: `mesh` as given (it must have a ``data`` axis), or the first `devices`
    devices along ``data``; by default every device of a multi-process run, else one device."""
    if mesh is not None:
        if devices is not None:
            raise ValueError("compile: give devices or mesh, not both")
        if DATA not in mesh.axis_names:
            raise ValueError(f"compile: the mesh needs a '{DATA}' axis, it has {mesh.axis_names}")
        return mesh
    every = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if devices is None:
        devices = len(every) if jax.process_count() > 1 else 1
    devices = int(devices)
    if not 1 <= devices <= len(every):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is "
                "imported)" if every[0].platform == "cpu" else "")
        raise ValueError(f"compile: devices={devices}, but JAX sees {len(every)} device(s){hint}")
    return Mesh(np.array(every[:devices]), (DATA,))


class Layout:
    """The sharding of every feed, state entry and output of one program."""

    def __init__(self, program, mesh: Mesh, batch_inputs=None, shard_optimizer_state: bool = False):
        self.mesh = mesh
        self.size = mesh.shape[DATA]
        self.replicated = NamedSharding(mesh, PartitionSpec())
        names = program.input_nodes
        if batch_inputs is None:
            batch_inputs = [n for n, node in names.items() if node.ndim >= 1] if self.size > 1 else []
        for name in batch_inputs:
            if name not in names:
                raise ValueError(f"compile: batch input '{name}' is not an input of this program")
            shape = names[name].shape
            if not shape or shape[0] % self.size:
                raise ValueError(f"compile: input '{name}' {fmt_shape(shape)} cannot be split along "
                                 f"its first axis over {self.size} devices")
        self.batch_inputs = set(batch_inputs)
        batch = NamedSharding(mesh, PartitionSpec(DATA))
        self.feeds = {n: batch if n in self.batch_inputs else self.replicated for n in names}
        moments = optimizer_moments(program) if shard_optimizer_state else set()
        self.state = {n: self._moment_sharding(node.shape) if n in moments else self.replicated
                      for n, node in program.state_nodes.items()}
        self.sharded_state = sorted(n for n, s in self.state.items() if s is not self.replicated)
        self.processes = len({d.process_index for d in mesh.devices.flat})
        self.multi_process = self.processes > 1

    def _moment_sharding(self, shape):
        for axis, d in enumerate(shape):
            if d % self.size == 0 and d >= self.size:
                return NamedSharding(self.mesh, PartitionSpec(*([None] * axis + [DATA])))
        return self.replicated   # no axis divides evenly: kept whole on every device

    def local_shape(self, name: str, shape) -> tuple[int, ...]:
        """The shape of this process's part of feed `name` (its rows of a batch input)."""
        if self.multi_process and name in self.batch_inputs:
            return (shape[0] // self.processes,) + tuple(shape[1:])
        return tuple(shape)

    def local_rows(self, batch_size: int) -> slice | None:
        """The rows of a global batch this process feeds (None: all, one process)."""
        if not self.multi_process:
            return None
        part = batch_size // self.processes
        i = jax.process_index()
        return slice(i * part, (i + 1) * part)

    def put_feed(self, name: str, value, global_shape):
        sharding = self.feeds[name]
        if self.multi_process and name in self.batch_inputs:
            return jax.make_array_from_process_local_data(sharding, np.asarray(value), tuple(global_shape))
        return put(value, sharding)

    def state_bytes_per_device(self, program, sharded: bool = True) -> int:
        """Bytes of params and state on each device (the largest share), as laid out, or with
        everything replicated when `sharded` is False."""
        total = 0
        for name, node in program.state_nodes.items():
            sharding = self.state[name] if sharded else self.replicated
            total += math.prod(sharding.shard_shape(node.shape)) * node.dtype.itemsize
        return total


def optimizer_moments(program) -> set[str]:
    """The state leaves the program's optimizer update ops write (moments, momentum buffers)."""
    return {n.inputs[i].name for n in program.nodes if n.op in OPTIMIZER_UPDATES
            for i in n.attrs["writes"] if n.inputs[i].op == "state"}


def put(value, sharding: NamedSharding):
    """`value` (NumPy or JAX) laid out as `sharding`; over several processes every process
    passes the same whole value and keeps its own devices' parts."""
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
        return value
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value) if not isinstance(value, jax.Array) else to_host(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(value) -> np.ndarray:
    """A NumPy copy of a (possibly sharded, possibly multi-process) array. Over several
    processes this is collective for a sharded array: every process must call it."""
    if not isinstance(value, jax.Array):
        return np.asarray(value)
    if value.is_fully_addressable:
        return np.asarray(value)
    if value.is_fully_replicated:
        return np.asarray(value.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def is_primary() -> bool:
    """Whether this is process 0 (the one that writes checkpoints)."""
    return jax.process_index() == 0
