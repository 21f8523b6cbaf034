"""The GRPO examples' tasks (experiments/grpo_tasks.py): the generated data is seeded and its worked answers check out
under the rewards the runs use; the calculator's chat template trains on the assistant turns only, each ended by
EOS; a sampled episode renders back as the ids sampled. The runs themselves: experiments/README.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import grpo_tasks as tasks  # noqa: E402

from jaxtune.data.formats import chat_example  # noqa: E402
from jaxtune.data.tokenizer import Tokenizer  # noqa: E402
from jaxtune.environments import ToolEnvironment  # noqa: E402
from jaxtune.environments.episode import EpisodeTokens  # noqa: E402


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = tasks.CHAT_TEMPLATE
    return tokenizer


def test_arithmetic_chains_are_seeded_distinct_and_verified():
    held_out = tasks.arithmetic_examples(50, seed=1)
    assert held_out == tasks.arithmetic_examples(50, seed=1)
    train = tasks.arithmetic_examples(200, seed=2, exclude=frozenset(r["prompt"] for r in held_out))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for record in held_out + train:
        assert eval(record["prompt"][3:-3]) == int(record["answer"])  # the expression as Python reads it
        assert 0 <= min(int(line.split("=")[1]) for line in record["completion"].splitlines()[:-1])
    completions = [r["completion"] for r in held_out[:3]]
    answers = [r["answer"] for r in held_out[:3]]
    assert tasks.arithmetic_reward(None, completions, answers) == [1.0, 1.0, 1.0]
    assert tasks.arithmetic_reward(None, [" 1+2=3", "answer: 7\nanswer: 3"], ["3", "3"]) == [0.0, 1.0]


def test_calculator_transcripts_train_the_assistant_turns_and_score_one():
    record = tasks.calculator_examples(1, seed=1)[0]
    tokenizer = _tokenizer()
    example = chat_example(record["messages"], tokenizer, None, where="test")
    trained = tokenizer.decode([i for i, m in zip(example.ids, example.loss_mask) if m], skip_special_tokens=False)
    assert trained.count("</s>") == 3 and trained.endswith(f"The answer is {record['answer']}.</s>")
    assert "tool:" not in trained and "user:" not in trained
    assert tasks.calculator_solved(record["messages"], record["answer"]) == 1.0
    assert tasks.calculator_solved(record["messages"][:-1], record["answer"]) == 0.0


def test_a_careless_calculator_transcript_stops_after_one_call_and_scores_zero():
    records = tasks.calculator_examples(200, seed=4, small=True, slip=0.6)
    careless = [r for r in records if len(r["messages"]) == 4]
    assert 0.5 < len(careless) / len(records) < 0.7 and all(len(r["messages"]) in (4, 6) for r in records)
    assert all(tasks.calculator_solved(r["messages"], r["answer"]) == 0.0 for r in careless)
    assert [r["prompt"] for r in records] == [r["prompt"] for r in tasks.calculator_examples(200, seed=4, small=True)]


def test_a_sampled_calculator_episode_renders_as_sampled():
    """The model's turn ends with EOS, which the template writes itself: the environment's text keeps it, the
    template drops it from the content, and the next prompt starts with the ids that were sampled."""
    record = tasks.calculator_examples(1, seed=3)[0]
    tokenizer = _tokenizer()
    env = ToolEnvironment([tasks.add, tasks.multiply], family="hermes", reward=tasks.calculator_solved, max_turns=4)
    try:
        tokens = EpisodeTokens(env.reset({"prompt": record["prompt"], "answer": record["answer"]}), tokenizer)
        for turn in (record["messages"][1], record["messages"][3], record["messages"][5]):
            ids = tokenizer.encode(turn["content"], add_special_tokens=False) + [tokenizer.eos_id]
            result = env.step(tokenizer.decode(ids, skip_special_tokens=False))
            tokens.add_model_turn(ids, env.messages[-1 - len(result.messages)])
            if result.done:
                break
            assert result.messages[0]["content"] == record["messages"][2 if turn is record["messages"][1] else 4][
                "content"]
            tokens.add_environment_turn(result.messages)
        assert result.done and result.reward == 1.0
        example = tokens.example()
        assert sum(example.loss_mask) == sum(chat_example(record["messages"], tokenizer, None, where="t").loss_mask)
    finally:
        env.close()
