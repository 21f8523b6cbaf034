"""An objective, declared once (`Objective`); adding one is a module here and its line in `__init__.py`. Its fields:

    name, section       the `train.objective` value; its TOML section's dataclass ([dpo], [grpo], [distill]) or None
    rows, batch_fields  rows a micro-batch holds per example (a preference pair: 2); its arrays beside SFT's five
    second_model        None, "base" (a full fine-tune's frozen copy; adapter methods: the base, adapters off) or a dir
    loss_terms          (`Context`) -> per micro-batch sums (loss, (count, metrics)); eval_terms: per held-out batch
    head, head_axes     the trainable leaves it adds (a reward model's score) and their logical axes
    prepare, export     the trainer's side (`ObjectiveInputs` -> `ObjectiveData`); what a finished run writes
    for the planner     logits_copies(method, section), rollout_tokens, extra_forwards, unit, single_process
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.data.batching import BATCH_FIELDS
from jaxtune.methods.base import adapter_keys

if TYPE_CHECKING:  # run_config assembles the objectives' sections, so it imports this package
    from jaxtune.run_config import RunConfig


@dataclass(frozen=True)
class Context:
    """What an objective's terms are built from; static under jit. second_cfg: the second model's architecture."""

    cfg: ModelConfig
    method: MethodConfig | None
    options: ForwardOptions
    section: object = None
    second_cfg: ModelConfig | None = None


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective's `prepare` reads: the run config (its [data] and [train] sections), the objective's own
    section, the model's architecture and tokenizer, where to log, and where tokenised data is cached (None: not).
    cache_writes: what loading found missing from the cache, written by the trainer only once every input has been
    checked (a run that fails to start leaves its directory as it was). load_reward_model(directory) -> (cfg,
    params): the spine's loader, handed down (a reward model scoring GRPO's rollouts)."""

    config: RunConfig
    section: object
    cfg: ModelConfig
    tokenizer: object
    log: Callable[[str], None]
    cache_dir: Path | None = None
    cache_writes: list = field(default_factory=list)
    load_reward_model: Callable[[str], tuple] | None = None


@dataclass
class ObjectiveData:
    """An objective's data as the trainer walks it.

    batch(epoch, index, params) -> host arrays [A, rows, ...] of step `index` of `epoch` (a function of the data
    seed, the epoch and the index; for GRPO also of the current params, which a resumed run restores exactly).
    evaluate(eval_step, params) -> {"eval_...": value} over the held-out data, None without any.
    start(trainer) runs once the weights are loaded (DPO scores its pairs with the reference there).
    rows_per_epoch, tokens_per_epoch: the rows of data an epoch's batches hold and the token positions in them (None
    where the objective does not know them before it runs), for `train.setup_checks`' padding warnings.
    """

    steps_per_epoch: int
    batch: Callable[[int, int, Callable[[], dict]], dict]
    evaluate: Callable | None = None
    start: Callable | None = None
    rows_per_epoch: int | None = None
    tokens_per_epoch: int | None = None


@dataclass(frozen=True)
class Objective:
    """One training objective (see the module docstring for each field)."""

    name: str
    loss_terms: Callable[[Context], Callable]
    eval_terms: Callable[[Context], Callable]
    prepare: Callable
    section: type | None = None
    rows: Callable[[object], int] = lambda section: 1
    batch_fields: Callable[[int, object], dict] = lambda rows, section: {}
    second_model: Callable[[object, MethodConfig], str | None] = lambda section, method: None
    logits_copies: Callable[[MethodConfig, object], int] = lambda method, section: 2
    head: Callable[[ModelConfig, jax.Array], dict] | None = None
    head_axes: dict = field(default_factory=dict)
    batch_metrics: Callable[[dict], dict] | None = None
    export: Callable | None = None
    unit: str = "rows"
    single_process: bool = False
    rollout_tokens: Callable[[object], int] = lambda section: 0
    extra_forwards: Callable[[object], int] = lambda section: 0

    def micro_batch(self, rows: int, seq_len: int, section) -> dict:
        """The arrays of one micro-batch, as ShapeDtypeStructs: [rows, seq_len] SFT fields + the objective's."""
        arrays = {k: jax.ShapeDtypeStruct((rows, seq_len), np.dtype(d)) for k, d in BATCH_FIELDS.items()}
        return {**arrays, **self.batch_fields(rows, section)}


def strip_adapters(params: dict) -> dict:
    """The base model inside a method's tree: adapter leaves (and the None holes of `partition`) removed. It holds
    the same arrays, so a reference "with adapters off" costs no memory."""
    if not isinstance(params, dict):
        return params
    return {k: strip_adapters(v) for k, v in params.items() if k not in adapter_keys() and v is not None}


def reference_of(frozen: dict, second: dict | None) -> dict:
    """The reference a step scores with: the second model if it has one, else the frozen base (adapters off)."""
    return strip_adapters(frozen) if second is None else second


def stack_micro_batches(batches: list[dict], grad_accum: int, index: int) -> dict:
    """Micro-batches index*A .. index*A+A-1 stacked to [A, rows, ...]; missing ones are empty (no loss tokens)."""
    chunk = batches[index * grad_accum:(index + 1) * grad_accum]
    chunk += [{k: np.zeros_like(v) for k, v in batches[0].items()}] * (grad_accum - len(chunk))
    return {k: np.stack([b[k] for b in chunk]) for k in chunk[0]}


def epoch_cache(make_batches: Callable[[int], list[dict]], grad_accum: int):
    """`batch(epoch, index, params)` over one epoch's batches, built once per epoch."""
    cache = {}

    def batch(epoch: int, index: int, _params) -> dict:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = make_batches(epoch)
        return stack_micro_batches(cache[epoch], grad_accum, index)

    return batch


def total(sums: list[dict]) -> dict:
    """Per-batch sums (device scalars) added up on the host, as floats."""
    return {k: sum(float(s[k]) for s in sums) for k in sums[0]} if sums else {}

