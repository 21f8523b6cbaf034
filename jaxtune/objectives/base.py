"""An objective, declared once (`Objective`, its fields described there); adding one is a module here and its
entry in `__init__.py`'s registry. It declares its TOML section, the rows and arrays a micro-batch holds, its second
model (a reference, a teacher), whether it generates (rollouts), its loss and eval terms, the head it adds, its data
(`prepare`: `ObjectiveInputs` -> `ObjectiveData`), what a finished run exports, and the planner's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import jax
import numpy as np

from jaxtune.config import (
    DataConfig,
    ForwardOptions,
    MethodConfig,
    ModelConfig,
    ModelSection,
    OffloadConfig,
    TrainConfig,
)
from jaxtune.data.batching import BATCH_FIELDS
from jaxtune.methods.base import adapter_keys


class RunSections(Protocol):
    """The sections of a run config an objective reads (`jaxtune.run_config.RunConfig` has them), read-only."""

    @property
    def model(self) -> ModelSection: ...

    @property
    def method(self) -> MethodConfig: ...

    @property
    def data(self) -> DataConfig: ...

    @property
    def train(self) -> TrainConfig: ...

    @property
    def offload(self) -> OffloadConfig: ...


@dataclass(frozen=True)
class Context:
    """What an objective's terms are built from; static under jit. second_cfg: the second model's architecture;
    images: the run's image side (`models.vision.family.ImageSide`; its tower's weights are `params["vision"]`)."""

    cfg: ModelConfig
    method: MethodConfig | None
    options: ForwardOptions
    section: Any = None
    second_cfg: ModelConfig | None = None
    images: Any = None


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective's `prepare` reads: the run config (its [data] and [train] sections), the objective's own
    section, the model's architecture and tokenizer, where to log, and where tokenised data is cached (None: not).
    cache_writes: what loading found missing from the cache, written by the trainer only once every input has been
    checked (a run that fails to start leaves its directory as it was). load_reward_model(directory) -> (cfg,
    params): the spine's loader, handed down (a reward model scoring GRPO's rollouts). images: the model's
    `ImageProcessor` where the run trains on images (a vision-language model and an objective that reads them)."""

    config: RunSections
    section: Any
    cfg: ModelConfig
    tokenizer: Any
    log: Callable[[str], None]
    cache_dir: Path | None = None
    cache_writes: list = field(default_factory=list)
    load_reward_model: Callable[[str], tuple] | None = None
    images: Any = None


@dataclass
class ObjectiveData:
    """An objective's data as the trainer walks it.

    batch(epoch, index, params) -> host arrays [A, rows, ...] of step `index` of `epoch` (a function of the data
    seed, the epoch and the index; for GRPO also of the current params, which a resumed run restores exactly).
    evaluate(eval_step, params) -> {"eval_...": value} over the held-out data, None without any.
    start(read_reference, context, second) runs once the weights are loaded (DPO scores its pairs with the reference
    there); read_reference(reference) -> params: "base" (the frozen base with adapters off, or read again for a full
    fine-tune) or a model directory, read into the frozen weights' shardings; second: the objective's second model
    as the step gets it (None without one), which stays the same the whole run (distillation's teacher decodes from
    it: `[distill] seq_kd`).
    rows_per_epoch, tokens_per_epoch: the rows of data an epoch's batches hold and the token positions in them (None
    where the objective does not know them before it runs), for `train.setup_checks`' padding warnings.
    ahead(epoch, index, params) -> finish: for batches sampled one step ahead (GRPO's `off_policy_steps`), the
    trainer calls it with the parameters of the step before `index`, before dispatching that step (which donates
    them), then `finish() -> batch` once the step is dispatched; batch() then returns that batch at its step.
    """

    steps_per_epoch: int
    batch: Callable[[int, int, Callable[[], dict]], dict]
    evaluate: Callable | None = None
    start: Callable[[Callable[[str], dict], Context, dict | None], None] | None = None
    rows_per_epoch: int | None = None
    tokens_per_epoch: int | None = None
    ahead: Callable[[int, int, Callable[[], dict]], Callable[[], dict]] | None = None


Section = TypeVar("Section")
# (trainable, frozen, second model, micro-batch, dropout key) -> (loss sum, (count, {metric: sum}))
LossTerms = Callable[..., tuple[jax.Array, tuple[jax.Array, dict]]]
# (params, second model, held-out batch) -> {name: sum}
EvalTerms = Callable[[dict, Any, dict], dict]


@dataclass(frozen=True)
class Objective(Generic[Section]):
    """One training objective.

    name, section       the `train.objective` value; its TOML section's dataclass ([dpo], [grpo], [distill]) or None
    rows, batch_fields  rows a micro-batch holds per example (a preference pair: 2); its arrays beside SFT's five
                        (rows, seq_len, section) -> {name: ShapeDtypeStruct}
    second_model        None, "base" (a full fine-tune's frozen copy; adapter methods: the base, adapters off) or a dir
    model_fields        its section's fields that name a model (a directory or a Hub id, resolved as [model] path is)
    generates           its step samples from the policy (rollouts): rows decoded whole (no context axis); one that
                        samples only for some sections (distill's lmbda > 0) says so by its rollout_tokens alone
    loss_terms          (`Context`) -> per micro-batch sums (loss, (count, metrics)); eval_terms: per held-out batch
    head, head_axes     (params, cfg, key) -> params with the trainable leaves it adds (a reward model's score);
                        their logical axes by dict path
    prepare             the trainer's side (`ObjectiveInputs` -> `ObjectiveData`)
    export, result      writes a finished run's result instead of the method's (a reward model), and what it is
    for the planner     logits_copies(method, section), rollout_tokens, extra_forwards, unit
    reads_images        its batches carry a vision-language model's pixel arrays (`pixel_values`)
    trains_images       its loss may train the image side (`[method] vision_modules`; not where a reference reads it)
    """

    name: str
    loss_terms: Callable[[Context], LossTerms]
    eval_terms: Callable[[Context], EvalTerms]
    prepare: Callable[[ObjectiveInputs], ObjectiveData]
    section: type[Section] | None = None
    rows: Callable[[Section], int] = lambda section: 1
    batch_fields: Callable[[int, int, Section], dict] = lambda rows, seq_len, section: {}
    second_model: Callable[[Section, MethodConfig], str | None] = lambda section, method: None
    model_fields: tuple[str, ...] = ()
    generates: bool = False
    logits_copies: Callable[[MethodConfig, Section], int] = lambda method, section: 2
    head: Callable[[dict, ModelConfig, jax.Array], dict] | None = None
    head_axes: Mapping[tuple, tuple] = field(default_factory=dict)
    batch_metrics: Callable[[dict], dict] | None = None
    export: Callable[[Path, RunSections, ModelConfig, dict], Path] | None = None
    result: str = ""
    unit: str = "rows"
    rollout_tokens: Callable[[Section], int] = lambda section: 0
    extra_forwards: Callable[[Section], int] = lambda section: 0
    reads_images: bool = False
    trains_images: bool = False

    def micro_batch(self, rows: int, seq_len: int, section, images=None) -> dict:
        """The arrays of one micro-batch, as ShapeDtypeStructs: [rows, seq_len] SFT fields + the objective's (+ a
        vision-language run's `pixel_values` [rows, max_images, *pixel_shape], `images` its `ImageSide`)."""
        arrays = {k: jax.ShapeDtypeStruct((rows, seq_len), np.dtype(d)) for k, d in BATCH_FIELDS.items()}
        if images is not None:
            arrays["pixel_values"] = jax.ShapeDtypeStruct((rows, images.max_images, *images.pixel_shape), np.float32)
        return {**arrays, **self.batch_fields(rows, seq_len, section)}

    @property
    def head_leaves(self) -> tuple[str, ...]:
        """The top-level names of the leaves its head adds (trained with any method)."""
        return tuple(dict.fromkeys(path[0] for path in self.head_axes))


def strip_adapters(params: dict) -> dict:
    """The base model inside a method's tree: adapter leaves (and the None holes of `partition`) removed. It holds
    the same arrays, so a reference "with adapters off" costs no memory."""
    if not isinstance(params, dict):
        return params
    return {k: strip_adapters(v) for k, v in params.items() if k not in adapter_keys() and v is not None}


def reference_of(frozen: dict, second: dict | None) -> dict:
    """The reference a step scores with: the second model if it has one, else the frozen base (adapters off)."""
    return strip_adapters(frozen) if second is None else second


def stack_micro_batches(batches: Sequence[dict], grad_accum: int, index: int) -> dict:
    """Micro-batches index*A .. index*A+A-1 stacked to [A, rows, ...]; missing ones are empty (no loss tokens)."""
    chunk = list(batches[index * grad_accum:(index + 1) * grad_accum])
    chunk += [{k: np.zeros_like(v) for k, v in batches[0].items()}] * (grad_accum - len(chunk))
    return {k: np.stack([b[k] for b in chunk]) for k in chunk[0]}


def epoch_cache(make_batches: Callable[[int], Sequence[dict]], grad_accum: int):
    """`batch(epoch, index, params)` over one epoch's batches, built once per epoch."""
    cache: dict[int, Sequence[dict]] = {}

    def batch(epoch: int, index: int, _params) -> dict:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = make_batches(epoch)
        return stack_micro_batches(cache[epoch], grad_accum, index)

    return batch


def total(sums: list[dict]) -> dict:
    """Per-batch sums (device scalars) added up on the host, as floats."""
    return {k: sum(float(s[k]) for s in sums) for k in sums[0]} if sums else {}

