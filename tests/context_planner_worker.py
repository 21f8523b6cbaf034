"""The planner against the compiler on context meshes of 8 fake CPU devices, run by tests/test_context_planner.py in a
subprocess (XLA fixes the number of host devices when jax is first imported); prints one JSON object, {row:
[planner bytes, compiled bytes]} a device:

    python tests/context_planner_worker.py

Each row is a small Llama's step as the trainer compiles it (`planner.compile_step`: the spine's own step, nothing
allocated) beside the planner's estimate for the `cpu-N` target without its runtime reserve
(`Estimate.compiled_bytes`): rows of 2k to 32k tokens on context = 2, 4 and 8, both strategies, remat none and full,
LoRA, full fine-tuning and QLoRA, alone and beside fsdp, data and tensor axes.
"""

from __future__ import annotations

import json
import math
import os
import sys

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.planner import compile_step, estimate, get_device

SMALL = ModelConfig(vocab_size=8000, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                    num_kv_heads=4, head_dim=32, max_position_embeddings=32768)
METHODS = {"lora": method_config("lora", rank=16, target_modules=("all-linear",)), "full": method_config("full"),
           "qlora": method_config("qlora", rank=16, target_modules=("all-linear",))}
# (tokens a row, rows, mesh, context attention, remat, method)
ROWS = [
    (2048, 1, "context=2", "ring", "none", "lora"),
    (4096, 1, "context=4", "all_gather", "full", "lora"),
    (8192, 1, "context=8", "ring", "full", "full"),
    (8192, 1, "context=2", "all_gather", "none", "full"),
    (16384, 1, "context=4", "ring", "none", "lora"),
    (16384, 1, "context=8", "all_gather", "full", "lora"),
    (32768, 1, "context=8", "ring", "full", "lora"),
    (32768, 1, "context=4", "all_gather", "full", "full"),
    (32768, 1, "context=8", "all_gather", "none", "lora"),
    (16384, 1, "context=4", "ring", "full", "qlora"),
    (8192, 2, "fsdp=2,context=4", "ring", "none", "full"),
    (4096, 2, "data=2,context=4", "all_gather", "full", "lora"),
    (8192, 1, "context=4,tensor=2", "ring", "full", "lora"),
]


def label(row) -> str:
    seq, rows, mesh, strategy, remat, method = row
    return f"{method} {rows}x{seq} {mesh} {strategy} remat={remat}"


def plan_of(row) -> TrainPlan:
    seq, rows, mesh, strategy, remat, method = row
    sizes = {"fsdp": 1} | {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    return TrainPlan(METHODS[method], rows, seq, 1, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", remat=remat, context_attention=strategy),
                     mesh=MeshConfig(**sizes))


def accuracy() -> dict:
    out = {}
    for row in ROWS:
        plan = plan_of(row)
        device = get_device(f"cpu-{math.prod(plan.mesh.sizes().values())}")
        out[label(row)] = [estimate(SMALL, plan, device).compiled_bytes, compile_step(SMALL, plan).total_bytes]
    return out


if __name__ == "__main__":
    print(json.dumps(accuracy()))
