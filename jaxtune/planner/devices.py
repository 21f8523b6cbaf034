"""The device catalogue (`CATALOGUE`, `get_device(target)`): memory, the share of it a JAX program can use,
bandwidth and peak FLOP/s per device, every figure with its source (`Device.sources`).

FLOP/s are dense (vendors quote recent NVIDIA parts "with sparsity", twice what a training step can reach); memory is
the datasheet capacity read in binary units (HBM and GDDR capacities are powers of two), less what the driver, ECC
and runtime keep (`usable_fraction`). A target is a catalogue name with an optional device count: `h100-80gb`,
`h100-80gb-8`, `v5e-8`, `v5p-32`. TPU slice names count chips for v5e and v6e but TensorCores for v4, v5p and v7x (two
a chip; one JAX device a chip on v4 and v5p, one a TensorCore on v7x), so `v5p-32` is 16 devices and `v7x-64` 64.
`cpu_device` describes this host (`host_cpu.fast_bf16_dots`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from jaxtune import host_cpu
from jaxtune.errors import JaxtuneError

GiB = 1 << 30
T = 1e12

_NVIDIA_USABLE = ("0.90: the CUDA context, cuBLAS/cuDNN workspaces and the driver's reservations; JAX preallocates "
                  "0.75 of memory unless XLA_PYTHON_CLIENT_MEM_FRACTION is raised (JAX docs, 'GPU memory "
                  "allocation'), so the plan assumes XLA_PYTHON_CLIENT_MEM_FRACTION=.90")
_TPU_USABLE = ("0.94: the TPU runtime keeps part of HBM for programs and collectives (our assumption, checked "
               "against XLA:TPU's reported free HBM in typical runs; not a published figure)")
_GAUDI_USABLE = "0.90: HBM left after the Habana runtime and graph recipe cache (our assumption, not published)"


@dataclass(frozen=True)
class Device:
    """One accelerator (or this host's CPU) and how many of them.

    family: "gpu" | "tpu" | "gaudi" | "cpu", which selects the memory rules of `estimate.py`.
    memory_bytes: per device. usable_fraction: the share a JAX program's buffers can have.
    bandwidth: memory bytes/s. peak_bf16 / peak_fp32: dense matmul FLOP/s.
    interconnect: bytes/s one device can send to its peers (NVLink, ICI, RoCE), for collective time.
    host_link: bytes/s one way between host and device memory, for offload (PCIe 4.0 x16: 32 GB/s raw, about 25
    usable; PCIe 5.0 x16: about 50; GB200's NVLink-C2C), an approximation.
    peak_fp8: dense fp8 matmul FLOP/s where the catalogue lists it (0: not listed; the planner plans bfloat16).
    sources: field name -> where the figure comes from.
    """

    name: str
    family: str
    memory_bytes: int
    usable_fraction: float
    bandwidth: float
    peak_bf16: float
    peak_fp32: float
    interconnect: float
    sources: tuple[tuple[str, str], ...]
    count: int = 1
    host_link: float = 25e9
    peak_fp8: float = 0.0

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)

    def peak(self, dtype: str) -> float:
        return self.peak_fp32 if dtype == "float32" else self.peak_bf16

    @property
    def target(self) -> str:
        return self.name if self.count == 1 else f"{self.name}-{self.count}"

    def with_count(self, count: int) -> Device:
        return replace(self, count=count)


def _nvidia(name, gib, bandwidth_gbs, bf16_dense_tflops, fp32_tflops, nvlink_gbs, datasheet, pcie5=False) -> Device:
    return Device(name, "gpu", gib * GiB, 0.90, bandwidth_gbs * 1e9, bf16_dense_tflops * T, fp32_tflops * T,
                  nvlink_gbs * 1e9, host_link=50e9 if pcie5 else 25e9, sources=(
                      ("memory", f"{datasheet}: {gib} GB"),
                      ("usable_fraction", _NVIDIA_USABLE),
                      ("bandwidth", f"{datasheet}: {bandwidth_gbs:,} GB/s"),
                      ("peak_bf16", f"{datasheet}: {2 * bf16_dense_tflops:g} TFLOPS with sparsity, "
                                    f"{bf16_dense_tflops:g} dense"),
                      ("peak_fp32", f"{datasheet}: {fp32_tflops:g} TFLOPS FP32 (non-tensor)"),
                      ("interconnect", f"{datasheet}: {nvlink_gbs:g} GB/s per GPU (NVLink, or PCIe where none)"),
                  ))


def _tpu(name, gib, bandwidth_gbs, bf16_tflops, ici_gbs, doc) -> Device:
    return Device(name, "tpu", gib * GiB, 0.94, bandwidth_gbs * 1e9, bf16_tflops * T, bf16_tflops * T / 6,
                  ici_gbs * 1e9, sources=(
                      ("memory", f"{doc}: {gib} GiB HBM per chip"),
                      ("usable_fraction", _TPU_USABLE),
                      ("bandwidth", f"{doc}: {bandwidth_gbs:,} GB/s HBM per chip"),
                      ("peak_bf16", f"{doc}: {bf16_tflops:g} TFLOPS bf16 per chip"),
                      ("peak_fp32", "derived: the MXU is bf16-native; a float32 matmul at HIGHEST precision is six "
                                    "bf16 passes, so peak_bf16 / 6"),
                      ("interconnect", f"{doc}: {ici_gbs:g} GB/s ICI per chip"),
                  ))


def _gaudi(name, gib, bandwidth_tbs, bf16_tflops, fp32_tflops, net_gbs, doc) -> Device:
    return Device(name, "gaudi", gib * GiB, 0.90, bandwidth_tbs * 1e12, bf16_tflops * T, fp32_tflops * T,
                  net_gbs * 1e9, sources=(
                      ("memory", f"{doc}: {gib} GB HBM2e"),
                      ("usable_fraction", _GAUDI_USABLE),
                      ("bandwidth", f"{doc}: {bandwidth_tbs} TB/s"),
                      ("peak_bf16", f"{doc}: {bf16_tflops:g} TFLOPS bf16 (MME)"),
                      ("peak_fp32", f"approximate: {fp32_tflops:g} TFLOPS, a quarter of the bf16 MME rate "
                                    "(our assumption; Intel publishes no single dense FP32 matmul figure)"),
                      ("interconnect", f"{doc}: {net_gbs:g} GB/s RoCE per card"),
                  ))


def _listed(name, family, gib, usable, usable_note, bandwidth_gbs, bf16_tflops, fp8_tflops, fp32_tflops, link_gbs,
            host_gbs, cited: dict[str, str]) -> Device:
    """A device whose every figure is cited in `cited` (field name -> source), dense FLOPs as given."""
    return Device(name, family, gib * GiB, usable, bandwidth_gbs * 1e9, bf16_tflops * T, fp32_tflops * T,
                  link_gbs * 1e9, host_link=host_gbs * 1e9, peak_fp8=fp8_tflops * T,
                  sources=(("usable_fraction", usable_note), *cited.items()))


_ROCM_USABLE = ("0.90: ROCm's runtime, rocBLAS/hipBLASLt workspaces and the driver's reservations, as for CUDA (our "
                "assumption; XLA_PYTHON_CLIENT_MEM_FRACTION=.90 as on NVIDIA)")
B200_DATASHEET = "NVIDIA DGX B200 datasheet (8 GPUs: 1,440 GB HBM3e, 64 TB/s, 72 PFLOPS FP8 with sparsity), per GPU"
GB200_PAGE = ("NVIDIA GB200 NVL72 product page (72 GPUs: 13.4 TB HBM3e, 576 TB/s, 360 PFLOPS FP16/BF16 and 720 "
              "FP8 with sparsity, 5,760 TFLOPS FP32, 130 TB/s NVLink), per GPU")
MI300X_SHEET = "AMD Instinct MI300X data sheet"
MI325X_SHEET = "AMD Instinct MI325X data sheet"
TPU7X_DOC = "Cloud TPU docs, 'TPU7x (Ironwood)'"
PCIE5_HOST = "PCIe 5.0 x16 to the host: 64 GB/s one way raw, about 50 usable (our approximation)"
NEW_DEVICES = (
    _listed("b200", "gpu", 180, 0.90, _NVIDIA_USABLE, 8000, 2250, 4500, 75, 900, 50, {
        "memory": f"{B200_DATASHEET}: 180 GB", "bandwidth": f"{B200_DATASHEET}: 8 TB/s",
        "peak_bf16": f"{B200_DATASHEET}: 4.5 PFLOPS FP16/BF16 with sparsity, 2.25 dense",
        "peak_fp8": f"{B200_DATASHEET}: 9 PFLOPS FP8 with sparsity, 4.5 dense",
        "peak_fp32": f"{B200_DATASHEET}: 75 TFLOPS FP32",
        "interconnect": f"{B200_DATASHEET}: NVLink 5, 1.8 TB/s per GPU both ways, 900 GB/s one way",
        "host_link": PCIE5_HOST}),
    _listed("gb200", "gpu", 186, 0.90, _NVIDIA_USABLE, 8000, 2500, 5000, 80, 900, 225, {
        "memory": f"{GB200_PAGE}: 186 GB", "bandwidth": f"{GB200_PAGE}: 8 TB/s",
        "peak_bf16": f"{GB200_PAGE}: 5 PFLOPS FP16/BF16 with sparsity, 2.5 dense",
        "peak_fp8": f"{GB200_PAGE}: 10 PFLOPS FP8 with sparsity, 5 dense",
        "peak_fp32": f"{GB200_PAGE}: 80 TFLOPS FP32",
        "interconnect": f"{GB200_PAGE}: 1.8 TB/s NVLink per GPU both ways, 900 GB/s one way",
        "host_link": "NVIDIA GB200 NVL72 product page: NVLink-C2C, 900 GB/s both ways between a Grace CPU and its two "
                     "GPUs: 225 GB/s one way a GPU (derived)"}),
    _listed("mi300x", "gpu", 192, 0.90, _ROCM_USABLE, 5300, 1307.4, 2614.9, 163.4, 448, 50, {
        "memory": f"{MI300X_SHEET}: 192 GB HBM3", "bandwidth": f"{MI300X_SHEET}: 5.3 TB/s peak",
        "peak_bf16": f"{MI300X_SHEET}: 1,307.4 TFLOPS BF16 (dense; 2,614.9 with sparsity)",
        "peak_fp8": f"{MI300X_SHEET}: 2,614.9 TFLOPS FP8 (dense; 5,229.8 with sparsity)",
        "peak_fp32": f"{MI300X_SHEET}: 163.4 TFLOPS FP32 matrix",
        "interconnect": f"{MI300X_SHEET}: 7 Infinity Fabric links of 128 GB/s both ways, 896 GB/s: 448 GB/s one way",
        "host_link": PCIE5_HOST}),
    _listed("mi325x", "gpu", 256, 0.90, _ROCM_USABLE, 6000, 1307.4, 2614.9, 163.4, 448, 50, {
        "memory": f"{MI325X_SHEET}: 256 GB HBM3E", "bandwidth": f"{MI325X_SHEET}: 6 TB/s peak",
        "peak_bf16": f"{MI325X_SHEET}: 1,307.4 TFLOPS BF16 (dense; 2,614.9 with sparsity)",
        "peak_fp8": f"{MI325X_SHEET}: 2,614.9 TFLOPS FP8 (dense; 5,229.8 with sparsity)",
        "peak_fp32": f"{MI325X_SHEET}: 163.4 TFLOPS FP32 matrix",
        "interconnect": f"{MI325X_SHEET}: 7 Infinity Fabric links of 128 GB/s both ways, 896 GB/s: 448 GB/s one way",
        "host_link": PCIE5_HOST}),
    # a TPU7x chip is two TensorCores, each its own JAX device with half the chip's HBM and rates
    _listed("v7x", "tpu", 96, 0.94, _TPU_USABLE, 3690, 1153.5, 2307, 1153.5 / 6, 300, 12.5, {
        "memory": f"{TPU7X_DOC}: 192 GiB HBM per chip, two TensorCores (JAX devices) a chip: 96 GiB a device",
        "bandwidth": f"{TPU7X_DOC}: 7,380 GB/s HBM per chip, half a device",
        "peak_bf16": f"{TPU7X_DOC}: 2,307 TFLOPS BF16 per chip, half a device",
        "peak_fp8": f"{TPU7X_DOC}: 4,614 TFLOPS FP8 per chip, half a device",
        "peak_fp32": "derived: the MXU is bf16-native; a float32 matmul at HIGHEST precision is six bf16 passes, so "
                     "peak_bf16 / 6",
        "interconnect": f"{TPU7X_DOC}: 1,200 GB/s ICI per chip both ways: 600 one way, 300 a device",
        "host_link": "not published: assumed as earlier TPU hosts, PCIe 4.0 x16 (about 25 GB/s usable) a chip, "
                     "shared by its two devices"}),
)

A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (SXM4)"
H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
H200_DATASHEET = "NVIDIA H200 Tensor Core GPU product brief (SXM)"

CATALOGUE: dict[str, Device] = {d.name: d for d in (
    _nvidia("a100-40gb", 40, 1555, 312, 19.5, 600, A100_DATASHEET),
    _nvidia("a100-80gb", 80, 2039, 312, 19.5, 600, A100_DATASHEET),
    _nvidia("h100-80gb", 80, 3350, 989.5, 67, 900, H100_DATASHEET, pcie5=True),
    _nvidia("h200-141gb", 141, 4800, 989.5, 67, 900, H200_DATASHEET, pcie5=True),
    _nvidia("l4", 24, 300, 121, 30.3, 64, "NVIDIA L4 Tensor Core GPU datasheet"),
    _nvidia("rtx-4090", 24, 1008, 165.2, 82.6, 64,
            "NVIDIA Ada GPU architecture whitepaper, appendix A (GeForce RTX 4090; FP16/BF16 with FP32 accumulate)"),
    _nvidia("rtx-a6000", 48, 768, 154.8, 38.7, 112, "NVIDIA RTX A6000 datasheet"),
    _nvidia("l40s", 48, 864, 362, 91.6, 64, "NVIDIA L40S datasheet"),
    _tpu("v4", 32, 1200, 275, 300, "Cloud TPU docs, 'TPU v4'"),
    _tpu("v5e", 16, 819, 197, 200, "Cloud TPU docs, 'TPU v5e'"),
    _tpu("v5p", 95, 2765, 459, 600, "Cloud TPU docs, 'TPU v5p'"),
    _tpu("v6e", 32, 1640, 918, 400, "Cloud TPU docs, 'TPU v6e'"),
    _gaudi("gaudi2", 96, 2.45, 432, 108, 300, "Intel Gaudi 3 AI accelerator white paper (2024), Gaudi 2 column"),
    _gaudi("gaudi3", 128, 3.7, 1835, 459, 600, "Intel Gaudi 3 AI accelerator white paper (2024)"),
    *NEW_DEVICES,
)}

# Short names that name one catalogued device; they are listed beside it, and a plan prints the full name.
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "4090": "rtx-4090", "a6000": "rtx-a6000",
           "gaudi-2": "gaudi2", "gaudi-3": "gaudi3", "tpu-v4": "v4", "tpu-v5e": "v5e", "tpu-v5p": "v5p",
           "tpu-v6e": "v6e", "v5litepod": "v5e", "tpu7x": "v7x", "ironwood": "v7x", "gb200-nvl72": "gb200"}
AMBIGUOUS = {"a100": ("a100-40gb", "a100-80gb")}  # names of more than one device: refused, naming them
CORES_PER_CHIP = {"v4": 2, "v5p": 2}  # slice names count TensorCores on these; JAX sees one device per chip
# (v7x's names count TensorCores too, but JAX sees each as a device: a count of them is a count of devices)


def host_memory_bytes() -> int:
    """This machine's physical memory, read now."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_device(fast_bf16_dots: bool | None = None) -> Device:
    """This host as a device: its memory read at run time, nominal rates (the CPU is for checks, not speed).

    fast_bf16_dots: whether XLA:CPU's bfloat16 dots beat its float32 GEMM here (AMX, Arm BF16); default
    `host_cpu.fast_bf16_dots()`, this host's flags less any --xla_cpu_max_isa cap. It sets peak_bf16: twice
    peak_fp32 with them, peak_fp32 without (bfloat16 layers' products run as float32 GEMMs there).
    """
    if fast_bf16_dots is None:
        fast_bf16_dots = host_cpu.fast_bf16_dots()
    cores = os.cpu_count() or 1
    flops = cores * 2.5e9 * 32  # two 8-wide fp32 FMA units a core
    bf16_source = ("2 x peak_fp32: AMX (or Arm BF16) that XLA:CPU's bfloat16 dots use; benchmarks/README.md, "
                   "'Mixed precision': about twice the float32 rate" if fast_bf16_dots else
                   "peak_fp32: no AMX here (or --xla_cpu_max_isa below it), so a bfloat16 layer's products run as "
                   "float32 GEMMs of widened operands (models.linear.product_dtype; benchmarks/README.md, issue 54)")
    peak_bf16 = flops * (2 if fast_bf16_dots else 1)
    return Device("cpu", "cpu", host_memory_bytes(), 0.90, 20e9, peak_bf16, flops, 20e9, sources=(
        ("memory", "this host: os.sysconf(SC_PHYS_PAGES) x SC_PAGE_SIZE, read at run time"),
        ("usable_fraction", "0.90: the OS, page cache and other processes (our assumption)"),
        ("bandwidth", "nominal 20 GB/s (one socket's DRAM, not measured)"),
        ("peak_bf16", bf16_source),
        ("peak_fp32", f"nominal: {cores} cores x 2.5 GHz x 32 fp32 FLOP/cycle (AVX2 FMA)"),
        ("interconnect", "nominal 20 GB/s (fake devices share one memory)"),
    ))


def known_targets() -> list[str]:
    """The catalogue's names, each with its short names: "h100-80gb (h100)"."""
    short = {full: [a for a, f in ALIASES.items() if f == full] for full in CATALOGUE}
    return [f"{name} ({', '.join(short[name])})" if short[name] else name for name in sorted(CATALOGUE)] + ["cpu"]


def get_device(target: str) -> Device:
    """`NAME` or `NAME-N` (N devices; TPU slice names as Google writes them) -> a Device with its count.

    An unknown name is an error that lists the known ones.
    """
    text = target.strip().lower()
    match = re.fullmatch(r"(.+?)(?:-(\d+))?", text)
    name, count = (match.group(1), match.group(2)) if match else (text, None)  # "": unknown, below
    if name not in CATALOGUE and name != "cpu" and name not in ALIASES and count is not None:
        name, count = text, None  # a name that ends in digits, like "a100-80gb" without a count
    if name in AMBIGUOUS:
        raise JaxtuneError(f"{target!r} names more than one device: {', '.join(AMBIGUOUS[name])}; give the full name")
    name = ALIASES.get(name, name)
    if name == "cpu":
        device = cpu_device()
    elif name in CATALOGUE:
        device = CATALOGUE[name]
    else:
        raise JaxtuneError(f"unknown device {target!r}; known devices: {', '.join(known_targets())} "
                           "(add -N for N of them, e.g. h100-80gb-8, v5e-8, v5p-32)")
    if count is None:
        return device
    n = int(count)
    if name == "cpu":  # fake devices (--xla_force_host_platform_device_count) share the host's memory
        return replace(device, count=n, memory_bytes=device.memory_bytes // max(n, 1))
    per_chip = CORES_PER_CHIP.get(name, 1)
    if n < 1 or n % per_chip:
        raise JaxtuneError(f"{target!r}: {name} slices count TensorCores, {per_chip} a chip; "
                           f"use a multiple of {per_chip}")
    return device.with_count(n // per_chip)
