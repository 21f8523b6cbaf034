"""GRPO on multi-turn episodes (`[grpo] environment`): each episode's rows hold every turn, the loss on the tokens the
model sampled and on nothing the environment wrote; the reward is the environment's; the config's environment keys
are checked in one line and round-trip through TOML. Two processes running episodes equal one:
tests/test_rollouts_across_devices.py."""

from dataclasses import replace

import jax
import numpy as np
import pytest
from grpo_environments import TwoTurns
from test_rollouts_across_devices import CHAT_TEMPLATE

from jaxtune.config import tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method
from jaxtune.models.params import init_params
from jaxtune.objectives.episode_rollouts import episode_batch, episode_rollouts
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.run_config import dump_run_config, load_run_config


def test_episode_rows_train_on_the_sampled_ids_only():
    ids = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7]]
    masks = [[0, 0, 1, 1, 0, 1, 1], [0, 1, 1]]
    batch = episode_batch(ids, masks, [0.5, 1.0], np.asarray([-0.5, 0.5]), seq_len=8)
    assert batch["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 10, 0, 0]
    assert batch["labels"][0].tolist() == [6, 7, 8, 9, 10, 11, 0, 0]
    assert batch["loss_mask"][0].tolist() == [0, 1, 1, 0, 1, 1, 0, 0]  # the positions predicting a sampled id
    assert batch["loss_mask"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch["segment_ids"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and batch["positions"][0][5] == 5
    assert batch["rewards"].tolist() == [0.5, 1.0] and batch["advantages"].tolist() == [-0.5, 0.5]
    cut = episode_batch([list(range(3, 20))], [[1] * 17], [0.0], np.zeros(1), seq_len=8)  # longer than a row
    assert cut["labels"][0].tolist() == list(range(4, 12)) and cut["loss_mask"][0].sum() == 8


@pytest.mark.slow
@pytest.mark.full
def test_two_turn_episodes_hold_both_turns_the_prompts_unmasked():
    """A tiny random model's episodes in `TwoTurns`: each row is prompt, turn 1, "Again:", turn 2; the mask is 1 on
    exactly the two sampled turns (6 tokens each: a random model never says EOS), and the reward is the share of odd
    code points in them, as the environment computes it from the text."""
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,), max_position_embeddings=256)
    method = method_config("lora", rank=4, target_modules=("all-linear",))
    params = apply_method(init_params(cfg, jax.random.key(0)), cfg, method, jax.random.key(1))
    section = GRPOConfig(environment="grpo_environments.TwoTurns", environment_options={"turns": 2}, group_size=2,
                         max_new_tokens=6)
    records = [{"prompt": "Write:"}, {"prompt": "Write:"}, {"prompt": "Go:"}, {"prompt": "Go:"}]
    ids, masks, rewards = episode_rollouts(params, cfg, method, records, section, 7, (2,), tokenizer, 129)
    assert len(ids) == 4 and ids[0] != ids[1]  # a group's samples differ
    for row, mask, reward, record in zip(ids, masks, rewards, records):
        assert len(row) == len(mask) and sum(mask) == 12
        runs = np.flatnonzero(np.diff(np.asarray([0, *mask, 0])))  # where the sampled spans start and end
        assert len(runs) == 4, mask
        turns = [tokenizer.decode(row[a:b], skip_special_tokens=False) for a, b in zip(runs[::2], runs[1::2])]
        between = tokenizer.decode(row[runs[1]:runs[2]], skip_special_tokens=False)
        assert between == "\nuser: Again:\nassistant: "
        prompt = tokenizer.decode(row[:runs[0]], skip_special_tokens=False)
        assert prompt == f"user: {record['prompt']}\nassistant: "
        env = TwoTurns()
        env.reset(record)
        env.step(turns[0])
        assert env.step(turns[1]).reward == pytest.approx(reward)


@pytest.mark.slow
@pytest.mark.full
def test_the_paged_engine_runs_episodes_as_the_padded_decode():
    """`rollout_engine = "paged"` with an environment: every turn of every running episode decoded by the engine (the
    episode so far its prompt, three slots for five episodes, so some wait for a slot); greedy (top_k = 1) the same
    episodes, masks and rewards as the padded decode, and no refusal of the pair."""
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,), max_position_embeddings=256)
    params = init_params(cfg, jax.random.key(2))
    padded = GRPOConfig(environment="grpo_environments.TwoTurns", environment_options={"turns": 2}, group_size=2,
                        max_new_tokens=5, top_k=1)
    paged = replace(padded, rollout_engine="paged", rollout_slots=3, rollout_page_size=4)
    records = [{"prompt": p} for p in ("Write:", "Go on and write:", "Go:", "Say it:", "W")]
    expected = episode_rollouts(params, cfg, None, records, padded, 7, (2,), tokenizer, 129)
    assert len({tuple(row) for row in expected[0]}) == 5 and sum(expected[1][0]) == 10
    assert episode_rollouts(params, cfg, None, records, paged, 7, (2,), tokenizer, 129) == expected
    with pytest.raises(JaxtuneError, match="page pool of 2 pages"):  # the engine's own refusal: it ran the turns
        episode_rollouts(params, cfg, None, records, replace(paged, rollout_pages=2), 7, (2,), tokenizer, 129)


def test_environment_keys_are_checked_and_round_trip(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[model]\npath = "m"\n[data]\ntrain = "d.jsonl"\n[train]\nobjective = "grpo"\n[grpo]\n'
                      'environment = "tools"\nenvironment_options = {family = "hermes", tools = ["pkg.add"], '
                      'max_turns = 3, names = {sum = "pkg.add"}}\n')
    loaded = load_run_config(config)
    section = loaded.section("grpo")
    assert dict(section.environment_options)["tools"] == ("pkg.add",)
    (tmp_path / "back.toml").write_text(dump_run_config(loaded))
    assert load_run_config(tmp_path / "back.toml") == loaded
    with pytest.raises(ConfigError, match="soft_punish_cache and mask_truncated_completions apply to one completion"):
        GRPOConfig(environment="tools", soft_punish_cache=4)
    with pytest.raises(ConfigError, match="must be a table of option = value"):
        GRPOConfig(environment="tools", environment_options=("family",))
