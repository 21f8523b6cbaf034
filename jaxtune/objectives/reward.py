"""A reward model (`REWARD`): a scalar head on the decoder (`models/reward_model.py`) trained with the Bradley-Terry
loss on preference pairs (Ouyang et al. 2022). Pairs come as for DPO: [2B, T] rows, chosen first; a row's reward is
the head read at its last real token. A finished run writes an HF `*ForSequenceClassification` directory, adapters
merged (`reward_model/`), so a method whose adapters cannot merge is refused at `prepare`.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxtune.data.tokenizer import copy_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import METHODS, method_unit
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
    unit = method_unit(setup.config.method)
    if not unit.trains_base and unit.merge is None:
        mergeable = ", ".join(kind for kind, u in METHODS.items() if u.trains_base or u.merge is not None)
        raise JaxtuneError(f"objective reward exports a sequence-classification model with the adapters merged: "
                           f"[method] kind must be one of {mergeable}, not {setup.config.method.kind}")
    return pair_training(setup, per_pair)


def export(run_dir: Path, config, cfg, params: dict) -> Path:
    method = config.method
    unit = method_unit(method)
    merge, merged_layer = unit.merge, unit.merged_layer
    assert unit.trains_base or (merge is not None and merged_layer is not None)  # `prepare` checked
    if unit.quantize_base is not None and merge is not None:  # a float model, dequantised as PEFT's merge_and_unload
        params = merge(params, method, cfg=cfg)
    tensor = None if unit.trains_base or merged_layer is None else merged_layer(params, method, cfg)
    out = save_reward_model(run_dir / "reward_model", cfg, params,
                            dtype=None if config.model.dtype == "auto" else config.model.dtype, tensor=tensor)
    copy_tokenizer(config.model.path, out)
    return out


REWARD: Objective[None] = Objective("reward", loss_terms, eval_terms, prepare, rows=lambda section: 2,
                                    logits_copies=lambda method, section: 0,
                                    head=add_reward_head, head_axes={("score", "kernel"): ("embed",)}, export=export,
                                    result="an HF sequence-classification directory (reward_model/)", unit="pairs")
