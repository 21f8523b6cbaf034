"""Reward functions the GRPO tests name by dotted path."""


def count_letter_a(prompts, completions):
    """A verifiable reward: the share of 'a' characters in the completion."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def share_of_answer(prompts, completions, answer):
    """A verifiable reward that reads a field of the prompt record: the share of the completion's characters that
    are the record's "answer" letter."""
    return [c.count(a) / max(len(c), 1) for c, a in zip(completions, answer)]
