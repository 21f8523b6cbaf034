"""Stop strings: a row ends once its decoded text holds one of its strings. Text exists only on the host, so the
decoders (`generation.generate`, `rollouts.engine.sample_groups`) take a `StopStrings` as their `stop_when`, asked
between chunks of decode steps; a row found there has run on to its chunk's end, and `StopStrings.cut` ends its tokens
where its text first held a string (bisection: log2(n) decodes a row), whatever the chunks or the slot that decoded it.

    stops = StopStrings.of(tokenizer, ["\\n\\n", "</answer>"], rows=len(prompts))  # or one list per row
    tokens = generate(params, cfg, prompts, sampling, stop_when=stops, include_stop=True)
With include_stop the tokens end with the one that completed the string (what a policy gradient credits: the sampled
tokens that produced it), as with a stop token; without, before it. `cut_text` cuts a text before its first string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError


@dataclass(frozen=True, eq=False)
class StopStrings:
    """Each row's stop strings (`strings_of_row[row]`, empty: none) and the tokenizer that turns its tokens into
    text (special tokens skipped). Called as `stop_when(row, tokens) -> bool`."""

    tokenizer: Tokenizer
    strings_of_row: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer, stop_strings: Sequence[str] | Sequence[Sequence[str]], rows: int
           ) -> StopStrings:
        """One list of strings for every row, or one list per row (`rows` of them); empty strings dropped."""
        if isinstance(stop_strings, str):
            raise JaxtuneError(f"stop_strings takes a list of strings (or one list per prompt), got the string "
                               f"{stop_strings!r}")
        given: list = list(stop_strings)
        if all(isinstance(s, str) for s in given):
            return cls(tokenizer, (tuple(s for s in given if s),) * rows)
        if len(given) != rows or not all(not isinstance(row, str) and all(isinstance(s, str) for s in row)
                                         for row in given):
            raise JaxtuneError(f"stop_strings: give one list of strings for every prompt or one list per prompt "
                               f"({rows}), got {given!r:.80}")
        return cls(tokenizer, tuple(tuple(s for s in row if s) for row in given))

    @property
    def any(self) -> bool:
        return any(self.strings_of_row)

    def text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def __call__(self, row: int, tokens: Sequence[int]) -> bool:
        """Whether row `row`'s text holds one of its strings."""
        text = self.text(tokens)
        return any(s in text for s in self.strings_of_row[row])

    def end(self, row: int, tokens: Sequence[int]) -> int | None:
        """The fewest of `tokens` whose text holds one of row `row`'s strings (None: theirs all together does not).
        Bisection: a text that holds a string goes on holding it as tokens are added."""
        if not self(row, tokens):
            return None
        low, high = 0, len(tokens)  # the text of tokens[:low] holds none, that of tokens[:high] one
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if self(row, tokens[:middle]) else (middle, high)
        return high

    def cut(self, row: int, tokens: Sequence[int], include_stop: bool) -> list[int]:
        """`tokens` ending with (include_stop) or before the token that completed row `row`'s first string."""
        end = self.end(row, tokens)
        return list(tokens if end is None else tokens[: end if include_stop else end - 1])

    def cut_text(self, row: int, text: str) -> str:
        """`text` up to (without) the first of row `row`'s strings in it."""
        cuts = [text.find(s) for s in self.strings_of_row[row] if s in text]
        return text[: min(cuts)] if cuts else text

    def token_ids(self) -> list[int]:
        """Where every row has the same strings, the tokens whose own text holds one (`Tokenizer.tokens_containing`):
        as stop tokens they end a row at once, inside a chunk; [] otherwise."""
        return self.tokenizer.tokens_containing(self.strings_of_row[0]) if len(set(self.strings_of_row)) == 1 else []
