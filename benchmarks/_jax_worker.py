"""One jaxtune configuration, measured in this process: the library's own jitted train step, nothing re-written.

A random model from `init_params`, the method applied with `apply_method`, `partition` into trainable and frozen,
and the spine's step (`spine.run.abstract_run(...).step`: global-norm clipping + AdamW, grad_accum 1), as
`jaxtune train` runs it. Compile time is `step.lower(...).compile()`, timed explicitly, so no step includes
compilation.
"""

from __future__ import annotations

import time

import _measure as M


def model_and_batch(name: str, shape: dict | None = None, batch: int | None = None, seq: int | None = None) -> tuple:
    """(cfg, plan, train config, trainable, frozen, batch) of configuration `name`: a random model of `shape` from
    `init_params` with the method applied and partitioned, and the fixed batch ([A=1, batch, seq]: loss on every
    token, one segment per row); the benchmark's SHAPE, BATCH and SEQ as they are when called, unless given."""
    import jax
    import numpy as np

    from jaxtune.config import ForwardOptions, ModelConfig, TrainConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods.transform import apply_method, partition, trainable_mask
    from jaxtune.models.params import init_params

    shape, batch, seq = shape or M.SHAPE, batch or M.BATCH, seq or M.SEQ
    cfg = ModelConfig(**shape, max_position_embeddings=M.MAX_POSITIONS)
    method = M.method(name)
    key = jax.random.key(0)
    params = apply_method(init_params(cfg, key), cfg, method, jax.random.fold_in(key, 1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    tc = TrainConfig(learning_rate=M.LEARNING_RATE, schedule="constant", max_grad_norm=M.MAX_GRAD_NORM)
    plan = TrainPlan(method, batch, seq, 1, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype=M.COMPUTE_DTYPE.get(name, "float32"), remat=M.REMAT))
    tokens = M.fixed_tokens(batch=batch, seq=seq, vocab=shape["vocab_size"])
    ones = np.ones((batch, seq), np.int32)
    arrays = {
        "input_ids": tokens[None, :, :-1], "labels": tokens[None, :, 1:], "loss_mask": ones[None].astype(np.float32),
        "segment_ids": ones[None], "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ones.shape)[None],
    }
    return cfg, plan, tc, trainable, frozen, jax.device_put(arrays)


def run(name: str, warmup: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxtune.config import MeshConfig
    from jaxtune.host_memory import release_after_compiles, return_large_blocks
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.spine.run import abstract_run

    release_after_compiles()  # the host memory settings `jaxtune train` runs with (train/loop.start_run)
    return_large_blocks()
    cfg, plan, tc, trainable, frozen, batch = model_and_batch(name)
    run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]), tc, warmup + steps)
    state = run.init_state(trainable, seed=0)
    del trainable  # for a full fine-tune the state's params are these buffers, and the state is donated
    jax.block_until_ready((state, frozen, batch))
    baseline = M.rss_mib()
    M.reset_peak_rss()

    t0 = time.perf_counter()
    compiled = run.step.lower(state, frozen, None, batch).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()

    holder = {"state": state}
    del state
    losses = []

    def step():
        holder["state"], metrics = compiled(holder["state"], frozen, None, batch)
        losses.append(metrics["loss"])
        jax.block_until_ready(holder["state"])

    timing = M.time_steps(step, warmup, steps)
    losses = [float(x) for x in losses]
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(frozen))
    return {
        "framework": "jax", "config": name, "variant": "jaxtune", "compile_s": compile_s, **timing,
        "baseline_rss_mib": baseline, "train_peak_rss_mib": M.window_peak_rss_mib(), "peak_rss_mib": M.peak_rss_mib(),
        "xla_temp_mib": memory.temp_size_in_bytes / 2**20, "xla_argument_mib": memory.argument_size_in_bytes / 2**20,
        "xla_output_mib": memory.output_size_in_bytes / 2**20, "xla_alias_mib": memory.alias_size_in_bytes / 2**20,
        "frozen_mib": frozen_bytes / 2**20, "loss_first": losses[0], "loss_last": losses[-1],
        "jax_version": jax.__version__, "float_dtype": str(jnp.result_type(float)),
    }
