"""Reward functions the GRPO tests name by dotted path."""


def count_letter_a(prompts, completions):
    """A verifiable reward: the share of 'a' characters in the completion."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def share_of_answer(prompts, completions, answer):
    """A verifiable reward that reads a field of the prompt record: the share of the completion's characters that
    are the record's "answer" letter."""
    return [c.count(a) / max(len(c), 1) for c, a in zip(completions, answer)]


def odd_characters(prompts, completions):
    """A reward that varies from sample to sample of a random model: the share of the completion's characters with
    odd code points. With GRPO_REWARD_CALLS set, each call appends "process rows" to that file."""
    import os

    import jax

    if os.environ.get("GRPO_REWARD_CALLS"):
        with open(os.environ["GRPO_REWARD_CALLS"], "a") as calls:
            calls.write(f"{jax.process_index()} {len(completions)}\n")
    return [sum(ord(ch) % 2 for ch in c) / max(len(c), 1) for c in completions]


def fails_on_process_one(prompts, completions):
    """`odd_characters` on process 0; raises on process 1 (a reward that breaks on one host)."""
    import jax

    if jax.process_index() == 1:
        raise ValueError("the grader on this host is down")
    return odd_characters(prompts, completions)


SEEN: list[str] = []  # the completions `count_letter_a_seen` was given, for the tests to read


def count_letter_a_seen(prompts, completions):
    """`count_letter_a`, keeping the completions it saw in SEEN."""
    SEEN.extend(completions)
    return count_letter_a(prompts, completions)


EVENTS: list = []  # ("reward", the call's number): tests/test_grpo_one_step_off.py sets it to its own list


def recorded_share_of_answer(prompts, completions, answer):
    """`share_of_answer`, each call appended to `EVENTS`."""
    EVENTS.append(("reward", 1 + sum(e[0] == "reward" for e in EVENTS)))
    return share_of_answer(prompts, completions, answer)


def letter_a_or_none(prompts, completions):
    """`count_letter_a` where the prompt does not start with "S", None (not applicable) where it does."""
    return [None if p.startswith("S") else c.count("a") / max(len(c), 1) for p, c in zip(prompts, completions)]


def short_or_none(prompts, completions):
    """A format reward: 1 for a completion of at most 4 characters, else 0; None where the prompt starts with "S"
    (with `letter_a_or_none`, those rows are unscorable)."""
    return [None if p.startswith("S") else float(len(c) <= 4) for p, c in zip(prompts, completions)]
