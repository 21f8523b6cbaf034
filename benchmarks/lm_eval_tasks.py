"""Wall time of lm-eval tasks: jaxtune's model (`--model jaxtune`) against lm-eval's own `hf` model, same weights.

    python benchmarks/lm_eval_tasks.py [--tasks jaxtune_facts,jaxtune_qa] [--limit N] [--batch-size 16]

SmolLM2-135M-Instruct (the GGUF the demo uses) dequantised to float32 by transformers and saved once, so both models
read the same tensors. Each model runs in its own process, one after the other: `lm_eval.simple_evaluate` from model
load to results (jaxtune's compiles included; a second evaluation in the same process shows them apart). jaxtune
runs twice: with an empty compile cache (`compile_cache=`, filled as it goes), then in a new process that loads it,
as a second `jaxtune eval` of the same tasks would. Both models use every core (torch's intra-op threads, XLA's).
Prints a markdown table and writes results/lm_eval_tasks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def convert(directory: Path) -> Path:
    """transformers' float32 reading of the SmolLM2 GGUF, saved as a Hugging Face directory (once)."""
    if (directory / "model.safetensors").is_file():
        return directory
    import torch
    import transformers

    from jaxtune.demo import smollm2_path

    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def worker(kind: str, directory: str, tasks: list[str], limit: float | None, batch_size: int,
           compile_cache: str | None = None) -> dict:
    """One model's evaluation, timed from its construction; jaxtune runs twice (the second without compiles)."""
    import lm_eval

    from jaxtune.harness import JaxtuneLM, evaluate_tasks
    from jaxtune.harness.tasks import task_specs

    began = time.perf_counter()
    if kind == "hf":
        specs, manager = task_specs(tasks)
        results = lm_eval.simple_evaluate(model="hf", tasks=specs, task_manager=manager, limit=limit,
                                          model_args=f"pretrained={directory},dtype=float32,device=cpu",
                                          batch_size=batch_size, bootstrap_iters=0)
        return {"seconds": time.perf_counter() - began, "results": results["results"]}
    lm = JaxtuneLM(model=directory, batch_size=batch_size, compile_cache=compile_cache)
    results = evaluate_tasks(lm, tasks, limit=limit)
    first = time.perf_counter() - began
    again = time.perf_counter()
    evaluate_tasks(lm, tasks, limit=limit)
    return {"seconds": first, "warm_seconds": time.perf_counter() - again, "results": results["results"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="jaxtune_facts,jaxtune_qa")
    parser.add_argument("--limit", type=float)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--weights", default=str(Path(tempfile.gettempdir(), "jaxtune_smollm2_f32")),
                        help="where the float32 copy goes (540 MB)")
    parser.add_argument("--worker", choices=("hf", "jaxtune"), help=argparse.SUPPRESS)
    parser.add_argument("--compile-cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    if args.worker:
        print(json.dumps(worker(args.worker, args.weights, tasks, args.limit, args.batch_size, args.compile_cache)))
        return
    directory = convert(Path(args.weights))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        for run, kind in (("hf", "hf"), ("jaxtune", "jaxtune"), ("jaxtune_cached", "jaxtune")):
            out = subprocess.run([sys.executable, __file__, "--worker", kind, "--weights", str(directory), "--tasks",
                                  args.tasks, "--batch-size", str(args.batch_size),
                                  *(["--compile-cache", cache] if kind == "jaxtune" else []),
                                  *(["--limit", str(args.limit)] if args.limit else [])],
                                 capture_output=True, text=True, env=env, check=True)
            runs[run] = json.loads(out.stdout.strip().splitlines()[-1])
    record = {"cpu": cpu_model(), "cores": os.cpu_count(), "tasks": tasks, "limit": args.limit,
              "batch_size": args.batch_size, "time": time.strftime("%Y-%m-%d %H:%M"), **runs,
              "speedup": runs["hf"]["seconds"] / runs["jaxtune"]["seconds"],
              "speedup_cached": runs["hf"]["seconds"] / runs["jaxtune_cached"]["seconds"]}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "lm_eval_tasks.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['cpu']}, {record['cores']} cores; tasks {args.tasks}, limit {args.limit}, batch {args.batch_size}")
    metrics = [(t, m) for t, values in runs["hf"]["results"].items() for m in values
               if "," in m and "stderr" not in m and not m.startswith("sample_len")]
    header = " | ".join(f"{t} {m.split(',')[0]}" for t, m in metrics)
    print(f"| model | wall s | warm s (no compiles) | {header} |")
    print("|---|---:|---:|" + "---:|" * len(metrics))
    names = {"hf": "lm-eval hf", "jaxtune": "jaxtune", "jaxtune_cached": "jaxtune, compile cache filled"}
    for kind, name in names.items():
        run = runs[kind]
        warm = f"{run['warm_seconds']:.1f}" if "warm_seconds" in run else "-"
        print(f"| {name} | {run['seconds']:.1f} | {warm} | "
              + " | ".join(f"{run['results'][t][m]:.4f}" for t, m in metrics) + " |")
    print(f"jaxtune / hf speed: {record['speedup']:.2f}x (compile cache filled: {record['speedup_cached']:.2f}x)")


if __name__ == "__main__":
    main()
