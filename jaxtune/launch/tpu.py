"""`jaxtune launch tpu`: run `jaxtune train` on every worker of a Cloud TPU VM, through gcloud.

Every worker runs the same `jaxtune train --auto-cluster` (JAX's multi-controller model: `jax.distributed` finds its
peers from the VM's metadata). `launch_tpu` first compiles the run's step for the slice with the TPU compiler
(`compile_check`: libtpu, on any host; a run that does not fit is refused with the figures), then creates the VM (a
queued resource for `--spot`) or reuses a READY one, ships the package, config and local data (`pack_sources`),
installs it with `jax[tpu]` and `etils[epath-gcs]`, and trains on all workers at once. A preempted VM is deleted,
re-created and trained again, resuming from the latest checkpoint: so `--spot` needs `train.output_dir` on `gs://`
(orbax writes there; other run files go to `runs/<bucket>/<path>`). `--dry-run` prints every command.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jaxtune.config import MeshConfig
from jaxtune.errors import JaxtuneError
from jaxtune.planner.command import plan_from_run_config
from jaxtune.planner.compiled_search import confirm_plan
from jaxtune.planner.devices import get_device
from jaxtune.planner.estimate import resolve_mesh
from jaxtune.run_config import load_run_config

REMOTE_DIR = "jaxtune-run"
# TPU VM software versions by generation (cloud.google.com/tpu/docs/runtimes) and gcloud's accelerator names.
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5e": "v2-alpha-tpuv5-lite", "v5litepod": "v2-alpha-tpuv5-lite",
            "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
GCLOUD_NAMES = {"v5e": "v5litepod"}


@dataclass(frozen=True)
class TpuTarget:
    name: str
    zone: str
    accelerator: str
    project: str | None = None
    spot: bool = False
    queued: bool = False
    runtime_version: str = ""

    def __post_init__(self):
        generation, _, chips = self.accelerator.partition("-")
        if not chips.isdigit() or generation not in RUNTIMES:
            raise JaxtuneError(f"--accelerator {self.accelerator!r}: expected TYPE-CORES with TYPE one of "
                               f"{', '.join(RUNTIMES)} (e.g. v5e-8, v5p-32)")
        object.__setattr__(self, "accelerator", f"{GCLOUD_NAMES.get(generation, generation)}-{chips}")
        object.__setattr__(self, "runtime_version", self.runtime_version or RUNTIMES[generation])

    def flags(self) -> list[str]:
        return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])


def create_commands(t: TpuTarget) -> list[list[str]]:
    """A queued resource when asked (the usual way to get spot capacity), else a plain TPU VM."""
    if t.queued:
        return [["gcloud", "compute", "tpus", "queued-resources", "create", t.name, f"--node-id={t.name}",
                 f"--accelerator-type={t.accelerator}", f"--runtime-version={t.runtime_version}", *t.flags(),
                 *(["--spot"] if t.spot else [])]]
    return [["gcloud", "compute", "tpus", "tpu-vm", "create", t.name, f"--accelerator-type={t.accelerator}",
             f"--version={t.runtime_version}", *t.flags(), *(["--spot"] if t.spot else [])]]


def describe_command(t: TpuTarget) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "describe", t.name, *t.flags(), "--format=value(state)"]


def delete_commands(t: TpuTarget) -> list[list[str]]:
    if t.queued:
        return [["gcloud", "compute", "tpus", "queued-resources", "delete", t.name, *t.flags(), "--force", "--quiet"]]
    return [["gcloud", "compute", "tpus", "tpu-vm", "delete", t.name, *t.flags(), "--quiet"]]


def ssh_command(t: TpuTarget, command: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", t.name, *t.flags(), "--worker=all", f"--command={command}"]


def ship_commands(t: TpuTarget, archive: str) -> list[list[str]]:
    return [
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive, f"{t.name}:~/{REMOTE_DIR}.tar.gz", *t.flags(),
         "--worker=all"],
        ssh_command(t, f"rm -rf ~/{REMOTE_DIR} && mkdir -p ~/{REMOTE_DIR} && tar -xzf ~/{REMOTE_DIR}.tar.gz "
                       f"-C ~/{REMOTE_DIR}"),
    ]


def install_command(t: TpuTarget) -> list[str]:
    return ssh_command(t, f"cd ~/{REMOTE_DIR} && python3 -m pip install -q 'jax[tpu]' 'etils[epath-gcs]' ./jaxtune")


def train_command(t: TpuTarget, config_name: str, overrides: list[str]) -> list[str]:
    train = ["train", f"config/{config_name}", "--auto-cluster", *sum((["--set", o] for o in overrides), [])]
    args = " ".join(shlex.quote(a) for a in train)
    return ssh_command(t, f"cd ~/{REMOTE_DIR} && python3 -m jaxtune.cli {args}")


def pack_sources(config: Path, data_files: dict[str, Path], archive: Path) -> None:
    """The jaxtune package (with pyproject), the run config and its local data files, as one tar.gz."""
    root = Path(__file__).resolve().parents[2]
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("pyproject.toml", "README.md", "jaxtune"):
            tar.add(root / name, arcname=f"jaxtune/{name}",
                    filter=lambda info: None if "__pycache__" in info.name else info)
        tar.add(config, arcname=f"config/{config.name}")
        for key, path in data_files.items():
            tar.add(path, arcname=f"data/{key}-{path.name}")


def local_data_files(run) -> dict[str, Path]:
    """[data] files that exist here: they are shipped, and the remote run is pointed at the copies."""
    files = {key: Path(getattr(run.data, key)) for key in ("train", "eval") if getattr(run.data, key)}
    return {key: path for key, path in files.items() if path.is_file()}


def parse_train_args(rest: list[str]) -> tuple[Path, list[str]]:
    """`train CONFIG.toml [--set k=v ...]` after `--`."""
    if len(rest) < 2 or rest[0] != "train":
        raise JaxtuneError("launch runs `-- train CONFIG.toml [--set section.key=value ...]`")
    config, overrides, items = Path(rest[1]), [], rest[2:]
    while items:
        if items[0] != "--set" or len(items) < 2:
            raise JaxtuneError(f"unexpected train argument {items[0]!r} (only --set section.key=value)")
        overrides.append(items[1])
        items = items[2:]
    return config, overrides


def needs(tool: str, flag: str, install: str) -> str:
    """The path of `tool` on PATH, or a JaxtuneError naming the flag that needs it and how to get it."""
    found = shutil.which(tool)
    if found is None:
        raise JaxtuneError(f"{flag} runs `{tool}`, which is not on PATH ({install})")
    return found


class Gcloud:
    """Runs (or, dry, prints) gcloud commands; `run` streams output and returns the exit status."""

    def __init__(self, dry_run: bool, out=None):
        self.dry_run, self.out = dry_run, out if out is not None else sys.stdout  # the stdout of the call, not import

    def run(self, command: list[str]) -> int:
        print("+ " + shlex.join(command), file=self.out, flush=True)
        return 0 if self.dry_run else subprocess.run(command).returncode

    def state(self, t: TpuTarget) -> str:
        """READY, CREATING, PREEMPTED, ... or "" when the VM does not exist (or in a dry run)."""
        print("+ " + shlex.join(describe_command(t)), file=self.out, flush=True)
        if self.dry_run:
            return ""
        result = subprocess.run(describe_command(t), capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""

    def check(self, command: list[str]) -> None:
        if self.run(command) != 0:
            raise JaxtuneError(f"command failed: {shlex.join(command)}")


def compile_check(run, accelerator: str, config_path: Path) -> str:
    """The run's step compiled with the TPU compiler for `accelerator`'s slice (gcloud's name or jaxtune's; `[mesh]
    slices` of them over DCN): one line with the compiler's figures when it fits, a JaxtuneError with them when it
    does not."""
    target = get_device(accelerator.replace("v5litepod", "v5e"))
    try:
        cfg, plan = plan_from_run_config(run, "tpu")
        slices = plan.mesh.slices
        every_slice = target.with_count(target.count * slices)
        plan = plan.replace(mesh=MeshConfig(**resolve_mesh(plan.mesh, every_slice), slices=slices))
        confirmation = confirm_plan(cfg, plan, target)
    except JaxtuneError as e:  # the model not readable here, no libtpu, a slice Cloud TPU does not make
        raise JaxtuneError(f"the compile check: {e} (--no-compile-check to launch without it)") from None
    c = confirmation.compiled
    assert c is not None  # a TPU slice's step is compiled
    figures = (f"the step compiled for {confirmation.topology} needs {confirmation.peak_bytes / 2**30:.2f} GiB a chip "
               f"+ {confirmation.estimate.reserve_bytes / 2**30:.2f} GiB reserve, of "
               f"{confirmation.estimate.device.usable_bytes / 2**30:.2f} GiB usable (compiled in "
               f"{c.compile_seconds:.0f} s, attention {c.attention})")
    if c.over_memory:
        figures = (f"the TPU compiler refuses the step for {confirmation.topology}: its temporaries need "
                   f"{c.temp_bytes / 2**30:.2f} GiB a chip beside {c.argument_bytes / 2**30:.2f} GiB of arguments, of "
                   f"{c.over_memory / 2**30:.2f} GiB")
    if not confirmation.fits:
        raise JaxtuneError(f"{figures}: it does not fit; `jaxtune plan --config {config_path} --target "
                           f"{target.target} --search --confirm` finds a plan that does (--no-compile-check to launch "
                           "anyway)")
    return f"{figures}: fits"


def launch_tpu(t: TpuTarget, rest: list[str], dry_run: bool = False, max_restarts: int = 5, out=None,
               compile_first: bool = True) -> int:
    """Check the run compiles within the slice's memory, then create/reuse, ship, install and train on every
    worker; re-create and resume after preemptions. out: where the commands and notes go (default sys.stdout)."""
    out = out if out is not None else sys.stdout
    config_path, overrides = parse_train_args(rest)
    run = load_run_config(config_path, overrides)  # fail here, not on the TPU, for a bad config
    output_dir = run.train.output_dir
    if t.spot and not output_dir.startswith("gs://"):
        raise JaxtuneError(f"--spot needs train.output_dir on gs:// to resume after a preemption, got {output_dir!r}")
    if compile_first:
        print(f"# {compile_check(run, t.accelerator, config_path)}", file=out, flush=True)
    gcloud = Gcloud(dry_run, out)
    data_files = local_data_files(run)
    overrides = overrides + [f"data.{key}=data/{key}-{path.name}" for key, path in data_files.items()]
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / f"{REMOTE_DIR}.tar.gz"
        pack_sources(config_path, data_files, archive)
        for attempt in range(max_restarts + 1):
            state = gcloud.state(t)
            if state in ("PREEMPTED", "TERMINATED", "FAILED"):
                for command in delete_commands(t):
                    gcloud.check(command)
                state = ""
            if state != "READY":
                for command in create_commands(t):
                    gcloud.check(command)
            for command in ship_commands(t, str(archive)):
                gcloud.check(command)
            gcloud.check(install_command(t))
            print(f"# attempt {attempt + 1}: training; checkpoints and resume point: {output_dir}/checkpoints",
                  file=out, flush=True)
            if gcloud.run(train_command(t, config_path.name, overrides)) == 0:
                return 0
            if gcloud.state(t) == "READY":
                raise JaxtuneError("training failed on a healthy TPU VM (not a preemption); see the log above")
            print(f"# {t.name} was preempted: re-creating it; `jaxtune train` resumes from {output_dir}/checkpoints",
                  file=out, flush=True)
    raise JaxtuneError(f"{t.name}: preempted {max_restarts + 1} times; giving up (re-run to continue)")
