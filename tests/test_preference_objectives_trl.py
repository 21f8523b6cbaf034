"""ORPO, CPO / SimPO and KTO against TRL 1.16's own code on the same random log-probabilities: the loss of a batch,
its gradient with respect to the policy's log-probabilities (torch autograd against jax.grad) and the metrics TRL
logs. TRL's methods are called unbound, a SimpleNamespace standing in for the trainer: `get_batch_loss_metrics` of
ORPOTrainer / CPOTrainer with their `concatenated_forward` returning the given log-probs and NLL, and KTOTrainer's
`_compute_loss` with a stand-in model whose `log_probs` are the given ones. jaxtune's batches carry empty
(padding) pairs or examples beside the real ones, which must change nothing."""

import functools
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.experimental.orpo.orpo_trainer import ORPOTrainer
from trl.trainer.kto_trainer import KTOTrainer

from jaxtune.objectives.cpo import CPOConfig, SimPOConfig, cpo_terms
from jaxtune.objectives.kto import KTOConfig, kto_terms
from jaxtune.objectives.orpo import orpo_terms

pytestmark = [pytest.mark.reference, pytest.mark.parity]

B, PAD = 6, 2  # real pairs (examples), and empty ones jaxtune's batch carries after them
RTOL = 1e-5
ACCELERATOR = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)


def _pairs(seed: int, mean: bool):
    """Chosen and rejected log-probs [B] (mean per-token ones, in (-3, -0.02), straddling -ln 2; or sums) and an
    NLL (sum over 37 tokens) of the chosen rows, float32."""
    rng = np.random.default_rng(seed)
    low, high = (-3.0, -0.02) if mean else (-60.0, -5.0)
    chosen, rejected = (rng.uniform(low, high, B).astype(np.float32) for _ in range(2))
    return chosen, rejected, np.float32(rng.uniform(30, 90)), np.float32(37)


def _ours(terms, chosen, rejected, nll_sum, nll_tokens):
    """(loss, d loss / d chosen [B], d loss / d rejected [B], metric means) of jaxtune's terms on the pairs followed
    by PAD empty pairs (log-probs 0, no tokens); the loss is the step's: loss sum / pairs."""
    pad = lambda x: jnp.concatenate([jnp.asarray(x), jnp.zeros(PAD, jnp.float32)])
    real = pad(np.ones(B, np.float32))

    def loss(c, r):
        total, pairs, sums = terms(pad(c), pad(r), real, jnp.float32(nll_sum), jnp.float32(nll_tokens))
        return total / pairs, {k: v / pairs for k, v in sums.items()}

    (value, metrics), (grad_c, grad_r) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(chosen, rejected)
    return float(value), np.asarray(grad_c), np.asarray(grad_r), {k: float(v) for k, v in metrics.items()}


def _theirs(trainer, trl_self, chosen, rejected, nll):
    """(loss, d loss / d chosen, d loss / d rejected, metrics) of TRL's `get_batch_loss_metrics` on the pairs."""
    c, r = (torch.tensor(x, requires_grad=True) for x in (chosen, rejected))
    logits = torch.zeros(B, 3, 5)
    trl_self.concatenated_forward = lambda model, batch: (c, r, logits, logits, torch.tensor(nll))
    loss, metrics = trainer.get_batch_loss_metrics(trl_self, None, None)
    loss.backward()
    return loss.item(), c.grad.numpy(), r.grad.numpy(), metrics


def _agree(ours, theirs, metric_names):
    value, grad_c, grad_r, metrics = ours
    np.testing.assert_allclose(value, theirs[0], rtol=RTOL)
    scale = max(np.abs(theirs[1]).max(), np.abs(theirs[2]).max())
    np.testing.assert_allclose(grad_c, theirs[1], rtol=RTOL, atol=RTOL * scale)
    np.testing.assert_allclose(grad_r, theirs[2], rtol=RTOL, atol=RTOL * scale)
    assert np.abs(grad_c).max() > 0 and np.abs(grad_r).max() > 0
    for name in metric_names:
        np.testing.assert_allclose(metrics[name], theirs[3][name], rtol=RTOL, atol=1e-6, err_msg=name)


PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


@pytest.mark.parametrize("beta, seed", [(0.1, 0), (0.5, 1), (2.0, 2)])
def test_orpo_equals_trl(beta, seed):
    """ORPO: TRL's `nll_loss - odds_ratio_loss(...).mean()` of mean per-token log-probs, and its logged metrics."""
    chosen, rejected, nll_sum, nll_tokens = _pairs(seed, mean=True)
    trl_self = SimpleNamespace(beta=beta, accelerator=ACCELERATOR, aux_loss_enabled=False)
    trl_self.odds_ratio_loss = functools.partial(ORPOTrainer.odds_ratio_loss, trl_self)
    theirs = _theirs(ORPOTrainer, trl_self, chosen, rejected, nll_sum / nll_tokens)
    ours = _ours(lambda *a: orpo_terms(*a, beta), chosen, rejected, nll_sum, nll_tokens)
    _agree(ours, theirs, PAIR_METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen"))


@pytest.mark.parametrize("section", [
    CPOConfig(),  # CPO: sigmoid of summed log-probs + NLL
    CPOConfig(beta=0.5, label_smoothing=0.1, cpo_alpha=0.3),
    CPOConfig(loss_type="hinge", beta=0.05),
    CPOConfig(loss_type="ipo", beta=0.5),
    SimPOConfig(),  # SimPO: TRL's defaults with loss_type simpo, cpo_alpha 0
    SimPOConfig(beta=2.0, simpo_gamma=1.0, label_smoothing=0.1, cpo_alpha=0.5),  # CPO-SimPO
], ids=lambda s: f"{type(s).__name__}-{s.loss_type}-b{s.beta}-a{s.cpo_alpha}")
def test_cpo_and_simpo_equal_trl(section):
    """CPO's losses (sigmoid, label-smoothed, hinge, ipo) and SimPO: TRL's `losses.mean() + cpo_alpha * nll_loss`
    of `cpo_loss`, summed log-probs for sigmoid and hinge, mean per-token ones for ipo and simpo."""
    chosen, rejected, nll_sum, nll_tokens = _pairs(7, mean=section.loss_type in ("ipo", "simpo"))
    trl_self = SimpleNamespace(accelerator=ACCELERATOR, aux_loss_enabled=False, alpha=0.0, loss_type=section.loss_type,
                               beta=section.beta, label_smoothing=section.label_smoothing,
                               simpo_gamma=section.simpo_gamma, cpo_alpha=section.cpo_alpha)
    trl_self.cpo_loss = functools.partial(CPOTrainer.cpo_loss, trl_self)
    # TRL's forward skips the NLL (0) when cpo_alpha is 0; jaxtune logs it regardless
    nll = nll_sum / nll_tokens if section.cpo_alpha else 0.0
    theirs = _theirs(CPOTrainer, trl_self, chosen, rejected, nll)
    ours = _ours(lambda *a: cpo_terms(*a, section), chosen, rejected, nll_sum, nll_tokens)
    _agree(ours, theirs, PAIR_METRICS + (("nll_loss",) if section.cpo_alpha else ()))


def _kto_data(seed: int):
    """Sequence log-probs [B] of policy and reference on matched and on mismatched completions, labels [B]."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(-40, 6, B).astype(np.float32)
    policy = (ref + rng.normal(0, 4, B)).astype(np.float32)
    kl_ref = rng.normal(-55, 6, B).astype(np.float32)
    kl_policy = (kl_ref + rng.normal(1.0, 3, B)).astype(np.float32)
    return policy, ref, kl_policy, kl_ref, np.array([1, 0, 0, 1, 1, 0], bool)


def _trl_kto(section: KTOConfig, policy, ref, kl_policy, kl_ref, labels):
    """TRL's `_compute_loss` (training, reference log-probs precomputed): (loss, d loss / d policy, logged metrics)."""
    logps = torch.tensor(policy, requires_grad=True)
    ids, kl_ids, ones = torch.zeros(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2)

    def model(input_ids, **_):  # log-probs of the one completion token of each row
        per_token = logps[:, None] if input_ids is ids else torch.tensor(kl_policy)[:, None]
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros(B, 1), mean_logits=torch.zeros(B, 1))

    batch = {"input_ids": ids, "attention_mask": ones, "completion_mask": ones, "KL_input_ids": kl_ids,
             "KL_attention_mask": ones, "KL_completion_mask": ones, "label": torch.tensor(labels),
             "ref_logps": torch.tensor(ref), "ref_KL_logps": torch.tensor(kl_ref)}
    trl_self = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=ACCELERATOR,
                               calculate_KL=section.loss_type == "kto", precompute_ref_logps=True,
                               aux_loss_enabled=False, loss_type=section.loss_type, beta=section.beta,
                               desirable_weight=section.desirable_weight, undesirable_weight=section.undesirable_weight,
                               _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    trl_self._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, trl_self)
    loss = KTOTrainer._compute_loss(trl_self, model, batch, return_outputs=False)
    loss.backward()
    return loss.item(), logps.grad.numpy(), {k: v[-1] for k, v in trl_self._metrics["train"].items()}


@pytest.mark.parametrize("section, kl_shift", [
    (KTOConfig(), 1.0),
    (KTOConfig(), -3.0),  # the mismatched pairs' mean log-ratio < 0: z0 clamped at 0
    (KTOConfig(beta=0.5, desirable_weight=1.33, undesirable_weight=0.7), 1.0),
    (KTOConfig(loss_type="apo_zero_unpaired", beta=0.2, undesirable_weight=2.0), 1.0),
], ids=["kto", "kto-clamped", "kto-weighted", "apo_zero_unpaired"])
def test_kto_equals_trl(section, kl_shift):
    """KTO (z0 from the mismatched completions, clamped, no gradient) and APO-zero unpaired: TRL's loss, its gradient
    (through the matched completions only) and its logged kl, rewards and log-probs per label."""
    from jaxtune.objectives.kto import _label_means

    policy, ref, kl_policy, kl_ref, labels = _kto_data(3)
    kl_policy = kl_policy + np.float32(kl_shift - 1.0)
    theirs = _trl_kto(section, policy, ref, kl_policy, kl_ref, labels)
    mismatched = section.loss_type == "kto"
    pad = lambda x: jnp.concatenate([jnp.asarray(x, jnp.float32), jnp.zeros(PAD, jnp.float32)])
    count = pad(np.full(B, 5.0)) if not mismatched else jnp.tile(pad(np.full(B, 5.0)), 2)
    desirable = pad(labels) if not mismatched else jnp.concatenate([pad(labels), jnp.zeros(B + PAD)])
    reference = pad(ref) if not mismatched else jnp.concatenate([pad(ref), pad(kl_ref)])

    def loss(policy_B):
        rows = pad(policy_B) if not mismatched else jnp.concatenate([pad(policy_B), pad(kl_policy)])
        total, examples, sums = kto_terms(rows, reference, count, desirable, section)
        return total / examples, _label_means({**sums, "examples": examples})

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(policy))
    np.testing.assert_allclose(float(value), theirs[0], rtol=RTOL)
    np.testing.assert_allclose(grad, theirs[1], rtol=RTOL, atol=RTOL * np.abs(theirs[1]).max())
    assert np.abs(theirs[1]).min() > 0
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(float(metrics[name]), theirs[2][name], rtol=RTOL, atol=1e-6, err_msg=name)
    if mismatched:
        assert (theirs[2]["kl"] == 0.0) == (kl_shift < 0)
