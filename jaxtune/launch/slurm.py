"""`jaxtune launch slurm`: one run on the GPU nodes of a Slurm cluster, as an sbatch script.

One process a GPU (JAX's layout under Slurm): `srun` starts `--ntasks-per-node` = GPUs a node copies of
`jaxtune train CONFIG --auto-cluster`, and `jax.distributed.initialize()` reads SLURM_JOB_ID, SLURM_STEP_NODELIST,
SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID (the coordinator: the first node, each process its own GPU). The nodes
share the file system the config, data and train.output_dir are on. Slurm sends SIGTERM two minutes before the time
limit, on which `jaxtune train` checkpoints and stops; a requeued (preempted) job resumes from that checkpoint.
`--submit` runs sbatch.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.launch.tpu import needs, parse_train_args
from jaxtune.run_config import load_run_config

WARNING_SECONDS = 120  # SIGTERM this long before the time limit: time for a checkpoint


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """`nodes` nodes of `gpus_per_node` GPUs each; partition, account and time limit ("HH:MM:SS", "D-HH:MM:SS")
    as sbatch takes them, empty for the cluster's defaults."""

    name: str
    nodes: int
    gpus_per_node: int
    partition: str = ""
    account: str = ""
    time_limit: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise JaxtuneError(f"--name {self.name!r}: letters, digits, '_', '.' and '-' only")
        if self.nodes < 1:
            raise JaxtuneError(f"--nodes {self.nodes}: a job takes 1 or more nodes")
        if self.gpus_per_node < 1:
            raise JaxtuneError(f"--gpus-per-node {self.gpus_per_node}: 1 or more")
        if self.time_limit and not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.time_limit):
            raise JaxtuneError(f"--time {self.time_limit!r}: as sbatch takes it, e.g. 24:00:00 or 2-00:00:00")


def sbatch_script(job: SlurmJob, argv: list[str]) -> str:
    """The batch script: one task a GPU on every node, each running `argv` through srun."""
    options = {"job-name": job.name, "nodes": job.nodes, "ntasks-per-node": job.gpus_per_node,
               "gpus-per-node": job.gpus_per_node, "partition": job.partition, "account": job.account,
               "time": job.time_limit, "signal": f"TERM@{WARNING_SECONDS}", "output": f"{job.name}-%j.out"}
    lines = ["#!/bin/bash"] + [f"#SBATCH --{key}={value}" for key, value in options.items() if value]
    lines += ["#SBATCH --exclusive", "#SBATCH --requeue",
              "# one process a GPU; jax.distributed finds the others from SLURM's variables (jaxtune train "
              "--auto-cluster)",
              f"srun --kill-on-bad-exit=1 {shlex.join(argv)}"]
    return "\n".join(lines) + "\n"


def launch_slurm(job: SlurmJob, rest: list[str], *, script_path: Path, submit: bool = False, out=None) -> int:
    """Check the run's config, write its sbatch script to `script_path` and, with `submit`, sbatch it."""
    out = out if out is not None else sys.stdout
    if submit:
        needs("sbatch", "--submit", "run it on the cluster's login node")
    config_path, overrides = parse_train_args(rest)
    load_run_config(config_path, overrides)  # fail here, not in the queue, for a bad config
    argv = ["jaxtune", "train", str(config_path.resolve()), "--auto-cluster",
            *sum((["--set", o] for o in overrides), [])]
    script_path.write_text(sbatch_script(job, argv))
    print(f"# wrote {script_path}: {job.nodes} node(s) x {job.gpus_per_node} GPU(s), one process a GPU", file=out,
          flush=True)
    if not submit:
        print(f"# to run it: sbatch {shlex.quote(str(script_path))}", file=out, flush=True)
        return 0
    command = ["sbatch", str(script_path)]
    print("+ " + shlex.join(command), file=out, flush=True)
    if subprocess.run(command).returncode != 0:
        raise JaxtuneError(f"`{shlex.join(command)}` failed (its output is above)")
    return 0
