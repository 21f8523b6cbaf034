"""The spine: from what fixes a run to every array it holds and the one step over them.

    run = abstract_run(cfg, plan, mesh)                     # run.state, .frozen, .second, .batch: sharded, abstract
    state, frozen, second = load_run(run, model_dir, ...)   # load.py: weights read into those shardings
    state, metrics = run.step(state, frozen, second, batch) # one jit: the run's shardings, the state donated

The trainer calls the step, the planner's estimate counts the same trees, `plan --confirm` lowers the same step: a
plan (`train_plan(config)`) is the run it describes. Shardings: `shardings.py` (batch rows over data, fsdp, expert);
traced under the mesh (`traced_on`); offloaded trees in host memory; frozen 16-bit kernels as `quant.BitPattern`s;
a vision-language run's image side replicated, its trained parts (`methods/vision.py`) in the state's "vision"."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import TypeAlias

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxtune.config import MethodConfig, ModelConfig, TrainConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import ConfigError
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import apply_method, combine, parameter_report, partition, trainable_mask
from jaxtune.methods.vision import add_vision_leaves, vision_mask
from jaxtune.models.adapters import adapter_forward
from jaxtune.models.hf_config import load_config
from jaxtune.models.params import ParamSpec, abstract_params, init_params
from jaxtune.models.quant import as_bit_patterns
from jaxtune.models.vision.families import image_side
from jaxtune.objectives import objective_named, section_of
from jaxtune.objectives.base import Context, Objective
from jaxtune.parallel.distributed import global_array
from jaxtune.parallel.offload import HOST, check_host_memory, on_device, with_memory_kind
from jaxtune.spine.optimizers import make_optimizer
from jaxtune.spine.shardings import batch_sharding, optimizer_shardings, param_shardings
from jaxtune.spine.state import init_state, learning_rate_schedule
from jaxtune.spine.update import make_step

AnyMesh: TypeAlias = Mesh | AbstractMesh


@dataclass(frozen=True)
class RunShardings:
    """Where each argument of the step lives: state, frozen weights, the second model (or None), a batch."""

    state: dict
    frozen: dict
    second: dict | None
    batch: dict

    @property
    def params(self) -> dict:
        """Shardings of `combine(state["params"], frozen)`, the full parameter tree."""
        return combine(self.state["params"], self.frozen)


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@dataclass(frozen=True)
class AbstractRun:
    """A run's arrays as ShapeDtypeStructs carrying their shardings, and its step.

    params: the whole tree the method and the objective make of the base (trainable and frozen, unsharded);
    state: the train state (`spine/state.py`); frozen: the frozen weights; second: the objective's second model or
    None; batch: one step's [A, rows, ...] micro-batches.
    """

    cfg: ModelConfig
    plan: TrainPlan
    objective: Objective
    context: Context
    mesh: AnyMesh
    params: dict
    state: dict
    frozen: dict
    second: dict | None
    batch: dict
    shardings: RunShardings
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule

    @property
    def parameters(self) -> int:
        """Parameters as PEFT counts them (the planner's and `info`'s number)."""
        return parameter_report(self.params, self.plan.method, self.cfg, self.objective.head_leaves).total

    @cached_property
    def step(self):
        """`step(state, frozen, second, batch) -> (state, metrics)`: one jit, the run's shardings, state donated."""
        sh = self.shardings
        dropout = adapter_forward(self.plan.method, self.cfg).dropout_rate > 0
        inner = make_step(self.objective.loss_terms(self.context), dropout, self.optimizer, self.schedule,
                          self.objective.batch_metrics)

        def step(state, frozen, second, batch):
            state, frozen, second = on_device((state, frozen, second), (sh.state, sh.frozen, sh.second))
            with traced_on(self.mesh):
                return inner(state, frozen, second, batch)

        return jax.jit(step, in_shardings=(sh.state, sh.frozen, sh.second, sh.batch), out_shardings=(sh.state, None),
                       donate_argnums=0)

    @cached_property
    def eval_step(self):
        """`eval_step(params, second, batch) -> sums` on the combined params as the run holds them (None when the
        objective evaluates otherwise, e.g. by generating)."""
        terms = self.objective.eval_terms(self.context)
        if terms is None:
            return None
        params_sh, second_sh = self.shardings.params, self.shardings.second

        def evaluate(params, second, batch):
            params, second = on_device((params, second), (params_sh, second_sh))
            with traced_on(self.mesh):
                return terms(params, second, batch)

        return jax.jit(evaluate, in_shardings=(params_sh, second_sh, None))

    def init_state(self, trainable: dict, seed: int, donate: bool = False) -> dict:
        """`init_state` of concrete trainable leaves, created in the state's shardings. donate: reuse the leaves'
        buffers for the state's params (the caller's `trainable` is consumed): no second copy of a full model."""
        return jax.jit(lambda t: init_state(t, self.optimizer, seed), out_shardings=self.shardings.state,
                       donate_argnums=(0,) if donate else ())(trainable)

    def place_batch(self, batch: dict) -> dict:
        """Host arrays [A, rows, ...] onto the mesh in the batch's shardings (every process builds the same host batch
        and transfers only the rows of its own devices)."""
        return {k: global_array(v, self.shardings.batch[k]) for k, v in batch.items()}


def init_run(cfg: ModelConfig, method: MethodConfig, seed: int = 0, objective: Objective | None = None
             ) -> tuple[dict, dict]:
    """(trainable, frozen) of a randomly initialised `cfg` under `method`, on the default device: the base drawn
    from key(seed), the method's leaves from key(seed + 1), the `objective`'s head (if it has one) from
    key(seed + 2). What a test or a notebook trains without a checkpoint."""
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed)), cfg, method,
                          jax.random.key(seed + 1))
    heads: tuple[str, ...] = ()
    if objective is not None and objective.head is not None:
        params, heads = objective.head(params, cfg, jax.random.key(seed + 2)), objective.head_leaves
    return partition(params, trainable_mask(params, method, heads))


def traced_on(mesh: AnyMesh):
    """The context a step is traced in: `mesh` as the abstract mesh, so `rules.constrain` can split activations
    (each layer input's rows over ("data", "fsdp")) by the same table as the parameters."""
    return jax.sharding.use_abstract_mesh(mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh)


def model_tree(cfg: ModelConfig, plan: TrainPlan, objective: Objective) -> dict:
    """The abstract parameter tree of the run: the base in `plan.param_dtype`, the method applied, the objective's
    head added."""

    def build(base, key):
        params = apply_method(base, cfg, plan.method, key)
        return objective.head(params, cfg, key) if objective.head else params

    return jax.eval_shape(build, abstract_params(cfg, jnp.dtype(plan.param_dtype)), jax.random.key(0))


def abstract_run(cfg: ModelConfig, plan: TrainPlan, mesh: AnyMesh, train: TrainConfig = TrainConfig(),
                 total_steps: int = 1000) -> AbstractRun:
    """Every array of `plan`'s run of `cfg` on `mesh`, abstract and sharded, and its step (see the module docstring).

    train, total_steps: the optimizer's hyper-parameters and schedule length (they change values, not shapes; the
    optimizer itself is `plan.optimizer`, which does).
    The objective's second model has `plan.second_model`'s architecture (default: `cfg`'s).
    """
    objective, section = objective_named(plan.objective), section_of(plan)
    method = plan.method
    params = model_tree(cfg, plan, objective)
    trainable, frozen = partition(params, trainable_mask(params, method, objective.head_leaves))
    trainable = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), trainable)
    if plan.images is not None:  # the image side's trained leaves (None where frozen; the whole side by default)
        vision_trainable, vision_frozen = _image_side(plan, mesh)
        trainable["vision"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), vision_trainable)
    optimizer = make_optimizer(plan.optimizer, train, total_steps, trainable, plan.offload.moments_dtype,
                               method_unit(method).learning_rates(method, trainable))
    state = jax.eval_shape(lambda t: init_state(t, optimizer, 0), trainable)

    if trainable.get("vision") is not None and not objective.trains_images:
        raise ConfigError("vision_modules", list(getattr(method, "vision_modules", ())), "the image side trains "
                          f"with SFT (not yet {objective.name}: its reference reads the frozen tower)")
    second_name = objective.second_model(section, method)
    second_cfg = None if second_name is None else cfg if second_name == "base" else plan.second_model or cfg
    second = abstract_params(second_cfg, jnp.dtype(plan.param_dtype)) if second_cfg is not None else None

    rows = plan.batch_size * objective.rows(section)
    micro = objective.micro_batch(rows, plan.seq_len, section, plan.images)
    batch = {k: jax.ShapeDtypeStruct((plan.grad_accum, *x.shape), x.dtype) for k, x in micro.items()}

    shardings = _shardings(mesh, cfg, second_cfg, state, frozen, second, optimizer, batch, objective, plan)
    # the frozen 16-bit kernels travel as bit patterns (models/quant.BitPattern), in the same shardings; so do the
    # embedding table and head where the compute dtype is wider
    head = jnp.dtype(plan.forward.compute_dtype).itemsize > 2
    frozen = as_bit_patterns(_with_shardings(frozen, shardings.frozen), head)
    second = None if second is None else as_bit_patterns(_with_shardings(second, shardings.second), head)
    if plan.images is not None:  # the image side: replicated (small), beside the text model
        frozen = {**frozen, "vision": vision_frozen}
    shardings = replace(shardings, frozen=_shardings_of(frozen), second=_shardings_of(second))
    context = Context(cfg, method, plan.forward, section, second_cfg, plan.images)
    return AbstractRun(cfg, plan, objective, context, mesh, params, _with_shardings(state, shardings.state), frozen,
                       second, _with_shardings(batch, shardings.batch), shardings, optimizer,
                       learning_rate_schedule(train, total_steps))


def _image_side(plan: TrainPlan, mesh: AnyMesh) -> tuple[dict | None, dict]:
    """(trained, frozen) halves of the image side, replicated (the tower is small); trained None when all is frozen."""
    images = plan.images
    base = jax.tree.map(lambda spec: jax.ShapeDtypeStruct(spec.shape, jnp.dtype(plan.param_dtype)),
                        images.family.param_specs(images.config), is_leaf=lambda x: isinstance(x, ParamSpec))
    vision = jax.eval_shape(partial(add_vision_leaves, method=plan.method, family=images.family), base,
                            key=jax.random.key(0))
    replicated = NamedSharding(mesh, PartitionSpec())
    vision = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), vision)
    mask = vision_mask(vision, plan.method, images.family)
    trained, frozen = partition(vision, mask)
    return (trained if any(jax.tree.leaves(mask)) else None), frozen


def _shardings_of(tree):
    return None if tree is None else jax.tree.map(lambda x: x.sharding, tree)


def _shardings(mesh, cfg, second_cfg, state, frozen, second, optimizer, batch, objective, plan) -> RunShardings:
    trainable = state["params"]
    trainable_sh = param_shardings(trainable, cfg, mesh, objective.head_axes)
    frozen_sh = param_shardings(frozen, cfg, mesh)
    opt_sh = optimizer_shardings(optimizer, trainable, trainable_sh, mesh)
    if plan.offload.optimizer_state:
        check_host_memory(mesh, "optimizer_state")
        opt_sh = with_memory_kind(opt_sh, HOST)
    if plan.offload.frozen_params:
        check_host_memory(mesh, "frozen_params")
        frozen_sh = with_memory_kind(frozen_sh, HOST)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sh = jax.tree.map(lambda _: replicated, state)
    state_sh.update(params=trainable_sh, opt_state=opt_sh)
    second_sh = None if second is None else param_shardings(second, second_cfg, mesh)
    rows = batch_sharding(mesh, next(iter(batch.values())).shape[1])
    batch_sh = {k: NamedSharding(mesh, PartitionSpec(*rows.spec[:x.ndim])) for k, x in batch.items()}
    return RunShardings(state_sh, frozen_sh, second_sh, batch_sh)


def train_plan(config, cfg_dtype: str, platform: str | None = None) -> TrainPlan:
    """The `TrainPlan` of a run config: what the spine and the planner build from it. cfg_dtype: the checkpoint's
    stored dtype, for `[model] dtype = "auto"`; platform: of the devices it runs on ("tpu", "gpu", "gaudi", "cpu";
    default this process's backend), for `[model] compute_dtype = "auto"`."""
    c = config
    objective = objective_named(c.train.objective)
    section = c.section(objective.name)
    second = objective.second_model(section, c.method)
    images = image_side(c.model.path, c.data.max_images_per_row) if objective.reads_images else None
    return TrainPlan(c.method, c.train.batch_size, c.data.max_seq_len, c.train.grad_accum,
                     cfg_dtype if c.model.dtype == "auto" else c.model.dtype,
                     c.model.forward.resolved(platform or jax.default_backend()), mesh=c.mesh, offload=c.offload,
                     objective=objective.name, optimizer=c.train.optimizer,
                     generate_tokens=objective.rollout_tokens(section), section=section,
                     second_model=None if second in (None, "base") else load_config(second), images=images)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree whose leaves carry shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))
