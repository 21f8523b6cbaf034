"""The two GRPO examples' tasks, rewards and tools, and what both scripts share (issue 51).

- Arithmetic chains: "Q: 7+8-5+9\nA:" answered step by step, one line per operation and a last line
  "answer: N"; `arithmetic_reward` checks that line against the record's `answer` field (a verifiable reward).
- A two-tool calculator: "What is (23 + 45) * 6?" answered by calling `add` and `multiply` (Hermes
  `<tool_call>{"name", "arguments"}</tool_call>` turns), then a last turn that states the number;
  `calculator_solved` scores the finished episode 1 when that number is the record's `answer`.

Both run on a tiny Llama with the byte-level tokenizer, trained here from random weights on the task's format (SFT,
a full fine-tune) before GRPO: on this machine's two CPU cores SmolLM2-135M decodes ~26 tokens/s for a batch of 32
(measured), too slow for groups of rollouts in minutes. The scripts import this module by its dotted path
(`grpo_tasks.arithmetic_reward`), so `experiments/` must be on sys.path (and PYTHONPATH, for the tool process).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content | replace('</s>', '') }}"
                 "{% if m.role == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
"""A chat template for the byte-level tokenizer: "role: content" lines, each assistant turn ended by EOS (`</s>`, id
2), which the sampled turn already holds: it is removed from the content so the render equals the sampled ids."""

# ---------------------------------------------------------------------------------------------- arithmetic chains

_ANSWER = re.compile(r"answer:\s*(-?\d+)")


def arithmetic_examples(n: int, seed: int, ops: int = 4, exclude: frozenset[str] = frozenset(),
                        slip: float = 0.0) -> list[dict]:
    """n records {"prompt", "completion", "answer"}: a start in 1..9 and `ops` steps of +/- a digit 1..9, every
    running value in 0..19 (facts a tiny model learns); the completion works it out one operation a line and ends
    "answer: N". slip: the share of completions whose last line is a careless teacher's, the value before the last
    step (their `answer` field stays right): demonstrations an imitator copies, slips included."""
    rng, slips = random.Random(seed), random.Random(seed + 1)
    records: list[dict] = []
    seen = set(exclude)
    while len(records) < n:
        value = rng.randint(1, 9)
        expression, lines = str(value), []
        for _ in range(ops):
            digit, sign = rng.randint(1, 9), rng.choice("+-")
            if not 0 <= (value + digit if sign == "+" else value - digit) <= 19:
                sign = "-" if sign == "+" else "+"
            new = value + digit if sign == "+" else value - digit
            lines.append(f"{value}{sign}{digit}={new}")
            expression, value = f"{expression}{sign}{digit}", new
        prompt = f"Q: {expression}\nA:"
        if prompt in seen:
            continue
        seen.add(prompt)
        stated = int(lines[-1].split("=")[0][:-2]) if slips.random() < slip else value  # the last step's start
        records.append({"prompt": prompt, "completion": " " + "\n".join(lines) + f"\nanswer: {stated}",
                        "answer": str(value)})
    return records


def final_answer(completion: str) -> str | None:
    """The number after the last "answer:" of a completion, or None."""
    found = _ANSWER.findall(completion)
    return found[-1] if found else None


def arithmetic_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the completion's final "answer: N" is the record's answer, else 0.0 (GRPO's reward signature)."""
    return [float(final_answer(c) == a) for c, a in zip(completions, answer)]


# ----------------------------------------------------------------------------------------- two-tool calculator


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return int(a) + int(b)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first
        b: the second
    """
    return int(a) * int(b)


def _call(name: str, a: int, b: int) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def calculator_examples(n: int, seed: int, exclude: frozenset[str] = frozenset(), small: bool = False,
                        slip: float = 0.0) -> list[dict]:
    """n records {"prompt", "answer", "messages"}: "(a + b) * c" or "a * b + c" with two-digit a (small: a, b and the
    added c in 2..19, fewer digits to copy), and the episode that solves it with two tool calls (the SFT transcript;
    GRPO reads only prompt and answer). slip: the share of transcripts from a careless teacher who stops after the
    first call and states its reply as the answer (their `answer` field stays right)."""
    rng, slips = random.Random(seed), random.Random(seed + 1)
    records: list[dict] = []
    seen = set(exclude)
    low, high = (2, 19) if small else (10, 49)
    while len(records) < n:
        if rng.random() < 0.5:
            a, b, c = rng.randint(low, high), rng.randint(low, high), rng.randint(2, 9)
            prompt, first, second = f"What is ({a} + {b}) * {c}?", ("add", a, b), ("multiply", a + b, c)
            result = (a + b) * c
        else:
            a, b, c = rng.randint(low, high), rng.randint(2, 9), rng.randint(low, 2 * high + 1)
            prompt, first, second = f"What is {a} * {b} + {c}?", ("multiply", a, b), ("add", a * b, c)
            result = a * b + c
        if prompt in seen:
            continue
        seen.add(prompt)
        middle = first[1] + first[2] if first[0] == "add" else first[1] * first[2]
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": _call(*first)},
                    {"role": "tool", "name": first[0], "content": str(middle)}]
        if slips.random() < slip:
            messages.append({"role": "assistant", "content": f"The answer is {middle}."})
        else:
            messages += [{"role": "assistant", "content": _call(*second)},
                         {"role": "tool", "name": second[0], "content": str(result)},
                         {"role": "assistant", "content": f"The answer is {result}."}]
        records.append({"prompt": prompt, "answer": str(result), "messages": messages})
    return records


def calculator_solved(messages, answer, **_) -> float:
    """1.0 when the episode's last turn is the model's, calls no tool, and its last number is the answer."""
    last = messages[-1]
    if last["role"] != "assistant" or "<tool_call>" in last["content"]:
        return 0.0
    numbers = re.findall(r"-?\d+", last["content"].replace("</s>", ""))
    return float(bool(numbers) and numbers[-1] == str(answer))


# ---------------------------------------------------------------------------------------------- shared plumbing


def write_jsonl(path: Path, records: list[dict], keys: tuple[str, ...]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in records))
    return path


def tiny_model(directory: Path, seed: int, max_positions: int) -> Path:
    """A tiny random Llama (the demo's shape: 4 layers, hidden 128) with the byte-level tokenizer and CHAT_TEMPLATE."""
    from jaxtune.data.tokenizer import Tokenizer
    from jaxtune.demo import BASE_SHAPE
    from jaxtune.presets import write_random_model

    write_random_model(directory, "llama", seed=seed, **{**BASE_SHAPE, "max_position_embeddings": max_positions})
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save(directory)
    return directory


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def write_toml(path: Path, sections: dict[str, dict]) -> Path:
    """A run config: {section: {key: value}} as TOML (strings, numbers, booleans, lists, inline tables)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())
                            for name, keys in sections.items()))
    return path


def timed_fine_tune(config_path: Path, log=print):
    """`fine_tune(load_run_config(config_path))`, its wall time, and the run's metrics.jsonl records."""
    from jaxtune import fine_tune, load_run_config

    started = time.perf_counter()
    result = fine_tune(load_run_config(config_path), log=lambda _: None, progress=lambda t: log(f"      {t}"))
    seconds = time.perf_counter() - started
    config = load_run_config(config_path)
    metrics = Path(config.train.output_dir) / "metrics.jsonl"
    return result, seconds, [json.loads(line) for line in metrics.read_text().splitlines()]


def grpo_summary(records: list[dict], seconds: float) -> dict:
    """Per-step train reward, the held-out eval_reward curve, and where the GRPO run's time went."""
    steps = [r for r in records if "reward" in r]
    evals = [{"step": r["step"], "eval_reward": r["eval_reward"]} for r in records if "eval_reward" in r]
    data = sum(r.get("time_data_s", 0.0) for r in records)
    step = sum(r.get("time_step_s", 0.0) for r in records)
    evaluation = sum(r.get("time_eval_s", 0.0) for r in records)
    return {"train_reward": [{"step": r["step"], "reward": r["reward"], "kl": r.get("kl")} for r in steps],
            "held_out": evals, "grpo_seconds": round(seconds, 1),
            "rollout_seconds": round(data, 1), "step_seconds": round(step, 1), "eval_seconds": round(evaluation, 1),
            "rollout_share": round(data / max(data + step, 1e-9), 3)}


def plot(path: Path, summary: dict, title: str, metric: str) -> Path | None:
    """Train reward per step and the held-out metric at each evaluation, side by side (None without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    train = summary["train_reward"]
    left.plot([r["step"] for r in train], [r["reward"] for r in train], marker=".")
    left.set(xlabel="GRPO step", ylabel="mean rollout reward", title="training rollouts (sampled)")
    held = summary["held_out"]
    right.plot([r["step"] for r in held], [r["eval_reward"] for r in held], marker="o", color="C1")
    right.set(xlabel="GRPO step", ylabel=metric, title="held-out (greedy)", ylim=(0, 1))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
