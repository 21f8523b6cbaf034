"""Supervised fine-tuning (`SFT`; `batch_loss`, and `sft_training` for the data): the masked causal-LM loss over
completion tokens (prompt tokens never count).

A micro-batch is `batch_size` packed rows (`data/batching.py`): several examples a row, none attending to another.
The loss is the sum of -log p(label) over completion tokens and EOS, divided once by their count over all the
step's micro-batches; held-out loss and perplexity are the same ratio over the whole held-out set. A mixture of
experts trained with its load-balancing loss (`ModelConfig.output_router_logits`) adds coef x that loss per token,
so a step of one micro-batch minimises transformers' `loss + router_aux_loss_coef * aux_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxtune.data.batching import ImageRows, count_epoch_rows, epoch_batches
from jaxtune.data.cache import cached_examples
from jaxtune.data.formats import DataStats, sft_chat_examples, sft_examples, train_eval_split
from jaxtune.data.image_examples import ImageExample, image_sft_examples
from jaxtune.data.store import example_lengths
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.methods.vision import with_lora_scales
from jaxtune.models.head import label_logps
from jaxtune.models.llama import decoder_and_routing
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs, epoch_cache, total


def batch_loss(params: dict, batch: dict, ctx: Context, dropout_key: jax.Array | None = None,
               router_loss: bool = False) -> tuple[jax.Array, jax.Array]:
    """(sum of completion-token losses, number of completion tokens) of one [B, T] batch (with `pixel_values`
    [B, M, ...]: its images, through the run's image side `ctx.images`).

    dropout_key: training with LoRA dropout (see `llama.decoder`); None: no dropout. router_loss: add a mixture's
    load-balancing term (training, when the model asks for it), coef x loss x tokens.
    """
    tokens_BxT, inputs = batch["input_ids"], dict(positions_BxT=batch["positions"])
    if "pixel_values" in batch:  # a vision-language batch: the tower's soft tokens over the placeholders
        side = ctx.images
        vision = with_lora_scales(params["vision"], ctx.method, side.family)  # trained or frozen, as the tree holds
        tokens_BxT, inputs = side.family.image_inputs(vision, tokens_BxT,
                                                      batch["pixel_values"], batch["positions"], ctx.cfg, side.config,
                                                      jnp.dtype(ctx.options.compute_dtype))
    hidden, balance = decoder_and_routing(params, tokens_BxT, ctx.cfg,
                                          segment_ids_BxT=batch["segment_ids"], method=ctx.method,
                                          options=ctx.options, dropout_key=dropout_key, **inputs)
    logps = label_logps(params, hidden, batch["labels"], ctx.cfg.final_logit_softcap)
    mask = batch["loss_mask"].astype(logps.dtype)
    loss, count = -jnp.sum(logps * mask), jnp.sum(mask)
    if router_loss and balance is not None and ctx.cfg.output_router_logits:
        loss = loss + ctx.cfg.router_aux_loss_coef * balance * count
    return loss, count


def loss_terms(ctx: Context):
    def terms(trainable, frozen, _second, micro, key=None):
        loss, count = batch_loss(combine(trainable, frozen), micro, ctx, key, router_loss=True)
        return loss, (count, {})

    return terms


def eval_terms(ctx: Context):
    def terms(params, _second, batch):
        loss, tokens = batch_loss(params, batch, ctx)
        return {"loss": loss, "tokens": tokens}

    return terms


def perplexity(mean_loss: float) -> float:
    return math.exp(mean_loss) if mean_loss < 700 else math.inf


def loss_metrics(sums: dict) -> dict:
    """eval_loss (the mean over every completion token), eval_perplexity and eval_tokens from held-out sums."""
    tokens = sums.get("tokens", 0.0)
    loss = sums["loss"] / tokens if tokens else math.nan
    return {"eval_loss": loss, "eval_perplexity": perplexity(loss), "eval_tokens": int(tokens)}


def train_and_held_out(setup: ObjectiveInputs, stream, unit: str) -> tuple[Sequence, Sequence]:
    """(train, held-out) examples streamed by `stream(path, tokenizer, seq_len, columns, stats)` from data.train (and
    data.eval, else a split of train), tokenised once into stores in `setup.cache_dir` (`data.cache`), logged as
    `unit`."""
    data = setup.config.data
    read = lambda path: cached_examples(setup.cache_dir, stream, path, setup.tokenizer, data.max_seq_len,
                                        dict(data.columns), setup.log, setup.cache_writes)
    examples, stats = read(data.train)
    held_out = read(data.eval)[0] if data.eval else None
    train, held_out = (examples, held_out) if held_out is not None else train_eval_split(
        examples, data.eval_fraction, data.seed)
    setup.log(f"data: {len(train)} train / {len(held_out)} eval {unit} ({stats.dropped_prompt_too_long} dropped: "
              f"prompt >= max_seq_len {data.max_seq_len}; {stats.truncated} truncated)")
    raw = sum(stats.formats.get(f, 0) for f in ("prompt/completion", "alpaca"))
    if raw and setup.tokenizer.chat_template and not data.apply_chat_template:
        setup.log(f"note: the model has a chat template and {raw} records of data.train are prompt/completion or "
                  "alpaca, trained as raw text; data.apply_chat_template = true trains them as chat turns")
    return train, held_out


def sft_split(setup: ObjectiveInputs) -> tuple[Sequence, Sequence]:
    """(train, held-out) SFT examples of data.train and data.eval (`train_and_held_out`); for a vision-language
    model, `ImageExample`s with their pixel arrays, read each run (not cached: the store keeps tokens only)."""
    if setup.images is not None:
        return image_split(setup)
    stream = sft_chat_examples if setup.config.data.apply_chat_template else sft_examples
    return train_and_held_out(setup, stream, "examples")


def image_split(setup: ObjectiveInputs) -> tuple[Sequence, Sequence]:
    data = setup.config.data
    stats = DataStats()
    read = lambda path, stats: list(image_sft_examples(path, setup.tokenizer, setup.images, data.max_seq_len,
                                                       dict(data.columns), stats, data.apply_chat_template))
    examples = read(data.train, stats)
    train, held_out = (examples, read(data.eval, DataStats())) if data.eval else train_eval_split(
        examples, data.eval_fraction, data.seed)
    images = sum(e.images for e in examples if isinstance(e, ImageExample))
    setup.log(f"data: {len(train)} train / {len(held_out)} eval examples with {images} pixel arrays "
              f"({stats.dropped_prompt_too_long} dropped: prompt >= max_seq_len {data.max_seq_len}; "
              f"{stats.truncated} truncated)")
    return train, held_out


def sft_training(setup: ObjectiveInputs, metrics=loss_metrics, split: tuple | None = None) -> ObjectiveData:
    """Packed SFT batches of data.train, and the held-out loss of its held-out part through `metrics`. split: the
    (train, held-out) examples when the caller has read them (`sft_split`)."""
    c = setup.config
    train, held_out = split or sft_split(setup)
    images = None if setup.images is None else ImageRows(c.data.max_images_per_row, setup.images.pixel_shape)
    batches = lambda examples, epoch: epoch_batches(examples, c.train.batch_size, c.data.max_seq_len, c.data.seed,
                                                    epoch, c.data.pack, images)
    rows = count_epoch_rows(train, c.data.max_seq_len, c.data.pack, images)
    steps = math.ceil(math.ceil(rows / c.train.batch_size) / c.train.grad_accum)
    held_out_batches = batches(held_out, 0) if held_out else []
    evaluate = (lambda eval_step, params: metrics(total([eval_step(params, b) for b in held_out_batches])))
    return ObjectiveData(steps, epoch_cache(lambda e: batches(train, e), c.train.grad_accum),
                    evaluate if held_out_batches else None, rows_per_epoch=rows,
                    tokens_per_epoch=int((example_lengths(train) - 1).clip(0).sum()))


SFT: Objective[None] = Objective("sft", loss_terms, eval_terms, sft_training,
                                 logits_copies=lambda method, section: 3 if method_unit(method).trains_base else 2,
                                 reads_images=True, trains_images=True)
