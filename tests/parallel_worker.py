"""Sharded training on 8 fake CPU devices, run by tests/test_parallel.py in a subprocess.

XLA fixes the number of host devices when jax is first imported, which a pytest worker has already done, so the
sharded checks run here, under XLA_FLAGS=--xla_force_host_platform_device_count=8: one process serving a test
module's calls (tests/eight_devices.py), or one call printing one JSON object:

    python tests/parallel_worker.py full|lora|qlora
    python tests/parallel_worker.py loop CONFIG.toml [section.key=value ...]
    python tests/parallel_worker.py planner
    python tests/parallel_worker.py families
    python tests/parallel_worker.py mixtures
    python tests/parallel_worker.py splash

For one method: 10 steps on one device, then on each mesh (fsdp=8, data=8, data=2 x fsdp=4, fsdp=4 x tensor=2);
the per-device bytes under fsdp=8; bfloat16 moments (LoRA). `loop` runs `fine_tune` on the 8 devices (the
host-offload check) and prints its metrics. `planner` compiles a small model's sharded step on each mesh and prints
the planner's per-device estimate beside XLA's figure.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from eight_devices import serve

from jaxtune import generation
from jaxtune.config import ForwardOptions, MeshConfig, MethodConfig, OffloadConfig, TrainConfig, tiny_config
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.parallel import make_mesh
from jaxtune.presets import tiny_model_config
from jaxtune.spine.run import abstract_run, init_run
from jaxtune.spine.shardings import bytes_per_device, total_bytes

STEPS, ACCUM, ROWS, SEQ = 10, 2, 8, 32
CFG = tiny_config(initializer_range=0.1)
METHODS = {
    "full": method_config("full"),
    "lora": method_config("lora", rank=4, target_modules=("all-linear",)),
    "qlora": method_config("qlora", rank=4, target_modules=("all-linear",), bits=4, double_quant=True),
}
MESHES = {
    "fsdp=8": MeshConfig(fsdp=8),
    "data=8": MeshConfig(data=8, fsdp=1),
    "data=2 x fsdp=4": MeshConfig(data=2, fsdp=4),
    "fsdp=4 x tensor=2": MeshConfig(fsdp=4, tensor=2),
}
TRAIN = TrainConfig(learning_rate=1e-2, grad_accum=ACCUM, batch_size=ROWS, warmup_steps=2)
MIXTURES = (("mixtral", METHODS["full"]), ("qwen3_moe", METHODS["full"]),
             ("qwen2_moe", method_config("lora", rank=4, target_modules=("all-linear",),
                                        target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))))
MIXTURE_MESHES = {"one": MeshConfig(fsdp=1), "fsdp=8": MeshConfig(fsdp=8), "expert=8": MeshConfig(fsdp=1, expert=8),
                  "fsdp=2 x expert=4": MeshConfig(fsdp=2, expert=4),
                  "fsdp=2 x expert=2 x tensor=2": MeshConfig(fsdp=2, expert=2, tensor=2)}


def batches(seed: int = 0, seq: int = SEQ) -> list[dict]:
    """STEPS stacks of [A, B, T]: two packed segments per row, a padded tail, a loss mask on about half the tokens,
    and labels a fixed function of the input token, a rule the model learns within the 10 steps."""
    rng = np.random.default_rng(seed)
    shape = (STEPS, ACCUM, ROWS, seq)
    split = seq // 2 - 3
    idx = np.arange(seq)
    segment_ids = np.where(idx < split, 1, np.where(idx < seq - 4, 2, 0)) * np.ones(shape, np.int32)
    positions = np.where(idx < split, idx, idx - split) * (segment_ids > 0)
    input_ids = rng.integers(3, CFG.vocab_size, shape, dtype=np.int32)
    data = {"input_ids": input_ids, "labels": (input_ids * 7 + 3) % CFG.vocab_size,
            "loss_mask": ((rng.random(shape) < 0.5) & (segment_ids > 0)).astype(np.float32),
            "segment_ids": segment_ids.astype(np.int32), "positions": positions.astype(np.int32)}
    return [{k: v[i] for k, v in data.items()} for i in range(STEPS)]


@functools.cache  # the same starting point for every mesh (nothing below mutates it)
def setup(method: MethodConfig):
    # one jit rather than dozens of eagerly compiled ops: CPU compile time is this test's cost
    base = jax.jit(init_params, static_argnums=0)(CFG, jax.random.key(0))
    params = jax.jit(apply_method, static_argnums=(1, 2))(base, CFG, method, jax.random.key(1))
    if method.kind in ("lora", "qlora"):  # B != 0, so every adapter leaf trains from step 1
        params["layers"] = {name: ({**m, "lora_b": m["lora_b"] + 0.01} if isinstance(m, dict) and "lora_b" in m
                                   else m) for name, m in params["layers"].items()}
    # numpy leaves: placing them on a mesh is a plain copy (a jax array is resharded by a compiled program)
    return partition(jax.tree.map(np.asarray, params), trainable_mask(params, method))


def train(method_name: str, mesh_config: MeshConfig, devices=None, offload=OffloadConfig(), keep=False):
    """Losses of STEPS steps of the spine's run (and, with keep, the final state, frozen weights and shardings)."""
    method = METHODS[method_name]
    trainable, frozen = setup(method)
    plan = TrainPlan(method, ROWS, SEQ, ACCUM, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=mesh_config, offload=offload)
    run = abstract_run(CFG, plan, make_mesh(mesh_config, devices), TRAIN, STEPS)
    state = run.init_state(trainable, 0)
    frozen = jax.device_put(frozen, run.shardings.frozen)
    losses = []
    for batch in batches():
        state, metrics = run.step(state, frozen, None, jax.device_put(batch, run.shardings.batch))
        losses.append(float(metrics["loss"]))
    assert run.step._cache_size() == 1, "the sharded step compiled more than once"
    return (losses, state, frozen, run.shardings) if keep else losses


def frozen_bf16() -> dict:
    """LoRA over a frozen bfloat16 base, kernels gathered a piece at a time (1 KiB pieces, so every kernel is
    cut): {mesh: largest relative loss difference from one device over STEPS steps} and, per mesh, the shapes of
    the step's all-gathered 16-bit arrays and of the kernels they are pieces of, and the bytes of its largest
    array of 16-bit kernel bits that is not a whole stack [L, in, out]."""
    import re

    import ml_dtypes

    from jaxtune.models import linear
    from jaxtune.models.quant import as_bit_patterns

    linear.GATHERED_PIECE_BYTES["cpu"] = 1024
    method = METHODS["lora"]
    trainable, frozen = setup(method)
    frozen = jax.tree.map(lambda x: jax.numpy.asarray(x, ml_dtypes.bfloat16 if x.dtype == np.float32 else x.dtype),
                          frozen)

    def losses(mesh_config, devices=None):
        plan = TrainPlan(method, ROWS, SEQ, ACCUM, param_dtype="bfloat16",
                         forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=mesh_config)
        run = abstract_run(CFG, plan, make_mesh(mesh_config, devices), TRAIN, STEPS)
        state = run.init_state(trainable, 0)
        placed = jax.device_put(as_bit_patterns(frozen, head=True), run.shardings.frozen)
        out = []
        for batch in batches()[:4]:
            state, metrics = run.step(state, placed, None, jax.device_put(batch, run.shardings.batch))
            out.append(float(metrics["loss"]))
        hlo = run.step.lower(state, placed, None, jax.device_put(batches()[0], run.shardings.batch)).compile()
        text = hlo.as_text()
        gathers = re.findall(r"= (?:u16|bf16)\[(\d+),(\d+)\][^ ]* all-gather\(", text)
        slices = [[int(d) for d in dims.split(",")] for dims in re.findall(r"u16\[([\d,]+)\]", text)]
        # not a stack, nor the embedding table's and head's shards (held as bits under float32 compute), nor the
        # token embeddings gathered from them (the micro-batch's, a device's row's)
        head, tokens = CFG.vocab_size * CFG.hidden_size // 8, ROWS * SEQ * CFG.hidden_size
        slices = [dims for dims in slices if not (len(dims) == 3 and dims[0] == CFG.num_layers)
                  and math.prod(dims) not in (head, tokens, tokens // ROWS)]
        return out, sorted({(int(a), int(b)) for a, b in gathers}), max(2 * math.prod(dims) for dims in slices)

    reference, *_ = losses(MeshConfig(fsdp=1), jax.devices()[:1])
    out = {"kernels": sorted({tuple(m["kernel"].shape[1:]) for m in frozen["layers"].values()
                              if isinstance(m, dict) and "kernel" in m})}
    for mesh in ("fsdp=8", "fsdp=4 x tensor=2"):
        mesh_losses, gathers, largest_slice = losses(MESHES[mesh])
        out[mesh] = relative_diff(mesh_losses, reference)
        out[mesh + " gathers"] = gathers
        out[mesh + " largest bits slice"] = largest_slice
    return out


def relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run(method: str) -> dict:
    """One method: the single-device losses, every mesh's largest relative loss difference, and extras."""
    reference = train(method, MeshConfig(fsdp=1), jax.devices()[:1])
    out = {"single": reference}
    for mesh, config in MESHES.items():
        losses, state, frozen, shardings = train(method, config, keep=True)
        out[mesh] = relative_diff(losses, reference)
        if mesh == "fsdp=8":
            fsdp8_losses = losses
            for part, tree in (("params", state["params"]), ("opt_state", state["opt_state"]), ("frozen", frozen)):
                held = bytes_per_device(tree)
                out[f"{part}_bytes"] = {
                    "total": total_bytes(tree), "per_device": sorted(set(held.values())), "devices": len(held),
                    "replicated": total_bytes([x for x in jax.tree.leaves(tree) if x.sharding.is_fully_replicated])}
        if mesh == "fsdp=4 x tensor=2":
            q_proj = shardings.params["layers"]["q_proj"]
            out["specs"] = {name: str(jax.tree.map(lambda s: tuple(s.spec), q_proj[name])) for name in q_proj}
    if method == "lora":  # bfloat16 moments against float32 moments, same mesh and batches
        losses, state, _, _ = train(method, MeshConfig(fsdp=8), offload=OffloadConfig(moments_dtype="bfloat16"),
                                    keep=True)
        out["bf16_moments"] = {"losses": losses, "fp32_losses": fsdp8_losses,
                               "relative_diff": relative_diff(losses, fsdp8_losses),
                               "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(state["opt_state"])})}
    return out


def two_slices() -> dict:
    """LoRA on a 2-slice hybrid mesh (data over the slices, fsdp x tensor within each): its losses' largest relative
    difference from one device's (and the first step's), and the device ids in each slice's block of the data axis."""
    hybrid = MeshConfig(data=2, fsdp=2, tensor=2, slices=2)
    losses, reference = train("lora", hybrid), train("lora", MeshConfig(fsdp=1), jax.devices()[:1])
    grid = make_mesh(hybrid).devices
    return {"first_step": relative_diff(losses[:1], reference[:1]), "all_steps": relative_diff(losses, reference),
            "blocks": [sorted(d.id for d in grid[i].flat) for i in range(2)]}


def loop(config: str, overrides: list[str]) -> dict:
    """`fine_tune` as `jaxtune train CONFIG --set ...` runs it on this process's 8 devices: its metrics records."""
    from jaxtune.run_config import load_run_config
    from jaxtune.train.loop import fine_tune

    result = fine_tune(load_run_config(config, overrides), log=lambda *_: None)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return {"records": [json.loads(line) for line in lines], "result": str(result.result_path)}


def planner() -> dict:
    """{mesh: (the planner's per-device bytes, XLA's compiled bytes of the sharded step)} for a small Llama on each
    mesh, nothing allocated (`jaxtune.planner.compile_step` from ShapeDtypeStructs)."""
    from shapes import SMALL

    from jaxtune.config.plan import TrainPlan
    from jaxtune.planner import compile_step, estimate, get_device

    cfg = SMALL
    plans = {
        "fsdp=8": TrainPlan(method_config("full"), 16, 128, 1, param_dtype="float32",
                            forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MESHES["fsdp=8"]),
        "data=8": TrainPlan(METHODS["lora"], 16, 128, 1, param_dtype="float32",
                            forward=ForwardOptions(compute_dtype="float32", remat="full"), mesh=MESHES["data=8"]),
        "data=2 x fsdp=4": TrainPlan(method_config("full"), 16, 128, 1, param_dtype="float32",
                                     forward=ForwardOptions(compute_dtype="float32", remat="save_matmuls"),
                                     mesh=MESHES["data=2 x fsdp=4"]),
        "fsdp=4 x tensor=2": TrainPlan(METHODS["qlora"], 16, 128, 1, param_dtype="float32",
                                       forward=ForwardOptions(compute_dtype="float32", remat="none"),
                                       mesh=MESHES["fsdp=4 x tensor=2"]),
        "dpo, fsdp=8": TrainPlan(METHODS["lora"], 8, 128, 1, param_dtype="float32",
                                 forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MESHES["fsdp=8"],
                                 objective="dpo"),
    }
    return {name: (estimate(cfg, plan, get_device("cpu-8")).compiled_bytes, compile_step(cfg, plan).total_bytes)
            for name, plan in plans.items()}


def eval_rows() -> dict:
    """{mesh: the largest [rows, T, columns] float32 buffer of the compiled sharded eval step of an 8-row batch,
    in rows' worth of logits (rows x columns / V); mesh + " whole head": whether the step's body holds an array of
    the head's full shape}."""
    import re

    from jaxtune.methods.transform import combine

    method, cfg = method_config("full"), CFG
    trainable, frozen = setup(method)
    params = combine(trainable, frozen)
    T = 32
    batch = {k: np.zeros((8, T), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
    rows = {}
    for name in ("fsdp=8", "data=8"):
        plan = TrainPlan(method, 8, T, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MESHES[name])
        run = abstract_run(cfg, plan, make_mesh(MESHES[name]), TRAIN, STEPS)
        hlo = run.eval_step.lower(jax.device_put(params, run.shardings.params), None, batch).compile().as_text()
        shapes = re.findall(rf"f32\[(\d+),{T},(\d+)\]", hlo)
        V, D = cfg.vocab_size, cfg.hidden_size
        rows[name] = max(int(r) * int(v) for r, v in shapes) / V
        entry = hlo.split("ENTRY")[-1].split("\n", 1)[1]
        rows[name + " whole head"] = bool(re.search(rf"\[({V},{D}|{D},{V})\]", entry))
    return rows


def decode_rows() -> dict:
    """{mesh: the per-device shapes of a rollout's cache keys [L, B, K, S, hd] and new tokens [B, N]} for 16 prompts
    decoded under the mesh (as a run's batch function is called), and whether the tokens equal one device's."""
    from jaxtune.config import SamplingConfig
    from jaxtune.generation import generate
    from jaxtune.methods.transform import combine
    from jaxtune.spine.run import traced_on

    method = METHODS["lora"]
    trainable, frozen = setup(method)
    params = combine(trainable, frozen)
    prompts = [[1 + (3 * i + j) % 200 for j in range(2 + i % 5)] for i in range(16)]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3)
    one = generate(params, CFG, prompts, sampling, method=method)
    out = {}
    for name in ("fsdp=8", "fsdp=4 x tensor=2"):
        mesh = make_mesh(MESHES[name])
        plan = TrainPlan(method, 8, SEQ, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MESHES[name])
        run = abstract_run(CFG, plan, mesh, TRAIN, STEPS)
        placed = jax.device_put(params, run.shardings.params)
        seen = {}
        real_begin = generation.begin

        def begin(*args, **kwargs):
            state = real_begin(*args, **kwargs)
            seen["k"] = state.cache.k.addressable_shards[0].data.shape
            seen["out"] = state.out_BxN.addressable_shards[0].data.shape
            return state

        generation.begin = begin
        try:
            with traced_on(mesh):
                split = generate(placed, CFG, prompts, sampling, method=method)
        finally:
            generation.begin = real_begin
        out[name] = {"cache": list(seen["k"]), "tokens": list(seen["out"]), "equal": split == one}
    return out


def engine_rows() -> dict:
    """{mesh: the per-device shapes of the rollout engine's page pool [L, NP, ps, K, hd] and slot tables [S, M], the
    all-gathers of a pool-sized array in its compiled program, and whether its greedy tokens (5 prompts of mixed
    lengths, groups of 3, mixed limits, 8 slots) equal one device's} for the LoRA policy placed in the run's
    shardings and sampled under the mesh, as GRPO's batch function runs."""
    import re

    from jaxtune.config import SamplingConfig
    from jaxtune.methods.transform import combine
    from jaxtune.rollouts import PagePool, engine, sample_groups
    from jaxtune.spine.run import traced_on

    method = METHODS["lora"]
    trainable, frozen = setup(method)
    params = combine(trainable, frozen)
    prompts = [[1 + (5 * i + j) % 200 for j in range(n)] for i, n in enumerate((3, 11, 5, 17, 8))]
    limits = [2 + (7 * i) % 11 for i in range(15)]
    greedy, pool = SamplingConfig(max_new_tokens=12), PagePool(slots=8, page_size=4)
    args = dict(pool=pool, eos_ids=(), method=method, max_new_tokens_of_sample=limits)
    one = sample_groups(params, CFG, prompts, 3, greedy, **args)
    out = {}
    # data=4 x fsdp=2: fsdp divides the 2 KV heads, which the rules' fallback would split (the slots are split there)
    meshes = {"fsdp=8": MESHES["fsdp=8"], "fsdp=4 x tensor=2": MESHES["fsdp=4 x tensor=2"],
              "data=4 x fsdp=2": MeshConfig(data=4, fsdp=2)}
    for name, config in meshes.items():
        mesh = make_mesh(config)
        plan = TrainPlan(method, 8, SEQ, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=config)
        placed = jax.device_put(params, abstract_run(CFG, plan, mesh, TRAIN, STEPS).shardings.params)
        seen = {}
        real_run = engine.run

        def run(*a, **kw):
            state = real_run(*a, **kw)
            seen["pool"] = state.k.addressable_shards[0].data.shape
            seen["tables"] = state.table_SxM.addressable_shards[0].data.shape
            L, NP, ps = state.k.shape[:3]  # the pool never all-gathered: each step gathers its new keys and values
            text = real_run.lower(*a, **kw).compile().as_text()
            seen["pool gathers"] = len(re.findall(rf"= f32\[{L},{NP},{ps},[^ ]* all-gather\(", text))
            return state

        engine.run = run
        try:
            with traced_on(mesh):  # stop strings' path too (start, then advance in chunks)
                split = sample_groups(placed, CFG, prompts, 3, greedy, **args)
                chunked = sample_groups(placed, CFG, prompts, 3, greedy, **args, stop_when=lambda *_: False,
                                        chunk_steps=4)
        finally:
            engine.run = real_run
        out[name] = {"pool": list(seen["pool"]), "tables": list(seen["tables"]), "pool gathers": seen["pool gathers"],
                     "equal": split.tokens == one.tokens,
                     "chunked equal": chunked.tokens == one.tokens, "free": split.free_pages == one.num_pages,
                     "params still split": not any(x.sharding.is_fully_replicated for x in
                                                   jax.tree.leaves(placed["layers"]["q_proj"]))}
    return out


def load(model_dir: str, method_name: str) -> dict:
    """`spine.load.load_run` of a checkpoint onto fsdp=8: every array alive while reading (snapshot at each read)
    and after, as per-device shard shapes, against the parameters' full shapes; and the bytes read."""
    from jaxtune.io.safetensors import CheckpointReader
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.params import logical_axes
    from jaxtune.spine.load import load_run

    cfg = load_config(model_dir)
    full = {tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))}
    full |= {tuple(s[1:]) for s in full if len(s) == 3}  # one layer of a stacked kernel, whole, counts too
    seen = []

    def snapshot():
        for x in jax.live_arrays():
            seen.extend((tuple(s.data.shape), len(x.sharding.device_set)) for s in x.addressable_shards)

    read = CheckpointReader.read

    def spying_read(self, name, index=None):
        snapshot()
        return read(self, name, index)

    plan = TrainPlan(METHODS[method_name], 8, SEQ, 1, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MESHES["fsdp=8"])
    run = abstract_run(cfg, plan, make_mesh(MESHES["fsdp=8"]), TRAIN, STEPS)
    before = CheckpointReader.total_bytes_read
    CheckpointReader.read = spying_read
    try:
        state, frozen, _ = load_run(run, model_dir, 0)
        jax.block_until_ready((state, frozen))
    finally:
        CheckpointReader.read = read
    during = sorted({shape for shape, _ in seen if shape in full})
    snapshots = len(seen)
    seen.clear()
    snapshot()
    after = sorted({shape for shape, _ in seen if shape in full})
    frozen_shards = sorted({tuple(s.data.shape) for x in jax.tree.leaves(frozen) for s in x.addressable_shards})
    return {"during": during, "after": after, "shards_seen_while_reading": snapshots,
            "frozen_shard_shapes": frozen_shards,
            "bytes_read": CheckpointReader.total_bytes_read - before,
            "axes": str(jax.tree.map(lambda a: a, logical_axes(cfg))["layers"]["q_proj"])}


def tiny_run(arch: str, method: MethodConfig, **overrides):
    """(config, trainable, frozen) of a tiny `arch` under `method`, every LoRA B nonzero: adapters train from step 1."""
    cfg = tiny_model_config(arch, vocab_size=CFG.vocab_size, initializer_range=0.1, **overrides)
    trainable, frozen = init_run(cfg, method)
    trainable = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.01 if jax.tree_util.keystr(path).endswith("['lora_b']") else x, trainable)
    return cfg, *(jax.tree.map(np.asarray, t) for t in (trainable, frozen))


def four_steps(cfg, method: MethodConfig, mesh_config: MeshConfig, trainable, frozen) -> tuple[list[float], dict]:
    """The losses of 4 steps of the spine's run on `mesh_config` (one device where it has one), and the final state."""
    plan = TrainPlan(method, ROWS, SEQ, ACCUM, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=mesh_config)
    single = mesh_config.data * mesh_config.fsdp * mesh_config.expert * mesh_config.tensor == 1
    run = abstract_run(cfg, plan, make_mesh(mesh_config, jax.devices()[:1] if single else None), TRAIN, STEPS)
    state, placed = run.init_state(trainable, 0), jax.device_put(frozen, run.shardings.frozen)
    losses = []
    for batch in batches()[:4]:
        state, metrics = run.step(state, placed, None, jax.device_put(batch, run.shardings.batch))
        losses.append(float(metrics["loss"]))
    return losses, state


def families() -> dict:
    """LoRA on every linear module of a tiny Gemma 2, Gemma 3 and Phi-3 (fused projections, sandwich norms, q/k
    norms): {arch: {mesh: largest relative loss difference from one device over 4 steps}}."""
    out = {}
    for arch in ("gemma2", "gemma3", "phi3"):
        cfg, trainable, frozen = tiny_run(arch, METHODS["lora"])
        losses = {mesh: four_steps(cfg, METHODS["lora"], config, trainable, frozen)[0]
                  for mesh, config in (("one", MeshConfig(fsdp=1)), ("fsdp=8", MESHES["fsdp=8"]),
                                       ("fsdp=4 x tensor=2", MESHES["fsdp=4 x tensor=2"]))}
        out[arch] = {mesh: relative_diff(losses[mesh], losses["one"]) for mesh in losses if mesh != "one"}
        out[arch]["loss fell"] = losses["one"][-1] < losses["one"][0]
    return out


def splash() -> dict:
    """LoRA on a tiny Gemma 2 (sliding and full layers, soft-capped scores), 128-token packed rows: the losses of
    3 steps with splash attention (Pallas' interpreter) on one device and on fsdp=4 x tensor=2 (the kernel under
    `shard_map`), each against the blockwise kernel on one device: {run: largest relative difference}, and under
    "traced" each splash run's traces of the kernel as [calls, calls on a mesh]."""
    from jaxtune.models.kernels import splash as unit
    from jaxtune.parallel.rules import mesh_in_context

    traced = {}
    kernel = unit.splash_attention

    def counted(*args, **kwargs):
        traced[name][0] += 1
        traced[name][1] += mesh_in_context() is not None
        return kernel(*args, **kwargs)

    unit.splash_attention = counted  # this worker serves the module's other checks: put back below

    cfg = tiny_model_config("gemma2", vocab_size=CFG.vocab_size, initializer_range=0.1)
    method = METHODS["lora"]
    base = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    params = jax.jit(apply_method, static_argnums=(1, 2))(base, cfg, method, jax.random.key(1))
    trainable, frozen = partition(jax.tree.map(np.asarray, params), trainable_mask(params, method))
    losses = {}
    for name, attention, config in (("blockwise", "blockwise", MeshConfig(fsdp=1)),
                                    ("splash", "splash", MeshConfig(fsdp=1)),
                                    ("splash fsdp=4 x tensor=2", "splash", MESHES["fsdp=4 x tensor=2"])):
        plan = TrainPlan(method, ROWS, 128, ACCUM, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="none", attention=attention),
                         mesh=config)
        devices = jax.devices()[:1] if config.fsdp == 1 else None
        run = abstract_run(cfg, plan, make_mesh(config, devices), TRAIN, STEPS)
        state, placed = run.init_state(trainable, 0), jax.device_put(frozen, run.shardings.frozen)
        losses[name], traced[name] = [], [0, 0]
        for batch in batches(seq=128)[:3]:
            state, metrics = run.step(state, placed, None, jax.device_put(batch, run.shardings.batch))
            losses[name].append(float(metrics["loss"]))
    unit.splash_attention = kernel
    out = {name: relative_diff(losses[name], losses["blockwise"]) for name in losses if name != "blockwise"}
    return {**out, "traced": traced}


def mixtures() -> dict:
    """Tiny mixtures of experts with their load-balancing loss on: a full fine-tune of a Mixtral and a Qwen3-MoE
    (the experts train), LoRA on the attention, shared expert and experts of a Qwen2-MoE, on meshes with an expert
    axis:
    {arch: {mesh: largest relative loss difference from one device over 4 steps}}."""
    out = {}
    for arch, method in MIXTURES:
        cfg, trainable, frozen = tiny_run(arch, method, output_router_logits=True, router_aux_loss_coef=0.1)
        losses = {}
        for mesh in ("one", "fsdp=2 x expert=4", "fsdp=2 x expert=2 x tensor=2"):
            losses[mesh], state = four_steps(cfg, method, MIXTURE_MESHES[mesh], trainable, frozen)
            if mesh == "fsdp=2 x expert=4":
                experts = state["params"]["layers"]["experts"]["down_proj"]
                leaf = experts["kernel" if method.kind == "full" else "lora_a"]
                out.setdefault("expert shards", str(leaf.sharding.spec))
        out[arch] = {mesh: relative_diff(losses[mesh], losses["one"]) for mesh in losses if mesh != "one"}
        if method.kind == "full":  # (4 steps of LoRA on a Qwen2-MoE's attention and shared expert move it little)
            out[arch]["loss fell"] = losses["one"][-1] < losses["one"][0]
    return out


def megablox() -> dict:
    """The TPU grouped matmul (megablox, in Pallas' interpreter) in place of ragged_dot, 4 steps against ragged_dot
    on one device: a full fine-tune of a tiny Mixtral (every expert's kernels train: gmm's and tgmm's backward) on
    one device, fsdp=2 x expert=4 (rows gathered over the expert axis, local experts, partial sums reduce-scattered)
    and fsdp=2 x expert=2 x tensor=2 (each device half of every expert's hidden units); LoRA on a Qwen2-MoE's experts
    on fsdp=8 (every device every expert) and expert=8; a Qwen3-MoE's full fine-tune on expert=8:
    {arch: {mesh: largest relative loss difference}}."""
    from jaxtune.models import moe

    meshes = {"mixtral": ("one", "fsdp=2 x expert=4", "fsdp=2 x expert=2 x tensor=2"),
              "qwen2_moe": ("fsdp=8", "expert=8"), "qwen3_moe": ("expert=8",)}
    out = {}
    for arch, method in MIXTURES:
        cfg, trainable, frozen = tiny_run(arch, method, output_router_logits=True, router_aux_loss_coef=0.1)
        ragged = four_steps(cfg, method, MIXTURE_MESHES["one"], trainable, frozen)[0]
        chosen, moe.expert_platform = moe.expert_platform, lambda: ("tpu", True)
        try:
            out[arch] = {mesh: relative_diff(four_steps(cfg, method, MIXTURE_MESHES[mesh], trainable, frozen)[0],
                                             ragged) for mesh in meshes[arch]}
        finally:
            moe.expert_platform = chosen
    return out


def dispatch(args: list[str]) -> dict:
    """One request: a method's name, or a check's name and its arguments."""
    assert jax.device_count() == 8, jax.devices()
    checks = {"load": load, "frozen_bf16": frozen_bf16, "eval": eval_rows, "loop": lambda c, *o: loop(c, list(o)),
              "planner": planner, "megablox": megablox, "families": families, "splash": splash, "mixtures": mixtures,
              "decode_rows": decode_rows, "engine_rows": engine_rows, "two_slices": two_slices}
    return checks[args[0]](*args[1:]) if args[0] in checks else run(args[0])


if __name__ == "__main__":
    serve(dispatch)
