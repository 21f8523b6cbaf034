"""The analytical memory estimate of one training step, per device: `estimate(cfg, plan, device) -> Estimate`.

Nothing is allocated. The arrays the step holds are counted exactly on the spine's abstract run (`held.py`); the
transient memory is the largest of the step's moments (`step_phases`: XLA gives buffers not alive together the same
memory), each a function of the step's shape (`step_of`): the loss's logits, the backward's saved activations and
one layer's workspace (activations.py), the update, GRPO's rollout, with the weight copies alive then (dtype casts,
ZeRO-3's gathered layer, a context axis's head), a vision-language step's tower. Beside them: the second model, the
family's runtime reserve (`FAMILY_RULES`), the peak while loading (`spine/load.py`). Checked against XLA's compiled
memory by experiments/planner_accuracy.py and experiments/tpu_compile_table.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, replace

import jax.numpy as jnp

from jaxtune.config import MeshConfig, ModelConfig, OffloadConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.config.run import batch_ways
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import Method, method_unit
from jaxtune.methods.vision import trained_parts
from jaxtune.models.attention import block_size
from jaxtune.models.head import chunk_length
from jaxtune.models.linear import gathered_piece_bytes
from jaxtune.models.moe import grouped_kernel
from jaxtune.objectives import objective_named, section_of
from jaxtune.objectives import rows as rows_of
from jaxtune.objectives.base import Objective
from jaxtune.parallel.rules import ZERO_AXES, mesh_axes_of
from jaxtune.planner import activations as act
from jaxtune.planner.devices import Device, GiB
from jaxtune.planner.held import RunBytes, run_bytes, tiled_bytes
from jaxtune.planner.hooks import folds_everywhere, hook_facts
from jaxtune.planner.kernels import planned_kernel

MiB = 1 << 20
ROLLOUT_SCORE_COPIES = 2.1  # GRPO's prefill: [b, H, bq, bk] float32 score blocks (measured on XLA:CPU)


@dataclass(frozen=True)
class FamilyRules:
    """How a hardware family changes the arithmetic. workspace_itemsize: bytes per value inside one layer's backward
    (XLA:CPU widens 16-bit values there; the stacks the layer scan keeps stay 16-bit, `models/remat.py`), None
    for the compute dtype's.
    tiled: arrays occupy whole (8, 128) tiles (16 rows for 2-byte, 32 for 1-byte types), as on TPU.
    transposed_weight_gradients: a layer's backward lays the inputs of its weight gradients' matmuls out again, where
    the base trains (`activations.weight_gradient_elements`; XLA:CPU).
    reserve: fixed bytes + a fraction of the device-side estimate, for what XLA's analysis does not see."""

    workspace_itemsize: int | None
    tiled: bool
    reserve_fixed: int
    reserve_fraction: float
    reserve_note: str
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
                       transposed_weight_gradients=True),
}


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
    offloaded_activations_bytes: int = 0  # of host_bytes: remat "offload"'s layer inputs, moved twice a micro-batch
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
            "host_bytes": self.host_bytes, "offloaded_activations_bytes": self.offloaded_activations_bytes,
            "plan": {"method": p.method.kind, "method_options": json.loads(json.dumps(dataclasses.asdict(p.method))),
                     "batch_size": p.batch_size, "seq_len": p.seq_len, "grad_accum": p.grad_accum,
                     "remat": p.forward.remat.policy, "compute_dtype": p.forward.compute_dtype,
                     "param_dtype": p.param_dtype,
                     "mesh": self.mesh, "offload": {"optimizer_state": p.offload.optimizer_state,
                                                    "frozen_params": p.offload.frozen_params,
                                                    "moments_dtype": p.offload.moments_dtype},
                     "objective": p.objective, "context_attention": p.forward.context_attention,
                     "images": None if p.images is None else {"family": p.images.family.name,
                                                              "max_images_per_row": p.images.max_images,
                                                              "pixel_shape": list(p.images.pixel_shape)}},
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


def _kernel_elements(cfg: ModelConfig) -> tuple[int, int]:
    """(elements of all layers' linear kernels, of the output head)."""
    return cfg.num_layers * act.kernel_elements_per_layer(cfg), cfg.hidden_size * cfg.vocab_size


def _cast_copies(plan: TrainPlan, layer_kernels: int, head_kernel: int, a: int, head_converted: bool
                 ) -> tuple[int, int]:
    """(bytes kept for the backward, bytes alive all step) of weight copies that dtype casts make, before sharding.

    Everywhere: under remat "none", JAX keeps `kernel.astype(compute dtype)` of every layer for the backward when
    the kernel's dtype differs (float32 masters under bfloat16 compute; frozen float32 weights under bfloat16).
    Frozen kernels quantised or held as bit patterns (`models/quant.BitPattern`, every 16-bit one) are re-derived
    in the backward instead (models/linear.py).
    A frozen head (or tied embedding) stored in a dtype other than the compute dtype is converted once for the step,
    out of the chunked loss's loop (measured on XLA:CPU; under fsdp, each device its vocabulary shard):
    `head_converted` (`_head_converted`).
    """
    frozen = not method_unit(plan.method).trains_base
    kernel_dtype = plan.param_dtype if frozen else "float32"
    residual = copies = 0
    kept = not frozen or (method_unit(plan.method).quantize_base is None and jnp.dtype(kernel_dtype).itemsize > 2)
    if plan.forward.remat.recomputes == "none" and kept and kernel_dtype != plan.forward.compute_dtype:
        # a frozen float32 copy is multiplied on XLA:CPU in float32 too (activation width `a`); float32 masters
        # cast to bf16 stay bf16
        residual = layer_kernels * (a if frozen else jnp.dtype(plan.forward.compute_dtype).itemsize)
    if head_converted:
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
    mlp = act.kernel_elements_per_layer(cfg) - D * (2 * q + 2 * kv)  # (Qwen3.5's: a mean layer's other kernels)
    modules = [D * q, D * kv, D * kv, q * D] + [mlp // 3] * 3  # elements of each kernel (a mixture's: its MLP)
    return sum(piece_bytes for m in modules if m * derived > piece_bytes)


def _widened(plan: TrainPlan) -> bool:
    """Whether frozen 16-bit weights are widened where they are used (float32 compute)."""
    return jnp.dtype(plan.param_dtype).itemsize == 2 < jnp.dtype(plan.forward.compute_dtype).itemsize


def _rollout_kv(cfg: ModelConfig, plan: TrainPlan, w, nbytes) -> int:
    """Bytes of the rollout KV cache per device (GRPO's, RLOO's, distillation's): [L, A b, prefix + T, K, hd] keys and
    values; with the paged engine (`rollout_engine = "paged"`) its pool [L, pages, page size, K, hd], the pages as
    `rollouts.engine` sizes them by default (every prompt's, and each slot's longest sample's, to a power of two) or
    as set (an environment's turn: each row its own prompt)."""
    prefix = method_unit(plan.method).costs.attended_tokens(plan.method)
    rollout_rows = w.b * plan.grad_accum  # one generation for the optimizer step's rows, then A micro-batches
    itemsize = jnp.dtype(plan.forward.compute_dtype).itemsize
    section = section_of(plan)
    if getattr(section, "rollout_engine", "padded") == "paged":
        ps, prompt = section.rollout_page_size, plan.seq_len - plan.generate_tokens
        group = 1 if getattr(section, "environment", "") else getattr(section, "group_size", 1)  # a turn: its own
        prompts = -(-rollout_rows // group)
        longest = bucket(plan.generate_tokens, MIN_BUCKET)  # the engine's static limit
        pages = section.rollout_pages or bucket(prompts * -(-prompt // ps) + section.rollout_slots * -(-(longest - 1)
                                                                                                     // ps))
        return 2 * cfg.num_layers * nbytes((pages, ps, w.kv_heads, cfg.head_dim), itemsize)
    return 2 * cfg.num_layers * nbytes((rollout_rows, prefix + plan.seq_len, w.kv_heads, cfg.head_dim), itemsize)


@dataclass(frozen=True)
class Step:
    """What every phase's rule reads: the plan on its device, the mesh's sizes, one micro-batch's widths, the arrays
    the step holds (`held.run_bytes`) and the activations its forward saves (`activations.activation_bytes`)."""

    cfg: ModelConfig
    plan: TrainPlan
    device: Device
    rules: FamilyRules
    sizes: dict
    rows: int  # the step's rows (a pair is two, a GRPO prompt group_size)
    w: act.Widths
    megablox: bool  # a mixture's experts run megablox (`moe.grouped_kernel`)
    held: RunBytes
    acts: act.ActivationBytes  # on the device: under remat "offload", less `offloaded`
    offloaded: int = 0  # remat "offload": the saved activations in host memory (`act.offloaded`)

    @property
    def unit(self) -> Method:
        return method_unit(self.plan.method)

    @property
    def objective(self) -> Objective:
        return objective_named(self.plan.objective)

    @property
    def compute_size(self) -> int:
        """Bytes of a value in the compute dtype."""
        return jnp.dtype(self.plan.forward.compute_dtype).itemsize

    @property
    def zero(self) -> int:
        return zero_ways(self.sizes)

    @property
    def tensor(self) -> int:
        return self.sizes["tensor"]

    def nbytes(self, shape, itemsize: int) -> int:
        """Bytes of an array of `shape` on the device (in whole tiles where the family tiles)."""
        return _array_bytes(self.rules.tiled)(shape, itemsize)


def _array_bytes(tiled: bool):
    """(shape, itemsize) -> bytes of such an array on a device, in whole tiles where `tiled`."""
    return (lambda shape, size: tiled_bytes(shape, size)) if tiled else (lambda shape, size: math.prod(shape) * size)


def step_of(cfg: ModelConfig, plan: TrainPlan, device: Device) -> Step:
    """The step's shape on `device`: its rows split over the mesh, the widths of a device's micro-batch, the arrays
    it holds and the activations its forward saves (a fused attention kernel's workspace its own)."""
    rules = FAMILY_RULES[device.family]
    sizes = resolve_mesh(plan.mesh, device)
    ways = batch_ways(sizes)
    total_rows = rows_of(plan)
    if total_rows % ways:
        raise JaxtuneError(f"batch {plan.batch_size} ({total_rows} rows) cannot be split over data x fsdp x expert = "
                           f"{sizes['data']} x {sizes['fsdp']} x {sizes['expert']} = {ways} devices; use a multiple "
                           f"of {ways} rows")
    if plan.generate_tokens and sizes["context"] > 1:
        raise JaxtuneError(f"GRPO's rollout decodes whole rows, which context = {sizes['context']} would split: use "
                           "a mesh without a context axis")
    rows, remat = total_rows // ways, plan.forward.remat.recomputes
    prefix = method_unit(plan.method).costs.attended_tokens(plan.method)
    megablox = grouped_kernel(cfg, device.family, sizes["tensor"]) == "megablox"  # else ragged_dot, dense on TPU
    w = act.widths(cfg, rows, plan.seq_len, prefix, sizes["tensor"], megablox, sizes["expert"], sizes["context"],
                   plan.forward.context_attention,
                   # under save_matmuls the tiles' matmul outputs are all kept: a tiled MLP saves nothing there
                   plan.forward.tiled_mlp if remat != "save_matmuls" else 0,
                   _fused_low_rank(cfg, plan, sizes, device), hook_facts(cfg, plan.method).whole_kernel)
    a = jnp.dtype(plan.forward.compute_dtype).itemsize
    copies = objective_named(plan.objective).logits_copies(plan.method, section_of(plan))
    acts = act.activation_bytes(cfg, plan.method, remat, w, a, _array_bytes(rules.tiled), copies, total_rows,
                                (lambda shape, size: tiled_bytes(shape, size, True)) if rules.tiled else None,
                                rules.workspace_itemsize)
    kernel = planned_kernel(cfg, plan, device.family, rows, prefix, w.context)
    if kernel is not None and kernel.costs.workspace is not None:  # a fused kernel's own (splash: VMEM, not HBM)
        acts = replace(acts, attention=kernel.costs.workspace(w.b, w.heads, w.T, w.S, a))
    held = run_bytes(cfg, plan, sizes, rules.tiled)
    offloaded = 0
    if plan.forward.remat.policy == "offload" and device.family != "cpu":  # a CPU runs it as "full" (`models/remat`)
        offloaded, acts = acts.saved, act.offloaded(acts, cfg.num_layers)
    return Step(cfg, plan, device, rules, sizes, total_rows, w, megablox, held, acts, offloaded)


def _vocab_ways(step: Step) -> int:
    """The devices the head's vocabulary is split over."""
    return math.prod(step.sizes[a] for a in mesh_axes_of(("vocab",), (step.cfg.vocab_size,), step.sizes)[0])


def _head_pieces(step: Step) -> bool:
    """Whether a frozen 16-bit head under wider compute is read from its bits a piece at a time: a device's share
    of it is larger than a piece (`linear.pieces_of`)."""
    cfg, plan = step.cfg, step.plan
    return (not step.unit.trains_base and _widened(plan) and cfg.hidden_size * cfg.vocab_size // _vocab_ways(step)
            * step.compute_size > gathered_piece_bytes(step.device.family))


def _head_converted(step: Step) -> bool:
    """Whether a frozen head (or tied embedding) stored in another dtype than the compute dtype is converted once
    for the step, rather than read from its bits a piece at a time (`_head_pieces`)."""
    plan = step.plan
    return not step.unit.trains_base and plan.param_dtype != plan.forward.compute_dtype and not _head_pieces(step)


def loss_logits(step: Step) -> int:
    """Bytes of the loss's logits: the chunked head's, and where the head is read a piece at a time into a buffer
    of its own, one more chunk where XLA:CPU gave it one (the loss is one chunk: the forward's first piece and its
    recomputation's merged, then copied for each; or the vocabulary is split over devices: the logits' gradient
    laid out again)."""
    one_chunk = chunk_length(step.rows, step.w.T, step.cfg.vocab_size) >= step.w.T
    if _head_pieces(step) and (one_chunk or _vocab_ways(step) > 1):
        return step.acts.logits + step.acts.logits_one
    return step.acts.logits


def _zero_gathered(step: Step) -> int:
    """Bytes of one layer's weights as ZeRO-3 gathers them where they are used, for each forward.

    One layer at a time inside the scan: a frozen 16-bit kernel a piece at a time in its own dtype, with XLA:CPU's
    copy of the piece from its bits (`linear.gathered_piecewise_matmul`), others whole as XLA widens them; a second
    model's forward (a reference, a teacher) gathers its own beside them. The head is split by vocabulary, never
    gathered (measured on fake CPU devices). On TPU the reference's gathered weights are not beside the policy's at
    the peak: a 1B LoRA's DPO step compiled to its SFT step's bytes (experiments/tpu_compile_table.py).
    """
    cfg, plan, unit, tensor, a = step.cfg, step.plan, step.unit, step.tensor, step.compute_size
    layer_kernels, _ = _kernel_elements(cfg)
    forwards = 1 + (step.objective.extra_forwards(section_of(plan)) if step.device.family != "tpu" else 0)
    stored = not unit.trains_base and unit.quantize_base is None and jnp.dtype(plan.param_dtype).itemsize == 2
    whole_kernel = hook_facts(cfg, plan.method).whole_kernel  # DoRA's norm: each kernel whole
    if stored and tensor == 1 and not whole_kernel:
        largest = 2 * cfg.hidden_size * max(cfg.q_size, cfg.intermediate_size)  # bytes of a layer's widest kernel
        piece = min(gathered_piece_bytes(step.device.family), largest)
        gathered = piece + piece * a // 2  # and its copy in the compute dtype
    elif stored:  # under tensor parallelism, or for DoRA's norm: each kernel whole over fsdp
        gathered = (layer_kernels // cfg.num_layers) * 2 // tensor
    else:
        gathered = (layer_kernels // cfg.num_layers) * a // tensor
    if step.megablox and cfg.num_experts:
        # megablox gathers a device's own experts whole (the expert axis splits them), not a piece at a time;
        # QLoRA dequantises their whole stack at once, its float32 values beside (Mixtral-8x7B on v6e-8,
        # experiments/tpu_compile_table.py)
        experts = act.expert_kernel_elements(cfg)
        local = experts // step.sizes["expert"]
        if stored and tensor == 1 and not whole_kernel:  # the dense modules a piece at a time, the experts whole
            gathered += local * 2
        else:  # every module whole, a device's experts only
            gathered -= (experts - local) * (2 if stored else a) // tensor
        if unit.quantize_base is not None:
            gathered += experts * 4 // (step.zero * step.sizes["expert"])
    return forwards * gathered


def weight_copies(step: Step) -> tuple[int, int, int]:
    """(kept for the backward, alive all step, one layer's derived kernels in its backward): bytes on one device of
    the weight copies that dtype casts, ZeRO-3's gathers and a context axis's head gather make."""
    cfg, sizes = step.cfg, step.sizes
    layer_kernels, head_kernel = _kernel_elements(cfg)
    cast = _cast_copies(step.plan, layer_kernels, head_kernel, step.compute_size, _head_converted(step))
    residual, copies = (c // (step.zero * step.tensor) for c in cast)
    if step.zero > 1:
        copies += _zero_gathered(step)
    head_ways = sizes["tensor"] if cfg.vocab_size % sizes["tensor"] == 0 else 1
    if sizes["context"] > 1 and _vocab_ways(step) > head_ways:
        # a device's share of a row's tokens meets every vocabulary entry: the head is gathered over the ZeRO axes
        # that split it (split over tensor only), in the compute dtype (XLA:CPU and the TPU compiler alike:
        # tests/test_context_planner.py, experiments/tpu_compile_table.py)
        copies += cfg.hidden_size * cfg.vocab_size * step.compute_size // head_ways
    piece = gathered_piece_bytes(step.device.family)
    layer = 0 if step.zero > 1 else _layer_copies(cfg, step.plan, piece) // step.tensor
    return residual, copies, layer


def backward_workspace(step: Step) -> int:
    """Bytes of the backward's working set beyond the saved activations: one layer's (`activations`), plus one more
    layer's saved activations under accumulation (XLA:CPU), a dense grouped matmul's (TPU), transposed weight gradients'
    inputs where the base trains, and the TPU compiler's second layer under remat "full"."""
    cfg, plan, acts, w, a = step.cfg, step.plan, step.acts, step.w, step.compute_size
    remat, trains_base = plan.forward.remat.recomputes, step.unit.trains_base
    workspace = acts.workspace + ((step.offloaded or acts.saved) // cfg.num_layers if plan.grad_accum > 1 else 0)
    tpu = step.device.family == "tpu"
    # a mixture's grouped matmul: ragged_dot on TPU is dense per expert; CPU's tiles (`models/grouped_tiles.py`) hold
    # a tile's rows beside the layer's, within 8% of XLA:CPU's step for eight mixtures without a term of their own
    if tpu and not step.megablox:
        workspace += act.grouped_matmul_elements(cfg, w, trains_base) * a
    if step.rules.transposed_weight_gradients and trains_base:
        workspace += act.weight_gradient_elements(remat, w) * 4
    if tpu and remat == "full":
        # The TPU compiler's program holds about two layers' backward working sets (a pipelined backward loop fits
        # what it shows; the cause is not in the dumped HLO): its memory_analysis exceeds its own buffer assignment
        # by 0.8-1.0 of a layer's working set on TPU, 0.45 of this estimate's one (LoRA, QLoRA and DoRA rows of
        # experiments/tpu_compile_table.py), a frozen mixture's group streams held once (`act.EXPERT_STREAMS`,
        # DeepSeek-V3's rows); in a full fine-tune, with each of the two a layer's whole float32
        # weight gradient before its reduce-scatter (a device's experts' share of a mixture's).
        workspace += int(0.45 * (acts.workspace - acts.expert_streams))
        if step.megablox and cfg.experts_per_token == 1 and not cfg.dense_layers:
            # every layer a top-1 mixture: the compiler lays the attention side of the backward out again with the
            # tokens minor, and the saved [L, b, T, D] residual stack with it, a second copy (Llama 4 Scout at 8,192
            # tokens, Mixtral routed top-1 at 4,096 and 8,192, not at top-2; not Scout at 4,096, nor Maverick, whose
            # dense layers make the scan switch kinds: experiments/README.md)
            workspace += acts.saved
        if trains_base and step.zero > 1:
            experts = act.expert_kernel_elements(cfg)
            per_layer = _kernel_elements(cfg)[0] // cfg.num_layers - experts + experts // step.sizes["expert"]
            workspace += 2 * per_layer * 4 // step.tensor
    return workspace


def _embedding_gradient(step: Step) -> int:
    """Bytes of the TPU compiler's whole embedding gradient (live ranges of Llama-3.1-8B's full fine-tune on
    v5p-64, experiments/tpu_compile_table.py): scattered into a whole table in the compute dtype and all-reduced
    whole (two whole tables) at the end of the backward; where the micro-batch has fewer tokens than the
    vocabulary, the compiler moves [tokens, D] rows instead (Llama-3.2-3B's DPO on v5p-64)."""
    largest = step.held.largest_trainable // step.tensor
    whole_table = largest * step.compute_size // 4  # (trainable leaves: float32)
    return 2 * int(whole_table * min(step.cfg.vocab_size, step.rows * step.plan.seq_len) / step.cfg.vocab_size)


def rollout_phase(step: Step, kv: int) -> dict:
    """GRPO's rollout: the prefill stacks every layer's prompt keys and values, then pads them into the KV cache
    (`kv` bytes); while it runs, one layer's working set over all the rollout's prompt tokens: its attention (one
    layer's scores, their softmax and the masked scores: ROLLOUT_SCORE_COPIES [b, H, bq, bk] float32 blocks) or
    its MLP (gate, up and their product, and the layer's input, norm and output, measured on XLA:CPU), or the
    cache being padded; the weights are cast to the compute dtype once for the whole generation (those that are
    not in it already: measured against the TPU compiler, experiments/tpu_compile_table.py)."""
    plan, w, held, compute = step.plan, step.w, step.held, step.plan.forward.compute_dtype
    prompt = plan.seq_len - plan.generate_tokens
    rollout_rows = w.b * plan.grad_accum
    scores = step.nbytes((rollout_rows, w.heads, block_size(prompt), block_size(w.S)), 4)
    prefill_mlp = 3 * step.nbytes((rollout_rows, prompt, w.F + w.D), step.compute_size)
    working = max(int(ROLLOUT_SCORE_COPIES * scores), prefill_mlp, kv)
    # weights not already in the compute dtype: float32 masters, and a frozen base stored otherwise or quantised
    frozen_widened = step.unit.quantize_base is not None or plan.param_dtype != compute
    widened = held.trainable_parameters + (held.parameters - held.trainable_parameters if frozen_widened else 0)
    cast = widened * step.compute_size // (step.zero * step.tensor) if compute != "float32" else 0
    return {"activations": kv * prompt // w.S + working, "gradients": 0, "weight_copies": cast}


def step_phases(step: Step, logits: int, workspace: int, residual_copies: int, layer_copies: int, kv: int,
                offload: OffloadConfig) -> dict[str, dict[str, int]]:
    """{phase: {"activations", "gradients", "weight_copies", ("optimizer"), "total"}}: the transient bytes of each
    of the step's moments (XLA gives buffers not alive together the same memory)."""
    acts, held = step.acts, step.held
    largest_gradient = held.largest_trainable // step.tensor  # summed whole on each device, then split over ZeRO's
    phases = {
        "loss": {"activations": acts.saved + logits, "gradients": largest_gradient, "weight_copies": residual_copies},
        "backward": {"activations": acts.saved + acts.attention + workspace, "gradients": held.trainable,
                     "weight_copies": residual_copies + layer_copies},
        "update": {"activations": held.optimizer_temporaries,
                   "gradients": held.trainable + largest_gradient // step.zero, "weight_copies": 0},
    }
    if step.device.family == "tpu" and step.zero > 1 and largest_gradient:
        phases["embedding gradient"] = {"activations": 0, "gradients": held.trainable + _embedding_gradient(step),
                                        "weight_copies": 0}
    if offload.optimizer_state:
        phases["update"]["optimizer"] = held.optimizer  # copied in for the update, written back to host after
    if step.plan.generate_tokens:
        phases["generate"] = rollout_phase(step, kv)
    images = step.plan.images
    if images is not None:  # the tower's forward on a device's rows' pixel arrays, before the decoder's
        trained = bool(trained_parts(step.plan.method, images.family))
        kept = {"saved": True} if trained else {}  # a family whose image side trains counts its saved layers
        tower = images.family.forward_bytes(images.config, images.pixel_shape, step.w.b * images.max_images,
                                            step.compute_size, **kept)
        phases["image side"] = {"activations": tower, "gradients": 0, "weight_copies": residual_copies}
        phases["loss"]["activations"] += tower_saved(step)
        phases["backward"]["activations"] += tower_saved(step)
        if trained:  # its backward, last: a layer recomputed beside its cotangents, the layers' inputs kept
            phases["image side backward"] = {"activations": tower + tower - tower_saved(step),
                                             "gradients": held.trainable, "weight_copies": residual_copies}
    for p in phases.values():
        p["total"] = sum(p.values())
    return phases


def tower_saved(step) -> int:
    """Bytes a trained tower keeps for its backward while the decoder runs (each layer's input: the layers are
    rematerialised); 0 for a frozen one or a text run."""
    images = step.plan.images
    if images is None or not trained_parts(step.plan.method, images.family):
        return 0
    count = lambda saved: images.family.forward_bytes(images.config, images.pixel_shape,  # noqa: E731
                                                      step.w.b * images.max_images, step.compute_size, saved=saved)
    return count(True) - count(False)


def estimate(cfg: ModelConfig, plan: TrainPlan, device: Device) -> Estimate:
    """Per-device memory of `plan`'s training step for `cfg` on `device` (with its count), without allocating.

    The arrays the step holds (weights, masters, optimizer state, the second model, the batch) are counted exactly
    on the spine's abstract run (`held.run_bytes`); its transient memory by phase (`step_phases`): the loss's
    logits, the backward's workspace, the update, GRPO's rollout, each with the weight copies alive then.
    """
    step = step_of(cfg, plan, device)
    held, acts, rules = step.held, step.acts, step.rules
    notes: list[str] = []
    logits = loss_logits(step)
    residual_copies, copies, layer_copies = weight_copies(step)
    if _head_converted(step):
        notes.append(f"the frozen {plan.param_dtype} head is converted to {plan.forward.compute_dtype} for the step: "
                     "that copy is counted")
    if held.second:
        notes.append(f"{plan.objective}: its second model (a frozen reference copy or a teacher) beside the policy")
    kv = _rollout_kv(cfg, plan, step.w, step.nbytes) if plan.generate_tokens else 0
    if cfg.num_experts and device.family == "tpu" and not step.megablox:
        notes.append(f"a mixture whose experts' {cfg.expert_size} hidden units tensor={step.tensor} does not divide "
                     "runs ragged_dot on TPU, which its compiler makes a dense matmul per expert over every row; "
                     "`--confirm` compiles it")
    offload = plan.offload
    if device.family == "cpu" and (offload.optimizer_state or offload.frozen_params):
        offload = replace(offload, optimizer_state=False, frozen_params=False)
        notes.append("on CPU host and device memory are the same RAM: offloading moves nothing")
    if device.family == "cpu" and plan.forward.remat.policy == "offload":
        notes.append('remat "offload" runs as "full" on CPU: host and device memory are the same RAM')
    workspace = backward_workspace(step)
    phases = step_phases(step, logits, workspace, residual_copies, layer_copies, kv, offload)
    peak = max(phases, key=lambda k: phases[k]["total"])
    at_peak = phases[peak]

    host, optimizer = step.offloaded, held.optimizer
    if step.offloaded:
        notes.append(f'remat "offload": {step.offloaded / (1 << 30):.2f} GiB of layer inputs in pinned host memory, '
                     "copied out in the forward and back in the backward")
    if offload.optimizer_state:
        host += held.optimizer
        optimizer = at_peak.get("optimizer", 0)
        notes.append("offloaded optimizer state is on the device only during the update")
    if offload.frozen_params:
        host += held.frozen
        notes.append("offloaded frozen weights are copied to the device whole for each step: they save device "
                     "memory between steps, not at the step's peak")
    # the breakdown at the peak: what each phase's "activations" are made of
    saved, attention, logits_at_peak, workspace_at_peak = {
        "loss": (acts.saved + tower_saved(step), 0, logits, 0),
        "backward": (acts.saved + tower_saved(step), acts.attention, 0, workspace),
        "update": (0, 0, 0, phases["update"]["activations"]),
        "generate": (at_peak["activations"] - kv, 0, 0, 0),
        "image side": (0, 0, 0, at_peak["activations"]),
        "image side backward": (0, 0, 0, at_peak["activations"]),
    }.get(peak, (0, 0, 0, 0))
    kv_at_peak = kv if peak == "generate" else 0
    copies += at_peak["weight_copies"]
    device_side = (held.frozen + held.trainable + held.second + at_peak["gradients"] + optimizer + saved
                   + attention + logits_at_peak + workspace_at_peak + copies + kv_at_peak + held.batch)
    reserve = rules.reserve_fixed + int(rules.reserve_fraction * device_side)
    return Estimate(
        device=device, plan=plan, model=cfg, mesh=step.sizes, parameters=held.parameters,
        trainable_parameters=held.trainable_parameters, frozen_bytes=held.frozen, trainable_bytes=held.trainable,
        extra_models_bytes=held.second, gradients_bytes=at_peak["gradients"], optimizer_bytes=optimizer,
        saved_activations_bytes=saved, attention_bytes=attention, logits_bytes=logits_at_peak,
        workspace_bytes=workspace_at_peak, weight_copies_bytes=copies, kv_cache_bytes=kv_at_peak,
        batch_bytes=held.batch, reserve_bytes=reserve, host_bytes=host, peak_phase=peak, phases=phases,
        base_parameters=held.base_parameters,
        loading_transient_bytes=held.loading_device + (held.loading_host if device.family == "cpu" else 0),
        offloaded_activations_bytes=step.offloaded, notes=tuple(notes + [rules.reserve_note]))
