"""Multi-turn rollouts of a batch of episodes, with any sampler: what a GRPO step calls in place of one completion a
prompt.

Each round, every episode still running renders its next prompt (`EpisodeTokens.prompt_ids`: the ids so far, so the
sampled turns are never re-tokenised), all of them go to `sample` together (one batched generate call: jaxtune's
`generate(params, cfg, prompts, sampling, eos_ids=..., include_stop=True)`), and each answer is decoded and stepped in
its environment. An episode ends when its environment says so or when its ids reach `max_tokens`
(`truncated`: reward 0.0). The result per episode: ids and a loss mask on the sampled ids only, the reward, the
conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxtune.data.formats import Example
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.environments.base import Environment
from jaxtune.environments.episode import EpisodeTokens


@dataclass(frozen=True)
class Episode:
    """A finished episode: `example` (ids [n], loss mask [n] on the model's sampled ids), its reward, the whole
    conversation, how many model turns it took, and whether `max_tokens` cut it."""

    example: Example
    reward: float
    messages: list[dict]
    turns: int
    truncated: bool = False


def rollout(envs: Sequence[Environment], records: Sequence[dict], sample: Callable[[list[list[int]]], list[list[int]]],
            tokenizer: Tokenizer, max_tokens: int) -> list[Episode]:
    """Run envs[i] on records[i] to the end, all episodes' turns sampled together by `sample(prompts) -> turns`
    (ids in, ids out, the end-of-turn token kept). Episodes in input order (a GRPO group: the same record G times,
    G environments)."""
    if len(envs) != len(records):
        raise ValueError(f"{len(envs)} environments for {len(records)} records")
    tokens = [EpisodeTokens(env.reset(record), tokenizer, env.tools or None) for env, record in zip(envs, records)]
    rewards, turns, truncated = [0.0] * len(envs), [0] * len(envs), [False] * len(envs)
    running = list(range(len(envs)))
    while running:
        over = [i for i in running if len(tokens[i].ids) >= max_tokens]
        for i in over:
            truncated[i] = True
        running = [i for i in running if i not in over]
        if not running:
            break
        answers = sample([tokens[i].prompt_ids for i in running])
        still = []
        for i, ids in zip(running, answers):
            result = envs[i].step(tokenizer.decode(ids, skip_special_tokens=False))
            turns[i] += 1
            model_turn = envs[i].messages[-1 - len(result.messages)]
            tokens[i].add_model_turn(ids, model_turn)
            rewards[i] = result.reward
            if result.done:
                continue
            tokens[i].add_environment_turn(result.messages)
            still.append(i)
        running = still
    return [Episode(tokens[i].example(), rewards[i] if not truncated[i] else 0.0, list(envs[i].messages), turns[i],
                    truncated[i]) for i in range(len(envs))]
