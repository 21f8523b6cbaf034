"""The tool-calling environment: the model writes turns, registered Python functions answer its calls, until it
answers without a call (or runs out of turns); then a reward function scores the episode.

A turn is read by the model's tool-call family (`tool_calls.parse_tool_calls`); each call runs in the `ToolRunner`'s
worker process within `timeout_s`, and its reply, or one error line (a malformed call, an unknown tool, a tool that
raised, hung or returned what JSON cannot hold), becomes a {"role": "tool", "name", "content"} message: the episode
goes on and the model reads what went wrong. The model's own turn is kept as it wrote it ({"role": "assistant",
"content": text}: the Hermes and Llama templates render it back token for token) except in harmony, whose template
writes channels from structured fields: there it is {"content", "thinking", "tool_calls"}.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from jaxtune.environments.base import StepResult, first_messages, register_environment
from jaxtune.environments.runner import ToolRunner, load_object
from jaxtune.environments.schema import json_schema
from jaxtune.environments.tool_calls import PARSERS, ToolCallError, parse_tool_calls
from jaxtune.errors import JaxtuneError

# What ends a model's turn in the families' templates, dropped from its end when the loop kept it.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|return|>", "<|endoftext|>")


def _without_end(text: str) -> str:
    text = text.rstrip()
    while any(text.endswith(m) for m in END_MARKERS):
        text = next(text.removesuffix(m) for m in END_MARKERS if text.endswith(m)).rstrip()
    return text


@register_environment("tools")
class ToolEnvironment:
    """Episodes in which the model may call `tools` (functions or dotted paths; their schemas from their signatures
    and docstrings) written as `family` writes calls (`tool_calls.PARSERS`: "hermes", "llama3", "harmony", "xml",
    "glm"). `reward`: a function (or dotted path) `reward(messages, **fields) -> float` given the finished episode and
    the record's other fields; None scores 0. `max_turns`: model turns before the episode stops. `runner`: a
    `ToolRunner` shared by many environments (one worker process for a batch of episodes); by default each has its
    own."""

    def __init__(self, tools: Sequence[Callable | str] | Mapping[str, Callable | str], family: str,
                 reward: Callable | str | None = None, max_turns: int = 8, timeout_s: float = 10.0,
                 system: str | None = None, runner: ToolRunner | None = None):
        if family not in PARSERS:
            raise JaxtuneError(f"tool-call family {family!r}: choose one of {', '.join(PARSERS)}")
        if max_turns < 1:
            raise JaxtuneError(f"max_turns = {max_turns}: must be >= 1")
        self.runner = runner if runner is not None else ToolRunner(tools, timeout_s)
        self._owns_runner = runner is None
        self.tools = [json_schema(self.runner.tools[name]) for name in self.runner.tools]
        for schema, name in zip(self.tools, self.runner.tools):  # a mapping may rename a function
            schema["function"]["name"] = name
        self.reward = load_object(reward, "reward") if isinstance(reward, str) else reward
        self.family, self.max_turns, self.system = family, max_turns, system
        self.messages: list[dict] = []
        self.fields: dict = {}
        self.turns = 0

    @classmethod
    def many(cls, count: int, tools, timeout_s: float = 10.0, **options) -> list[ToolEnvironment]:
        """`count` environments sharing one `ToolRunner` (one worker process for a batch of episodes, stopped when
        the last of them closes): what `load_environments` builds for a rollout batch."""
        runner = ToolRunner(tools, timeout_s).shared_by(count)
        made = [cls(tools, runner=runner, **options) for _ in range(count)]
        for env in made:
            env._owns_runner = True  # each closes its share
        return made

    def reset(self, record: dict) -> list[dict]:
        self.messages = first_messages(record, self.system)
        self.fields = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
        self.turns = 0
        return list(self.messages)

    def _assistant(self, text: str, parsed) -> dict:
        if self.family in ("harmony", "gpt-oss"):
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": [c.message_call() for c in parsed.valid] or None}
            if parsed.reasoning:
                message["thinking"] = parsed.reasoning
            return message
        return {"role": "assistant", "content": text}

    def step(self, text: str) -> StepResult:
        if not self.messages:
            raise JaxtuneError("environment step before reset")
        text = _without_end(text)
        parsed = parse_tool_calls(text, self.family, self.tools)
        self.messages.append(self._assistant(text, parsed))
        self.turns += 1
        replies = []
        for call in parsed.calls:
            if isinstance(call, ToolCallError):
                replies.append({"role": "tool", "name": call.name, "content": call.message})
            else:
                replies.append({"role": "tool", "name": call.name,
                                "content": self.runner.call(call.name, call.arguments)})
        self.messages += replies
        done = not parsed.calls or self.turns >= self.max_turns
        reward = float(self.reward(self.messages, **self.fields)) if done and self.reward is not None else 0.0
        return StepResult(replies, reward, done)

    def close(self) -> None:
        if self._owns_runner:
            self.runner.close()
