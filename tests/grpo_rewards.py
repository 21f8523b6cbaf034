"""Reward functions the GRPO tests name by dotted path."""


def count_letter_a(prompts, completions):
    """A verifiable reward: the share of 'a' characters in the completion."""
    return [c.count("a") / max(len(c), 1) for c in completions]
