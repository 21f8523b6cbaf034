"""Multi-turn RL with tools: environments a rollout loop steps, tool calls read from a model's turn, tools run in a
process with a time limit, episodes as ids and a loss mask on the model's own tokens.

  base.py        the `Environment` protocol (reset, step -> StepResult, close), `load_environment` by name or path
  tool_calls.py  `parse_tool_calls(text, family)`: Hermes/Qwen, Llama 3, gpt-oss harmony; malformed calls as values
  schema.py      `json_schema(function)`: a tool's schema from its signature and docstring (transformers' format)
  runner.py      `ToolRunner`: tools in a spawned worker process, each call within a time limit, replies as text
  tool_env.py    `ToolEnvironment` ("tools"): the model calls registered functions until it answers; a reward
  episode.py     `render_episode` (the template's render) and `EpisodeTokens` (the sampled ids) with their loss masks
  rollout.py     `rollout(envs, records, sample, tokenizer, max_tokens)`: a batch of episodes, turns sampled together

The public names, one a line, imported when first used (the tool worker process imports only what it runs).
"""

from __future__ import annotations

import importlib

PUBLIC = {  # name -> the module that defines it
    "ENVIRONMENTS": "jaxtune.environments.base",
    "Environment": "jaxtune.environments.base",
    "StepResult": "jaxtune.environments.base",
    "load_environment": "jaxtune.environments.base",
    "register_environment": "jaxtune.environments.base",
    "EpisodeTokens": "jaxtune.environments.episode",
    "render_episode": "jaxtune.environments.episode",
    "Episode": "jaxtune.environments.rollout",
    "rollout": "jaxtune.environments.rollout",
    "ToolRunner": "jaxtune.environments.runner",
    "json_schema": "jaxtune.environments.schema",
    "ParsedTurn": "jaxtune.environments.tool_calls",
    "ToolCall": "jaxtune.environments.tool_calls",
    "ToolCallError": "jaxtune.environments.tool_calls",
    "detect_family": "jaxtune.environments.tool_calls",
    "parse_tool_calls": "jaxtune.environments.tool_calls",
    "ToolEnvironment": "jaxtune.environments.tool_env",
}
__all__ = list(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'jaxtune.environments' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
