"""The sections of a training run's TOML, each a frozen dataclass that validates its own values.

    [model]   ModelSection: path, dtype, router_aux_loss_coef, and the `ForwardOptions` (compute_dtype, remat, ...)
    [data]    DataConfig: train, eval, eval_fraction, max_seq_len, pack, seed, columns, apply_chat_template
    [train]   TrainConfig: objective, output_dir, epochs, max_steps, batch_size, grad_accum, learning_rate, ...
    [mesh]    MeshConfig: data, fsdp, expert, context, tensor (device mesh sizes; -1 takes the rest; `batch_ways`)
    [offload] OffloadConfig: optimizer_state, frozen_params (host memory), moments_dtype
    [eval]    EvalConfig: tasks (lm-eval benchmark tasks scored at each evaluation), limit, num_fewshot, ...
[method] is `MethodConfig` (method.py), an objective's section ([dpo], ...) its own; `run_config` makes a `RunConfig`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from jaxtune.config.forward import ForwardOptions
from jaxtune.errors import ConfigError, JaxtuneError, check_choice, check_range

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
MOMENT_DTYPES = ("float32", "bfloat16")
OPTIMIZERS = ("adamw", "adafactor", "muon", "adamw_8bit")  # [train] optimizer (spine/optimizers.py)
MUON_LR_ADJUSTMENTS = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn
PARAM_DTYPES = ("float32", "bfloat16", "float16")  # of the frozen base (a run's, a plan's)


@dataclass(frozen=True)
class ModelSection:
    """path: a Hugging Face model directory, a .gguf file, or a Hub id (`owner/name[@revision]`: `jaxtune.hub`).
    dtype: of the frozen base ("auto": as stored). Trainable leaves are
    always float32 master weights. forward: how the forward computes (`ForwardOptions`: compute_dtype, remat,
    scan_layers, attention, context_attention, tiled_mlp), written as keys of [model] beside these in a run's TOML;
    its compute_dtype defaults to "auto" here, what the run's devices multiply fast (bfloat16 on TPUs, GPUs and
    Gaudis, float32 on CPUs). router_aux_loss_coef: a mixture of experts' load-balancing loss weight in training
    (0: none); -1: as its config.json says (transformers': `router_aux_loss_coef` if `output_router_logits`, else
    none)."""

    path: str = ""
    dtype: str = "auto"
    router_aux_loss_coef: float = -1.0
    forward: ForwardOptions = field(default_factory=lambda: ForwardOptions(compute_dtype="auto"))

    def __post_init__(self):
        check_choice("dtype", self.dtype, ("auto",) + PARAM_DTYPES)
        if self.router_aux_loss_coef < 0 and self.router_aux_loss_coef != -1:
            raise ConfigError("router_aux_loss_coef", self.router_aux_loss_coef, "needs >= 0, or -1 (config.json's)")


# The record fields jaxtune reads (data/formats.py): alpaca, prompt/completion, chat (with tools), preference pairs.
RECORD_FIELDS = ("instruction", "input", "output", "prompt", "completion", "messages", "tools", "chosen", "rejected")


@dataclass(frozen=True)
class DataConfig:
    """train/eval: JSONL (.jsonl, .jsonl.gz), Parquet or Arrow files (or a glob of them), `datasets` `save_to_disk`
    directories (`data.sources`), or a Hub dataset id `owner/name[@revision][:split]` (`jaxtune.hub`).
    Without an eval file, `eval_fraction` of train is held out (by `seed`). columns: our field
    names -> the dataset's column names where they differ (TOML: `columns = {prompt = "question"}`), held as sorted
    pairs. apply_chat_template: prompt/completion and alpaca records become a user and an assistant turn of the
    model's chat template (else raw text: prompt + completion + EOS). max_images_per_row: for a vision-language
    model, the pixel arrays (images, and pan-and-scan's crops) a batch row holds: the batch's static
    [rows, max_images_per_row, C, H, W]; rows are packed within it, and an example holding more is an error."""

    train: str = ""
    eval: str = ""
    eval_fraction: float = 0.1
    max_seq_len: int = 256
    pack: bool = True
    seed: int = 0
    columns: tuple = ()
    apply_chat_template: bool = False
    max_images_per_row: int = 1

    def __post_init__(self):
        columns = self.columns.items() if isinstance(self.columns, dict) else self.columns
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, str) for x in p)
                   for p in columns):
            raise ConfigError("columns", self.columns, "must be a table of our field name = the dataset's column")
        unknown = sorted({ours for ours, _ in columns} - set(RECORD_FIELDS))
        if unknown:
            raise ConfigError("columns", self.columns, f"maps {unknown[0]!r}, not a field of ours "
                                                       f"({', '.join(RECORD_FIELDS)})")
        object.__setattr__(self, "columns", tuple(sorted((ours, theirs) for ours, theirs in columns)))
        check_range("eval_fraction", self.eval_fraction, 0.0, 1.0, high_open=True)
        check_range("max_seq_len", self.max_seq_len, 2)
        check_range("seed", self.seed, 0)
        check_range("max_images_per_row", self.max_images_per_row, 1)


REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hub repo `owner/name` (train.push_to_hub)
REPORTERS = ("tensorboard", "wandb")  # [train] report_to (train/tracking.py)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping. A step consumes `grad_accum` micro-batches of `batch_size` rows (for dpo, orpo,
    cpo, simpo and reward: pairs; kto: examples; grpo and rloo: prompts, each sampled `group_size` times).

    objective: sft (masked cross-entropy), dpo (preference optimisation, [dpo]), orpo / cpo / simpo (reference-free
    preference optimisation), kto (unpaired desirable / undesirable examples), reward (a Bradley-Terry reward model),
    grpo / rloo (online RL against a reward) or distill (from a teacher, [distill]); each reads its own section.

    schedule: warmup (linear, `warmup_steps`) then "cosine", "linear" (to `min_lr_ratio` x lr) or "constant".
    optimizer (after clipping to `max_grad_norm`; `spine/optimizers.py`): "adamw" (adam_b1, adam_b2, adam_eps,
    weight_decay), "adafactor" (factored second moments, as transformers' Trainer runs optim="adafactor"), "muon"
    (Newton-Schulz orthogonalised momentum `muon_momentum` for the layers' matrices, its step scaled by
    torch.optim.Muon's `muon_adjust_lr_fn`; AdamW for the rest) or "adamw_8bit" (AdamW with both moments in 8
    bits, as bitsandbytes' AdamW8bit).
    max_steps: 0 trains `epochs` epochs. eval_every / checkpoint_every: in steps (0: at epoch ends / at the end).
    max_nonfinite_steps: the run stops after this many non-finite steps in a row (each is skipped and counted).
    report_to: where metrics go besides metrics.jsonl ("tensorboard": run_dir/tensorboard; "wandb": a W&B run named
    after run_dir, project WANDB_PROJECT or "jaxtune", offline under run_dir/wandb when no credentials exist, for
    `wandb sync` later; each needs its package installed). profile_steps: [first, last] writes a `jax.profiler` trace
    of those steps to run_dir/profile (TensorBoard's profile plugin or Perfetto open it). progress_every_s: where
    stderr is not a terminal, a progress line this often. push_to_hub: "owner/name", a Hub repo the finished run's
    result (adapter/ or model/) is uploaded to with a model card (`train.push`); "" (default): none.
    """

    objective: str = "sft"
    output_dir: str = "runs/run"
    epochs: int = 1
    max_steps: int = 0
    batch_size: int = 8
    grad_accum: int = 1
    learning_rate: float = 2e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adamw"
    muon_momentum: float = 0.95
    muon_adjust_lr_fn: str = "match_rms_adamw"
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_nonfinite_steps: int = 10
    resume_step: int = -1
    report_to: tuple = ()
    profile_steps: tuple = ()
    progress_every_s: float = 10.0
    push_to_hub: str = ""

    def __post_init__(self):
        if self.push_to_hub and not REPO_ID.fullmatch(self.push_to_hub):
            raise ConfigError("push_to_hub", self.push_to_hub, "needs a Hub repo id, owner/name")
        check_choice("schedule", self.schedule, ("cosine", "linear", "constant"))
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("muon_adjust_lr_fn", self.muon_adjust_lr_fn, MUON_LR_ADJUSTMENTS)
        for kind in self.report_to:
            check_choice("report_to", kind, REPORTERS)
        if self.profile_steps and not (len(self.profile_steps) == 2 and all(
                isinstance(s, int) and not isinstance(s, bool) for s in self.profile_steps)
                and 1 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise ConfigError("profile_steps", list(self.profile_steps), "needs [first, last], 1 <= first <= last")
        check_range("progress_every_s", self.progress_every_s, 0, low_open=True)
        if not self.output_dir:
            raise ConfigError("output_dir", self.output_dir, "needs a directory")
        for name in ("epochs", "batch_size", "grad_accum", "log_every", "keep_checkpoints", "max_nonfinite_steps"):
            check_range(name, getattr(self, name), 1)
        for name in ("max_steps", "warmup_steps", "eval_every", "checkpoint_every", "seed"):
            check_range(name, getattr(self, name), 0)
        check_range("learning_rate", self.learning_rate, 0)
        check_range("min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_range("weight_decay", self.weight_decay, 0)
        check_range("adam_b1", self.adam_b1, 0, 1, high_open=True)
        check_range("adam_b2", self.adam_b2, 0, 1, high_open=True)
        check_range("adam_eps", self.adam_eps, 0, low_open=True)
        check_range("muon_momentum", self.muon_momentum, 0, 1, high_open=True)
        check_range("max_grad_norm", self.max_grad_norm, 0, low_open=True)
        check_range("resume_step", self.resume_step, -1)


def context_split_error(seq_len: int, context: int) -> str | None:
    """Why rows of `seq_len` tokens cannot split over a context axis of `context` devices, or None: each row is cut
    into 2 x context chunks (`models/context_attention.py`)."""
    if context > 1 and seq_len % (2 * context):
        return (f"does not split over [mesh] context = {context}: a row is cut into 2 x {context} chunks, so use a "
                f"multiple of {2 * context}")
    return None


def batch_ways(sizes) -> int:
    """How many ways a batch's rows are split on a mesh of axis `sizes`: data x fsdp x expert."""
    return sizes["data"] * sizes["fsdp"] * sizes["expert"]


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; -1 takes the devices the others leave (at most one axis may say -1).

    The default puts every device on `fsdp`: ZeRO-3 over all devices, which is plain training on one device.
    context splits each row's tokens (context parallelism; `models/context_attention.py`) and, with fsdp, the
    parameters, gradients and optimizer state (ZeRO-3 over fsdp x context).
    slices: how many TPU slices (multi-slice over the data-centre network, DCN) the data axis spans; the other axes
    stay within a slice (over its chip links), so `data` is a multiple of `slices` (`parallel/mesh.py`).
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    slices: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size == 0 or size < -1:
                raise ConfigError(name, size, "a mesh axis size is a positive integer, or -1 for the rest")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError("fsdp" if self.fsdp == -1 else "data", -1,
                              f"at most one mesh axis may be -1 ({self._describe()})")
        if isinstance(self.slices, bool) or not isinstance(self.slices, int) or self.slices < 1:
            raise ConfigError("slices", self.slices, "the number of slices is a positive integer")
        if self.data != -1 and self.data % self.slices:
            raise ConfigError("data", self.data, f"the data axis spans the {self.slices} slices, so it is a multiple "
                              f"of slices = {self.slices} (or -1)")

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}

    def _describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in {**self.sizes(), "slices": self.slices}.items()
                          if name not in ("expert", "context", "slices") or size != 1)

    def resolve(self, num_devices: int) -> dict[str, int]:
        """The axis sizes for `num_devices` devices, -1 filled in; a JaxtuneError naming both when they don't fit."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes.values() if s != -1)
        if -1 in sizes.values():
            if num_devices % known:
                raise JaxtuneError(f"[mesh] {self._describe()}: {known} devices on the fixed axes do not divide the "
                                   f"{num_devices} devices available")
            sizes = {name: num_devices // known if s == -1 else s for name, s in sizes.items()}
        elif known != num_devices:
            raise JaxtuneError(f"[mesh] {self._describe()} needs {known} devices, but {num_devices} are available "
                               "(set one axis to -1 to take the rest)")
        if sizes["data"] % self.slices:
            raise JaxtuneError(f"[mesh] {self._describe()}: the data axis takes {sizes['data']} of {num_devices} "
                               f"devices, not a multiple of the {self.slices} slices it spans")
        return sizes


@dataclass(frozen=True)
class OffloadConfig:
    """optimizer_state: keep the optimizer state in host memory. frozen_params: keep the frozen (non-trainable)
    weights in host memory. moments_dtype: "float32" or "bfloat16" storage for the optimizer's moments."""

    optimizer_state: bool = False
    frozen_params: bool = False
    moments_dtype: str = "float32"

    def __post_init__(self):
        check_choice("moments_dtype", self.moments_dtype, MOMENT_DTYPES)


@dataclass(frozen=True)
class EvalConfig:
    """Benchmark tasks scored at each evaluation ([train] eval_every, epoch ends, the end) through
    lm-evaluation-harness (`jaxtune.harness`; pip install "jaxtune[eval]"), their scores in metrics.jsonl as
    `eval_<task>/<metric>`. tasks: as `jaxtune eval --tasks` names them (lm-eval's registry, task YAML files, the
    bundled jaxtune_facts, jaxtune_qa, jaxtune_text). limit: examples a task (0: all; below 1: a fraction).
    num_fewshot: -1 keeps each task's own. batch_size: generation rows. apply_chat_template: as lm-eval's flag."""

    tasks: tuple = ()
    limit: float = 0.0
    num_fewshot: int = -1
    batch_size: int = 16
    apply_chat_template: bool = False

    def __post_init__(self):
        if isinstance(self.tasks, str) or not all(isinstance(t, str) and t for t in self.tasks):
            raise ConfigError("tasks", self.tasks, "must be a list of task names or task YAML files")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        check_range("limit", self.limit, 0.0)
        check_range("num_fewshot", self.num_fewshot, -1)
        check_range("batch_size", self.batch_size, 1)
