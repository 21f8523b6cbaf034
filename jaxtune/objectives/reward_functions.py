"""Several rewards with weights (TRL 1.16's `reward_funcs` + `reward_weights`) for GRPO and RLOO, on the host.

Each reward scores every completion: a number, or None where it does not apply (a format reward for a task without
a format), which becomes NaN. A step's rewards are a table [N, K], one column a reward (`reward_names`: the functions
of `[grpo] reward`, then `reward_model`, then DAPO's soft overlong punishment, which TRL users pass as a reward
function). The columns are weighted and aggregated exactly as TRL's `_generate_and_score_completions` aggregates
them (grpo_trainer.py and rloo_trainer.py): a NaN column is left out of a row's weighted sum (`nansum`); a row every
column left out is unscorable: NaN, out of its group's baseline and the normalisation, and its advantage 0. The
operations below are TRL's torch ones in float32 numpy, NaN-aware means and TRL's `nanstd` (Bessel's correction).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxtune.errors import JaxtuneError

SOFT_PUNISHMENT = "soft_overlong_punishment_reward"  # TRL's `get_soft_overlong_punishment`'s name in its logs
EPS = 1e-4  # TRL's epsilon under the std


def reward_names(section) -> tuple[str, ...]:
    """The name of each column of the reward table of a `RolloutConfig` (GRPO's, RLOO's), as the metrics name them
    (`rewards/<name>/mean`): a function by its dotted path's last part (TRL names a function by its __name__, the
    same), the reward model by its directory's name (TRL: the model id's last part), then the soft overlong
    punishment. An environment's episodes have their own score and no named columns."""
    names = [path.replace(":", ".").rpartition(".")[2] for path in section.reward]
    if section.reward_model:
        names.append(Path(section.reward_model).name or section.reward_model)
    if section.soft_punish_cache:
        names.append(SOFT_PUNISHMENT)
    return tuple(names)


def column_weights(section) -> np.ndarray:
    """The weight [K] of each column: `reward_weights` (default 1 each; one column for an environment's score),
    then 1 for the soft overlong punishment."""
    given = len(section.reward) + bool(section.reward_model)
    weights = list(section.reward_weights) or [1.0] * max(given, 1)
    return np.asarray(weights + [1.0] * bool(section.soft_punish_cache), np.float32)


def _table(rewards, weights) -> tuple[np.ndarray, np.ndarray]:
    """(rewards [N, K], weights [K]) as float32; a flat [N] is one column of weight 1 (rewards already summed)."""
    rewards_NxK = np.asarray(rewards, np.float32)
    if rewards_NxK.ndim == 1:
        return rewards_NxK[:, None], np.ones(1, np.float32)
    return rewards_NxK, np.asarray(weights, np.float32)


def scored_by(label: str, function, prompts: list[str], completions: list[str], fields: dict) -> np.ndarray:
    """One reward's scores [rows] (float64, NaN where it returned None: TRL's convention for "not applicable") of
    `function(prompts, completions, **fields)`; what it raises or returns amiss is one line naming `label`."""
    try:
        values = list(function(prompts, completions, **fields))
    except Exception as e:  # noqa: BLE001  the user's code: one line naming it
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise JaxtuneError(f"reward {label!r} raised {type(e).__name__}: {first}") from e
    try:
        column = np.asarray([np.nan if v is None else float(v) for v in values], np.float64)
    except (TypeError, ValueError):
        column = np.zeros(0)
    if len(column) != len(completions) or not all(v is None or np.isfinite(x) for v, x in zip(values, column)):
        raise JaxtuneError(f"reward {label!r} must return one finite number (or None: not applicable) per completion")
    return column


def nanmean(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """torch.nanmean: the mean of the non-NaN values (NaN where there are none), without numpy's warning."""
    count = np.sum(~np.isnan(x), axis=axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.nansum(x, axis=axis, keepdims=keepdims) / count).astype(x.dtype)


def nanstd(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """TRL's `nanstd` (trl/trainer/utils.py): the std of the non-NaN values with Bessel's correction, NaN for fewer
    than two."""
    mean = nanmean(x, axis, keepdims=True)
    variance = nanmean((x - mean) ** 2, axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        variance = variance * np.where(count > 1, count / (count - 1), np.nan).astype(x.dtype)
    std = np.sqrt(variance)
    return std if keepdims else (std.reshape(()) if axis is None else np.squeeze(std, axis))


def weighted_sum(rewards, weights) -> np.ndarray:
    """Each row's weighted sum over the columns that scored it [N], NaN where none did (TRL's `(rewards_per_func *
    reward_weights).nansum(dim=1)` with `rewards[unscorable_mask] = nan`): what the metric `reward` averages."""
    rewards_NxK, weights_K = _table(rewards, weights)
    total_N = np.nansum(rewards_NxK * weights_K[None], axis=1)
    total_N[np.isnan(rewards_NxK).all(axis=1)] = np.nan
    return total_N


def grpo_table_advantages(rewards, weights, group_size: int, scale: str = "group",
                          aggregation: str = "sum_then_normalize") -> np.ndarray:
    """GRPO's advantages [N] of a reward table [N, K] (groups of `group_size` consecutive rows) with `weights` [K]:
    "sum_then_normalize" sums the weighted columns, then centres on the group's mean and divides by the std of the
    group ("group"), of the batch ("batch") or by nothing ("none"), + 1e-4; "normalize_then_sum" (GDPO) normalises
    each column within its group first, sums them weighted and normalises the sums over the batch (scale_rewards
    not read, as in TRL). NaN-aware throughout, unscorable rows 0."""
    rewards_NxK, weights_K = _table(rewards, weights)
    G, K = group_size, rewards_NxK.shape[1]
    unscorable_N = np.isnan(rewards_NxK).all(axis=1)
    std_N: np.ndarray
    if aggregation == "sum_then_normalize":
        rewards_N = weighted_sum(rewards_NxK, weights_K)
        mean_N: np.ndarray = np.repeat(nanmean(rewards_N.reshape(-1, G), axis=1), G)
        if scale in ("group", "none"):
            std_N = np.repeat(nanstd(rewards_N.reshape(-1, G), axis=1), G)
        elif scale == "batch":
            std_N = np.broadcast_to(nanstd(rewards_N), rewards_N.shape)
        else:
            raise ValueError(f"unknown scale_rewards {scale!r}; choose group, batch or none")
        advantages_N = rewards_N - mean_N
        if scale != "none":
            advantages_N = advantages_N / (std_N + np.float32(EPS))
    elif aggregation == "normalize_then_sum":
        grouped_PxGxK = rewards_NxK.reshape(-1, G, K)
        mean_K = nanmean(grouped_PxGxK, axis=1, keepdims=True)
        std_K = nanstd(grouped_PxGxK, axis=1, keepdims=True)
        normalised_NxK = ((grouped_PxGxK - mean_K) / (std_K + np.float32(EPS))).reshape(-1, K)
        rewards_N = np.nansum(normalised_NxK * weights_K[None], axis=1)
        rewards_N[unscorable_N] = np.nan
        advantages_N = (rewards_N - nanmean(rewards_N)) / (nanstd(rewards_N) + np.float32(EPS))
    else:
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")
    return np.nan_to_num(advantages_N, nan=0.0).astype(np.float32)


def rloo_table_advantages(rewards, weights, group_size: int, clip_range: Sequence[float] = ()) -> np.ndarray:
    """The rewards' part of RLOO's advantages [N] of a reward table [N, K]: the weighted sums clipped to
    `clip_range`, less the mean of the group's other scorable rows (TRL: `nansum` over the group, divided by its
    scorable count - 1). NaN where a row has no such baseline (unscorable, or its group's only scorable row): the
    step (`rloo.step_advantages`) leaves those rows out of the KL's baseline and the normalisation and gives them 0."""
    rewards_N = weighted_sum(*_table(rewards, weights))
    if len(clip_range):
        rewards_N = np.clip(rewards_N, clip_range[0], clip_range[1])
    grouped_PxG = rewards_N.reshape(-1, group_size)
    scorable_Px1 = np.sum(~np.isnan(grouped_PxG), axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        baselines_PxG = (np.nansum(grouped_PxG, axis=1, keepdims=True) - grouped_PxG) / (scorable_Px1 - 1)
    return (grouped_PxG - baselines_PxG).reshape(-1).astype(np.float32)


def unscorable_rows(rewards_NxK: np.ndarray) -> np.ndarray:
    """The indices of the rows no reward scored (every one returned None)."""
    return np.flatnonzero(np.isnan(rewards_NxK).all(axis=1)) if rewards_NxK.shape[1] else np.zeros(0, int)


def column_stats(rewards_NxK: np.ndarray, names: Sequence[str], prefix: str) -> dict[str, float]:
    """`{prefix}rewards/<name>/mean` and `/std` of each column over the rows it scored (TRL's per-function logs)."""
    stats = {}
    for name, column in zip(names, np.asarray(rewards_NxK, np.float32).T):
        stats[f"{prefix}rewards/{name}/mean"] = float(nanmean(column))
        stats[f"{prefix}rewards/{name}/std"] = float(nanstd(column))
    return stats
