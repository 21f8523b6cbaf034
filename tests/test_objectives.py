"""Objectives against float64 numpy re-statements of the published formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_batch

from jaxtune.config import ForwardOptions
from jaxtune.models.head import label_logps
from jaxtune.objectives import distill, dpo, grpo
from jaxtune.objectives.base import Context
from jaxtune.objectives.grpo import group_advantages
from jaxtune.objectives.losses import (
    bradley_terry_loss,
    distillation_kl,
    grpo_token_loss,
    preference_loss,
    sequence_logps,
)
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.spine.model import load_model

RNG = np.random.default_rng(0)
PC, PR, RC, RR = (RNG.normal(-40, 8, 16) for _ in range(4))  # sequence log-probs of a fixed batch of 16 pairs


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("kind, beta, smoothing", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.1), ("ipo", 0.1, 0.0),
                                                   ("hinge", 0.2, 0.0)])
def test_preference_losses_equal_the_published_formulas(kind, beta, smoothing):
    h = (PC - RC) - (PR - RR)  # float64
    if kind == "sigmoid":  # DPO eq. 7, with cDPO label smoothing
        expected = -(1 - smoothing) * log_sigmoid(beta * h) - smoothing * log_sigmoid(-beta * h)
    elif kind == "ipo":  # IPO eq. 17
        expected = (h - 1 / (2 * beta)) ** 2
    else:  # SLiC hinge
        expected = np.maximum(0.0, 1 - beta * h)
    with jax.enable_x64(True):
        losses, metrics = preference_loss(*(jnp.asarray(x) for x in (PC, PR, RC, RR)), beta, kind, smoothing)
        np.testing.assert_allclose(losses, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(metrics["rewards/chosen"], beta * (PC - RC), rtol=1e-6)
        np.testing.assert_allclose(metrics["rewards/rejected"], beta * (PR - RR), rtol=1e-6)
        np.testing.assert_allclose(metrics["rewards/margin"], beta * h, rtol=1e-6, atol=1e-9)
        np.testing.assert_array_equal(metrics["rewards/accuracy"], (h > 0).astype(float))
    # float32 on the same batch, as training computes it
    losses32, _ = preference_loss(*(jnp.asarray(x, jnp.float32) for x in (PC, PR, RC, RR)), beta, kind, smoothing)
    np.testing.assert_allclose(losses32, expected, rtol=1e-4, atol=1e-4)


def test_unknown_preference_loss_is_named():
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        preference_loss(jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), 0.1, "kto")


def test_sequence_logps_sum_masked_token_logps():
    hidden, kernel = RNG.normal(size=(2, 5, 3)), RNG.normal(size=(3, 7))
    labels = RNG.integers(0, 7, (2, 5))
    mask = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    logits = hidden @ kernel
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = (np.take_along_axis(logp, labels[..., None], -1)[..., 0] * mask).sum(-1)
    params = {"lm_head": {"kernel": jnp.asarray(kernel, jnp.float32)}}
    logps = label_logps(params, jnp.asarray(hidden, jnp.float32), jnp.asarray(labels))
    total, count = sequence_logps(logps, jnp.asarray(mask))
    np.testing.assert_allclose(total, expected, rtol=1e-5)
    np.testing.assert_array_equal(count, [3, 2])


def test_bradley_terry():
    a, b = RNG.normal(size=8), RNG.normal(size=8)
    np.testing.assert_allclose(bradley_terry_loss(jnp.asarray(a), jnp.asarray(b)), -log_sigmoid(a - b), rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_distillation_kl(reverse):
    s, t = RNG.normal(size=(2, 4, 9)), RNG.normal(size=(2, 4, 9))
    temperature = 2.0
    log_softmax = lambda x: x / temperature - np.log(np.exp(x / temperature).sum(-1, keepdims=True))
    ls, lt = log_softmax(s), log_softmax(t)
    p, lp, lq = (np.exp(ls), ls, lt) if reverse else (np.exp(lt), lt, ls)
    expected = (p * (lp - lq)).sum(-1) * temperature**2
    np.testing.assert_allclose(distillation_kl(jnp.asarray(s), jnp.asarray(t), temperature, reverse), expected,
                               rtol=1e-5)


def test_grpo_advantages_and_loss():
    rewards = RNG.normal(size=(3, 4))
    expected = (rewards - rewards.mean(-1, keepdims=True)) / (rewards.std(-1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(group_advantages(rewards.reshape(-1), GRPOConfig(group_size=4)), expected.reshape(-1),
                               rtol=1e-5)
    logp, old, ref = (RNG.normal(-2, 0.3, (4, 6)) for _ in range(3))
    adv, mask = RNG.normal(size=4), (RNG.random((4, 6)) > 0.3).astype(float)
    ratio = np.exp(logp - old)
    surrogate = np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
    kl = np.exp(ref - logp) - (ref - logp) - 1
    total, count = grpo_token_loss(*(jnp.asarray(x) for x in (logp, old, ref, adv, mask)))
    np.testing.assert_allclose(total, ((-surrogate + 0.04 * kl) * mask).sum(), rtol=1e-5)
    assert count == mask.sum()


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("student_arch, teacher_arch", [pytest.param("gemma2", "gemma3", marks=pytest.mark.full),
                                                       ("qwen3_moe", "mixtral")])
def test_every_objective_reads_log_probs_as_transformers(student_arch, teacher_arch, hf_model_dir):
    """DPO's sequence log-probs, GRPO's token log-probs (at a sampling temperature) and distillation's KL and NLL
    on a Gemma 2 student (final logits soft-capped at 2) with a Gemma 3 teacher, and on a Qwen3-MoE student with a
    Mixtral teacher, equal what transformers' logits give."""
    import torch

    (student_dir, student), (teacher_dir, teacher) = hf_model_dir(student_arch), hf_model_dir(teacher_arch)
    cfg, params = load_model(student_dir)
    teacher_cfg, teacher_params = load_model(teacher_dir)
    ids, _, _ = padded_batch(cfg.vocab_size, seed=3)
    ids = np.concatenate([ids, ids[::-1]])  # four rows: two pairs
    B, T = ids.shape
    labels = np.concatenate([ids[:, 1:], np.zeros((B, 1), ids.dtype)], axis=1)
    loss_mask = (np.arange(T)[None] >= 3) & (np.arange(T)[None] < T - 1) & (np.arange(B)[:, None] != 3)
    batch = {"input_ids": ids, "labels": labels, "loss_mask": loss_mask.astype(np.float32),
             "positions": np.broadcast_to(np.arange(T), (B, T)), "segment_ids": np.ones((B, T), np.int32)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    with torch.no_grad():
        student_logits = student(torch.tensor(ids)).logits.double()
        teacher_logits = teacher(torch.tensor(ids)).logits.double()
    logps = torch.log_softmax(student_logits, -1).gather(-1, torch.tensor(labels)[..., None])[..., 0].numpy()
    assert np.abs(student_logits.numpy()).max() <= (2.0 if cfg.final_logit_softcap else np.inf)  # the cap holds

    ctx = Context(cfg, None, ForwardOptions(), distill.DistillConfig(temperature=2.0), teacher_cfg)
    chosen, rejected, _ = dpo.pair_logps(params, batch, ctx, None, mean=False)
    sums = (logps * loss_mask).sum(axis=1)
    np.testing.assert_allclose(np.concatenate([chosen, rejected]), sums, rtol=1e-5, atol=1e-4)
    token = grpo._token_logps(params, cfg, batch, None, ForwardOptions(), 0.7)  # TRL: soft-capped logits / T
    tempered = torch.log_softmax(student_logits / 0.7, -1).gather(-1, torch.tensor(labels)[..., None])[..., 0]
    np.testing.assert_allclose(np.asarray(token) * loss_mask, tempered.numpy() * loss_mask, atol=1e-5)

    kl, nll, count = distill._sums(params, teacher_params, batch, ctx)
    s, t = torch.log_softmax(student_logits / 2.0, -1), torch.log_softmax(teacher_logits / 2.0, -1)
    kl_ref = ((t.exp() * (t - s)).sum(-1).numpy() * 4.0 * loss_mask).sum()
    assert float(count) == loss_mask.sum()
    assert float(kl) == pytest.approx(kl_ref, rel=1e-5)
    assert float(nll) == pytest.approx(-(logps * loss_mask).sum(), rel=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.full
def test_sft_loss_with_the_router_loss_equals_transformers(arch, tmp_path):
    """A mixture trained with its load-balancing loss: one micro-batch's loss / tokens is transformers'
    `loss + router_aux_loss_coef * aux_loss` (output_router_logits), padding left out of both; without the flag
    neither adds it."""
    import torch
    from hf_models import make_hf_model

    from jaxtune.objectives.sft import batch_loss

    model = make_hf_model(arch, tmp_path, output_router_logits=True, router_aux_loss_coef=0.5)
    cfg, params = load_model(tmp_path)
    assert (cfg.output_router_logits, cfg.router_aux_loss_coef) == (True, 0.5)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ids, mask, positions = ids[[0, 2]], mask[[0, 2]], positions[[0, 2]]  # right padding: packed rows' convention
    labels = np.where(mask > 0, ids, -100)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    assert float(out.aux_loss) > 1.0  # E * sum f P: 1 at perfect balance
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), "positions": positions,
             "segment_ids": mask.astype(np.int32), "loss_mask": (np.roll(mask, -1, axis=1) * mask).astype(np.float32)}
    batch["loss_mask"][:, -1] = 0
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    ctx = Context(cfg, None, ForwardOptions())
    loss, count = jax.jit(lambda p, b: batch_loss(p, b, ctx, router_loss=True))(params, batch)
    np.testing.assert_allclose(float(loss / count), float(out.loss), rtol=2e-6)
    plain = Context(cfg.replace(output_router_logits=False), None, ForwardOptions())
    loss, count = jax.jit(lambda p, b: batch_loss(p, b, plain, router_loss=True))(params, batch)
    np.testing.assert_allclose(float(loss / count), float(out.loss - 0.5 * out.aux_loss), rtol=2e-6)
