"""Multi-turn RL with tools, apart from any trainer: the `Environment` protocol and its registry (base.py), tool calls
read per chat-template family (tool_calls.py), tool schemas from signatures (schema.py), tools in a worker process
with a time limit (runner.py), the tool-calling environment (tool_env.py), episodes as ids and a loss mask on the
model's own tokens (episode.py), and batched multi-turn rollouts with any sampler (episode_batch.py).

The public names, one a line, imported when first used (the tool worker process imports only what it runs).
"""

from __future__ import annotations

import importlib

PUBLIC = {  # name -> the module that defines it
    "ENVIRONMENTS": "jaxtune.environments.base",
    "Environment": "jaxtune.environments.base",
    "StepResult": "jaxtune.environments.base",
    "load_environment": "jaxtune.environments.base",
    "load_environments": "jaxtune.environments.base",
    "register_environment": "jaxtune.environments.base",
    "EpisodeTokens": "jaxtune.environments.episode",
    "render_episode": "jaxtune.environments.episode",
    "Episode": "jaxtune.environments.episode_batch",
    "rollout": "jaxtune.environments.episode_batch",
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
