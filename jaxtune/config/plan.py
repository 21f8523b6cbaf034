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

from jaxtune.config.forward import ATTENTION_KERNELS, CONTEXT_ATTENTION, REMAT_POLICIES
from jaxtune.config.method import MethodConfig
from jaxtune.config.model import ModelConfig
from jaxtune.config.run import OPTIMIZERS, MeshConfig, OffloadConfig, context_split_error
from jaxtune.errors import ConfigError, check_choice, check_range

FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # what a plan's compute_dtype and param_dtype may name


@dataclass(frozen=True)
class TrainPlan:
    """One configuration of a fine-tuning step.

    param_dtype: the frozen base weights' dtype (trainable leaves are always float32 master copies, as
    `init_state` makes them). compute_dtype: activations and matmuls. attention, context_attention, tiled_mlp: as
    `ForwardOptions` has them.
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
    (its moments in bfloat16, `offload.moments_dtype`, are AdamW's only).
    """

    method: MethodConfig = field(default_factory=lambda: MethodConfig("full"))
    batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    remat: str = "none"
    compute_dtype: str = "bfloat16"
    param_dtype: str = "bfloat16"
    mesh: MeshConfig = field(default_factory=MeshConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    objective: str = "sft"
    generate_tokens: int = 0
    section: object = None
    second_model: ModelConfig | None = None
    attention: str = "auto"
    context_attention: str = "ring"
    tiled_mlp: int = 0
    optimizer: str = "adamw"

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "grad_accum"):
            check_range(name, getattr(self, name), 1)
        object.__setattr__(self, "remat", self.remat.replace("-", "_"))
        check_choice("remat", self.remat, REMAT_POLICIES)
        check_choice("attention", self.attention, ATTENTION_KERNELS)
        check_choice("context_attention", self.context_attention, CONTEXT_ATTENTION)
        check_range("tiled_mlp", self.tiled_mlp, 0)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.offload.moments_dtype != "float32" and self.optimizer != "adamw":
            raise ConfigError("moments_dtype", self.offload.moments_dtype, f"is for optimizer adamw, not "
                              f"{self.optimizer} (adamw_8bit stores its moments in 8 bits)")
        why = context_split_error(self.seq_len, self.mesh.context)
        if why:
            raise ConfigError("seq_len", self.seq_len, why)
        for name in ("compute_dtype", "param_dtype"):
            check_choice(name, getattr(self, name), FLOAT_DTYPES)
        if not 0 <= self.generate_tokens < self.seq_len:
            raise ConfigError("generate_tokens", self.generate_tokens, "the rollout's prompt and completion share a "
                              f"row of seq_len {self.seq_len} tokens, so use 0 to {self.seq_len - 1}")

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step."""
        return self.batch_size * self.grad_accum

    def replace(self, **changes) -> TrainPlan:
        return dataclasses.replace(self, **changes)
