"""Distillation (`DISTILL`, its section `DistillConfig`): a student (full or any adapter method) learns a teacher's
next-token distributions on the SFT data, mixed with the SFT loss: alpha * KL + (1 - alpha) * cross-entropy, both
over completion tokens. The teacher is any loadable model with the student's vocabulary; it runs in the same step,
under stop_gradient, its logits computed chunk by chunk beside the student's (`models/head.per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError, check_range
from jaxtune.methods.transform import combine
from jaxtune.models.head import head_logits, per_token, token_logps
from jaxtune.models.hf_config import load_config
from jaxtune.models.llama import decoder
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs
from jaxtune.objectives.losses import distillation_kl
from jaxtune.objectives.sft import perplexity, sft_training


@dataclass(frozen=True)
class DistillConfig:
    """teacher: a model directory; alpha: the KL's weight (1 - alpha: the SFT loss's); temperature softens both
    distributions; reverse: KL(student || teacher) instead of KL(teacher || student)."""

    teacher: str = ""
    alpha: float = 0.5
    temperature: float = 1.0
    reverse: bool = False

    def __post_init__(self):
        check_range("alpha", self.alpha, 0, 1)
        check_range("temperature", self.temperature, 0, low_open=True)


def check_teacher(student: ModelConfig, teacher: ModelConfig, where: str) -> None:
    if teacher.vocab_size != student.vocab_size:
        raise JaxtuneError(f"{where}: teacher vocabulary has {teacher.vocab_size} tokens, the student's "
                           f"{student.vocab_size}; distillation needs the same tokenizer")


def _hidden(params, cfg, batch, method, options, dropout_key=None):
    return decoder(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                   segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)


def _sums(student_params, teacher, batch, ctx: Context, key=None):
    """(sum of KL, sum of -log p(label), token count) over the batch's completion tokens; the teacher's logits
    are computed chunk by chunk beside the student's (`head.per_token`)."""
    d = ctx.section
    teacher_hidden = jax.lax.stop_gradient(_hidden(teacher, ctx.second_cfg, batch, None, ctx.options))
    student_hidden = _hidden(student_params, ctx.cfg, batch, ctx.method, ctx.options, key)

    def chunk(student_BxCxD, teacher_BxCxD, labels_BxC):
        student_logits = head_logits(student_params, student_BxCxD, ctx.cfg.final_logit_softcap)
        teacher_logits = head_logits(teacher, teacher_BxCxD, ctx.second_cfg.final_logit_softcap)
        return (distillation_kl(student_logits, teacher_logits, d.temperature, d.reverse),
                token_logps(student_logits, labels_BxC))

    kl_BxT, logps_BxT = per_token(chunk, student_hidden, teacher_hidden, batch["labels"], vocab=ctx.cfg.vocab_size)
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(kl_BxT * mask), -jnp.sum(logps_BxT * mask), jnp.sum(mask)


def loss_terms(ctx: Context):
    def terms(trainable, frozen, teacher, micro, key=None):
        kl, nll, count = _sums(combine(trainable, frozen), teacher, micro, ctx, key)
        return ctx.section.alpha * kl + (1 - ctx.section.alpha) * nll, (count, {"kl": kl, "nll": nll})

    return terms


def eval_terms(ctx: Context):
    def terms(params, teacher, batch):
        kl, nll, count = _sums(params, teacher, batch, ctx)
        return {"kl": kl, "nll": nll, "tokens": count}

    return terms


def prepare(setup: ObjectiveInputs) -> ObjectiveData:
    d = setup.section
    if not d.teacher:
        raise JaxtuneError("[distill] teacher is not set (a model directory with the student's vocabulary)")
    check_teacher(setup.cfg, load_config(d.teacher), f"[distill] teacher {d.teacher}")

    def metrics(sums: dict) -> dict:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        kl, nll = sums["kl"] / tokens, sums["nll"] / tokens
        return {"eval_loss": d.alpha * kl + (1 - d.alpha) * nll, "eval_kl": kl, "eval_nll": nll,
                "eval_perplexity": perplexity(nll), "eval_tokens": int(sums.get("tokens", 0))}

    return sft_training(setup, metrics)


DISTILL = Objective("distill", loss_terms, eval_terms, prepare, section=DistillConfig,
                    second_model=lambda section, method: section.teacher, logits_copies=lambda method, section: 6,
                    extra_forwards=lambda section: 1)
