"""KTO, Kahneman-Tversky optimisation (Ethayarajh et al. 2024), as TRL 1.16's `KTOTrainer` (`KTO`, its section
`KTOConfig`): unpaired completions labelled desirable or undesirable (`data.formats.labelled_examples`; preference
pairs split into one of each), each pushed away from the reference, to the side its label says.
A micro-batch of B examples is 2B rows: each example's prompt + completion, then the mismatched pairs prompt_i +
completion_(i-1) of its real examples (TRL's rotation within the batch). Those estimate the reference point z0, the
batch's mean log pi/ref of completions the prompt did not ask for, clamped at 0, no gradient (`kto_reference_point`).
The reference is the frozen base with the adapters off (no copy; a full fine-tune keeps a frozen copy), read in the
same step under stop_gradient. loss_type "apo_zero_unpaired" uses no z0, so its micro-batch is the B rows alone.
With images (`image_labelled_examples`) each row carries its prompt's pixel arrays, a mismatched row prompt_i's, as
TRL's vision collator builds its KL rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.data.batching import ImageRows
from jaxtune.data.formats import LabelledExample, labelled_examples, train_eval_split
from jaxtune.data.image_examples import image_labelled_examples
from jaxtune.errors import JaxtuneError, check_choice, check_range
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs, epoch_cache, reference_of, total
from jaxtune.objectives.dpo import PAIR_FIELDS, row_logps, sequence_row
from jaxtune.objectives.losses import sequence_logps
from jaxtune.objectives.sft import train_and_held_out


@dataclass(frozen=True)
class KTOConfig:
    """[kto], TRL's KTOConfig names and defaults. loss_type: kto | apo_zero_unpaired (APO's unpaired variant, no
    reference point); beta: the KL strength; desirable_weight, undesirable_weight: each label's loss weight (KTO's
    lambda_D, lambda_U, to balance unequal counts: eq. 8)."""

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, ("kto", "apo_zero_unpaired"))
        check_range("beta", self.beta, 0, low_open=True)
        check_range("desirable_weight", self.desirable_weight, 0, low_open=True)
        check_range("undesirable_weight", self.undesirable_weight, 0, low_open=True)


def kto_reference_point(policy_B: jax.Array, reference_B: jax.Array, real_B: jax.Array) -> jax.Array:
    """KTO's reference point z0 (eq. 7-8): the mean of log pi(y'|x) - log ref(y'|x) [B] over a batch's real mismatched
    pairs (x, y'), clamped at 0, with no gradient (TRL's `kl`)."""
    mean = jnp.sum((policy_B - reference_B) * real_B) / jnp.maximum(jnp.sum(real_B), 1.0)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0.0))


def kto_loss(policy_B: jax.Array, reference_B: jax.Array, desirable_B: jax.Array, z0: jax.Array, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, kind: str = "kto"
             ) -> tuple[jax.Array, jax.Array]:
    """(losses [B], rewards beta (log pi - log ref) [B]) of completions labelled desirable (1) or not (0), from
    sequence log-probs [B] of policy and reference (TRL's `KTOTrainer._compute_loss`), r = log pi - log ref:
      kto (eq. 7):        desirable  w_d (1 - sigmoid(beta (r - z0)))   undesirable  w_u (1 - sigmoid(beta (z0 - r)))
      apo_zero_unpaired:  desirable  w_d (1 - sigmoid(beta r))          undesirable  w_u sigmoid(beta r)   (APO)"""
    r = policy_B - reference_B
    if kind == "kto":
        desirable, undesirable = 1 - jax.nn.sigmoid(beta * (r - z0)), 1 - jax.nn.sigmoid(beta * (z0 - r))
    elif kind == "apo_zero_unpaired":
        desirable, undesirable = 1 - jax.nn.sigmoid(beta * r), jax.nn.sigmoid(beta * r)
    else:
        raise ValueError(f"unknown KTO loss {kind!r}; choose kto or apo_zero_unpaired")
    losses = jnp.where(desirable_B > 0, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses, beta * r


def _mismatched(section: KTOConfig) -> bool:
    return section.loss_type == "kto"


def kto_batch(examples: list[LabelledExample], batch_size: int, seq_len: int, mismatched: bool,
              images: ImageRows | None = None) -> dict:
    """`examples` (at most batch_size) as [batch_size, seq_len] rows of prompt + completion, filled with empty rows;
    `mismatched`: then as many rows of prompt_i + completion_(i-1) of the real examples (cut to seq_len). "desirable"
    [rows]: 1.0 on a desirable example's own row. With `images` (`ImageLabelledExample`s) "pixel_values" [rows,
    max_images, ...]: each row its prompt's pixel arrays (a mismatched row those of prompt_i)."""
    empty: dict[str, np.ndarray] = {k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32)
                                    for k in PAIR_FIELDS}
    pad = [empty] * (batch_size - len(examples))
    rows = [sequence_row(e.prompt + e.completion, len(e.prompt), seq_len) for e in examples] + pad
    if mismatched:
        rows += [sequence_row((e.prompt + examples[i - 1].completion)[:seq_len], len(e.prompt), seq_len)
                 for i, e in enumerate(examples)] + pad
    batch = {k: np.stack([r[k] for r in rows]) for k in PAIR_FIELDS}
    batch["desirable"] = np.zeros(len(rows), np.float32)
    batch["desirable"][:len(examples)] = [e.label[0] for e in examples]
    if images is not None:
        pixels: np.ndarray = np.zeros((batch_size, images.max_images, *images.shape), np.float32)
        for i, example in enumerate(examples):
            held: Any = example  # `ImageLabelledExample`
            if held.images > images.max_images:
                raise JaxtuneError(f"an example's prompt holds {held.images} pixel arrays; [data] max_images_per_row "
                                   f"= {images.max_images} must be at least that")
            pixels[i, :held.images] = held.pixel_values
        batch["pixel_values"] = np.concatenate([pixels, pixels]) if mismatched else pixels
    return batch


def kto_batches(examples, batch_size: int, seq_len: int, seed: int, epoch: int, mismatched: bool,
                images: ImageRows | None = None) -> list[dict]:
    """Batches of `batch_size` examples (`kto_batch`), shuffled from (seed, epoch)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    return [kto_batch([examples[i] for i in order[start:start + batch_size]], batch_size, seq_len, mismatched,
                      images) for start in range(0, len(order), batch_size)]


def kto_terms(policy_R: jax.Array, reference_R: jax.Array, count_R: jax.Array, desirable_R: jax.Array,
              section: KTOConfig) -> tuple[jax.Array, jax.Array, dict]:
    """(loss sum, examples, sums: desirable (count), kl (examples x z0), rewards and log-probs of each label, right
    (rewards on their label's side of 0)) of a `kto_batch`'s rows: sequence log-probs [R] of policy and reference,
    completion tokens [R], labels [R]. Loss sum / examples is TRL's `losses.nanmean()` of that batch."""
    k = section
    policy, reference = policy_R, jax.lax.stop_gradient(reference_R)
    B = policy.shape[0] // (2 if _mismatched(k) else 1)
    real = (count_R[:B] > 0).astype(jnp.float32)
    desirable = desirable_R[:B] * real
    undesirable = real - desirable
    z0 = (kto_reference_point(jax.lax.stop_gradient(policy[B:]), reference[B:], real) if _mismatched(k)
          else jnp.zeros(()))
    losses, rewards = kto_loss(policy[:B], reference[:B], desirable, z0, k.beta, k.desirable_weight,
                               k.undesirable_weight, k.loss_type)
    examples = jnp.sum(real)
    right = jnp.where(desirable > 0, rewards > 0, rewards < 0).astype(jnp.float32) * real
    sums = {"desirable": jnp.sum(desirable), "kl": examples * z0, "right": jnp.sum(right),
            "rewards/chosen": jnp.sum(rewards * desirable), "rewards/rejected": jnp.sum(rewards * undesirable),
            "logps/chosen": jnp.sum(policy[:B] * desirable), "logps/rejected": jnp.sum(policy[:B] * undesirable)}
    return jnp.sum(losses * real), examples, sums


def _sums(policy_params, reference, micro, ctx: Context, key=None) -> tuple[jax.Array, jax.Array, dict]:
    if "vision" in policy_params and "vision" not in reference:  # a reference of its own reads the same images
        reference = {**reference, "vision": policy_params["vision"]}
    mask = micro["loss_mask"]
    policy, count = sequence_logps(row_logps(policy_params, micro, ctx, ctx.method, key), mask)
    reference, _ = sequence_logps(row_logps(reference, micro, ctx, None), mask)
    return kto_terms(policy, reference, count, micro["desirable"], ctx.section)


def _label_means(sums: dict) -> dict:
    """TRL's logged means: kl, rewards and log-probs per desirable (chosen) and undesirable (rejected) example."""
    n, d = sums["examples"], sums["desirable"]
    per = lambda key, count: sums[key] / jnp.maximum(count, 1.0)
    out = {"kl": per("kl", n), **{f"{m}/chosen": per(f"{m}/chosen", d) for m in ("rewards", "logps")},
           **{f"{m}/rejected": per(f"{m}/rejected", n - d) for m in ("rewards", "logps")}}
    return out | {"rewards/margins": out["rewards/chosen"] - out["rewards/rejected"]}


def loss_terms(ctx: Context):
    def terms(trainable, frozen, second, micro, key=None):
        loss, examples, sums = _sums(combine(trainable, frozen), reference_of(frozen, second), micro, ctx, key)
        # the step divides metric sums by its examples: a micro-batch's means, weighted by its examples, give
        # TRL's values of that batch
        means = _label_means({**sums, "examples": examples})
        return loss, (examples, {k: examples * v for k, v in means.items()})

    return terms


def eval_terms(ctx: Context):
    def terms(params, second, batch):
        loss, examples, sums = _sums(params, reference_of(params, second), batch, ctx)
        return {"loss": loss, "examples": examples, **sums}

    return terms


def held_out_metrics(sums: dict) -> dict:
    """eval_loss, eval_kl, TRL's rewards and log-probs per label, eval_accuracy (the share of completions whose
    reward r = beta log pi/ref is on their label's side: r > 0 desirable, r < 0 undesirable) and eval_examples."""
    n = max(sums["examples"], 1.0)
    means = {k: float(v) for k, v in _label_means(sums).items() if k != "kl"}
    return {"eval_loss": sums["loss"] / n, "eval_kl": sums["kl"] / n, **{f"eval_{k}": v for k, v in means.items()},
            "eval_accuracy": sums["right"] / n, "eval_examples": int(sums["examples"])}


def prepare(setup: ObjectiveInputs) -> ObjectiveData:
    c, k = setup.config, setup.section
    if _mismatched(k) and c.train.batch_size < 2:
        raise JaxtuneError(f"[kto] loss_type = \"kto\" estimates its reference point from the batch's mismatched "
                           f"completions: train.batch_size = {c.train.batch_size} must be at least 2")
    images = None if setup.images is None else ImageRows(c.data.max_images_per_row, setup.images.pixel_shape)
    train, held_out = image_split(setup) if images else train_and_held_out(setup, labelled_examples, "examples")
    batches = lambda examples, epoch: kto_batches(examples, c.train.batch_size, c.data.max_seq_len, c.data.seed, epoch,
                                                  _mismatched(k), images)
    steps = math.ceil(math.ceil(len(train) / c.train.batch_size) / c.train.grad_accum)

    def evaluate(eval_step, params):  # reads `held_out`, which keeps its token store (and the cache's files) alive
        return held_out_metrics(total([eval_step(params, b) for b in batches(held_out, 0)]))

    return ObjectiveData(steps, epoch_cache(lambda e: batches(train, e), c.train.grad_accum),
                         evaluate if held_out else None)


def image_split(setup: ObjectiveInputs) -> tuple[list, list]:
    """(train, held-out) labelled examples with images (`image_labelled_examples`), read each run."""
    data = setup.config.data
    read = lambda path: list(image_labelled_examples(path, setup.tokenizer, setup.images, data.max_seq_len,
                                                     dict(data.columns)))
    examples = read(data.train)
    train, held_out = (examples, read(data.eval)) if data.eval else train_eval_split(examples, data.eval_fraction,
                                                                                     data.seed)
    images = sum(e.images for e in examples)
    setup.log(f"data: {len(train)} train / {len(held_out)} eval examples with {images} pixel arrays")
    return list(train), list(held_out)


def _second_model(section: KTOConfig, method) -> str | None:
    return "base" if method_unit(method).trains_base else None  # adapter methods: the base with adapters off


def _batch_fields(rows: int, _seq_len: int, section: KTOConfig) -> dict:
    return {"desirable": jax.ShapeDtypeStruct((rows,), np.float32)}


KTO = Objective("kto", loss_terms, eval_terms, prepare, section=KTOConfig,
                rows=lambda section: 2 if _mismatched(section) else 1, batch_fields=_batch_fields,
                # the reference's forward holds a [b, T, V] chunk more than DPO's count for an adapter method (a
                # LoRA KTO step on XLA:CPU: 19% above the estimate with 2)
                second_model=_second_model, logits_copies=lambda method, section: 3, unit="examples",
                extra_forwards=lambda section: 1, reads_images=True)
