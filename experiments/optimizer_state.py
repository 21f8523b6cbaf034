"""Optimizer-state bytes of each `[train] optimizer` on a real model, from the planner (abstract: nothing allocated).

Llama-3.1-8B's shape, a full fine-tune (every parameter trained, so the state is largest) and LoRA r=16 on every
linear module, on one device and under ZeRO-3 over 8: the state (`Estimate.optimizer_bytes`, the abstract train
state's own arrays), bytes of state per trainable parameter, the update's temporaries the planner adds (measured on
XLA:CPU: `held.UPDATE_COPIES`) and the step's peak (one row of 2,048 tokens, remat full).

    python experiments/optimizer_state.py          # the table
    python experiments/optimizer_state.py --tpu    # each optimizer's step compiled by libtpu for v5e-4, vs the planner
"""

from __future__ import annotations

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.planner import estimate, get_device

LLAMA31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0)
OPTIMIZERS = ("adamw", "adafactor", "muon", "adamw_8bit")
GiB = 1 << 30


def main() -> None:
    methods = {"full": method_config("full"),
               "LoRA r=16 all-linear": method_config("lora", rank=16, alpha=32, target_modules=("all-linear",))}
    print("| method | optimizer | state, 1 device (GiB) | bytes / trainable parameter | fsdp=8: state a device "
          "(GiB) | update temporaries, 1 device (GiB) | step's peak, 1 device (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for name, method in methods.items():
        for optimizer in OPTIMIZERS:
            one = estimate(LLAMA31_8B, TrainPlan(method, 1, 2048, 1,
                                                 forward=ForwardOptions(compute_dtype="bfloat16", remat="full"),
                                                 optimizer=optimizer, mesh=MeshConfig(fsdp=1)),
                  get_device("h200-141gb"))
            eight = estimate(LLAMA31_8B, TrainPlan(method, 8, 2048, 1,
                                                   forward=ForwardOptions(compute_dtype="bfloat16", remat="full"),
                                                   optimizer=optimizer, mesh=MeshConfig(fsdp=8)),
                    get_device("h200-141gb-8"))
            print(f"| {name} | {optimizer} | {one.optimizer_bytes / GiB:.2f} | "
                  f"{one.optimizer_bytes / one.trainable_parameters:.3f} | {eight.optimizer_bytes / GiB:.2f} | "
                  f"{one.phases['update']['activations'] / GiB:.2f} | {one.compiled_bytes / GiB:.2f} |")


def tpu_rows() -> None:
    """Each optimizer's full fine-tune step (a 512-wide model of 4 and 12 layers, 4 x 256 tokens, bfloat16 compute)
    compiled by the TPU compiler for v5e-4 (fsdp=4) on this host, beside the planner's figure (MiB a chip)."""
    from jaxtune.planner.confirm import compile_step
    from jaxtune.planner.slices import topology_devices, tpu_slice

    device = get_device("v5e-4")
    devices = topology_devices(tpu_slice(device))
    print("| layers | optimizer | compiled (MiB a chip) | planner | error |")
    print("|---|---|---:|---:|---:|")
    for layers in (4, 12):
        cfg = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=layers, num_heads=8,
                          num_kv_heads=4, head_dim=64)
        for optimizer in OPTIMIZERS:
            plan = TrainPlan(method_config("full"), 4, 256, 1, param_dtype="float32",
                             forward=ForwardOptions(compute_dtype="bfloat16", remat="full"), mesh=MeshConfig(fsdp=4),
                             optimizer=optimizer)
            compiled, planned = compile_step(cfg, plan, devices).total_bytes, estimate(cfg, plan, device).compiled_bytes
            print(f"| {layers} | {optimizer} | {compiled / 2**20:.1f} | {planned / 2**20:.1f} | "
                  f"{planned / compiled - 1:+.0%} |")


if __name__ == "__main__":
    import sys

    tpu_rows() if "--tpu" in sys.argv else main()
