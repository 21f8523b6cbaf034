"""Memory while loading: does a big checkpoint go straight into its final shards and formats?

    python benchmarks/load_memory.py            # ~15 min on 2 cores; writes benchmarks/results/load_memory.json
    python benchmarks/load_memory.py lora_fsdp8 # only the named runs; the other rows of the results file are kept

A random Llama of 607M parameters stored in bfloat16 (S = the bytes of its safetensors, 1.13 GiB) is trained for
two steps with `jaxtune train` in a subprocess; its peak resident set (ru_maxrss) minus that of the same command on
the tiny demo model is reported in units of S, beside the planner's prediction for the same run config (`jaxtune
plan --config`, which says whether loading or the step peaks higher). Runs, with bfloat16 compute (QLoRA's
`bnb_4bit_compute_dtype`) unless named `_f32`:

    qlora           NF4 with double quantisation on one device, LoRA rank 8 on q, v
    qlora_all_r16   the same with LoRA rank 16 on every linear layer
    lora_fsdp8      LoRA rank 8 on q, v with fsdp=8 on 8 fake CPU devices (which share this host's memory)
    qlora_f32       qlora with float32 compute, the CPU default (frozen bfloat16 and NF4 weights, float32 products)
    lora_fsdp8_f32  lora_fsdp8 with float32 compute

Before the spine, the same runs peaked at 3.08 S (QLoRA: the whole float model, then its quantised copy) and 8.04 S
(fsdp=8: every device got the whole model, then its shard).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.io.safetensors import write_weights
from jaxtune.models.hf_config import config_to_hf
from jaxtune.models.hf_weights import expected_tensors
from jaxtune.presets import write_random_model

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "jaxtune" / "assets" / "demo_instructions.jsonl"
BIG = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=12, num_heads=16,
                  num_kv_heads=4, head_dim=128, tie_word_embeddings=True, max_position_embeddings=2048)
RUNS = {  # name: (method and mesh sections, devices, compute dtype)
    "qlora": ('[method]\nkind = "qlora"\n', 1, "bfloat16"),
    "qlora_all_r16": ('[method]\nkind = "qlora"\nrank = 16\ntarget_modules = ["all-linear"]\n', 1, "bfloat16"),
    "lora_fsdp8": ('[method]\nkind = "lora"\n[mesh]\nfsdp = 8\n', 8, "bfloat16"),
    "qlora_f32": ('[method]\nkind = "qlora"\n', 1, "float32"),
    "lora_fsdp8_f32": ('[method]\nkind = "lora"\n[mesh]\nfsdp = 8\n', 8, "float32"),
}


def write_big_model(directory: Path, cfg: ModelConfig) -> int:
    """A random bfloat16 checkpoint of `cfg`, written tensor by tensor; returns its bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    entries = [(name, shape, np.dtype(ml_dtypes.bfloat16),
                lambda shape=shape: (rng.standard_normal(shape, np.float32) * (0.02 if len(shape) > 1 else 1.0)
                                     + (len(shape) == 1)).astype(ml_dtypes.bfloat16))
               for name, shape in expected_tensors(cfg).items()]
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg, "bfloat16")))
    write_weights(directory, entries)
    Tokenizer.byte_level().save(directory)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


TRAIN = "from jaxtune.cli import main; main(['train', CONFIG])"
LOAD = ("from jaxtune.run_config import load_run_config; from jaxtune.train.loop import start_run; "
        "task = start_run(load_run_config(CONFIG), print); import jax; jax.block_until_ready(task.state)")


def peak_rss(config: Path, devices: int, program: str = TRAIN) -> int:
    """Peak resident set of `program` (`jaxtune train CONFIG`, or only its loading: `start_run`, which reads the
    weights into the run's arrays) in a fresh process without a compilation cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(p.returncode)")
    child = f"CONFIG = {str(config)!r}; {program}"
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-c", child], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])
    return int(out.stdout.strip().splitlines()[-1])


def planned(config: Path, devices: int) -> dict:
    target = "cpu" if devices == 1 else f"cpu-{devices}"
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "plan", "--config", str(config), "--target", target,
                          "--json"], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout)


def run_config(path: Path, model: Path, method: str, out: Path, devices: int, compute: str) -> Path:
    batch = max(2, devices)  # one row a device at least
    path.write_text(f'[model]\npath = "{model}"\ncompute_dtype = "{compute}"\nremat = "full"\n{method}'
                    f'[data]\ntrain = "{DATA}"\nmax_seq_len = 128\neval_fraction = 0.02\n'
                    f'[train]\noutput_dir = "{out}"\nbatch_size = {batch}\nmax_steps = 2\n')
    return path


def cpu_model() -> str:
    """The CPU the row was measured on (/proc/cpuinfo's model name and whether it has AMX), for the record."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return name + (" (AMX)" if " amx_bf16" in info else "")


def main(names: list[str]) -> None:
    out = ROOT / "benchmarks" / "results" / "load_memory.json"
    unknown = set(names) - set(RUNS)
    if unknown:
        raise SystemExit(f"unknown runs {sorted(unknown)}; known: {sorted(RUNS)}")
    kept = [row for row in json.loads(out.read_text())["rows"] if row["run"] not in names] if names else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = write_big_model(tmp / "big", BIG)
        write_random_model(tmp / "tiny", "llama")
        parameters = sum(math.prod(shape) for shape in expected_tensors(BIG).values())
        print(f"checkpoint: {parameters / 1e6:.0f}M parameters, S = {size / MiB:.0f} MiB", flush=True)
        for name, (method, devices, compute) in RUNS.items():
            if names and name not in names:
                continue
            tiny_config = run_config(tmp / f"tiny_{name}.toml", tmp / "tiny", method, tmp / f"tiny_{name}", devices,
                                     compute)
            config = run_config(tmp / f"{name}.toml", tmp / "big", method, tmp / name, devices, compute)
            peaks = {phase: (peak_rss(config, devices, program), peak_rss(tiny_config, devices, program))
                     for phase, program in (("train", TRAIN), ("load", LOAD))}
            plan = planned(config, devices)
            reserve, transient = plan["per_device"]["reserve_bytes"], plan["loading"]["transient_bytes"]
            row = {"run": name, "devices": devices, "compute_dtype": compute, "cpu": cpu_model(),
                   "checkpoint_bytes": size,
                   **{f"{phase}_peak_rss_bytes": big for phase, (big, _) in peaks.items()},
                   **{f"{phase}_tiny_peak_rss_bytes": tiny for phase, (_, tiny) in peaks.items()},
                   **{f"{phase}_over_tiny_in_S": (big - tiny) / size for phase, (big, tiny) in peaks.items()},
                   # one process: the runtime reserve once, each device's arrays and step transients; loading's
                   # read buffers once too, since the process reads one leaf at a time for all its devices
                   "plan_step_bytes": (plan["per_device"]["total_bytes"] - reserve) * devices + reserve,
                   "plan_loading_bytes": (plan["loading"]["total_bytes"] - reserve - transient) * devices
                                         + transient + reserve}
            row["plan_peak"] = "loading" if row["plan_loading_bytes"] > row["plan_step_bytes"] else "step"
            rows.append(row)
            print(f"{name:14s} train: peak RSS {peaks['train'][0] / MiB:6.0f} MiB "
                  f"(tiny {peaks['train'][1] / MiB:4.0f}): "
                  f"{row['train_over_tiny_in_S']:.2f} S; loading only: {peaks['load'][0] / MiB:6.0f} MiB (tiny "
                  f"{peaks['load'][1] / MiB:4.0f}): {row['load_over_tiny_in_S']:.2f} S; plan (all devices, one runtime "
                  f"reserve): step {row['plan_step_bytes'] / MiB:.0f} MiB, loading "
                  f"{row['plan_loading_bytes'] / MiB:.0f} MiB, {row['plan_peak']} peaks", flush=True)
    rows = sorted(kept + rows, key=lambda row: list(RUNS).index(row["run"]))
    out.write_text(json.dumps({"model": BIG.__dict__ | {"rope_scaling": None}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
