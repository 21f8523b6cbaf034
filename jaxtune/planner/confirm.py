"""Ahead-of-time confirmation: compile the real train step for a plan and read XLA's memory analysis.

Nothing is allocated: the state, frozen weights and batch are `jax.ShapeDtypeStruct`s (from `jax.eval_shape` on
the same functions the training loop calls), and `jit(...).lower(...).compile()` plans buffers without running.
XLA's figure for one device is arguments + temporaries + outputs - aliased (donated state comes back in place).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.data.batching import DTYPES as BATCH_DTYPES
from jaxtune.errors import JaxtuneError
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models.llama import ForwardOptions, Remat
from jaxtune.models.params import abstract_params
from jaxtune.parallel.mesh import MeshConfig
from jaxtune.planner.plan import TrainPlan
from jaxtune.run_config import TrainConfig


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
    """(state, frozen, batch, optimizer) as ShapeDtypeStructs, built exactly as `fine_tune` builds the real ones."""
    from jaxtune.train.step import init_state, make_optimizer

    base = abstract_params(cfg, jnp.dtype(plan.param_dtype))
    params = jax.eval_shape(lambda p, k: apply_method(p, cfg, plan.method, k), base, jax.random.key(0))
    trainable, frozen = partition(params, trainable_mask(params, plan.method))
    optimizer = make_optimizer(TrainConfig(), 1000, trainable)
    if plan.offload.moments_dtype != "float32":
        from jaxtune.parallel.offload import low_precision_moments

        optimizer = low_precision_moments(optimizer, plan.offload.moments_dtype)
    state = jax.eval_shape(lambda t: init_state(t, optimizer, 0), trainable)
    shape = (plan.grad_accum, plan.batch_size, plan.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, d) for k, d in BATCH_DTYPES.items()}
    return state, frozen, batch, optimizer


def compile_step(cfg: ModelConfig, plan: TrainPlan, devices=None) -> CompiledMemory:
    """Compile jaxtune's train step for `plan` on the default backend and return XLA's per-device memory analysis.

    The step is the one `fine_tune` runs: `make_train_step` placed on the plan's mesh by jaxtune.parallel (its
    shardings, offload memory kinds and donation). devices: the devices of the mesh (default: the first
    `mesh size` of `jax.devices()`; on CPU, fake ones come from XLA_FLAGS=--xla_force_host_platform_device_count=N).
    Only supervised fine-tuning has a jaxtune step to compile here.
    """
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.parallel.placement import shard_train_step, train_shardings
    from jaxtune.train.step import learning_rate_schedule, make_train_step

    if plan.objective != "sft":
        raise JaxtuneError(f"--confirm compiles jaxtune's supervised train step; objective {plan.objective!r} is "
                           "estimated analytically only")
    available = list(jax.devices() if devices is None else devices)
    sizes = plan.mesh.resolve(len(available)) if -1 in plan.mesh.sizes().values() else plan.mesh.sizes()
    needed = math.prod(sizes.values())
    if needed > len(available):
        hint = (f"; on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
                if jax.default_backend() == "cpu" else "")
        raise JaxtuneError(f"the plan's mesh needs {needed} devices, this {jax.default_backend()} backend has "
                           f"{len(available)}{hint}")
    mesh = make_mesh(MeshConfig(**sizes), available[:needed])
    state, frozen, batch, optimizer = abstract_step_inputs(cfg, plan)
    options = ForwardOptions(compute_dtype=plan.compute_dtype, remat=Remat(plan.remat))
    trainable = state["params"]
    shardings = train_shardings(mesh, cfg, trainable, frozen, optimizer, plan.batch_size, plan.offload)
    step = shard_train_step(make_train_step(cfg, plan.method, options, optimizer,
                                            learning_rate_schedule(TrainConfig(), 1000)), shardings)
    start = time.perf_counter()
    compiled = step.lower(state, frozen, batch).compile()
    return _memory(compiled, time.perf_counter() - start)


def _memory(compiled, seconds: float) -> CompiledMemory:
    m = compiled.memory_analysis()
    if m is None:
        raise JaxtuneError(f"the {jax.default_backend()} backend gives no memory analysis for compiled programs")
    host = m.host_argument_size_in_bytes + m.host_temp_size_in_bytes + m.host_output_size_in_bytes \
        - m.host_alias_size_in_bytes
    return CompiledMemory(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                          m.temp_size_in_bytes, host, jax.default_backend(), seconds)
