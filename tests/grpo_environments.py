"""Environments the GRPO episode tests name by dotted path."""

from jaxtune.environments import StepResult


class TwoTurns:
    """The user's prompt, the model's turn, "Again:", the model's second turn; the reward: the share of odd code
    points in both turns (a reward that varies between a random model's samples). Options: `turns` (default 2)."""

    tools: list = []

    def __init__(self, turns: int = 2):
        self.turns, self.messages, self.written = turns, [], []

    def reset(self, record: dict) -> list[dict]:
        self.messages, self.written = [{"role": "user", "content": record["prompt"]}], []
        return list(self.messages)

    def step(self, text: str) -> StepResult:
        self.messages.append({"role": "assistant", "content": text})
        self.written.append(text)
        if len(self.written) < self.turns:
            reply = [{"role": "user", "content": "Again:"}]
            self.messages += reply
            return StepResult(reply, 0.0, False)
        both = "".join(self.written)
        return StepResult([], sum(ord(ch) % 2 for ch in both) / max(len(both), 1), True)

    def close(self) -> None:
        pass
