"""The analytical memory estimate of one training step, per device: `estimate(cfg, plan, device) -> Estimate`.

Nothing is allocated. The step's arguments are counted exactly on the spine's abstract run on an `AbstractMesh`
(`run_bytes`): frozen weights in their dtype (QLoRA's packed leaves), float32 trainable copies, Adam's moments, the
batch. The transient memory is the largest of the step's moments (`phases`, `peak_phase`; XLA gives buffers not
alive together the same memory): the loss, the backward (saved activations, one layer's workspace: activations.py),
the update, GRPO's rollout. Beside them: copies a dtype cast makes, the gathered layer under fsdp, the second model,
the runtime reserve of the hardware family (`FAMILY_RULES`), and the peak while loading (`spine/load.py`). Counts
are checked against XLA's compiled memory by experiments/planner_accuracy.py and experiments/tpu_compile_table.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers

from jaxtune.config import MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.config.run import batch_ways
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import parameter_report
from jaxtune.models.attention import block_size
from jaxtune.models.head import chunk_length
from jaxtune.models.linear import gathered_piece_bytes
from jaxtune.models.moe import grouped_kernel
from jaxtune.models.params import abstract_params, count_params
from jaxtune.models.quant import (
    NF4_BLOCKSIZE,
    Int8Array,
    QuantizedArray,
    full_shape,
    nf4_codes,
    quantize_int8,
    row_slices,
)
from jaxtune.objectives import objective_named, section_of
from jaxtune.objectives import rows as rows_of
from jaxtune.parallel.mesh import abstract_mesh
from jaxtune.parallel.rules import ZERO_AXES, mesh_axes_of
from jaxtune.planner import activations as act
from jaxtune.planner.devices import Device, GiB
from jaxtune.planner.hooks import folds_everywhere, hook_facts
from jaxtune.planner.kernels import planned_kernel
from jaxtune.spine.optimizers import QuantizedMoment, layer_stacked, muon_dimensions, row_chunks, scale_by_adam_8bit
from jaxtune.spine.run import abstract_run

MiB = 1 << 20
ROLLOUT_SCORE_COPIES = 2.1  # GRPO's prefill: [b, H, bq, bk] float32 score blocks (measured on XLA:CPU)


@dataclass(frozen=True)
class FamilyRules:
    """How a hardware family changes the arithmetic. workspace_itemsize: bytes per value inside one layer's backward
    (XLA:CPU widens 16-bit values there; the stacks the layer scan keeps stay 16-bit, `models/remat.py`), None
    for the compute dtype's.
    tiled: arrays occupy whole (8, 128) tiles (16 rows for 2-byte, 32 for 1-byte types), as on TPU.
    dense_grouped_matmul: a mixture's grouped matmul runs as a dense matmul per expert (`lax.ragged_dot` on XLA:CPU;
    on TPU jaxtune runs megablox instead, unless a tensor axis does not divide the experts' hidden units).
    transposed_weight_gradients: a layer's backward lays the inputs of its weight gradients' matmuls out again, where
    the base trains (`activations.weight_gradient_elements`; XLA:CPU).
    reserve: fixed bytes + a fraction of the device-side estimate, for what XLA's analysis does not see."""

    workspace_itemsize: int | None
    tiled: bool
    reserve_fixed: int
    reserve_fraction: float
    reserve_note: str
    dense_grouped_matmul: bool = False
    transposed_weight_gradients: bool = False


FAMILY_RULES = {
    "gpu": FamilyRules(None, False, 256 * MiB, 0.05,
                       "allocator slack: 5% for the BFC allocator's fragmentation + 256 MiB of cuBLAS/cuDNN workspace "
                       "and autotuning scratch (our assumption)"),
    "tpu": FamilyRules(None, True, 128 * MiB, 0.0,
                       "128 MiB for the program and collective buffers (our assumption); padding to (8, 128) tiles "
                       "is counted in every array"),
    "gaudi": FamilyRules(None, False, 1 * GiB, 0.05,
                         "graph mode: 1 GiB + 5% for the compiled graphs' recipe cache and workspace (our "
                         "assumption)"),
    "cpu": FamilyRules(4, False, 520 * MiB, 0.0,
                       "runtime baseline: 520 MiB for Python, jaxlib, the tokenizer, orbax and XLA's compiler, the "
                       "peak RSS of `jaxtune train` on a 0.2M-parameter model; XLA:CPU widens 16-bit values inside a "
                       "layer's backward",
                       dense_grouped_matmul=True, transposed_weight_gradients=True),
}


def _tiled_bytes(shape, itemsize: int, stored: bool = False) -> int:
    """Bytes of an array laid out in (rows, 128) tiles over its last two dimensions, in the order that pads least
    (the TPU compiler lays a [D, r] LoRA factor out with D minor); a `stored` array (a weight, a moment) over any
    two of its dimensions (QLoRA's expert codes [L, E, n] are laid out over (L, n) rather than padding E = 8 to 32
    rows). Measured, experiments/tpu_compile_table.py."""
    shape = tuple(shape) if len(shape) > 1 else (1, *shape) if shape else (1, 1)
    if not math.prod(shape):
        return 0
    rows = 8 * max(1, 4 // itemsize)
    padded = lambda sublanes, lanes: (-(-sublanes // rows) * rows) * (-(-lanes // 128) * 128)  # noqa: E731
    n = len(shape)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j] if stored else [(n - 2, n - 1), (n - 1, n - 2)]
    return itemsize * min(padded(shape[i], shape[j]) * math.prod(shape) // (shape[i] * shape[j]) for i, j in pairs)


@dataclass(frozen=True)
class Estimate:
    """Bytes on one device at the step's peak, and where they go. `phases` holds the transient bytes of each of the
    three moments; the breakdown fields are those of the largest (`peak_phase`)."""

    device: Device
    plan: TrainPlan
    model: ModelConfig
    mesh: dict
    parameters: int
    trainable_parameters: int
    frozen_bytes: int
    trainable_bytes: int
    extra_models_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    saved_activations_bytes: int
    attention_bytes: int
    logits_bytes: int
    workspace_bytes: int
    weight_copies_bytes: int
    kv_cache_bytes: int
    batch_bytes: int
    reserve_bytes: int
    host_bytes: int
    peak_phase: str
    phases: dict
    base_parameters: int = 0
    loading_transient_bytes: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def weights_bytes(self) -> int:
        return self.frozen_bytes + self.trainable_bytes + self.extra_models_bytes

    @property
    def activations_bytes(self) -> int:
        return self.saved_activations_bytes + self.attention_bytes + self.logits_bytes + self.workspace_bytes

    @property
    def other_bytes(self) -> int:
        return self.weight_copies_bytes + self.kv_cache_bytes + self.batch_bytes + self.reserve_bytes

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes
                + self.other_bytes)

    @property
    def compiled_bytes(self) -> int:
        """The part XLA's memory analysis of the step sees: everything but the runtime reserve."""
        return self.total_bytes - self.reserve_bytes

    @property
    def model_states_bytes(self) -> int:
        """Weights + one gradient + optimizer state: the ZeRO paper's "model states"."""
        one_gradient = 4 * self.trainable_parameters // (zero_ways(self.mesh) * self.mesh["tensor"])
        return self.frozen_bytes + self.trainable_bytes + one_gradient + self.optimizer_bytes

    @property
    def loading_bytes(self) -> int:
        """The peak while the run starts (`spine/load.py`): the weights as they are created with the reading's own
        buffers beside them (QLoRA: one float layer being quantised; otherwise one shard being read; on CPU the
        host's buffers too), then the optimizer state made beside the weights; plus the runtime reserve."""
        return (self.frozen_bytes + self.trainable_bytes + self.extra_models_bytes
                + max(self.loading_transient_bytes, self.optimizer_bytes) + self.reserve_bytes)

    @property
    def peak_bytes(self) -> int:
        """The larger of the step's peak and loading's."""
        return max(self.total_bytes, self.loading_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device.usable_bytes

    def to_dict(self) -> dict:
        per_device = {
            "weights_bytes": self.weights_bytes, "gradients_bytes": self.gradients_bytes,
            "optimizer_bytes": self.optimizer_bytes, "activations_bytes": self.activations_bytes,
            "other_bytes": self.other_bytes, "total_bytes": self.total_bytes,
            "frozen_weights_bytes": self.frozen_bytes, "trainable_weights_bytes": self.trainable_bytes,
            "extra_models_bytes": self.extra_models_bytes,
            "saved_activations_bytes": self.saved_activations_bytes, "attention_scores_bytes": self.attention_bytes,
            "logits_bytes": self.logits_bytes, "backward_workspace_bytes": self.workspace_bytes,
            "weight_copies_bytes": self.weight_copies_bytes, "kv_cache_bytes": self.kv_cache_bytes,
            "batch_bytes": self.batch_bytes, "reserve_bytes": self.reserve_bytes,
            "model_states_bytes": self.model_states_bytes,
        }
        p = self.plan
        return {
            "per_device": per_device,
            "device": {"name": self.device.name, "memory_bytes": self.device.memory_bytes, "count": self.device.count,
                       "usable_bytes": self.device.usable_bytes, "family": self.device.family},
            "fits": self.fits,
            "loading": {"total_bytes": self.loading_bytes, "transient_bytes": self.loading_transient_bytes,
                        "peak": "loading" if self.loading_bytes > self.total_bytes else "step"},
            "peak_phase": self.peak_phase,
            "phases": self.phases,
            "host_bytes": self.host_bytes,
            "plan": {"method": p.method.kind, "method_options": json.loads(json.dumps(dataclasses.asdict(p.method))),
                     "batch_size": p.batch_size, "seq_len": p.seq_len, "grad_accum": p.grad_accum,
                     "remat": p.forward.remat.policy, "compute_dtype": p.forward.compute_dtype,
                     "param_dtype": p.param_dtype,
                     "mesh": self.mesh, "offload": {"optimizer_state": p.offload.optimizer_state,
                                                    "frozen_params": p.offload.frozen_params,
                                                    "moments_dtype": p.offload.moments_dtype},
                     "objective": p.objective, "context_attention": p.forward.context_attention},
            "model": {"parameters": self.base_parameters, "method_parameters": self.parameters - self.base_parameters,
                      "trainable_parameters": self.trainable_parameters,
                      "layers": self.model.num_layers, "hidden_size": self.model.hidden_size,
                      "vocab_size": self.model.vocab_size},
            "notes": list(self.notes),
        }


def resolve_mesh(mesh: MeshConfig, device: Device) -> dict:
    """{"data", "fsdp", "expert", "context", "tensor"} sizes for `mesh` on `device.count` devices."""
    try:
        return mesh.resolve(device.count)
    except JaxtuneError:
        sizes = mesh.sizes()
        fixed = math.prod(s for s in sizes.values() if s != -1)
        described = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise JaxtuneError(f"mesh {described} does not divide the {device.count} device(s) of {device.target}: the "
                           f"fixed axes need {fixed}; use sizes whose product is {device.count}, or -1 for one axis"
                           ) from None


def zero_ways(sizes: dict) -> int:
    """The devices ZeRO-3 splits weights, gradients and optimizer state over: fsdp x context (`rules.ZERO_AXES`)."""
    return math.prod(sizes[a] for a in ZERO_AXES)


def _device_bytes(tree, tiled: bool) -> int:
    """Bytes of one device's shard of every array of an abstract tree whose leaves carry their shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(tuple(leaf.shape))
        itemsize = np.dtype(leaf.dtype).itemsize
        total += _tiled_bytes(shape, itemsize, stored=True) if tiled else math.prod(shape) * itemsize
    return total


@dataclass(frozen=True)
class RunBytes:
    """Per-device bytes of the arrays a step holds, counted on the spine's own abstract run (exact)."""

    frozen: int
    trainable: int
    optimizer: int
    second: int
    batch: int
    parameters: int
    trainable_parameters: int
    base_parameters: int
    loading_device: int
    loading_host: int
    largest_trainable: int  # the largest trainable leaf outside the layer stacks, whole
    optimizer_temporaries: int = 0  # the update's working copies (`_optimizer_temporaries`)


def run_bytes(cfg: ModelConfig, plan: TrainPlan, sizes: dict, tiled: bool) -> RunBytes:
    """The spine's abstract run of `plan` on an abstract mesh of `sizes`: what each argument of the step holds per
    device. Cached on what changes the arrays (not remat or the compute dtype)."""
    return _run_bytes(cfg, plan.replace(remat="none", compute_dtype="float32"), tuple(sizes.items()), tiled)


@functools.lru_cache(maxsize=512)
def _run_bytes(cfg, plan, sizes, tiled) -> RunBytes:
    sizes = dict(sizes)
    mesh = abstract_mesh(MeshConfig(**sizes), math.prod(sizes.values()))
    run = abstract_run(cfg, plan, mesh)
    trainable = sum(math.prod(x.shape) for x in jax.tree.leaves(run.state["params"]))
    report = parameter_report(run.params, plan.method, cfg, run.objective.head_leaves)
    return RunBytes(_device_bytes(run.frozen, tiled), _device_bytes(run.state["params"], tiled),
                    _device_bytes(run.state["opt_state"], tiled), _device_bytes(run.second, tiled),
                    _device_bytes(run.batch, tiled), report.total, trainable, count_params(abstract_params(cfg)),
                    *_loading_transient(run, tiled),
                    _largest_outside_layers(run.state["params"]),
                    _optimizer_temporaries(plan.optimizer, run.state["params"], tiled))


# The update's temporaries beyond the gradients, as (copies of a device's bytes of the leaves each optimizer works
# on, and copies of one layer's slice of them). XLA:CPU (the update alone after clipping, compiled at 4 and 16
# layers): optax's Adafactor keeps a float32 copy of every update; Muon and the 8-bit AdamW run layer by layer
# (`spine.optimizers.by_layer`) and keep the clipped gradients and the step whole (Muon also a copy of its
# momentum), plus one layer's Newton-Schulz products or dequantised moments. The TPU compiler (libtpu, a full
# fine-tune's step on v5e-4 at 4 and 12 layers, against AdamW's): Adafactor and Muon fuse their updates; the 8-bit
# AdamW's layer loop re-lays each fsdp-split layer into blocks of 256. AdamW updates in place on both. GPUs (not
# measured) are counted as the CPU.
UPDATE_COPIES = {"cpu": {"adafactor": (1.0, 0.0), "muon": (2.75, 4.2), "adamw_8bit": (1.0, 3.2)},
                 "tpu": {"adafactor": (0.0, 0.0), "muon": (0.0, 3.3), "adamw_8bit": (0.3, 21.0)}}


def _optimizer_temporaries(optimizer: str, params, tiled: bool) -> int:
    """Bytes on one device of the optimizer update's temporaries (`UPDATE_COPIES`)."""
    copies = UPDATE_COPIES["tpu" if tiled else "cpu"]  # tiled: a TPU's layouts
    if optimizer not in copies:
        return 0
    if optimizer == "muon":
        dims = muon_dimensions(params)
        params = jax.tree.map(lambda x, d: None if d is None else x, params, dims,
                              is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    elif optimizer == "adamw_8bit":
        params = jax.tree.map(lambda x, m: x if isinstance(m, QuantizedMoment) else None, params,
                              jax.eval_shape(scale_by_adam_8bit(0.9, 0.999, 1e-8).init, params).mu,
                              is_leaf=lambda x: isinstance(x, QuantizedMoment))
    whole, per_layer = copies[optimizer]
    total = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:  # outside the stacks: 8-bit's row chunks
        pieces = x.shape[0] if layer_stacked(path) else row_chunks(math.prod(x.shape))
        total += (whole + per_layer / pieces) * _device_bytes([x], tiled)
    return int(total)


def _largest_outside_layers(params) -> int:
    """Bytes of the largest trainable leaf outside the layer stacks (the head, the embedding table): its gradient
    is summed whole on each device before an fsdp mesh splits it. A stacked layer's gradient is split inside the
    layer scan, one layer at a time (a 70B full fine-tune's [80, 8192, 28672] MLP stack is no such leaf)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    outside = [x for path, x in leaves if not any(getattr(k, "key", None) == "layers" for k in path)]
    return max((math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in outside), default=0)


def _loading_transient(run, tiled: bool) -> tuple[int, int]:
    """(device, host) bytes `spine/load.py` holds beside the arrays it has created. A quantised kernel: on the
    device, one slice of rows being quantised (its compiled program's own figures); on the host, all that kernel's
    layers' quantised children (placed at the end) and the slice as read. A float leaf: one shard being read, on
    the host and on the device."""
    quantized = [x for x in jax.tree.leaves(run.frozen, is_leaf=lambda x: isinstance(x, QuantizedArray))
                 if isinstance(x, QuantizedArray) and x.codes is not None]
    if quantized:
        host = max(sum(math.prod(c.shape) * np.dtype(c.dtype).itemsize for c in jax.tree.leaves(q)) for q in quantized)
        slices = []
        for q in quantized:
            d_in, d_out = full_shape(q)[-2:]  # [L, in, out], or [L, E, in, out] for a mixture's experts
            int8 = isinstance(q, Int8Array)
            start, stop = row_slices(d_out, d_in, 1 if int8 else NF4_BLOCKSIZE)[0]
            slices.append(((stop - start, d_in), np.dtype(q.dtype).name, int8))
        device = max(_quantizer_bytes(*s) for s in slices)
        read = max(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype, _ in slices)
        return device, host + read
    leaves = jax.tree.leaves(run.frozen) + jax.tree.leaves(run.state["params"])
    shard = max((_device_bytes(x, tiled) for x in leaves), default=0)
    return shard, shard


@functools.lru_cache(maxsize=64)
def _quantizer_bytes(slice_shape: tuple[int, int], dtype: str, int8: bool) -> int:
    """Argument + output + temporary bytes of the compiled quantiser on one [rows, in] slice of a weight's torch
    layout, as `models/quant.quantize_by_rows` runs it."""
    rows, d_in = slice_shape
    if int8:
        lowered = jax.jit(quantize_int8).lower(jax.ShapeDtypeStruct((d_in, rows), dtype))
    else:
        lowered = nf4_codes.lower(jax.ShapeDtypeStruct((1, rows * d_in), dtype))
    memory = lowered.compile().memory_analysis()
    return memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes


def _full_size(tree, tiled: bool) -> int:
    return sum((_tiled_bytes(x.shape, np.dtype(x.dtype).itemsize) if tiled
                else math.prod(x.shape) * np.dtype(x.dtype).itemsize) for x in jax.tree.leaves(tree))


def _kernel_elements(cfg: ModelConfig) -> tuple[int, int]:
    """(elements of all layers' linear kernels, of the output head)."""
    return cfg.num_layers * act.kernel_elements_per_layer(cfg), cfg.hidden_size * cfg.vocab_size


def _cast_copies(plan: TrainPlan, layer_kernels: int, head_kernel: int, a: int, head_pieces: bool
                 ) -> tuple[int, int]:
    """(bytes kept for the backward, bytes alive all step) of weight copies that dtype casts make, before sharding.

    Everywhere: under remat "none", JAX keeps `kernel.astype(compute dtype)` of every layer for the backward when
    the kernel's dtype differs (float32 masters under bfloat16 compute; frozen float32 weights under bfloat16).
    Frozen kernels quantised or held as bit patterns (`models/quant.BitPattern`, every 16-bit one) are re-derived
    in the backward instead (models/linear.py).
    A frozen head (or tied embedding) stored in a dtype other than the compute dtype is converted once for the step,
    out of the chunked loss's loop (measured on XLA:CPU; under fsdp, each device its vocabulary shard), unless it
    is read from its bits a piece at a time (`head_pieces`: a 16-bit head under wider compute, larger than a piece
    on each device; `linear.derived_piecewise_matmul`).
    """
    frozen = not method_unit(plan.method).trains_base
    kernel_dtype = plan.param_dtype if frozen else "float32"
    residual = copies = 0
    kept = not frozen or (method_unit(plan.method).quantize_base is None and jnp.dtype(kernel_dtype).itemsize > 2)
    if plan.forward.remat.policy == "none" and kept and kernel_dtype != plan.forward.compute_dtype:
        # a frozen float32 copy is multiplied on XLA:CPU in float32 too (activation width `a`); float32 masters
        # cast to bf16 stay bf16
        residual = layer_kernels * (a if frozen else jnp.dtype(plan.forward.compute_dtype).itemsize)
    if frozen and plan.param_dtype != plan.forward.compute_dtype and not head_pieces:
        copies += head_kernel * jnp.dtype(plan.forward.compute_dtype).itemsize
    return residual, copies


def _fused_low_rank(cfg: ModelConfig, plan: TrainPlan, sizes: dict, device: Device) -> bool:
    """Whether `linear.dense` folds the method's branches into their base products (`hooks.folds_everywhere`: the
    hooks' own predicates on the abstract tree), for kernels used whole, not a piece at a time (`_layer_copies`)."""
    return (folds_everywhere(cfg, plan.method, sizes, device.family)
            and _layer_copies(cfg, plan, gathered_piece_bytes(device.family)) == 0)


def _layer_copies(cfg: ModelConfig, plan: TrainPlan, piece_bytes: int) -> int:
    """Bytes of one layer's derived frozen kernels as its backward holds them, on one device: each kernel that
    is dequantised or widened from 16 bits and larger than a piece so derived, a piece
    (`linear.derived_piecewise_matmul`; XLA:CPU derives the modules' pieces side by side, measured)."""
    quantised = method_unit(plan.method).quantize_base is not None
    derived = max(jnp.dtype(plan.forward.compute_dtype).itemsize, 4 if quantised else 2)
    if method_unit(plan.method).trains_base or not (quantised or _widened(plan)):
        return 0
    D, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    mlp = act.kernel_elements_per_layer(cfg) - D * (2 * q + 2 * kv)
    modules = [D * q, D * kv, D * kv, q * D] + [mlp // 3] * 3  # elements of each kernel (a mixture's: its MLP)
    return sum(piece_bytes for m in modules if m * derived > piece_bytes)


def _widened(plan: TrainPlan) -> bool:
    """Whether frozen 16-bit weights are widened where they are used (float32 compute)."""
    return jnp.dtype(plan.param_dtype).itemsize == 2 < jnp.dtype(plan.forward.compute_dtype).itemsize


def _rollout_kv(cfg: ModelConfig, plan: TrainPlan, w, nbytes) -> int:
    """Bytes of GRPO's rollout KV cache per device: [L, A b, prefix + T, K, hd] keys and values."""
    prefix = method_unit(plan.method).costs.attended_tokens(plan.method)
    rollout_rows = w.b * plan.grad_accum  # one generation for the optimizer step's rows, then A micro-batches
    return 2 * cfg.num_layers * nbytes((rollout_rows, prefix + plan.seq_len, w.kv_heads, cfg.head_dim),
                                       jnp.dtype(plan.forward.compute_dtype).itemsize)


def estimate(cfg: ModelConfig, plan: TrainPlan, device: Device) -> Estimate:
    """Per-device memory of `plan`'s training step for `cfg` on `device` (with its count), without allocating.

    The arrays the step holds (weights, masters, optimizer state, the second model, the batch) are counted exactly
    on the spine's abstract run (`run_bytes`); its transient memory (activations, logits, gradients, copies) by
    the rules below.
    """
    remat, compute = plan.forward.remat.policy, plan.forward.compute_dtype
    rules = FAMILY_RULES[device.family]
    sizes = resolve_mesh(plan.mesh, device)
    data, fsdp, tensor = sizes["data"], sizes["fsdp"], sizes["tensor"]
    zero = zero_ways(sizes)  # ZeRO-3: fsdp x context devices split the weights, gradients and optimizer state
    method, tiled = plan.method, rules.tiled
    notes: list[str] = []
    ways = batch_ways(sizes)
    total_rows = rows_of(plan)  # a pair is two rows, a GRPO prompt group_size rows
    if total_rows % ways:
        raise JaxtuneError(f"batch {plan.batch_size} ({total_rows} rows) cannot be split over data x fsdp x expert = "
                           f"{data} x {fsdp} x {sizes['expert']} = {ways} devices; use a multiple of {ways} rows")
    if plan.generate_tokens and sizes["context"] > 1:
        raise JaxtuneError(f"GRPO's rollout decodes whole rows, which context = {sizes['context']} would split: use "
                           "a mesh without a context axis")
    rows = total_rows // ways
    unit = method_unit(method)
    prefix = unit.costs.attended_tokens(method)
    megablox = grouped_kernel(cfg, device.family, tensor) == "megablox"  # else ragged_dot, dense on TPU
    w = act.widths(cfg, rows, plan.seq_len, prefix, tensor, megablox, sizes["expert"], sizes["context"],
                   plan.forward.context_attention,
                   # under save_matmuls the tiles' matmul outputs are all kept: a tiled MLP saves nothing there
                   plan.forward.tiled_mlp if remat != "save_matmuls" else 0,
                   _fused_low_rank(cfg, plan, sizes, device), hook_facts(cfg, method).whole_kernel)
    a = jnp.dtype(compute).itemsize
    nbytes = (lambda shape, size: _tiled_bytes(shape, size)) if tiled else (lambda shape, size: math.prod(shape) * size)

    held = run_bytes(cfg, plan, sizes, tiled)
    frozen_b, trainable_b, optimizer_b, grad_b = held.frozen, held.trainable, held.optimizer, held.trainable
    n_total, n_trainable = held.parameters, held.trainable_parameters
    objective = objective_named(plan.objective)

    copies = objective.logits_copies(method, section_of(plan))
    acts = act.activation_bytes(cfg, method, remat, w, a, nbytes, copies, total_rows,
                                (lambda shape, size: _tiled_bytes(shape, size, True)) if tiled else None,
                                rules.workspace_itemsize)
    kernel = planned_kernel(cfg, plan, device.family, rows, prefix, w.context)
    if kernel is not None and kernel.costs.workspace is not None:  # a fused kernel's own (splash: VMEM, not HBM)
        acts = replace(acts, attention=kernel.costs.workspace(w.b, w.heads, w.T, w.S, a))
    logits_b = acts.logits
    # a frozen 16-bit head under wider compute is read from its bits a piece at a time where a device's share of
    # it is larger than a piece (`linear.pieces_of`)
    vocab_ways = math.prod(sizes[a] for a in mesh_axes_of(("vocab",), (cfg.vocab_size,), sizes)[0])
    head_pieces = (not unit.trains_base and _widened(plan) and cfg.hidden_size * cfg.vocab_size // vocab_ways
                   * jnp.dtype(compute).itemsize > gathered_piece_bytes(device.family))
    one_chunk = chunk_length(total_rows, w.T, cfg.vocab_size) >= w.T
    if head_pieces and (one_chunk or vocab_ways > 1):
        # it writes the logits into a buffer of their own: XLA:CPU gave it one more chunk buffer where the loss is
        # one chunk (the forward's first piece and its recomputation's merged, then copied for each) or the
        # vocabulary is split over devices (the logits' gradient laid out again)
        logits_b += acts.logits_one

    # Weight copies made by dtype casts.
    layer_kernels, head_kernel = _kernel_elements(cfg)
    shard = zero * tensor
    residual_copies, copies_b = (c // shard for c in _cast_copies(plan, layer_kernels, head_kernel, a, head_pieces))
    if copies_b:
        notes.append(f"the frozen {plan.param_dtype} head is converted to {compute} for the step: that "
                     "copy is counted")
    if zero > 1:
        # ZeRO-3: a layer's weights are all-gathered where they are used, one layer at a time inside the scan; a
        # frozen 16-bit kernel a piece at a time in its own dtype, with XLA:CPU's copy of the piece from its bits
        # (`linear.gathered_piecewise_matmul`), others whole as XLA widens them; a second model's forward (a
        # reference, a teacher) gathers its own beside them. The head is split by vocabulary, never gathered
        # (measured on fake CPU devices).
        # (on TPU the reference's gathered weights are not beside the policy's at the peak: a 1B LoRA's DPO step
        # compiled to its SFT step's bytes, experiments/tpu_compile_table.py)
        forwards = 1 + (objective.extra_forwards(section_of(plan)) if device.family != "tpu" else 0)
        stored = not unit.trains_base and unit.quantize_base is None and jnp.dtype(plan.param_dtype).itemsize == 2
        whole_kernel = hook_facts(cfg, method).whole_kernel  # DoRA's norm: each kernel whole
        if stored and tensor == 1 and not whole_kernel:
            largest = 2 * cfg.hidden_size * max(cfg.q_size, cfg.intermediate_size)  # bytes of a layer's widest kernel
            piece = min(gathered_piece_bytes(device.family), largest)
            gathered = piece + piece * jnp.dtype(compute).itemsize // 2  # and its copy in the compute dtype
        elif stored:  # under tensor parallelism, or for DoRA's norm: each kernel whole over fsdp
            gathered = (layer_kernels // cfg.num_layers) * 2 // tensor
        else:
            gathered = (layer_kernels // cfg.num_layers) * a // tensor
        if megablox and cfg.num_experts:
            # megablox gathers a device's own experts whole (the expert axis splits them), not a piece at a time;
            # QLoRA dequantises their whole stack at once, its float32 values beside (Mixtral-8x7B on v6e-8,
            # experiments/tpu_compile_table.py)
            experts = act.expert_kernel_elements(cfg)
            local = experts // sizes["expert"]
            if stored and tensor == 1 and not whole_kernel:  # the dense modules a piece at a time, the experts whole
                gathered += local * 2
            else:  # every module whole, a device's experts only
                gathered -= (experts - local) * (2 if stored else a) // tensor
            if unit.quantize_base is not None:
                gathered += experts * 4 // (zero * sizes["expert"])
        copies_b += forwards * gathered
    head_ways = sizes["tensor"] if cfg.vocab_size % sizes["tensor"] == 0 else 1
    if sizes["context"] > 1 and vocab_ways > head_ways:
        # a device's share of a row's tokens meets every vocabulary entry: the head is gathered over the ZeRO axes
        # that split it (split over tensor only), in the compute dtype (XLA:CPU and the TPU compiler alike:
        # tests/test_context_planner.py, experiments/tpu_compile_table.py)
        copies_b += cfg.hidden_size * cfg.vocab_size * jnp.dtype(compute).itemsize // head_ways
    layer_copies = 0 if zero > 1 else _layer_copies(cfg, plan, gathered_piece_bytes(device.family)) // tensor

    extra_models_b = held.second
    if extra_models_b:
        notes.append(f"{plan.objective}: its second model (a frozen reference copy or a teacher) beside the policy")
    kv_b = _rollout_kv(cfg, plan, w, nbytes) if plan.generate_tokens else 0
    if cfg.num_experts and device.family == "tpu" and not megablox:
        notes.append(f"a mixture whose experts' {cfg.expert_size} hidden units tensor={tensor} does not divide runs "
                     "ragged_dot on TPU, which its compiler makes a dense matmul per expert over every row; "
                     "`--confirm` compiles it")

    # With accumulation XLA keeps one more layer's saved activations in the backward (measured on XLA:CPU).
    backward_workspace = acts.workspace + (acts.saved // cfg.num_layers if plan.grad_accum > 1 else 0)
    if rules.dense_grouped_matmul or (device.family == "tpu" and not megablox):
        backward_workspace += act.grouped_matmul_elements(cfg, w, unit.trains_base) * a
    if rules.transposed_weight_gradients and unit.trains_base:
        backward_workspace += act.weight_gradient_elements(remat, w) * 4
    if device.family == "tpu" and remat == "full":
        # The TPU compiler's program holds about two layers' backward working sets (a pipelined backward loop fits
        # what it shows; the cause is not in the dumped HLO): its memory_analysis exceeds its own buffer assignment
        # by 0.8-1.0 of a layer's working set on TPU, 0.45 of this estimate's one (LoRA, QLoRA and DoRA rows of
        # experiments/tpu_compile_table.py); in a full fine-tune, with each of the two a layer's whole float32
        # weight gradient before its reduce-scatter (a device's experts' share of a mixture's).
        backward_workspace += int(0.45 * acts.workspace)
        if unit.trains_base and zero > 1:
            experts = act.expert_kernel_elements(cfg)
            per_layer = layer_kernels // cfg.num_layers - experts + experts // sizes["expert"]
            backward_workspace += 2 * per_layer * 4 // tensor

    # The moments of the step.
    grads_in_flight = grad_b
    largest_gradient = held.largest_trainable // tensor  # summed whole on each device, then split over ZeRO's

    # The TPU compiler's program (live ranges of Llama-3.1-8B's full fine-tune on v5p-64, experiments/
    # tpu_compile_table.py): the embedding's gradient is scattered into a whole table in the compute dtype and
    # all-reduced whole (two whole tables) at the end of the backward; where the micro-batch has fewer tokens than the
    # vocabulary, the compiler moves [tokens, D] rows instead (Llama-3.2-3B's DPO on v5p-64).
    whole_table = largest_gradient * jnp.dtype(compute).itemsize // 4  # (trainable leaves: float32)
    whole_table = int(whole_table * min(cfg.vocab_size, total_rows * plan.seq_len) / cfg.vocab_size)
    phases = {
        "loss": {"activations": acts.saved + logits_b, "gradients": largest_gradient,
                 "weight_copies": residual_copies},
        "backward": {"activations": acts.saved + acts.attention + backward_workspace, "gradients": grads_in_flight,
                     "weight_copies": residual_copies + layer_copies},
        "update": {"activations": held.optimizer_temporaries, "gradients": grad_b + largest_gradient // zero,
                   "weight_copies": 0},
    }
    if device.family == "tpu" and zero > 1 and largest_gradient:
        phases["embedding gradient"] = {"activations": 0, "gradients": grads_in_flight + 2 * whole_table,
                                        "weight_copies": 0}
    offload = plan.offload
    if device.family == "cpu" and (offload.optimizer_state or offload.frozen_params):
        offload = replace(offload, optimizer_state=False, frozen_params=False)
        notes.append("on CPU host and device memory are the same RAM: offloading moves nothing")
    if offload.optimizer_state:
        phases["update"]["optimizer"] = optimizer_b  # copied in for the update, written back to host after
    if plan.generate_tokens:
        # the rollout: the prefill stacks every layer's prompt keys and values, then pads them into the KV cache;
        # while it runs, one layer's working set over all the rollout's prompt tokens: its attention (one layer's
        # scores, their softmax and the masked scores: ROLLOUT_SCORE_COPIES [b, H, bq, bk] float32 blocks) or its
        # MLP (gate, up and their product, and the layer's input, norm and output, measured on XLA:CPU), or the
        # cache being padded; the weights are cast to the compute dtype once for the whole generation (those that
        # are not in it already: measured against the TPU compiler, experiments/tpu_compile_table.py)
        prompt = plan.seq_len - plan.generate_tokens
        rollout_rows = w.b * plan.grad_accum
        scores = nbytes((rollout_rows, w.heads, block_size(prompt), block_size(w.S)), 4)
        prefill_mlp = 3 * nbytes((rollout_rows, prompt, w.F + w.D), a)
        prompt_kv = kv_b * prompt // w.S
        working = max(int(ROLLOUT_SCORE_COPIES * scores), prefill_mlp, kv_b)
        # weights not already in the compute dtype: float32 masters, and a frozen base stored otherwise or quantised
        frozen_widened = unit.quantize_base is not None or plan.param_dtype != compute
        widened = n_trainable + (n_total - n_trainable if frozen_widened else 0)
        cast = widened * jnp.dtype(compute).itemsize // shard if compute != "float32" else 0
        phases["generate"] = {"activations": prompt_kv + working, "gradients": 0, "weight_copies": cast}
    for p in phases.values():
        p["total"] = sum(p.values())
    peak = max(phases, key=lambda k: phases[k]["total"])
    at_peak = phases[peak]

    host_b = 0
    optimizer_dev = optimizer_b
    if offload.optimizer_state:
        host_b += optimizer_b
        optimizer_dev = at_peak.get("optimizer", 0)
        notes.append("offloaded optimizer state is on the device only during the update")
    if offload.frozen_params:
        host_b += frozen_b
        notes.append("offloaded frozen weights are copied to the device whole for each step: they save device "
                     "memory between steps, not at the step's peak")

    batch_b = held.batch
    if peak == "loss":
        saved, attention, logits, workspace = acts.saved, 0, logits_b, 0
    elif peak == "backward":
        saved, attention, logits, workspace = acts.saved, acts.attention, 0, backward_workspace
    else:  # the update's workspace: the optimizer's temporaries
        saved = attention = logits = 0
        workspace = phases["update"]["activations"] if peak == "update" else 0
    kv_at_peak = kv_b if peak == "generate" else 0
    if peak == "generate":
        saved = phases["generate"]["activations"] - kv_b
    copies_b += at_peak["weight_copies"]
    device_side = (frozen_b + trainable_b + extra_models_b + at_peak["gradients"] + optimizer_dev + saved
                   + attention + logits + workspace + copies_b + kv_at_peak + batch_b)
    reserve = rules.reserve_fixed + int(rules.reserve_fraction * device_side)
    return Estimate(
        device=device, plan=plan, model=cfg, mesh=sizes, parameters=n_total, trainable_parameters=n_trainable,
        frozen_bytes=frozen_b, trainable_bytes=trainable_b, extra_models_bytes=extra_models_b,
        gradients_bytes=at_peak["gradients"], optimizer_bytes=optimizer_dev, saved_activations_bytes=saved,
        attention_bytes=attention, logits_bytes=logits, workspace_bytes=workspace, weight_copies_bytes=copies_b,
        kv_cache_bytes=kv_at_peak, batch_bytes=batch_b, reserve_bytes=reserve, host_bytes=host_b,
        peak_phase=peak, phases=phases, base_parameters=held.base_parameters,
        loading_transient_bytes=held.loading_device + (held.loading_host if device.family == "cpu" else 0),
        notes=tuple(notes + [rules.reserve_note]))
