"""Long context: peak memory and speed of one LoRA step as the sequence grows, jaxtune against PyTorch+PEFT.

    .venv/bin/python benchmarks/long_context.py                     # 1k .. 16k tokens, all three; ~25 min on 2 cores
    .venv/bin/python benchmarks/long_context.py --lengths 1024 4096 --only jax
    .venv/bin/python benchmarks/long_context.py --context            # context parallelism on 8 fake devices, ~10 min

The benchmark shape of `train_throughput.py` (hidden 512, 8 layers, 8 / 4 heads, vocabulary 8192, float32), LoRA
rank 8 on q, v, batch 1, every layer recomputed in the backward on both sides (jaxtune's remat "full", torch's
gradient checkpointing): the setting people train long contexts with. PEFT runs with "sdpa" attention (PyTorch's
fused CPU kernel) and "eager" (the [T, T] softmax). Each (framework, length) is a fresh process (its peak RSS is its
own), one warm-up step and one or two timed steps. A run is stopped when its resident set passes the budget
(8 GiB), which is recorded as "over budget".

The longest sequence each trains within the budget: PEFT's from its measured peaks (sdpa's memory grows linearly
with T, eager's with T^2; fitted on the measured lengths); jaxtune's from XLA's own memory analysis of the compiled
step (compiling allocates none of the arrays), found by bisection over T in steps of 1,024, plus the largest gap
between a measured peak RSS and the compiled figure at the same length (the runtime, Python and the libraries).
Results go to benchmarks/results/long_context.json.

`--context`: memory a device against T and the context axis' size N (`[mesh] context`, each row's tokens split over
N devices), from XLA's memory analysis of the step compiled for 8 fake CPU devices (same shape, LoRA, remat full; no
step runs: 8 fake devices share this host's cores, so their speed means nothing). For each T and N, both attention
strategies (ring, all-gather): the bytes a device holds (arguments + temporaries + outputs - aliases) and its
temporaries. Results go to benchmarks/results/long_context_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _measure as M  # noqa: E402

BUDGET_MIB = 8 * 1024
VARIANTS = ("jax", "torch:sdpa", "torch:eager")


def configure(seq: int) -> None:
    M.BATCH, M.SEQ, M.MAX_POSITIONS, M.REMAT = 1, seq, max(seq, 2048), "full"


def worker(variant: str, seq: int, steps: int) -> dict:
    configure(seq)
    if variant == "jax":
        import _jax_worker

        return _jax_worker.run("lora_qv", 1, steps)
    import _torch_worker

    return _torch_worker.run("lora_qv", variant.split(":")[1], 1, steps)


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def spawn(variant: str, seq: int, steps: int) -> dict:
    """One worker in a fresh interpreter, killed if its resident set passes the budget."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--seq", str(seq), "--steps",
           str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    over = threading.Event()

    def watch():
        while proc.poll() is None:
            if _rss_mib(proc.pid) > BUDGET_MIB:
                over.set()
                proc.kill()
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    out, err = proc.communicate()
    if over.is_set():
        return {"variant": variant, "seq": seq, "over_budget": True}
    if proc.returncode:
        return {"variant": variant, "seq": seq, "error": err[-1500:]}
    return {**json.loads(out.strip().splitlines()[-1]), "variant": variant, "seq": seq}


def jax_compiled_mib(seq: int) -> float:
    """XLA's memory analysis of the jaxtune step at `seq` tokens (arguments + temporaries + outputs - aliases)."""
    configure(seq)
    from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.planner import compile_step

    cfg = ModelConfig(**M.SHAPE, max_position_embeddings=M.MAX_POSITIONS)
    plan = TrainPlan(M.method("lora_qv"), 1, seq, 1,
                     param_dtype="float32", forward=ForwardOptions(compute_dtype="float32", remat="full"),
                     mesh=MeshConfig(1, 1, 1))
    return compile_step(cfg, plan).total_bytes / 2**20


def jax_longest_within_budget(rows: list[dict]) -> dict | None:
    done = [r for r in rows if r["variant"] == "jax" and "peak_rss_mib" in r]
    if not done:
        return None
    compiled = lambda r: r["xla_argument_mib"] + r["xla_temp_mib"] + r["xla_output_mib"] - r["xla_alias_mib"]
    overhead = max(r["peak_rss_mib"] - compiled(r) for r in done)
    low, high = max(r["seq"] for r in done) // 1024, 1024  # in units of 1,024 tokens: 1M tokens at most
    while low < high:
        mid = (low + high + 1) // 2
        if jax_compiled_mib(mid * 1024) + overhead <= BUDGET_MIB:
            low = mid
        else:
            high = mid - 1
    return {"variant": "jax", "fit": f"XLA's compiled step + {overhead:.0f} MiB of runtime",
            "longest_tokens": low * 1024, "xla_compiled_mib_at_longest": jax_compiled_mib(low * 1024)}


def longest_within_budget(rows: list[dict], variant: str, power: int) -> dict | None:
    """The T at which a fit of peak RSS = a + b T^power over the measured lengths reaches the budget."""
    done = [r for r in rows if r["variant"] == variant and "peak_rss_mib" in r]
    if len(done) < 2:
        return None
    T = np.array([r["seq"] for r in done], float)
    peak = np.array([r["peak_rss_mib"] for r in done])
    b, a = np.polyfit(T**power, peak, 1)
    longest = ((BUDGET_MIB - a) / b) ** (1 / power)
    return {"variant": variant, "fit": f"{a:.0f} MiB + {b:.3g} MiB x T^{power}", "longest_tokens": int(longest)}


def table(rows: list[dict]) -> str:
    lines = ["| tokens | framework | tokens/s | step s | peak RSS MiB |", "|---:|---|---:|---:|---:|"]
    names = {"jax": "jaxtune", "torch:sdpa": "PEFT (sdpa)", "torch:eager": "PEFT (eager)"}
    for r in sorted(rows, key=lambda r: (r["seq"], VARIANTS.index(r["variant"]))):
        if "tokens_per_s" in r:
            lines.append(f"| {r['seq']:,} | {names[r['variant']]} | {r['tokens_per_s']:.0f} | {r['step_s_median']:.1f} "
                         f"| {r['peak_rss_mib']:.0f} |")
        else:
            lines.append(f"| {r['seq']:,} | {names[r['variant']]} | — | — | "
                         f"{'over 8 GiB' if r.get('over_budget') else 'failed'} |")
    return "\n".join(lines)


CONTEXT_LENGTHS = (8192, 16384, 32768, 65536, 131072)
CONTEXT_WAYS = (1, 2, 4, 8)


def context_rows() -> list[dict]:
    """Per-device compiled MiB of the LoRA step for each T, N and strategy (run under 8 fake devices)."""
    from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.planner import compile_step

    rows = []
    for seq in CONTEXT_LENGTHS:
        cfg = ModelConfig(**M.SHAPE, max_position_embeddings=seq)
        for ways in CONTEXT_WAYS:
            for strategy in ("ring", "all_gather") if ways > 1 else ("ring",):
                plan = TrainPlan(M.method("lora_qv"), 1, seq, 1,
                                 param_dtype="float32",
                                 forward=ForwardOptions(compute_dtype="float32", remat="full",
                                                        context_attention=strategy),
                                 mesh=MeshConfig(fsdp=1, context=ways))
                compiled = compile_step(cfg, plan)
                rows.append({"seq": seq, "context": ways, "strategy": strategy if ways > 1 else "-",
                             "device_mib": compiled.total_bytes / 2**20, "temp_mib": compiled.temp_bytes / 2**20,
                             "compile_s": compiled.compile_seconds})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def context_table(rows: list[dict]) -> str:
    lines = ["| tokens | context | strategy | MiB a device | of which temporaries | vs context 1 |",
             "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        one = next(o for o in rows if o["seq"] == r["seq"] and o["context"] == 1)
        lines.append(f"| {r['seq']:,} | {r['context']} | {r['strategy']} | {r['device_mib']:,.0f} | "
                     f"{r['temp_mib']:,.0f} | {r['device_mib'] / one['device_mib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--only", choices=VARIANTS)
    parser.add_argument("--context", action="store_true", help="the context-parallel table (8 fake devices)")
    args = parser.parse_args()
    if args.context:
        if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
            sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
        rows = context_rows()
        print(context_table(rows))
        out = HERE / "results" / "long_context_parallel.json"
        out.write_text(json.dumps({"cpu": os.uname().machine, "rows": rows}, indent=2) + "\n")
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq, args.steps)))
        return
    rows = []
    for seq in args.lengths:
        for variant in VARIANTS if args.only is None else (args.only,):
            if any(r["variant"] == variant and r.get("over_budget") for r in rows):
                continue  # longer sequences only need more
            row = spawn(variant, seq, 2 if seq <= 4096 else 1)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("variant", "seq", "tokens_per_s", "peak_rss_mib",
                                                      "over_budget", "error")}), flush=True)
    longest = [x for x in (jax_longest_within_budget(rows), longest_within_budget(rows, "torch:sdpa", 1),
                           longest_within_budget(rows, "torch:eager", 2)) if x]
    print(table(rows))
    for x in longest:
        print(x)
    out = HERE / "results" / "long_context.json"
    out.write_text(json.dumps({"cpu": os.uname().machine, "budget_mib": BUDGET_MIB, "rows": rows,
                               "longest": longest}, indent=2) + "\n")


if __name__ == "__main__":
    main()
