"""Context parallelism (a `context` mesh axis splitting each row's tokens): both attention strategies against one
device, every objective through the spine, the load-balanced layout, skipped work, memory a device, `jaxtune train`
on a context mesh, and the configs and refusals.

The 8-device checks run in subprocesses (tests/context_worker.py, tests/parallel_worker.py) with 8 fake CPU devices.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eight_devices import DeviceWorker
from shapes import LLAMA3_8B

from jaxtune.config import MeshConfig, tiny_config
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.generation import generate
from jaxtune.methods import method_config
from jaxtune.models.context_attention import (
    ContextLayout,
    balanced_order,
    context_layout,
    padded_length,
    to_layout,
)
from jaxtune.models.params import init_params
from jaxtune.parallel import abstract_mesh, partition_spec
from jaxtune.presets import write_random_model
from jaxtune.run_config import dump_run_config, load_run_config
from jaxtune.spine.run import abstract_run, per_device_bytes, traced_on
from jaxtune.train.loop import fine_tune

HERE = Path(__file__).parent
DEMO_DATA = HERE.parent / "jaxtune" / "assets" / "demo_instructions.jsonl"


WORKERS: dict[tuple[str, bool], DeviceWorker] = {}  # one process per worker script and flags, for this module


@pytest.fixture(scope="module", autouse=True)
def _close_workers():
    yield
    for worker in WORKERS.values():
        worker.close()
    WORKERS.clear()


def run(worker: str, *args: str, optimize: bool = False) -> dict:
    """`worker`'s answer to `args` on 8 fake devices (XLA's backend optimisation off unless `optimize`)."""
    if (worker, optimize) not in WORKERS:
        WORKERS[worker, optimize] = DeviceWorker(HERE / worker, optimize=optimize)
    return WORKERS[worker, optimize](*args)


# -- 8 fake devices ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", [*(pytest.param(case, marks=pytest.mark.full) for case in (  # everyday: the sinks test
    "causal", "packed", "sliding", "gemma2", "prefix", "qlora", "ia3", "tiled", "mixture"))])
def test_both_strategies_give_one_devices_loss_and_gradients(case):
    """SFT's loss and every trainable leaf's gradient on context=8, context=4 x fsdp=2 and context=2 x fsdp=2 x
    tensor=2, ring and all-gather, within 1e-5 (relative, float32) of one device: a causal GQA model (full
    fine-tune), packed rows with padding (LoRA), a sliding window on every layer (contiguous chunks, the ring cut
    short), Gemma 2 (sliding and global layers, soft-capped scores), prefix tuning (keys every device holds), QLoRA
    (NF4, double quantisation), IA3, the tiled MLP, and a Qwen2-MoE mixture with a tiled MLP (also on context=2 x
    expert=2 x tensor=2)."""
    out = run("context_worker.py", "gradients", case)
    meshes = ("context=8", "context=4 x fsdp=2", "context=2 x fsdp=2 x tensor=2") + (
        ("context=2 x expert=2 x tensor=2",) if case == "mixture" else ())
    assert set(out) == {f"{s} {m}" for s in ("ring", "all_gather") for m in meshes}
    for name, (loss, grads) in out.items():
        assert loss <= 1e-5 and grads <= 1e-5, (case, name, loss, grads)


@pytest.mark.slow
def test_attention_sinks_count_once_on_a_context_axis():
    """gpt-oss's sinks joined once per query after the blocks' merge: the output and the gradients of q, k, v and
    the sinks of the balanced ring and the ring cut short by a window (context=4 x fsdp=2) and the all-gather
    (context=2 x fsdp=2 x tensor=2) within 1e-5 of one device's blockwise kernel (padded rows included)."""
    out = run("context_worker.py", "sinks")
    assert len(out) == 3
    for name, (values, grads) in out.items():
        assert values <= 1e-5 and grads <= 1e-5, (name, values, grads)


@pytest.mark.slow
@pytest.mark.full
def test_splash_as_the_rings_per_block_kernel_gives_one_devices_loss_and_gradients():
    """`attention = "splash"` (on TPU, "auto") on a balanced ring: each block by splash's forward and backward
    kernels (Pallas' interpreter here) given the whole attention's output and log-sum-exp; packed rows, GQA, LoRA,
    on context=4 x fsdp=2 and context=2 x fsdp=2 x tensor=2, against one device's blockwise kernel."""
    out = run("context_worker.py", "splash")
    assert out.pop("pallas calls") > 0
    for mesh, (loss, grads) in out.items():
        assert loss < 1e-5 and grads < 1e-5, (mesh, loss, grads)


@pytest.mark.slow
@pytest.mark.full
def test_every_objective_trains_on_a_context_mesh_as_on_one_device():
    """Three spine steps of SFT, DPO (pairs), the reward model, GRPO's training step and distillation (the teacher
    split like the student) on context=4 x fsdp=2 give the one-device losses within 1e-5."""
    out = run("context_worker.py", "objectives")
    assert set(out) == {"sft", "dpo", "reward", "grpo", "distill"}
    assert all(d <= 1e-5 for d in out.values()), out


@pytest.mark.full
def test_balanced_layout_holds_chunks_i_and_2n_minus_1_minus_i_and_round_trips():
    out = run("context_worker.py", "layout")
    for name, ways in (("context=8", 8), ("context=4 x fsdp=2", 4)):
        assert out[name]["held"] == {str(i): [i, 2 * ways - 1 - i] for i in range(ways)}, out[name]
        assert out[name]["round trip"], name


@pytest.mark.full
def test_a_sliding_window_step_runs_fewer_flops_than_a_causal_one():
    """With a window on every layer the chunks stay contiguous and the ring stops at the devices a window reaches
    (3 of 8 blocks at 2,048 tokens, window 128): the program's FLOPs fall well below the causal step's."""
    out = run("context_worker.py", "flops")
    assert out["window 128"] < 0.5 * out["causal"], out


@pytest.mark.slow
@pytest.mark.full
def test_context_8_holds_at_most_a_fifth_of_one_devices_temporaries_at_32k_tokens():
    """Compiled temporaries a device of a LoRA step on one 32,768-token row (remat full): context=8, ring or
    all-gather, at most 1/5 of one device's."""
    out = run("context_worker.py", "memory", optimize=True)
    assert out["ring"] <= out["one"] / 5 and out["all_gather"] <= out["one"] / 5, out


@pytest.mark.slow
@pytest.mark.full
def test_jaxtune_train_on_a_context_mesh_equals_one_device(tmp_path):
    """`fine_tune` with [mesh] context = 4, fsdp = 2 (LoRA, packed rows, eval and checkpoints) gives the one-device
    run's train and eval losses and gradient norms within 1e-5."""
    model = write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.1)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    config = tmp_path / "run.toml"
    config.write_text("\n".join([
        "[model]", f'path = "{model}"', 'context_attention = "ring"', "[method]", 'kind = "lora"', "rank = 4",
        'target_modules = ["all-linear"]', "[data]", f'train = "{data}"', "max_seq_len = 96", "eval_fraction = 0.25",
        "[train]", "max_steps = 3", "batch_size = 4", "learning_rate = 1e-2", "log_every = 1",
        "checkpoint_every = 2"]) + "\n")
    single = fine_tune(load_run_config(config, [f"train.output_dir={tmp_path / 'one'}"]), log=lambda *_: None)
    records = [json.loads(line) for line in (single.run_dir / "metrics.jsonl").read_text().splitlines()]
    split = run("parallel_worker.py", "loop", str(config), f"train.output_dir={tmp_path / 'eight'}",
                "mesh.context=4", "mesh.fsdp=2")
    assert Path(split["result"], "adapter_model.safetensors").is_file()
    assert len(split["records"]) == len(records) and any("eval_loss" in r for r in records)
    for a, b in zip(split["records"], records):
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)


# -- layout, rules and configs -------------------------------------------------------------------------------------

def test_balanced_order_gives_device_i_chunks_i_and_2n_minus_1_minus_i():
    assert balanced_order(4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    x = jnp.arange(16)
    spread = to_layout(x[None], ContextLayout(4, True, "ring", 4))[0]
    assert spread.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert padded_length(100, 4) == 104 and padded_length(96, 4) == 96


def test_context_splits_tokens_and_partitions_parameters_over_fsdp_x_context():
    """The rules: a row's tokens over context; the weights, gradients and optimizer state of Llama-3-8B's LoRA run on
    context=8 partitioned 8 ways like fsdp=8's (ZeRO-3 over fsdp x context), not replicated."""
    sizes = {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert partition_spec(("batch", "seq", None), (4, 4096, 4096), sizes) == jax.sharding.PartitionSpec(
        "fsdp", "context", None)
    assert partition_spec(("layers", "embed", "mlp"), (32, 4096, 14336), sizes) == jax.sharding.PartitionSpec(
        None, ("fsdp", "context"), None)
    method = method_config("lora", rank=16, target_modules=("all-linear",))
    held = {}
    for name, mesh in (("context=8", MeshConfig(fsdp=1, context=8)), ("fsdp=8", MeshConfig(fsdp=8))):
        run_ = abstract_run(LLAMA3_8B, TrainPlan(method, 8, 4096, mesh=mesh), abstract_mesh(mesh, 8))
        held[name] = per_device_bytes(run_.frozen) + per_device_bytes(run_.state)
    assert held["context=8"] == held["fsdp=8"]


def test_run_config_reads_context_and_refuses_a_sequence_it_cannot_split():
    config = load_run_config(None, ["mesh.context=4", "mesh.fsdp=2", "model.context_attention=all_gather",
                                    "model.tiled_mlp=1024", "data.max_seq_len=1024"])
    assert config.mesh == MeshConfig(fsdp=2, context=4) and config.model.forward.context_attention == "all_gather"
    assert "context = 4" in dump_run_config(config) and "tiled_mlp = 1024" in dump_run_config(config)
    with pytest.raises(JaxtuneError, match=r"^config: \[data\] max_seq_len = 100 does not split over \[mesh\] "
                                           r"context = 4: a row is cut into 2 x 4 chunks, so use a multiple of 8$"):
        load_run_config(None, ["mesh.context=4", "data.max_seq_len=100"])
    with pytest.raises(ConfigError, match=r"^seq_len = 100: does not split over \[mesh\] context = 4"):
        TrainPlan(method_config("lora"), 1, 100, mesh=MeshConfig(context=4))
    with pytest.raises(JaxtuneError, match="--set model.context_attention=ulysses: choose one of ring, all_gather"):
        load_run_config(None, ["model.context_attention=ulysses"])
    with pytest.raises(JaxtuneError, match=r"^config: \[train\] objective = 'grpo' with \[mesh\] context = 2: its "
                                           r"rollouts decode whole rows"):
        load_run_config(None, ["mesh.context=2", "train.objective=grpo", "grpo.reward=x.y"])


def test_generation_on_a_context_mesh_is_refused_in_one_line():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))
    mesh = abstract_mesh(MeshConfig(fsdp=1, context=8), 8)
    with traced_on(mesh), pytest.raises(JaxtuneError, match=r"^generation does not split a row over \[mesh\] "
                                                            r"context = 8: decode on a mesh without a context axis$"):
        generate(params, cfg, [[1, 2, 3]], eos_ids=())


def test_a_window_model_keeps_contiguous_chunks_and_a_short_ring():
    """Layout decisions (on an abstract mesh): a global layer balances the chunks and walks the whole ring; windows
    on every layer keep chunks contiguous and stop the ring at the last device a window reaches."""
    with traced_on(abstract_mesh(MeshConfig(fsdp=1, context=8), 8)):
        causal = context_layout(4096, (0, 4096), "ring")
        window = context_layout(4096, (1024, 1024), "ring")
    assert causal.balanced and causal.ring_steps == 8
    assert not window.balanced and window.ring_steps == 3  # 512-token chunks: a window of 1,024 reaches 2 back
    assert context_layout(4096, (0,), "ring") is None  # no mesh in context: no context axis
    assert np.all(np.asarray(to_layout(jnp.arange(8)[None], window)) == np.arange(8))
