"""A LoRA step of each 2025-26 family (issue 50) against PyTorch+PEFT on this CPU, side by side in one run.

    .venv/bin/python benchmarks/family_step.py              # every family, 5 rounds of 3 steps a side
    .venv/bin/python benchmarks/family_step.py --only gpt_oss --rounds 3

Per family: a small random transformers model of its architecture (hidden 256, 4 layers, 8 heads / 4 KV heads of 32,
vocab 4096; a mixture's 4 experts of 256; its own traits: windows, sinks, chunks, NoPE layers, Gated DeltaNet)
written to a directory that both load. LoRA rank 8, alpha 16 on q,v (and the hybrids' linear layers' input and
output projections); AdamW 2e-4, clipping at 1.0; batch 4 x 256 tokens, float32, loss on every token. jaxtune runs
the spine's jitted step (`abstract_run(...).step`, as `jaxtune train` does); PyTorch runs transformers' eager
attention (gpt-oss's sinks and Llama 4's chunks need it) with 2 threads. The two alternate, a round of steps each,
so a busy machine slows both alike; the ratio is jaxtune's tokens/s over PEFT's, of the per-round medians. Compile
time (jaxtune's `lower().compile()`) is reported apart. Results: benchmarks/results/family_step.json, with the
machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_throughput  # noqa: E402

BATCH, SEQ, RANK, ALPHA, LR = 4, 256, 8, 16, 2e-4
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, attn_implementation="eager")
FAMILIES = {  # transformers class names, and what sets each apart (at this size)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 4}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 128}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"intermediate_size": 256, "num_local_experts": 4,
                                                       "num_experts_per_tok": 2, "sliding_window": 128}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"intermediate_size": 256, "intermediate_size_mlp": 704,
                                                          "num_local_experts": 4, "num_experts_per_tok": 1,
                                                          "attention_chunk_size": 128, "floor_scale": 128}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {"linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                                             "linear_key_head_dim": 32, "linear_value_head_dim": 32}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {  # latent attention, the first layer dense
        "num_key_value_heads": 8, "head_dim": 16, "kv_lora_rank": 128, "q_lora_rank": 192, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 256, "first_k_dense_replace": 1}),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {  # full layers 64 wide, values from keys; the last two
        "global_head_dim": 64, "num_global_key_value_heads": 1, "attention_k_eq_v": True,  # sharing the first
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2,  # two's keys and values
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 32,  # per-layer inputs
        "vocab_size_per_layer_input": 4096, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 256}),  # 4 experts beside every MLP
}
# LoRA's modules: q and v; the hybrids' linear-attention layers (three in four) their input and output projections too
TARGETS = {"qwen3_5": ("q_proj", "v_proj", "in_proj_qkv", "out_proj"),
           "qwen3_next": ("q_proj", "v_proj", "in_proj_qkvz", "out_proj"),
           "deepseek_v3": ("q_b_proj", "kv_b_proj")}  # its queries' and its keys' and values' projections


def write_model(family: str, directory: Path) -> None:
    import torch
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**SHAPE, **extra})
    getattr(transformers, model_name)(config).save_pretrained(directory)


def jaxtune_step(directory: Path, targets: tuple[str, ...]):
    """step() running one jitted LoRA step, and its compile seconds."""
    import jax
    import numpy as np

    from jaxtune.config import ForwardOptions, MeshConfig, TrainConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.methods.transform import apply_method, partition, trainable_mask
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.spine.model import load_model
    from jaxtune.spine.run import abstract_run

    cfg, params = load_model(directory)
    method = method_config("lora", rank=RANK, alpha=ALPHA, target_modules=targets)
    trainable, frozen = partition(*(lambda p: (p, trainable_mask(p, method)))(
        apply_method(params, cfg, method, jax.random.key(1))))
    plan = TrainPlan(method, BATCH, SEQ, 1, param_dtype="float32", forward=ForwardOptions(remat="none"))
    tc = TrainConfig(learning_rate=LR, schedule="constant", max_grad_norm=1.0)
    run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]), tc, 10_000)
    state = run.init_state(trainable, seed=0)
    tokens = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], (BATCH, SEQ + 1), dtype=np.int32)
    ones = np.ones((BATCH, SEQ), np.int32)
    batch = jax.device_put({"input_ids": tokens[None, :, :-1], "labels": tokens[None, :, 1:],
                            "loss_mask": ones[None].astype(np.float32), "segment_ids": ones[None],
                            "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), ones.shape)[None]})
    start = time.perf_counter()
    compiled = run.step.lower(state, frozen, None, batch).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def step():
        holder["state"], _ = compiled(holder["state"], frozen, None, batch)
        jax.block_until_ready(holder["state"])

    return step, compile_s


def peft_step(directory: Path, targets: tuple[str, ...]):
    import numpy as np
    import peft
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                       target_modules=list(targets))).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0, foreach=True)
    ids = torch.tensor(np.random.default_rng(0).integers(3, SHAPE["vocab_size"], (BATCH, SEQ), dtype=np.int64))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def rounds(steps: dict, count: int, per_round: int) -> dict[str, list[float]]:
    """Seconds a step, the median of each round, the sides alternating round by round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(count):
        for name, step in steps.items():
            samples = []
            for _ in range(per_round):
                start = time.perf_counter()
                step()
                samples.append(time.perf_counter() - start)
            times[name].append(statistics.median(samples))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps a round")
    args = parser.parse_args()
    results = []
    for family in [args.only] if args.only else list(FAMILIES):
        with tempfile.TemporaryDirectory() as tmp:
            write_model(family, Path(tmp))
            targets = TARGETS.get(family, ("q_proj", "v_proj"))
            jax_step, compile_s = jaxtune_step(Path(tmp), targets)
            times = rounds({"jaxtune": jax_step, "peft": peft_step(Path(tmp), targets)}, args.rounds, args.steps)
        jax_s, peft_s = (statistics.median(times[k]) for k in ("jaxtune", "peft"))
        ratios = [p / j for j, p in zip(times["jaxtune"], times["peft"])]
        result = {"family": family, "jaxtune_step_s": jax_s, "peft_step_s": peft_s, "compile_s": compile_s,
                  "ratio": peft_s / jax_s, "ratio_range": [min(ratios), max(ratios)],
                  "tokens_per_s": {"jaxtune": BATCH * SEQ / jax_s, "peft": BATCH * SEQ / peft_s}}
        print(f"{family}: jaxtune {jax_s * 1e3:.0f} ms, PEFT {peft_s * 1e3:.0f} ms a step: {peft_s / jax_s:.2f}x "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); compile {compile_s:.1f} s", flush=True)
        results.append(result)
    out = HERE / "results" / "family_step.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    machine = train_throughput.machine()
    out.write_text(json.dumps(previous + [{"machine": machine, "kind": train_throughput.machine_kind(machine),
                                           "results": results}], indent=1) + "\n")


if __name__ == "__main__":
    main()
