"""`jaxtune launch gke`, `launch xpk` and `launch slurm`: the JobSet YAML read back field by field, the xpk command
and the sbatch script (dry runs); applying and submitting against fake kubectl / xpk / sbatch on PATH, the JobSet's
restarts followed to the end; `jax.distributed` joined from SLURM's variables; a preempted pod's `jaxtune train`
resuming as an unbroken run; the compile gate for two slices; one-line errors for bad input."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxtune.cli import main

CONFIG = ('[model]\npath = "/models/llama"\n[data]\ntrain = "{data}"\n[mesh]\ndata = -1\nfsdp = 4\n[train]\n'
          'output_dir = "gs://bucket/run1"\n')
GKE = ["launch", "gke", "--name", "tune", "--tpu", "v5p-64", "--slices", "2", "--image", "gcr.io/p/jaxtune:1",
       "--no-compile-check"]


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.format(data=tmp_path / "train.jsonl"))
    return path


def fake_tool(tmp_path: Path, name: str, body: str) -> Path:
    """An executable `name` in tmp_path/bin that logs its arguments to tmp_path/NAME.log, then runs `body`."""
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/{name}.log\n{body}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool.parent


def test_gke_writes_a_configmap_and_a_jobset_of_one_job_a_slice(config, capsys):
    assert main(GKE + ["--max-restarts", "3", "--", "train", str(config), "--set", "train.epochs=2"]) == 0
    assert "kubectl apply -f tune.yaml" in capsys.readouterr().out
    config_map, jobset = yaml.safe_load_all(Path("tune.yaml").read_text())
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["name"] == "tune-run"
    assert config_map["data"] == {"run.toml": config.read_text(), "train-train.jsonl": (config.parent /
                                                                                       "train.jsonl").read_text()}
    assert (jobset["apiVersion"], jobset["kind"], jobset["metadata"]["name"]) == ("jobset.x-k8s.io/v1alpha2",
                                                                                  "JobSet", "tune")
    assert jobset["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 3}
    [replicated] = jobset["spec"]["replicatedJobs"]
    assert replicated["name"] == "slice" and replicated["replicas"] == 2
    job = replicated["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (8, 8, 0)  # v5p-64: 32 chips, 8 hosts
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x4x4"}
    assert (pod["restartPolicy"], pod["hostNetwork"], pod["dnsPolicy"]) == ("Never", True, "ClusterFirstWithHostNet")
    assert pod["volumes"] == [{"name": "run", "configMap": {"name": "tune-run"}}]
    [container] = pod["containers"]
    assert container["image"] == "gcr.io/p/jaxtune:1"
    assert container["resources"] == {"limits": {"google.com/tpu": 4}}
    assert container["volumeMounts"] == [{"name": "run", "mountPath": "/etc/jaxtune"}]
    assert container["command"] == ["jaxtune", "train", "/etc/jaxtune/run.toml", "--auto-cluster", "--set",
                                    "train.epochs=2", "--set", "mesh.slices=2", "--set",
                                    "data.train=/etc/jaxtune/train-train.jsonl"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env == {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_COORDINATOR_ADDRESS": "tune-slice-0-0.tune",
                   "MEGASCALE_SLICE_ID": {"fieldRef": {
                       "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}}


def test_gke_one_single_host_slice_has_no_megascale_variables(config):
    assert main(["launch", "gke", "--name", "one", "--tpu", "v5litepod-8", "--image", "i", "--no-compile-check",
                 "--out", "one.yml", "--", "train", str(config)]) == 0
    _, jobset = yaml.safe_load_all(Path("one.yml").read_text())
    job = jobset["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 1 and job["template"]["spec"]["parallelism"] == 1
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == 8
    assert "env" not in pod["containers"][0] or not pod["containers"][0]["env"]


def test_gke_apply_follows_the_jobsets_restarts_to_the_end(config, tmp_path, monkeypatch, capsys):
    """A fake kubectl: the JobSet runs, restarts once (a preempted pod), runs, completes. The launcher applies the
    YAML it wrote and reports the restart as a resume from the bucket's checkpoints."""
    (tmp_path / "states").write_text("0 \n1 \n1 Completed\n")
    bin_dir = fake_tool(tmp_path, "kubectl", f'case "$1" in get) head -n1 {tmp_path}/states; '
                                             f'sed -i 1d {tmp_path}/states ;; esac')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert main(GKE + ["--apply", "--poll-seconds", "0", "--", "train", str(config)]) == 0
    calls = (tmp_path / "kubectl.log").read_text().splitlines()
    assert calls == ["apply -f tune.yaml"] + ["get jobset tune -o jsonpath={.status.restarts} "
                                              "{.status.terminalState}"] * 3
    out = capsys.readouterr().out
    assert ("# tune: the JobSet restarted its pods (1 of at most 5); `jaxtune train` resumes from "
            "gs://bucket/run1/checkpoints") in out and out.rstrip().endswith("# tune: completed")

    (tmp_path / "states").write_text("5 Failed\n")
    assert main(GKE + ["--apply", "--poll-seconds", "0", "--", "train", str(config)]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxtune: error: JobSet tune failed after 5 restart(s) (at most 5); `kubectl logs -l "
        "jobset.sigs.k8s.io/jobset-name=tune` says why")


@pytest.mark.parametrize(("flags", "message"), [
    (["--tpu", "v9x-8"], "--tpu 'v9x-8': expected TYPE-SIZE with TYPE one of v4, v5e, v5p, v6e (e.g. v5p-64, v6e-16)"),
    (["--tpu", "v5p-12"], "--tpu v5p-12: Cloud TPU makes no v5p slice of 6 chips; slices: v5p-8, v5p-16"),
    (["--slices", "0"], "--slices 0: a run takes 1 or more slices"),
    (["--name", "Tune_1"], "--name 'Tune_1': a JobSet name is lowercase letters, digits and '-'"),
    (["--set", "mesh.data=1"], "--set mesh.data=1: the data axis spans the 2 slices, so it is a multiple of slices"),
    (["--set", "mesh.slices=4", "--set", "mesh.data=4"], "--slices 2, but run.toml says [mesh] slices = 4"),
    (["--set", "train.output_dir=runs/a"], "a GKE run needs train.output_dir on gs:// (pods' disks do not outlive a "
                                           "restart, so nothing could resume), got 'runs/a'"),
    (["--apply"], "--apply runs `kubectl`, which is not on PATH (gcloud components install kubectl"),
])
def test_gke_bad_input_is_one_line(config, monkeypatch, capsys, flags, message):
    monkeypatch.setenv("PATH", "/nonexistent")
    overrides = [f for f in flags if f == "--set" or "=" in f]
    given = [f for f in flags if f not in overrides]
    assert main([*GKE, *given, "--", "train", config.name, *overrides]) == 2  # the fixture works in its folder
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not Path("tune.yaml").exists()


def test_xpk_writes_its_script_dir_and_runs_workload_create(config, tmp_path, monkeypatch, capsys):
    bin_dir = fake_tool(tmp_path, "xpk", f"printf '%s\\n' \"$@\" > {tmp_path}/xpk.args")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert main(["launch", "xpk", "--name", "tune", "--tpu", "v5e-16", "--slices", "4", "--image", "img",
                 "--cluster", "c1", "--zone", "us-east5-b", "--max-restarts", "2", "--no-compile-check", "--apply",
                 "--", "train", str(config), "--set", "mesh.fsdp=16"]) == 0
    assert sorted(p.name for p in (tmp_path / "tune-xpk").iterdir()) == ["run.toml", "train-train.jsonl"]
    argv = (tmp_path / "xpk.args").read_text().splitlines()
    assert argv[:2] == ["workload", "create"]
    assert argv[2:10] == ["--cluster=c1", "--workload=tune", "--tpu-type=v5litepod-16", "--num-slices=4",
                          "--base-docker-image=img", "--script-dir=tune-xpk", "--max-restarts=2",
                          "--command=jaxtune train ./run.toml --auto-cluster --set mesh.fsdp=16 --set mesh.slices=4 "
                          "--set data.train=./train-train.jsonl"]
    assert argv[10:] == ["--zone=us-east5-b"]
    assert "+ xpk workload create --cluster=c1" in capsys.readouterr().out


def test_slurm_writes_an_sbatch_script_of_one_process_a_gpu_and_submits_it(config, tmp_path, monkeypatch, capsys):
    args = ["launch", "slurm", "--name", "tune", "--nodes", "2", "--gpus-per-node", "8", "--partition", "a3",
            "--time", "24:00:00"]
    run = ["--", "train", str(config), "--set", "train.epochs=2"]
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(args + ["--submit"] + run) == 2
    assert "--submit runs `sbatch`, which is not on PATH" in capsys.readouterr().err
    assert main(args + run) == 0
    script = Path("tune.sbatch").read_text().splitlines()
    assert script[0] == "#!/bin/bash"
    assert [line for line in script if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=tune", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=a3", "#SBATCH --time=24:00:00", "#SBATCH --signal=TERM@120",
        "#SBATCH --output=tune-%j.out", "#SBATCH --exclusive", "#SBATCH --requeue"]
    assert script[-1] == f"srun --kill-on-bad-exit=1 jaxtune train {config} --auto-cluster --set train.epochs=2"
    monkeypatch.setenv("PATH", f"{fake_tool(tmp_path, 'sbatch', 'echo Submitted batch job 7')}:/usr/bin:/bin")
    assert main(args + ["--submit"] + run) == 0
    assert (tmp_path / "sbatch.log").read_text() == "tune.sbatch\n"
    assert "+ sbatch tune.sbatch" in capsys.readouterr().out
    assert main(["launch", "slurm", "--name", "t", "--nodes", "0", "--gpus-per-node", "8", "--", "train",
                 str(config)]) == 2
    assert capsys.readouterr().err.strip() == "jaxtune: error: --nodes 0: a job takes 1 or more nodes"


JOIN = """
from jaxtune.parallel.distributed import ClusterConfig, join_cluster
import jax
join_cluster(ClusterConfig(auto=True))
print(jax.process_count(), jax.process_index(), jax.device_count())
"""


def slurm_job_id() -> int:
    """A job id whose coordinator port (JAX: 61440 + id mod 4096) is free here."""
    for job_id in range(1000 + os.getpid() % 3000, 4096 * 8):
        with socket.socket() as s:
            try:
                s.bind(("localhost", 61440 + job_id % 4096))
                return job_id
            except OSError:
                continue
    raise RuntimeError("no free port")


def test_jax_reads_the_cluster_from_the_variables_srun_sets(monkeypatch):
    """What `jax.distributed.initialize()` (jaxtune train --auto-cluster) finds on srun's second task of two: the
    coordinator on the job's first node at JAX's port for the job id, 2 processes, this one 1, its own GPU."""
    from jax._src import clusters

    for name, value in (("SLURM_JOB_ID", "4242"), ("SLURM_STEP_NODELIST", "gpu[017-018]"), ("SLURM_NTASKS", "2"),
                        ("SLURM_PROCID", "1"), ("SLURM_LOCALID", "1")):
        monkeypatch.setenv(name, value)
    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, None)
    assert found == ("gpu017:" + str(61440 + 4242 % 4096), 2, 1, [1])


@pytest.mark.full
@pytest.mark.slow
def test_two_processes_join_one_cluster_from_slurms_variables(tmp_path):
    """What `srun jaxtune train --auto-cluster` does on each task: `join_cluster(auto)` finds the coordinator, the
    process count and its own id in SLURM's variables (JAX's cluster detection), as srun sets them."""
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "SLURM_JOB_ID": str(slurm_job_id()),
            "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2", "PYTHONPATH": str(Path(__file__).parents[1])}
    processes = [subprocess.Popen([sys.executable, "-c", JOIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**base, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
                 for i in range(2)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert sorted(out.split()[:3] for out, _ in outputs) == [["2", "0", "2"], ["2", "1", "2"]]


@pytest.mark.full
@pytest.mark.slow
def test_a_restarted_pod_resumes_from_the_checkpoint_as_an_unbroken_run(tmp_path, monkeypatch):
    """The pods' command from the JobSet, run here (the ConfigMap's files in place of /etc/jaxtune, the output on a
    local directory instead of gs://): stopped by SIGTERM (a preemption) after its first checkpoint, then run again
    unchanged, as the JobSet's restart does; its metrics equal an uninterrupted run's."""
    from jaxtune.presets import write_random_model

    monkeypatch.chdir(tmp_path)
    model = write_random_model(tmp_path / "model", "llama", hidden_size=16, intermediate_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=8)
    rows = "".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(24))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{model}"\n[data]\ntrain = "{tmp_path}/train.jsonl"\nmax_seq_len = 32\n[method]\n'
        'kind = "lora"\n[train]\noutput_dir = "gs://bucket/run"\nbatch_size = 2\nmax_steps = 12\n'
        'learning_rate = 1e-2\nlog_every = 1\n')
    assert main(["launch", "gke", "--name", "tune", "--tpu", "v5e-4", "--image", "i", "--no-compile-check", "--",
                 "train", "run.toml"]) == 0
    config_map, jobset = yaml.safe_load_all(Path("tune.yaml").read_text())
    mounted = tmp_path / "etc-jaxtune"
    mounted.mkdir()
    for name, text in config_map["data"].items():
        (mounted / name).write_text(text)
    command = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    command = [a.replace("/etc/jaxtune", str(mounted)) for a in command]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[1])}

    def pod(output_dir: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "jaxtune.cli", *command[1:3], "--set", f"train.output_dir={output_dir}"]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    assert pod("unbroken").wait(timeout=600) == 0
    first = pod("preempted")
    assert first.stdout is not None
    for line in first.stdout:  # the steps begin: preempt it (it checkpoints the step it is on and stops)
        if line.startswith("training"):
            first.send_signal(signal.SIGTERM)
            break
    assert first.wait(timeout=300) == 143
    restarted = pod("preempted")
    said = restarted.communicate(timeout=600)[0]
    assert restarted.returncode == 0 and "resumed from step" in said, said

    def losses(run: str) -> list:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]

    assert losses("preempted") == losses("unbroken") and len(losses("unbroken")) == 12


@pytest.mark.full
@pytest.mark.slow
def test_the_compile_gate_compiles_the_step_for_two_slices_before_writing_anything(tmp_path, monkeypatch):
    """`launch gke --slices 2` compiles the run's step with the TPU compiler for two v5e-4 slices over DCN (libtpu's
    multi-slice topology, the hybrid mesh), then writes the JobSet."""
    from jaxtune.presets import write_random_model

    monkeypatch.chdir(tmp_path)
    model = write_random_model(tmp_path / "model", "llama", hidden_size=64, intermediate_size=128, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=16)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{model}"\n[data]\ntrain = "{tmp_path}/train.jsonl"\nmax_seq_len = 256\n[mesh]\n'
        'data = 2\nfsdp = -1\n[train]\noutput_dir = "gs://bucket/run"\nbatch_size = 8\n')
    launch = [sys.executable, "-m", "jaxtune.cli", "launch", "gke", "--name", "t", "--tpu", "v5e-4", "--slices", "2",
              "--image", "i", "--", "train", "run.toml"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    result = subprocess.run(launch, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    verdict = result.stdout.splitlines()[0]
    assert verdict.startswith("# the step compiled for v5e:2x2, 4 chips on 1 host, x 2 slices over DCN needs ")
    assert verdict.endswith(": fits") and Path("t.yaml").exists()
