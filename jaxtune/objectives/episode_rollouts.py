"""GRPO's and RLOO's rollouts as multi-turn episodes in an environment (`[grpo] environment`): the model's turns
sampled from the policy, the environment's (tool replies, a user) in between, the reward the environment's, the loss
on every token the model sampled across the turns (`episode_batch`).

Across processes each process steps its share of the episodes (a contiguous block, as rewards are scored) while
every turn is sampled by one collective decode of all processes' running episodes in process order (`sample`): the
same call, rows and tokens as one process running them all, so the run equals one process's.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxtune.config import MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import trimmed_to_longest
from jaxtune.environments.base import load_environments
from jaxtune.environments.episode_batch import Episode, rollout
from jaxtune.errors import JaxtuneError
from jaxtune.parallel.distributed import gathered_floats, gathered_lists
from jaxtune.rollouts.decoders import sampled_groups


def episode_rollouts(params: dict, cfg: ModelConfig, method: MethodConfig | None, records: Sequence[dict], section,
                     seed: int, eos_ids, tokenizer, max_tokens: int) -> tuple[list[list[int]], list[list[int]],
                                                                            list[float]]:
    """(ids, loss mask on the sampled ids, reward) of each record's episode in `section.environment` (its
    `environment_options`), every process holding all of them in input order. Each round samples every running
    episode's next turn with `section`'s settings (seed + round; its decoder, `EngineKeys`), at most `max_new_tokens`
    a turn; an episode ends when its environment says so or at `max_tokens` ids (reward 0)."""
    processes, me = jax.process_count(), jax.process_index()
    block = -(-len(records) // processes)
    mine = list(records[me * block:(me + 1) * block])
    options = _thawed(Table(section.environment_options))
    rounds = iter(range(1 << 30))

    def shared_round(prompts: list[list[int]]) -> tuple[list[list[int]], bool]:
        """(this process's prompts' turns, from one decode of every process's; whether any process had one)."""
        shares = gathered_lists(prompts)
        every = [prompt for share in shares for prompt in share]
        sampling = SamplingConfig(max_new_tokens=section.max_new_tokens, temperature=section.temperature,
                                  top_k=section.top_k, top_p=section.top_p, seed=seed + next(rounds))
        if not every:
            return [], False
        turns = sampled_groups(params, cfg, every, 1, sampling, section, eos_ids=eos_ids, method=method)
        start = sum(len(share) for share in shares[:me])
        return turns[start:start + len(prompts)], True

    sample = lambda prompts: shared_round(prompts)[0]  # noqa: E731

    failure: Exception | None = None
    episodes: list[Episode] = []
    environments = []
    try:
        environments = load_environments(section.environment, len(mine), **options)  # one tool process
        episodes = rollout(environments, mine, sample, tokenizer, max_tokens) if mine else []
    except Exception as e:  # noqa: BLE001  raised below, once the other processes' episodes are done
        failure = e
    finally:
        for environment in environments:
            environment.close()
    while processes > 1 and shared_round([])[1]:  # the other processes' episodes still running
        pass
    failed = [share[0][0] for share in gathered_lists([[int(failure is not None)]])]
    if failure is not None:
        raise failure
    if any(failed):
        raise JaxtuneError(f"process {failed.index(1)} failed running its share of the episodes (its log names the "
                           "error)")
    ids = [i for share in gathered_lists([list(e.example.ids) for e in episodes]) for i in share]
    masks = [m for share in gathered_lists([list(e.example.loss_mask) for e in episodes]) for m in share]
    rewards = [r for share in gathered_floats([e.reward for e in episodes]) for r in share]
    return ids, masks, rewards


class Table(tuple):
    """A TOML table as a config holds it (hashable): its (key, value) pairs, sorted."""


def frozen_table(table: dict) -> Table:
    """`table` with its tables as `Table`s and its lists as tuples, all the way down."""
    return Table(sorted((k, _frozen(v)) for k, v in table.items()))


def _frozen(value):
    if isinstance(value, dict):
        return frozen_table(value)
    return tuple(map(_frozen, value)) if isinstance(value, list) else value


def _thawed(value):
    """A config's option as the environment takes it: `Table`s as dicts, tuples as lists."""
    if isinstance(value, Table):
        return {k: _thawed(v) for k, v in value}
    return [_thawed(v) for v in value] if isinstance(value, tuple) else value


def episode_batch(ids: list[list[int]], masks: list[list[int]], rewards: list[float], advantages: np.ndarray,
                  seq_len: int) -> dict:
    """Episodes as [N, T] rows (as `grpo.rollout_batch` lays out prompt + completion; T the `padded_length` of the
    longest), the loss on the positions that predict a sampled token, plus `rewards` [N] and `advantages` [N]."""
    N = len(ids)
    batch: dict[str, np.ndarray] = {k: np.zeros((N, seq_len), np.float32 if k == "loss_mask" else np.int32)
                                    for k in ("input_ids", "labels", "loss_mask", "segment_ids", "positions")}
    for i, (row, mask) in enumerate(zip(ids, masks)):
        row, mask = row[: seq_len + 1], mask[: seq_len + 1]
        n = len(row) - 1
        batch["input_ids"][i, :n], batch["labels"][i, :n] = row[:-1], row[1:]
        batch["loss_mask"][i, :n] = mask[1:]
        batch["segment_ids"][i, :n], batch["positions"][i, :n] = 1, np.arange(n)
    batch["rewards"] = np.asarray(rewards, np.float32)
    batch["advantages"] = np.asarray(advantages, np.float32)
    return trimmed_to_longest(batch, seq_len)
