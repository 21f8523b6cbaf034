"""Reference-free preference optimisation on {prompt, chosen, rejected} pairs, as TRL 1.16's `CPOTrainer`: CPO (`CPO`,
its section `CPOConfig`) and SimPO (`SIMPO`, `SimPOConfig`: the same trainer with loss_type "simpo" and no NLL).

Pairs are batched as for DPO (`dpo.pair_batch`: 2B rows, chosen first), but no reference model is read: the loss
(`cpo_loss`) compares the policy's own log-probabilities of chosen and rejected, summed over the completion, or their
per-token mean for "ipo" and "simpo" (SimPO's length normalisation), as TRL averages them. CPO adds cpo_alpha times
the NLL of the chosen completions (Xu et al. 2024, eq. 4), a token mean over the micro-batch's chosen rows as TRL's
cross-entropy takes it; its term per pair is that mean, so a micro-batch's loss / pairs is TRL's loss of that batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtune.errors import check_choice, check_range
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.objectives.base import Context, Objective
from jaxtune.objectives.dpo import pair_training, row_logps
from jaxtune.objectives.losses import margin_loss, sequence_logps


@dataclass(frozen=True)
class CPOConfig:
    """[cpo], TRL's CPOConfig names and defaults. loss_type: sigmoid (CPO) | hinge | ipo | simpo; beta: the
    temperature of the preference term; label_smoothing: its label noise (sigmoid, simpo); simpo_gamma: SimPO's
    target margin (gamma / beta in mean log-prob units); cpo_alpha: the weight of the NLL of the chosen completion."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, ("sigmoid", "hinge", "ipo", "simpo"))
        check_range("beta", self.beta, 0, low_open=True)
        check_range("label_smoothing", self.label_smoothing, 0, 0.5, high_open=True)
        check_range("simpo_gamma", self.simpo_gamma, 0)
        check_range("cpo_alpha", self.cpo_alpha, 0)


@dataclass(frozen=True)
class SimPOConfig(CPOConfig):
    """[simpo]: [cpo]'s knobs, defaulting to SimPO (Meng et al. 2024): loss_type "simpo", no NLL term."""

    loss_type: str = "simpo"
    cpo_alpha: float = 0.0


def reward_metrics(chosen_rewards_B: jax.Array, rejected_rewards_B: jax.Array) -> dict:
    """Per-pair metrics [B], named as TRL logs them: rewards/chosen, rejected, margins, accuracies."""
    return {"rewards/chosen": chosen_rewards_B, "rewards/rejected": rejected_rewards_B,
            "rewards/margins": chosen_rewards_B - rejected_rewards_B,
            "rewards/accuracies": (chosen_rewards_B > rejected_rewards_B).astype(jnp.float32)}


def cpo_loss(chosen_B: jax.Array, rejected_B: jax.Array, beta: float, kind: str = "sigmoid",
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> tuple[jax.Array, dict]:
    """Reference-free pair losses [B] of policy log-probabilities [B] (TRL's `CPOTrainer.cpo_loss`), h = log pi(c) -
    log pi(r):
      sigmoid (CPO, Xu et al. 2024, eq. 3):   -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
      simpo (SimPO, Meng et al. 2024, eq. 6): the same of h - gamma / beta     (mean per-token log-probs)
      ipo: (h - 1 / (2 beta))^2               (mean per-token log-probs)       hinge: max(0, 1 - beta h)
    Metrics [B]: `reward_metrics` of the rewards beta log pi."""
    h = chosen_B - rejected_B
    if kind == "simpo":  # the sigmoid loss of the margin beyond gamma
        h, kind = h - simpo_gamma / beta, "sigmoid"
    return margin_loss(h, beta, kind, label_smoothing), reward_metrics(beta * chosen_B, beta * rejected_B)


def pair_nll_terms(pair_losses_B: jax.Array, metrics: dict, chosen_B: jax.Array, rejected_B: jax.Array,
                   real_B: jax.Array, nll_sum: jax.Array, nll_tokens: jax.Array, nll_weight: float
                   ) -> tuple[jax.Array, jax.Array, dict]:
    """(loss sum, pairs, metric sums) of a micro-batch whose loss is, as TRL's `get_batch_loss_metrics`, the mean of
    `pair_losses_B` over its real pairs + nll_weight x its NLL (nll_sum / nll_tokens, a token mean): each pair
    carries that mean once, so loss sum / pairs is TRL's loss of the batch. Metric sums: `metrics` and the
    log-probs (logps/chosen, logps/rejected) over real pairs, nll_loss once per pair."""
    pairs = jnp.sum(real_B)
    nll = nll_sum / jnp.maximum(nll_tokens, 1.0)
    sums = {k: jnp.sum(v * real_B) for k, v in metrics.items()}
    sums |= {"logps/chosen": jnp.sum(chosen_B * real_B), "logps/rejected": jnp.sum(rejected_B * real_B),
             "nll_loss": pairs * nll}
    return jnp.sum(pair_losses_B * real_B) + nll_weight * pairs * nll, pairs, sums


def pair_forward(params: dict, micro: dict, ctx: Context, method, mean: bool, nll_mask: str, key=None
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One forward of a [2B, T] pair batch: (chosen [B], rejected [B] log-probs, summed or per-token means, real
    pairs [B], NLL sum and token count of the chosen rows over `nll_mask`: "loss_mask" (the completion and EOS) or
    "segment_ids" (every real target, prompt included))."""
    logps_BxT = row_logps(params, micro, ctx, method, key)
    total_B, count_B = sequence_logps(logps_BxT, micro["loss_mask"])
    logps_B = total_B / jnp.maximum(count_B, 1.0) if mean else total_B
    B = logps_B.shape[0] // 2
    real = (count_B[:B] > 0).astype(jnp.float32)
    nll_sum, nll_count = sequence_logps(logps_BxT[:B], micro[nll_mask][:B] > 0)
    return logps_B[:B], logps_B[B:], real, -jnp.sum(nll_sum), jnp.sum(nll_count)


def cpo_terms(chosen_B: jax.Array, rejected_B: jax.Array, real_B: jax.Array, nll_sum: jax.Array,
              nll_tokens: jax.Array, section: CPOConfig) -> tuple[jax.Array, jax.Array, dict]:
    """(loss sum, pairs, metric sums) of a micro-batch of policy log-probs [B] (per-token means for ipo and simpo)
    and its chosen rows' NLL: TRL's `losses.mean() + cpo_alpha * nll_loss` times its real pairs."""
    c = section
    losses, metrics = cpo_loss(chosen_B, rejected_B, c.beta, c.loss_type, c.label_smoothing, c.simpo_gamma)
    return pair_nll_terms(losses, metrics, chosen_B, rejected_B, real_B, nll_sum, nll_tokens, c.cpo_alpha)


def _sums(params, micro, ctx: Context, key=None):
    mean = ctx.section.loss_type in ("ipo", "simpo")
    return cpo_terms(*pair_forward(params, micro, ctx, ctx.method, mean, "loss_mask", key), ctx.section)


def reference_free_terms(sums):
    """(loss_terms, eval_terms) of a pair objective without a reference model from its `sums(params, micro, ctx,
    key) -> (loss sum, pairs, metric sums)`."""

    def loss_terms(ctx: Context):
        def terms(trainable, frozen, _second, micro, key=None):
            loss, pairs, metric_sums = sums(combine(trainable, frozen), micro, ctx, key)
            return loss, (pairs, metric_sums)

        return terms

    def eval_terms(ctx: Context):
        def terms(params, _second, batch):
            loss, pairs, metric_sums = sums(params, batch, ctx)
            return {"loss": loss, "pairs": pairs, **metric_sums}

        return terms

    return loss_terms, eval_terms


loss_terms, eval_terms = reference_free_terms(_sums)


def pair_logits_copies(method, section=None) -> int:
    """A pair objective's [b, T, V] float32 chunk buffers at the loss, as DPO's (the planner's `logits_copies`)."""
    return 3 if method_unit(method).trains_base else 2


# Pairs with images read them as DPO's do (`dpo.row_logps`: each row its prompt's pixel arrays)
CPO = Objective("cpo", loss_terms, eval_terms, pair_training, section=CPOConfig, rows=lambda section: 2,
                logits_copies=pair_logits_copies, unit="pairs", reads_images=True)
SIMPO = Objective("simpo", loss_terms, eval_terms, pair_training, section=SimPOConfig, rows=lambda section: 2,
                  logits_copies=pair_logits_copies, unit="pairs", reads_images=True)
