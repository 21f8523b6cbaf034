"""GRPO (Shao et al. 2024, DeepSeekMath): online policy optimisation against a reward function, no critic.

Each iteration: for every prompt, sample G completions with jaxtune's own generation (the current policy), score
them with the reward function, normalise the rewards within each prompt's group into advantages, and take one
gradient step on the clipped-ratio objective with a KL penalty to the reference (the frozen base, adapters off).
With one step per batch the old policy equals the current one, so the ratio is 1 in value but not in gradient.
Per-token terms are averaged over all completion tokens of the batch (token-level normalisation, as in DAPO).

The reward is a Python callable `reward(prompts: list[str], completions: list[str]) -> list[float]`, named by a
dotted path ("package.module.function" or "package.module:function").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.generation import SamplingConfig, generate
from jaxtune.methods.transform import combine
from jaxtune.models.llama import ForwardOptions, forward
from jaxtune.objectives import grpo_advantages, grpo_token_loss, token_nll
from jaxtune.train.update import accumulate, apply_update


@dataclass(frozen=True)
class GRPOConfig:
    reward: str = ""
    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    clip: float = 0.2
    kl_coef: float = 0.04


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


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray,
                  seq_len: int) -> dict:
    """Rows prompt + completion as [N, seq_len] arrays (as SFT batches), plus `advantages` [N]."""
    N = len(completions)
    batch = {k: np.zeros((N, seq_len), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = (prompt + completion)[: seq_len + 1]
        n = len(ids) - 1
        batch["input_ids"][i, :n], batch["labels"][i, :n] = ids[:-1], ids[1:]
        batch["loss_mask"][i, len(prompt) - 1:n] = 1.0
        batch["segment_ids"][i, :n], batch["positions"][i, :n] = 1, np.arange(n)
    batch["advantages"] = advantages.astype(np.float32)
    return batch


def sample_group(params: dict, cfg: ModelConfig, method: MethodConfig | None, prompts: list[list[int]],
                 grpo: GRPOConfig, seed: int, eos_ids) -> tuple[list[list[int]], list[list[int]]]:
    """G completions per prompt from the current policy: (prompt of each row, completion of each row)."""
    repeated = [p for p in prompts for _ in range(grpo.group_size)]
    sampling = SamplingConfig(max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature, seed=seed)
    return repeated, generate(params, cfg, repeated, sampling, eos_ids=eos_ids, method=method)


def group_advantages(rewards: list[float], group_size: int) -> np.ndarray:
    return np.asarray(grpo_advantages(jnp.asarray(rewards, jnp.float32).reshape(-1, group_size))).reshape(-1)


def _token_logps(params, cfg, batch, method, options):
    logits = forward(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                     segment_ids_BxT=batch["segment_ids"], method=method, options=options)
    return -token_nll(logits, batch["labels"])


def make_grpo_step(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                   optimizer: optax.GradientTransformation, schedule: optax.Schedule, grpo: GRPOConfig):
    """The jitted `step(state, frozen, reference, batch[A, N, T] + advantages [A, N]) -> (state, metrics)`."""

    def loss_terms(trainable, frozen, reference, micro):
        logp = _token_logps(combine(trainable, frozen), cfg, micro, method, options)
        ref_logp = jax.lax.stop_gradient(_token_logps(reference, cfg, micro, None, options))
        total, count = grpo_token_loss(logp, jax.lax.stop_gradient(logp), ref_logp, micro["advantages"],
                                       micro["loss_mask"], grpo.clip, grpo.kl_coef)
        kl = jnp.sum((jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1) * micro["loss_mask"])
        return total, (count, {"kl": kl})

    def step(state, frozen, reference, batch):
        loss_fn = lambda trainable, micro: loss_terms(trainable, frozen, reference, micro)
        loss, _, grads, metrics = accumulate(loss_fn, state["params"], batch)
        state, update_metrics = apply_update(state, grads, loss, optimizer, schedule)
        return state, {**update_metrics, **metrics, "tokens": jnp.sum(batch["segment_ids"] > 0)}

    return jax.jit(step, donate_argnums=0)
