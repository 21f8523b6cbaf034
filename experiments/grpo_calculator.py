"""Multi-turn GRPO on a two-tool calculator episode (issue 51).

"What is (23 + 45) * 6?" or "What is 23 * 6 + 45?": the model calls `add` and `multiply` (`grpo_tasks`, run by
jaxtune's `ToolEnvironment` in its worker process, Hermes `<tool_call>` turns), reads their replies and states the
number; `grpo_tasks.calculator_solved` scores the episode 1 when that number is right.

1. Generate the episodes (seeded, no download): SFT transcripts, GRPO prompts and held-out prompts, all distinct.
2. Build a tiny Llama (byte-level tokenizer, a "role: content" chat template) and SFT it on the transcripts (a full
   fine-tune, the loss on the assistant turns). 60% of them are a careless teacher's, who stops after the first call
   and states its reply (`slip`): the SFT model learns when to stop from them, and GRPO has that choice to correct.
3. Multi-turn GRPO (`[grpo] environment = "tools"`, `fine_tune` on a TOML config written here); the held-out success
   rate is the run's `eval_reward` (greedy episodes of the held-out prompts) at step 0 (the baseline) and every
   `eval_every` steps.
4. Write experiments/results/grpo_calculator.json and .png.

    PYTHONPATH=. python experiments/grpo_calculator.py [--quick] [--out runs/grpo_calculator]
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

FULL = dict(sft_examples=3000, sft_steps=2400, grpo_prompts=1500, held_out=100, grpo_steps=30, prompts_per_step=8,
            group_size=8, max_new_tokens=96, max_turns=4, eval_every=5, learning_rate=1e-4, small=True, slip=0.6)
QUICK = dict(sft_examples=200, sft_steps=10, grpo_prompts=64, held_out=8, grpo_steps=2, prompts_per_step=2,
             group_size=4, max_new_tokens=96, max_turns=3, eval_every=2, learning_rate=5e-4, small=True, slip=0.6)
OPTIONS = {"family": "hermes", "tools": ["grpo_tasks.add", "grpo_tasks.multiply"],
           "reward": "grpo_tasks.calculator_solved"}
SEQ_LEN = 320  # a solved episode is ~250 bytes in the template; a turn may start as late as SEQ_LEN, so the model
# holds SEQ_LEN + max_new_tokens positions


def calls_made(model: Path, held_out: list[dict], size: dict) -> dict:
    """What the model does on the held-out prompts: the share of its episodes that make both calls, and their
    success, greedy and sampled (temperature 1, one episode a prompt, seed 3)."""
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.objectives.episode_rollouts import episode_rollouts
    from jaxtune.objectives.rollout_config import GRPOConfig
    from jaxtune.spine.model import load_model

    cfg, params = load_model(model)
    tokenizer = load_tokenizer(model)
    found = {}
    for name, temperature, top_k in (("greedy", 1e-6, 1), ("sampled", 1.0, 0)):
        section = GRPOConfig(environment="tools", environment_options=OPTIONS | {"max_turns": size["max_turns"]},
                             max_new_tokens=size["max_new_tokens"], temperature=temperature, top_k=top_k)
        ids, _, rewards = episode_rollouts(params, cfg, None, held_out, section, 3, cfg.eos_token_id, tokenizer,
                                           SEQ_LEN + 1)
        both = [r for row, r in zip(ids, rewards) if tokenizer.decode(row).count("<tool_call>") == 2]
        found[name] = {"both_calls": len(both) / len(ids), "success": sum(rewards) / len(ids),
                       "success_with_both_calls": sum(both) / max(len(both), 1)}
    return found


def run(out: Path, quick: bool, log=print) -> dict:
    size = QUICK if quick else FULL
    started = time.perf_counter()
    held_out = tasks.calculator_examples(size["held_out"], seed=1, small=size["small"])
    seen = frozenset(r["prompt"] for r in held_out)
    sft = tasks.calculator_examples(size["sft_examples"], seed=2, exclude=seen, small=size["small"], slip=size["slip"])
    prompts = tasks.calculator_examples(size["grpo_prompts"], seed=3, exclude=seen | {r["prompt"] for r in sft},
                                        small=size["small"])
    data = out / "data"
    tasks.write_jsonl(data / "sft.jsonl", sft, ("messages",))
    tasks.write_jsonl(data / "sft_eval.jsonl", held_out, ("messages",))
    tasks.write_jsonl(data / "prompts.jsonl", prompts, ("prompt", "answer"))
    tasks.write_jsonl(data / "held_out.jsonl", held_out, ("prompt", "answer"))

    log(f"[1/2] tiny Llama, SFT on {len(sft)} solved episodes ({size['sft_steps']} steps) ...")
    model = tasks.tiny_model(out / "random-init", seed=0, max_positions=SEQ_LEN + size["max_new_tokens"] + 32)
    sft_config = tasks.write_toml(out / "sft.toml", {
        "model": {"path": str(model)}, "method": {"kind": "full"},
        "data": {"train": str(data / "sft.jsonl"), "eval": str(data / "sft_eval.jsonl"), "max_seq_len": SEQ_LEN},
        "train": {"output_dir": str(out / "sft"), "max_steps": size["sft_steps"], "batch_size": 8,
                  "learning_rate": 3e-3, "warmup_steps": 20, "log_every": 10, "eval_every": size["sft_steps"]}})
    sft_result, sft_seconds, sft_records = tasks.timed_fine_tune(sft_config, log)
    log(f"      held-out loss on the assistant turns {sft_records[-1].get('eval_loss', float('nan')):.3f} "
        f"({sft_seconds:.0f} s)")

    log(f"[2/2] multi-turn GRPO: {size['grpo_steps']} steps of {size['prompts_per_step']} prompts x "
        f"{size['group_size']} episodes (<= {size['max_turns']} turns of <= {size['max_new_tokens']} tokens), "
        f"held-out success every {size['eval_every']} steps ...")
    grpo_config = tasks.write_toml(out / "grpo.toml", {
        "model": {"path": str(sft_result.result_path)}, "method": {"kind": "full"},
        "data": {"train": str(data / "prompts.jsonl"), "eval": str(data / "held_out.jsonl"), "max_seq_len": SEQ_LEN},
        "train": {"objective": "grpo", "output_dir": str(out / "grpo"), "max_steps": size["grpo_steps"],
                  "batch_size": size["prompts_per_step"], "learning_rate": size["learning_rate"],
                  "schedule": "constant", "log_every": 1, "eval_every": size["eval_every"]},
        "grpo": {"environment": "tools", "environment_options": OPTIONS | {"max_turns": size["max_turns"]},
                 "group_size": size["group_size"], "max_new_tokens": size["max_new_tokens"], "temperature": 1.0,
                 "kl_coef": 0.04, "loss_type": "grpo"}})
    grpo_result, grpo_seconds, records = tasks.timed_fine_tune(grpo_config, log)
    summary = tasks.grpo_summary(records, grpo_seconds)
    summary["calls_before"] = calls_made(sft_result.result_path, held_out, size)
    summary["calls_after"] = calls_made(grpo_result.result_path, held_out, size)
    log(f"      greedy episodes making both calls {summary['calls_before']['greedy']['both_calls']:.2f} -> "
        f"{summary['calls_after']['greedy']['both_calls']:.2f}")
    held = summary["held_out"]
    summary = {"example": "grpo_calculator", "quick": quick, "model": "tiny Llama (4 layers, hidden 128, "
               "byte-level), SFT from random weights", "sizes": size, "seq_len": SEQ_LEN,
               "held_out_prompts": len(held_out), "success_before": held[0]["eval_reward"],
               "success_after": held[-1]["eval_reward"], "sft_seconds": round(sft_seconds, 1),
               "sft_eval_loss": sft_records[-1].get("eval_loss"), **summary,
               "total_seconds": round(time.perf_counter() - started, 1)}
    log(f"      held-out success {summary['success_before']:.3f} -> {summary['success_after']:.3f}; "
        f"GRPO {grpo_seconds:.0f} s (rollouts {summary['rollout_share']:.0%} of rollouts + steps)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, a minute or two")
    parser.add_argument("--out", default="runs/grpo_calculator")
    parser.add_argument("--results", default=str(HERE / "results"))
    args = parser.parse_args()
    summary = run(Path(args.out), args.quick)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = "grpo_calculator" + ("_quick" if args.quick else "")
    (results / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    figure = tasks.plot(results / f"{name}.png", summary, "Multi-turn GRPO on a two-tool calculator (tiny Llama)",
                        "success rate")
    print(f"wrote {results / f'{name}.json'}" + (f" and {figure}" if figure else ""))


if __name__ == "__main__":
    main()
