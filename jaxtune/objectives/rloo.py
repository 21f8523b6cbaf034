"""RLOO, REINFORCE leave-one-out (Ahmadian et al. 2024), as TRL 1.16's RLOOTrainer runs it (`RLOO`, its section
`RLOOConfig`); rollouts, rewards and data are GRPO's (`grpo.py`).

Each step samples `group_size` completions per prompt. A row's reward, less beta times its sequence KL to the
reference (the sum over its completion tokens of log pi - log ref, the first-order estimate: the KL goes into the
reward, not the loss), minus the mean of the other rows of its group is its advantage. The loss is PPO's clipped
ratio of whole sequences, exp(sum of token log-ratios), averaged over rows. The rewards' leave-one-out part is
computed with the rollout (`reward_advantages`); the KL's needs the policy's and the reference's log-probs, which the
step computes anyway, so it is added there (`step_advantages`; leave-one-out is linear, so the sum is TRL's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.objectives.base import Context
from jaxtune.objectives.grpo import GRPO, make_prepare, old_logps_of, policy_and_reference_logps
from jaxtune.objectives.losses import rloo_sequence_loss
from jaxtune.objectives.reward_functions import column_weights, rloo_table_advantages
from jaxtune.objectives.rollout_config import RolloutConfig


@dataclass(frozen=True)
class RLOOConfig(RolloutConfig):
    """RLOO's section: `RolloutConfig`'s keys (kl_coef defaults to TRL's beta, 0.05) and TRL 1.16 RLOOConfig's:
    normalize_advantages (over the step's batch: mean 0, std 1), reward_clip_range ([min, max], or [] for none).
    num_iterations, mask_truncated_completions and soft_punish_cache as GRPO's (`RolloutConfig`)."""

    kl_coef: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        low_high = self.reward_clip_range
        if low_high and not (len(low_high) == 2 and all(isinstance(x, (int, float)) for x in low_high)
                             and low_high[0] <= low_high[1]):
            raise ConfigError("reward_clip_range", list(low_high), "must be [min, max] with min <= max, or []")


def reward_advantages(rewards, rloo: RLOOConfig) -> np.ndarray:
    """The rewards' part of RLOO's advantages [N] of a reward table [N, K] (weighted by `reward_weights`; or rewards
    already summed [N]): the sums clipped to `reward_clip_range`, leave-one-out over the group's scored rows; NaN
    where a row has no baseline (`reward_functions.rloo_table_advantages`). Several rewards are summed as TRL's
    RLOOTrainer sums them; it has no multi_objective_aggregation."""
    return rloo_table_advantages(rewards, column_weights(rloo), rloo.group_size, rloo.reward_clip_range)


def step_advantages(advantages_B: jax.Array, kl_B: jax.Array, rloo: RLOOConfig) -> jax.Array:
    """RLOO's advantages [B] of a batch: the rewards' part [B] less kl_coef times the leave-one-out of the rows'
    sequence KL [B], normalised over the batch (std with Bessel's correction, + 1e-4) if normalize_advantages. Rows
    whose part is NaN (no baseline: no reward scored them, or no other row of their group) are left out of the KL's
    baseline and the normalisation and get 0, as TRL's NaN-aware baseline and `nan_to_num` give them."""
    valid_B = ~jnp.isnan(advantages_B)
    valid_PxG = valid_B.reshape(-1, rloo.group_size)
    kl_PxG = jnp.where(valid_PxG, kl_B.reshape(-1, rloo.group_size), 0.0)
    others_PxG = jnp.maximum(jnp.sum(valid_PxG, axis=-1, keepdims=True) - 1, 1)
    kl_loo_PxG = kl_PxG - (jnp.sum(kl_PxG, axis=-1, keepdims=True) - kl_PxG) / others_PxG
    advantages_B = jnp.where(valid_B, advantages_B - rloo.kl_coef * kl_loo_PxG.reshape(-1), 0.0)
    if rloo.normalize_advantages:
        n = jnp.sum(valid_B)
        mean = jnp.sum(advantages_B) / n
        std = jnp.sqrt(jnp.sum(jnp.where(valid_B, (advantages_B - mean) ** 2, 0.0)) / (n - 1))
        advantages_B = jnp.where(valid_B, (advantages_B - mean) / (std + 1e-4), 0.0)
    return jnp.nan_to_num(advantages_B, nan=0.0)


def loss_terms(ctx: Context):
    """RLOO's clipped sequence-ratio loss per micro-batch of rollouts (a sum over rows, counted in rows). The old
    policy and the KL in the reward are the batch's `old_logps` when it has them (num_iterations > 1: the learner's
    at sampling time, as TRL's), else this step's log-probs as constants. Metrics "kl": the rows' mean sequence KL
    sum(log pi_old - log ref), the term kl_coef scales in the reward; "entropy": the policy's mean over the
    completion tokens of the rows' token means."""
    r = ctx.section

    def terms(trainable, frozen, second, micro, key=None):
        logp, ref_logp, entropy = policy_and_reference_logps(ctx, trainable, frozen, second, micro, key)
        mask = micro["loss_mask"].astype(jnp.float32)
        old = old_logps_of(micro, logp)
        kl_B = jax.lax.stop_gradient(jnp.sum((old - ref_logp) * mask, -1))
        advantages = step_advantages(micro["advantages"], kl_B, r)
        total, rows = rloo_sequence_loss(logp, old, advantages, mask, r.clip, r.clip_high)
        entropy_B = jnp.sum(entropy * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
        return total, (rows, {"kl": jnp.sum(kl_B), "entropy": jnp.sum(entropy_B)})

    return terms


def _prepare(setup):
    """GRPO's data with RLOO's advantages; normalising over the step's batch needs the batch in one micro-batch."""
    if setup.section.normalize_advantages and setup.config.train.grad_accum > 1:
        raise JaxtuneError(f"[rloo] normalize_advantages = true with [train] grad_accum = "
                           f"{setup.config.train.grad_accum}: advantages are normalised over the step's batch inside "
                           "the step, which needs the batch in one micro-batch; set grad_accum = 1")
    return make_prepare("rloo", reward_advantages)(setup)


# Everything else (rows, batch fields, reference, planner figures, metrics) is GRPO's.
RLOO = dataclasses.replace(GRPO, name="rloo", loss_terms=loss_terms, prepare=_prepare, section=RLOOConfig)
