"""Optimizer-state bytes of each `[train] optimizer` on a real model, from the planner (abstract: nothing allocated).

Llama-3.1-8B's shape, a full fine-tune (every parameter trained, so the state is largest) and LoRA r=16 on every
linear module, on one device and under ZeRO-3 over 8: the state (`Estimate.optimizer_bytes`, the abstract train
state's own arrays), bytes of state per trainable parameter, the update's temporaries the planner adds (measured on
XLA:CPU: `estimate.UPDATE_COPIES`) and the step's peak (one row of 2,048 tokens, remat full).

    python experiments/optimizer_state.py
"""

from __future__ import annotations

from jaxtune.config import MeshConfig, MethodConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.planner import estimate, get_device

LLAMA31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0)
OPTIMIZERS = ("adamw", "adafactor", "muon", "adamw_8bit")
GiB = 1 << 30


def main() -> None:
    methods = {"full": MethodConfig("full"),
               "LoRA r=16 all-linear": MethodConfig("lora", rank=16, alpha=32, target_modules=("all-linear",))}
    print("| method | optimizer | state, 1 device (GiB) | bytes / trainable parameter | fsdp=8: state a device "
          "(GiB) | update temporaries, 1 device (GiB) | step's peak, 1 device (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for name, method in methods.items():
        for optimizer in OPTIMIZERS:
            one = estimate(LLAMA31_8B, TrainPlan(method, 1, 2048, 1, "full", optimizer=optimizer,
                                                 mesh=MeshConfig(fsdp=1)), get_device("h200-141gb"))
            eight = estimate(LLAMA31_8B, TrainPlan(method, 8, 2048, 1, "full", optimizer=optimizer,
                                                   mesh=MeshConfig(fsdp=8)), get_device("h200-141gb-8"))
            print(f"| {name} | {optimizer} | {one.optimizer_bytes / GiB:.2f} | "
                  f"{one.optimizer_bytes / one.trainable_parameters:.3f} | {eight.optimizer_bytes / GiB:.2f} | "
                  f"{one.phases['update']['activations'] / GiB:.2f} | {one.compiled_bytes / GiB:.2f} |")


if __name__ == "__main__":
    main()
