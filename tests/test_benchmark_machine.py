"""benchmarks/train_throughput.py keeps machines apart: every result carries its CPU and its kind (vendor, widest
vector ISA, AMX, XLA's ISA cap), and the table has one section per kind, ratios taken within it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "train_throughput.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("train_throughput", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_machine_kinds():
    tt = _benchmark()
    sapphire = {"vendor": "GenuineIntel", "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]}
    assert tt.machine_kind(sapphire) == "GenuineIntel AVX-512+AMX"
    assert tt.machine_kind({**sapphire, "xla_max_isa": "AVX2"}) == "GenuineIntel AVX-512+AMX, capped at AVX2"
    assert tt.machine_kind({"vendor": "AuthenticAMD", "isa": ["avx2", "avx512f", "avx512_bf16"]}) == \
        "AuthenticAMD AVX-512+BF16"
    assert tt.machine_kind({"vendor": "AuthenticAMD", "isa": ["avx2"]}) == "AuthenticAMD AVX2"
    old = {"cpu_count": 2, "processor": "", "xla_flags": "--xla_cpu_max_isa=avx2"}  # saved before CPUs were recorded
    assert tt.machine_kind(old, "a.json") == "CPU not recorded (a.json), capped at AVX2"
    here = tt.machine()
    assert here["cpu_model"] and set(here["isa"]) <= set(tt.ISA)


def _record(kind: str, framework: str, tokens_per_s: float) -> dict:
    return {"framework": framework, "config": "lora_qv", "variant": "sdpa" if framework == "torch" else "jaxtune",
            "machine_kind": kind, "machine": {"cpu_model": kind + " model", "cpu_count": 2},
            "tokens_per_s": tokens_per_s, "step_s_median": 1024 / tokens_per_s, "compile_s": 1.0,
            "peak_rss_mib": 900.0, "baseline_rss_mib": 500.0, "train_peak_rss_mib": 900.0, "cpu_s_per_step": 2.0,
            "other_load_cores": 0.0}


def test_one_table_per_machine_kind():
    tt = _benchmark()
    records = tt.aggregate([_record("intel", "jax", 800.0), _record("intel", "torch", 1000.0),
                            _record("amd", "jax", 1000.0), _record("amd", "torch", 1000.0)])
    text = tt.tables(records)
    intel, amd = text.split("### ")[1:]
    assert intel.startswith("intel: intel model, 2 cores") and amd.startswith("amd: amd model, 2 cores")
    jax_row = {name: next(line for line in section.splitlines() if "| jaxtune |" in line)
               for name, section in (("intel", intel), ("amd", amd))}
    assert jax_row["intel"].endswith("| 0.80 |") and "0.80x (target >= 1.2x)" in intel
    assert jax_row["amd"].endswith("| 1.00 |") and "1.00x (target >= 1.2x)" in amd


def test_every_configuration_builds_its_method():
    """Each configuration's method options are ones its kind reads (a full fine-tune takes no rank)."""
    import sys

    sys.path.insert(0, str(BENCHMARK.parent))
    import _measure

    for name, (kind, targets) in _measure.METHODS.items():
        method = _measure.method(name)
        assert method.kind == kind and set(targets) <= set(getattr(method, "target_modules", ()))
