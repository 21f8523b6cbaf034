"""Preference optimisation (DPO, IPO, hinge: `losses.preference_loss`) on {prompt, chosen, rejected} pairs (`DPO`,
its section `PreferenceConfig`).

A micro-batch holds B pairs as 2B rows, chosen rows first: each row is prompt + completion + EOS, one pair member a
row, with `loss_mask` on the completion and EOS, so a row's masked sum of log-probabilities is log pi(completion |
prompt). The reference is the frozen base with the adapters switched off: the same arrays the policy reads, so an
adapter method's DPO holds no second copy. For a full fine-tune (or a separate reference model) the reference is a
tree of its own; with `precompute_reference` every pair is scored once before training and no reference is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.data.batching import ImageRows
from jaxtune.data.formats import PreferenceExample, preference_examples, train_eval_split
from jaxtune.data.image_examples import image_preference_examples
from jaxtune.errors import JaxtuneError, check_choice, check_range
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.models.head import label_logps
from jaxtune.models.hf_config import load_config
from jaxtune.models.llama import decoder
from jaxtune.models.params import param_specs
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs, epoch_cache, reference_of, total
from jaxtune.objectives.losses import preference_loss, sequence_logps
from jaxtune.objectives.sft import train_and_held_out

PAIR_FIELDS = ("input_ids", "labels", "loss_mask", "segment_ids", "positions")


@dataclass(frozen=True)
class PreferenceConfig:
    """[dpo] loss: sigmoid (DPO) | ipo | hinge; beta: the KL strength; label_smoothing: cDPO's noise rate.
    IPO uses each sequence's mean per-token log-probability (as TRL does), the others the sum.
    reference: "base" (the model being tuned as loaded: for adapter methods its frozen weights with the adapters
    off, no copy) or a model directory with the same vocabulary. precompute_reference: score every pair with the
    reference once before training; steps then skip the reference forward, and no reference model is kept."""

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
    row: dict[str, np.ndarray] = {k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32)
                                  for k in PAIR_FIELDS}
    row["input_ids"][:n] = ids[:-1]
    row["labels"][:n] = ids[1:]
    row["loss_mask"][prompt_len - 1:n] = 1.0
    row["segment_ids"][:n] = 1
    row["positions"][:n] = np.arange(n)
    return row


def pair_batch(pairs: Sequence[PreferenceExample], batch_size: int, seq_len: int,
               reference: np.ndarray | None = None, images: ImageRows | None = None) -> dict:
    """`pairs` (at most batch_size) as [2 * batch_size, seq_len] arrays, chosen rows then rejected rows, filled
    with empty pairs (no loss tokens). With `reference` ([len(pairs), 2] log-probs of chosen and rejected) also
    "reference_logps" [2 * batch_size]; with `images` (pairs with images) "pixel_values" [2 * batch_size,
    max_images, ...], each row its prompt's pixel arrays."""
    empty: dict[str, np.ndarray] = {k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32)
                                    for k in PAIR_FIELDS}
    chosen = [sequence_row(p.prompt + p.chosen, len(p.prompt), seq_len) for p in pairs]
    rejected = [sequence_row(p.prompt + p.rejected, len(p.prompt), seq_len) for p in pairs]
    pad = [empty] * (batch_size - len(pairs))
    rows = chosen + pad + rejected + pad
    batch = {k: np.stack([r[k] for r in rows]) for k in PAIR_FIELDS}
    if reference is not None:
        zeros: np.ndarray = np.zeros(batch_size - len(pairs), np.float32)
        batch["reference_logps"] = np.concatenate([reference[:, 0], zeros, reference[:, 1], zeros]).astype(np.float32)
    if images is not None:
        pixels: np.ndarray = np.zeros((batch_size, images.max_images, *images.shape), np.float32)
        for i, pair in enumerate(pairs):
            held: Any = pair  # `ImagePreferenceExample`
            if held.images > images.max_images:
                raise JaxtuneError(f"a pair's prompt holds {held.images} pixel arrays; [data] max_images_per_row = "
                                   f"{images.max_images} must be at least that")
            pixels[i, :held.images] = held.pixel_values
        batch["pixel_values"] = np.concatenate([pixels, pixels])
    return batch


def preference_batches(examples: list[PreferenceExample], batch_size: int, seq_len: int, seed: int,
                       epoch: int, reference: np.ndarray | None = None, images: ImageRows | None = None
                       ) -> list[dict]:
    """Batches of `batch_size` pairs (`pair_batch`), shuffled from (seed, epoch). `reference`: [N, 2] precomputed
    reference log-probs of the examples (`reference_logps`), carried along with their pairs."""
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    return [pair_batch([examples[i] for i in chunk], batch_size, seq_len,
                       None if reference is None else reference[chunk], images)
            for chunk in (order[start:start + batch_size] for start in range(0, len(order), batch_size))]


def row_logps(params: dict, batch: dict, ctx: Context, method, dropout_key: jax.Array | None = None) -> jax.Array:
    """log p(label) [R, T] of every position of an [R, T] batch of rows under `params` read with `method` (None: a
    plain model); dropout_key: LoRA dropout in training. A batch with `pixel_values` reads its images through the
    run's frozen image side (`params["vision"]`)."""
    tokens_BxT, inputs = batch["input_ids"], dict(positions_BxT=batch["positions"])
    if "pixel_values" in batch:
        side = ctx.images
        tokens_BxT, inputs = side.family.image_inputs(jax.lax.stop_gradient(params["vision"]), tokens_BxT,
                                                      batch["pixel_values"], batch["positions"], ctx.cfg, side.config,
                                                      jnp.dtype(ctx.options.compute_dtype))
    hidden = decoder(params, tokens_BxT, ctx.cfg, segment_ids_BxT=batch["segment_ids"], method=method,
                     options=ctx.options, dropout_key=dropout_key, **inputs)
    return label_logps(params, hidden, batch["labels"], ctx.cfg.final_logit_softcap)


def pair_logps(params: dict, batch: dict, ctx: Context, method, mean: bool, dropout_key: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen log-probs [B], rejected log-probs [B], real-pair mask [B]) of a [2B, T] pair batch under `params`
    read with `method` (None: a plain model); dropout_key: LoRA dropout in training."""
    logps_BxT = row_logps(params, batch, ctx, method, dropout_key)
    total_B, count_B = sequence_logps(logps_BxT, batch["loss_mask"])
    logps = total_B / jnp.maximum(count_B, 1.0) if mean else total_B
    B = logps.shape[0] // 2
    return logps[:B], logps[B:], (count_B[:B] > 0).astype(jnp.float32)


def _reference_pair(reference, micro, ctx: Context, mean: bool):
    """(chosen, rejected) reference log-probs [B] of a pair batch: precomputed ones if the batch carries them."""
    if "reference_logps" in micro:
        B = micro["reference_logps"].shape[0] // 2
        return micro["reference_logps"][:B], micro["reference_logps"][B:]
    chosen, rejected, _ = pair_logps(reference, micro, ctx, None, mean)
    return chosen, rejected


def _pair_sums(policy_params, reference, micro, ctx: Context, key=None):
    p = ctx.section
    if "vision" in policy_params and "vision" not in reference:  # a reference of its own reads the same images
        reference = {**reference, "vision": policy_params["vision"]}
    mean = p.loss == "ipo"
    ref_chosen, ref_rejected = jax.lax.stop_gradient(_reference_pair(reference, micro, ctx, mean))
    chosen, rejected, real = pair_logps(policy_params, micro, ctx, ctx.method, mean, key)
    losses, metrics = preference_loss(chosen, rejected, ref_chosen, ref_rejected, p.beta, p.loss, p.label_smoothing)
    return jnp.sum(losses * real), jnp.sum(real), {k: jnp.sum(v * real) for k, v in metrics.items()}


def loss_terms(ctx: Context):
    def terms(trainable, frozen, second, micro, key=None):
        loss, pairs, sums = _pair_sums(combine(trainable, frozen), reference_of(frozen, second), micro, ctx, key)
        return loss, (pairs, sums)

    return terms


def eval_terms(ctx: Context):
    def terms(params, second, batch):
        loss, pairs, sums = _pair_sums(params, reference_of(params, second), batch, ctx)
        return {"loss": loss, "pairs": pairs, **sums}

    return terms


def per_pair(sums: dict) -> dict:
    """Held-out sums over pair batches ({"pairs", metric sums}) as means per pair, named eval_<metric>."""
    sums = dict(sums)
    pairs = sums.pop("pairs")
    return {f"eval_{k}": v / max(pairs, 1) for k, v in sums.items()} | {"eval_pairs": int(pairs)}


def reference_logps(reference: dict, examples: Sequence[PreferenceExample], ctx: Context, batch_size: int,
                    seq_len: int, images: ImageRows | None = None) -> np.ndarray:
    """[N, 2] log-probs of each example's chosen and rejected completion under the reference model (summed, or the
    per-token mean for IPO), computed once, batch by batch."""
    score = jax.jit(lambda params, batch: pair_logps(params, batch, ctx, None, ctx.section.loss == "ipo"))
    out = []
    for start in range(0, len(examples), batch_size):
        pairs = examples[start:start + batch_size]
        chosen, rejected, _ = score(reference, pair_batch(pairs, batch_size, seq_len, images=images))
        out.append(np.stack([np.asarray(chosen), np.asarray(rejected)], axis=1)[:len(pairs)])
    return np.concatenate(out) if out else np.zeros((0, 2), np.float32)


def pair_training(setup: ObjectiveInputs, metrics=per_pair) -> ObjectiveData:
    """Pair batches of data.train and, if `precompute_reference`, their reference scores (at `start`)."""
    c = setup.config
    images = None if setup.images is None else ImageRows(c.data.max_images_per_row, setup.images.pixel_shape)
    train, held_out = image_pairs(setup) if images else train_and_held_out(setup, preference_examples, "pairs")
    scores: dict[str, np.ndarray | None] = {"train": None, "held_out": None}
    batches = lambda pairs, epoch, ref: preference_batches(pairs, c.train.batch_size, c.data.max_seq_len,
                                                           c.data.seed, epoch, ref, images)
    steps = -(-len(batches(train, 0, None)) // c.train.grad_accum)

    def start(read_reference, ctx: Context, _second) -> None:
        if getattr(setup.section, "precompute_reference", False):
            params = read_reference(getattr(setup.section, "reference", "base"))
            scores["train"], scores["held_out"] = (reference_logps(params, pairs, ctx, c.train.batch_size,
                                                                   c.data.max_seq_len, images)
                                                   for pairs in (train, held_out))
            setup.log(f"reference log-probs precomputed for {len(train)} + {len(held_out)} pairs")

    def evaluate(eval_step, params):
        return metrics(total([eval_step(params, b) for b in batches(held_out, 0, scores["held_out"])]))

    return ObjectiveData(steps, epoch_cache(lambda e: batches(train, e, scores["train"]), c.train.grad_accum),
                    evaluate if held_out else None, start)


def image_pairs(setup: ObjectiveInputs) -> tuple[list, list]:
    """(train, held-out) preference pairs with images (`image_preference_examples`), read each run."""
    data = setup.config.data
    read = lambda path: list(image_preference_examples(path, setup.tokenizer, setup.images, data.max_seq_len,
                                                       dict(data.columns)))
    pairs = read(data.train)
    train, held_out = (pairs, read(data.eval)) if data.eval else train_eval_split(pairs, data.eval_fraction,
                                                                                   data.seed)
    setup.log(f"data: {len(train)} train / {len(held_out)} eval pairs with images")
    return list(train), list(held_out)


def prepare(setup: ObjectiveInputs) -> ObjectiveData:
    reference = setup.section.reference
    if reference != "base":
        ref_cfg = load_config(reference)
        if ref_cfg.vocab_size != setup.cfg.vocab_size:
            raise JaxtuneError(f"[dpo] reference {reference}: vocabulary has {ref_cfg.vocab_size} tokens, the "
                               f"policy's {setup.cfg.vocab_size}; the reference must be the same model shape")
        shapes = lambda cfg: jax.tree.map(lambda s: s.shape, param_specs(cfg), is_leaf=lambda x: hasattr(x, "axes"))
        if shapes(ref_cfg) != shapes(setup.cfg):
            raise JaxtuneError(f"[dpo] reference {reference}: parameter shapes differ from the policy's; the "
                               "reference must be the same model shape (e.g. the SFT checkpoint)")
    return pair_training(setup)


def _second_model(section: PreferenceConfig, method) -> str | None:
    if section.precompute_reference or (section.reference == "base" and not method_unit(method).trains_base):
        return None  # scores come with the batch, or the reference is the frozen base with adapters off
    return section.reference


def _batch_fields(rows: int, _seq_len: int, section: PreferenceConfig) -> dict:
    return {"reference_logps": jax.ShapeDtypeStruct((rows,), np.float32)} if section.precompute_reference else {}


DPO = Objective("dpo", loss_terms, eval_terms, prepare, section=PreferenceConfig, rows=lambda section: 2,
                reads_images=True,
                batch_fields=_batch_fields, second_model=_second_model, model_fields=("reference",),
                logits_copies=lambda method, section: 2 if section.precompute_reference and not method_unit(
                    method).trains_base else 3, unit="pairs",
                extra_forwards=lambda section: 0 if section.precompute_reference else 1)
