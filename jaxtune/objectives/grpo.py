"""GRPO (Shao et al. 2024, DeepSeekMath): online policy optimisation against a reward function, no critic (`GRPO`,
its section `GRPOConfig`); RLOO (`rloo.py`) shares its rollouts, rewards and data (`RolloutConfig`, `make_prepare`).
Each step: sample `group_size` completions a prompt (`sample_group`), score them, normalise the rewards into
advantages (`group_advantages`), pad the rows to the power-of-two bucket of the longest (a compile per bucket), and
step on the clipped-ratio objective (or CISPO's) with a KL penalty to the reference (the base, adapters off; a frozen
copy for a full fine-tune), aggregated as TRL 1.16's `loss_type`. With `num_iterations` > 1 a batch serves that many
steps with the learner's log-probs at sampling (`old_logps`; `rollout_store`); another sampler's (`sampler_logps`)
weight the loss as TRL's importance sampling does. The reward: `reward(prompts, completions, **fields)` by a dotted
path (`load_reward_function`; other fields as keyword lists) or a reward model (`reward_model_function`). A
vision-language policy reads TRL's prompts with images (`data.image_prompts`): samples and log-probs see them."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import trimmed_to_longest
from jaxtune.data.formats import PromptExample, load_prompt_examples, train_eval_split
from jaxtune.data.image_prompts import ImagePrompt, image_prompt_examples
from jaxtune.data.tokenizer import Tokenizer, load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.image_decoding import PromptImages
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.models.head import head_logits, label_logps, per_token, token_logps, vocab_size
from jaxtune.models.llama import decoder
from jaxtune.models.reward_model import reward_scores
from jaxtune.models.vision.family import ImageSide
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs, reference_of
from jaxtune.objectives.dpo import sequence_row
from jaxtune.objectives.episode_rollouts import episode_batch, episode_rollouts
from jaxtune.objectives.losses import (
    grpo_aggregate,
    grpo_token_loss,
    sampler_weights,
)
from jaxtune.objectives.reward_functions import (
    column_stats,
    column_weights,
    grpo_table_advantages,
    nanmean,
    reward_names,
    scored_by,
    unscorable_rows,
    weighted_sum,
)
from jaxtune.objectives.rollout_config import GRPOConfig, RolloutConfig
from jaxtune.objectives.rollout_store import RolloutStore
from jaxtune.parallel.distributed import host_copy, scored_in_shares
from jaxtune.rollouts.decoders import sampled_groups
from jaxtune.rollouts.external_sampler import ExternalSampler, sample_group_external
from jaxtune.stop_strings import StopStrings


def load_reward_function(path: str):
    """The callable named by `path`; a clear error when the module or attribute cannot be imported."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise JaxtuneError(f"reward {path!r}: expected a dotted path such as 'mypackage.rewards.exact_match'")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise JaxtuneError(f"reward {path!r} cannot be imported: {e}") from None
    if not callable(function):
        raise JaxtuneError(f"reward {path!r} is not callable")
    return function


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], rewards: Sequence[float] | np.ndarray,
                  advantages: np.ndarray, seq_len: int, eos_ids: Sequence[int] = (),
                  sampler_logps: Sequence[Sequence[float]] | None = None,
                  stopped: Sequence[bool] | None = None, reward_columns: dict | None = None) -> dict:
    """Rows prompt + completion as [N, T] arrays (as SFT batches; T the `padded_length` of the longest, at most
    seq_len), plus `rewards` [N] and their `advantages` [N] (rows of a prompt's group are consecutive). eos_ids: if
    given, a completion that does not end with one of them (nor at a stop string: `stopped` [N]) has no loss tokens
    (`mask_truncated_completions`). sampler_logps: the sampler's log-prob of each completion token, one list a row,
    as `sampler_logps` [N, T] at the positions that predict them (NaN: not reported). reward_columns: {name: [N]}
    each reward's scores (NaN: None), as `rewards/<name>` [N] (the metrics `rewards/<name>/mean`, `/std`)."""
    N = len(completions)
    batch: dict[str, np.ndarray] = {k: np.zeros((N, seq_len), np.float32 if k == "loss_mask" else np.int32)
                                    for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
    if sampler_logps is not None:
        batch["sampler_logps"] = np.zeros((N, seq_len), np.float32)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = (prompt + completion)[: seq_len + 1]
        n = len(ids) - 1
        batch["input_ids"][i, :n], batch["labels"][i, :n] = ids[:-1], ids[1:]
        truncated = bool(eos_ids) and not (completion and completion[-1] in eos_ids) and not (stopped and stopped[i])
        start = len(prompt) - 1  # the position that predicts the completion's first token
        batch["loss_mask"][i, start:n] = 0.0 if truncated else 1.0
        batch["segment_ids"][i, :n], batch["positions"][i, :n] = 1, np.arange(n)
        if sampler_logps is not None:
            batch["sampler_logps"][i, start:n] = np.asarray(sampler_logps[i], np.float32)[:n - start]
    batch["rewards"] = np.asarray(rewards, np.float32)
    batch["advantages"] = np.asarray(advantages, np.float32)
    for name, column in (reward_columns or {}).items():
        batch[f"rewards/{name}"] = np.asarray(column, np.float32)
    return trimmed_to_longest(batch, seq_len)


def soft_overlong_punishment(lengths: Sequence[int], max_completion_len: int, cache: int) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of completions of `lengths` tokens [N]: 0 up to
    max_completion_len - cache tokens, ((max_completion_len - cache) - length) / cache up to max_completion_len, -1
    beyond (TRL 1.16's `get_soft_overlong_punishment`)."""
    lengths_N = np.asarray(lengths, np.float64)
    start = max_completion_len - cache
    penalty = np.where(lengths_N <= start, 0.0, (start - lengths_N) / max(cache, 1))
    return np.where(lengths_N > max_completion_len, -1.0, penalty)


def stops_of(section: RolloutConfig, tokenizer: Tokenizer | None, rows: int) -> StopStrings | None:
    """The section's `stop_strings` for `rows` completions (None: none)."""
    if not section.stop_strings:
        return None
    if tokenizer is None:
        raise JaxtuneError("stop_strings: completions are cut by their text, which needs the tokenizer")
    return StopStrings.of(tokenizer, section.stop_strings, rows)


def sample_group(params: dict, cfg: ModelConfig, method: MethodConfig | None, prompts: list[list[int]],
                 grpo: RolloutConfig, seed: int, eos_ids, tokenizer: Tokenizer | None = None,
                 images: PromptImages | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """G completions per prompt from the current policy: (prompt of each row, completion of each row); a completion
    that stopped ends with its EOS, or with the token that completed one of the section's `stop_strings` (decoded by
    `tokenizer`), so the step's loss covers the choice to stop. images: the prompts' pixel arrays, which the samples
    are conditioned on (`params["vision"]` the image side's weights)."""
    repeated = [p for p in prompts for _ in range(grpo.group_size)]
    sampling = SamplingConfig(max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature, top_k=grpo.top_k,
                              top_p=grpo.top_p, seed=seed)
    stops = stops_of(grpo, tokenizer, len(repeated))
    return repeated, sampled_groups(params, cfg, prompts, grpo.group_size, sampling, grpo, eos_ids=eos_ids,
                                    method=method, stop_token_ids=stops.token_ids() if stops else [], stop_when=stops,
                                    images=images)


def group_advantages(rewards, grpo: GRPOConfig) -> np.ndarray:
    """GRPO's advantages [N] of a step's reward table [N, K] (a column a reward, NaN where it returned None; weighted
    by the section's `reward_weights`) or of rewards already summed [N], groups of `group_size` consecutive rows
    (`reward_functions.grpo_table_advantages`: scale_rewards, multi_objective_aggregation)."""
    return grpo_table_advantages(rewards, column_weights(grpo), grpo.group_size, grpo.scale_rewards,
                                 grpo.multi_objective_aggregation)


def _hidden(params, cfg, batch, method, options, dropout_key=None, images: ImageSide | None = None):
    """The decoder's output [B, T, D] of rollout rows; with the run's image side `images` (its weights
    `params["vision"]`, frozen), each row reads its prompt's images, the batch's `pixel_values` [B, M, ...]."""
    tokens_BxT, inputs = batch["input_ids"], dict(positions_BxT=batch["positions"])
    if images is not None:
        tokens_BxT, inputs = images.family.image_inputs(jax.lax.stop_gradient(params["vision"]), tokens_BxT,
                                                        batch["pixel_values"], batch["positions"], cfg, images.config,
                                                        jnp.dtype(options.compute_dtype))
    return decoder(params, tokens_BxT, cfg, segment_ids_BxT=batch["segment_ids"], method=method, options=options,
                   dropout_key=dropout_key, **inputs)


def _token_logps(params, cfg, batch, method, options, temperature: float, dropout_key=None, images=None):
    hidden = _hidden(params, cfg, batch, method, options, dropout_key, images)
    return label_logps(params, hidden, batch["labels"], cfg.final_logit_softcap, temperature)


def _token_logps_and_entropy(params, cfg, batch, method, options, temperature: float, dropout_key=None,
                             entropy_grad: bool = False, images=None):
    """(log p(label), the entropy of p) [B, T] of the logits divided by `temperature`, a chunk of tokens at a time
    (`head.per_token`): the entropy is logsumexp(z) - sum softmax(z) z of the chunk's logits z, of constant logits
    unless entropy_grad (so that the backward keeps nothing of it: a GRPO step's bytes as without the metric)."""
    hidden = _hidden(params, cfg, batch, method, options, dropout_key, images)

    def chunk(hidden_BxCxD, labels_BxC):
        logits_BxCxV = head_logits(params, hidden_BxCxD, cfg.final_logit_softcap) / temperature
        z_BxCxV = logits_BxCxV if entropy_grad else jax.lax.stop_gradient(logits_BxCxV)
        lse_BxC = jax.nn.logsumexp(z_BxCxV, axis=-1)  # one fused reduction below: no [B, C, V] probabilities
        entropy_BxC = lse_BxC - jnp.sum(jnp.exp(z_BxCxV - lse_BxC[..., None]) * z_BxCxV, axis=-1)
        return token_logps(logits_BxCxV, labels_BxC), entropy_BxC

    return per_token(chunk, hidden, batch["labels"], vocab=vocab_size(params))


def policy_and_reference_logps(ctx: Context, trainable, frozen, second, micro, key=None, entropy_grad: bool = False):
    """log p(label) [B, T] under the policy (differentiable) and under the reference (constant), both of the logits
    divided by the sampling temperature, as TRL's GRPO and RLOO trainers score them, and the policy's entropy
    [B, T] (differentiable if entropy_grad, else constant). Rows with images: both read them (`_hidden`)."""
    t = ctx.section.temperature
    policy, reference = combine(trainable, frozen), reference_of(frozen, second)
    if "vision" in policy and "vision" not in reference:  # a reference of its own reads the same images
        reference = {**reference, "vision": policy["vision"]}
    logp, entropy = _token_logps_and_entropy(policy, ctx.cfg, micro, ctx.method, ctx.options, t, key, entropy_grad,
                                             ctx.images)
    ref_logp = _token_logps(reference, ctx.cfg, micro, None, ctx.options, t, images=ctx.images)
    return logp, jax.lax.stop_gradient(ref_logp), entropy if entropy_grad else jax.lax.stop_gradient(entropy)


def old_logps_of(micro: dict, logp_BxT: jax.Array) -> jax.Array:
    """The old policy's per-token log-probs [B, T]: the batch's `old_logps` (the learner's at sampling time, kept for
    `num_iterations` steps, or one update stale with `off_policy_steps`), else the current policy's as a constant (one
    step per batch: the ratio is 1 in value but not in gradient)."""
    return micro["old_logps"] if "old_logps" in micro else jax.lax.stop_gradient(logp_BxT)


def keeps_learner_logps(section: RolloutConfig) -> bool:
    """Whether a rollout batch carries the learner's per-token log-probs at sampling time as `old_logps`: reused for
    num_iterations steps, sampled one step ahead (off_policy_steps), or weighted against another sampler's. One step
    ahead with the sampler's correction, they are the batch's `sampler_logps` instead (the sampling policy one update
    behind) and the old policy is the learner's at the step (`old_logps_of`), as TRL's with a lagging vLLM."""
    if section.off_policy_steps and sampler_corrected(section):
        return False
    return section.num_iterations > 1 or section.off_policy_steps > 0 or sampler_corrected(section)


def sampler_corrected(section: RolloutConfig) -> bool:
    """Whether the policy term is weighted between sampler and learner (the batch carries `sampler_logps`)."""
    return isinstance(section, GRPOConfig) and section.sampler_importance_sampling_correction


def counts_micro_tokens(section: RolloutConfig) -> bool:
    """Whether the entropy bonus needs the step's tokens per micro-batch (`tokens_per_micro`, dapo and cispo)."""
    return isinstance(section, GRPOConfig) and bool(section.entropy_coef) and section.loss_type in ("dapo", "cispo")


def loss_terms(ctx: Context):
    """GRPO's clipped-ratio (or CISPO) objective with a KL penalty to the reference and an entropy bonus, per
    micro-batch of rollouts (`losses.grpo_token_loss`). Metrics "kl" and "entropy": the KL estimator and the
    policy's entropy over the completion tokens, aggregated as the loss aggregates its terms."""
    g = ctx.section

    def terms(trainable, frozen, second, micro, key=None):
        logp, ref_logp, entropy = policy_and_reference_logps(ctx, trainable, frozen, second, micro, key,
                                                             entropy_grad=bool(g.entropy_coef))
        mask = micro["loss_mask"]
        old = old_logps_of(micro, logp)
        weights = (sampler_weights(old, micro["sampler_logps"], mask, g.sampler_importance_sampling_mode,
                                   *g.sampler_clip) if sampler_corrected(g) else None)
        total_, count = grpo_token_loss(logp, old, ref_logp, micro["advantages"], mask, g.clip, g.kl_coef,
                                        clip_high=g.clip_high, delta=g.delta or None,
                                        level=g.importance_sampling_level, loss_type=g.loss_type,
                                        max_completion_length=g.max_new_tokens, weights=weights, entropy_BxT=entropy,
                                        top_entropy_quantile=g.top_entropy_quantile, entropy_coef=g.entropy_coef,
                                        tokens_per_micro=micro["tokens_per_micro"] if counts_micro_tokens(g) else None)
        kl, _ = grpo_aggregate(jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1, mask, g.loss_type, g.max_new_tokens)
        entropy_sum, _ = grpo_aggregate(entropy, mask, g.loss_type, g.max_new_tokens)
        return total_, (count, {"kl": jax.lax.stop_gradient(kl), "entropy": jax.lax.stop_gradient(entropy_sum)})

    return terms


def eval_terms(ctx: Context):
    """GRPO's held-out score is the mean reward of greedy completions (`prepare`), not a sum over batches."""
    return None


def reward_model_function(directory: str, seq_len: int, load_reward_model):
    """A reward function `(prompts, completions, **fields) -> rewards` that scores prompt + completion (cut to
    `seq_len` tokens) with the reward model in `directory` (as `objective = "reward"` exports it), read by
    `load_reward_model(directory) -> (cfg, params)`."""
    cfg, params = load_reward_model(directory)
    tokenizer = load_tokenizer(directory)
    score = jax.jit(lambda p, batch: reward_scores(p, batch, cfg, None, ForwardOptions()))

    def reward(prompts: list[str], completions: list[str], **_) -> list[float]:
        rows = []
        for prompt, completion in zip(prompts, completions):
            p = tokenizer.encode(prompt)
            ids = (p + tokenizer.encode(completion, add_special_tokens=False))[:seq_len]
            rows.append(sequence_row((*ids, 0), min(len(p), seq_len), seq_len))  # 0: a target nothing reads
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        return np.asarray(score(params, batch)).tolist()

    return reward


Rollout = TypeVar("Rollout", bound=RolloutConfig)  # a `RolloutConfig`: GRPO's section, RLOO's


def make_prepare(name: str, advantages: Callable[[np.ndarray, Rollout], np.ndarray]):
    """The `prepare` of objective `name` whose section is a `RolloutConfig`: prompts of data.train; each step samples
    `group_size` completions of `batch_size x grad_accum` of them with the current policy, scores them and turns the
    rewards into advantages, `advantages(reward table [N, K], section) -> [N]`."""
    return lambda setup: _prepare(setup, name, advantages)


def _prepare(setup: ObjectiveInputs, name: str, advantages) -> ObjectiveData:
    c, g, tok, cfg = setup.config, setup.section, setup.tokenizer, setup.cfg
    seq_len, tc, method = c.data.max_seq_len, c.train, c.method
    if bool(g.reward or g.reward_model) == bool(g.environment):
        raise JaxtuneError(f"[{name}] set reward (reward functions' dotted paths, e.g. ['mypkg.rewards.exact']) "
                           "and/or reward_model (a reward model directory), or else environment (episodes: 'tools' or "
                           "a dotted path)")
    if c.offload.frozen_params:
        raise JaxtuneError(f"[offload] frozen_params = true is not supported with objective {name} (rollouts "
                           "decode from the frozen weights every step); set it to false")
    sources = [(path, load_reward_function(path)) for path in g.reward]  # (what errors name, the function)
    if g.reward_model:
        sources.append((g.reward_model, reward_model_function(g.reward_model, seq_len, setup.load_reward_model)))
    names, weights = reward_names(g), column_weights(g)
    processor = setup.images  # a vision-language policy: prompts with images (TRL's format), samples that see them
    side = None if processor is None else ImageSide(processor.family, processor.config, c.data.max_images_per_row,
                                                    processor.pixel_shape)
    if side is not None and (g.environment or g.sampler_url or g.rollout_engine == "paged"):
        raise JaxtuneError(f"[{name}] " + ("rollout_engine = \"paged\"" if g.rollout_engine == "paged" else
                                           "environment" if g.environment else "sampler_url")
                           + " does not take a vision-language model's prompts with images yet (they decode padded, "
                           "with their pixel arrays: rollout_engine = \"padded\", no environment or sampler_url)")
    read: Callable[[str], Sequence[PromptExample | ImagePrompt]] = (
        (lambda path: load_prompt_examples(path, dict(c.data.columns))) if processor is None else
        (lambda path: image_prompt_examples(path, tok, processor, c.data.max_images_per_row, dict(c.data.columns))))
    ids_of = (lambda e: tok.encode(e.prompt)) if side is None else (lambda e: list(e.ids))
    examples = read(c.data.train)
    held_out: Sequence[PromptExample | ImagePrompt] | None = read(c.data.eval) if c.data.eval else None
    fits = lambda e: len(ids_of(e)) + g.max_new_tokens <= seq_len + 1
    kept = [e for e in examples if fits(e)]
    train, held_out = (kept, held_out) if held_out is not None else train_eval_split(kept, c.data.eval_fraction,
                                                                                     c.data.seed)
    held_out = [e for e in held_out if fits(e)]
    per_step = tc.batch_size * tc.grad_accum
    setup.log(f"data: {len(train)} train / {len(held_out)} eval prompts ({len(examples) - len(kept)} dropped: "
              f"prompt + max_new_tokens {g.max_new_tokens} > max_seq_len {seq_len} + 1)")
    if len(train) < per_step:
        raise JaxtuneError(f"{c.data.train}: {len(train)} training prompts, fewer than batch_size x grad_accum = "
                           f"{per_step} per step")
    eos = sorted({*cfg.eos_token_id, *([tok.eos_id] if tok.eos_id is not None else [])})

    def rewards(chosen: list, completions: list[list[int]], repeat: int) -> np.ndarray:
        """The reward table [N, len(sources)] (NaN: None): each process decodes and scores its share of the rows with
        every reward (`scored_in_shares`)."""
        names = sorted({k for e in chosen for k in e.fields})
        fields = {k: [e.fields.get(k) for e in chosen for _ in range(repeat)] for k in names}
        prompts = [e.prompt for e in chosen for _ in range(repeat)]

        stops = stops_of(g, tok, len(completions))

        def text(i: int) -> str:  # cut before a stop string, whose tokens the loss credits
            decoded = tok.decode(completions[i])
            return decoded if stops is None else stops.cut_text(i, decoded)

        def score(rows: list[int]) -> np.ndarray:
            texts, row_prompts = [text(i) for i in rows], [prompts[i] for i in rows]
            row_fields = {k: [v[i] for i in rows] for k, v in fields.items()}
            return np.stack([scored_by(label, fn, row_prompts, texts, row_fields) for label, fn in sources], axis=1)

        return scored_in_shares(score, len(completions), columns=len(sources))

    def scored_table(chosen: list, completions: list[list[int]]) -> np.ndarray:
        """A rollout batch's reward table [N, K]: each reward's column, then the soft overlong punishment's."""
        table = rewards(chosen, completions, g.group_size)
        if g.soft_punish_cache:
            punished = soft_overlong_punishment([len(t) for t in completions], g.max_new_tokens, g.soft_punish_cache)
            table = np.concatenate([table, punished[:, None]], axis=1)
        unscored = unscorable_rows(table)
        if len(unscored):  # TRL warns too: they get no reward and advantage 0
            setup.log(f"[{name}] every reward returned None for {len(unscored)} of {len(table)} completions (e.g. "
                      f"of prompt {chosen[unscored[0] // g.group_size].prompt[:60]!r}): they get advantage 0")
        return table

    if g.num_iterations > 1 and tc.checkpoint_every % g.num_iterations:
        raise JaxtuneError(f"[{name}] num_iterations = {g.num_iterations} with [train] checkpoint_every = "
                           f"{tc.checkpoint_every}: a checkpoint must fall between rollout batches (a resumed run "
                           f"cannot sample a batch again); use a multiple of {g.num_iterations}")
    if g.rollout_engine == "paged" and g.sampler_url:
        raise JaxtuneError(f"[{name}] rollout_engine = \"paged\" is jaxtune's own decoder, not the external sampler's "
                           "(sampler_url); unset one of them")
    sampler = ExternalSampler.from_config(g.external_sampler) if g.sampler_url else None
    if sampler is not None and jax.process_count() > 1:
        raise JaxtuneError(f"[{name}] sampler_url with {jax.process_count()} processes: an external sampler is "
                           "spoken to from one process; run the trainer in one (its mesh may span that host's devices)")
    directory = None if setup.cache_dir is None else Path(setup.cache_dir) / "rollouts"
    # one-step-off: a hard-killed run resumes from its last checkpoint, up to checkpoint_every batches back
    store = RolloutStore(directory, keep=max(2, tc.checkpoint_every + 1) if g.off_policy_steps else 2)
    options = c.model.forward.resolved(jax.default_backend())
    learner_logps = jax.jit(lambda params, micro: _token_logps(params, cfg, micro, method, options, g.temperature,
                                                               images=side))

    prompt_images = lambda chosen: None if side is None else PromptImages.of(side, [p.pixel_values for p in chosen])

    def sample(epoch: int, generation: int, params) -> Callable[[], dict]:
        """Rollout batch `generation` of `epoch`, in two parts: this call decodes with `params()` and dispatches the
        learner's log-probs of the samples with them (all the device work that needs those parameters); the
        function it returns scores the completions on the host and returns the batch, so a step dispatched in
        between, which may donate the parameters, runs while the host scores (`off_policy_steps`)."""
        order = np.random.default_rng([c.data.seed, epoch]).permutation(len(train))
        chosen = [train[j] for j in order[generation * per_step:(generation + 1) * per_step]]
        seed = int(np.random.default_rng([tc.seed, epoch, generation]).integers(2**31))
        policy = params()
        completions: list[list[int]] = []
        if g.environment:
            ids, masks, scores = episode_rollouts(policy, cfg, method, records(chosen, g.group_size), g, seed, eos, tok,
                                                  seq_len + 1)
            rollouts = episode_batch(ids, masks, scores, advantages(scores, g), seq_len)
        else:
            prompts, sampled, images = [ids_of(e) for e in chosen], None, prompt_images(chosen)
            if sampler is None:
                rows, completions = sample_group(policy, cfg, method, prompts, g, seed, eos, tok, images)
            else:  # the rollout batch's number over the run, for push_every
                number = epoch * (steps_per_epoch // g.num_iterations) + generation
                rows, completions, sampled = sample_group_external(
                    sampler, policy, cfg, method, prompts, g, seed, eos, number, g.sampler_push_every,
                    g.sampler_weights)
            n = len(completions)  # rewards, advantages and each reward's column once scored (`finish`)
            stops = stops_of(g, tok, n)
            stopped = None if stops is None else [stops(i, c) for i, c in enumerate(completions)]
            rollouts = rollout_batch(rows, completions, [0.0] * n, np.zeros(n), seq_len,
                                     eos_ids=eos if g.mask_truncated_completions else (),
                                     sampler_logps=sampled if sampler_corrected(g) else None,
                                     stopped=stopped)
            if images is not None:  # each row reads its prompt's images in the step
                rollouts["pixel_values"] = np.repeat(images.pixels, g.group_size, axis=0)
        stacked = {k: v.reshape(tc.grad_accum, -1, *v.shape[1:]) for k, v in rollouts.items()}
        # the old policy's, scored once with the parameters that sampled (dispatched now, read in `finish`)
        old = ([learner_logps(policy, {k: v[a] for k, v in stacked.items()}) for a in range(tc.grad_accum)]
               if keeps_learner_logps(g) or sampler_corrected(g) else None)

        def finish() -> dict:
            if not g.environment:
                table = scored_table(chosen, completions)  # [N, K]: a column a reward
                per_row = {"rewards": weighted_sum(table, weights), "advantages": advantages(table, g),
                           **{f"rewards/{label}": column for label, column in zip(names, table.T)}}
                stacked.update({k: np.asarray(v, np.float32).reshape(tc.grad_accum, -1) for k, v in per_row.items()})
            sampling = None if old is None else np.stack([host_copy(x) for x in old]) * (stacked["loss_mask"] > 0)
            if keeps_learner_logps(g):
                stacked["old_logps"] = sampling
            if sampler_corrected(g) and "sampler_logps" not in stacked:  # jaxtune's sampler is the learner: weights 1
                stacked["sampler_logps"] = sampling  # unless one step ahead: the learner's a step behind
            if counts_micro_tokens(g):
                stacked["tokens_per_micro"] = np.full(stacked["rewards"].shape,
                                                      stacked["loss_mask"].sum() / tc.grad_accum, np.float32)
            return stacked

        return finish

    def batch(epoch: int, index: int, params) -> dict:
        if g.off_policy_steps and (epoch, index) != (0, 0):  # sampled a step ahead (`ahead`), or at a resume read back
            stored = store.find(epoch, index)
            if stored is not None:
                return stored
            setup.log(f"[{name}] step {epoch * steps_per_epoch + index + 1}: no rollout batch sampled ahead for it "
                      f"(in memory or {directory or 'no run directory'}); sampled now with the current parameters")
            return sample(epoch, index, params)()
        generation, iteration = divmod(index, g.num_iterations)  # one rollout batch for num_iterations steps
        if iteration:
            return store.get(epoch, generation, f"[{name}] step {index + 1} of epoch {epoch + 1}")
        stacked = sample(epoch, generation, params)()
        if g.num_iterations > 1:
            store.put(epoch, generation, stacked)
        return stacked

    def ahead(epoch: int, index: int, params) -> Callable[[], dict]:
        """One-step-off: step `index` of `epoch`'s batch sampled now, with the parameters of the step before it,
        scored and stored (memory and the run's directory, for a resume) by the function returned."""
        finish = sample(epoch, index, params)

        def stored() -> dict:
            stacked = finish()
            store.put(epoch, index, stacked)
            return stacked

        return stored

    def records(chosen: list, repeat: int) -> list[dict]:
        """Each prompt record `repeat` times, as an environment's reset takes it."""
        return [{"prompt": e.prompt, **e.fields} for e in chosen for _ in range(repeat)]

    def evaluate(_eval_step, params) -> dict:
        if g.environment:  # greedy episodes: the least temperature sampling takes
            greedy_episodes = replace(g, temperature=1e-6, top_k=1)
            _, _, scores = episode_rollouts(params, cfg, method, records(held_out, 1), greedy_episodes, 0, eos, tok,
                                            seq_len + 1)
            return {"eval_reward": float(np.mean(scores))}
        greedy = SamplingConfig(max_new_tokens=g.max_new_tokens, temperature=0.0)
        stops = stops_of(g, tok, len(held_out))
        completions = sampled_groups(params, cfg, [ids_of(e) for e in held_out], 1, greedy, g, eos_ids=eos,
                                     method=method, stop_token_ids=stops.token_ids() if stops else [],
                                     stop_when=stops, images=prompt_images(held_out))
        table = rewards(held_out, completions, 1)  # the soft overlong punishment left out, as before several rewards
        return {"eval_reward": float(nanmean(weighted_sum(table, weights[:len(sources)]))),
                **column_stats(table, names[:len(sources)], "eval_")}

    steps_per_epoch = len(train) // per_step * g.num_iterations
    return ObjectiveData(steps_per_epoch, batch, evaluate if held_out else None,
                         ahead=ahead if g.off_policy_steps else None)


def _batch_fields(rows: int, seq_len: int, section: RolloutConfig) -> dict:
    per_row = (["advantages", "rewards"] + ["tokens_per_micro"] * counts_micro_tokens(section)
               + [f"rewards/{n}" for n in reward_names(section)])
    per_token = ["old_logps"] * keeps_learner_logps(section) + ["sampler_logps"] * sampler_corrected(section)
    return {**{k: jax.ShapeDtypeStruct((rows,), np.float32) for k in per_row},
            **{k: jax.ShapeDtypeStruct((rows, seq_len), np.float32) for k in per_token}}


def _batch_metrics(batch: dict) -> dict:
    """"reward": the mean over the rows some reward scored of their weighted sum; "rewards/<name>/mean" and "/std":
    each reward's over the rows it scored (TRL's names; std with Bessel's correction)."""
    metrics = {"reward": jnp.nanmean(batch["rewards"])}
    for key in sorted(k for k in batch if k.startswith("rewards/")):
        metrics[f"{key}/mean"] = jnp.nanmean(batch[key])
        metrics[f"{key}/std"] = jnp.nanstd(batch[key], ddof=1)
    return metrics


# The step takes the reference the policy started from: the frozen base with adapters off, or for a full
# fine-tune a frozen copy of the base weights.
GRPO: Objective[RolloutConfig] = Objective(
    "grpo", loss_terms, eval_terms, make_prepare("grpo", group_advantages), section=GRPOConfig,
    rows=lambda section: section.group_size, batch_fields=_batch_fields,
    second_model=lambda section, method: "base" if method_unit(method).trains_base else None,
    logits_copies=lambda method, section: 3,
    batch_metrics=_batch_metrics,
    unit="prompts", generates=True, reads_images=True,
    rollout_tokens=lambda section: section.max_new_tokens,
    extra_forwards=lambda section: 1
)
