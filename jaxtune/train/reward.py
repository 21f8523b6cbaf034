"""Reward models: a scalar head on the decoder, read at each sequence's last completion token, trained with the
Bradley-Terry loss on preference pairs (Ouyang et al. 2022). Pairs come as in `preference.py`: [2B, T] rows,
chosen first; the last real input position of a row holds its last completion token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.methods.transform import combine
from jaxtune.models.llama import ForwardOptions, decoder
from jaxtune.objectives import bradley_terry_loss
from jaxtune.train.update import accumulate, apply_update


def add_reward_head(params: dict, cfg: ModelConfig, key: jax.Array) -> dict:
    """`params` with `score.kernel` [D] ~ N(0, initializer_range), as transformers initialises `score.weight`."""
    kernel = cfg.initializer_range * jax.random.normal(key, (cfg.hidden_size,), jnp.float32)
    return {**params, "score": {"kernel": kernel}}


def reward_scores(params: dict, batch: dict, cfg: ModelConfig, method: MethodConfig | None,
                  options: ForwardOptions) -> jax.Array:
    """Scalar reward [rows] of each row, from the hidden state at its last real position."""
    hidden_BxTxD = decoder(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                           segment_ids_BxT=batch["segment_ids"], method=method, options=options)
    last_B = jnp.maximum(jnp.sum(batch["segment_ids"] > 0, axis=-1) - 1, 0)
    hidden_BxD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)[:, 0]
    return hidden_BxD.astype(jnp.float32) @ params["score"]["kernel"].astype(jnp.float32)


def _pair_terms(params, batch, cfg, method, options):
    scores = reward_scores(params, batch, cfg, method, options)
    B = scores.shape[0] // 2
    real = (jnp.sum(batch["loss_mask"][:B], axis=-1) > 0).astype(jnp.float32)
    losses = bradley_terry_loss(scores[:B], scores[B:])
    accuracy = (scores[:B] > scores[B:]).astype(jnp.float32)
    return jnp.sum(losses * real), (jnp.sum(real), {"accuracy": jnp.sum(accuracy * real),
                                                      "margin": jnp.sum((scores[:B] - scores[B:]) * real)})


def make_reward_step(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                     optimizer: optax.GradientTransformation, schedule: optax.Schedule):
    """The jitted `step(state, frozen, batch[A, 2B, T]) -> (state, metrics)`, state donated."""

    def step(state, frozen, batch):
        loss_fn = lambda trainable, micro: _pair_terms(combine(trainable, frozen), micro, cfg, method, options)
        loss, _, grads, metrics = accumulate(loss_fn, state["params"], batch)
        state, update_metrics = apply_update(state, grads, loss, optimizer, schedule)
        return state, {**update_metrics, **metrics, "tokens": jnp.sum(batch["segment_ids"] > 0)}

    return jax.jit(step, donate_argnums=0)


def make_reward_eval(cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions):
    """Jitted `(params, batch) -> {"loss", "pairs", "accuracy", "margin"}` sums over a pair batch."""

    def evaluate(params, batch):
        loss, (pairs, sums) = _pair_terms(params, batch, cfg, method, options)
        return {"loss": loss, "pairs": pairs, **sums}

    return jax.jit(evaluate)
