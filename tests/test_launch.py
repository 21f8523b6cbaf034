"""`jaxtune launch tpu`: the gcloud commands (dry run) and the preemption loop (against a fake gcloud)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtune.cli import main

CONFIG = '[model]\npath = "/models/llama"\n[data]\ntrain = "{data}"\n[train]\noutput_dir = "gs://bucket/run1"\n'


@pytest.fixture
def config(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.format(data=tmp_path / "train.jsonl"))
    return path


def test_dry_run_prints_every_command(config, capsys):
    assert main(["launch", "tpu", "--name", "tune", "--zone", "us-east5-b", "--accelerator", "v5p-32", "--project",
                 "proj", "--spot", "--dry-run", "--no-compile-check", "--", "train", str(config), "--set",
                 "train.epochs=2"]) == 0
    out = capsys.readouterr().out
    commands = [line[2:] for line in out.splitlines() if line.startswith("+ ")]
    assert commands[0].startswith("gcloud compute tpus tpu-vm describe tune --zone=us-east5-b --project=proj")
    assert commands[1] == ("gcloud compute tpus tpu-vm create tune --accelerator-type=v5p-32 --version=v2-alpha-tpuv5 "
                           "--zone=us-east5-b --project=proj --spot")
    assert "tpu-vm scp" in commands[2] and "--worker=all" in commands[2]
    assert all("--worker=all" in c for c in commands[3:])
    assert "pip install -q 'jax[tpu]' 'etils[epath-gcs]' ./jaxtune" in commands[4].replace("'\"'\"'", "'")
    assert ("jaxtune.cli train config/run.toml --auto-cluster --set train.epochs=2 "
            "--set data.train=data/train-train.jsonl") in commands[5]
    assert "resume point: gs://bucket/run1/checkpoints" in out


def test_spot_needs_a_durable_output_dir(config, capsys):
    config.write_text(config.read_text().replace("gs://bucket/run1", "runs/local"))
    assert main(["launch", "tpu", "--name", "t", "--zone", "z", "--accelerator", "v5e-8", "--spot", "--dry-run",
                 "--no-compile-check", "--", "train", str(config)]) == 2
    assert "--spot needs train.output_dir on gs://" in capsys.readouterr().err


def test_unknown_accelerator_is_named(config, capsys):
    assert main(["launch", "tpu", "--name", "t", "--zone", "z", "--accelerator", "v9x-8", "--dry-run", "--", "train",
                 str(config)]) == 2
    assert "--accelerator 'v9x-8'" in capsys.readouterr().err


def test_preemption_recreates_the_vm_and_reruns_the_same_train_command(config, tmp_path):
    """A fake gcloud: the first training ssh dies and the VM reports PREEMPTED; the launcher deletes, re-creates,
    re-ships and runs the identical train command, which (being `jaxtune train`) resumes from the checkpoints."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {log}
state_file={tmp_path}/state
case "$*" in
  *describe*) if [ -f $state_file ]; then cat $state_file; else exit 1; fi ;;
  *" create "*) echo READY > $state_file ;;
  *" delete "*) rm -f $state_file ;;
  *"jaxtune.cli train"*)
    if [ ! -f {tmp_path}/preempted ]; then touch {tmp_path}/preempted; echo PREEMPTED > $state_file; exit 255; fi ;;
esac
exit 0
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "jaxtune.cli", "launch", "tpu", "--name", "t", "--zone", "z",
                             "--accelerator", "v6e-8", "--spot", "--no-compile-check", "--", "train", str(config)],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    verbs = [next(w for w in ("describe", "create", "delete", "scp", "train", "install", "tar") if w in c.replace(
        "pip install", "install")) for c in calls]
    assert verbs == ["describe", "create", "scp", "tar", "install", "train", "describe", "describe", "delete", "create",
                     "scp", "tar", "install", "train"]
    train_calls = [c for c in calls if "jaxtune.cli train" in c]
    assert len(train_calls) == 2 and train_calls[0] == train_calls[1]
    assert "re-creating it; `jaxtune train` resumes from gs://bucket/run1/checkpoints" in result.stdout


def test_gs_output_keeps_checkpoints_in_the_bucket_and_the_rest_local():
    """What makes a re-created VM resume: the checkpoints (orbax, straight to Cloud Storage) outlive it."""
    from jaxtune.train.outputs import run_directories

    assert run_directories("gs://bucket/runs/a/") == (Path("runs/bucket/runs/a"), "gs://bucket/runs/a/checkpoints")
    assert run_directories("out/run") == (Path("out/run"), Path("out/run/checkpoints"))
