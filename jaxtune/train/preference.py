"""Preference optimisation (DPO, IPO, hinge): batches of (chosen, rejected) pairs and the jitted step.

A batch holds B pairs as 2B rows, chosen rows first: each row is prompt + completion + EOS, one pair member a row,
with `loss_mask` on the completion and EOS, so a row's masked sum of log-probabilities is log pi(completion |
prompt). The reference model is the frozen base with the adapters switched off: the same arrays the policy
reads, so LoRA-family DPO holds no second copy. For a full fine-tune (or a separate reference model) the
reference is a tree of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.data.formats import PreferenceExample
from jaxtune.errors import check_choice, check_range
from jaxtune.methods.transform import ADAPTER_KEYS, combine
from jaxtune.models.llama import forward
from jaxtune.objectives import preference_loss, sequence_logps
from jaxtune.train.update import objective_step

PAIR_FIELDS = ("input_ids", "labels", "loss_mask", "segment_ids", "positions")


@dataclass(frozen=True)
class PreferenceConfig:
    """loss: sigmoid (DPO) | ipo | hinge; beta: the KL strength; label_smoothing: cDPO's noise rate.
    IPO uses each sequence's mean per-token log-probability (as TRL does), the others the sum.
    reference: "base" (the model being tuned as loaded: for adapter methods its frozen weights with the adapters
    off, no copy) or a model directory with the same vocabulary. precompute_reference: score every pair with the
    reference once before training (`reference_logps`); steps then skip the reference forward, and a separate
    reference model is not kept in memory."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference: str = "base"
    precompute_reference: bool = False

    def __post_init__(self):
        check_choice("loss", self.loss, ("sigmoid", "ipo", "hinge"))
        check_range("beta", self.beta, 0, low_open=True)
        check_range("label_smoothing", self.label_smoothing, 0, 0.5, high_open=True)


def sequence_row(ids: tuple[int, ...], prompt_len: int, seq_len: int) -> dict:
    """One [seq_len] row of prompt + completion `ids` (len <= seq_len + 1): inputs ids[:-1], targets ids[1:], the
    loss mask on the completion's targets."""
    n = len(ids) - 1
    row = {k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32) for k in PAIR_FIELDS}
    row["input_ids"][:n] = ids[:-1]
    row["labels"][:n] = ids[1:]
    row["loss_mask"][prompt_len - 1:n] = 1.0
    row["segment_ids"][:n] = 1
    row["positions"][:n] = np.arange(n)
    return row


def pair_batch(pairs: list[PreferenceExample], batch_size: int, seq_len: int,
               reference: np.ndarray | None = None) -> dict:
    """`pairs` (at most batch_size) as [2 * batch_size, seq_len] arrays, chosen rows then rejected rows, filled
    with empty pairs (no loss tokens). With `reference` ([len(pairs), 2] log-probs of chosen and rejected) also
    "reference_logps" [2 * batch_size]."""
    empty = {k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32) for k in PAIR_FIELDS}
    chosen = [sequence_row(p.prompt + p.chosen, len(p.prompt), seq_len) for p in pairs]
    rejected = [sequence_row(p.prompt + p.rejected, len(p.prompt), seq_len) for p in pairs]
    pad = [empty] * (batch_size - len(pairs))
    rows = chosen + pad + rejected + pad
    batch = {k: np.stack([r[k] for r in rows]) for k in PAIR_FIELDS}
    if reference is not None:
        zeros = np.zeros(batch_size - len(pairs), np.float32)
        batch["reference_logps"] = np.concatenate([reference[:, 0], zeros, reference[:, 1], zeros]).astype(np.float32)
    return batch


def preference_batches(examples: list[PreferenceExample], batch_size: int, seq_len: int, seed: int,
                       epoch: int, reference: np.ndarray | None = None) -> list[dict]:
    """Batches of `batch_size` pairs (`pair_batch`), shuffled from (seed, epoch). `reference`: [N, 2] precomputed
    reference log-probs of the examples (`reference_logps`), carried along with their pairs."""
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    return [pair_batch([examples[i] for i in chunk], batch_size, seq_len,
                       None if reference is None else reference[chunk])
            for chunk in (order[start:start + batch_size] for start in range(0, len(order), batch_size))]


def strip_adapters(params: dict) -> dict:
    """The base model inside a method's tree: adapter leaves (and the None holes of `partition`) removed."""
    if not isinstance(params, dict):
        return params
    return {k: strip_adapters(v) for k, v in params.items() if k not in ADAPTER_KEYS and v is not None}


def pair_logps(params: dict, batch: dict, cfg: ModelConfig, method: MethodConfig | None,
               options: ForwardOptions, mean: bool, dropout_key: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen log-probs [B], rejected log-probs [B], real-pair mask [B]) of a [2B, T] pair batch;
    dropout_key: LoRA dropout in training."""
    logits = forward(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                     segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)
    total, count = sequence_logps(logits, batch["labels"], batch["loss_mask"])
    logps = total / jnp.maximum(count, 1.0) if mean else total
    B = logps.shape[0] // 2
    return logps[:B], logps[B:], (count[:B] > 0).astype(jnp.float32)


def reference_logps(reference: dict, examples: list[PreferenceExample], cfg: ModelConfig, options: ForwardOptions,
                    preference: PreferenceConfig, batch_size: int, seq_len: int) -> np.ndarray:
    """[N, 2] log-probs of each example's chosen and rejected completion under the reference model (summed, or the
    per-token mean for IPO), computed once, batch by batch, for `preference_batches(..., reference=...)`."""
    score = jax.jit(lambda params, batch: pair_logps(params, batch, cfg, None, options, preference.loss == "ipo"))
    out = []
    for start in range(0, len(examples), batch_size):
        pairs = examples[start:start + batch_size]
        chosen, rejected, _ = score(reference, pair_batch(pairs, batch_size, seq_len))
        out.append(np.stack([np.asarray(chosen), np.asarray(rejected)], axis=1)[:len(pairs)])
    return np.concatenate(out) if out else np.zeros((0, 2), np.float32)


def _reference_pair(reference, micro, cfg, options, mean):
    """(chosen, rejected) reference log-probs [B] of a pair batch: precomputed ones if the batch carries them."""
    if "reference_logps" in micro:
        B = micro["reference_logps"].shape[0] // 2
        return micro["reference_logps"][:B], micro["reference_logps"][B:]
    chosen, rejected, _ = pair_logps(reference, micro, cfg, None, options, mean)
    return chosen, rejected


def make_preference_step(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                         optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                         preference: PreferenceConfig):
    """The jitted `step(state, frozen, reference, batch[A, 2B, T]) -> (state, metrics)`, state donated.

    `reference` is `strip_adapters(frozen)` for adapter methods (no copy) or the reference model's params; unused
    when the batch carries precomputed "reference_logps".
    """
    mean = preference.loss == "ipo"

    def pair_losses(trainable, frozen, reference, micro, key=None):
        ref_chosen, ref_rejected = _reference_pair(reference, micro, cfg, options, mean)
        ref_chosen, ref_rejected = jax.lax.stop_gradient((ref_chosen, ref_rejected))
        chosen, rejected, real = pair_logps(combine(trainable, frozen), micro, cfg, method, options, mean, key)
        losses, metrics = preference_loss(chosen, rejected, ref_chosen, ref_rejected, preference.beta,
                                          preference.loss, preference.label_smoothing)
        sums = {k: jnp.sum(v * real) for k, v in metrics.items()}
        return jnp.sum(losses * real), (jnp.sum(real), sums)

    return objective_step(pair_losses, method, optimizer, schedule)


def make_preference_eval(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                         preference: PreferenceConfig):
    """Jitted `(params, reference, batch) -> sums of loss and metrics and the pair count` for held-out pairs."""
    mean = preference.loss == "ipo"

    def evaluate(params, reference, batch):
        ref_chosen, ref_rejected = _reference_pair(reference, batch, cfg, options, mean)
        chosen, rejected, real = pair_logps(params, batch, cfg, method, options, mean)
        losses, metrics = preference_loss(chosen, rejected, ref_chosen, ref_rejected, preference.beta,
                                          preference.loss, preference.label_smoothing)
        return {"loss": jnp.sum(losses * real), "pairs": jnp.sum(real),
                **{k: jnp.sum(v * real) for k, v in metrics.items()}}

    return jax.jit(evaluate)
