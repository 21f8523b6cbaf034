"""Distillation: a student (full or any adapter method) learns a teacher's next-token distributions on the SFT
data, mixed with the SFT loss: alpha * KL + (1 - alpha) * cross-entropy, both over completion tokens. The teacher
is any loadable model with the student's vocabulary; it runs in the same step, under stop_gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError, check_range
from jaxtune.methods.transform import combine
from jaxtune.models.llama import forward
from jaxtune.objectives import distillation_kl, masked_nll_sum
from jaxtune.train.update import objective_step


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


def _logits(params, cfg, batch, method, options, dropout_key=None):
    return forward(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                   segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)


def make_distill_step(cfg: ModelConfig, teacher_cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                      optimizer: optax.GradientTransformation, schedule: optax.Schedule, distill: DistillConfig):
    """The jitted `step(state, frozen, teacher_params, batch[A, B, T]) -> (state, metrics)`, state donated."""

    def loss_terms(trainable, frozen, teacher, micro, key=None):
        teacher_logits = jax.lax.stop_gradient(_logits(teacher, teacher_cfg, micro, None, options))
        student_logits = _logits(combine(trainable, frozen), cfg, micro, method, options, key)
        kl, count = distillation_kl(student_logits, teacher_logits, micro["loss_mask"], distill.temperature,
                                    distill.reverse)
        nll, _ = masked_nll_sum(student_logits, micro["labels"], micro["loss_mask"])
        loss = distill.alpha * kl + (1 - distill.alpha) * nll
        return loss, (count, {"kl": kl, "nll": nll})

    return objective_step(loss_terms, method, optimizer, schedule)


def make_distill_eval(cfg: ModelConfig, teacher_cfg: ModelConfig, method: MethodConfig | None,
                      options: ForwardOptions, distill: DistillConfig):
    """Jitted `(student params, teacher params, batch) -> {"kl", "nll", "tokens"}` sums on held-out data."""

    def evaluate(params, teacher, batch):
        student_logits = _logits(params, cfg, batch, method, options)
        kl, count = distillation_kl(student_logits, _logits(teacher, teacher_cfg, batch, None, options),
                                    batch["loss_mask"], distill.temperature, distill.reverse)
        nll, _ = masked_nll_sum(student_logits, batch["labels"], batch["loss_mask"])
        return {"kl": kl, "nll": nll, "tokens": count}

    return jax.jit(evaluate)
