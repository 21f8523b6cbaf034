"""Training throughput of jaxtune against PyTorch+PEFT at one fixed Llama shape, on whatever CPU runs it.

    .venv/bin/python benchmarks/train_throughput.py            # every configuration, both frameworks
    .venv/bin/python benchmarks/train_throughput.py --quick    # fewer steps
    .venv/bin/python benchmarks/train_throughput.py --only lora_qv

Shape: hidden 512, intermediate 1376, 8 layers, 8 heads / 4 KV heads (head_dim 64), vocab 8192, untied head;
batch 4 x 256 tokens, float32, loss on every token. Methods: full fine-tune, LoRA on q,v, LoRA on every linear
layer, QLoRA (NF4 with double quantisation, LoRA on q,v); LoRA rank 8, alpha 16; AdamW lr 2e-4, clipping at 1.0.

Each configuration runs in its own subprocess (`--worker`), so its peak RSS is its own. Per configuration:
tokens/s and step time (median of the timed steps, after warm-up steps), compile time (jaxtune: the train
step's `lower().compile()`; torch runs eagerly), peak RSS (the process's lifetime `ru_maxrss`), the RSS once the
model and optimiser state exist (baseline), and the high-water mark of compiling + training alone (train peak).
Torch runs with both "sdpa" and "eager" attention and the faster is kept. The ratio column divides tokens/s by
PyTorch+PEFT's on the same configuration. Results go to benchmarks/results/train_throughput.json.

XLA flags: none are set here; jaxtune runs with JAX's defaults (set XLA_FLAGS yourself to try others).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _measure as M  # noqa: E402

TORCH_ATTENTION = ("sdpa", "eager")
LABELS = {"full": "full", "lora_qv": "LoRA (q,v)", "lora_all": "LoRA (all-linear)", "qlora": "QLoRA (NF4, q,v)"}


def worker_names(only: str | None, torch_available: bool) -> list[str]:
    """Worker names "jax:CONFIG" and "torch:CONFIG:ATTN", filtered by `only` (a config or a worker name)."""
    names = []
    for config in M.METHODS:
        names.append(f"jax:{config}")
        if torch_available:
            attns = TORCH_ATTENTION if M.METHODS[config][0] != "qlora" else TORCH_ATTENTION[:1]
            names += [f"torch:{config}:{attn}" for attn in attns]
    if only:
        names = [n for n in names if only in (n, n.split(":")[1], ":".join(n.split(":")[:2]))]
        if not names:
            raise SystemExit(f"--only {only!r} matches nothing; configs: {', '.join(M.METHODS)}")
    return names


def run_worker(name: str, warmup: int, steps: int) -> dict:
    """Measure one configuration in this process and return its result."""
    framework, config, *rest = name.split(":")
    if framework == "jax":
        import _jax_worker

        return _jax_worker.run(config, warmup, steps)
    import _torch_worker

    return _torch_worker.run(config, rest[0], warmup, steps)


def spawn(name: str, warmup: int, steps: int) -> dict:
    """Run one worker in a fresh interpreter; its last stdout line is its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--warmup", str(warmup),
           "--steps", str(steps)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"framework": name.split(":")[0], "config": name.split(":")[1], "error": " | ".join(tail)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def best_torch(results: list[dict]) -> dict[str, dict]:
    """Per config, the torch variant with the highest tokens/s (or the unavailable/error record)."""
    best: dict[str, dict] = {}
    for r in results:
        if r["framework"] != "torch":
            continue
        current = best.get(r["config"])
        if current is None or r.get("tokens_per_s", 0) > current.get("tokens_per_s", 0):
            best[r["config"]] = r
    return best


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(results: list[dict]) -> str:
    """The markdown table: one jaxtune and one (best) PyTorch+PEFT row per configuration."""
    torch_best = best_torch(results)
    rows = ["| config | framework | tokens/s | step ms | compile s | peak RSS MiB (baseline / train peak) | "
            "ratio vs PEFT |", "|---|---|---:|---:|---:|---:|---:|"]
    for config in M.METHODS:
        jax_r = next((r for r in results if r["framework"] == "jax" and r["config"] == config), None)
        torch_r = torch_best.get(config)
        for r in (jax_r, torch_r):
            if r is None:
                continue
            framework = "jaxtune" if r["framework"] == "jax" else f"PyTorch+PEFT ({r.get('variant')})"
            if config == "full" and r["framework"] == "torch":
                framework = f"PyTorch ({r.get('variant')})"
            if "tokens_per_s" not in r:
                reason = r.get("unavailable") or r.get("error", "")
                rows.append(f"| {LABELS[config]} | {framework} | n/a | n/a | n/a | n/a | n/a ({reason}) |")
                continue
            ratio = "1.00" if r["framework"] == "torch" else "n/a"
            if r["framework"] == "jax" and torch_r and "tokens_per_s" in torch_r:
                ratio = f"{r['tokens_per_s'] / torch_r['tokens_per_s']:.2f}"
            memory = (f"{r['peak_rss_mib']:.0f} ({r['baseline_rss_mib']:.0f} / {r['train_peak_rss_mib']:.0f})")
            rows.append(f"| {LABELS[config]} | {framework} | {r['tokens_per_s']:.0f} | {1e3 * r['step_s_median']:.0f}"
                        f" | {_fmt(r['compile_s'], '.2f')} | {memory} | {ratio} |")
    return "\n".join(rows)


def targets(results: list[dict]) -> list[str]:
    """The issue's targets, checked against this run's numbers."""
    by = {(r["framework"], r["config"]): r for r in results if "tokens_per_s" in r}
    torch_best = best_torch(results)
    lines = []
    jax_qv, torch_qv = by.get(("jax", "lora_qv")), torch_best.get("lora_qv")
    if jax_qv and torch_qv and "tokens_per_s" in torch_qv:
        speed = jax_qv["tokens_per_s"] / torch_qv["tokens_per_s"]
        lines.append(f"LoRA (q,v) tokens/s vs PEFT: {speed:.2f}x (target >= 1.5x): {'met' if speed >= 1.5 else 'MISSED'}")
        ok = jax_qv["peak_rss_mib"] <= torch_qv["peak_rss_mib"]
        lines.append(f"LoRA (q,v) peak RSS {jax_qv['peak_rss_mib']:.0f} vs PEFT {torch_qv['peak_rss_mib']:.0f} MiB "
                     f"(target <=): {'met' if ok else 'MISSED'}")
    if jax_qv:
        ok = jax_qv["compile_s"] < 5
        lines.append(f"LoRA (q,v) compile {jax_qv['compile_s']:.2f} s (target < 5 s): {'met' if ok else 'MISSED'}")
    jax_q = by.get(("jax", "qlora"))
    if jax_q and jax_qv:
        slow = jax_q["step_s_median"] / jax_qv["step_s_median"]
        lines.append(f"QLoRA step / LoRA (q,v) step: {slow:.2f}x (target <= 1.5x): {'met' if slow <= 1.5 else 'MISSED'}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps (default 2 and 10)")
    parser.add_argument("--only", help="one config (full, lora_qv, lora_all, qlora) or worker (jax:lora_qv, ...)")
    parser.add_argument("--steps", type=int, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, help="untimed steps before timing")
    parser.add_argument("--no-torch", action="store_true", help="jaxtune only")
    parser.add_argument("--output", default=str(HERE / "results" / "train_throughput.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (3 if args.quick else 10)

    if args.worker:
        print(json.dumps(run_worker(args.worker, warmup, steps)))
        return

    try:
        import torch  # noqa: F401  (only to know whether the torch side can run; workers import their own)

        torch_available = not args.no_torch
    except ImportError:
        torch_available = False
    results = []
    for name in worker_names(args.only, torch_available):
        result = spawn(name, warmup, steps)
        results.append(result)
        summary = (f"{result['tokens_per_s']:.0f} tok/s, {1e3 * result['step_s_median']:.0f} ms/step"
                   if "tokens_per_s" in result else result.get("unavailable") or result.get("error"))
        print(f"{name}: {summary}", file=sys.stderr, flush=True)

    report = {"machine": {"cpu_count": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version(),
                          "xla_flags": os.environ.get("XLA_FLAGS", "")},
              "shape": M.SHAPE, "batch": [M.BATCH, M.SEQ], "warmup": warmup, "steps": steps, "results": results}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))
    print()
    print("\n".join(targets(results)))


if __name__ == "__main__":
    main()
