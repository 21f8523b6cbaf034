"""jaxtune's train step against PyTorch+PEFT's on one GPU, in bfloat16, within a fixed wall-clock budget.

    python benchmarks/device_run.py                  # on the GPU machine: installs what is missing, then measures
    python benchmarks/device_run.py --dry-run        # the same flow on this CPU, tiny shapes, no installs
    python benchmarks/device_run.py --only 1b:lora,1b:layer --no-torch --budget-s 120

Shapes: Llama-3.2-1B (4 of its 16 layers, tied head) and Llama-3.1-8B (2 of its 32 layers), their real widths,
heads and 128,256-token vocabulary; batch 4 x 1024 tokens (DPO: 4 pairs). Methods: full fine-tune, LoRA on every
linear layer, QLoRA (NF4, double quantisation; torch's side needs bitsandbytes, else n/a) and DPO with LoRA (torch:
TRL's log-probabilities and sigmoid loss, the reference the base with adapters off); rank 16, alpha 32; AdamW 2e-4,
clipping at 1.0 (`_device_workers.py` says how each side is built). jaxtune's train step packs rows (segment ids),
which cuDNN's attention does not take, so its "auto" attention is the blockwise kernel there; the two kernels are
compared on one layer's causal attention, forward and backward, at the first shape's heads on the same batch.

Per row: tokens/s and step time (median of the timed steps after warm-up), jaxtune's compile seconds, MFU against
the device's dense bfloat16 peak (the planner's catalogue: 989.5 TFLOP/s for an H200 SXM) with the FLOPs of
`_device_workers.model_flops` (6 N per token + PaLM's attention term), the device's peak memory, and the planner's
prediction of jaxtune's run (`planner.estimate(...).peak_bytes`) with the ratio measured / predicted (for torch's
row too, as a yardstick). Each worker runs in its own process with `--config-s` seconds at most; the whole run,
installs included, stops starting workers when under MIN_WORKER_S of `--budget-s` is left, and says which it skipped.
Prints a markdown table; writes one JSON (`--output`; a dry run's apart) with the machine (GPU, driver, CUDA,
package versions), after every worker, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]
# Only the standard library at import: `_device_workers` (numpy, jaxtune) is imported where used, on a bare machine
# after `install`.

BUDGET_S, CONFIG_S, MIN_WORKER_S = 480.0, 120.0, 20.0
GPU_RUN = dict(shapes=("1b", "8b"), batch=4, seq=1024, warmup=2, steps=5, device="h200")
DRY_RUN = dict(shapes=("tiny",), batch=2, seq=32, warmup=1, steps=2, device="cpu")
ATTENTION_AFTER = "lora"  # the one-layer attention workers run after the first shape's LoRA
ATTENTION_KERNELS = ("cudnn", "blockwise")
# What the GPU run needs: the bench extra's pins (pyproject.toml: torch, transformers, peft, trl), jaxtune's own
# dependencies, and JAX's CUDA wheels (`cuda_jax`).
BENCH_EXTRA = f"{REPO}[bench]"
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "torch", "transformers", "peft", "trl", "bitsandbytes", "optax")
LABELS = {"full": "full", "lora": "LoRA (all-linear)", "qlora": "QLoRA (NF4, all-linear)", "dpo_lora": "DPO (LoRA)"}


def worker_names(shapes: tuple[str, ...], torch: bool, only: str | None) -> list[str]:
    """"jax:SHAPE:METHOD", "torch:SHAPE:METHOD" and "attention:SHAPE:layer:KERNEL", first shape first; `only`
    keeps those whose "SHAPE:METHOD" or full name it lists (comma-separated)."""
    import _device_workers as W

    names = []
    for shape in shapes:
        for method in W.METHODS:
            names.append(f"jax:{shape}:{method}")
            if torch:
                names.append(f"torch:{shape}:{method}")
            if method == ATTENTION_AFTER and shape == shapes[0]:
                names += [f"attention:{shape}:layer:{kernel}" for kernel in ATTENTION_KERNELS]
    if only:
        wanted = set(only.split(","))
        names = [n for n in names if n in wanted or ":".join(n.split(":")[1:3]) in wanted]
        if not names:
            raise SystemExit(f"--only {only!r} matches nothing; configs: "
                             + ", ".join(f"{s}:{m}" for s in shapes for m in W.METHODS))
    return names


def run_worker(name: str, setting: dict) -> dict:
    """Measure one worker in this process."""
    import _device_workers as W

    framework, shape, method, *kernel = name.split(":")
    sizes = (setting["batch"], setting["seq"], setting["warmup"], setting["steps"])
    if framework == "attention":
        return W.attention_run(shape, kernel[0], *sizes)
    if framework == "jax":
        return W.jax_run(shape, method, *sizes, setting["device"])
    return W.torch_run(shape, method, *sizes)


def describe(name: str) -> dict:
    """A worker's name as the fields of its record."""
    framework, shape, method, *kernel = name.split(":")
    return {"name": name, "framework": framework, "shape": shape, "method": method,
            "kernel": kernel[0] if kernel else None}


def spawn(name: str, dry_run: bool, device: str, timeout_s: float) -> dict:
    """One worker in a fresh interpreter (its memory peak its own); its last stdout line is its JSON result."""
    record = describe(name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--device", device] + \
        (["--dry-run"] if dry_run else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**record, "error": f"timed out after {timeout_s:.0f} s"}
    record["process_wall_s"] = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {**record, "error": " | ".join(tail)}
    return {**record, **json.loads(proc.stdout.strip().splitlines()[-1])}


def with_utilisation(result: dict, setting: dict, peak_flops: float) -> dict:
    """The result with its step's model FLOPs, achieved TFLOP/s and MFU (against `peak_flops`)."""
    import _device_workers as W

    if "step_s_median" not in result or result["framework"] == "attention":
        return result
    flops = W.model_flops(result["shape"], result["method"], setting["batch"], setting["seq"])
    achieved = flops / result["step_s_median"]
    return {**result, "model_flops": flops, "tflops_per_s": achieved / 1e12, "mfu": achieved / peak_flops}


def _python_ok(code: str) -> bool:
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def cuda_jax() -> str:
    """JAX's CUDA 12 wheels, at the version of an installed jax (a CPU-only one), else the newest."""
    try:
        return f"jax[cuda12]=={importlib.metadata.version('jax')}"
    except importlib.metadata.PackageNotFoundError:
        return "jax[cuda12]"


def install() -> dict:
    """pip-install the bench extra and `cuda_jax()` where JAX sees no GPU, torch no CUDA, or a package is missing;
    bitsandbytes on its own (QLoRA's torch side only: a failure leaves that row n/a). Returns what it did and how
    long it took."""
    t0 = time.perf_counter()
    ready = (_python_ok("import jax; assert jax.default_backend() == 'gpu'")
             and _python_ok("import torch; assert torch.cuda.is_available()")
             and _python_ok("import transformers, peft, trl, optax, orbax.checkpoint, safetensors"))
    done: dict = {"required": "present" if ready else "installed"}
    if not ready:
        subprocess.run([sys.executable, "-m", "pip", "install", BENCH_EXTRA, cuda_jax()], check=True)
    if not _python_ok("import bitsandbytes"):
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "bitsandbytes"])
        done["bitsandbytes"] = "installed" if pip.returncode == 0 else "install failed"
    return {**done, "seconds": time.perf_counter() - t0}


def machine() -> dict:
    """The GPU (name, driver, memory, CUDA version, from nvidia-smi, where there is one) and package versions."""
    host: dict = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            host[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {**host, "gpu": None}
    gpu, driver, memory = (field.strip() for field in query.splitlines()[0].split(","))
    cuda = header.split("CUDA Version:")[1].split()[0] if "CUDA Version:" in header else None
    return {**host, "gpu": gpu, "driver": driver, "gpu_memory": memory, "cuda_driver_version": cuda}


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def table(results: list[dict], dry_run: bool) -> str:
    """The markdown table (per configuration jaxtune's row, then PyTorch's), then the attention kernels' line."""
    steps = [r for r in results if r["framework"] != "attention"]
    planned = {(r["shape"], r["method"]): r.get("planned_peak_bytes") for r in steps if r["framework"] == "jax"}
    torch_speed = {(r["shape"], r["method"]): r["tokens_per_s"] for r in steps
                   if r["framework"] == "torch" and "tokens_per_s" in r}
    rows = ["| config | framework | tokens/s | step ms | compile s | MFU | peak GiB | planned GiB | peak / planned | "
            "vs PyTorch |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in steps:
        key = (r["shape"], r["method"])
        config = f"{r['shape']} {LABELS[r['method']]}"
        framework = f"jaxtune ({r.get('attention_kernel', 'attention n/a')})" if r["framework"] == "jax" else \
            ("PyTorch" if r["method"] == "full" else "PyTorch+PEFT")
        if "tokens_per_s" not in r:
            why = r.get("unavailable") or r.get("error", "").split(" | ")[-1]
            rows.append(f"| {config} | {framework} | n/a ({why}) |  |  |  |  |  |  |  |")
            continue
        ratio = "n/a" if r["peak_bytes"] is None or not planned.get(key) else f"{r['peak_bytes'] / planned[key]:.2f}"
        speed = f"{r['tokens_per_s'] / torch_speed[key]:.2f}x" if r["framework"] == "jax" and key in torch_speed else ""
        compile_s = "—" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        rows.append(f"| {config} | {framework} | {r['tokens_per_s']:.0f} | {1e3 * r['step_s_median']:.1f} | "
                    f"{compile_s} | {100 * r['mfu']:.1f}% | {_gib(r['peak_bytes'])} | {_gib(planned.get(key))} | "
                    f"{ratio} | {speed} |")
    lines = ["\n".join(rows)]
    layer = {r["kernel"]: r for r in results if r["framework"] == "attention" and "step_s_median" in r}
    if len(layer) == len(ATTENTION_KERNELS):
        cudnn, blockwise = (layer[k] for k in ATTENTION_KERNELS)
        lines.append(f"attention, one layer forward + backward ({cudnn['shape']} heads, bfloat16): "
                     f"cuDNN ({cudnn['implementation']}) {1e3 * cudnn['step_s_median']:.2f} ms, blockwise "
                     f"{1e3 * blockwise['step_s_median']:.2f} ms: cuDNN "
                     f"{blockwise['step_s_median'] / cudnn['step_s_median']:.2f}x as fast")
    if dry_run:
        lines.insert(0, "**Dry run**: CPU, tiny shapes; the numbers test the flow and say nothing about a GPU.")
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="this CPU, tiny shapes, a few steps, no installs")
    parser.add_argument("--only", help="comma-separated configs (1b:lora, 8b:full, ..., 1b:layer: the attention "
                                       "kernels) or workers (jax:1b:lora, torch:1b:qlora, attention:1b:layer:cudnn)")
    parser.add_argument("--no-torch", action="store_true", help="jaxtune only")
    parser.add_argument("--no-install", action="store_true", help="never pip-install (the packages are there)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's wall-clock seconds")
    parser.add_argument("--config-s", type=float, default=CONFIG_S, help="one worker's seconds at most")
    parser.add_argument("--device", help="the planner's name of the accelerator, for its peak FLOP/s and the "
                                         "predicted memory (default: h200; cpu with --dry-run)")
    parser.add_argument("--output", help="the JSON (default: benchmarks/results/device_run.json, with --dry-run "
                                         "device_run_dry.json: a dry run never overwrites a GPU run)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setting = {**(DRY_RUN if args.dry_run else GPU_RUN), **({"device": args.device} if args.device else {})}
    if args.worker:
        print(json.dumps(run_worker(args.worker, setting)))
        return

    output = args.output or str(HERE / "results" / ("device_run_dry.json" if args.dry_run else "device_run.json"))
    start = time.perf_counter()
    installed = None if args.dry_run or args.no_install else install()
    importlib.invalidate_caches()  # the finders' listings of site-packages predate the install
    # after the install: these need numpy and jaxtune's dependencies
    import _device_workers as W

    from jaxtune.planner import get_device

    device = get_device(setting["device"])
    report = {"dry_run": args.dry_run, "machine": machine(), "install": installed, "budget_s": args.budget_s,
              "config_s": args.config_s, **{k: v for k, v in setting.items() if k != "shapes"},
              "shapes": {s: W.SHAPES[s] for s in setting["shapes"]}, "peak_bf16_flops": device.peak_bf16,
              "flops": W.model_flops.__doc__, "results": [], "skipped": []}
    for name in worker_names(setting["shapes"], not args.no_torch, args.only):
        left = args.budget_s - (time.perf_counter() - start)
        if left < MIN_WORKER_S:
            report["skipped"].append(f"{name}: {max(left, 0):.0f} s of the {args.budget_s:.0f} s budget left")
            print(f"{name}: skipped, out of time", file=sys.stderr, flush=True)
            continue
        measured = spawn(name, args.dry_run, setting["device"], min(args.config_s, left))
        result = with_utilisation(measured, setting, device.peak_bf16)
        report["results"].append(result)
        summary = (f"{result['tokens_per_s']:.0f} tokens/s, {1e3 * result['step_s_median']:.1f} ms/step"
                   if "tokens_per_s" in result else result.get("unavailable") or result.get("error"))
        print(f"{name}: {summary}", file=sys.stderr, flush=True)
        report["elapsed_s"] = time.perf_counter() - start
        write(output, report)
    report["elapsed_s"] = time.perf_counter() - start
    write(output, report)
    print(table(report["results"], args.dry_run))
    if report["skipped"]:
        print("\nskipped (out of time): " + "; ".join(report["skipped"]))


def write(path: str, report: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
