"""Predicted step time: FLOPs and bytes against the device's rates, a roofline and not a benchmark.

Per micro-batch on one device (n = rows x T tokens, P = matmul weights a token passes through, split `tensor` ways):

  FLOPs    forward 2 n P, plus attention (q k^T and probs v: 4 H hd T S per row and layer)
           backward: the input gradients (2 n P) always, the weight gradients (2 n P) only when the weights train;
           attention is recomputed in every backward (jaxtune checkpoints it) and its backward costs twice its
           forward (TPU's splash kernel: 3.5 times, its dq and dk/dv kernels each recomputing the scores); remat
           "full" runs the layers' forward once more; the chunked loss recomputes its logits (2 n D V)
  bytes    weights read once per forward, backward and recompute; saved activations written and read; logits
  comm     fsdp: weights all-gathered per forward/backward, gradients reduce-scattered; data: gradients
           all-reduced; tensor: two all-reduces of [b, T, D] per layer and pass (Megatron)
and per step: the AdamW update (7 float32 reads/writes a trainable parameter) and, with offload, host transfers.

time = accumulation x (max(compute, memory) + tensor all-reduces + the part of the fsdp/data collectives that
       does not hide behind half of the compute) + update + host transfers.
Compute runs at MFU_CEILING of peak and memory at BANDWIDTH_CEILING of peak: well-tuned training steps reach about
half of peak FLOP/s (PaLM: 46% model-FLOPs utilisation, Chowdhery et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxtune.config.run import batch_ways
from jaxtune.models.fused_attention import splash_covers
from jaxtune.objectives import objective_named, section_of
from jaxtune.objectives import rows as rows_of
from jaxtune.planner import activations as act
from jaxtune.planner.estimate import Estimate

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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def step_time(est: Estimate) -> StepTime:
    """The predicted time of one optimizer step of `est`'s plan on `est.device` (per device; all run in step)."""
    cfg, plan, dev = est.model, est.plan, est.device
    data, fsdp, tensor = est.mesh["data"], est.mesh["fsdp"], est.mesh["tensor"]
    rows = rows_of(plan) // batch_ways(est.mesh)
    prefix = plan.method.num_virtual_tokens if plan.method.kind == "prefix" else 0
    n = rows * plan.seq_len
    matmul = act.matmul_params_per_token(cfg) / tensor
    splash = (dev.family == "tpu" and plan.attention in ("auto", "splash")
              and splash_covers(plan.seq_len, plan.seq_len + prefix, prefix, True) is None)
    attention = rows * act.attention_flops_per_row(cfg, plan.seq_len, prefix, splash) / tensor
    weight_grads = plan.method.kind == "full"
    passes = 3 if plan.remat == "full" else 2  # forward, backward (+ recompute)
    head = cfg.hidden_size * cfg.vocab_size / tensor
    flops = 2 * n * matmul * (1 + 1 + (1 if weight_grads else 0))
    flops += 2 * n * (matmul - head) * (plan.remat == "full")  # the layers' forward again (not the head's)
    flops += 2 * n * head  # the chunked loss recomputes its logits in the backward
    # forward, recompute, a backward of twice the forward; splash's backward: 7 matmuls of the forward's 2
    flops += (4.5 if splash else 4) * attention
    if plan.method.kind in ("lora", "qlora"):
        lora_params = est.trainable_parameters
        flops += 2 * n * lora_params * 3
    # the reference's forward (DPO, GRPO; the base with adapters off for adapter methods), the teacher's (distill)
    extra_forwards = objective_named(plan.objective).extra_forwards(section_of(plan))
    flops += extra_forwards * (2 * n * matmul + attention)
    flops += 2 * rows * plan.generate_tokens * matmul  # a rollout's decode (GRPO)
    compute_dtype = plan.compute_dtype
    compute_s = flops / (dev.peak(compute_dtype) * MFU_CEILING)

    a = jnp.dtype(compute_dtype).itemsize
    weights_full = (cfg.num_layers * act.kernel_elements_per_layer(cfg) + cfg.hidden_size * cfg.vocab_size) * a / tensor
    moved = passes * weights_full + 2 * est.phases["backward"]["activations"] + 3 * n * cfg.vocab_size * 4 / tensor

    if plan.remat == "save_matmuls":  # elementwise work and attention recomputed from the saved matmul outputs
        moved += est.phases["backward"]["activations"]
    memory_s = moved / (dev.bandwidth * BANDWIDTH_CEILING)

    comm = 0.0
    trainable_f32 = 4 * est.trainable_parameters / tensor
    if fsdp > 1:
        comm += passes * (fsdp - 1) / fsdp * weights_full + (fsdp - 1) / fsdp * trainable_f32
    if data > 1:
        comm += 2 * (data - 1) / data * trainable_f32 / fsdp
    # tensor parallelism's all-reduces sit between a layer's matmuls: nothing hides them
    tensor_comm = 2 * passes * cfg.num_layers * 2 * (tensor - 1) / tensor * n * cfg.hidden_size * a
    comm_s = (comm + tensor_comm) / dev.interconnect
    busy = max(compute_s, memory_s)
    micro_s = busy + tensor_comm / dev.interconnect + max(0.0, comm / dev.interconnect - HIDDEN_COMM_SHARE * busy)

    update_s = 7 * 4 * est.trainable_parameters / (fsdp * tensor) / (dev.bandwidth * BANDWIDTH_CEILING)
    host = 0
    if plan.offload.optimizer_state:
        host += 2 * est.host_bytes
    if plan.offload.frozen_params:
        host += est.frozen_bytes
    host_s = host / dev.host_link if host else 0.0
    step_s = plan.grad_accum * micro_s + update_s + host_s
    bound = max((("compute", compute_s), ("memory", memory_s), ("communication", comm_s)), key=lambda kv: kv[1])[0]
    if host_s > plan.grad_accum * micro_s:
        bound = "host transfers"
    tokens = plan.batch_size * plan.grad_accum * plan.seq_len
    return StepTime(plan.grad_accum * flops * dev.count, compute_s, memory_s, comm_s, update_s, host_s, step_s,
                    tokens / step_s, bound)
