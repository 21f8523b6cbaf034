"""What a multi-turn RL environment is: the rollout loop's other side (`Environment`: reset, step, close).

An episode is a conversation the environment keeps (`messages`, the model's turns included), so a rollout loop never
needs to know a tool-call format: it renders `messages` with the chat template (`tools=env.tools`), samples the
model's turn, and `step`s the text until `done` (`rollout.rollout` is that loop, batched). Environments load by
registered name (`register_environment`) or by dotted path to a class or factory ("mypkg.envs:Maze"), as GRPO loads
its reward functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

from jaxtune.environments.runner import load_object
from jaxtune.errors import JaxtuneError


class StepResult(NamedTuple):
    """What answers a model's turn: the next messages (tool replies as {"role": "tool", "name", "content"}, or a
    user's turn), the reward (the episode's, when `done`; 0.0 or a shaped reward before), and whether it ended."""

    messages: list[dict]
    reward: float
    done: bool


@runtime_checkable
class Environment(Protocol):
    """The interface a rollout loop calls. `tools`: the JSON schemas the chat template shows the model (empty when
    none); `messages`: the episode so far, every turn including the model's (after `step`: the model's turn, then the
    messages `step` returned, which is where `rollout` finds the model's turn). One episode, by hand:

        env = load_environment("tools", tools=["mypkg.tools.search"], family="hermes", reward="mypkg.rewards.solved")
        env.reset(record)
        while True:
            prompt = render_chat(env.messages, tokenizer, add_generation_prompt=True, tools=env.tools)
            messages, reward, done = env.step(sample(prompt))
            if done:
                break
        example = render_episode(env.messages, tokenizer, env.tools)   # ids, the loss mask on the model's turns
        env.close()
    """

    tools: list[dict]
    messages: list[dict]

    def reset(self, record: dict) -> list[dict]:
        """Start an episode from a dataset record; the first messages (system, user)."""
        ...

    def step(self, text: str) -> StepResult:
        """The model's turn as it wrote it (decoded, the end-of-turn token dropped or kept: both are read)."""
        ...

    def close(self) -> None:
        """Free what the environment holds (a tool process)."""
        ...


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str):
    """Decorator: make a class or factory loadable as `load_environment(name, **options)`."""
    def register(factory):
        ENVIRONMENTS[name] = factory
        return factory
    return register


def _factory(name: str) -> Callable[..., Environment]:
    """The class or factory registered as `name`, or named by a dotted path."""
    if name not in ENVIRONMENTS:
        import jaxtune.environments.tool_env  # noqa: F401 (registers the built-in ones)
    factory = ENVIRONMENTS.get(name) or (load_object(name, "environment") if "." in name or ":" in name else None)
    if factory is None:
        raise JaxtuneError(f"environment {name!r}: not one of {', '.join(sorted(ENVIRONMENTS))}, nor a dotted path "
                           "such as 'mypackage.envs:Maze'")
    if not callable(factory):
        raise JaxtuneError(f"environment {name!r} is not a class or function")
    return factory


def _checked(env, name: str) -> Environment:
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(env, m, None))]
    if missing:
        raise JaxtuneError(f"environment {name!r} has no {', '.join(missing)} method")
    return env


def load_environment(name: str, **options) -> Environment:
    """An environment by registered name ("tools") or by dotted path to a class or factory, called with `options`."""
    return _checked(_factory(name)(**options), name)


def load_environments(name: str, count: int, **options) -> list[Environment]:
    """`count` environments of `name` for a batch of episodes: the factory's `many(count, **options)` where it has one
    (environments sharing what is costly to start, e.g. one tool process), else the factory called `count` times."""
    factory = _factory(name)
    many = getattr(factory, "many", None)
    made = many(count, **options) if callable(many) else [factory(**options) for _ in range(count)]
    return [_checked(env, name) for env in made]


def first_messages(record: dict, system: str | None = None) -> list[dict]:
    """The opening turns of a record: its "messages" as given, or its "prompt" as a user turn, after `system` (when
    given and the messages have none)."""
    if isinstance(record.get("messages"), list):
        messages = [dict(m) for m in record["messages"]]
    elif isinstance(record.get("prompt"), str):
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise JaxtuneError(f"environment record with keys {sorted(record)}: expected a string \"prompt\" or a "
                           "\"messages\" list")
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages
