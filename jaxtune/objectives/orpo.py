"""ORPO, odds-ratio preference optimisation (Hong et al. 2024), as TRL 1.16's `ORPOTrainer` (`ORPO`, its section
`ORPOConfig`): SFT and preference alignment in one loss with no reference model.

Pairs are batched as for DPO (`dpo.pair_batch`). Per micro-batch the loss is the NLL of the chosen rows (a token mean,
over the prompt and the completion, as TRL's "orpo chosen nll loss is computed over the full prompt and response")
plus the mean over pairs of `odds_ratio_loss` of the mean per-token log-probabilities of the two completions.
Pairs with images read them as DPO's (`dpo.row_logps`); the NLL then counts the prompt's image placeholders too, as
every other prompt target (TRL's ORPO reads no images; its SFT without completion_only_loss counts them the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtune.errors import check_range
from jaxtune.objectives.base import Context, Objective
from jaxtune.objectives.cpo import (
    pair_forward,
    pair_logits_copies,
    pair_nll_terms,
    reference_free_terms,
    reward_metrics,
)
from jaxtune.objectives.dpo import pair_training


@dataclass(frozen=True)
class ORPOConfig:
    """[orpo] beta: the weight of the odds-ratio term (TRL's ORPOConfig.beta, the paper's lambda)."""

    beta: float = 0.1

    def __post_init__(self):
        check_range("beta", self.beta, 0, low_open=True)


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, switching at -ln 2 between log1p(-exp(x)) and log(-expm1(x)) so neither cancels
    (Maechler 2012; TRL's `log1mexp`)."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def odds_ratio_loss(chosen_B: jax.Array, rejected_B: jax.Array, beta: float) -> tuple[jax.Array, dict]:
    """ORPO's odds-ratio term per pair [B] (eq. 6-7) from mean per-token log-probs [B] (< 0): -beta log sigmoid(
    log odds(chosen) - log odds(rejected)), log odds(y) = log p - log(1 - p). TRL's `odds_ratio_loss` returns
    beta log sigmoid(...), which its loss subtracts: this is that, negated. Metrics [B]: `reward_metrics` of beta
    log p, log_odds_ratio (the log sigmoid) and log_odds_chosen (the log-odds difference), as TRL logs them."""
    log_odds = (chosen_B - rejected_B) - (log1mexp(chosen_B) - log1mexp(rejected_B))
    ratio = jax.nn.log_sigmoid(log_odds)
    metrics = reward_metrics(beta * chosen_B, beta * rejected_B)
    return -beta * ratio, {**metrics, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}


def orpo_terms(chosen_B: jax.Array, rejected_B: jax.Array, real_B: jax.Array, nll_sum: jax.Array,
               nll_tokens: jax.Array, beta: float) -> tuple[jax.Array, jax.Array, dict]:
    """(loss sum, pairs, metric sums) of a micro-batch of mean per-token log-probs [B] and its chosen rows' NLL:
    TRL's `nll_loss - losses.mean()` times its real pairs."""
    # an empty pair's mean log-prob is 0, where log1mexp is -inf: score it at -1 (its terms are masked out)
    safe = lambda x: jnp.where(real_B > 0, x, -1.0)
    losses, metrics = odds_ratio_loss(safe(chosen_B), safe(rejected_B), beta)
    return pair_nll_terms(losses, metrics, chosen_B, rejected_B, real_B, nll_sum, nll_tokens, 1.0)


def _sums(params, micro, ctx: Context, key=None):
    return orpo_terms(*pair_forward(params, micro, ctx, ctx.method, True, "segment_ids", key), ctx.section.beta)


loss_terms, eval_terms = reference_free_terms(_sums)


ORPO = Objective("orpo", loss_terms, eval_terms, pair_training, section=ORPOConfig, rows=lambda section: 2,
                 logits_copies=pair_logits_copies, unit="pairs", reads_images=True)
