"""The run spine's contract: the trainer, the planner and `plan --confirm` read one abstract run. What the planner
counts is the arrays the trainer creates, and what `--confirm` compiles is the step the trainer runs."""

import math

import jax
import numpy as np
import pytest

from jaxtune.config import ForwardOptions, MeshConfig, MethodConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.parallel.mesh import make_mesh
from jaxtune.planner.confirm import compile_step
from jaxtune.planner.devices import get_device
from jaxtune.planner.estimate import estimate
from jaxtune.presets import tiny_model_config, write_random_model
from jaxtune.spine.load import load_run
from jaxtune.spine.run import abstract_run, init_run

METHODS = {"lora": method_config("lora", rank=4, target_modules=("all-linear",)), "qlora": method_config("qlora"),
           "full": method_config("full")}


def plan_of(method: MethodConfig) -> TrainPlan:
    return TrainPlan(method, forward=ForwardOptions(compute_dtype="float32"), batch_size=2, seq_len=32, grad_accum=2,
                     param_dtype="float32", mesh=MeshConfig())


def device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", list(METHODS))
def test_the_planner_counts_the_arrays_of_the_trainers_run(name):
    cfg = tiny_model_config()
    plan = plan_of(METHODS[name])
    run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]))
    est = estimate(cfg, plan, get_device("cpu"))
    assert est.frozen_bytes == device_bytes(run.frozen)
    assert est.trainable_bytes == device_bytes(run.state["params"])
    assert est.optimizer_bytes == device_bytes(run.state["opt_state"])
    assert est.trainable_parameters == sum(x.size for x in jax.tree.leaves(run.state["params"]))


def test_confirm_compiles_the_step_the_trainer_runs():
    """`--confirm`'s program takes exactly the trainer's arguments: the state, the frozen tree and the batch."""
    cfg = tiny_model_config()
    plan = plan_of(METHODS["lora"])
    run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]))
    compiled = compile_step(cfg, plan)
    assert compiled.argument_bytes == device_bytes((run.state, run.frozen, run.batch))
    assert compiled.alias_bytes == device_bytes(run.state)  # the state is donated: updated in place


@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_the_loaded_run_has_the_abstract_runs_shapes_dtypes_and_shardings(name, tmp_path):
    cfg = tiny_model_config()
    model = write_random_model(tmp_path / "model", "llama")
    run = abstract_run(cfg, plan_of(METHODS[name]), make_mesh(MeshConfig(), jax.devices()[:1]))
    state, frozen, _ = load_run(run, model, seed=0)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path((run.state, run.frozen)),
                                 jax.tree.leaves((state, frozen)), strict=True):
        where = jax.tree_util.keystr(path)
        assert (got.shape, got.dtype) == (want.shape, want.dtype), where
        assert got.sharding.is_equivalent_to(want.sharding, len(want.shape)), where


def test_init_run_is_the_method_applied_to_random_weights_and_partitioned():
    cfg, method = tiny_model_config(), METHODS["lora"]
    trainable, frozen = init_run(cfg, method, seed=3)
    base = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(3))
    params = apply_method(base, cfg, method, jax.random.key(4))
    want = partition(params, trainable_mask(params, method))
    for got, expected in zip(jax.tree.leaves((trainable, frozen)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, expected)
