"""How generation picks each new token."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxtune.errors import check_range


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick each new token.

    temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature).
    top_k: sample among the k most likely tokens (0: all). top_p: among the smallest set whose probability
    reaches top_p (1: all). seed: of the sampling key; the same seed and prompts give the same tokens.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("temperature", self.temperature, 0)  # 0 is greedy
        check_range("top_k", self.top_k, 0)  # 0 is off
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingConfig:
        return dataclasses.replace(self, **changes)
