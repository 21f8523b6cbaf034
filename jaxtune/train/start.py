"""What a run trains, put together: the objective's data (`Objective.prepare`), the spine's abstract run and step,
and the weights loaded into its shardings. Nothing here names an objective: they are registered units
(`jaxtune.objectives`).

    task = start_run_on(config, mesh, tokenizer, stored_dtype, cfg, log)     # `loop.start_run` reads those
    state, metrics = task.run.step(state, task.frozen, task.second, task.run.place_batch(task.batch(e, i, state)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.models.hf_weights import checked_reader
from jaxtune.models.params import abstract_params
from jaxtune.models.vision.families import image_processor
from jaxtune.objectives import objective_named, section_of
from jaxtune.objectives.base import ObjectiveData, ObjectiveInputs, strip_adapters
from jaxtune.spine.load import load_run, read_tree
from jaxtune.spine.model import load_reward_model
from jaxtune.spine.run import AbstractRun, abstract_run, traced_on, train_plan
from jaxtune.spine.shardings import param_shardings
from jaxtune.train.export import export_result
from jaxtune.train.outputs import run_directories


@dataclass(frozen=True)
class StartedRun:
    """A run ready to step: the spine's `run`, the objective's `training` data, the loaded arrays."""

    run: AbstractRun
    training: ObjectiveData
    total_steps: int
    state: dict
    frozen: dict
    second: dict | None
    export_fn: Callable[[Path, dict], Path]
    cache_writes: list  # tokenised data to cache, once the run starts (`objectives.base.ObjectiveInputs`)

    @property
    def steps_per_epoch(self) -> int:
        return self.training.steps_per_epoch

    def batch(self, epoch: int, index: int, state: dict) -> dict:
        """Host arrays [A, rows, ...] of step `index` of `epoch` (GRPO samples them from the current policy, each
        device decoding its own rows: called under the run's mesh)."""
        with traced_on(self.run.mesh):
            return self.training.batch(epoch, index, lambda: combine(state["params"], self.frozen))

    def ahead(self, epoch: int, index: int, state: dict) -> Callable[[], dict] | None:
        """For an objective that samples a step ahead (`ObjectiveData.ahead`): step `index` of `epoch`'s batch
        sampled now with `state`'s params (before the step that donates them is dispatched), and the function that
        finishes it (scores it) once that step runs; None for the others."""
        if self.training.ahead is None:
            return None
        with traced_on(self.run.mesh):
            finish = self.training.ahead(epoch, index, lambda: combine(state["params"], self.frozen))

        def finished() -> dict:
            with traced_on(self.run.mesh):
                return finish()

        return finished

    def evaluate(self, state: dict) -> dict | None:
        if self.training.evaluate is None:
            return None
        eval_step = self.run.eval_step
        bound = None if eval_step is None else (lambda params, batch: eval_step(params, self.second, batch))
        with traced_on(self.run.mesh):
            return self.training.evaluate(bound, combine(state["params"], self.frozen))

    def export(self, run_dir: Path, params: dict) -> Path:
        return self.export_fn(run_dir, params)


def start_run_on(config, mesh: Mesh, tokenizer, stored_dtype: str, cfg: ModelConfig, log) -> StartedRun:
    """The run of `config` on `mesh`: the objective's data, then the abstract run, then the weights read into it."""
    c = config
    plan = train_plan(c, stored_dtype)
    objective = objective_named(plan.objective)
    section = section_of(plan)
    cache_dir = run_directories(c.train.output_dir)[0] / "cache"  # tokenised data, beside the run
    images = None if plan.images is None else image_processor(c.model.path, tokenizer)
    setup = ObjectiveInputs(c, section, cfg, tokenizer, log, cache_dir, load_reward_model=load_reward_model,
                            images=images)
    training = objective.prepare(setup)
    total_steps = c.train.max_steps or c.train.epochs * training.steps_per_epoch
    if total_steps < 1:
        raise JaxtuneError(f"{c.data.train}: no training step (too few examples for train.batch_size = "
                           f"{c.train.batch_size})")
    run = abstract_run(cfg, plan, mesh, c.train, total_steps)
    state, frozen, second = load_run(run, c.model.path, c.train.seed, objective.second_model(section, c.method))
    if training.start is not None:
        training.start(lambda reference: _with_image_side(_read_reference(run, c, reference, frozen), frozen),
                       run.context, second)
    if objective.export is not None:
        export_fn = lambda run_dir, params: objective.export(run_dir, c, cfg, params)
    else:
        export_fn = lambda run_dir, params: export_result(run_dir, c, cfg, params, c.method)
    return StartedRun(run, training, total_steps, state, frozen, second, export_fn, setup.cache_writes)


def _with_image_side(reference: dict, frozen: dict) -> dict:
    """A reference that reads the run's images through its frozen image side (a vision-language run's)."""
    return {**reference, "vision": frozen["vision"]} if "vision" in frozen and "vision" not in reference else reference


def _read_reference(run: AbstractRun, config, reference: str, frozen: dict) -> dict:
    """A reference model an objective scores with before training (`ObjectiveData.start`): "base", the frozen base
    (adapters off), or a model read whole into the policy's frozen shardings ("base" of a full fine-tune, or a
    directory)."""
    if reference == "base" and not method_unit(config.method).trains_base:
        return strip_adapters(frozen)
    base = abstract_params(run.cfg, jax.numpy.dtype(run.plan.param_dtype))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), base,
                            param_shardings(base, run.cfg, run.mesh))
    with checked_reader(config.model.path if reference == "base" else reference, run.cfg) as reader:
        return read_tree(reader, abstract, run.cfg)
