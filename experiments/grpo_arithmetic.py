"""GRPO on a verifiable math-style task: arithmetic chains ("Q: 7+8-5+9\nA:") with an `answer` field (issue 51).

1. Generate the data (seeded, no download): SFT chats, GRPO prompts and held-out prompts, all distinct.
2. Build a tiny Llama (byte-level tokenizer) and SFT it (a full fine-tune) on demonstrations from a careless
   teacher: in `slip` of them (60%) the last line states the value before the last step. The imitator learns the
   chains and the slip; the answers' checker (the reward) sees every slip, which leaves GRPO something to raise.
3. GRPO (full fine-tune, `fine_tune` on a TOML config written here) with the exact-answer reward
   `grpo_tasks.arithmetic_reward`, rollouts of up to `max_new_tokens` (1024 in the full run) sampled at
   temperature 1; the held-out accuracy is the run's `eval_reward` (greedy completions of the held-out prompts),
   at step 0 (the baseline) and every `eval_every` steps.
4. Write experiments/results/grpo_arithmetic.json and .png.

    PYTHONPATH=. python experiments/grpo_arithmetic.py [--quick] [--out runs/grpo_arithmetic]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)

import grpo_tasks as tasks  # noqa: E402

FULL = dict(sft_examples=8000, sft_steps=800, slip=0.6, grpo_prompts=2000, held_out=200, grpo_steps=30,
            prompts_per_step=16, group_size=8, max_new_tokens=1024, eval_every=10, learning_rate=5e-5)
QUICK = dict(sft_examples=200, sft_steps=10, slip=0.6, grpo_prompts=64, held_out=16, grpo_steps=2, prompts_per_step=4,
             group_size=4, max_new_tokens=64, eval_every=2, learning_rate=5e-4)


def run(out: Path, quick: bool, log=print) -> dict:
    size = QUICK if quick else FULL
    started = time.perf_counter()
    held_out = tasks.arithmetic_examples(size["held_out"], seed=1)
    seen = frozenset(r["prompt"] for r in held_out)
    sft = tasks.arithmetic_examples(size["sft_examples"], seed=2, exclude=seen, slip=size["slip"])
    prompts = tasks.arithmetic_examples(size["grpo_prompts"], seed=3, exclude=seen | {r["prompt"] for r in sft})
    data = out / "data"
    tasks.write_jsonl(data / "sft.jsonl", sft, ("prompt", "completion"))
    tasks.write_jsonl(data / "sft_eval.jsonl", held_out, ("prompt", "completion"))
    tasks.write_jsonl(data / "prompts.jsonl", prompts, ("prompt", "answer"))
    tasks.write_jsonl(data / "held_out.jsonl", held_out, ("prompt", "answer"))
    seq_len = 32 + size["max_new_tokens"]  # the longest prompt is 19 bytes with BOS

    log(f"[1/2] tiny Llama, SFT on {len(sft)} worked chains ({size['sft_steps']} steps) ...")
    model = tasks.tiny_model(out / "random-init", seed=0, max_positions=seq_len + 64)
    sft_config = tasks.write_toml(out / "sft.toml", {
        "model": {"path": str(model)}, "method": {"kind": "full"},
        "data": {"train": str(data / "sft.jsonl"), "eval": str(data / "sft_eval.jsonl"), "max_seq_len": 96},
        "train": {"output_dir": str(out / "sft"), "max_steps": size["sft_steps"], "batch_size": 16,
                  "learning_rate": 3e-3, "warmup_steps": 20, "log_every": 10, "eval_every": size["sft_steps"]}})
    sft_result, sft_seconds, sft_records = tasks.timed_fine_tune(sft_config, log)
    log(f"      held-out completion loss {sft_records[-1].get('eval_loss', float('nan')):.3f} ({sft_seconds:.0f} s)")

    log(f"[2/2] GRPO: {size['grpo_steps']} steps of {size['prompts_per_step']} prompts x {size['group_size']} "
        f"rollouts (<= {size['max_new_tokens']} tokens), held-out accuracy every {size['eval_every']} steps ...")
    grpo_config = tasks.write_toml(out / "grpo.toml", {
        "model": {"path": str(sft_result.result_path)}, "method": {"kind": "full"},
        "data": {"train": str(data / "prompts.jsonl"), "eval": str(data / "held_out.jsonl"), "max_seq_len": seq_len},
        "train": {"objective": "grpo", "output_dir": str(out / "grpo"), "max_steps": size["grpo_steps"],
                  "batch_size": size["prompts_per_step"], "learning_rate": size["learning_rate"],
                  "schedule": "constant", "log_every": 1, "eval_every": size["eval_every"]},
        "grpo": {"reward": "grpo_tasks.arithmetic_reward", "group_size": size["group_size"],
                 "max_new_tokens": size["max_new_tokens"], "temperature": 1.0, "kl_coef": 0.04,
                 "loss_type": "grpo", "mask_truncated_completions": True, "rollout_engine": "paged",
                 "rollout_slots": size["prompts_per_step"] * size["group_size"]}})
    _, grpo_seconds, records = tasks.timed_fine_tune(grpo_config, log)
    summary = tasks.grpo_summary(records, grpo_seconds)
    held = summary["held_out"]
    summary = {"example": "grpo_arithmetic", "quick": quick, "model": "tiny Llama (4 layers, hidden 128, byte-level), "
               "SFT from random weights", "sizes": size, "held_out_prompts": len(held_out),
               "accuracy_before": held[0]["eval_reward"], "accuracy_after": held[-1]["eval_reward"],
               "sft_seconds": round(sft_seconds, 1), "sft_eval_loss": sft_records[-1].get("eval_loss"), **summary,
               "total_seconds": round(time.perf_counter() - started, 1)}
    log(f"      held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}; "
        f"GRPO {grpo_seconds:.0f} s (rollouts {summary['rollout_share']:.0%} of rollouts + steps)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, a minute or two")
    parser.add_argument("--out", default="runs/grpo_arithmetic")
    parser.add_argument("--results", default=str(HERE / "results"))
    args = parser.parse_args()
    summary = run(Path(args.out), args.quick)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = "grpo_arithmetic" + ("_quick" if args.quick else "")
    (results / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    figure = tasks.plot(results / f"{name}.png", summary, "GRPO on arithmetic chains (tiny Llama, exact-answer "
                        "reward)", "accuracy")
    print(f"wrote {results / f'{name}.json'}" + (f" and {figure}" if figure else ""))


if __name__ == "__main__":
    main()
