"""benchmarks/device_run.py, the GPU benchmark, run here as its `--dry-run` (CPU, tiny shapes): its flow, its JSON's
fields and its table. The everyday tier checks the table and the budget; the full tier measures one jaxtune
configuration in this process and runs the script itself, each worker its own process, PyTorch+PEFT's and TRL's side
included."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_run.py"
MEASURED = ("tokens_per_s", "step_s_median", "compile_s", "mfu", "model_flops", "peak_bytes", "planned_peak_bytes",
            "attention_kernel", "loss_first", "loss_last")


def _script():
    spec = importlib.util.spec_from_file_location("device_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_report(report: dict, measured: set[str]) -> None:
    assert report["dry_run"] and report["machine"]["python"] and report["machine"]["jax"]
    assert report["peak_bf16_flops"] > 0 and "6 N per token" in report["flops"]
    assert report["shapes"]["tiny"]["hidden_size"] == 64 and report["shapes"]["tiny"]["num_layers"] == 2
    assert {r["name"] for r in report["results"]} == measured
    for r in report["results"]:
        if r["framework"] == "jax":
            assert set(MEASURED) <= set(r) and r["tokens_per_s"] > 0 and r["compile_s"] > 0
            assert r["planned_peak_bytes"] > 0 and r["peak_bytes"] is None  # a CPU keeps no device high-water mark


@pytest.mark.full
def test_dry_run_of_one_configuration(tmp_path, monkeypatch):
    """The runner's flow with one jaxtune worker measured in this process (the full tier spawns them)."""
    run = _script()
    monkeypatch.setattr(run, "spawn", lambda name, dry_run, device, timeout_s: {**run.describe(name),
                                                                                  **run.run_worker(name, run.DRY_RUN)})
    output = tmp_path / "run.json"
    run.main(["--dry-run", "--only", "jax:tiny:lora", "--no-torch", "--output", str(output)])
    report = json.loads(output.read_text())
    _check_report(report, {"jax:tiny:lora"})
    row = report["results"][0]
    assert row["mfu"] == pytest.approx(row["model_flops"] / row["step_s_median"] / report["peak_bf16_flops"])
    assert "| tiny LoRA (all-linear) | jaxtune (blockwise) |" in run.table(report["results"], True)


def test_budget_spent(tmp_path):
    """A run whose budget is spent starts no worker and names every one it skipped; the JSON is written."""
    run = _script()
    output = tmp_path / "run.json"
    run.main(["--dry-run", "--only", "tiny:lora,tiny:layer", "--budget-s", "0", "--output", str(output)])
    report = json.loads(output.read_text())
    _check_report(report, set())
    assert [s.split(": ")[0] for s in report["skipped"]] == [
        "jax:tiny:lora", "torch:tiny:lora", "attention:tiny:layer:cudnn", "attention:tiny:layer:blockwise"]


def test_table_compares_frameworks_and_kernels():
    run = _script()
    row = dict(compile_s=2.0, step_s_median=0.5, mfu=0.4, peak_bytes=2**31)
    results = [{**run.describe("jax:1b:lora"), **row, "tokens_per_s": 3000.0, "attention_kernel": "blockwise",
                "planned_peak_bytes": 2**32},
               {**run.describe("torch:1b:lora"), **row, "tokens_per_s": 1500.0, "compile_s": None},
               {**run.describe("attention:1b:layer:cudnn"), "step_s_median": 0.001, "implementation": "cudnn"},
               {**run.describe("attention:1b:layer:blockwise"), "step_s_median": 0.003,
                "implementation": "blockwise"},
               {**run.describe("torch:1b:qlora"), "unavailable": "bitsandbytes: No module named 'bitsandbytes'"}]
    text = run.table(results, False)
    assert "| 1b LoRA (all-linear) | jaxtune (blockwise) | 3000 | 500.0 | 2.0 | 40.0% | 2.00 | 4.00 | 0.50 | " \
           "2.00x |" in text
    assert "| 1b LoRA (all-linear) | PyTorch+PEFT | 1500 | 500.0 | — | 40.0% | 2.00 | 4.00 | 0.50 |  |" in text
    assert "n/a (bitsandbytes: No module named 'bitsandbytes')" in text
    assert "cuDNN (cudnn) 1.00 ms, blockwise 3.00 ms: cuDNN 3.00x as fast" in text and "Dry run" not in text


@pytest.mark.full
@pytest.mark.reference
def test_dry_run_with_torch(tmp_path):
    """The script as the GPU machine runs it, on this CPU: LoRA, DPO and the attention kernels, each worker its own
    process, against PyTorch+PEFT and TRL's DPO loss."""
    output = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "tiny:lora,tiny:dpo_lora,tiny:layer",
                           "--output", str(output)], capture_output=True, text=True, check=True)
    report = json.loads(output.read_text())
    _check_report(report, {"jax:tiny:lora", "torch:tiny:lora", "attention:tiny:layer:cudnn",
                           "attention:tiny:layer:blockwise", "jax:tiny:dpo_lora", "torch:tiny:dpo_lora"})
    torch_rows = [r for r in report["results"] if r["framework"] == "torch"]
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] is None for r in torch_rows)
    assert "**Dry run**" in proc.stdout and "| tiny DPO (LoRA) | PyTorch+PEFT |" in proc.stdout
    assert "cuDNN (xla)" in proc.stdout  # off a GPU, cuDNN's call with XLA's implementation
