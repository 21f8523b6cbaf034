"""This host's CPU: whether XLA:CPU's bfloat16 dot kernel beats its float32 GEMM here, and one warning where not.

With AMX-BF16 (or Arm BF16) XLA:CPU's bfloat16 dots run about twice the float32 rate. Elsewhere, AVX512_BF16
included, its bfloat16 kernel is slower than its float32 GEMM, so a bfloat16 layer's products run as float32 GEMMs
of widened operands (`models.linear.product_dtype`): bfloat16 compute saves activation memory, not time (issue 54).
`fast_bf16_dots` reads /proc/cpuinfo (Linux; elsewhere the answer is no) less what `XLA_FLAGS=--xla_cpu_max_isa=...`
forbids; it takes both texts as arguments so tests can fix them. The products, the planner's `cpu` target
(`planner/devices.cpu_device`) and `warn_if_slow_bf16` (the trainer's one warning a process) ask it.
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
CAPS_WITHOUT_AMX = frozenset({"SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16"})
SLOW_BF16 = ("bfloat16 compute on a CPU without AMX runs its products as float32 GEMMs (XLA:CPU's bfloat16 kernel is "
             "slower here): it saves activation memory, not time")


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


def fast_bf16_dots(cpuinfo: str | None = None, xla_flags: str | None = None) -> bool:
    """Whether XLA:CPU's bfloat16 dots beat its float32 GEMM here: AMX-BF16 that --xla_cpu_max_isa leaves on, or Arm
    BF16 (unmeasured; its dot instructions). Not AVX512_BF16 alone: on a Xeon with it and no AMX the bfloat16 kernel
    ran 150-160 GFLOP/s, the float32 GEMM 240-270 (benchmarks/README.md, issue 54). cpuinfo, xla_flags: default this
    host's /proc/cpuinfo and $XLA_FLAGS, read once a process."""
    if cpuinfo is None and xla_flags is None:
        return _host_fast_bf16_dots()
    flags = cpu_flags(_host_cpuinfo() if cpuinfo is None else cpuinfo)
    cap = max_isa(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    return ("amx_bf16" in flags and cap not in CAPS_WITHOUT_AMX) or "bf16" in flags


@functools.cache  # asked at every product a trace makes
def _host_fast_bf16_dots() -> bool:
    return fast_bf16_dots(_host_cpuinfo(), os.environ.get("XLA_FLAGS", ""))


def _host_cpuinfo() -> str:
    return CPUINFO.read_text() if CPUINFO.exists() else ""


def warn_if_slow_bf16(compute_dtype: str, backend: str | None = None) -> None:
    """A `SlowBfloat16Warning`, once a process, when `compute_dtype` is bfloat16 on a CPU backend (default
    `jax.default_backend()`) without fast bfloat16 dots."""
    if compute_dtype == "bfloat16" and (backend or jax.default_backend()) == "cpu" and not fast_bf16_dots():
        _warn_slow_bf16()


@functools.cache  # once a process: `jaxtune demo` and a notebook start several runs
def _warn_slow_bf16() -> None:
    warnings.warn(SLOW_BF16, SlowBfloat16Warning, stacklevel=3)
