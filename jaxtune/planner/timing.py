"""Predicted step time (`step_time(est) -> StepTime`): FLOPs and bytes against the device's rates, a roofline.

Per micro-batch on one device (n tokens, its rows' share of a context axis, through P matmul weights, split `tensor`
ways): FLOPs of the forward (2 n P plus attention), the backward (input gradients always, weight gradients when the
weights train, attention recomputed), full remat's recompute, the chunked loss's logits again, a reference's or
teacher's forward, GRPO's decode; bytes moved; the collectives of ZeRO-3, data, tensor and context (`context_bytes`).
step = accumulation x (max(compute, memory, remat "offload"'s host link) + tensor all-reduces and context all-gathers
+ collectives not hidden behind `HIDDEN_COMM_SHARE` of the compute) + the AdamW update + host transfers; compute at
`MFU_CEILING` of peak (PaLM's tuned training, Chowdhery et al. 2022), memory at `BANDWIDTH_CEILING` of bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp

from jaxtune.config import MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.config.run import batch_ways
from jaxtune.methods.base import adapted_modules, method_unit
from jaxtune.models.context_attention import context_layout
from jaxtune.models.kernels import KernelCosts
from jaxtune.models.moe import grouped_kernel
from jaxtune.models.params import linear_shapes
from jaxtune.objectives import objective_named, section_of
from jaxtune.objectives import rows as rows_of
from jaxtune.parallel.mesh import abstract_mesh
from jaxtune.planner import activations as act
from jaxtune.planner.estimate import Estimate, zero_ways
from jaxtune.planner.hooks import hook_facts
from jaxtune.planner.kernels import planned_kernel
from jaxtune.spine.run import traced_on

MFU_CEILING = 0.5
BANDWIDTH_CEILING = 0.8
HIDDEN_COMM_SHARE = 0.5


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step and what bounds it."""

    flops: float
    compute_s: float
    memory_s: float
    comm_s: float
    update_s: float
    host_s: float
    step_s: float
    tokens_per_s: float
    bound: str
    rollout_flops: float = 0.0  # of `flops`: GRPO's rollout decode, a program of its own
    offload_s: float = 0.0  # a micro-batch's offloaded layer inputs to host and back (`Estimate.offloaded_...`)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def step_time(est: Estimate) -> StepTime:
    """The predicted time of one optimizer step of `est`'s plan on `est.device` (per device; all run in step)."""
    cfg, plan, dev = est.model, est.plan, est.device
    remat, compute_dtype = plan.forward.remat.recomputes, plan.forward.compute_dtype
    data, context, tensor = est.mesh["data"], est.mesh["context"], est.mesh["tensor"]
    zero = zero_ways(est.mesh)
    rows = rows_of(plan) // batch_ways(est.mesh)
    unit = method_unit(plan.method)
    prefix = unit.costs.attended_tokens(plan.method)
    n = rows * plan.seq_len // context  # a context axis splits each row's tokens, and (load-balanced) its attention
    matmul = act.matmul_params_per_token(cfg) / tensor
    kernel = planned_kernel(cfg, plan, dev.family, rows, prefix, context)
    costs = KernelCosts() if kernel is None else kernel.costs  # the blockwise kernel's, or the fused one's
    attention = rows * act.attention_flops_per_row(cfg, plan.seq_len, prefix, costs.blocks) / (tensor * context)
    weight_grads = unit.trains_base
    passes = 3 if remat == "full" else 2  # forward, backward (+ recompute)
    head = cfg.hidden_size * cfg.vocab_size / tensor
    flops = 2 * n * matmul * (1 + 1 + (1 if weight_grads else 0))
    if remat == "full":  # the layers' forward again, but for the head and each layer's last matmul (the MLP's
        # down projection, whose output only the residual add reads; Gemma's post-MLP norm reads it too)
        # (a mixture's experts' outputs are read by the routing weights' gradient)
        last = 0 if cfg.sandwich_norms or cfg.num_experts else cfg.hidden_size * act.mlp_width(cfg) / tensor
        flops += 2 * n * (matmul - head - cfg.num_layers * last)
    flops += 2 * n * head  # the chunked loss recomputes its logits in the backward
    if cfg.num_experts and grouped_kernel(cfg, dev.family, tensor) == "megablox" and remat == "save_matmuls":
        # megablox's products are no dots the policy saves: the routed experts' forward runs again in the backward
        flops += 2 * n * cfg.num_layers * cfg.experts_per_token * 3 * cfg.hidden_size * cfg.expert_size / tensor
    # forward, a backward of twice the forward (`KernelCosts.passes`; splash's: 7 matmuls of the forward's 2), full
    # remat's recompute
    flops += (costs.passes + 1 + (remat == "full")) * attention
    if unit.costs.low_rank:
        lora_params = est.trainable_parameters
        flops += 2 * n * lora_params * 3
    recomputed_frozen = unit.quantize_base is not None or jnp.dtype(plan.param_dtype).itemsize == 2
    if hook_facts(cfg, plan.method).whole_kernel and recomputed_frozen and remat != "save_matmuls":
        # a frozen kernel kept as bits or quantised is derived again in the backward (`linear.dense`), and DoRA's
        # magnitude gradient needs x W: the adapted modules' forward matmuls once more
        shapes = linear_shapes(cfg)
        adapted = adapted_modules(plan.method, cfg.layer_stacks())
        flops += 2 * n * cfg.num_layers * sum(shapes[m][0] * shapes[m][1] for m in adapted) / tensor
    # the reference's forward (DPO, GRPO; the base with adapters off for adapter methods), the teacher's (distill)
    extra_forwards = objective_named(plan.objective).extra_forwards(section_of(plan))
    flops += extra_forwards * (2 * n * matmul + attention)
    rollout = 2 * rows * plan.generate_tokens * matmul  # a rollout's decode (GRPO)
    flops += rollout
    compute_s = flops / (dev.peak(compute_dtype) * MFU_CEILING)

    a = jnp.dtype(compute_dtype).itemsize
    weights_full = (cfg.num_layers * act.kernel_elements_per_layer(cfg) + cfg.hidden_size * cfg.vocab_size) * a / tensor
    moved = passes * weights_full + 2 * est.phases["backward"]["activations"] + 3 * n * cfg.vocab_size * 4 / tensor

    if remat == "save_matmuls":  # elementwise work and attention recomputed from the saved matmul outputs
        moved += est.phases["backward"]["activations"]
    memory_s = moved / (dev.bandwidth * BANDWIDTH_CEILING)

    comm = 0.0
    trainable_f32 = 4 * est.trainable_parameters / tensor
    if zero > 1:
        comm += passes * (zero - 1) / zero * weights_full + (zero - 1) / zero * trainable_f32
    if data > 1:
        comm += 2 * (data - 1) / data * trainable_f32 / zero
    # tensor parallelism's all-reduces sit between a layer's matmuls: nothing hides them; nor does anything hide a
    # layer's keys and values gathered before its attention, where a ring passes them on while it attends
    exposed = 2 * passes * cfg.num_layers * 2 * (tensor - 1) / tensor * n * cfg.hidden_size * a
    context_sent = context_bytes(cfg, plan, est.mesh, 1 + extra_forwards + (remat == "full"))
    if plan.forward.context_attention == "all_gather":
        exposed += context_sent
    else:
        comm += context_sent
    comm_s = (comm + exposed) / dev.interconnect
    busy = max(compute_s, memory_s)
    # remat "offload": each layer's input out in the forward, back in the backward, overlapped with the layers'
    # compute (a layer's copy runs while its neighbour computes): only what outlasts the compute adds time
    offload_s = 2 * est.offloaded_activations_bytes / dev.host_link
    micro_s = (max(busy, offload_s) + exposed / dev.interconnect
               + max(0.0, comm / dev.interconnect - HIDDEN_COMM_SHARE * busy))

    update_s = 7 * 4 * est.trainable_parameters / (zero * tensor) / (dev.bandwidth * BANDWIDTH_CEILING)
    host = 0
    if plan.offload.optimizer_state:
        host += 2 * est.host_bytes
    if plan.offload.frozen_params:
        host += est.frozen_bytes
    host_s = host / dev.host_link if host else 0.0
    step_s = plan.grad_accum * micro_s + update_s + host_s
    bound = max((("compute", compute_s), ("memory", memory_s), ("communication", comm_s)), key=lambda kv: kv[1])[0]
    if host_s > plan.grad_accum * micro_s or offload_s > busy:
        bound = "host transfers"
    tokens = plan.batch_size * plan.grad_accum * plan.seq_len
    return StepTime(plan.grad_accum * flops * dev.count, compute_s, memory_s, comm_s, update_s, host_s, step_s,
                    tokens / step_s, bound, plan.grad_accum * rollout * dev.count, offload_s)


def context_bytes(cfg: ModelConfig, plan: TrainPlan, sizes: dict, forwards: int) -> float:
    """Bytes one device sends a micro-batch to attend across a context axis of N devices (0 without one), for
    `forwards` forward passes of the layers (a reference's, full remat's recompute) and one backward. "ring": per
    layer and forward, ring_steps - 1 key/value blocks [b, K, T / N, hd] in the compute dtype; in the backward the
    same blocks again with their float32 gradients, which then go home in one more pass. "all_gather": per layer
    and forward, (N - 1) / N of the layer's keys and values; in the backward that again, and the reduce-scatter of
    their float32 gradients (`models/context_attention.py`)."""
    N = sizes["context"]
    if N == 1:
        return 0.0
    rows = rows_of(plan) // batch_ways(sizes)
    a = jnp.dtype(plan.forward.compute_dtype).itemsize
    kv = 2 * rows * plan.seq_len * cfg.kv_size / sizes["tensor"]  # a layer's keys and values, whole rows
    if plan.forward.context_attention == "all_gather":
        return cfg.num_layers * (N - 1) / N * kv * (a * (forwards + 1) + 4)
    steps = ring_steps(cfg, plan, sizes)
    block = kv / N
    return cfg.num_layers * ((steps - 1) * block * (a * (forwards + 1) + 4) + (steps > 1) * block * 4)


def ring_steps(cfg: ModelConfig, plan: TrainPlan, sizes: dict) -> int:
    """The key/value blocks a device attends to on the ring (`ContextLayout.ring_steps`): N, fewer where every
    layer's sliding window ends within the previous devices' tokens."""
    with traced_on(abstract_mesh(MeshConfig(**sizes), math.prod(sizes.values()))):
        layout = context_layout(plan.seq_len, cfg.sliding_windows, plan.forward.context_attention)
    assert layout is not None  # asked of a mesh with a context axis
    return layout.ring_steps
