"""A finished episode as token ids and a loss mask on the model's own tokens, across all its turns.

`render_episode`: the conversation rendered by the chat template and tokenised, each assistant turn's span trained
(`data.formats.chat_spans`, as SFT on a chat record): right for SFT. `EpisodeTokens`: the ids the rollout sampled,
kept as they were, with the environment's turns cut from the template's render between them: what a policy-gradient
loss needs, since re-tokenising a sampled turn may give other ids than were sampled, and the ratio to the sampling
policy is only right on those.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtune.data.formats import Example, chat_example, chat_spans, render_chat
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError


def render_episode(messages: list[dict], tokenizer: Tokenizer, tools: list[dict] | None = None) -> Example:
    """Token ids [n] of the episode by the tokenizer's chat template (with `tools`) and its loss mask [n]: 1 on every
    assistant turn (its content, tool calls and end-of-turn token), 0 elsewhere."""
    return chat_example(messages, tokenizer, tools, where="episode")


class EpisodeTokens:
    """An episode's ids as sampled. Start from the opening messages; `prompt_ids` is what to generate from; after
    each model turn `add_model_turn(ids, message)`, after each environment answer `add_environment_turn(messages)`;
    `example()` gives the ids [n] and loss mask [n] (1 on sampled ids only)."""

    def __init__(self, messages: Sequence[dict], tokenizer: Tokenizer, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools
        self.messages = [dict(m) for m in messages]
        prompt = render_chat(self.messages, tokenizer, add_generation_prompt=True, tools=tools)
        self.ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False)
        self.loss_mask: list[int] = [0] * len(self.ids)
        self._model_text = ""  # the last model turn as decoded, to find where it stops in the template's render

    @property
    def prompt_ids(self) -> list[int]:
        """The ids to generate the model's next turn from (the whole episode so far, generation prompt included)."""
        return list(self.ids)

    def add_model_turn(self, ids: Sequence[int], message: dict) -> None:
        """The model's sampled ids (its end-of-turn token kept or not) and the message they became (the
        environment's record of the turn: `env.messages[-1]` after `step`, before its replies)."""
        self.ids += [int(i) for i in ids]
        self.loss_mask += [1] * len(ids)
        self.messages.append(dict(message))
        self._model_text = self.tokenizer.decode(ids, skip_special_tokens=False)

    def add_environment_turn(self, messages: Sequence[dict]) -> None:
        """The turns that answered the model (tool replies, a user's turn): their ids are the template's text after
        the model's last turn as sampled, through the next generation prompt; the end-of-turn text the model did not
        write (a turn cut at max_new_tokens) comes first, masked too. Where the template renders the turn otherwise
        than it was sampled, the text after the turn's end-of-turn token."""
        self.messages += [dict(m) for m in messages]
        text, spans = chat_spans(self.messages, self.tokenizer, self.tools, where="episode")
        prompt = render_chat(self.messages, self.tokenizer, add_generation_prompt=True, tools=self.tools)
        if not spans or not prompt.startswith(text[: spans[-1][1]]):
            raise JaxtuneError("episode: the chat template does not render the conversation so far as the start of "
                               "the next prompt, so the environment's turn cannot be cut from it")
        start, end = spans[-1]
        written = self._model_text.strip()
        at = text.find(written, start) if written else start
        # where the model's turn stops in the render: after its text as sampled; or, where the template rewrites the
        # turn (a reasoning block re-spaced), at the turn's end, its end-of-turn token taken to be among the sampled
        cut = at + len(written) if 0 <= at <= end else end
        rest = prompt[cut:]
        new = self.tokenizer.encode(rest, add_special_tokens=False)
        self.ids += new
        self.loss_mask += [0] * len(new)

    def example(self) -> Example:
        return Example(tuple(self.ids), tuple(self.loss_mask))
