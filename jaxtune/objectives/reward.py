"""A reward model: a scalar head on the decoder (`models/reward_model.py`) trained with the Bradley-Terry loss on
preference pairs (Ouyang et al. 2022). Pairs come as for DPO: [2B, T] rows, chosen first; a row's reward is the
head read at its last real token. A finished run writes an HF `*ForSequenceClassification` directory, adapters
merged (`reward_model/`).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxtune.errors import JaxtuneError
from jaxtune.methods.lora import merge, merged_layer
from jaxtune.methods.transform import combine
from jaxtune.models.reward_model import add_reward_head, reward_scores, save_reward_model
from jaxtune.objectives.base import Context, Objective
from jaxtune.objectives.dpo import pair_training, per_pair
from jaxtune.objectives.losses import bradley_terry_loss


def _pair_sums(params, batch, ctx: Context, key=None):
    scores = reward_scores(params, batch, ctx.cfg, ctx.method, ctx.options, key)
    B = scores.shape[0] // 2
    real = (jnp.sum(batch["loss_mask"][:B], axis=-1) > 0).astype(jnp.float32)
    losses = bradley_terry_loss(scores[:B], scores[B:])
    accuracy = (scores[:B] > scores[B:]).astype(jnp.float32)
    return jnp.sum(losses * real), jnp.sum(real), {"accuracy": jnp.sum(accuracy * real),
                                                   "margin": jnp.sum((scores[:B] - scores[B:]) * real)}


def loss_terms(ctx: Context):
    def terms(trainable, frozen, _second, micro, key=None):
        loss, pairs, sums = _pair_sums(combine(trainable, frozen), micro, ctx, key)
        return loss, (pairs, sums)

    return terms


def eval_terms(ctx: Context):
    def terms(params, _second, batch):
        loss, pairs, sums = _pair_sums(params, batch, ctx)
        return {"loss": loss, "pairs": pairs, **sums}

    return terms


def prepare(setup):
    if setup.config.method.kind not in ("full", "lora", "qlora"):
        raise JaxtuneError(f"objective reward exports a sequence-classification model with the adapters merged: "
                           f"[method] kind must be full, lora or qlora, not {setup.config.method.kind}")
    return pair_training(setup, per_pair)


def export(run_dir: Path, config, cfg, params: dict) -> Path:
    method = config.method
    if method.kind == "qlora":  # a plain float model, dequantised as PEFT's merge_and_unload gives it
        params = merge(params, method)
    tensor = None if method.kind == "full" else merged_layer(params, method)
    return save_reward_model(run_dir / "reward_model", cfg, params, tokenizer_from=config.model.path,
                             dtype=None if config.model.dtype == "auto" else config.model.dtype, tensor=tensor)


REWARD = Objective("reward", loss_terms, eval_terms, prepare, rows=lambda section: 2, logits_copies=lambda m: 0,
                   head=add_reward_head, head_axes={("score", "kernel"): ("embed",)}, export=export, unit="pairs")
