"""GRPO seconds a step with a slow reward: synchronous rollouts (`[grpo] off_policy_steps = 0`) against one-step-off
(`= 1`: step t + 1's batch is scored on the host while the device runs step t), the same model, prompts and config,
through `fine_tune`, the two runs in turns.

    .venv/bin/python benchmarks/grpo_one_step_off.py                        # 8 steps each, a 0.5 s reward
    .venv/bin/python benchmarks/grpo_one_step_off.py --steps 4 --reward-s 0.2

A random Llama (`--layers` of `--hidden`, the byte-level vocabulary), LoRA r=8 on every linear layer, float32;
`--prompts` prompts x group 4, up to 16 new tokens. The reward (`reward` below) sleeps `--reward-s` seconds, as a
judge or a sandbox would take. A step's seconds are its metrics record's `time_data_s + time_step_s` (the rollout,
the reward, the step and the wait for its metrics), the first two steps (compiles) left out. Results go to
benchmarks/results/grpo_one_step_off.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from generation_throughput import cpu_name

HERE = Path(__file__).resolve().parent
SLEEP = {"s": 0.5}


def reward(prompts, completions):
    """The share of 'a' in each completion, after `SLEEP["s"]` seconds."""
    time.sleep(SLEEP["s"])
    return [c.count("a") / max(len(c), 1) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps a run (default 8; the first two not timed)")
    parser.add_argument("--reward-s", type=float, default=0.5, help="the reward's seconds a call (default 0.5)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step (default 8)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, in turns (default 2)")
    parser.add_argument("--out", default=str(HERE / "results" / "grpo_one_step_off.json"))
    args = parser.parse_args()
    SLEEP["s"] = args.reward_s
    sys.modules.setdefault("grpo_one_step_off", sys.modules[__name__])  # the reward's dotted path

    from jaxtune.presets import write_random_model
    from jaxtune.run_config import load_run_config
    from jaxtune.train.loop import fine_tune

    root = Path(tempfile.mkdtemp(prefix="grpo-one-step-off-"))
    write_random_model(root / "model", "llama", seed=0, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_layers=args.layers, initializer_range=0.3, max_position_embeddings=128)
    words = ["Write:", "Say:", "Go:", "Now:", "Tell:", "Sing:", "Do:", "Ask:"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{words[i % 8]} {i}"}) + "\n"
                                                for i in range(args.prompts)))
    seconds: dict[str, list[float]] = {"0": [], "1": []}
    phases: dict[str, list[tuple[float, float]]] = {"0": [], "1": []}
    for run in range(args.rounds):
        for off in ("0", "1"):
            out = root / f"run-{off}-{run}"
            config = root / f"{out.name}.toml"
            config.write_text(f"""[model]\npath = "{root / 'model'}"\n[method]\nkind = "lora"\nrank = 8
target_modules = ["all-linear"]\n[data]\ntrain = "{root / 'prompts.jsonl'}"\nmax_seq_len = 32\neval_fraction = 0.0
[train]\nobjective = "grpo"\noutput_dir = "{out}"\nbatch_size = {args.prompts}\nmax_steps = {args.steps}
learning_rate = 1e-3\nlog_every = 1\ncheckpoint_every = 0\n[grpo]\nreward = "grpo_one_step_off.reward"
group_size = 4\nmax_new_tokens = 16\noff_policy_steps = {off}\n""")
            fine_tune(load_run_config(config), log=lambda _: None)
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in records if "loss" in r][2:]
            seconds[off] += [r["time_data_s"] + r["time_step_s"] for r in steps]
            phases[off] += [(r["time_data_s"], r["time_step_s"]) for r in steps]
            data, step = np.median([r["time_data_s"] for r in steps]), np.median([r["time_step_s"] for r in steps])
            print(f"off_policy_steps = {off}, round {run + 1}: {np.median(seconds[off][-len(steps):]):.3f} s a step "
                  f"(median; data {data:.3f} s, step and its metrics {step:.3f} s)", flush=True)
    result = {"args": vars(args), "median_s": {k: float(np.median(v)) for k, v in seconds.items()},
              "seconds": seconds, "data_and_step_s": phases, "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name()}
    print(json.dumps(result["median_s"]))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
