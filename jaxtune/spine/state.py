"""The train state (`init_state`) and what every optimiser shares: the schedule, the weight-decay mask and global-norm
clipping (the optimisers: `optimizers.make_optimizer`).

The state is a plain dict pytree, so orbax saves and restores it as it is:

    {"step": int32, "params": trainable tree (None where frozen), "opt_state": optax state,
     "rng": uint32[2], "skipped": int32 (non-finite steps so far), "bad_streak": int32 (in a row)}
Frozen weights (and an objective's second model) are separate arguments of the step: never donated, never
differentiated, never checkpointed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtune.config import TrainConfig
from jaxtune.models.params import BUFFERS, is_norm


def learning_rate_schedule(train: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine / linear decay to min_lr_ratio * lr at `total_steps`, or constant."""
    lr, warmup = train.learning_rate, min(train.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    if train.schedule == "cosine":
        decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=train.min_lr_ratio)
    elif train.schedule == "linear":
        decay = optax.linear_schedule(lr, lr * train.min_lr_ratio, decay_steps)
    else:
        decay = optax.constant_schedule(lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def weight_decay_mask(trainable: dict) -> dict:
    """False for norm scales and biases (names containing "bias", a LoRA bias too, as transformers' Trainer and
    PEFT's LoRA+ groups decide) and for transformers' buffers (`params.BUFFERS`: no gradient, no decay), True for
    every other trainable leaf."""

    def decays(path, _) -> bool:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return not ("bias" in names[-1] or any(is_norm(n) or n in BUFFERS for n in names))

    return jax.tree_util.tree_map_with_path(decays, trainable)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm's result (gradients times max_norm / norm when the norm exceeds max_norm; the same
    empty state, so checkpoints are unchanged) as one scalar factor that XLA fuses into AdamW's moment updates,
    where optax's select between the gradients and a divided copy made XLA:CPU write that copy out whole."""

    def update(gradients, state, params=None):
        del params
        norm = optax.tree.norm(gradients)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), gradients), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def init_state(trainable: dict, optimizer: optax.GradientTransformation, seed: int) -> dict:
    """Step 0: float32 master copies of the trainable leaves and a fresh optimiser state."""
    params = jax.tree.map(lambda x: x.astype(jnp.float32), trainable)
    zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state is donated leaf by leaf
    return {"step": zero(), "params": params, "opt_state": optimizer.init(params),
            "rng": jax.random.PRNGKey(seed), "skipped": zero(), "bad_streak": zero()}
