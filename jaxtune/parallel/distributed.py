"""Multi-process runs: joining a `jax.distributed` cluster, feeding each process its share of a batch, bringing
sharded results back. Every process runs the same program over all devices and drives only its own (JAX's model).

    join_cluster(ClusterConfig("10.0.0.1:1234", num_processes=2, process_id=0))  # before anything else touches JAX
    rows = global_array(np_rows, sharding)              # this process transfers only its devices' rows
    host = host_copy(params)                             # numpy on every process, gathered where sharded
    if is_main_process(): write(...)                     # barrier, main_process_says: the rest agree

`ClusterConfig(auto=True)` reads a Cloud TPU VM's metadata; else `cluster_from_env` (flags, or `ENV`'s variables).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtune.errors import JaxtuneError

ENV = {"coordinator": "JAXTUNE_COORDINATOR", "num_processes": "JAXTUNE_NUM_PROCESSES",
       "process_id": "JAXTUNE_PROCESS_ID"}


@dataclass(frozen=True)
class ClusterConfig:
    """coordinator: "host:port" of process 0's coordination service ("" and auto=False: a single process).
    auto: let JAX detect the cluster (Cloud TPU VMs, SLURM, Open MPI)."""

    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    auto: bool = False

    def __post_init__(self):
        if self.coordinator and not (self.num_processes >= 1 and 0 <= self.process_id < self.num_processes):
            raise JaxtuneError(f"process id {self.process_id} is not in 0..{self.num_processes - 1} "
                               f"(--num-processes {self.num_processes})")

    @property
    def multi_process(self) -> bool:
        return self.auto or bool(self.coordinator)


def cluster_from_env(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, auto: bool = False) -> ClusterConfig:
    """A ClusterConfig from explicit values, falling back on the JAXTUNE_* environment variables."""
    values: dict[str, Any] = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for key, var in ENV.items():
        if values[key] is None and os.environ.get(var):
            raw = os.environ[var]
            try:
                values[key] = raw if key == "coordinator" else int(raw)
            except ValueError:
                raise JaxtuneError(f"{var}={raw!r} is not an integer") from None
    if values["coordinator"] and values["num_processes"] is None:
        raise JaxtuneError(f"a coordinator address needs the process count (--num-processes or {ENV['num_processes']})")
    if values["coordinator"] and values["process_id"] is None:
        raise JaxtuneError(f"a coordinator address needs this process's id (--process-id or {ENV['process_id']})")
    return ClusterConfig(values["coordinator"] or "", values["num_processes"] or 1, values["process_id"] or 0, auto)


def join_cluster(cluster: ClusterConfig) -> None:
    """`jax.distributed.initialize` for `cluster` (nothing for a single process). Must run before JAX creates its
    backends. CPU processes exchange collectives through gloo."""
    if not cluster.multi_process:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if cluster.auto:
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id)
    except (RuntimeError, ValueError) as e:
        where = "auto-detected cluster" if cluster.auto else f"coordinator {cluster.coordinator}"
        first_line = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise JaxtuneError(f"could not join the {where} as process {cluster.process_id}: {first_line}") from None


def is_main_process() -> bool:
    """True on the process that writes files meant to exist once (metrics, plots, exported results)."""
    return jax.process_index() == 0


def global_array(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The same host array on every process → one global array in `sharding`; each process copies only the
    slices its own devices hold (nothing of the other processes' rows)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def host_copy(tree):
    """The tree as numpy arrays on every process; arrays split across processes are all-gathered first."""
    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(fetch, tree)


def scored_in_shares(score: Callable[[list[int]], np.ndarray], n: int, columns: int | None = None) -> np.ndarray:
    """The [n] float64 scores of n rows (or [n, columns] with `columns`: several scores a row, NaN among them), each
    process scoring its share (a contiguous block of ceil(n / processes) rows) with `score(row indices) -> [rows]`
    (or [rows, columns]) float64, the numbers then gathered to every process bit for bit. An
    exception in one process's share is raised there and a JaxtuneError naming that process on the others (none
    waits in the gather)."""
    processes, me = jax.process_count(), jax.process_index()
    shape = () if columns is None else (columns,)
    if processes == 1:
        return np.asarray(score(list(range(n))), np.float64).reshape(n, *shape)
    block = -(-n // processes)
    mine = list(range(me * block, min(n, (me + 1) * block)))
    values: np.ndarray = np.zeros((block, *shape), np.float64)
    failure = None
    try:
        if mine:
            values[:len(mine)] = score(mine)
    except Exception as e:  # noqa: BLE001  raised below, once every process knows
        failure = e
    failed = np.asarray(multihost_utils.process_allgather(np.int32(failure is not None))).reshape(-1)
    if failure is not None:
        raise failure
    if failed.any():
        raise JaxtuneError(f"process {int(np.flatnonzero(failed)[0])} failed scoring its share of the rows (its log "
                           "names the error)")
    bits = multihost_utils.process_allgather(values.view(np.int32))  # float64 as int32 pairs: JAX keeps 32 bits
    return np.asarray(bits).reshape(-1).view(np.float64).reshape(-1, *shape)[:n]


def gathered_lists(local: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Every process's lists of integers (token ids), in process order, on every process; `local`: this process's."""
    if jax.process_count() == 1:
        return [[list(x) for x in local]]
    sizes = np.asarray([len(local), max((len(x) for x in local), default=0)], np.int32)
    counts = np.asarray(multihost_utils.process_allgather(sizes)).reshape(-1, 2)
    padded: np.ndarray = np.zeros((max(1, int(counts[:, 0].max())), 1 + int(counts[:, 1].max())), np.int32)
    for i, x in enumerate(local):  # column 0: the list's length
        padded[i, 0], padded[i, 1:1 + len(x)] = len(x), x
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [[every[p, i, 1:1 + every[p, i, 0]].tolist() for i in range(counts[p, 0])] for p in range(len(counts))]


def gathered_floats(local: Sequence[float]) -> list[list[float]]:
    """Every process's float64 numbers, in process order, bit for bit (as int32 pairs: JAX keeps 32 bits)."""
    pairs = [np.asarray([v], np.float64).view(np.int32).tolist() for v in local]
    return [[float(np.asarray(p, np.int32).view(np.float64)[0]) for p in share] for share in gathered_lists(pairs)]


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier called `name` (nothing for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def main_process_says(value: bool) -> bool:
    """Process 0's `value` on every process: a decision only the main process can take (it holds the run's files)
    that every process must follow (a collective computation)."""
    if jax.process_count() == 1:
        return value
    return bool(multihost_utils.broadcast_one_to_all(np.int32(value)))
