"""Scale-out: the mesh config, the rules table, shardings of every kind of leaf, ZeRO-3 bytes, host offload,
bfloat16 moments, and sharded training equal to one device.

The 8-device checks run in one process serving this module (tests/parallel_worker.py, tests/eight_devices.py) under
XLA_FLAGS=--xla_force_host_platform_device_count=8: a pytest worker has imported jax with one device already.
The worker's backend optimisation level is 0, which halves XLA's compile time on CPU; the single-device reference
runs in the same process with the same flags. Shape-level checks use an `abstract_mesh` of the real Llama-3-8B
config: nothing is allocated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from eight_devices import DeviceWorker
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file
from shapes import LLAMA3_8B

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, OffloadConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.parallel import abstract_mesh, low_precision_moments, make_mesh, partition_spec
from jaxtune.parallel import offload as offload_module
from jaxtune.parallel.mesh import hybrid_device_grid
from jaxtune.presets import write_random_model
from jaxtune.run_config import dump_run_config, load_run_config
from jaxtune.spine.run import abstract_run, per_device_bytes
from jaxtune.spine.shardings import batch_sharding, param_shardings, total_bytes
from jaxtune.train.checkpoint import Checkpoints
from jaxtune.train.loop import fine_tune

WORKER = Path(__file__).with_name("parallel_worker.py")
DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"
MESHES = ("fsdp=8", "data=8", "data=2 x fsdp=4", "fsdp=4 x tensor=2")
TINY = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=4)


run_worker = DeviceWorker(WORKER)  # one process on 8 fake devices serves this module's calls


@pytest.fixture(scope="module", autouse=True)
def _close_worker():
    yield
    run_worker.close()


# -- 8 fake devices ------------------------------------------------------------------------------------------------

def test_weights_load_straight_into_their_shards(tmp_path):
    """fsdp=8 on 8 fake devices: while the checkpoint is read, and after, no array on any device holds a
    parameter (or one layer of a stacked one) whole; every tensor byte of the checkpoint is read exactly once."""
    model = write_random_model(tmp_path / "model", "llama", hidden_size=64, intermediate_size=176)
    out = run_worker("load", str(model), "lora")
    assert out["shards_seen_while_reading"] > 100  # the arrays alive at each read were looked at
    assert out["during"] == [] and out["after"] == [], out
    data = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in load_file(str(model / "model.safetensors")).values())
    assert out["bytes_read"] == data
    assert all(shape[-1] <= 64 // 8 or shape[-2] <= 64 // 8 for shape in out["frozen_shard_shapes"] if len(shape) >= 2)


def test_a_rollouts_rows_are_split_over_the_devices_and_decode_as_on_one():
    """16 prompts sampled under fsdp=8 and fsdp=4 x tensor=2: each device holds 16 / 8 (or / 4) rows of the cache
    and of the new tokens, its heads split over tensor, and the tokens equal one device's."""
    out = run_worker("decode_rows")
    assert out["fsdp=8"]["cache"][1:3] == [2, 2] and out["fsdp=8"]["tokens"][0] == 2, out
    assert out["fsdp=4 x tensor=2"]["cache"][1:3] == [4, 1] and out["fsdp=4 x tensor=2"]["tokens"][0] == 4, out
    assert all(mesh["equal"] for mesh in out.values()), out


@pytest.mark.full  # 43 s on 2 cores; the padded decode's split rows stay in the everyday tier
def test_the_rollout_engine_splits_its_slots_over_the_devices_and_decodes_as_on_one():
    """The paged engine (5 prompts of 3-17 tokens, groups of 3, limits 2-12, 8 slots) under fsdp=8, fsdp=4 x tensor=2
    and data=4 x fsdp=2 with the policy in the run's shardings: each device decodes 8 / 8 (or / 4) slots, holds the
    pool's pages whole with its heads split over tensor only (no all-gather of the pool in its program: a step gathers
    the slots' new keys and values), and the tokens, in one call or in chunks, equal one device's."""
    out = run_worker("engine_rows")
    for mesh in ("fsdp=8", "data=4 x fsdp=2"):
        assert out[mesh]["tables"][0] == 1 and out[mesh]["pool"][1:5] == [64, 4, 2, 16], out
    assert out["fsdp=4 x tensor=2"]["tables"][0] == 2 and out["fsdp=4 x tensor=2"]["pool"][1:5] == [64, 4, 1, 16], out
    assert all(m["equal"] and m["chunked equal"] and m["free"] and m["params still split"] and m["pool gathers"] == 0
               for m in out.values()), out


@pytest.mark.full
def test_eval_on_8_devices_computes_each_row_on_its_own_device():
    """An 8-row eval batch arrives whole, but the constraints split the work: no [rows, T, ...] buffer of the
    compiled eval step holds more than one row's worth of logits per device (on data=8 one row's logits, on fsdp=8
    an eighth of the vocabulary of every row: the head's kernel is split by vocabulary rather than gathered)."""
    assert run_worker("eval") == {"fsdp=8": 1, "data=8": 1, "fsdp=8 whole head": False, "data=8 whole head": True}


@pytest.mark.full
def test_frozen_bfloat16_kernels_are_gathered_a_piece_at_a_time():
    """LoRA over a frozen bfloat16 base trains on fsdp=8 and fsdp=4 x tensor=2 as on one device, and the step's
    all-gathers of 16-bit weights never hold a kernel whole: on fsdp=8 pieces of at most 1 KiB (the piece size set
    for the test), on fsdp=4 x tensor=2 a kernel gathered over fsdp stays split over tensor. On fsdp=8 no layer's
    shard of a kernel is sliced off its stack whole: each piece's shard is read from the stack (the MLP kernels'
    layer shards, [8, 176] bits, are 2,816 bytes)."""
    out = run_worker("frozen_bf16")
    assert out["fsdp=8"] <= 1e-5 and out["fsdp=4 x tensor=2"] <= 1e-5, out
    assert out["fsdp=8 gathers"] and all(a * b * 2 <= 1024 for a, b in out["fsdp=8 gathers"]), out
    assert out["fsdp=8 largest bits slice"] <= 1024, out
    tensor_halves = {(a, b // 2) for a, b in out["kernels"]} | {(a // 2, b) for a, b in out["kernels"]}
    assert out["fsdp=4 x tensor=2 gathers"], out
    assert {tuple(g) for g in out["fsdp=4 x tensor=2 gathers"]} <= tensor_halves, out


@pytest.mark.slow
@pytest.mark.full
def test_gemma_and_phi3_train_on_every_mesh_as_on_one_device():
    """LoRA on every linear module of a tiny Gemma 2, Gemma 3 and Phi-3: their own leaves (sandwich and q/k norms,
    fused qkv_proj and gate_up_proj) follow the sharding rules, and 4 steps on fsdp=8 and fsdp=4 x tensor=2 give
    the one-device losses within 1e-5 (tests/parallel_worker.py families)."""
    out = run_worker("families")
    assert set(out) == {"gemma2", "gemma3", "phi3"}
    for arch, diffs in out.items():
        assert diffs.pop("loss fell"), arch
        assert diffs and all(d <= 1e-5 for d in diffs.values()), (arch, diffs)


@pytest.mark.slow
@pytest.mark.parametrize("method", [pytest.param("full", marks=pytest.mark.full), "lora",
                                    pytest.param("qlora", marks=pytest.mark.full)])
def test_sharded_training_on_8_devices(method):
    """One subprocess per method (its compiles dominate), checking:

    - every mesh trains like one device: 10 steps of 2 accumulated micro-batches x 8 rows, loss within 1e-5;
    - ZeRO-3 under fsdp=8, read from the arrays' shards: each device holds 1/8 of the params, optimizer state and
      frozen weights; only scalars (Adam's counter, QLoRA's per-layer offsets) are replicated;
    - on fsdp=4 x tensor=2 the kernel is (-, fsdp, tensor), LoRA A splits its input axis the same way first, LoRA B
      its output axis, NF4 codes and absmax their block axis output-major (tensor first);
    - LoRA with bfloat16 moments stores bfloat16 and moves the 10-step loss by ~1e-5.
    """
    out = run_worker(method)
    assert len(out["single"]) == 10 and len(set(out["single"])) > 1
    for mesh in MESHES:
        assert out[mesh] <= 1e-5, (mesh, out[mesh])

    for part in ("params", "opt_state") + (("frozen",) if method != "full" else ()):
        b = out[f"{part}_bytes"]
        assert b["devices"] == 8 and len(b["per_device"]) == 1, b
        assert b["per_device"][0] == (b["total"] - b["replicated"]) // 8 + b["replicated"], (part, b)
        assert b["replicated"] <= 0.001 * b["total"], (part, b)

    specs = out["specs"]
    if method == "qlora":
        assert "codes=(None, ('tensor', 'fsdp'))" in specs["kernel"]
        assert "absmax=(None, ('tensor', 'fsdp'))" in specs["kernel"]
    else:
        assert specs["kernel"] == "(None, 'fsdp', 'tensor')"
    if method != "full":
        assert specs["lora_a"] == "(None, ('fsdp', 'tensor'), None)"
        assert specs["lora_b"] == "(None, None, ('tensor', 'fsdp'))"

    if method == "lora":
        bf16 = out["bf16_moments"]
        assert bf16["dtypes"] == ["bfloat16", "int32"]
        assert bf16["relative_diff"] <= 1e-4  # 1.5e-5 over these 10 steps; longer runs: experiments/README.md


@pytest.mark.slow
@pytest.mark.full
def test_a_two_slice_hybrid_mesh_trains_as_one_device():
    """[mesh] slices = 2, data = 2, fsdp = 2, tensor = 2: the data axis is two blocks of 4 devices, one a slice
    (DCN between them), fsdp x tensor within each; LoRA's losses equal one device's from the first step."""
    out = run_worker("two_slices")
    assert out["blocks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["first_step"] <= 1e-6 and out["all_steps"] <= 1e-5, out


@pytest.mark.slow
@pytest.mark.full
def test_fine_tune_on_8_devices_with_offload_equals_one_device(tmp_path):
    """`jaxtune train` of QLoRA with [mesh] data=2 fsdp=4 and [offload] optimizer state and (NF4) frozen weights in
    pinned host memory, against the same config on one device: train and eval losses, checkpoints, the adapter."""
    model = write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.1)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    config = tmp_path / "run.toml"
    config.write_text("\n".join([
        "[model]", f'path = "{model}"', "[method]", 'kind = "qlora"', "rank = 4", 'target_modules = ["all-linear"]',
        "[data]", f'train = "{data}"', "max_seq_len = 96", "eval_fraction = 0.25",
        "[train]", "max_steps = 3", "batch_size = 8", "grad_accum = 2", "learning_rate = 1e-2", "log_every = 1",
        "checkpoint_every = 2"]) + "\n")
    single = fine_tune(load_run_config(config, [f"train.output_dir={tmp_path / 'one'}"]), log=lambda *_: None)
    records = [json.loads(line) for line in (single.run_dir / "metrics.jsonl").read_text().splitlines()]
    sharded = run_worker("loop", str(config), f"train.output_dir={tmp_path / 'eight'}", "mesh.data=2",
                         "offload.optimizer_state=true", "offload.frozen_params=true")
    assert Path(sharded["result"], "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "eight" / "checkpoints").iterdir()) == ["2", "3"]
    assert len(sharded["records"]) == len(records) and any("eval_loss" in r for r in records)
    for a, b in zip(sharded["records"], records):
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)


@pytest.mark.full
def test_offloaded_state_stays_in_host_memory_through_steps_and_checkpoints(tmp_path):
    """Placement mechanics on this process's one CPU device: the optimizer state and frozen weights start, stay and
    are restored in pinned host memory, the trainable params on the device, and the step computes what it computes
    without offload."""
    method = method_config("lora", rank=2, target_modules=("all-linear",))
    params = apply_method(init_params(TINY, jax.random.key(0)), TINY, method, jax.random.key(1))
    params["layers"]["q_proj"]["lora_b"] += 0.1
    trainable, frozen = partition(params, trainable_mask(params, method))
    offload = lambda on: OffloadConfig(optimizer_state=on, frozen_params=on)
    runs = {on: abstract_run(TINY, TrainPlan(method, 8, 4, 1, param_dtype="float32",
                                             forward=ForwardOptions(compute_dtype="float32", remat="none"),
                                             offload=offload(on)),
                             make_mesh(MeshConfig())) for on in (True, False)}
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    states = {k: run.init_state(trainable, 0) for k, run in runs.items()}
    placed = {k: jax.device_put(frozen, run.shardings.frozen) for k, run in runs.items()}
    assert kinds(states[True]["opt_state"]) == kinds(placed[True]) == {"pinned_host"}
    assert kinds(states[True]["params"]) == {"device"}
    ids = np.arange(32, dtype=np.int32).reshape(1, 8, 4) % TINY.vocab_size
    batch = {"input_ids": ids, "labels": (ids + 1) % TINY.vocab_size, "loss_mask": np.ones((1, 8, 4), np.float32),
             "segment_ids": np.ones((1, 8, 4), np.int32), "positions": np.broadcast_to(np.arange(4, dtype=np.int32),
                                                                                      (1, 8, 4))}
    for _ in range(2):
        for k, run in runs.items():
            states[k], _ = run.step(states[k], placed[k], None, batch)
    state = states[True]
    assert kinds(state["opt_state"]) == {"pinned_host"} and kinds(state["params"]) == {"device"}
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(states[False]["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=1)
    checkpoints.save(2, state, {})
    restored, _ = checkpoints.restore(2, state)
    checkpoints.close()
    assert kinds(restored["opt_state"]) == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding == b.sharding and np.array_equal(a, b)


# -- the rules, on abstract meshes (no devices) --------------------------------------------------------------------

def test_rules_split_heads_and_hidden_and_drop_what_does_not_divide():
    mesh = {"data": 2, "fsdp": 4, "expert": 1, "tensor": 2}
    assert partition_spec(("layers", "embed", "mlp"), (32, 4096, 14336), mesh) == P(None, "fsdp", "tensor")
    assert partition_spec(("vocab", "embed"), (128256, 4096), mesh) == P("tensor", "fsdp")
    assert partition_spec(("layers", "embed"), (32, 4096), mesh) == P(None, ("fsdp", "tensor"))
    # 259 (a byte-level vocabulary) divides by nothing: kept whole, and fsdp still splits the hidden axis
    assert partition_spec(("vocab", "embed"), (259, 64), mesh) == P(None, ("fsdp", "tensor"))
    # 2 kv heads x 64 on tensor=2 x fsdp=4 would be fine; 6 columns take tensor but not fsdp
    assert partition_spec(("layers", "lora_rank", "kv_heads"), (2, 4, 6), mesh) == P(None, None, "tensor")
    assert partition_spec((None, "batch", None), (4, 8, 128), mesh) == P(None, ("data", "fsdp"), None)
    data_only = {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert partition_spec((None, "batch", None), (4, 8, 128), data_only) == P(None, "data", None)
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'heads'"):
        partition_spec(("layers", "heads"), (2, 8), mesh)


METHODS_8B = {
    "full": method_config("full"),
    "lora": method_config("lora", rank=16, target_modules=("all-linear",)),
    "dora": method_config("lora", rank=16, target_modules=("all-linear",), dora=True),
    "qlora": method_config("qlora", rank=16, target_modules=("all-linear",)),
    "qlora8": method_config("qlora", rank=16, target_modules=("all-linear",), bits=8),
    "ia3": method_config("ia3"),
    "prefix": method_config("prefix"),
    "adapter": method_config("adapter"),
}


@pytest.mark.parametrize("kind", list(METHODS_8B))
@pytest.mark.parametrize("mesh_config", [MeshConfig(fsdp=8), MeshConfig(fsdp=4, tensor=2), MeshConfig(data=2, fsdp=4)])
def test_llama3_8b_every_leaf_kind_is_partitioned(kind, mesh_config):
    """Per-device bytes of trainable params, optimizer state and frozen weights are 1/(fsdp x tensor) of the total,
    for every method's leaves on the real Llama-3-8B shapes (from `NamedSharding.shard_shape`, nothing allocated)."""
    method = METHODS_8B[kind]
    plan = TrainPlan(method, 8, 128, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="bfloat16", remat="none"), mesh=mesh_config)
    run = abstract_run(LLAMA3_8B, plan, abstract_mesh(mesh_config, 8))
    ways = mesh_config.resolve(8)["fsdp"] * mesh_config.resolve(8)["tensor"]
    for name, tree in (("params", run.state["params"]), ("opt_state", run.state["opt_state"]),
                       ("frozen", run.frozen)):
        total = total_bytes(tree)
        assert per_device_bytes(tree) <= total / ways * 1.0001 + 64, (name, total, per_device_bytes(tree))


def test_method_leaves_follow_their_base_kernel():
    """The mesh axes of LoRA A's input axis and LoRA B's output axis begin with the kernel's; DoRA's magnitude and
    IA3's vectors take the output (input) axis's."""
    cfg = LLAMA3_8B
    mesh = abstract_mesh(MeshConfig(fsdp=4, tensor=2), 8)
    method = method_config("lora", rank=16, target_modules=("all-linear",), dora=True)
    params = jax.eval_shape(lambda k: apply_method(init_params(cfg, k), cfg, method, k), jax.random.key(0))
    shardings = param_shardings(params, cfg, mesh)
    as_tuple = lambda spec: [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec]
    for name, module in shardings["layers"].items():
        if not isinstance(module, dict) or "kernel" not in module:
            continue
        _, k_in, k_out = as_tuple(module["kernel"].spec)
        _, a_in, _ = as_tuple(module["lora_a"].spec)
        _, _, b_out = as_tuple(module["lora_b"].spec)
        _, m_out = as_tuple(module["magnitude"].spec)
        assert a_in[:len(k_in)] == k_in and b_out[:len(k_out)] == k_out and m_out[:len(k_out)] == k_out, name


def test_nf4_blocks_stay_whole_on_every_device():
    """Each device's codes are exactly the blocks its absmax entries describe: the flat split is whole blocks."""
    cfg = LLAMA3_8B
    method = method_config("qlora", rank=16, target_modules=("all-linear",))
    params = jax.eval_shape(lambda k: apply_method(init_params(cfg, k), cfg, method, k), jax.random.key(0))
    for mesh_config in (MeshConfig(fsdp=8), MeshConfig(fsdp=4, tensor=2)):
        shardings = param_shardings(params, cfg, abstract_mesh(mesh_config, 8))
        for name in ("q_proj", "k_proj", "gate_proj", "down_proj"):
            q, s = params["layers"][name]["kernel"], shardings["layers"][name]["kernel"]
            codes = s.codes.shard_shape(q.codes.shape)[-1]
            blocks = s.absmax.shard_shape(q.absmax.shape)[-1]
            assert codes == blocks * q.blocksize // 2 and blocks < q.absmax.shape[-1], (name, codes, blocks)
            assert s.absmax2.shard_shape(q.absmax2.shape)[-1] * 256 == blocks  # double-quant groups too


# -- configs and errors --------------------------------------------------------------------------------------------

def test_mesh_sizes_that_do_not_fit_the_devices_are_errors_naming_both():
    assert MeshConfig().resolve(8) == {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
    assert MeshConfig(data=2, tensor=2).resolve(8) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    with pytest.raises(JaxtuneError, match=r"data=3 x fsdp=-1 x tensor=1: 3 devices .* do not divide the 8 devices"):
        MeshConfig(data=3).resolve(8)
    with pytest.raises(JaxtuneError, match=r"data=2 x fsdp=2 x tensor=1 needs 4 devices, but 8 are available"):
        MeshConfig(data=2, fsdp=2).resolve(8)
    with pytest.raises(JaxtuneError, match=r"needs 2 devices, but 1 are available"):
        make_mesh(MeshConfig(data=2, fsdp=1))  # this process has one CPU device
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(JaxtuneError, match=r"--set mesh.tensor=0: a mesh axis size is a positive integer"):
        load_run_config(None, ["mesh.tensor=0"])
    assert MeshConfig(data=-1, fsdp=2, slices=2).resolve(8)["data"] == 4
    with pytest.raises(JaxtuneError, match=r"mesh.data = 1: the data axis spans the 2 slices, so it is a "
                                           r"multiple of slices = 2 \(or -1\)"):
        load_run_config(None, ["mesh.slices=2"])
    with pytest.raises(JaxtuneError, match=r"--set mesh.slices=0: the number of slices is a positive integer"):
        load_run_config(None, ["mesh.slices=0"])
    with pytest.raises(JaxtuneError, match=r"data=-1 x fsdp=3 x tensor=1 x slices=2: the data axis takes 1 of 3"):
        MeshConfig(data=-1, fsdp=3, slices=2).resolve(3)
    with pytest.raises(JaxtuneError,
                       match=r"batch_size = 6 rows cannot be split .* data x fsdp x expert = 2 x 4 x 1 = 8"):
        batch_sharding(abstract_mesh(MeshConfig(data=2, fsdp=4), 8), 6)


def test_devices_that_name_their_slice_fill_its_block_of_the_data_axis():
    """A TPU device says its slice (`slice_index`): each slice's devices make one block of the data axis, in slice
    order whatever the device order (the 8-device training check above uses devices that do not say it)."""
    devices = [SimpleNamespace(id=i, slice_index=1 - i // 4, platform="cpu", device_kind="cpu", process_index=0)
               for i in range(8)]
    grid = hybrid_device_grid([2, 2, 1, 1, 2], 2, devices)
    assert grid.shape == (2, 2, 1, 1, 2)
    assert [sorted(d.id for d in grid[i].flat) for i in range(2)] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(JaxtuneError, match=r"slices = 4, but the 8 devices are in 2 slice\(s\) of \[4\] devices"):
        hybrid_device_grid([4, 2, 1, 1, 1], 4, devices)


def test_offload_where_the_backend_has_no_host_memory_says_so(monkeypatch):
    mesh = make_mesh(MeshConfig())
    assert "pinned_host" in offload_module.memory_kinds(mesh)  # the CPU backend has it
    monkeypatch.setattr(offload_module, "memory_kinds", lambda mesh: ("device",))
    plan = TrainPlan(method_config("lora"), 8, 4, offload=OffloadConfig(optimizer_state=True))
    with pytest.raises(JaxtuneError, match=r"\[offload\] optimizer_state = true: the cpu backend has no "
                                           r"'pinned_host' memory \(memory kinds: device\); set it to false"):
        abstract_run(TINY, plan, mesh)


def test_run_config_reads_and_writes_mesh_and_offload():
    config = load_run_config(None, ["mesh.data=2", "mesh.tensor=2", "offload.optimizer_state=true",
                                    "offload.moments_dtype=bfloat16"])
    assert config.mesh == MeshConfig(data=2, fsdp=-1, tensor=2)
    assert config.offload == OffloadConfig(optimizer_state=True, moments_dtype="bfloat16")
    text = dump_run_config(config)
    assert "[mesh]\ndata = 2\nfsdp = -1\nexpert = 1\ncontext = 1\ntensor = 2\n" in text
    assert 'moments_dtype = "bfloat16"' in text
    with pytest.raises(JaxtuneError, match="--set offload.moments_dtype=float16: choose one of float32, bfloat16"):
        load_run_config(None, ["offload.moments_dtype=float16"])


def test_bf16_moments_store_bfloat16_and_update_in_float32():
    params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}
    grads = {"w": jnp.cos(jnp.arange(64.0)).reshape(8, 8)}
    fp32, bf16 = optax.adamw(1e-2), low_precision_moments(optax.adamw(1e-2), "bfloat16")
    s32, s16 = fp32.init(params), bf16.init(params)
    for _ in range(3):
        u32, s32 = fp32.update(grads, s32, params)
        u16, s16 = bf16.update(grads, s16, params)
    assert {str(x.dtype) for x in jax.tree.leaves(s16)} == {"bfloat16", "int32"}
    mu32, mu16 = s32[0].mu["w"], s16[0].mu["w"]
    np.testing.assert_allclose(np.asarray(mu16, np.float32), mu32, rtol=3 * 2**-8)  # a rounding per step
    np.testing.assert_allclose(u16["w"], u32["w"], rtol=1e-2)
    assert math.isclose(float(jnp.abs(u16["w"]).max()), 1e-2, rel_tol=1e-2)


@pytest.mark.slow
@pytest.mark.full
def test_mixtures_train_on_meshes_with_an_expert_axis_as_on_one_device():
    """A full fine-tune of a tiny Mixtral and Qwen3-MoE and LoRA on a Qwen2-MoE's attention and shared expert, with
    the load-balancing loss on: 4 steps on fsdp=2 x expert=4 and fsdp=2 x expert=2 x tensor=2 give the one-device
    losses within 1e-5, the experts split over the expert axis (tests/parallel_worker.py mixtures)."""
    out = run_worker("mixtures")
    assert out.pop("expert shards") == "P(None, 'expert', None, 'fsdp')"  # down_proj [L, E, Fe, D]
    assert set(out) == {"mixtral", "qwen2_moe", "qwen3_moe"}
    for arch, diffs in out.items():
        assert diffs.pop("loss fell", True), arch  # the full fine-tunes learn
        assert diffs and all(d <= 1e-5 for d in diffs.values()), (arch, diffs)


@pytest.mark.slow
@pytest.mark.full
def test_megablox_experts_train_as_ragged_dot_on_every_mesh():
    """TPU's grouped matmul (Pallas megablox, interpreted here) trains as `lax.ragged_dot` does on one device, 4 steps
    within 1e-5: a tiny Mixtral's full fine-tune (gmm's and tgmm's backward) on one device, with the experts split over
    the expert axis (rows gathered over it, each device its own experts from their group offset, the sums
    reduce-scattered back) and with a tensor axis too (each device its share of every expert's hidden units); LoRA on
    a Qwen2-MoE's experts on fsdp=8 (each device all experts) and expert=8; a Qwen3-MoE on expert=8."""
    out = run_worker("megablox")
    assert {arch: set(diffs) for arch, diffs in out.items()} == {
        "mixtral": {"one", "fsdp=2 x expert=4", "fsdp=2 x expert=2 x tensor=2"}, "qwen2_moe": {"fsdp=8", "expert=8"},
        "qwen3_moe": {"expert=8"}}
    for arch, diffs in out.items():
        assert all(d <= 1e-5 for d in diffs.values()), (arch, diffs)
