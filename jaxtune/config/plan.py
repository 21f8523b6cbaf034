"""What a plan is: the run's shape, as the planner sees it.

A `TrainPlan` holds every choice that changes memory or speed and nothing else: the method, dtypes, the global
micro-batch and sequence length, accumulation, the remat policy, the mesh, what lives in host memory, and the
objective with its section (which decide the extra model copies and rows a step holds). It is frozen, so plans are
compared, hashed, and varied with `replace` by the search. Batch sizes are global, as in the run config:
`batch_size` examples per micro-batch over the whole mesh, split over data x fsdp x expert devices
(`config.run.batch_ways`); `grad_accum` micro-batches make one optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxtune.config.forward import ForwardOptions
from jaxtune.config.method import MethodConfig
from jaxtune.config.model import ModelConfig
from jaxtune.config.run import OPTIMIZERS, PARAM_DTYPES, MeshConfig, OffloadConfig, context_split_error
from jaxtune.errors import ConfigError, check_choice, check_range

FORWARD_KNOBS = tuple(f.name for f in dataclasses.fields(ForwardOptions))  # what `TrainPlan.replace` routes to forward


@dataclass(frozen=True)
class TrainPlan:
    """One configuration of a fine-tuning step.

    param_dtype: the frozen base weights' dtype (trainable leaves are always float32 master copies, as
    `init_state` makes them). forward: the `ForwardOptions` the step's forward runs with (its compute dtype a
    device's, not "auto": `ForwardOptions.resolved`).
    objective, as the trainer's steps run them:
    "sft"; "dpo" (`batch_size` pairs = 2 x batch_size rows through the policy and a frozen reference, a copy of the
    weights only for a full fine-tune: adapter methods use the base with adapters off); "reward" (pairs through the
    decoder and a scalar head, no [b, T, V] logits); "grpo" (rows of prompt + completion through the policy and
    the reference, and before the step the rollout: `generate_tokens` of each row's `seq_len` tokens sampled with
    a KV cache; "rlhf" is accepted for it); "distill" (a frozen teacher of the student's architecture beside it).
    The objectives are registered in `jaxtune.objectives`; `section` is the objective's own config (None: its
    defaults), e.g. DPO's `precompute_reference` or GRPO's `group_size`, which change the arrays a step holds.
    `batch_size` counts examples: a pair is two rows, a GRPO prompt `group_size` rows (`objectives.rows(plan)`).
    second_model: the architecture of the objective's second model when it is a model directory (a teacher, a
    reference); None: the policy's own. optimizer: `[train] optimizer`, which decides the optimizer state's arrays
    (its moments in bfloat16, `offload.moments_dtype`, are AdamW's only). images: a vision-language run's image
    side (`models.vision.family.ImageSide`: the frozen tower beside the text model, pixel arrays in each batch
    row), None for text.
    """

    method: MethodConfig
    batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    param_dtype: str = "bfloat16"
    forward: ForwardOptions = field(default_factory=lambda: ForwardOptions(compute_dtype="bfloat16"))
    mesh: MeshConfig = field(default_factory=MeshConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    objective: str = "sft"
    generate_tokens: int = 0
    section: object = None
    second_model: ModelConfig | None = None
    optimizer: str = "adamw"
    images: Any = None

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "grad_accum"):
            check_range(name, getattr(self, name), 1)
        if self.forward.compute_dtype == "auto":
            raise ConfigError("compute_dtype", "auto", "a plan's compute dtype is its devices' (ForwardOptions."
                              "resolved(platform) names it)")
        check_choice("param_dtype", self.param_dtype, PARAM_DTYPES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.offload.moments_dtype != "float32" and self.optimizer != "adamw":
            raise ConfigError("moments_dtype", self.offload.moments_dtype, f"is for optimizer adamw, not "
                              f"{self.optimizer} (adamw_8bit stores its moments in 8 bits)")
        why = context_split_error(self.seq_len, self.mesh.context)
        if why:
            raise ConfigError("seq_len", self.seq_len, why)
        if not 0 <= self.generate_tokens < self.seq_len:
            raise ConfigError("generate_tokens", self.generate_tokens, "the rollout's prompt and completion share a "
                              f"row of seq_len {self.seq_len} tokens, so use 0 to {self.seq_len - 1}")

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step."""
        return self.batch_size * self.grad_accum

    def replace(self, **changes) -> TrainPlan:
        """A copy with `changes`; a forward knob (remat, compute_dtype, attention, ...) changes `forward`."""
        knobs = {name: changes.pop(name) for name in list(changes) if name in FORWARD_KNOBS}
        if knobs:
            changes["forward"] = dataclasses.replace(changes.get("forward", self.forward), **knobs)
        return dataclasses.replace(self, **changes)
