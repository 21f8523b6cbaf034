"""Multi-process training: two local `jaxtune train` processes joined by `jax.distributed` (gloo CPU collectives on
127.0.0.1) train the tiny model as one program and match a single-process run. They run as users run them: the CLI
with no JAX_PLATFORMS, so where libtpu is installed (the full tier's install) JAX looks for a TPU first, and the
cluster must be joined before anything touches a backend."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from eight_devices import UNOPTIMISED
from safetensors.numpy import load_file

from jaxtune.errors import JaxtuneError
from jaxtune.parallel.distributed import ClusterConfig, cluster_from_env
from jaxtune.presets import write_random_model
from jaxtune.train.metrics import WALL_CLOCK_FIELDS

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(config: Path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=1{UNOPTIMISED}", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "jaxtune.cli", "train", str(config), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out[-3000:]
    return out


def records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_FIELDS} for line in lines]


@pytest.mark.slow
def test_two_processes_train_as_one_and_match_a_single_process(tmp_path):
    model = write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.1)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))

    def config(name: str) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(f'[model]\npath = "{model}"\n[method]\nkind = "full"\n[data]\ntrain = "{data}"\n'
                        'max_seq_len = 96\neval_fraction = 0.2\n[train]\n'
                        f'output_dir = "{tmp_path / name}"\nmax_steps = 4\nbatch_size = 4\nlearning_rate = 1e-3\n'
                        'log_every = 1\neval_every = 2\ncheckpoint_every = 2\n')
        return path

    single = train(config("single"))
    port = free_port()
    cluster = [train(config("pair"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                     "--process-id", str(i)) for i in range(2)]
    finish(single)
    outputs = [finish(p) for p in cluster]
    assert "process 0 of 2" in outputs[0] and "process 1 of 2" in outputs[1]
    assert "2 devices" in outputs[0]
    assert "result in " in outputs[0] and "process 1: process 0 writes the result" in outputs[1]
    assert "result in None" not in outputs[1]

    one, two = records(tmp_path / "single"), records(tmp_path / "pair")
    assert [sorted(r) for r in one] == [sorted(r) for r in two]  # written once, by process 0 only
    assert sum("loss" in r for r in two) == 4 and sum("eval_loss" in r for r in two) == 3
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"{key} at step {a['step']}")
    assert sorted(p.name for p in (tmp_path / "pair" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]

    # the exported model: the shards of both processes gathered into one HF checkpoint, equal to the single run's
    w1 = load_file(tmp_path / "single" / "model" / "model.safetensors")
    w2 = load_file(tmp_path / "pair" / "model" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for key in w1:  # the gradient sums' order differs across two processes: seen 2.5e-6 apart on AMD Zen 3
        np.testing.assert_allclose(w2[key], w1[key], rtol=0, atol=1e-5, err_msg=key)

    # both processes restore the step-2 checkpoint collectively and replay steps 3-4 exactly
    port = free_port()
    again = [train(config("pair"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(i), "--set", "train.resume_step=2") for i in range(2)]
    assert all("resumed from step 2" in finish(p) for p in again)
    assert records(tmp_path / "pair") == two


def test_cluster_settings_from_flags_and_environment(monkeypatch):
    assert not cluster_from_env().multi_process
    monkeypatch.setenv("JAXTUNE_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("JAXTUNE_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXTUNE_PROCESS_ID", "3")
    assert cluster_from_env() == ClusterConfig("10.0.0.1:1234", 4, 3)
    assert cluster_from_env(process_id=1).process_id == 1  # a flag wins over the environment
    with pytest.raises(JaxtuneError, match="process id 4 is not in 0..3"):
        cluster_from_env(process_id=4)
    monkeypatch.setenv("JAXTUNE_PROCESS_ID", "one")
    with pytest.raises(JaxtuneError, match="JAXTUNE_PROCESS_ID='one' is not an integer"):
        cluster_from_env()
    monkeypatch.delenv("JAXTUNE_PROCESS_ID")
    with pytest.raises(JaxtuneError, match="needs this process's id"):
        cluster_from_env()


@pytest.mark.slow
@pytest.mark.full
def test_two_processes_each_read_about_half_of_the_checkpoint(tmp_path):
    """Two processes on fsdp=2 (one CPU device each) read only the slices their device holds: about half of the
    checkpoint's tensor bytes each, all of it together; the weights they assemble are the checkpoint's."""
    model = write_random_model(tmp_path / "model", "llama", seed=0)
    port = free_port()
    worker = Path(__file__).with_name("load_worker.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count=1{UNOPTIMISED}"}
    processes = [subprocess.Popen([sys.executable, str(worker), f"127.0.0.1:{port}", "2", str(i), str(model)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    outs = [json.loads(finish(p).strip().splitlines()[-1]) for p in processes]
    tensors = load_file(str(model / "model.safetensors"))
    data = sum(v.nbytes for v in tensors.values())
    for out in outs:
        assert 0.4 * data < out["bytes_read"] < 0.6 * data, (out, data)
    assert sum(out["bytes_read"] for out in outs) < 1.05 * data
    expected = sum(float(np.abs(v.astype(np.float64)).sum()) for v in tensors.values())
    assert outs[0]["params_sum"] == outs[1]["params_sum"] == pytest.approx(expected, rel=1e-6)
