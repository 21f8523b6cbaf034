"""Distillation (`DISTILL`, its section `DistillConfig`): a student (full or any adapter method) learns a teacher's
next-token distributions, mixed with the SFT loss: alpha * D + (1 - alpha) * cross-entropy over completion tokens, D
the generalised Jensen-Shannon divergence of `beta` (`losses.generalized_jsd`; 0 forward KL, 1 reverse). The teacher
(any model with the student's vocabulary) runs in the same step under stop_gradient, chunk by chunk beside the student.

On-policy (GKD, Agarwal et al. 2024; TRL 1.16's GKDTrainer): with probability `lmbda` a step's batch is the student's
own completions of its prompts (its `rollout_engine`, under the run's mesh); else, with `seq_kd` (Kim & Rush 2016), the
teacher's, decoded from the arrays the step reads (handed over once, `ObjectiveData.start`); else the dataset's: one
draw, then seq_kd, as GKDTrainer.training_step. Draws and samples are functions of (seed, epoch, step): every process
draws the same and a resumed run draws them again (`mixed_batches`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig, SamplingConfig
from jaxtune.data.formats import Example
from jaxtune.errors import ConfigError, JaxtuneError, check_range
from jaxtune.methods.transform import combine
from jaxtune.models.head import head_logits, per_token, token_logps
from jaxtune.models.hf_config import load_config
from jaxtune.models.llama import decoder
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs
from jaxtune.objectives.grpo import rollout_batch
from jaxtune.objectives.losses import generalized_jsd
from jaxtune.objectives.sft import perplexity, sft_split, sft_training
from jaxtune.rollouts.decoders import EngineKeys, sampled_groups


@dataclass(frozen=True)
class DistillConfig(EngineKeys):
    """teacher: a model directory; alpha: the divergence's weight (1 - alpha: the SFT loss's); temperature softens
    both distributions in the divergence, which is scaled by temperature^2 (Hinton et al. 2015; TRL's
    `generalized_jsd_loss` has the temperature, not the scale, and GKDTrainer leaves it at 1); beta: the generalised
    JSD's interpolation (TRL's; 0: KL(teacher || student), 1: KL(student || teacher); TRL's default is 0.5).
    lmbda: the probability that a step's batch is the student's own completions (TRL's; 0: offline distillation),
    max_new_tokens of them sampled at sampling_temperature (TRL's GKDConfig `max_new_tokens`, `temperature`; top-k and
    top-p off, as TRL). An on-policy batch has no reference completion for the cross-entropy: lmbda > 0 needs alpha 1.
    seq_kd: a step not drawn on-policy trains on the teacher's completions of its prompts (TRL's, sampled with the
    same settings) instead of the dataset's; with alpha < 1 the cross-entropy is on the teacher's tokens (sequence-
    level KD: supervised fine-tuning on the teacher's output). lmbda = 1 never reaches it: refused.
    rollout_engine, rollout_slots, rollout_page_size, rollout_pages: the decoder of both (`EngineKeys`).
    reverse: before beta, true meant KL(student || teacher); it still does (it sets beta = 1), set beta instead."""

    teacher: str = ""
    alpha: float = 0.5
    temperature: float = 1.0
    reverse: bool = False
    beta: float = 0.0
    lmbda: float = 0.0
    max_new_tokens: int = 128
    sampling_temperature: float = 0.9
    seq_kd: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_range("alpha", self.alpha, 0, 1)
        check_range("temperature", self.temperature, 0, low_open=True)
        check_range("beta", self.beta, 0, 1)
        check_range("lmbda", self.lmbda, 0, 1)
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("sampling_temperature", self.sampling_temperature, 0, low_open=True)
        if self.reverse and self.beta not in (0, 1):
            raise ConfigError("reverse", True, f"is beta = 1 (KL(student || teacher)), and beta = {self.beta} is set "
                              "too; set beta alone")
        if self.reverse:
            object.__setattr__(self, "beta", 1.0)
        if self.lmbda and self.alpha != 1:
            raise ConfigError("alpha", self.alpha, f"must be 1 with lmbda = {self.lmbda} (a batch the student "
                              "samples has no reference completion for the cross-entropy; TRL's GKD is alpha = 1)")
        if self.seq_kd and self.lmbda == 1:
            raise ConfigError("seq_kd", True, "is never used with lmbda = 1 (every batch is the student's); lower "
                              "lmbda or set seq_kd = false")


def check_teacher(student: ModelConfig, teacher: ModelConfig, where: str) -> None:
    if teacher.vocab_size != student.vocab_size:
        raise JaxtuneError(f"{where}: teacher vocabulary has {teacher.vocab_size} tokens, the student's "
                           f"{student.vocab_size}; distillation needs the same tokenizer")


def _hidden(params, cfg, batch, method, options, dropout_key=None):
    return decoder(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                   segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)


def _sums(student_params, teacher, batch, ctx: Context, key=None):
    """(sum of the divergence, sum of -log p(label), token count) over the batch's completion tokens; the teacher's
    logits are computed chunk by chunk beside the student's (`head.per_token`)."""
    d = ctx.section
    teacher_hidden = jax.lax.stop_gradient(_hidden(teacher, ctx.second_cfg, batch, None, ctx.options))
    student_hidden = _hidden(student_params, ctx.cfg, batch, ctx.method, ctx.options, key)

    def chunk(student_BxCxD, teacher_BxCxD, labels_BxC):
        student_logits = head_logits(student_params, student_BxCxD, ctx.cfg.final_logit_softcap)
        teacher_logits = head_logits(teacher, teacher_BxCxD, ctx.second_cfg.final_logit_softcap)
        return (generalized_jsd(student_logits, teacher_logits, d.beta, d.temperature) * d.temperature**2,
                token_logps(student_logits, labels_BxC))

    kl_BxT, logps_BxT = per_token(chunk, student_hidden, teacher_hidden, batch["labels"], vocab=ctx.cfg.vocab_size)
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(kl_BxT * mask), -jnp.sum(logps_BxT * mask), jnp.sum(mask)


def loss_terms(ctx: Context):
    """alpha * divergence + (1 - alpha) * cross-entropy per micro-batch; metric "kl": the divergence (a KL at beta 0
    or 1, the generalised JSD between)."""
    def terms(trainable, frozen, teacher, micro, key=None):
        kl, nll, count = _sums(combine(trainable, frozen), teacher, micro, ctx, key)
        return ctx.section.alpha * kl + (1 - ctx.section.alpha) * nll, (count, {"kl": kl, "nll": nll})

    return terms


def eval_terms(ctx: Context):
    def terms(params, teacher, batch):
        kl, nll, count = _sums(params, teacher, batch, ctx)
        return {"kl": kl, "nll": nll, "tokens": count}

    return terms


def prompt_of(example: Example) -> list[int]:
    """The tokens before an example's first prediction target (its prompt; empty if the first token is one)."""
    mask = np.asarray(example.loss_mask)
    return list(example.ids[:int(np.argmax(mask > 0))]) if mask.any() else []


def on_policy_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], seq_len: int,
                    grad_accum: int) -> dict:
    """Host arrays [A, rows, T] of prompt + completion rows (`grpo.rollout_batch`): the completion's tokens are the
    labels, the prompt masked; T the `padded_length` of the longest row; `on_policy` [A, rows] ones."""
    n = len(completions)
    rows = rollout_batch([list(p) for p in prompts], [list(c) for c in completions], [0.0] * n, np.zeros(n), seq_len)
    stacked = {k: rows[k].reshape(grad_accum, -1, rows[k].shape[1]) for k in ("input_ids", "labels", "loss_mask",
                                                                             "segment_ids", "positions")}
    return {**stacked, "on_policy": np.ones(stacked["loss_mask"].shape[:2], np.float32)}


def mixed_batches(setup: ObjectiveInputs, train: Sequence[Example], off_policy: Callable,
                  teacher: tuple[Callable[[], dict], ModelConfig] | None = None) -> Callable:
    """`batch(epoch, index, params)` that is, with probability lmbda, the student's completions of batch_size x
    grad_accum prompts of `train` (`on_policy_batch`); else, with seq_kd, the teacher's completions of them
    (teacher: (its params when asked, its architecture)); else `off_policy`'s batch. `on_policy` is 1 for the
    student's, 0 for the others. The draw and the sampling seed come from (train.seed, epoch, index); the prompts
    from a (data.seed, epoch) permutation. Both decode with max_new_tokens, sampling_temperature, top-k and top-p
    off, and the student's EOS ids (TRL's one `generation_config`)."""
    c, d, tok, cfg = setup.config, setup.section, setup.tokenizer, setup.cfg
    tc, seq_len = c.train, c.data.max_seq_len
    if d.lmbda and c.offload.frozen_params:
        raise JaxtuneError("[offload] frozen_params = true is not supported with [distill] lmbda > 0 (the student "
                           "decodes from the frozen weights); set it to false")
    if d.seq_kd and teacher is None:
        raise JaxtuneError("[distill] seq_kd: no teacher to decode with")
    prompts = [p for p in map(prompt_of, train) if p and len(p) + d.max_new_tokens <= seq_len + 1]
    setup.log(f"{'on-policy' if d.lmbda else 'seq_kd'}: {len(prompts)} of {len(train)} training prompts leave room "
              f"for max_new_tokens = {d.max_new_tokens} in max_seq_len {seq_len} + 1")
    if not prompts:
        sampled = f"lmbda = {d.lmbda}" if d.lmbda else "seq_kd = true"
        raise JaxtuneError(f"[distill] {sampled}: no training prompt leaves room for max_new_tokens = "
                           f"{d.max_new_tokens} in [data] max_seq_len = {seq_len}; lower max_new_tokens")
    decoders = ([("student", cfg)] if d.lmbda else []) + ([("teacher", teacher[1])] if d.seq_kd and teacher else [])
    prompt = max(map(len, prompts))
    for who, model in decoders:  # the longest prompt decoded, not failing at the first sampled step
        if prompt + d.max_new_tokens > model.max_position_embeddings:
            raise JaxtuneError(f"[distill] max_new_tokens = {d.max_new_tokens} after a prompt of {prompt} tokens "
                               f"passes the {who}'s context of {model.max_position_embeddings} "
                               "(max_position_embeddings); lower max_new_tokens or [data] max_seq_len")
    eos = sorted({*cfg.eos_token_id, *([tok.eos_id] if tok.eos_id is not None else [])})
    per_step = tc.batch_size * tc.grad_accum

    def batch(epoch: int, index: int, params: Callable[[], dict]) -> dict:
        draw = np.random.default_rng([tc.seed, epoch, index])
        student = draw.random() < d.lmbda  # TRL: random.random() <= lmbda, each step, then `elif seq_kd`
        if not student and not d.seq_kd:
            off = off_policy(epoch, index, params)
            return {**off, "on_policy": np.zeros(off["loss_mask"].shape[:2], np.float32)}
        order = np.random.default_rng([c.data.seed, epoch]).permutation(len(prompts))
        chosen = [prompts[order[(index * per_step + i) % len(prompts)]] for i in range(per_step)]
        sampling = SamplingConfig(max_new_tokens=d.max_new_tokens, temperature=d.sampling_temperature,
                                  seed=int(draw.integers(2**31)))
        if student:
            completions = sampled_groups(params(), cfg, chosen, 1, sampling, d, eos_ids=eos, method=c.method)
        else:
            assert teacher is not None  # checked above
            completions = sampled_groups(teacher[0](), teacher[1], chosen, 1, sampling, d, eos_ids=eos, method=None)
        rows = on_policy_batch(chosen, completions, seq_len, tc.grad_accum)
        return {**rows, "on_policy": rows["on_policy"] * float(student)}

    return batch


def prepare(setup: ObjectiveInputs) -> ObjectiveData:
    d = setup.section
    if not d.teacher:
        raise JaxtuneError("[distill] teacher is not set (a model directory with the student's vocabulary)")
    teacher_cfg = load_config(d.teacher)
    check_teacher(setup.cfg, teacher_cfg, f"[distill] teacher {d.teacher}")

    def metrics(sums: dict) -> dict:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        kl, nll = sums["kl"] / tokens, sums["nll"] / tokens
        return {"eval_loss": d.alpha * kl + (1 - d.alpha) * nll, "eval_kl": kl, "eval_nll": nll,
                "eval_perplexity": perplexity(nll), "eval_tokens": int(sums.get("tokens", 0))}

    split = sft_split(setup)
    data = sft_training(setup, metrics, split)
    if not d.lmbda and not d.seq_kd:
        return data
    loaded: dict[str, dict] = {}  # the teacher's arrays, once the trainer has loaded them (`start`)

    def start(_read_reference, _ctx: Context, second: dict | None) -> None:
        assert second is not None  # distillation's second model is its teacher
        loaded["teacher"] = second

    teacher = (lambda: loaded["teacher"], teacher_cfg) if d.seq_kd else None
    return replace(data, batch=mixed_batches(setup, split[0], data.batch, teacher), start=start)


def _batch_fields(rows: int, seq_len: int, section: DistillConfig) -> dict:
    return {"on_policy": jax.ShapeDtypeStruct((rows,), np.float32)} if section.lmbda or section.seq_kd else {}


DISTILL = Objective("distill", loss_terms, eval_terms, prepare, section=DistillConfig,
                    second_model=lambda section, method: section.teacher, model_fields=("teacher",),
                    logits_copies=lambda method, section: 6,
                    extra_forwards=lambda section: 1, batch_fields=_batch_fields,
                    batch_metrics=lambda batch: {"on_policy": jnp.mean(batch["on_policy"])} if "on_policy" in batch
                    else {},
                    rollout_tokens=lambda section: section.max_new_tokens if section.lmbda or section.seq_kd else 0)
