"""Ahead-of-time confirmation: compile the real train step for a plan and read XLA's memory analysis.

Nothing is allocated: the state, frozen weights and batch are `jax.ShapeDtypeStruct`s (from `jax.eval_shape` on
the same functions the training loop calls), and `jit(...).lower(...).compile()` plans buffers without running.
XLA's figure for one device is arguments + temporaries + outputs - aliased (donated state comes back in place).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, Remat, TrainConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.data.batching import DTYPES as BATCH_DTYPES
from jaxtune.errors import JaxtuneError
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models.params import abstract_params


@dataclass(frozen=True)
class CompiledMemory:
    """XLA's per-device memory analysis of the compiled step, in bytes."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int
    backend: str
    compile_seconds: float

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def abstract_step_inputs(cfg: ModelConfig, plan: TrainPlan):
    """(state, frozen, batch, optimizer) as ShapeDtypeStructs, built as the trainer builds the real ones (a reward
    model's head included; pair objectives' batches hold 2 rows a pair, GRPO's `advantages` and `rewards` [A, N] too)."""
    from jaxtune.train.reward import add_reward_head
    from jaxtune.train.step import init_state, make_optimizer

    base = abstract_params(cfg, jnp.dtype(plan.param_dtype))

    def build(p, k):
        params = apply_method(p, cfg, plan.method, k)
        return add_reward_head(params, cfg, k) if plan.objective == "reward" else params

    params = jax.eval_shape(build, base, jax.random.key(0))
    trainable, frozen = partition(params, trainable_mask(params, plan.method))
    optimizer = make_optimizer(TrainConfig(), 1000, trainable)
    if plan.offload.moments_dtype != "float32":
        from jaxtune.parallel.offload import low_precision_moments

        optimizer = low_precision_moments(optimizer, plan.offload.moments_dtype)
    state = jax.eval_shape(lambda t: init_state(t, optimizer, 0), trainable)
    shape = (plan.grad_accum, plan.rows, plan.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, d) for k, d in BATCH_DTYPES.items()}
    if plan.objective == "grpo":
        batch.update(advantages=jax.ShapeDtypeStruct(shape[:2], jnp.float32),
                     rewards=jax.ShapeDtypeStruct(shape[:2], jnp.float32))
    return state, frozen, batch, optimizer


def objective_step(cfg: ModelConfig, plan: TrainPlan, options: ForwardOptions, optimizer):
    """(step(state, (frozen, extra), batch), extra): the trainer's jitted step for `plan.objective` with its second
    model as the trainer passes it. `extra` is that model's abstract tree when it is one of its own (the reference of
    a full fine-tune, the teacher), else None: an adapter method's reference is `strip_adapters(frozen)`, the same
    arrays, and a separate argument would count them twice."""
    from jaxtune.train.distill import DistillConfig, make_distill_step
    from jaxtune.train.grpo import GRPOConfig, make_grpo_step
    from jaxtune.train.preference import PreferenceConfig, make_preference_step, strip_adapters
    from jaxtune.train.reward import make_reward_step
    from jaxtune.train.step import learning_rate_schedule, make_train_step

    schedule = learning_rate_schedule(TrainConfig(), 1000)
    if plan.objective in ("sft", "reward"):
        make = make_train_step if plan.objective == "sft" else make_reward_step
        inner = make(cfg, plan.method, options, optimizer, schedule)
        return (lambda state, frozen_extra, batch: inner(state, frozen_extra[0], batch)), None
    if plan.objective == "dpo":
        inner = make_preference_step(cfg, plan.method, options, optimizer, schedule, PreferenceConfig())
    elif plan.objective == "grpo":
        inner = make_grpo_step(cfg, plan.method, options, optimizer, schedule, GRPOConfig())
    else:
        inner = make_distill_step(cfg, cfg, plan.method, options, optimizer, schedule, DistillConfig())
    own = plan.objective == "distill" or plan.method.kind == "full"
    extra = abstract_params(cfg, jnp.dtype(plan.param_dtype)) if own else None

    def step(state, frozen_extra, batch):
        frozen, other = frozen_extra
        return inner(state, frozen, strip_adapters(frozen) if other is None else other, batch)

    return step, extra


def _mesh(plan: TrainPlan, devices):
    from jaxtune.parallel.mesh import make_mesh

    available = list(jax.devices() if devices is None else devices)
    sizes = plan.mesh.resolve(len(available)) if -1 in plan.mesh.sizes().values() else plan.mesh.sizes()
    needed = math.prod(sizes.values())
    if needed > len(available):
        hint = (f"; on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
                if jax.default_backend() == "cpu" else "")
        raise JaxtuneError(f"the plan's mesh needs {needed} devices, this {jax.default_backend()} backend has "
                           f"{len(available)}{hint}")
    return make_mesh(MeshConfig(**sizes), available[:needed])


def compile_step(cfg: ModelConfig, plan: TrainPlan, devices=None) -> CompiledMemory:
    """Compile jaxtune's train step for `plan` on the default backend and return XLA's per-device memory analysis.

    The step is the trainer's for `plan.objective` (`make_train_step`, `make_preference_step`, `make_reward_step`,
    `make_grpo_step`, `make_distill_step`) placed on the plan's mesh by jaxtune.parallel (its shardings, offload
    memory kinds and donation; a reference or teacher split as the policy's weights are). devices: the devices of
    the mesh (default: the first `mesh size` of `jax.devices()`; on CPU, fake ones come from
    XLA_FLAGS=--xla_force_host_platform_device_count=N). GRPO's rollout is a program of its own: `compile_rollout`.
    """
    from jaxtune.parallel.placement import shard_train_step, train_shardings
    from jaxtune.parallel.sharding import batch_sharding, param_shardings

    mesh = _mesh(plan, devices)
    state, frozen, batch, optimizer = abstract_step_inputs(cfg, plan)
    options = ForwardOptions(compute_dtype=plan.compute_dtype, remat=Remat(plan.remat))
    step, extra = objective_step(cfg, plan, options, optimizer)
    shardings = train_shardings(mesh, cfg, state["params"], frozen, optimizer, plan.rows, plan.offload)
    rows = batch_sharding(mesh, plan.rows)
    batch_sh = {k: rows if v.ndim == 3 else NamedSharding(mesh, PartitionSpec(*rows.spec[:2])) for k, v in batch.items()}
    shardings = dataclasses.replace(shardings, frozen=(shardings.frozen, param_shardings(extra, cfg, mesh)),
                                    batch=batch_sh)
    start = time.perf_counter()
    compiled = shard_train_step(step, shardings).lower(state, (frozen, extra), batch).compile()
    return _memory(compiled, time.perf_counter() - start)


def compile_rollout(cfg: ModelConfig, plan: TrainPlan) -> CompiledMemory:
    """XLA's memory of GRPO's rollout on one device: jaxtune's generation program (prefill, then a `while_loop`
    of cached decode steps) sampling `plan.generate_tokens` tokens after prompts of `seq_len - generate_tokens` for
    all `rows x grad_accum` rows of an optimizer step at once (as the trainer does), from the policy's weights as the step holds them (float32 trainable masters + the frozen
    base). The optimizer state, alive beside it but not an argument, is not in this figure."""
    from jaxtune.generation import _generate
    from jaxtune.methods.transform import combine

    if plan.objective != "grpo" or plan.generate_tokens < 1:
        raise JaxtuneError("a rollout needs objective 'grpo' and generate_tokens of at least 1")
    state, frozen, _, _ = abstract_step_inputs(cfg, plan)
    rows, prompt = plan.rows * plan.grad_accum, plan.seq_len - plan.generate_tokens
    prefix = plan.method.num_virtual_tokens if plan.method.kind == "prefix" else 0
    spec = jax.ShapeDtypeStruct
    options = ForwardOptions(compute_dtype=plan.compute_dtype)
    start = time.perf_counter()
    compiled = _generate.lower(
        combine(state["params"], frozen), spec((rows, prompt), jnp.int32), spec((rows, prompt), jnp.int32),
        spec((rows,), jnp.bool_), spec((cfg.vocab_size,), jnp.bool_), spec((), jnp.float32), spec((), jnp.int32),
        spec((), jnp.float32), jax.eval_shape(jax.random.key, 0), cfg=cfg, method=plan.method, options=options,
        cache_size=prefix + plan.seq_len, max_new_tokens=plan.generate_tokens, greedy=False).compile()
    return _memory(compiled, time.perf_counter() - start)


def compile_peak(cfg: ModelConfig, plan: TrainPlan) -> tuple[int, str]:
    """(XLA's per-device bytes at the training iteration's peak, "step" or "rollout"): the step's total, or for
    GRPO with a rollout the larger of it and the rollout's total + the optimizer state (alive beside the generation
    program but not one of its arguments)."""
    step = compile_step(cfg, plan).total_bytes
    if plan.objective != "grpo" or not plan.generate_tokens:
        return step, "step"
    state = abstract_step_inputs(cfg, plan)[0]
    optimizer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["opt_state"]))
    rollout = compile_rollout(cfg, plan).total_bytes + optimizer
    return (step, "step") if step >= rollout else (rollout, "rollout")


def _memory(compiled, seconds: float) -> CompiledMemory:
    m = compiled.memory_analysis()
    if m is None:
        raise JaxtuneError(f"the {jax.default_backend()} backend gives no memory analysis for compiled programs")
    host = m.host_argument_size_in_bytes + m.host_temp_size_in_bytes + m.host_output_size_in_bytes \
        - m.host_alias_size_in_bytes
    return CompiledMemory(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                          m.temp_size_in_bytes, host, jax.default_backend(), seconds)
