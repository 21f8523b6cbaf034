"""The objectives' losses as pure functions: `sequence_logps`, `preference_loss` (DPO, IPO, hinge),
`bradley_terry_loss`, `generalized_jsd` (`distillation_kl`), `grpo_token_loss` (`grpo_aggregate`),
`rloo_sequence_loss`. They return per-row, per-pair or per-token values, or
sums with their counts, never batch means, so micro-batches and eval batches add up exactly."""

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


def generalized_jsd(student_logits_BxTxV: jax.Array, teacher_logits_BxTxV: jax.Array, beta: float = 0.5,
                    temperature: float = 1.0) -> jax.Array:
    """The generalised Jensen-Shannon divergence per position [B, T] (GKD, Agarwal et al. 2024, eq. 1; TRL 1.16's
    `GKDTrainer.generalized_jsd_loss` before its reduction), both distributions softened by `temperature`.

    With m = beta teacher + (1 - beta) student: beta KL(teacher || m) + (1 - beta) KL(student || m); at the ends, as
    TRL, beta = 0 is KL(teacher || student) (forward) and beta = 1 KL(student || teacher) (reverse), not the limits
    of the mixture (which vanish there)."""
    s = jax.nn.log_softmax(student_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    kl = lambda log_p, log_q: jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # KL(p || q)
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def distillation_kl(student_logits_BxTxV: jax.Array, teacher_logits_BxTxV: jax.Array, temperature: float = 1.0,
                    reverse: bool = False) -> jax.Array:
    """KL per position [B, T], both distributions softened by `temperature`, scaled by T^2 (Hinton et al. 2015):
    forward KL(teacher || student), or reverse KL(student || teacher) (MiniLLM); `generalized_jsd` at beta 0 or 1."""
    return generalized_jsd(student_logits_BxTxV, teacher_logits_BxTxV, float(reverse), temperature) * temperature**2


GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo")
SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def grpo_aggregate(values_BxT: jax.Array, mask_BxT: jax.Array, loss_type: str = "dapo",
                   max_completion_length: int = 0) -> tuple[jax.Array, jax.Array]:
    """Per-token values [B, T] (or per-row [B, 1]) as (sum, count) of one micro-batch, chosen so that A micro-batches
    of B rows, summed and divided once (`spine.update.accumulate`), equal TRL 1.16's `_compute_loss` of `loss_type`
    summed over A accumulation steps (grpo_trainer.py, the `if self.loss_type` branch that divides the loss):

      dapo, cispo  tokens summed over the step, / the step's completion tokens   (sum, tokens)
      bnpo         each micro-batch's token mean, averaged over micro-batches     (token mean, 1)
      dr_grpo      tokens summed, / (B x max_completion_length) per micro-batch   (sum, B x max_completion_length)
      grpo         each row's token mean, averaged over rows                      (sum of row means, B)
    """
    mask = mask_BxT.astype(jnp.float32)
    masked = values_BxT * mask
    total, tokens = jnp.sum(masked), jnp.sum(mask)
    B = mask.shape[0]
    if loss_type in ("dapo", "cispo"):
        return total, tokens
    if loss_type == "bnpo":
        return total / jnp.maximum(tokens, 1.0), jnp.float32(1)
    if loss_type == "dr_grpo":
        return total, jnp.float32(B * max_completion_length)
    if loss_type == "grpo":
        return jnp.sum(jnp.sum(masked, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)), jnp.float32(B)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose " + ", ".join(GRPO_LOSS_TYPES))


def sampler_weights(old_logp_BxT: jax.Array, sampler_logp_BxT: jax.Array, mask_BxT: jax.Array,
                    mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0
                    ) -> jax.Array:
    """Importance weights between the sampler and the learner, [B, T] ("token_*") or [B, 1] ("sequence_*"): the ratio
    pi_learner / pi_sampler of the completion's tokens (of the whole completion: exp of the summed log-ratio),
    truncated to [clip_min, clip_max] ("*_truncate", truncated IS) or set to 0 outside it ("*_mask", masked IS);
    None: no bound. A NaN sampler log-prob (one the sampler did not report) counts as no correction. TRL 1.16's
    `vllm_importance_sampling_mode` (grpo_trainer.py, `_generate_and_score_completions`), with the learner's
    log-probs at sampling time as `old_per_token_logps`; constant (no gradient)."""
    diff = jnp.nan_to_num((old_logp_BxT - sampler_logp_BxT) * mask_BxT.astype(old_logp_BxT.dtype), nan=0.0)
    if mode.startswith("sequence"):
        diff = jnp.sum(diff, -1, keepdims=True)
    elif not mode.startswith("token"):
        raise ValueError(f"unknown sampler importance sampling mode {mode!r}; choose " + ", ".join(SAMPLER_IS_MODES))
    ratio = jnp.exp(diff)
    if mode.endswith("truncate"):
        ratio = jnp.clip(ratio, clip_min, clip_max)
    else:
        low = -jnp.inf if clip_min is None else clip_min
        high = jnp.inf if clip_max is None else clip_max
        ratio = jnp.where((ratio < low) | (ratio > high), 0.0, ratio)
    return jax.lax.stop_gradient(ratio)


def high_entropy_mask(entropy_BxT: jax.Array, mask_BxT: jax.Array, quantile: float) -> jax.Array:
    """The completion tokens [B, T] (0 or 1) whose entropy is at least the (1 - quantile) quantile of the
    micro-batch's completion tokens' entropies (linear interpolation): the top `quantile` of tokens by entropy
    ("Beyond the 80/20 rule", Wang et al. 2025; TRL 1.16's `top_entropy_quantile`, `get_high_entropy_mask`); none
    when there are no completion tokens. Constant (no gradient)."""
    entropy = jax.lax.stop_gradient(entropy_BxT)
    mask = mask_BxT > 0
    threshold = jnp.nanquantile(jnp.where(mask, entropy, jnp.nan), 1 - quantile)  # NaN without tokens: none kept
    return ((entropy * mask >= threshold) & mask).astype(jnp.float32)


def grpo_token_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, ref_logp_BxT: jax.Array, advantages_B: jax.Array,
                    mask_BxT: jax.Array, clip: float = 0.2, kl_coef: float = 0.04, *, clip_high: float | None = None,
                    delta: float | None = None, level: str = "token", loss_type: str = "dapo",
                    max_completion_length: int = 0, weights: jax.Array | None = None,
                    entropy_BxT: jax.Array | None = None, top_entropy_quantile: float = 1.0,
                    entropy_coef: float = 0.0, tokens_per_micro: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of GRPO's loss over one micro-batch's completion tokens, aggregated as `grpo_aggregate`.

    The ratio r = pi / pi_old per token ("token"), or per row exp(mean token log-ratio) ("sequence", GSPO, Zheng et
    al. 2025), clipped to [1 - clip, 1 + clip_high] (DAPO's clip-higher; clip_high None: clip) against the row's
    advantage (PPO); delta caps the unclipped r (two-sided clipping, INTELLECT-2). loss_type "cispo" (MiniMax-M1,
    2025, eq. 4): -sg(min(r, clip_high)) A log pi instead, the weight clipped and its gradient stopped, so every token
    keeps a gradient. Tokens outside the top `top_entropy_quantile` by entropy get none of that term
    (`high_entropy_mask`); `weights` ([B, T] or [B, 1], `sampler_weights`) multiply it. Plus beta = kl_coef times the
    unbiased KL estimator exp(ref - pi) - (ref - pi) - 1 to the reference (DeepSeekMath eq. 3-4). Then, with
    entropy_coef c, the entropy bonus: minus c times the micro-batch's mean entropy H over the tokens the loss keeps,

        L = L_policy - c / A x sum_a (sum_t H_at m_at / sum_t m_at)     (a: the step's A micro-batches),

    which for dapo and cispo (a count that differs between micro-batches) needs `tokens_per_micro` [B]: the step's
    completion tokens / A. TRL 1.16's `GRPOTrainer._compute_loss` with epsilon = clip, epsilon_high = clip_high,
    beta = kl_coef, importance_sampling_ratio = weights, entropy_coef = c.
    """
    mask = mask_BxT.astype(jnp.float32)
    log_ratio = logp_BxT - old_logp_BxT
    if level == "sequence":
        log_ratio = (jnp.sum(log_ratio * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))[:, None]  # [B, 1]
    elif level != "token":
        raise ValueError(f"unknown importance_sampling_level {level!r}; choose token or sequence")
    ratio = jnp.exp(log_ratio)
    high = clip if clip_high is None else clip_high
    adv = advantages_B[:, None]
    if loss_type == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(ratio, high)) * adv * logp_BxT
    else:
        clipped = jnp.clip(ratio, 1 - clip, 1 + high)
        if delta is not None:
            ratio = jnp.minimum(ratio, delta)
        loss = -jnp.minimum(ratio * adv, clipped * adv)
    kept = mask
    if top_entropy_quantile < 1.0:
        if entropy_BxT is None:
            raise ValueError("top_entropy_quantile < 1 needs the tokens' entropies (entropy_BxT)")
        kept = mask * high_entropy_mask(entropy_BxT, mask, top_entropy_quantile)
        loss = loss * kept
    if weights is not None:
        loss = loss * weights
    if kl_coef:
        loss = loss + kl_coef * (jnp.exp(ref_logp_BxT - logp_BxT) - (ref_logp_BxT - logp_BxT) - 1)
    total, count = grpo_aggregate(loss, mask, loss_type, max_completion_length)
    if entropy_coef:
        if entropy_BxT is None:
            raise ValueError("entropy_coef needs the tokens' entropies (entropy_BxT)")
        bonus = jnp.sum(entropy_BxT * kept) / jnp.maximum(jnp.sum(kept), 1.0)
        if loss_type in ("dapo", "cispo"):
            if tokens_per_micro is None:
                raise ValueError(f"entropy_coef with loss_type {loss_type!r} needs tokens_per_micro")
            scale = tokens_per_micro[0]
        else:
            scale = count  # the same in every micro-batch
        total = total - entropy_coef * bonus * scale
    return total, count


def rloo_sequence_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_B: jax.Array, mask_BxT: jax.Array,
                       clip: float = 0.2, clip_high: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum over rows, rows) of RLOO's clipped loss: the ratio of whole sequences exp(sum of token log-ratios),
    clipped to [1 - clip, 1 + clip_high], against the row's advantage (TRL 1.16 `RLOOTrainer._compute_loss`)."""
    mask = mask_BxT.astype(jnp.float32)
    ratio = jnp.exp(jnp.sum(logp_BxT * mask, -1) - jnp.sum(old_logp_BxT * mask, -1))
    clipped = jnp.clip(ratio, 1 - clip, 1 + (clip if clip_high is None else clip_high))
    return jnp.sum(-jnp.minimum(ratio * advantages_B, clipped * advantages_B)), jnp.float32(mask.shape[0])
