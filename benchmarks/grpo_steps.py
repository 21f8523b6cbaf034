"""GRPO steps/s with rollouts of mixed lengths: `[grpo] rollout_engine = "padded"` (`generate`) against "paged"
(the rollout engine), the same prompts, model and step, one run.

    .venv/bin/python benchmarks/grpo_steps.py                 # 8 prompts x group 8, up to 256 new tokens, ~10 min
    .venv/bin/python benchmarks/grpo_steps.py --steps 2 --max-new-tokens 64   # a quick look

A small Llama (8 layers of hidden 512, vocab 32,000) with random weights, float32, LoRA r=16 on every linear layer.
Rows end at mixed lengths: `--stop-share` of the vocabulary ends a row (random weights pick a stop token with about
that probability each step, so lengths run from a few tokens to `--max-new-tokens`). A GRPO step: sample the rows
(`grpo.sample_group`), score them (the share of even token ids: any reward will do), build the batch and take the
jitted step (rows laid out to the bucket of the longest, as the trainer does; `--rows-at-the-cap` adds a paged arm
whose rows are padded to max_seq_len, the layout before). Each engine runs `--steps` steps after a warm-up step
(its compiles, reported apart), interleaved step by step; steps/s, rollout tokens/s and the rollout's share of the
step are reported. Results go to benchmarks/results/grpo_steps.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
from generation_throughput import cpu_name

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, TrainConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives.grpo import group_advantages, rollout_batch, sample_group
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.parallel.mesh import make_mesh
from jaxtune.spine.run import abstract_run

HERE = Path(__file__).resolve().parent
CFG = ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4,
                  head_dim=64, max_position_embeddings=1024, eos_token_id=(2,), initializer_range=0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step (default 8)")
    parser.add_argument("--group", type=int, default=8, help="samples of each prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="a row's limit (default 256)")
    parser.add_argument("--stop-share", type=float, default=0.01, help="share of the vocabulary that ends a row")
    parser.add_argument("--steps", type=int, default=4, help="timed steps each after the warm-up (default 4)")
    parser.add_argument("--rows-at-the-cap", action="store_true",
                        help="a third arm: paged, the step's rows padded to max_seq_len, not to the longest's bucket")
    parser.add_argument("--out", default=str(HERE / "results" / "grpo_steps.json"))
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    prompts = [[1, *rng.randint(3, CFG.vocab_size, n).tolist()] for n in np.linspace(16, 96, args.prompts).astype(int)]
    stops = tuple(sorted({2, *rng.choice(np.arange(3, CFG.vocab_size), int(args.stop_share * CFG.vocab_size),
                                         replace=False).tolist()}))
    method = method_config("lora", rank=16, target_modules=("all-linear",))
    params = apply_method(init_params(CFG, jax.random.key(0)), CFG, method, jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    seq_len = max(map(len, prompts)) + args.max_new_tokens
    section = GRPOConfig(reward="bench", group_size=args.group, max_new_tokens=args.max_new_tokens, kl_coef=0.0,
                         rollout_slots=args.prompts * args.group // 2)
    plan = TrainPlan(method, args.prompts, seq_len, 1, param_dtype="float32", objective="grpo", section=section,
                     forward=ForwardOptions(compute_dtype="float32", remat="full"))
    run = abstract_run(CFG, plan, make_mesh(MeshConfig(), jax.devices()[:1]), TrainConfig(learning_rate=1e-4), 100)
    engines = {"padded": section, "paged": replace(section, rollout_engine="paged")}
    if args.rows_at_the_cap:
        engines["paged, rows at the cap"] = engines["paged"]
    states = {name: run.init_state(trainable, 0) for name in engines}
    times: dict[str, dict[str, list]] = {name: {"rollout": [], "step": [], "tokens": []} for name in engines}

    def one_step(name: str, seed: int) -> None:
        state = states[name]
        began = time.perf_counter()
        rows, completions = sample_group(combine(state["params"], frozen), CFG, method, prompts, engines[name], seed,
                                         stops)
        sampled = time.perf_counter()
        rewards = [float(np.mean(np.asarray(c) % 2 == 0)) if c else 0.0 for c in completions]
        batch = rollout_batch(rows, completions, rewards, group_advantages(rewards, section), seq_len,
                              reward_columns={"bench": rewards})  # the section's reward, by name
        if name.endswith("at the cap"):  # the layout before rows were cut to the bucket of the longest
            batch = {k: np.pad(v, ((0, 0), (0, seq_len - v.shape[1]))) if v.ndim == 2 else v for k, v in batch.items()}
        states[name], metrics = run.step(state, frozen, None, {k: v[None] for k, v in batch.items()})
        jax.block_until_ready(metrics)
        done = time.perf_counter()
        times[name]["rollout"].append(sampled - began)
        times[name]["step"].append(done - sampled)
        times[name]["tokens"].append(sum(map(len, completions)))

    for seed in range(args.steps + 1):  # interleaved; the first is the warm-up (compiles)
        for name in engines:
            one_step(name, seed)
    out = {"cpu": cpu_name(), "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
           "stop_share": args.stop_share, "steps": args.steps, "engines": {}}
    for name, t in times.items():
        rollout, step, tokens = (np.asarray(t[k][1:]) for k in ("rollout", "step", "tokens"))
        out["engines"][name] = {"warm_up_s": round(t["rollout"][0] + t["step"][0], 1),
                                "steps_per_s": round(len(step) / float(np.sum(rollout + step)), 4),
                                "rollout_tokens_per_s": round(float(np.sum(tokens) / np.sum(rollout)), 1),
                                "rollout_share": round(float(np.sum(rollout) / np.sum(rollout + step)), 3),
                                "mean_new_tokens": round(float(np.mean(tokens)) / (args.prompts * args.group), 1)}
    paged, padded = out["engines"]["paged"], out["engines"]["padded"]
    out["paged_over_padded_steps_per_s"] = round(paged["steps_per_s"] / padded["steps_per_s"], 3)
    if args.rows_at_the_cap:
        out["longest_bucket_over_cap_steps_per_s"] = round(
            paged["steps_per_s"] / out["engines"]["paged, rows at the cap"]["steps_per_s"], 3)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
