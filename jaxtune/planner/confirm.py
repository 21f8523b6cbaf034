"""Ahead-of-time confirmation: compile the real train step for a plan and read XLA's memory analysis.

Nothing is allocated: the step and its arguments are the spine's abstract run (`spine/run.py`), the very step and
ShapeDtypeStructs the trainer uses, and `jit(...).lower(...).compile()` plans buffers without running.
XLA's figure for one device is arguments + temporaries + outputs - aliased (donated state comes back in place).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.objectives import rows as rows_of


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
    """Compile the trainer's own step for `plan` on the default backend and return XLA's per-device memory analysis.

    The step is the spine's (`spine.run.abstract_run(...).step`): the objective's loss, accumulation and update in
    one jit with the run's shardings, offload memory kinds and donation. devices: the devices of the mesh (default:
    the first `mesh size` of `jax.devices()`; on CPU, fake ones come from
    XLA_FLAGS=--xla_force_host_platform_device_count=N). GRPO's rollout is a program of its own: `compile_rollout`.
    """
    run = _abstract_run(cfg, plan, _mesh(plan, devices))
    start = time.perf_counter()
    compiled = run.step.lower(run.state, run.frozen, run.second, run.batch).compile()
    return _memory(compiled, time.perf_counter() - start)


def _abstract_run(cfg: ModelConfig, plan: TrainPlan, mesh):
    from jaxtune.spine.run import abstract_run

    return abstract_run(cfg, plan, mesh)


def compile_rollout(cfg: ModelConfig, plan: TrainPlan) -> CompiledMemory:
    """XLA's memory of GRPO's rollout on one device: jaxtune's generation program (prefill, then a `while_loop`
    of cached decode steps) sampling `plan.generate_tokens` tokens after prompts of `seq_len - generate_tokens` for
    all `rows x grad_accum` rows of an optimizer step at once (as the trainer does), from the policy's weights as
    the step holds them (float32 trainable masters + the frozen base). The optimizer state, alive beside it but not
    an argument, is not in this figure."""
    from jaxtune.generation import _generate
    from jaxtune.methods.transform import combine

    if plan.generate_tokens < 1:
        raise JaxtuneError("a rollout needs generate_tokens of at least 1 (objective grpo)")
    run = _abstract_run(cfg, plan, _mesh(plan.replace(mesh=MeshConfig(fsdp=1)), None))
    state, frozen = run.state, run.frozen
    rows, prompt = rows_of(plan) * plan.grad_accum, plan.seq_len - plan.generate_tokens
    prefix = plan.method.num_virtual_tokens if plan.method.kind == "prefix" else 0
    spec = jax.ShapeDtypeStruct
    options = ForwardOptions(compute_dtype=plan.compute_dtype, attention=plan.attention)
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
    if not plan.generate_tokens:
        return step, "step"
    state = _abstract_run(cfg, plan, _mesh(plan.replace(mesh=MeshConfig(fsdp=1)), None)).state
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
