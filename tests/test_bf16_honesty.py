"""bfloat16 honesty (issues 13 and 54): detecting fast bfloat16 dots (AMX), the products' output dtype by CPU kind,
the one warning, the planner's CPU rate."""

import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shapes import SMALL
from test_train import DEMO_DATA, write_config

from jaxtune import host_cpu
from jaxtune.config import ForwardOptions, MeshConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.host_cpu import SLOW_BF16, SlowBfloat16Warning, fast_bf16_dots, warn_if_slow_bf16
from jaxtune.methods import method_config
from jaxtune.models import linear
from jaxtune.planner import estimate, get_device, step_time
from jaxtune.planner.devices import cpu_device
from jaxtune.presets import write_random_model

# /proc/cpuinfo lines as these CPUs' Linux kernels write them (one core shown)
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid pni pclmulqdq ssse3 fma cx16 pcid \
sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy abm sse4a misalignsse \
3dnowprefetch bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 \
xsaves clzero xsaveerptr rdpru arat npt umip pku ospke vaes vpclmulqdq rdpid fsrm
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht \
syscall nx pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes \
xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm \
avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec \
xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes \
vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b fsrm md_clear serialize \
tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities
"""
NEOVERSE_V1 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh \
rng
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


# --- detection ----------------------------------------------------------------------------------------------------

def test_zen3_with_avx2_only_has_no_fast_bf16_dots():
    assert not fast_bf16_dots(ZEN3, "")


def test_sapphire_rapids_amx_and_neoverse_v1_have_fast_bf16_dots():
    assert fast_bf16_dots(SAPPHIRE_RAPIDS, "") and fast_bf16_dots(NEOVERSE_V1, "")


def test_avx512_bf16_without_amx_is_not_fast():
    """AVX512_BF16 alone (a Xeon without AMX, Zen 4): XLA:CPU's bfloat16 kernel is slower than its float32 GEMM."""
    no_amx = SAPPHIRE_RAPIDS.replace(" amx_bf16", "").replace(" amx_tile", "").replace(" amx_int8", "")
    assert "avx512_bf16" in no_amx and not fast_bf16_dots(no_amx, "")


@pytest.mark.parametrize("cap", ["AVX2", "avx2", "AVX", "SSE4_2", "AVX512", "AVX512_VNNI", "AVX512_BF16"])
def test_xla_isa_cap_below_amx_turns_fast_bf16_dots_off(cap):
    assert not fast_bf16_dots(SAPPHIRE_RAPIDS, f"--xla_force_host_platform_device_count=8 --xla_cpu_max_isa={cap}")


def test_xla_isa_caps_that_keep_a_fast_bf16_instruction():
    assert fast_bf16_dots(SAPPHIRE_RAPIDS, "--xla_cpu_max_isa=AMX")
    assert fast_bf16_dots(NEOVERSE_V1, "--xla_cpu_max_isa=NEON")  # the Arm caps only turn off SVE/SVE2
    assert not fast_bf16_dots(SAPPHIRE_RAPIDS, "--xla_cpu_max_isa=AMX --xla_cpu_max_isa=AVX2")  # the last one counts


def test_no_cpuinfo_counts_as_not_fast():
    assert not fast_bf16_dots("", "")


# --- the products' output dtype -----------------------------------------------------------------------------------

@pytest.mark.parametrize("amx", [False, True])
def test_bf16_products_round_in_the_dot_without_fast_bf16_dots(amx, monkeypatch):
    """Without AMX a bfloat16 layer's dots (y = x w and g w^T) return bfloat16 (XLA:CPU runs them as float32 GEMMs of
    widened operands, rounded once: within one bfloat16 rounding of float64); with AMX, and for the float32 weight
    gradient and a wide output (the head's logits), they return float32 (its bfloat16 kernel's)."""
    monkeypatch.setattr(linear, "fast_bf16_dots", lambda: amx)
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (64, 96), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(key_w, (96, 48), jnp.float32) / 10  # a float32 master weight, cast in the product
    loss = lambda x, w, out: jnp.sum(linear.matmul(x, w, out).astype(jnp.float32) ** 2)
    dots = lambda out: re.findall(r"dot_general .*-> tensor<(\w+)>", jax.jit(jax.grad(
        lambda x, w: loss(x, w, out), argnums=(0, 1))).lower(x, w).as_text())
    rounded = "bf16" if not amx else "f32"
    assert sorted(dots(None)) == sorted([f"64x48x{rounded}", f"64x96x{rounded}", "96x48xf32"])  # y, dx, dw
    assert sorted(dots(jnp.float32)) == ["64x48xf32", "64x96xf32", "96x48xf32"]
    y = np.asarray(jax.jit(lambda x, w: linear.matmul(x, w))(x, w), np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(y, exact, rtol=2.0**-8, atol=1e-6)


# --- the warning --------------------------------------------------------------------------------------------------

@pytest.fixture
def slow_warnings(monkeypatch):
    """A function (native, compute_dtype, calls, backend) -> the SlowBfloat16Warnings those calls emit, with this
    process's once-only memory cleared before and after."""

    def emitted(native: bool, compute_dtype: str, calls: int = 2, backend: str = "cpu") -> list:
        monkeypatch.setattr(host_cpu, "fast_bf16_dots", lambda: native)
        host_cpu._warn_slow_bf16.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # so only the function's own once-guard can hold back a repeat
            for _ in range(calls):
                warn_if_slow_bf16(compute_dtype, backend)
        return [w for w in caught if issubclass(w.category, SlowBfloat16Warning)]

    yield emitted
    host_cpu._warn_slow_bf16.cache_clear()


def test_warning_is_emitted_once_across_calls_without_fast_bf16_dots(slow_warnings):
    caught = slow_warnings(native=False, compute_dtype="bfloat16")
    assert len(caught) == 1 and str(caught[0].message) == SLOW_BF16


def test_no_warning_with_fast_bf16_dots_float32_compute_or_another_backend(slow_warnings):
    assert slow_warnings(native=True, compute_dtype="bfloat16") == []
    assert slow_warnings(native=False, compute_dtype="float32") == []
    assert slow_warnings(native=False, compute_dtype="bfloat16", backend="gpu") == []


@pytest.mark.slow
@pytest.mark.full
def test_jaxtune_train_prints_the_warning_as_one_line(tmp_path):
    """`jaxtune train` with bfloat16 compute and XLA capped to AVX2 (so on any x86 host no AMX)."""
    model = write_random_model(tmp_path / "model", "llama", seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:16]))
    config = write_config(tmp_path / "run.toml", model, data, tmp_path / "run", max_steps=1, eval_every=0,
                          checkpoint_every=0)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"} | {
        "XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", str(config), "--set",
                          "model.compute_dtype=bfloat16"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines.count(f"jaxtune: warning: {SLOW_BF16}") == 1
    assert not any("SlowBfloat16Warning" in line or "warnings.warn" in line for line in lines)


# --- the planner --------------------------------------------------------------------------------------------------

def _compute_s(compute_dtype: str, native: bool) -> float:
    plan = TrainPlan(method_config("full"), 4, 256, 1, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype=compute_dtype, remat="none"), mesh=MeshConfig(1, 1, 1))
    return step_time(estimate(SMALL, plan, cpu_device(fast_bf16_dots=native))).compute_s


def test_planner_cpu_bf16_rate_is_twice_or_the_float32_rate():
    float32 = _compute_s("float32", native=False)
    assert _compute_s("float32", native=True) == float32
    assert _compute_s("bfloat16", native=True) == pytest.approx(float32 / 2)
    assert _compute_s("bfloat16", native=False) == pytest.approx(float32)


def test_planner_cpu_target_uses_this_hosts_detection(monkeypatch):
    for native, ratio in ((True, 2.0), (False, 1.0)):
        monkeypatch.setattr(host_cpu, "fast_bf16_dots", lambda native=native: native)
        device = get_device("cpu")
        assert device.peak_bf16 == ratio * device.peak_fp32
