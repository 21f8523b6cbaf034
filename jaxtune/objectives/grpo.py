"""GRPO (Shao et al. 2024, DeepSeekMath): online policy optimisation against a reward function, no critic (`GRPO`,
its section `GRPOConfig`); RLOO (`rloo.py`) shares its rollouts, rewards and data (`RolloutConfig`, `make_prepare`).

Each step: for every prompt, sample `group_size` completions with jaxtune's own generation (`sample_group`), score
them, normalise the rewards into advantages (`group_advantages`, TRL's `scale_rewards`), and take one gradient step
on the clipped-ratio objective with a KL penalty to the reference (the base, adapters off; a frozen copy for a full
fine-tune), per-token terms aggregated as TRL 1.16's `loss_type` (`losses.grpo_aggregate`). The reward is a
callable `reward(prompts, completions, **fields) -> list[float]` named by a dotted path (`load_reward_function`; the
prompt records' other fields come as keyword lists), or a reward model directory (`reward_model_function`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.formats import PromptExample, load_prompt_examples, train_eval_split
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import ConfigError, JaxtuneError, check_range
from jaxtune.generation import generate
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.models.head import label_logps
from jaxtune.models.llama import decoder
from jaxtune.models.reward_model import reward_scores
from jaxtune.objectives.base import Context, Objective, ObjectiveData, ObjectiveInputs, reference_of
from jaxtune.objectives.dpo import sequence_row
from jaxtune.objectives.losses import GRPO_LOSS_TYPES, grpo_advantages, grpo_aggregate, grpo_token_loss
from jaxtune.parallel.distributed import scored_in_shares


@dataclass(frozen=True)
class RolloutConfig:
    """What GRPO and RLOO share. reward: a dotted path to a reward function, or reward_model: a directory
    `objective = "reward"` exported. group_size completions per prompt, sampled with temperature / top_k / top_p.
    clip: PPO's epsilon (TRL's `epsilon`), the ratio clipped to [1 - clip, 1 + epsilon_high]; epsilon_high: DAPO's
    clip-higher (0: the same as clip, TRL's None); kl_coef: the KL penalty's beta (TRL's `beta`)."""

    reward: str = ""
    reward_model: str = ""
    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    clip: float = 0.2
    epsilon_high: float = 0.0
    kl_coef: float = 0.04

    def __post_init__(self):
        if self.group_size < 2:
            raise ConfigError("group_size", self.group_size, "must be >= 2 (advantages are relative to the group)")
        if not self.temperature > 0:
            raise ConfigError("temperature", self.temperature, "must be > 0 (the samples of a group must differ)")
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("top_k", self.top_k, 0)
        check_range("top_p", self.top_p, 0, 1, low_open=True)
        check_range("clip", self.clip, 0, low_open=True)
        if self.epsilon_high and not self.epsilon_high >= self.clip:
            raise ConfigError("epsilon_high", self.epsilon_high, f"must be >= clip = {self.clip} (or 0: the same)")
        check_range("epsilon_high", self.epsilon_high, 0)
        check_range("kl_coef", self.kl_coef, 0)

    @property
    def clip_high(self) -> float:
        """The ratio's upper clip, 1 + clip_high (TRL: epsilon_high if set, else epsilon)."""
        return self.epsilon_high or self.clip


@dataclass(frozen=True)
class GRPOConfig(RolloutConfig):
    """GRPO's section: `RolloutConfig`'s keys and TRL 1.16 GRPOConfig's, named as TRL names them.
    loss_type: how per-token terms become the loss (`losses.grpo_aggregate`): "dapo" (TRL's default, and jaxtune's
    before these keys existed), "grpo", "dr_grpo" or "bnpo". importance_sampling_level: "token", or "sequence"
    (GSPO). scale_rewards: "group", "batch" or "none" (`losses.grpo_advantages`). delta: two-sided clipping's cap on
    the ratio (INTELLECT-2; 0: none, TRL's None)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    delta: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        for key, allowed in (("loss_type", GRPO_LOSS_TYPES), ("importance_sampling_level", ("token", "sequence")),
                             ("scale_rewards", ("group", "batch", "none"))):
            if getattr(self, key) not in allowed:
                raise ConfigError(key, getattr(self, key), "choose one of " + ", ".join(allowed))
        if self.delta != 0 and not self.delta > 1:
            raise ConfigError("delta", self.delta, "must be > 1 (a cap on the ratio, which starts at 1; TRL "
                              "recommends > 1 + epsilon_high) or 0: none")


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


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], rewards: list[float],
                  advantages: np.ndarray, seq_len: int) -> dict:
    """Rows prompt + completion as [N, seq_len] arrays (as SFT batches), plus `rewards` [N] and their `advantages`
    [N] (rows of a prompt's group are consecutive)."""
    N = len(completions)
    batch: dict[str, np.ndarray] = {k: np.zeros((N, seq_len), np.float32 if k == "loss_mask" else np.int32)
                                    for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = (prompt + completion)[: seq_len + 1]
        n = len(ids) - 1
        batch["input_ids"][i, :n], batch["labels"][i, :n] = ids[:-1], ids[1:]
        batch["loss_mask"][i, len(prompt) - 1:n] = 1.0
        batch["segment_ids"][i, :n], batch["positions"][i, :n] = 1, np.arange(n)
    batch["rewards"] = np.asarray(rewards, np.float32)
    batch["advantages"] = np.asarray(advantages, np.float32)
    return batch


def sample_group(params: dict, cfg: ModelConfig, method: MethodConfig | None, prompts: list[list[int]],
                 grpo: RolloutConfig, seed: int, eos_ids) -> tuple[list[list[int]], list[list[int]]]:
    """G completions per prompt from the current policy: (prompt of each row, completion of each row); a completion
    that stopped ends with its EOS, so the step's loss covers the choice to stop."""
    repeated = [p for p in prompts for _ in range(grpo.group_size)]
    sampling = SamplingConfig(max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature, top_k=grpo.top_k,
                              top_p=grpo.top_p, seed=seed)
    return repeated, generate(params, cfg, repeated, sampling, eos_ids=eos_ids, method=method, include_stop=True)


def group_advantages(rewards: list[float], grpo: GRPOConfig) -> np.ndarray:
    """GRPO's advantages [N] of a step's rewards [N] (groups of `group_size` consecutive rows)."""
    rewards_PxG = jnp.asarray(rewards, jnp.float32).reshape(-1, grpo.group_size)
    return np.asarray(grpo_advantages(rewards_PxG, scale=grpo.scale_rewards)).reshape(-1)


def _token_logps(params, cfg, batch, method, options, temperature: float, dropout_key=None):
    hidden = decoder(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                     segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)
    return label_logps(params, hidden, batch["labels"], cfg.final_logit_softcap, temperature)


def policy_and_reference_logps(ctx: Context, trainable, frozen, second, micro, key=None):
    """log p(label) [B, T] under the policy (differentiable) and under the reference (constant), both of the logits
    divided by the sampling temperature, as TRL's GRPO and RLOO trainers score them."""
    t = ctx.section.temperature
    logp = _token_logps(combine(trainable, frozen), ctx.cfg, micro, ctx.method, ctx.options, t, key)
    ref_logp = _token_logps(reference_of(frozen, second), ctx.cfg, micro, None, ctx.options, t)
    return logp, jax.lax.stop_gradient(ref_logp)


# One gradient step per batch (TRL's num_iterations = 1): the old policy is the current one, so the ratio is 1 in
# value but not in gradient.
def loss_terms(ctx: Context):
    """GRPO's clipped-ratio objective with a KL penalty to the reference, per micro-batch of rollouts. Metric "kl":
    the KL estimator aggregated as the loss aggregates its terms."""
    g = ctx.section

    def terms(trainable, frozen, second, micro, key=None):
        logp, ref_logp = policy_and_reference_logps(ctx, trainable, frozen, second, micro, key)
        total_, count = grpo_token_loss(logp, jax.lax.stop_gradient(logp), ref_logp, micro["advantages"],
                                        micro["loss_mask"], g.clip, g.kl_coef, clip_high=g.clip_high,
                                        delta=g.delta or None, level=g.importance_sampling_level,
                                        loss_type=g.loss_type, max_completion_length=g.max_new_tokens)
        kl, _ = grpo_aggregate(jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1, micro["loss_mask"], g.loss_type,
                               g.max_new_tokens)
        return total_, (count, {"kl": jax.lax.stop_gradient(kl)})

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


def make_prepare(name: str, advantages: Callable[[list[float], Rollout], np.ndarray]):
    """The `prepare` of objective `name` whose section is a `RolloutConfig`: prompts of data.train; each step samples
    `group_size` completions of `batch_size x grad_accum` of them with the current policy, scores them and turns the
    rewards into advantages, `advantages(rewards [N], section) -> [N]`."""
    return lambda setup: _prepare(setup, name, advantages)


def _prepare(setup: ObjectiveInputs, name: str, advantages) -> ObjectiveData:
    c, g, tok, cfg = setup.config, setup.section, setup.tokenizer, setup.cfg
    seq_len, tc, method = c.data.max_seq_len, c.train, c.method
    if bool(g.reward) == bool(g.reward_model):
        raise JaxtuneError(f"[{name}] set exactly one of reward (a function's dotted path, e.g. 'mypkg.rewards.exact') "
                           "and reward_model (a reward model directory)")
    if c.offload.frozen_params:
        raise JaxtuneError(f"[offload] frozen_params = true is not supported with objective {name} (rollouts "
                           "decode from the frozen weights every step); set it to false")
    reward_fn = (load_reward_function(g.reward) if g.reward
                 else reward_model_function(g.reward_model, seq_len, setup.load_reward_model))
    examples = load_prompt_examples(c.data.train, dict(c.data.columns))
    held_out: Sequence[PromptExample] | None
    held_out = load_prompt_examples(c.data.eval, dict(c.data.columns)) if c.data.eval else None
    fits = lambda e: len(tok.encode(e.prompt)) + g.max_new_tokens <= seq_len + 1
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

    def rewards(chosen: list, completions: list[list[int]], repeat: int) -> list[float]:
        """Each process decodes and scores its share of the rows (`scored_in_shares`)."""
        names = sorted({k for e in chosen for k in e.fields})
        fields = {k: [e.fields.get(k) for e in chosen for _ in range(repeat)] for k in names}
        prompts = [e.prompt for e in chosen for _ in range(repeat)]

        def score(rows: list[int]) -> np.ndarray:
            try:
                values = reward_fn([prompts[i] for i in rows], [tok.decode(completions[i]) for i in rows],
                                   **{k: [v[i] for i in rows] for k, v in fields.items()})
            except Exception as e:  # noqa: BLE001  the user's code: one line naming it
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                raise JaxtuneError(f"reward {g.reward or g.reward_model!r} raised {type(e).__name__}: {first}") from e
            values = np.asarray(values, np.float64) if len(values) == len(rows) else None
            if values is None or not np.all(np.isfinite(values)):
                raise JaxtuneError(f"reward {g.reward or g.reward_model!r} must return one finite number per "
                                   "completion")
            return values

        return scored_in_shares(score, len(completions)).tolist()

    def batch(epoch: int, index: int, params) -> dict:
        order = np.random.default_rng([c.data.seed, epoch]).permutation(len(train))
        chosen = [train[j] for j in order[index * per_step:(index + 1) * per_step]]
        seed = int(np.random.default_rng([tc.seed, epoch, index]).integers(2**31))
        rows, completions = sample_group(params(), cfg, method, [tok.encode(e.prompt) for e in chosen], g, seed, eos)
        scores = rewards(chosen, completions, g.group_size)
        rollouts = rollout_batch(rows, completions, scores, advantages(scores, g), seq_len)
        return {k: v.reshape(tc.grad_accum, -1, *v.shape[1:]) for k, v in rollouts.items()}

    def evaluate(_eval_step, params) -> dict:
        greedy = SamplingConfig(max_new_tokens=g.max_new_tokens, temperature=0.0)
        completions = generate(params, cfg, [tok.encode(e.prompt) for e in held_out], greedy, eos_ids=eos,
                               method=method)
        return {"eval_reward": float(np.mean(rewards(held_out, completions, 1)))}

    return ObjectiveData(len(train) // per_step, batch, evaluate if held_out else None)


def _batch_fields(rows: int, _section) -> dict:
    return {"advantages": jax.ShapeDtypeStruct((rows,), np.float32),
            "rewards": jax.ShapeDtypeStruct((rows,), np.float32)}


# The step takes the reference the policy started from: the frozen base with adapters off, or for a full
# fine-tune a frozen copy of the base weights.
GRPO: Objective[RolloutConfig] = Objective(
    "grpo", loss_terms, eval_terms, make_prepare("grpo", group_advantages), section=GRPOConfig,
    rows=lambda section: section.group_size, batch_fields=_batch_fields,
    second_model=lambda section, method: "base" if method_unit(method).trains_base else None,
    logits_copies=lambda method, section: 3,
    batch_metrics=lambda batch: {"reward": jnp.mean(batch["rewards"])},
    unit="prompts", generates=True,
    rollout_tokens=lambda section: section.max_new_tokens,
    extra_forwards=lambda section: 1
)
