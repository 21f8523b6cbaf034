"""`jaxtune launch gke` and `launch xpk`: one run on N slices of a Cloud TPU type in a GKE cluster.

`launch gke` writes a JobSet as GKE's multi-slice docs and XPK lay it out: a replicated job of one Job a slice, one
pod a host (nodeSelector on the slice's accelerator and topology, `google.com/tpu` chips each), libtpu's MEGASCALE_*
variables so the slices meet over DCN, and a ConfigMap with the run config and its local data mounted at CONFIG_DIR.
Every pod runs `jaxtune train CONFIG --auto-cluster --set mesh.slices=N` (data parallel across slices). A preempted
pod fails its Job; the JobSet re-creates them all (failurePolicy.maxRestarts) and `jaxtune train` resumes from its
latest checkpoint on gs://. The compile gate runs first; `--apply` applies with kubectl and follows the JobSet to
its end. `launch xpk` writes the same run as `xpk workload create` (xpk writes the JobSet; `--apply` runs it).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.launch.tpu import GCLOUD_NAMES, compile_check, local_data_files, needs, parse_train_args
from jaxtune.planner.devices import get_device
from jaxtune.planner.slices import TpuSlice, tpu_slice
from jaxtune.run_config import load_run_config
from jaxtune.train.outputs import run_directories

CONFIG_DIR = "/etc/jaxtune"  # where the pods see the ConfigMap's files
# GKE's node label value for each TPU generation (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus)
GKE_ACCELERATORS = {"v4": "tpu-v4-podslice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice",
                    "v6e": "tpu-v6e-slice"}
CONFIG_MAP_BYTES = 1 << 20  # Kubernetes' limit on one ConfigMap
JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"  # a pod's slice: its Job's index in the JobSet


@dataclass(frozen=True, kw_only=True)
class SliceJob:
    """`slices` slices of the Cloud TPU type `tpu` ("v5p-64"; "v5litepod-16" as gcloud says "v5e-16") for the
    run `name` (the JobSet's or xpk workload's name, a DNS label); a preempted run restarts `max_restarts` times."""

    name: str
    tpu: str
    slices: int = 1
    max_restarts: int = 5

    def __post_init__(self):
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", self.name):
            raise JaxtuneError(f"--name {self.name!r}: a JobSet name is lowercase letters, digits and '-', starting "
                               "with a letter, at most 40 characters")
        generation, _, size = self.tpu.replace("v5litepod", "v5e").partition("-")
        if generation not in GKE_ACCELERATORS or not size.isdigit():
            raise JaxtuneError(f"--tpu {self.tpu!r}: expected TYPE-SIZE with TYPE one of {', '.join(GKE_ACCELERATORS)}"
                               " (e.g. v5p-64, v6e-16)")
        object.__setattr__(self, "tpu", f"{generation}-{size}")  # jaxtune's name for it, the planner's
        if self.slices < 1:
            raise JaxtuneError(f"--slices {self.slices}: a run takes 1 or more slices")
        if self.max_restarts < 0:
            raise JaxtuneError(f"--max-restarts {self.max_restarts}: 0 or more")
        try:
            self.slice  # a size Cloud TPU makes, or the line naming those it does
        except JaxtuneError as e:
            raise JaxtuneError(f"--tpu {e}") from None

    @property
    def slice(self) -> TpuSlice:
        return tpu_slice(get_device(self.tpu))

    @property
    def gcloud_tpu(self) -> str:
        """The type as gcloud and xpk name it ("v5litepod-16")."""
        generation, _, size = self.tpu.partition("-")
        return f"{GCLOUD_NAMES.get(generation, generation)}-{size}"


def prepared_run(job: SliceJob, rest: list[str], where: str, compile_first: bool,
                 out) -> tuple[list[str], dict[str, Path], str]:
    """The checks every launch makes before anything is created (the config loads with `mesh.slices` set, its output
    is on gs://, its step compiles for the slices), then (the pods' `jaxtune train` argv, {file name: local path} of
    the config and local data it reads from the directory `where`, the checkpoint directory a restart resumes from)."""
    config_path, overrides = parse_train_args(rest)
    said = load_run_config(config_path, overrides).mesh.slices
    if said not in (1, job.slices):
        raise JaxtuneError(f"--slices {job.slices}, but {config_path} says [mesh] slices = {said}: give one number")
    overrides = overrides + [f"mesh.slices={job.slices}"]
    run = load_run_config(config_path, overrides)
    if not run.train.output_dir.startswith("gs://"):
        raise JaxtuneError(f"a GKE run needs train.output_dir on gs:// (pods' disks do not outlive a restart, so "
                           f"nothing could resume), got {run.train.output_dir!r}")
    if compile_first:
        print(f"# {compile_check(run, job.tpu, config_path)}", file=out, flush=True)
    data = local_data_files(run)
    files = {config_path.name: config_path} | {f"{key}-{path.name}": path for key, path in data.items()}
    overrides += [f"data.{key}={where}/{key}-{path.name}" for key, path in data.items()]
    argv = ["jaxtune", "train", f"{where}/{config_path.name}", "--auto-cluster",
            *sum((["--set", o] for o in overrides), [])]
    return argv, files, str(run_directories(run.train.output_dir)[1])


def config_map(name: str, files: dict[str, Path]) -> dict:
    """A ConfigMap holding `files` (UTF-8 ones as text, others as binaryData); a JaxtuneError past Kubernetes'
    1 MiB."""
    size = sum(path.stat().st_size for path in files.values())
    if size > CONFIG_MAP_BYTES:
        raise JaxtuneError(f"the config and local data files ({', '.join(map(str, files.values()))}) are {size:,} "
                           f"bytes, over a ConfigMap's {CONFIG_MAP_BYTES:,}: put the data on gs:// or in the image")
    text, binary = {}, {}
    for key, path in files.items():
        raw = path.read_bytes()
        try:
            text[key] = raw.decode()
        except UnicodeDecodeError:
            binary[key] = base64.b64encode(raw).decode()
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-run"}, "data": text,
            **({"binaryData": binary} if binary else {})}


def jobset(job: SliceJob, image: str, argv: list[str]) -> dict:
    """The JobSet: `job.slices` Jobs ("slice"), each of one pod a host of the slice running `argv`."""
    s = job.slice
    megascale = [] if job.slices == 1 else [
        {"name": "MEGASCALE_NUM_SLICES", "value": str(job.slices)},
        {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}},
        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{job.name}-slice-0-0.{job.name}"},  # slice 0's pod 0
    ]
    container = {"name": "jaxtune", "image": image, "command": argv, "env": megascale,
                 "ports": [{"containerPort": 8471}, {"containerPort": 8080}], "securityContext": {"privileged": True},
                 "resources": {"limits": {"google.com/tpu": s.chips_per_host}},
                 "volumeMounts": [{"name": "run", "mountPath": CONFIG_DIR}]}
    pod = {"spec": {"restartPolicy": "Never", "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATORS[s.generation],
                                     "cloud.google.com/gke-tpu-topology": "x".join(map(str, s.shape))},
                    "containers": [container], "volumes": [{"name": "run", "configMap": {"name": f"{job.name}-run"}}]}}
    slice_job = {"parallelism": s.hosts, "completions": s.hosts, "backoffLimit": 0, "template": pod}
    one_slice_a_node_pool = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": job.name, "annotations": one_slice_a_node_pool},
            "spec": {"failurePolicy": {"maxRestarts": job.max_restarts},
                     "replicatedJobs": [{"name": "slice", "replicas": job.slices, "template": {"spec": slice_job}}]}}


def to_yaml(documents: list[dict]) -> str:
    """Block-style YAML of `documents` (dicts, lists, str, int, bool); strings JSON-quoted, which YAML reads as is."""
    return "---\n".join("\n".join(_yaml_lines(d, 0)) + "\n" for d in documents)


def _yaml_lines(value, depth: int):
    pad = "  " * depth
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                yield f"{pad}{key}:"
                yield from _yaml_lines(item, depth + 1)
            else:
                yield f"{pad}{key}: {_scalar(item)}"
    else:
        for item in value:
            if isinstance(item, dict) and item:
                first, *others = _yaml_lines(item, depth + 1)
                yield f"{pad}- {first.lstrip()}"
                yield from others
            else:
                yield f"{pad}- {_scalar(item)}"


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else json.dumps(value)


def jobset_status(name: str) -> tuple[int, str]:
    """(restarts so far, terminal state: "Completed", "Failed" or "" while running) of the JobSet `name`."""
    command = ["kubectl", "get", "jobset", name, "-o", "jsonpath={.status.restarts} {.status.terminalState}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise JaxtuneError(f"`{shlex.join(command)}` failed: {(result.stderr.strip() or 'no output')[:200]}")
    restarts, _, state = result.stdout.strip().partition(" ")
    return int(restarts or 0), state.strip()


def follow(job: SliceJob, checkpoints: str, poll_seconds: float, out) -> int:
    """Report the JobSet's restarts (each one resumes from `checkpoints`) until it completes (0) or fails."""
    seen = 0
    while True:
        restarts, state = jobset_status(job.name)
        if restarts > seen:
            print(f"# {job.name}: the JobSet restarted its pods ({restarts} of at most {job.max_restarts}); "
                  f"`jaxtune train` resumes from {checkpoints}", file=out, flush=True)
            seen = restarts
        if state == "Completed":
            print(f"# {job.name}: completed", file=out, flush=True)
            return 0
        if state == "Failed":
            raise JaxtuneError(f"JobSet {job.name} failed after {restarts} restart(s) (at most {job.max_restarts}); "
                               f"`kubectl logs -l jobset.sigs.k8s.io/jobset-name={job.name}` says why")
        time.sleep(poll_seconds)


def launch_gke(job: SliceJob, image: str, rest: list[str], *, yaml_path: Path, apply: bool = False,
               compile_first: bool = True, poll_seconds: float = 30.0, out=None) -> int:
    """Check the run, write its ConfigMap and JobSet to `yaml_path`; with `apply`, `kubectl apply` them and follow
    the JobSet through its restarts to the end."""
    out = out if out is not None else sys.stdout
    if apply:
        needs("kubectl", "--apply", "gcloud components install kubectl, then gcloud container clusters "
                                    "get-credentials CLUSTER")
    argv, files, checkpoints = prepared_run(job, rest, CONFIG_DIR, compile_first, out)
    yaml_path.write_text(to_yaml([config_map(job.name, files), jobset(job, image, argv)]))
    print(f"# wrote {yaml_path}: {job.slices} x {job.slice.accelerator} ({job.slice.hosts} pod(s) a slice), "
          f"restarted up to {job.max_restarts} times", file=out, flush=True)
    if not apply:
        print(f"# to run it: kubectl apply -f {shlex.quote(str(yaml_path))}", file=out, flush=True)
        return 0
    command = ["kubectl", "apply", "-f", str(yaml_path)]
    print("+ " + shlex.join(command), file=out, flush=True)
    if subprocess.run(command).returncode != 0:
        raise JaxtuneError(f"`{shlex.join(command)}` failed (its output is above)")
    return follow(job, checkpoints, poll_seconds, out)


def xpk_command(job: SliceJob, image: str, cluster: str, argv: list[str], script_dir: Path,
                project: str | None = None, zone: str | None = None) -> list[str]:
    """`xpk workload create` for the run: xpk layers `script_dir` (the config and local data) on `image` and runs
    `argv` there on every host of every slice (xpk sets the MEGASCALE_* variables itself)."""
    return ["xpk", "workload", "create", f"--cluster={cluster}", f"--workload={job.name}",
            f"--tpu-type={job.gcloud_tpu}", f"--num-slices={job.slices}", f"--base-docker-image={image}",
            f"--script-dir={script_dir}", f"--max-restarts={job.max_restarts}", f"--command={shlex.join(argv)}",
            *([f"--project={project}"] if project else []), *([f"--zone={zone}"] if zone else [])]


def launch_xpk(job: SliceJob, image: str, cluster: str, rest: list[str], *, script_dir: Path,
               project: str | None = None, zone: str | None = None, apply: bool = False, compile_first: bool = True,
               out=None) -> int:
    """Check the run, copy its config and local data to `script_dir`, print the `xpk workload create` command
    and, with `apply`, run it."""
    out = out if out is not None else sys.stdout
    if apply:
        needs("xpk", "--apply", "pip install xpk")
    argv, files, _ = prepared_run(job, rest, ".", compile_first, out)
    script_dir.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        shutil.copyfile(path, script_dir / name)
    command = xpk_command(job, image, cluster, argv, script_dir, project, zone)
    print("+ " + shlex.join(command), file=out, flush=True)
    if apply and subprocess.run(command).returncode != 0:
        raise JaxtuneError(f"`xpk workload create` for {job.name} failed (its output is above)")
    return 0
