"""GRPO (Shao et al. 2024, DeepSeekMath): online policy optimisation against a reward function, no critic.

Each iteration: for every prompt, sample G completions with jaxtune's own generation (the current policy), score
them with the reward function, normalise the rewards within each prompt's group into advantages, and take one
gradient step on the clipped-ratio objective with a KL penalty to the reference (the frozen base, adapters off).
With one step per batch the old policy equals the current one, so the ratio is 1 in value but not in gradient.
Per-token terms are averaged over all completion tokens of the batch (token-level normalisation, as in DAPO).

The reward is a Python callable `reward(prompts: list[str], completions: list[str], **fields) -> list[float]`, named
by a dotted path ("package.module.function" or "package.module:function"); the prompt records' other fields come
as keyword lists, one value a completion (as TRL passes dataset columns), so a verifiable task can check an
"answer". Or it is a reward model directory (`reward_model_function`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.errors import ConfigError, JaxtuneError, check_range
from jaxtune.generation import generate
from jaxtune.methods.transform import combine
from jaxtune.models.llama import forward
from jaxtune.objectives import grpo_advantages, grpo_token_loss, token_nll
from jaxtune.train.update import objective_step


@dataclass(frozen=True)
class GRPOConfig:
    """reward: a dotted path to a reward function, or reward_model: a directory `objective = "reward"` exported.
    group_size completions per prompt, sampled with temperature / top_k / top_p; clip: PPO's epsilon; kl_coef: the
    KL penalty's beta."""

    reward: str = ""
    reward_model: str = ""
    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    clip: float = 0.2
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
        check_range("kl_coef", self.kl_coef, 0)


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


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], rewards: list[float], group_size: int,
                  seq_len: int) -> dict:
    """Rows prompt + completion as [N, seq_len] arrays (as SFT batches), plus `rewards` [N] and their group-normalised
    `advantages` [N] (rows of a prompt's group are consecutive)."""
    N = len(completions)
    batch = {k: np.zeros((N, seq_len), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = (prompt + completion)[: seq_len + 1]
        n = len(ids) - 1
        batch["input_ids"][i, :n], batch["labels"][i, :n] = ids[:-1], ids[1:]
        batch["loss_mask"][i, len(prompt) - 1:n] = 1.0
        batch["segment_ids"][i, :n], batch["positions"][i, :n] = 1, np.arange(n)
    batch["rewards"] = np.asarray(rewards, np.float32)
    batch["advantages"] = group_advantages(rewards, group_size).astype(np.float32)
    return batch


def sample_group(params: dict, cfg: ModelConfig, method: MethodConfig | None, prompts: list[list[int]],
                 grpo: GRPOConfig, seed: int, eos_ids) -> tuple[list[list[int]], list[list[int]]]:
    """G completions per prompt from the current policy: (prompt of each row, completion of each row); a completion
    that stopped ends with its EOS, so the step's loss covers the choice to stop."""
    repeated = [p for p in prompts for _ in range(grpo.group_size)]
    sampling = SamplingConfig(max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature, top_k=grpo.top_k,
                              top_p=grpo.top_p, seed=seed)
    return repeated, generate(params, cfg, repeated, sampling, eos_ids=eos_ids, method=method, include_stop=True)


def group_advantages(rewards: list[float], group_size: int) -> np.ndarray:
    return np.asarray(grpo_advantages(jnp.asarray(rewards, jnp.float32).reshape(-1, group_size))).reshape(-1)


def _token_logps(params, cfg, batch, method, options, dropout_key=None):
    logits = forward(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                     segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)
    return -token_nll(logits, batch["labels"])


def make_grpo_step(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                   optimizer: optax.GradientTransformation, schedule: optax.Schedule, grpo: GRPOConfig):
    """The jitted `step(state, frozen, reference, batch[A, N, T] + advantages [A, N]) -> (state, metrics)`."""

    def loss_terms(trainable, frozen, reference, micro, key=None):
        logp = _token_logps(combine(trainable, frozen), cfg, micro, method, options, key)
        ref_logp = jax.lax.stop_gradient(_token_logps(reference, cfg, micro, None, options))
        total, count = grpo_token_loss(logp, jax.lax.stop_gradient(logp), ref_logp, micro["advantages"],
                                       micro["loss_mask"], grpo.clip, grpo.kl_coef)
        kl = jnp.sum((jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1) * micro["loss_mask"])
        return total, (count, {"kl": kl})

    return objective_step(loss_terms, method, optimizer, schedule,
                          batch_metrics=lambda batch: {"reward": jnp.mean(batch["rewards"])})


def reward_model_function(directory: str, seq_len: int):
    """A reward function `(prompts, completions, **fields) -> rewards` that scores prompt + completion (cut to
    `seq_len` tokens) with the reward model in `directory` (as `objective = "reward"` exports it)."""
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.train.preference import sequence_row
    from jaxtune.train.reward import load_reward_model, reward_scores

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
