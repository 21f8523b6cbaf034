"""A training run placed on the mesh: the shardings of its state, frozen weights and batches, and the step
jitted with them.

    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    shardings = train_shardings(mesh, cfg, trainable, frozen, optimizer, batch_size=8)
    state = init_sharded_state(trainable, optimizer, seed, shardings)
    frozen = jax.device_put(frozen, shardings.frozen)
    step = shard_train_step(make_train_step(cfg, method, options, optimizer, schedule), shardings)
    state, metrics = step(state, frozen, jax.device_put(batch_AxBxT, shardings.batch))

`shard_train_step` wraps the (already jitted) step in one outer `jax.jit` with explicit in/out shardings and the
state donated; the inner jit is inlined into it, so each step is still one compiled program. With the parameters
split over `fsdp` and the batch over ("data", "fsdp"), XLA's SPMD partitioner inserts the all-gathers of weights and
the reduce-scatters of gradients (ZeRO-3). The step is traced under the mesh (`traced_on`), so the decoder splits
each layer input's rows over ("data", "fsdp") as well (`rules.constrain`): every device computes and keeps only its
rows. out_shardings equal to in_shardings keep the new state exactly where the old one was, so the donated buffers
are reused and the step never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax
from jax.sharding import AbstractMesh, NamedSharding

from jaxtune.config import ModelConfig, OffloadConfig
from jaxtune.methods.transform import combine
from jaxtune.parallel.offload import HOST, check_host_memory, on_device, with_memory_kind
from jaxtune.parallel.sharding import AnyMesh, batch_sharding, optimizer_shardings, param_shardings, replicated


@dataclass(frozen=True)
class TrainShardings:
    """Where each part of a run lives. state: the train state's tree ({"params", "opt_state", "step", ...});
    frozen: the frozen weights' tree; batch: [A, B, T] micro-batch stacks."""

    mesh: AnyMesh
    state: dict
    frozen: dict
    batch: NamedSharding

    @property
    def params(self) -> dict:
        """Shardings of `combine(state["params"], frozen)`, the full parameter tree."""
        return combine(self.state["params"], self.frozen)


def train_shardings(mesh: AnyMesh, cfg: ModelConfig, trainable: dict, frozen: dict,
                    optimizer: optax.GradientTransformation, batch_size: int,
                    offload: OffloadConfig = OffloadConfig()) -> TrainShardings:
    """Shardings for the state `init_state(trainable, optimizer, seed)` would make, the frozen tree, and batches of
    `batch_size` rows. Trees may be abstract (ShapeDtypeStructs): nothing is allocated."""
    trainable_sh = param_shardings(trainable, cfg, mesh)
    frozen_sh = param_shardings(frozen, cfg, mesh)
    opt_sh = optimizer_shardings(optimizer, trainable, trainable_sh, mesh)
    if offload.optimizer_state:
        check_host_memory(mesh, "optimizer_state")
        opt_sh = with_memory_kind(opt_sh, HOST)
    if offload.frozen_params:
        check_host_memory(mesh, "frozen_params")
        frozen_sh = with_memory_kind(frozen_sh, HOST)
    from jaxtune.train.step import init_state  # not at the top: train.step -> run_config -> jaxtune.parallel

    # the state's other entries (step, rng, counters) are small and replicated, whatever train.step puts there
    state = jax.tree.map(lambda _: replicated(mesh), jax.eval_shape(lambda t: init_state(t, optimizer, 0), trainable))
    state.update(params=trainable_sh, opt_state=opt_sh)
    return TrainShardings(mesh, state, frozen_sh, batch_sharding(mesh, batch_size))


def init_sharded_state(trainable: dict, optimizer: optax.GradientTransformation, seed: int,
                       shardings: TrainShardings) -> dict:
    """`init_state`, created directly in its shardings (each device allocates only its part)."""
    from jaxtune.train.step import init_state

    return jax.jit(lambda t: init_state(t, optimizer, seed), out_shardings=shardings.state)(trainable)


def shard_train_step(train_step, shardings: TrainShardings):
    """`train_step(state, frozen, batch) -> (state, metrics)` jitted with the run's shardings, state donated.

    Offloaded trees arrive in host memory and are copied to the devices inside the step; the new state leaves in
    the shardings (and memory kinds) it came in.
    """

    def step(state, frozen, batch):
        state, frozen = on_device((state, frozen), (shardings.state, shardings.frozen))
        with traced_on(shardings.mesh):
            return train_step(state, frozen, batch)

    return jax.jit(step, in_shardings=(shardings.state, shardings.frozen, shardings.batch),
                   out_shardings=(shardings.state, None), donate_argnums=0)


def shard_eval_step(eval_step, shardings: TrainShardings):
    """`eval_step(params, batch)` for the full (combined) parameter tree as the run holds it, host-offloaded
    weights included; batches are placed by the compiler."""
    params_sh = shardings.params

    def evaluate(params, batch):
        with traced_on(shardings.mesh):
            return eval_step(on_device(params, params_sh), batch)

    return jax.jit(evaluate, in_shardings=(params_sh, None))


def traced_on(mesh: AnyMesh):
    """The context a step is traced in: `mesh` as the abstract mesh, so `rules.constrain` can split activations
    (each layer input's rows over ("data", "fsdp")) by the same table as the parameters."""
    return jax.sharding.use_abstract_mesh(mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh)
