"""The objectives' losses as pure functions: `sequence_logps`, `preference_loss` (DPO, IPO, hinge),
`bradley_terry_loss`, `distillation_kl`, `grpo_advantages`, `grpo_token_loss`. They return per-row, per-pair or
per-token values, or sums with their counts, never batch means, so micro-batches and eval batches add up exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_logps(logps_BxT: jax.Array, loss_mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of log p(label) over each row's completion tokens [B], number of those tokens [B])."""
    mask = loss_mask_BxT.astype(logps_BxT.dtype)
    return jnp.sum(logps_BxT * mask, axis=-1), jnp.sum(mask, axis=-1)


def preference_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, reference_chosen: jax.Array,
                    reference_rejected: jax.Array, beta: float, kind: str = "sigmoid",
                    label_smoothing: float = 0.0) -> tuple[jax.Array, dict]:
    """Per-pair losses [B] and metrics from sequence log-probabilities [B] of policy and reference.

    With h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)):
      sigmoid (DPO, Rafailov et al. 2023, eq. 7): -log sigmoid(beta h), optionally label-smoothed (cDPO):
                                                  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
      ipo (Azar et al. 2023, eq. 17):            (h - 1 / (2 beta))^2   (pass mean per-token log-probs, as TRL does)
      hinge (SLiC, Zhao et al. 2023):            max(0, 1 - beta h)
    Metrics: implicit rewards beta (log pi - log ref) of chosen and rejected, their margin, and whether chosen wins.
    """
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    if kind == "sigmoid":
        losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif kind == "hinge":
        losses = jax.nn.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown preference loss {kind!r}; choose sigmoid, ipo or hinge")
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    metrics = {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
               "rewards/margin": chosen_reward - rejected_reward,
               "rewards/accuracy": (chosen_reward > rejected_reward).astype(jnp.float32)}
    return losses, metrics


def bradley_terry_loss(chosen_scores_B: jax.Array, rejected_scores_B: jax.Array) -> jax.Array:
    """Reward-model loss per pair [B]: -log sigmoid(r(chosen) - r(rejected)) (Ouyang et al. 2022, eq. 1)."""
    return -jax.nn.log_sigmoid(chosen_scores_B - rejected_scores_B)


def distillation_kl(student_logits_BxTxV: jax.Array, teacher_logits_BxTxV: jax.Array, temperature: float = 1.0,
                    reverse: bool = False) -> jax.Array:
    """KL per position [B, T], both distributions softened by `temperature`.

    forward: KL(teacher || student) (Hinton et al. 2015, scaled by T^2); reverse: KL(student || teacher) (MiniLLM).
    """
    s = jax.nn.log_softmax(student_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    p, log_p, log_q = (jnp.exp(s), s, t) if reverse else (jnp.exp(t), t, s)
    return jnp.sum(p * (log_p - log_q), axis=-1) * temperature**2


def grpo_advantages(rewards_PxG: jax.Array, eps: float = 1e-4) -> jax.Array:
    """Group-normalised advantages [P, G]: (r - mean of the prompt's group) / (std of the group + eps)
    (DeepSeekMath, Shao et al. 2024, section 4.1.2)."""
    mean = jnp.mean(rewards_PxG, axis=-1, keepdims=True)
    std = jnp.std(rewards_PxG, axis=-1, keepdims=True, ddof=1)
    return (rewards_PxG - mean) / (std + eps)


def grpo_token_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, ref_logp_BxT: jax.Array, advantages_B: jax.Array,
                    mask_BxT: jax.Array, clip: float = 0.2, kl_coef: float = 0.04) -> tuple[jax.Array, jax.Array]:
    """(sum of GRPO's per-token objective over completion tokens, token count).

    Clipped ratio r = pi / pi_old against the sequence's advantage (PPO), plus beta times the unbiased KL
    estimator exp(ref - pi) - (ref - pi) - 1 to the reference (DeepSeekMath eq. 3-4); returned as a loss.
    """
    ratio = jnp.exp(logp_BxT - old_logp_BxT)
    adv = advantages_B[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    kl = jnp.exp(ref_logp_BxT - logp_BxT) - (ref_logp_BxT - logp_BxT) - 1
    mask = mask_BxT.astype(jnp.float32)
    return jnp.sum((-surrogate + kl_coef * kl) * mask), jnp.sum(mask)
