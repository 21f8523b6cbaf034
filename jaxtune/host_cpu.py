"""This host's CPU: whether XLA:CPU multiplies bfloat16 natively here, and one warning when bfloat16 compute is slow.

With bfloat16 dot-product instructions (x86 AVX512_BF16 or AMX-BF16, Arm BF16) XLA:CPU multiplies bfloat16 faster
than float32; without them every bfloat16 operand is widened to float32 and the result rounded back, slower than
float32 (benchmarks/train_throughput.py, `--only lora_qv_bf16`). `native_bf16` reads /proc/cpuinfo (Linux; elsewhere
the CPU counts as not native) less what `XLA_FLAGS=--xla_cpu_max_isa=...` forbids; it takes both texts as arguments
so tests can fix them. The planner's `cpu` target (`planner/devices.cpu_device`) and `warn_if_slow_bf16` (the
trainer's one warning a process) both ask it.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from pathlib import Path

import jax

from jaxtune.errors import JaxtuneWarning

CPUINFO = Path("/proc/cpuinfo")
# --xla_cpu_max_isa values that turn the instructions off: XLA:CPU disables every feature newer than the cap
# (xla/backends/cpu/codegen/cpu_features.cc, ShouldEnableX86CpuFeature); the Arm caps (NEON, SVE, SVE2) keep BF16
CAPS_WITHOUT_AVX512_BF16 = frozenset({"SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_VNNI"})
CAPS_WITHOUT_AMX = CAPS_WITHOUT_AVX512_BF16 | {"AVX512_BF16"}
SLOW_BF16 = ("bfloat16 compute on a CPU without native bfloat16 dot products (no AVX512_BF16/AMX) runs at about half "
             'the float32 speed; compute_dtype = "float32" is faster here')


class SlowBfloat16Warning(JaxtuneWarning):
    """bfloat16 compute asked for on a CPU backend that widens every bfloat16 dot to float32."""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in /proc/cpuinfo text: x86 `flags` lines and Arm `Features` lines, all cores together."""
    return frozenset(word for line in cpuinfo.splitlines() if line.partition(":")[0].strip() in ("flags", "Features")
                     for word in line.partition(":")[2].split())


def max_isa(xla_flags: str) -> str | None:
    """The `--xla_cpu_max_isa` of an XLA_FLAGS string (the last one given), upper-case as XLA reads it; else None."""
    values = re.findall(r"--xla_cpu_max_isa=(\S+)", xla_flags)
    return values[-1].upper() if values else None


def native_bf16(cpuinfo: str | None = None, xla_flags: str | None = None) -> bool:
    """Whether XLA:CPU can multiply bfloat16 natively: AVX512_BF16 or AMX-BF16 that --xla_cpu_max_isa leaves on, or
    Arm BF16. cpuinfo, xla_flags: default this host's /proc/cpuinfo and $XLA_FLAGS, read now."""
    if cpuinfo is None:
        cpuinfo = CPUINFO.read_text() if CPUINFO.exists() else ""
    if xla_flags is None:
        xla_flags = os.environ.get("XLA_FLAGS", "")
    flags, cap = cpu_flags(cpuinfo), max_isa(xla_flags)
    return (("avx512_bf16" in flags and cap not in CAPS_WITHOUT_AVX512_BF16)
            or ("amx_bf16" in flags and cap not in CAPS_WITHOUT_AMX)
            or "bf16" in flags)


def warn_if_slow_bf16(compute_dtype: str, backend: str | None = None) -> None:
    """A `SlowBfloat16Warning`, once a process, when `compute_dtype` is bfloat16 on a CPU backend (default
    `jax.default_backend()`) without native bfloat16."""
    if compute_dtype == "bfloat16" and (backend or jax.default_backend()) == "cpu" and not native_bf16():
        _warn_slow_bf16()


@functools.cache  # once a process: `jaxtune demo` and a notebook start several runs
def _warn_slow_bf16() -> None:
    warnings.warn(SLOW_BF16, SlowBfloat16Warning, stacklevel=3)
