"""The objectives' losses as pure functions: `sequence_logps`, `preference_loss` (DPO, IPO, hinge),
`bradley_terry_loss`, `distillation_kl`, `grpo_advantages`, `rloo_advantages`, `grpo_token_loss` (`grpo_aggregate`),
`rloo_sequence_loss`. They return per-row, per-pair or per-token values, or sums with their counts, never batch
means, so micro-batches and eval batches add up exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_logps(logps_BxT: jax.Array, loss_mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of log p(label) over each row's completion tokens [B], number of those tokens [B])."""
    mask = loss_mask_BxT.astype(logps_BxT.dtype)
    return jnp.sum(logps_BxT * mask, axis=-1), jnp.sum(mask, axis=-1)


def margin_loss(h_B: jax.Array, beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0) -> jax.Array:
    """Per-pair losses [B] of a preference margin h [B] (`preference_loss` says which is which; CPO's h has no
    reference): sigmoid (label-smoothed), ipo or hinge."""
    if kind == "sigmoid":
        return (-(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h_B)
                - label_smoothing * jax.nn.log_sigmoid(-beta * h_B))
    if kind == "ipo":
        return (h_B - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return jax.nn.relu(1 - beta * h_B)
    raise ValueError(f"unknown preference loss {kind!r}; choose sigmoid, ipo or hinge")


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
    losses = margin_loss(h, beta, kind, label_smoothing)
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


def grpo_advantages(rewards_PxG: jax.Array, eps: float = 1e-4, scale: str = "group") -> jax.Array:
    """Advantages [P, G]: the reward minus its group's mean, divided by (std + eps) of the prompt's group ("group",
    DeepSeekMath, Shao et al. 2024, section 4.1.2), of the whole batch ("batch", PPO Lite) or not ("none", Dr. GRPO);
    stds with Bessel's correction. TRL 1.16's `scale_rewards` (grpo_trainer.py, `_generate_and_score_completions`)."""
    centred = rewards_PxG - jnp.mean(rewards_PxG, axis=-1, keepdims=True)
    if scale == "none":
        return centred
    if scale not in ("group", "batch"):
        raise ValueError(f"unknown scale_rewards {scale!r}; choose group, batch or none")
    return centred / (jnp.std(rewards_PxG, axis=-1 if scale == "group" else None, keepdims=True, ddof=1) + eps)


def rloo_advantages(rewards_PxG: jax.Array) -> jax.Array:
    """REINFORCE leave-one-out advantages [P, G]: each reward minus the mean of the other G - 1 rewards of its
    prompt's group (Ahmadian et al. 2024, eq. 4; TRL 1.16 rloo_trainer.py, `_generate_and_score_completions`)."""
    G = rewards_PxG.shape[-1]
    return rewards_PxG - (jnp.sum(rewards_PxG, axis=-1, keepdims=True) - rewards_PxG) / (G - 1)


GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


def grpo_aggregate(values_BxT: jax.Array, mask_BxT: jax.Array, loss_type: str = "dapo",
                   max_completion_length: int = 0) -> tuple[jax.Array, jax.Array]:
    """Per-token values [B, T] (or per-row [B, 1]) as (sum, count) of one micro-batch, chosen so that A micro-batches
    of B rows, summed and divided once (`spine.update.accumulate`), equal TRL 1.16's `_compute_loss` of `loss_type`
    summed over A accumulation steps (grpo_trainer.py, the `if self.loss_type` branch that divides the loss):

      dapo     tokens summed over the step, / the step's completion tokens       (sum, tokens)
      bnpo     each micro-batch's token mean, averaged over micro-batches         (token mean, 1)
      dr_grpo  tokens summed, / (B x max_completion_length) per micro-batch       (sum, B x max_completion_length)
      grpo     each row's token mean, averaged over rows                          (sum of row means, B)
    """
    mask = mask_BxT.astype(jnp.float32)
    masked = values_BxT * mask
    total, tokens = jnp.sum(masked), jnp.sum(mask)
    B = mask.shape[0]
    if loss_type == "dapo":
        return total, tokens
    if loss_type == "bnpo":
        return total / jnp.maximum(tokens, 1.0), jnp.float32(1)
    if loss_type == "dr_grpo":
        return total, jnp.float32(B * max_completion_length)
    if loss_type == "grpo":
        return jnp.sum(jnp.sum(masked, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)), jnp.float32(B)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose " + ", ".join(GRPO_LOSS_TYPES))


def grpo_token_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, ref_logp_BxT: jax.Array, advantages_B: jax.Array,
                    mask_BxT: jax.Array, clip: float = 0.2, kl_coef: float = 0.04, *, clip_high: float | None = None,
                    delta: float | None = None, level: str = "token", loss_type: str = "dapo",
                    max_completion_length: int = 0) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of GRPO's loss over one micro-batch's completion tokens, aggregated as `grpo_aggregate`.

    The ratio r = pi / pi_old per token ("token"), or per row exp(mean token log-ratio) ("sequence", GSPO, Zheng et
    al. 2025), clipped to [1 - clip, 1 + clip_high] (DAPO's clip-higher; clip_high None: clip) against the row's
    advantage (PPO); delta caps the unclipped r (two-sided clipping, INTELLECT-2); plus beta = kl_coef times the
    unbiased KL estimator exp(ref - pi) - (ref - pi) - 1 to the reference (DeepSeekMath eq. 3-4). TRL 1.16's
    `GRPOTrainer._compute_loss` with epsilon = clip, epsilon_high = clip_high, beta = kl_coef.
    """
    mask = mask_BxT.astype(jnp.float32)
    log_ratio = logp_BxT - old_logp_BxT
    if level == "sequence":
        log_ratio = (jnp.sum(log_ratio * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))[:, None]  # [B, 1]
    elif level != "token":
        raise ValueError(f"unknown importance_sampling_level {level!r}; choose token or sequence")
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - clip, 1 + (clip if clip_high is None else clip_high))
    if delta is not None:
        ratio = jnp.minimum(ratio, delta)
    adv = advantages_B[:, None]
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    if kl_coef:
        loss = loss + kl_coef * (jnp.exp(ref_logp_BxT - logp_BxT) - (ref_logp_BxT - logp_BxT) - 1)
    return grpo_aggregate(loss, mask, loss_type, max_completion_length)


def rloo_sequence_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_B: jax.Array, mask_BxT: jax.Array,
                       clip: float = 0.2, clip_high: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum over rows, rows) of RLOO's clipped loss: the ratio of whole sequences exp(sum of token log-ratios),
    clipped to [1 - clip, 1 + clip_high], against the row's advantage (TRL 1.16 `RLOOTrainer._compute_loss`)."""
    mask = mask_BxT.astype(jnp.float32)
    ratio = jnp.exp(jnp.sum(logp_BxT * mask, -1) - jnp.sum(old_logp_BxT * mask, -1))
    clipped = jnp.clip(ratio, 1 - clip, 1 + (clip if clip_high is None else clip_high))
    return jnp.sum(-jnp.minimum(ratio * advantages_B, clipped * advantages_B)), jnp.float32(mask.shape[0])
