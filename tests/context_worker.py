"""Context parallelism on 8 fake CPU devices, run by tests/test_context_parallel.py in a process that serves the
module's calls (tests/eight_devices.py; XLA fixes the number of host devices when jax is first imported), or once:

    python tests/context_worker.py gradients CASE   # loss and gradients on context meshes against one device
    python tests/context_worker.py objectives       # 3 spine steps of every objective on context=4 x fsdp=2
    python tests/context_worker.py layout           # the load-balanced layout: who holds what, and its round trip
    python tests/context_worker.py memory           # compiled temporaries a device at 32k tokens, context 1 and 8
    python tests/context_worker.py flops            # program FLOPs of a causal and a sliding-window step
    python tests/context_worker.py splash           # the ring with splash as its per-block kernel (interpreted)
    python tests/context_worker.py sinks            # context attention with attention sinks against one device

Gradients are of SFT's mean loss over a packed, padded micro-batch (spine.update.accumulate), the parameters sharded
as the trainer shards them (ZeRO-3 over fsdp x context), float32; differences are each leaf's largest absolute one
over its largest magnitude.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from eight_devices import serve

from jaxtune.config import ForwardOptions, MeshConfig, TrainConfig, tiny_config
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.models.attention import blockwise_attention, training_mask
from jaxtune.models.context_attention import (
    ContextLayout,
    balanced_order,
    context_attention,
    context_layout,
    gather_outputs,
    to_layout,
)
from jaxtune.objectives import objective_named
from jaxtune.objectives.distill import DistillConfig
from jaxtune.objectives.dpo import PreferenceConfig
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.parallel import make_mesh
from jaxtune.parallel.rules import constrain
from jaxtune.planner.program_flops import step_flops
from jaxtune.presets import tiny_model_config
from jaxtune.spine.run import abstract_run, init_run, traced_on
from jaxtune.spine.shardings import batch_sharding, param_shardings

sys.path.insert(0, os.path.dirname(__file__))
from steps import sft_gradients  # noqa: E402

LORA = method_config("lora", rank=4, target_modules=("all-linear",))
MESHES = {"context=8": MeshConfig(fsdp=1, context=8), "context=4 x fsdp=2": MeshConfig(fsdp=2, context=4),
          "context=2 x fsdp=2 x tensor=2": MeshConfig(fsdp=2, context=2, tensor=2)}
MIXTURE_MESH = {"context=2 x expert=2 x tensor=2": MeshConfig(fsdp=1, expert=2, context=2, tensor=2)}
# case: (model, method, rows, tokens, packed, tiled MLP tile)
CASES = {
    "causal": (tiny_config(initializer_range=0.1), method_config("full"), 2, 64, False, 0),
    "packed": (tiny_config(initializer_range=0.1), LORA, 2, 64, True, 0),
    "sliding": (tiny_model_config("mistral", initializer_range=0.1), LORA, 2, 256, True, 0),
    "gemma2": (tiny_model_config("gemma2", initializer_range=0.1), LORA, 2, 128, True, 0),
    "prefix": (tiny_config(initializer_range=0.1), method_config("prefix", num_virtual_tokens=4), 2, 64, True, 0),
    "tiled": (tiny_config(initializer_range=0.1), LORA, 2, 64, True, 8),
    "qlora": (tiny_config(initializer_range=0.1), method_config("qlora", rank=4, target_modules=("all-linear",), bits=4,
                                                               double_quant=True), 2, 64, True, 0),
    "ia3": (tiny_config(initializer_range=0.1), method_config("ia3"), 2, 64, True, 0),
    "mixture": (tiny_model_config("qwen2_moe", initializer_range=0.1), method_config("full"), 2, 64, True, 8),
}


def splash() -> dict:
    """{mesh: [relative loss difference, largest relative gradient difference]} of the ring with splash as its
    per-block kernel (`attention = "splash"`, Pallas' interpreter off TPU) against one device's blockwise kernel:
    packed rows of 1,024 tokens (chunks of 128 and 256: splash's blocks), GQA, LoRA on every linear layer; and
    whether the context step's program holds Pallas calls."""
    cfg = tiny_config(initializer_range=0.1)
    trainable, frozen = init_run(cfg, LORA)
    trainable = rows_trained(trainable)
    batch = packed_batch(cfg, 2, 1024, True)
    loss, grads = loss_and_grads(cfg, LORA, trainable, frozen, batch, MeshConfig(fsdp=1), ForwardOptions())
    options = ForwardOptions(attention="splash", context_attention="ring")
    out = {}
    for name in ("context=4 x fsdp=2", "context=2 x fsdp=2 x tensor=2"):
        mesh_config = MESHES[name]
        split_loss, split_grads = loss_and_grads(cfg, LORA, trainable, frozen, batch, mesh_config, options)
        out[name] = [abs(split_loss - loss) / abs(loss), largest_difference(split_grads, grads)]
    mesh = make_mesh(MESHES["context=4 x fsdp=2"])
    with traced_on(mesh):
        text = str(jax.make_jaxpr(lambda t, f, b: sft_gradients(t, f, b, cfg, LORA, options)[::2])(
            trainable, frozen, jax.tree.map(np.asarray, batch)))
    out["pallas calls"] = text.count("pallas_call")
    return out


def packed_batch(cfg, rows: int, T: int, packed: bool, seed: int = 0, accum: int = 1) -> dict:
    """[accum, rows, T] SFT arrays: two segments a row and a padded tail when packed, a loss mask on half the
    tokens."""
    rng = np.random.default_rng(seed)
    shape, idx = (accum, rows, T), np.arange(T)
    split = T // 2 - 3
    segments = np.where(idx < split, 1, np.where(idx < T - 4, 2, 0)) if packed else np.ones(T, int)
    positions = (np.where(idx < split, idx, idx - split) if packed else idx) * (segments > 0)
    ids = rng.integers(3, cfg.vocab_size, shape, dtype=np.int32)
    return {"input_ids": ids, "labels": rng.integers(0, cfg.vocab_size, shape, dtype=np.int32),
            "loss_mask": ((rng.random(shape) < 0.5) & (segments > 0)).astype(np.float32),
            "segment_ids": np.broadcast_to(segments, shape).astype(np.int32),
            "positions": np.broadcast_to(positions, shape).astype(np.int32)}


def rows_trained(trainable):
    """Every LoRA B moved off zero, so adapters have gradients from the start."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.01 if jax.tree_util.keystr(path).endswith("['lora_b']") else x, trainable)


def loss_and_grads(cfg, method, trainable, frozen, batch, mesh_config: MeshConfig, options: ForwardOptions):
    single = mesh_config.context * mesh_config.fsdp * mesh_config.tensor * mesh_config.expert == 1
    mesh = make_mesh(mesh_config, jax.devices()[:1] if single else None)
    placed = [jax.device_put(tree, param_shardings(tree, cfg, mesh)) for tree in (trainable, frozen)]
    rows = batch_sharding(mesh, batch["input_ids"].shape[1])
    with traced_on(mesh):
        fn = jax.jit(lambda t, f, b: sft_gradients(t, f, b, cfg, method, options)[::2])
        loss, grads = fn(*placed, jax.device_put(batch, rows))
    return float(loss), jax.tree.map(np.asarray, grads)


def largest_difference(grads, reference) -> float:
    return max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
               for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))


def gradients(case: str) -> dict:
    """{"strategy mesh": [relative loss difference, largest relative gradient difference]} against one device."""
    cfg, method, rows, T, packed, tile = CASES[case]
    trainable, frozen = init_run(cfg, method)
    trainable = rows_trained(trainable)
    batch = packed_batch(cfg, rows, T, packed)
    loss, grads = loss_and_grads(cfg, method, trainable, frozen, batch, MeshConfig(fsdp=1), ForwardOptions())
    out = {}
    for strategy in ("ring", "all_gather"):
        options = ForwardOptions(context_attention=strategy, tiled_mlp=tile)
        for name, mesh_config in {**MESHES, **(MIXTURE_MESH if case == "mixture" else {})}.items():
            split_loss, split_grads = loss_and_grads(cfg, method, trainable, frozen, batch, mesh_config, options)
            out[f"{strategy} {name}"] = [abs(split_loss - loss) / abs(loss), largest_difference(split_grads, grads)]
    return out


def objectives() -> dict:
    """{objective: largest relative loss difference over 3 spine steps, context=4 x fsdp=2 (ring) against one
    device}: each objective's own step (DPO's pairs, the reward model's head, GRPO's clipped step, distillation's
    teacher sharded like the student) on 64-token packed rows."""
    cfg, T = tiny_config(initializer_range=0.1), 64
    sections = {"sft": None, "dpo": PreferenceConfig(), "reward": None, "grpo": GRPOConfig(),
                "distill": DistillConfig(teacher="teacher")}
    train = TrainConfig(learning_rate=1e-2, batch_size=4, warmup_steps=1)
    out = {}
    for name, section in sections.items():
        objective = objective_named(name)
        trainable, frozen = init_run(cfg, LORA, objective=objective)
        trainable = rows_trained(trainable)
        teacher = None
        if name == "distill":
            teacher = jax.tree.map(np.asarray, init_run(cfg, method_config("full"), seed=5)[0])
        rows = 4 * objective.rows(section)
        steps = []
        for s in range(3):
            batch = packed_batch(cfg, rows, T, True, seed=s)
            if name == "grpo":
                rng = np.random.default_rng(s)
                batch["advantages"] = rng.normal(size=(1, rows)).astype(np.float32)
                batch["rewards"] = rng.normal(size=(1, rows)).astype(np.float32)
            steps.append(batch)
        losses = {}
        for mesh_name, mesh_config in (("one", MeshConfig(fsdp=1)), ("context", MeshConfig(fsdp=2, context=4))):
            plan = TrainPlan(LORA, 4, T, 1, param_dtype="float32",
                             forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=mesh_config,
                             objective=name, section=section)
            single = mesh_name == "one"
            run = abstract_run(cfg, plan, make_mesh(mesh_config, jax.devices()[:1] if single else None), train, 10)
            state = run.init_state(jax.tree.map(np.asarray, trainable), 0)
            placed = jax.device_put(jax.tree.map(np.asarray, frozen), run.shardings.frozen)
            second = None if teacher is None else jax.device_put(teacher, run.shardings.second)
            losses[mesh_name] = []
            for batch in steps:
                state, metrics = run.step(state, placed, second, jax.device_put(batch, run.shardings.batch))
                losses[mesh_name].append(float(metrics["loss"]))
        out[name] = max(abs(a - b) / abs(b) for a, b in zip(losses["context"], losses["one"]))
    return out


def layout() -> dict:
    """Where the balanced layout puts a row's chunks on context=4 (device i: chunks i and 7 - i, read from the
    shards), and whether `gather_outputs` after `to_layout` gives the row back (N=4 x fsdp=2, and N=8)."""
    out = {}
    for name, mesh_config in MESHES.items():
        mesh = make_mesh(mesh_config)
        ways = mesh_config.context
        context = ContextLayout(ways, True, "ring", ways)
        x = np.arange(2 * 16 * ways * 3, dtype=np.float32).reshape(2, 16 * ways, 3)
        with traced_on(mesh), jax.set_mesh(mesh):
            spread = jax.jit(lambda x: constrain(to_layout(x, context), ("batch", "seq", None)))(x)
            back = jax.jit(lambda y: gather_outputs(y, context, x.shape[1]))(spread)
        chunk = x.shape[1] // (2 * ways)
        held = {}
        for shard in spread.addressable_shards:
            index = mesh.devices.flatten().tolist().index(shard.device)
            device = np.unravel_index(index, mesh.devices.shape)[mesh.axis_names.index("context")]
            first = shard.data[0, ::chunk, 0] // 3  # the token index at each chunk's start
            held[int(device)] = sorted({int(t) // chunk for t in np.asarray(first) % (16 * ways)})
        out[name] = {"held": held, "round trip": bool(np.array_equal(np.asarray(back), x)),
                     "order": balanced_order(ways).tolist()}
    return out


def memory() -> dict:
    """Compiled temporaries a device (MiB) of a 4-layer LoRA step on one 32,768-token row, remat full: one device,
    and context=8 with each strategy."""
    cfg = tiny_config(num_layers=4, hidden_size=256, intermediate_size=688, num_heads=8, num_kv_heads=4, head_dim=32,
                      vocab_size=2048, max_position_embeddings=32768)
    out = {}
    for name, mesh_config, strategy in (("one", MeshConfig(fsdp=1), "ring"),
                                        ("ring", MESHES["context=8"], "ring"),
                                        ("all_gather", MESHES["context=8"], "all_gather")):
        plan = TrainPlan(LORA, 1, 32768, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="full", context_attention=strategy),
                         mesh=mesh_config)
        mesh = make_mesh(mesh_config, jax.devices()[:1] if name == "one" else None)
        run = abstract_run(cfg, plan, mesh, TrainConfig(batch_size=1), 10)
        compiled = run.step.lower(run.state, run.frozen, run.second, run.batch).compile()
        out[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return out


def flops() -> dict:
    """Program FLOPs (planner.program_flops, loops by their trip counts) of a LoRA step at 2,048 tokens on
    context=8: a causal model, and the same with every layer's window 128 tokens (its ring stops early)."""
    out = {}
    for name, windows in (("causal", 0), ("window 128", 128)):
        cfg = tiny_config(sliding_windows=(windows, windows))
        plan = TrainPlan(LORA, 1, 2048, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MESHES["context=8"])
        out[name] = step_flops(abstract_run(cfg, plan, make_mesh(MESHES["context=8"]), TrainConfig(batch_size=1), 10))
    return out


def sinks() -> dict:
    """{"strategy window mesh": [relative output difference, largest relative gradient difference (q, k, v, sinks)]}
    of `context_attention` with attention sinks [K, G] against the blockwise kernel on one device: 2 rows of 64
    tokens (row 0's first 5 padding: queries that see no key), GQA, float32; on context=4 x fsdp=2 the balanced
    ring (window 0: 4 steps) and the ring cut short (window 12, contiguous chunks: 2 steps), on context=2 x fsdp=2 x
    tensor=2 the all-gather (the sinks split with the key/value heads)."""
    B, K, G, T, hd = 2, 2, 2, 64, 8
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, K, G, T, hd), np.float32)
    k, v = rng.standard_normal((2, B, K, T, hd), np.float32)
    sinks_KxG = 2 * rng.standard_normal((K, G), np.float32)
    weights = rng.standard_normal(q.shape, np.float32)
    valid = np.ones((B, T), np.int32)
    valid[0, :5] = 0
    mask = training_mask(B, T, 0, jnp.asarray(valid), None)

    def values_and_grads(fn, weights):
        loss = lambda *a: jnp.sum(fn(*a) * weights)  # noqa: E731
        return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, k, v, sinks_KxG)

    out = {}
    for strategy, window, name in (("ring", 0, "context=4 x fsdp=2"), ("ring", 12, "context=4 x fsdp=2"),
                                   ("all_gather", 0, "context=2 x fsdp=2 x tensor=2")):
        want, want_grads = values_and_grads(lambda q, k, v, s: blockwise_attention(q, k, v, mask, window,
                                                                                   sinks_KxG=s), weights)
        mesh = make_mesh(MESHES[name])
        with traced_on(mesh), jax.set_mesh(mesh):
            layout = context_layout(T, (window,), strategy)
            spread = training_mask(B, T, 0, to_layout(jnp.asarray(valid), layout), None,
                                   to_layout(jnp.arange(T, dtype=jnp.int32), layout, axis=0))
            no_prefix = jnp.zeros((B, K, 0, hd), jnp.float32)

            def split(q, k, v, s):  # the output in the layout's order
                return context_attention(to_layout(q, layout, 3), to_layout(k, layout, 2), to_layout(v, layout, 2),
                                         no_prefix, no_prefix, spread, window, layout, scale=hd**-0.5, softcap=None,
                                         sinks_KxG=s)

            got, grads = values_and_grads(split, to_layout(jnp.asarray(weights), layout, 3))
            ordered = to_layout(want, layout, 3)
        out[f"{strategy} {window} {name}"] = [largest_difference([got], [np.asarray(ordered)]),
                                              largest_difference(grads, want_grads)]
    return out


def dispatch(args: list[str]) -> dict:
    """One request: a mode and its arguments."""
    modes = {"gradients": gradients, "objectives": objectives, "layout": layout, "memory": memory, "flops": flops,
             "splash": splash, "sinks": sinks}
    return modes[args[0]](*args[1:])


if __name__ == "__main__":
    serve(dispatch)
