"""What every benchmark worker shares: the fixed shape, the fixed batch, the method table, and memory readings.

A worker is one process per (framework, method), so its resident-set high-water mark belongs to that one
configuration alone. Linux's VmHWM is reset (`/proc/self/clear_refs`, "5") once the model, optimiser state and
batch exist, so `train_peak_rss` is the high-water mark of compiling and training only, beside the process's
lifetime peak (`ru_maxrss`, imports and model creation included).
"""

from __future__ import annotations

import resource
import statistics
import time

import numpy as np

# The fixed Llama shape of the benchmark (float32 throughout, but for the COMPUTE_DTYPE configs).
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_layers=8, num_heads=8, num_kv_heads=4,
             head_dim=64)
BATCH, SEQ = 4, 256
MAX_POSITIONS = 2048  # the model config's context (long_context.py raises it with SEQ)
REMAT = "none"  # jaxtune's remat policy; "full" also turns on torch's gradient checkpointing (long_context.py)
RANK, ALPHA = 8, 16.0
LEARNING_RATE, MAX_GRAD_NORM = 2e-4, 1.0

# name -> (method kind, LoRA target modules); QLoRA targets q,v like "lora_qv", so the two differ only by NF4.
METHODS = {
    "full": ("full", ()),
    "lora_qv": ("lora", ("q_proj", "v_proj")),
    "lora_all": ("lora", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "qlora": ("qlora", ("q_proj", "v_proj")),
    "lora_qv_bf16": ("lora", ("q_proj", "v_proj")),
}


def method(name: str):
    """The method options of configuration `name` (rank and alpha for the LoRA kinds; a full fine-tune has none)."""
    from jaxtune.methods import method_config

    kind, targets = METHODS[name]
    if kind == "full":
        return method_config(kind)
    return method_config(kind, rank=RANK, alpha=ALPHA, target_modules=targets)


# Mixed precision (float32 weights and optimizer, bfloat16 matmuls): jaxtune's compute_dtype, torch's autocast.
COMPUTE_DTYPE = {"lora_qv_bf16": "bfloat16"}


def fixed_tokens(seed: int = 0, batch: int | None = None, seq: int | None = None, vocab: int | None = None
                 ) -> np.ndarray:
    """[B, T+1] int32 random token ids (BATCH, SEQ and SHAPE's vocabulary as they are when called, unless given):
    inputs are [:, :-1] ... for jaxtune's pre-shifted labels, see `jax_batch`."""
    shape = (batch or BATCH, (seq or SEQ) + 1)
    return np.random.default_rng(seed).integers(0, vocab or SHAPE["vocab_size"], shape, dtype=np.int32)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_mib() -> float:
    """Current resident set size."""
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Start a new VmHWM window (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """The process's lifetime resident high-water mark (`ru_maxrss` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def window_peak_rss_mib() -> float:
    """The resident high-water mark since `reset_peak_rss`."""
    return _status_kib("VmHWM") / 1024


def time_steps(step, warmup: int, steps: int, tokens: int = BATCH * SEQ) -> dict:
    """Run `step()` (which must block until its result exists) warmup + steps times; per-step wall times and
    `tokens` (a step's) per second."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    first = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    median = statistics.median(times)
    # CPU seconds (all threads) per step: a check on the wall time when other processes share the cores.
    return {"warmup_s": first, "step_s_median": median, "step_s_min": min(times), "step_s_max": max(times),
            "step_s_all": times, "cpu_s_per_step": statistics.median(cpu), "tokens_per_s": tokens / median}
